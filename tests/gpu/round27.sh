#!/usr/bin/env bash
# tests/gpu/round27.sh: 4 GPUs. nccl-candle on the new kernels (two-shot, 64 CTAs, Auto table):
# its GPU tests at 4 ranks, then tests/gpu/candle-4gpu-f.runs. Logs under $OUT.
source tests/gpu/lib.sh
TAIL=8 CANDLE_RUNS=$(cat tests/gpu/candle-4gpu-f.runs) bash tests/gpu/round9.sh 330
pack_logs
