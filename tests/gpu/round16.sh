#!/usr/bin/env bash
# tests/gpu/round16.sh: one GPU: gpu_diagnostics in its one-GPU shape (three simulated hosts),
# NCCL 2.32.3 and 2.28.3; gpu_lsa_all_reduce (two ranks sharing the GPU). Logs under $OUT.
export OUT; s=$(date +%s)
nvidia-smi -L
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
run() { local label=$1 limit=$2; shift 2; echo "=== $label"; t0=$(date +%s)
  timeout -k 5 $limit "$@" > $OUT/$label.log 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "^test .*(ok|FAILED)$|RUNS|SKIPPED|NOTE|test result|panicked|SKIPPED collective|STALLED|MISMATCH" $OUT/$label.log | grep -v "^\[child" | head -${HEAD:-16}; }
diag=$(.gpu/run path tests/gpu_diagnostics-test); lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
run diag-hosts-2.32.3 150 $diag --include-ignored --test-threads=1
run diag-hosts-2.28.3 150 env NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 $diag --include-ignored --test-threads=1
run lsa-one-gpu 100 $lsa --include-ignored --test-threads=1
echo "total $(( $(date +%s) - s )) s"
