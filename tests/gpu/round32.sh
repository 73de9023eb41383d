#!/usr/bin/env bash
# tests/gpu/round32.sh: 4 GPUs. The flags kernels' CTA policy (128 threads a CTA up to 64
# CTAs, larger past that) and the state read once at a call's start: one- and two-shot at 4
# and 2 ranks beside NCCL (and two-shot/one-shot at 512 threads a CTA, the EXPERIMENT knob of
# that tree, removed before it landed, for the large sizes), the epilogue, then the shipped kernels' GPU tests (4 GPUs,
# 2 GPUs, one shared GPU). Logs under $OUT.
source tests/gpu/lib.sh
for gpus in 0,1,2,3 0,1; do for d in float bfloat16; do
  bench_rows "flags-$d-small" $gpus -b 8 -e 128K -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d $d --lsa flags
done; done
for k in flags twoshot; do
  bench_rows "$k-float-large" 0,1,2,3 -b 256K -e 8M -f 2 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d float --lsa $k
  NCCL_RS_LSA_CTA_THREADS=512 bench_rows "$k-float-large-cta512" 0,1,2,3 -b 256K -e 8M -f 2 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d float --lsa $k
done
bench_rows "flags-float-large" 0,1 -b 256K -e 8M -f 2 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d float --lsa flags
ep=$(.gpu/run path examples/tp_epilogue)
for gpus in 0,1,2,3 0,1; do
  echo "=== tp_epilogue, GPUs $gpus"
  CUDA_VISIBLE_DEVICES=$gpus timeout -k 5 60 "$ep" --iters 20 --launches 20 > "$OUT/ep-$gpus.log" 2>&1; echo "rc=$?"
  grep -E "^\|" "$OUT/ep-$gpus.log" | grep -v -- "---"
done
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
HEAD=12 run lsa-4gpu 120 "$lsa" --include-ignored --test-threads=1
HEAD=12 run lsa-2gpu 120 env CUDA_VISIBLE_DEVICES=0,1 "$lsa" --include-ignored --test-threads=1
HEAD=14 run lsa-shared 150 env CUDA_VISIBLE_DEVICES=0 "$lsa" --include-ignored --test-threads=1
pack_logs
