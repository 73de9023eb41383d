#!/usr/bin/env bash
# tests/gpu/round7.sh: issue 30's final tree in the one-GPU shapes: the suite in the default shape
# (two ranks share the GPU on NCCL 2.30+) on the packed NCCL and on the system 2.28.3, then the
# issue's binaries with every rank its own simulated host on the packed NCCL. Logs under $OUT.
export OUT RUST_BACKTRACE=1
s=$(date +%s)
timeout -k 5 280 bash tests/gpu/suite.sh packed-one-gpu > /dev/null 2>&1
echo "suite packed at $(( $(date +%s) - s )) s"; grep -hE "suite .* rc=|test binaries|total:" $OUT/suite-packed-one-gpu.log
NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 timeout -k 5 120 bash tests/gpu/suite.sh system-one-gpu > /dev/null 2>&1
echo "suite 2.28.3 at $(( $(date +%s) - s )) s"; grep -hE "suite .* rc=|test binaries|total:" $OUT/suite-system-one-gpu.log
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
t() { timeout -k 5 "$1" "$(.gpu/run path tests/$2-test)" --include-ignored --test-threads=1 "${@:3}" 2>&1 | grep -vE "^\[20|NCCL INFO"; }
for b in gpu_hardening gpu_parity gpu_device gpu_windows gpu_fault_tolerance; do
  left=$(( 585 - ($(date +%s) - s) )); (( left < 20 )) && { echo "no time for $b"; break; }
  echo "=== hosts $b"; NCCL_RS_GPU_SHAPE=hosts t $(( left < 90 ? left : 90 )) $b
done > $OUT/hosts.log
echo "hosts at $(( $(date +%s) - s )) s"; grep -E "^===|no time|test result|panicked|FAILED" $OUT/hosts.log
