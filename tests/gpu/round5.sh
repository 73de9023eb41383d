#!/usr/bin/env bash
# tests/gpu/round5.sh: on one GPU, the review's fixes (gpu_device, shared GPU, packed NCCL), then
# issue 30's tests in the simulated-hosts shape on the packed NCCL and on the system 2.28.3.
export OUT RUST_BACKTRACE=1
s=$(date +%s)
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
t() { timeout -k 5 "$1" "$(.gpu/run path tests/$2-test)" --include-ignored --test-threads=1 "${@:3}" 2>&1 | grep -vE "^\[20|NCCL INFO"; }
{ t 120 gpu_device; } > $OUT/device.log
echo "device at $(( $(date +%s) - s )) s"; grep -E "RUNS|SKIPPED|test result|panicked" $OUT/device.log
for lib in "$NCCL_LIBRARY" /lib/x86_64-linux-gnu/libnccl.so.2; do
  echo "=== $lib"
  NCCL_LIBRARY=$lib NCCL_RS_GPU_SHAPE=hosts t 60 gpu_parity simulated_broadcasts
  NCCL_LIBRARY=$lib NCCL_RS_GPU_SHAPE=hosts t 90 gpu_hardening side_stream
  NCCL_LIBRARY=$lib NCCL_RS_GPU_SHAPE=hosts t 60 gpu_fault_tolerance never_joins
done > $OUT/hosts.log
echo "hosts at $(( $(date +%s) - s )) s"; grep -E "^===|RUNS|SKIPPED|test result|panicked" $OUT/hosts.log
