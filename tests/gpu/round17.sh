#!/usr/bin/env bash
# tests/gpu/round17.sh: one GPU again: gpu_lsa_all_reduce (two ranks sharing the GPU) after
# the creation test's barriers, and gpu_diagnostics over simulated hosts on NCCL 2.28.3 with
# RAS's raw text report printed. Logs under $OUT.
export OUT; s=$(date +%s)
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
run() { local label=$1 limit=$2; shift 2; echo "=== $label"; t0=$(date +%s)
  timeout -k 5 $limit "$@" > $OUT/$label.log 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "^test .*(ok|FAILED)$|SKIPPED|NOTE|test result|panicked" $OUT/$label.log | grep -v "^\[child" | head -${HEAD:-16}; }
run lsa-one-gpu 60 $(.gpu/run path tests/gpu_lsa_all_reduce-test) --include-ignored --test-threads=1
run diag-hosts-2.28.3 60 env NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 $(.gpu/run path tests/gpu_diagnostics-test) --include-ignored --test-threads=1 a_rank_that_skips
awk '/RAS_RAW_REPORT_BEGIN/{p=1;n++} p&&n==1{print} /RAS_RAW_REPORT_END/{p=0}' $OUT/diag-hosts-2.28.3.log | head -40
echo "total $(( $(date +%s) - s )) s"
