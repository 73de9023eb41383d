#!/usr/bin/env bash
# tests/gpu/round24.sh: 4 GPUs. The two-shot flags kernel: GPU tests on 4 and 2 GPUs and on
# one GPU shared by two ranks (the only one visible); bench --lsa flags / twoshot (f32, bf16)
# at 4 and 2 ranks beside NCCL, 8 B to 4 MiB. Logs under $OUT.
source tests/gpu/lib.sh
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
run lsa-4gpu 90 "$lsa" --include-ignored --test-threads=1
run lsa-2gpu 90 env CUDA_VISIBLE_DEVICES=0,1 "$lsa" --include-ignored --test-threads=1
HEAD=12 run lsa-shared 120 env CUDA_VISIBLE_DEVICES=0 "$lsa" --include-ignored --test-threads=1 --nocapture
for gpus in 0,1,2,3 0,1; do for d in float bfloat16; do for k in flags twoshot; do
  bench_rows "$k-$d" $gpus -b 8 -e 4M -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d $d --lsa $k
done; done; done
pack_logs
