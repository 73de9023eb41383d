#!/usr/bin/env bash
# tests/gpu/round30.sh: 4 GPUs. Per-CTA call counts (no cross-CTA atomics or fences) and the
# row-split fused kernel. EXPERIMENT knobs of that tree only, removed before it landed (NCCL_RS_LSA_CTA_THREADS: the
# flags kernels' CTA size; NCCL_RS_LSA_SPLIT_VECTORS: the fused kernel's vectors a CTA):
# the one-shot at 4 and 2 ranks by CTA size, the epilogue by split target. Logs under $OUT.
source tests/gpu/lib.sh
ep=$(.gpu/run path examples/tp_epilogue)
for cta in 512 256 128 64; do
  NCCL_RS_LSA_CTA_THREADS=$cta bench_rows "flags-float-cta$cta" 0,1,2,3 -b 8 -e 128K -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d float --lsa flags
done
for cta in 512 128; do
  NCCL_RS_LSA_CTA_THREADS=$cta bench_rows "flags-bf16-cta$cta" 0,1,2,3 -b 8 -e 128K -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d bfloat16 --lsa flags
  NCCL_RS_LSA_CTA_THREADS=$cta bench_rows "flags-float-cta$cta" 0,1 -b 8 -e 128K -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d float --lsa flags
done
for target in 1024 256 128 64; do for gpus in 0,1,2,3 0,1; do
  echo "=== tp_epilogue split target $target, GPUs $gpus"
  NCCL_RS_LSA_SPLIT_VECTORS=$target CUDA_VISIBLE_DEVICES=$gpus timeout -k 5 60 "$ep" --iters 20 --launches 20 > "$OUT/ep-$target-$gpus.log" 2>&1; echo "rc=$?"
  grep -E "^\|" "$OUT/ep-$target-$gpus.log" | grep -v -- "---"
done; done
pack_logs
