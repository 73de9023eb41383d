#!/usr/bin/env bash
# tests/gpu/round10.sh: issue 31's closing runs: candle GPU tests on NCCL 2.32.3 and 2.28.3,
# then tests/gpu/candle-close.runs (round9.sh), bounded to ~560 s in all.
export OUT; s=$(date +%s)
nvidia-smi -L
timeout -k 5 110 env NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 bash tests/gpu/candle.sh > $OUT/candle-tests-nccl228.log 2>&1
echo "candle tests on 2.28.3 rc=$? at $(( $(date +%s) - s )) s"
grep -E "^===|RUNS|SKIPPED|test result|panicked|FAILED" $OUT/candle-tests-nccl228.log | head -20
CANDLE_RUNS=$(cat tests/gpu/candle-close.runs) bash tests/gpu/round9.sh $(( 560 - ($(date +%s) - s) ))
