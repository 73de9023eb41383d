#!/usr/bin/env bash
# tests/gpu/round34.sh: 4 GPUs, the session's last device minutes. The shipped kernels' GPU
# tests on 4 and 2 GPUs and one shared GPU (the review's fixes, the Auto table from round 33),
# the LL all-gather beside NCCL's
# (bench all_gather --lsa flags), then tests/gpu/candle-fused.runs (llama_tp decode with
# NCCL, --lsa, --lsa --fused at 4 and 2 ranks), within a budget. Logs under $OUT.
source tests/gpu/lib.sh
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
HEAD=4 run lsa-4gpu 60 "$lsa" --include-ignored --test-threads=1
HEAD=4 run lsa-2gpu 60 env CUDA_VISIBLE_DEVICES=0,1 "$lsa" --include-ignored --test-threads=1
HEAD=4 run lsa-shared 60 env CUDA_VISIBLE_DEVICES=0 "$lsa" --include-ignored --test-threads=1
bench_rows gather-float 0,1,2,3 all_gather -b 64 -e 1M -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d float --lsa flags
TAIL=5 CANDLE_TESTS=0 CANDLE_RUNS=$(cat tests/gpu/candle-fused.runs) bash tests/gpu/round9.sh ${1:-250}
pack_logs
