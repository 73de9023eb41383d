#!/usr/bin/env bash
# tests/gpu/round33.sh: 4 GPUs. The session's kernels as they land (per-CTA call counts written
# without a load, flags CTAs of 128 threads up to 64, rows of the fused kernel split over
# CTAs, no experiment knobs): the shipped kernels' GPU tests on 4 and 2 GPUs and one shared
# GPU, the refusal on the system's NCCL 2.28.3, the fault-tolerance tests (the abort stop), then
# one-shot and two-shot beside NCCL (f32 and bf16, 4 and 2 ranks, 8 B to 8 MiB) and the
# epilogue at 4 and 2 ranks. Logs under $OUT.
source tests/gpu/lib.sh
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
HEAD=12 run lsa-4gpu 120 "$lsa" --include-ignored --test-threads=1
HEAD=12 run lsa-2gpu 120 env CUDA_VISIBLE_DEVICES=0,1 "$lsa" --include-ignored --test-threads=1
HEAD=14 run lsa-shared 150 env CUDA_VISIBLE_DEVICES=0 "$lsa" --include-ignored --test-threads=1
run lsa-nccl228 60 env NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 "$lsa" --include-ignored --test-threads=1
run fault 200 "$(.gpu/run path tests/gpu_fault_tolerance-test)" --include-ignored --test-threads=1
for gpus in 0,1,2,3 0,1; do for d in float bfloat16; do for k in flags twoshot; do
  bench_rows "$k-$d-small" $gpus -b 8 -e 32K -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d $d --lsa $k
  bench_rows "$k-$d" $gpus -b 64K -e 8M -f 2 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d $d --lsa $k
done; done; done
ep=$(.gpu/run path examples/tp_epilogue)
for gpus in 0,1,2,3 0,1; do
  echo "=== tp_epilogue, GPUs $gpus"
  CUDA_VISIBLE_DEVICES=$gpus timeout -k 5 60 "$ep" --iters 20 --launches 20 > "$OUT/ep-$gpus.log" 2>&1; echo "rc=$?"
  grep -E "^\|" "$OUT/ep-$gpus.log" | grep -v -- "---"
done
pack_logs
