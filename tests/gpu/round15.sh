#!/usr/bin/env bash
# tests/gpu/round15.sh: nccl-candle's LsaCollectives: gpu_tp (with the shipped-kernel sums),
# then tests/gpu/candle-lsa.runs (llama_tp with and without --lsa). Logs under $OUT.
export OUT; s=$(date +%s)
timeout -k 5 60 bash tests/gpu/candle.sh gpu_tp --include-ignored --test-threads=1 > $OUT/gpu_tp.log 2>&1; echo "gpu_tp rc=$?"
grep -E "RUNS|SKIPPED|test result|panicked" $OUT/gpu_tp.log | head
CANDLE_TESTS=0 CANDLE_RUNS=$(cat tests/gpu/candle-lsa.runs) TAIL=8 bash tests/gpu/round9.sh $(( 500 - ($(date +%s) - s) ))
