#!/usr/bin/env bash
# tests/gpu/round21.sh: 4 GPUs, final trees. The shipped kernels (batched pulls, chunked fused
# pushes, the creation's last meeting): tests on 4 and on 2 GPUs, bench --lsa flags (f32, bf16)
# and tp_epilogue at 4 and 2 ranks beside NCCL in one call; then tests/gpu/candle-4gpu-c.runs.
# Logs under $OUT.
export OUT; s=$(date +%s)
nvidia-smi -L
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
run() { local label=$1 limit=$2; shift 2; echo "=== $label"; t0=$(date +%s)
  timeout -k 5 $limit "$@" > $OUT/$label.log 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "^test .*FAILED$|SKIPPED|NOTE|test result|panicked|gave up" $OUT/$label.log | grep -v "^\[child" | head -${HEAD:-8}; }
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test); b=$(.gpu/run path examples/bench)
run lsa-4gpu 60 $lsa --include-ignored --test-threads=1
run lsa-2gpu 60 env CUDA_VISIBLE_DEVICES=0,1 $lsa --include-ignored --test-threads=1
for gpus in 0,1,2,3 0,1; do for d in float bfloat16; do
  echo "=== bench --lsa flags -d $d, GPUs $gpus"
  timeout -k 5 40 env CUDA_VISIBLE_DEVICES=$gpus $b -b 8 -e 128K -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d $d --lsa flags > $OUT/bench.log 2>&1; echo "rc=$?"
  grep -E "^ +[0-9]|rror" $OUT/bench.log | cut -c1-100; done
  echo "=== tp_epilogue, GPUs $gpus"
  timeout -k 5 60 env CUDA_VISIBLE_DEVICES=$gpus .gpu/run examples/tp_epilogue > $OUT/tp-epilogue.log 2>&1; echo "rc=$?"
  grep -E "^\||rror|tp_epilogue:" $OUT/tp-epilogue.log; done
rm -f $OUT/bench.log $OUT/tp-epilogue.log
echo "core part: $(( $(date +%s) - s )) s"
CANDLE_TESTS=0 CANDLE_RUNS=$(cat tests/gpu/candle-4gpu-c.runs) TAIL=7 bash tests/gpu/round9.sh $(( ${BUDGET:-560} - ($(date +%s) - s) ))
( cd $OUT && for f in *.log; do echo "##### $f"; grep -v "NCCL INFO" "$f"; done > all-logs.txt && rm -f *.log )
