#!/usr/bin/env bash
# tests/gpu/round8.sh: nccl-candle's GPU tests on the GPUs present, then the rest of the one-GPU
# suite (GPU 0 only) on the packed NCCL and the system 2.28.3. Logs under $OUT.
export OUT RUST_BACKTRACE=1
s=$(date +%s)
timeout -k 5 120 bash tests/gpu/candle.sh > $OUT/candle.log 2>&1; echo "candle rc=$? at $(( $(date +%s) - s )) s"
grep -E "^===|RUNS|SKIPPED|test result|panicked|FAILED|error" $OUT/candle.log | head -30
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
t() { timeout -k 5 "$1" "$(.gpu/run path tests/$2-test)" --include-ignored --test-threads=1 "${@:3}" 2>&1 | grep -vE "^\[20|NCCL INFO"; }
export CUDA_VISIBLE_DEVICES=0
for lib in "$NCCL_LIBRARY" /lib/x86_64-linux-gnu/libnccl.so.2; do
  for b in gpu_vector gpu_windows launch_shape_envs layout library_loading loading mpi_ids nccl-unit nccl_sys-unit params_and_simulation gpu_teardown; do
    [[ $b == *-unit ]] && p=$(.gpu/run path tests/$b) || p=$(.gpu/run path tests/$b-test)
    left=$(( 400 - ($(date +%s) - s) )); (( left < 15 )) && { echo "no time for $b"; break; }
    echo "=== $lib $b"; NCCL_LIBRARY=$lib timeout -k 5 $(( left < 120 ? left : 120 )) $p --include-ignored --test-threads=1 2>&1 | grep -vE "^\[20|NCCL INFO"
  done
done > $OUT/one-gpu-rest.log
echo "one-gpu rest at $(( $(date +%s) - s )) s"; grep -E "^===|no time|test result|panicked|FAILED" $OUT/one-gpu-rest.log
