#!/usr/bin/env bash
# tests/gpu/two_gpus.sh: on a host with 2+ GPUs, one rank per GPU: device_allreduce, the bench with
# --simulate, and the GPU tests of the parity and device-API features. Logs under $OUT.
export OUT
s=$(date +%s)
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
{ nvidia-smi -L; nvidia-smi topo -m; } > $OUT/topo.txt 2>&1
{ timeout 60 .gpu/run examples/device_allreduce; echo "rc=$?"; } > $OUT/device_allreduce-2gpu.log 2>&1; echo "device_allreduce at $(( $(date +%s) - s )) s"
{ timeout 60 .gpu/run examples/bench --ranks 2 -b 8 -e 256M -f 4 -n 20 -w 5 --simulate; echo "rc=$?"; } > $OUT/bench-simulate-2gpu.log 2>&1; echo "bench at $(( $(date +%s) - s )) s"
for t in gpu_device gpu_parity gpu_coll_config gpu_scalable_init; do
  echo "=== $t"; RUST_BACKTRACE=1 timeout 60 "$(.gpu/run path tests/$t-test)" --include-ignored --test-threads=1 --nocapture 2>&1 | grep -vE "^\[20"; echo "--- $t rc=$?"
done > $OUT/tests-2gpu.log 2>&1; echo "tests at $(( $(date +%s) - s )) s"
head -3 $OUT/topo.txt; grep -E "^==|checked|PASSED|FAILED|rc=" $OUT/device_allreduce-2gpu.log; grep -E "^---|test result|panicked" $OUT/tests-2gpu.log; grep -cE "simulate:" $OUT/bench-simulate-2gpu.log
