#!/usr/bin/env bash
# tests/gpu/verify.sh: the one-GPU verification of a tree: the suite on the packed NCCL and the
# system 2.28.3, device_allreduce (shared GPU) and allreduce (3 simulated hosts), then the 8-byte
# overhead against $BASELINE (tests/gpu/bench.sh). Logs under $OUT.
export OUT
: "${BASELINE:?set BASELINE to the bench binary of the tree to compare with}"
s=$(date +%s)
timeout -k 5 300 bash tests/gpu/suite.sh 2.32.3 --skip ending_a_communicator > /dev/null 2>&1; echo "suite 2.32.3 done at $(( $(date +%s) - s )) s"
NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 timeout -k 5 100 bash tests/gpu/suite.sh 2.28.3 --skip ending_a_communicator > /dev/null 2>&1; echo "suite 2.28.3 done at $(( $(date +%s) - s )) s"
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
{ timeout 40 env NCCL_MULTI_RANK_GPU_ENABLE=1 .gpu/run examples/device_allreduce; echo "rc=$?";
  timeout 30 env NCCL_RS_LOCAL_RANKS=3 .gpu/run examples/allreduce; echo "rc=$?"; } > $OUT/examples.log 2>&1
echo "examples done at $(( $(date +%s) - s )) s"
timeout -k 5 $(( 590 - ($(date +%s) - s) )) bash tests/gpu/bench.sh > $OUT/bench-summary.txt 2>&1
echo "bench done at $(( $(date +%s) - s )) s"
grep -hE "suite .* rc=|total:|test binaries" $OUT/suite-*.log
grep -E "PASSED|FAILED|rc=|verified|correct" $OUT/examples.log | head
tail -12 $OUT/bench-summary.txt
