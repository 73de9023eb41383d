#!/usr/bin/env bash
# tests/gpu/round2.sh: issue 30's GPU checks on a multi-GPU host with the packed NCCL: the J2 destroy
# case alone with NCCL's warnings, then the binaries the fixes touched. Logs under $OUT.
export OUT RUST_BACKTRACE=1
s=$(date +%s)
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
t() { "$(.gpu/run path tests/$1-test)" --include-ignored --test-threads=1 "${@:2}"; }
{ NCCL_DEBUG=WARN timeout -k 5 90 "$(.gpu/run path tests/gpu_hardening-test)" --include-ignored --exact destroy_refuses_while_a_kernel_runs_on_a_side_stream --nocapture; echo "--- rc=$?"; } > $OUT/destroy.log 2>&1
echo "destroy at $(( $(date +%s) - s )) s"; tail -5 $OUT/destroy.log
for b in gpu_hardening gpu_device gpu_parity gpu_scalable_init gpu_windows; do
  echo "=== $b"; timeout -k 5 150 "$(.gpu/run path tests/$b-test)" --include-ignored --test-threads=1 --skip destroy_refuses 2>&1 | grep -vE "^\[20|NCCL INFO"; echo "--- $b rc=$?"
done > $OUT/round2.log 2>&1
echo "binaries at $(( $(date +%s) - s )) s"
grep -E "^===|^---|test result|panicked|FAILED|SKIPPED" $OUT/round2.log
