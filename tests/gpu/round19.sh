#!/usr/bin/env bash
# tests/gpu/round19.sh: nccl-candle on 4 GPUs, NCCL 2.32.3: its GPU tests, then
# tests/gpu/candle-4gpu.runs (DDP 1/2/4 scaling, llama_tp's check at 4 ranks). Logs under $OUT.
export OUT; nvidia-smi -L
CANDLE_RUNS=$(cat tests/gpu/candle-4gpu.runs) TAIL=9 bash tests/gpu/round9.sh 545
# One file back (the device returns only a few files per call).
( cd $OUT && for f in *.log; do echo "##### $f"; grep -v "NCCL INFO" "$f"; done > all-logs.txt && rm -f *.log )
