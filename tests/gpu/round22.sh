#!/usr/bin/env bash
# tests/gpu/round22.sh (run as round 23): the shipped kernels' tests with two ranks sharing GPU 0 alone, with
# CUDA_DEVICE_MAX_CONNECTIONS=32 (are the timeouts of round18/20 two ranks' streams sharing one
# of the default 8 hardware queues?); then tests/gpu/candle-4gpu-e.runs. Logs under $OUT.
export OUT; s=$(date +%s)
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
echo "=== lsa-one-gpu, CUDA_DEVICE_MAX_CONNECTIONS=32"
timeout -k 5 75 env CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_MAX_CONNECTIONS=32 $lsa --include-ignored --test-threads=1 > $OUT/lsa-one-gpu.log 2>&1; echo "rc=$? in $(( $(date +%s) - s )) s"
grep -E "^test .*(ok|FAILED)$|test result|panicked|gave up" $OUT/lsa-one-gpu.log | head -12
CANDLE_TESTS=0 CANDLE_RUNS=$(cat tests/gpu/candle-4gpu-e.runs) TAIL=6 bash tests/gpu/round9.sh $(( ${BUDGET:-200} - ($(date +%s) - s) ))
( cd $OUT && for f in *.log; do echo "##### $f"; grep -v "NCCL INFO" "$f"; done > all-logs.txt && rm -f *.log )
