#!/usr/bin/env bash
# tests/gpu/round9.sh [BUDGET_S]: nccl-candle on the GPUs present: its GPU tests, then the
# examples named in $CANDLE_RUNS (lines "TIMEOUT LABEL ENV... -- BINARY ARGS"), most important first,
# each bounded and skipped when the budget is spent. Logs under $OUT.
export OUT RUST_BACKTRACE=1
budget=${1:-300}; s=$(date +%s)
left() { echo $(( budget - ($(date +%s) - s) )); }
if [[ ${CANDLE_TESTS:-1} != 0 ]]; then  # CANDLE_TESTS=0: the examples only
  timeout -k 5 100 bash tests/gpu/candle.sh > $OUT/candle-tests.log 2>&1; echo "candle tests rc=$? at $(( $(date +%s) - s )) s"
  grep -E "^===|RUNS|SKIPPED|test result|panicked|FAILED" $OUT/candle-tests.log | head -30
fi
while read -r limit label rest; do
  [[ -z $limit || $limit == \#* ]] && continue
  l=$(left); (( l < 15 )) && { echo "no time for $label"; continue; }
  (( limit > l )) && limit=$l
  echo "=== $label (limit $limit s)"
  t0=$(date +%s)
  eval "timeout -k 5 $limit env $rest" > $OUT/$label.log 2>&1 < /dev/null; rc=$?  # mpirun reads stdin
  echo "rc=$rc in $(( $(date +%s) - t0 )) s"
  grep -vE "^\[20|NCCL INFO|^\s*$" $OUT/$label.log | tail -${TAIL:-14}
done <<< "$CANDLE_RUNS"
