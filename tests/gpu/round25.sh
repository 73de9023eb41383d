#!/usr/bin/env bash
# tests/gpu/round25.sh: 4 GPUs. The flags kernels on up to 64 CTAs (was 16): GPU tests on 4
# GPUs and on one shared GPU; bench --lsa flags / twoshot (f32, bf16) at 4 and 2 ranks beside
# NCCL, 8 B to 8 MiB by factors of 2 past 32 KiB. Logs under $OUT.
source tests/gpu/lib.sh
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
run lsa-4gpu 90 "$lsa" --include-ignored --test-threads=1
HEAD=12 run lsa-shared 120 env CUDA_VISIBLE_DEVICES=0 "$lsa" --include-ignored --test-threads=1 --nocapture
for gpus in 0,1,2,3 0,1; do for d in float bfloat16; do for k in flags twoshot; do
  bench_rows "$k-$d-small" $gpus -b 8 -e 32K -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d $d --lsa $k
  bench_rows "$k-$d" $gpus -b 64K -e 8M -f 2 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d $d --lsa $k
done; done; done
pack_logs
