#!/usr/bin/env bash
# tests/gpu/round26.sh: 4 GPUs. The all-gather kernel: GPU tests of the shipped kernels on 4 and
# 2 GPUs and on one shared GPU (NCCL 2.32.3), and the refusal on the system's NCCL 2.28.3;
# bench --lsa auto at 4 ranks (the new dispatch table). Logs under $OUT.
source tests/gpu/lib.sh
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
run lsa-4gpu 120 "$lsa" --include-ignored --test-threads=1
run lsa-2gpu 120 env CUDA_VISIBLE_DEVICES=0,1 "$lsa" --include-ignored --test-threads=1
HEAD=12 run lsa-shared 150 env CUDA_VISIBLE_DEVICES=0 "$lsa" --include-ignored --test-threads=1 --nocapture
run lsa-nccl228 60 env NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 "$lsa" --include-ignored --test-threads=1
bench_rows auto-float 0,1,2,3 -b 8 -e 8M -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d float --lsa auto
pack_logs
