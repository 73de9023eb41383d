#!/usr/bin/env bash
# tests/gpu/round20.sh: 4 GPUs. The shipped kernels after the creation's last meeting and the
# fused kernel's chunked pushes (tests on GPU 0 shared by two ranks, then on 4 GPUs), the flags
# kernel's CTA size (512/256/128 threads) and the fused kernel's pushers (a CTA per 512/128/64
# vectors) measured at 4 ranks beside NCCL; then tests/gpu/candle-4gpu-b.runs. Logs under $OUT.
export OUT; s=$(date +%s)
nvidia-smi -L
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
run() { local label=$1 limit=$2; shift 2; echo "=== $label"; t0=$(date +%s)
  timeout -k 5 $limit "$@" > $OUT/$label.log 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "^test .*(ok|FAILED)$|SKIPPED|NOTE|test result|panicked|gave up" $OUT/$label.log | grep -v "^\[child" | head -${HEAD:-16}; }
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
run lsa-one-gpu 70 env CUDA_VISIBLE_DEVICES=0 $lsa --include-ignored --test-threads=1
run lsa-4gpu 60 $lsa --include-ignored --test-threads=1
b=$(.gpu/run path examples/bench)
for spec in "float 512" "float 256" "float 128" "bfloat16 512" "bfloat16 128"; do set -- $spec
  echo "=== bench --lsa flags -d $1, CTA $2 threads, 4 ranks"
  timeout -k 5 40 env NCCL_RS_LSA_CTA_THREADS=$2 $b -b 8 -e 128K -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d $1 --lsa flags > $OUT/bench.log 2>&1; echo "rc=$?"
  grep -E "^ +[0-9]|rror" $OUT/bench.log | cut -c1-100; done
for p in 512 128 64; do echo "=== tp_epilogue 4 ranks, a pushing CTA per $p vectors"
  timeout -k 5 60 env NCCL_RS_LSA_PUSH_VECTORS=$p .gpu/run examples/tp_epilogue > $OUT/tp-epilogue.log 2>&1; echo "rc=$?"
  grep -E "^\| [0-9]|rror" $OUT/tp-epilogue.log; done
rm -f $OUT/bench.log $OUT/tp-epilogue.log
echo "core part: $(( $(date +%s) - s )) s"
CANDLE_TESTS=0 CANDLE_RUNS=$(cat tests/gpu/candle-4gpu-b.runs) TAIL=7 bash tests/gpu/round9.sh $(( 570 - ($(date +%s) - s) ))
( cd $OUT && for f in *.log; do echo "##### $f"; grep -v "NCCL INFO" "$f"; done > all-logs.txt && rm -f *.log )
