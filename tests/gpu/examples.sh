#!/usr/bin/env bash
# tests/gpu/examples.sh LABEL: the examples and the bench on one GPU, logged to ${OUT:-/tmp}/examples-LABEL.log
# Run from the repository root on a GPU host, after tests/gpu/bundle (and tests/gpu/nccl
# VERSION) here and with the tree carried there (.gpu included). Logs go to $OUT (default /tmp).
label=$1
log=${OUT:-/tmp}/examples-$label.log
: > "$log"
ex() { # name, env..., -- args
  local name=$1; shift
  echo "=== $* examples/$name" >> "$log"
  local start=$(date +%s)
  timeout 120 env "$@" .gpu/run examples/$name >> "$log" 2>&1
  echo "--- rc=$? in $(( $(date +%s) - start )) s" >> "$log"
}
ex allreduce NCCL_RS_LOCAL_RANKS=3
ex ring NCCL_RS_LOCAL_RANKS=3
ex split NCCL_RS_LOCAL_RANKS=4
ex moe_dispatch NCCL_RS_LOCAL_RANKS=3
ex data_parallel NCCL_RS_LOCAL_RANKS=2
ex windows NCCL_RS_LOCAL_RANKS=2
ex windows NCCL_RS_LOCAL_RANKS=2 NCCL_MULTI_RANK_GPU_ENABLE=1
echo "=== bench simulated hosts" >> "$log"
timeout 120 .gpu/run examples/bench --ranks 2 -b 8 -e 4M -f 8 -n 20 -w 5 >> "$log" 2>&1; echo "--- rc=$?" >> "$log"
echo "=== bench shared gpu" >> "$log"
NCCL_MULTI_RANK_GPU_ENABLE=1 timeout 120 .gpu/run examples/bench --ranks 2 -b 8 -e 4M -f 8 -n 20 -w 5 >> "$log" 2>&1; echo "--- rc=$?" >> "$log"
grep -E "^===|^---|verified|correct|error|Error|panicked|busbw|nccl-rs:|came home|identical|FAIL|wrong" "$log" | head -80
