#!/usr/bin/env bash
# tests/gpu/round6.sh: the final tree of issue 30 on the GPUs present: the whole suite on the packed
# NCCL, then the binaries on the system 2.28.3. Logs under $OUT.
export OUT RUST_BACKTRACE=1
s=$(date +%s)
timeout -k 5 380 bash tests/gpu/suite.sh packed > /dev/null 2>&1
echo "suite (packed NCCL) at $(( $(date +%s) - s )) s"
grep -hE "suite .* rc=|test binaries|ran,|skipped " $OUT/suite-packed.log | tail -5
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
t() { timeout -k 5 "$1" "$(.gpu/run path tests/$2-test)" --include-ignored --test-threads=1 "${@:3}" 2>&1 | grep -vE "^\[20|NCCL INFO"; }
export NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2
for b in gpu_hardening gpu_device gpu_parity gpu_windows gpu_fault_tolerance; do
  left=$(( 585 - ($(date +%s) - s) )); (( left < 20 )) && { echo "no time for $b"; break; }
  echo "=== 2.28.3 $b"; t $(( left < 120 ? left : 120 )) $b
done > $OUT/system.log
echo "2.28.3 at $(( $(date +%s) - s )) s"; grep -E "^===|no time|test result|panicked|SKIPPED" $OUT/system.log
