#!/usr/bin/env bash
# tests/gpu/bench.sh: 8-byte all-reduce, safe/raw per-round ratio, this tree vs $BASELINE's, alternating
# Run from the repository root on a GPU host, after tests/gpu/bundle (and tests/gpu/nccl
# VERSION) here and with the tree carried there (.gpu included). Logs go to $OUT (default /tmp).
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
new=$(.gpu/run path examples/bench); old=${BASELINE:?set BASELINE to the bench binary of the tree to compare with}
log=${OUT:-/tmp}/bench.log; : > "$log"
for round in 1 2 3; do
  for tree in new old; do
    bin=${!tree}
    echo "=== round $round $tree 1 rank" >> "$log"
    timeout 25 $bin --ranks 1 -b 8 -e 8 -n 5000 -w 500 --compare --rounds 11 >> "$log" 2>&1 || echo "--- rc=$?" >> "$log"
  done
done
for round in 1 2; do
  for tree in new old; do
    bin=${!tree}
    echo "=== round $round $tree 2 ranks shared GPU" >> "$log"
    NCCL_MULTI_RANK_GPU_ENABLE=1 timeout 30 $bin --ranks 2 -b 8 -e 8 -n 300 -w 50 --compare --rounds 5 >> "$log" 2>&1 || echo "--- rc=$?" >> "$log"
  done
done
awk '/^=== /{h=$0} /^--- rc/{print h" "$0} /^ +8 /{print h" | "$6" "$7" "$8" | "$12" "$13" "$14} /median of per-round/{print h" | "$0}' "$log"
