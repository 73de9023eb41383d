#!/usr/bin/env bash
# tests/gpu/round12.sh: issues 32 and 33 on 2 GPUs: the shipped kernels' tests (2 GPUs and
# two ranks sharing GPU 0), the fused epilogue timed (tp_epilogue), --lsa flags up to 4 MiB,
# the diagnostics tests (NCCL 2.32.3 and 2.28.3), and the flight recorder's 8-byte cost
# (bench --compare, recorder on and off, alternating). Logs under $OUT.
export OUT; s=$(date +%s)
nvidia-smi -L | head -4
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
run() { local label=$1 limit=$2; shift 2; echo "=== $label"; t0=$(date +%s)
  timeout -k 5 $limit "$@" > $OUT/$label.log 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "^test .*(ok|FAILED)$|SKIPPED|NOTE|test result|panicked" $OUT/$label.log | head -${HEAD:-16}; }
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test); diag=$(.gpu/run path tests/gpu_diagnostics-test)
run lsa-2gpu 120 $lsa --include-ignored --test-threads=1
run lsa-shared 150 env NCCL_RS_GPU_SHAPE=shared $lsa --include-ignored --test-threads=1
echo "=== tp_epilogue 2 ranks"; timeout -k 5 90 .gpu/run examples/tp_epilogue > $OUT/tp-epilogue.log 2>&1; echo "rc=$?"
grep -E "^\||tp_epilogue" $OUT/tp-epilogue.log
b=$(.gpu/run path examples/bench)
echo "=== bench --lsa flags f32 8 B - 4 MiB"; timeout -k 5 60 $b -b 8 -e 4M -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d float --lsa flags > $OUT/lsa-large.log 2>&1; echo "rc=$?"
grep -E "^ +[0-9]" $OUT/lsa-large.log
echo "=== bench --lsa flags f16 8 B - 64 KiB"; timeout -k 5 60 $b -b 8 -e 64K -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d half --lsa flags > $OUT/lsa-f16.log 2>&1; echo "rc=$?"
grep -E "^ +[0-9]" $OUT/lsa-f16.log
run diag-2gpu 120 $diag --include-ignored --test-threads=1 --nocapture
run diag-nccl228 120 env NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 $diag --include-ignored --test-threads=1 --nocapture
for round in 1 2; do for fr in on off; do
  echo "=== 8 B safe/raw, recorder $fr, round $round"
  v=; [[ $fr == off ]] && v="NCCL_RS_FLIGHT_RECORDER=0"
  timeout -k 5 40 env $v $b -b 8 -e 8 -n 3000 -w 300 --compare --rounds 7 > $OUT/fr-$fr-$round.log 2>&1; echo "rc=$?"
  grep -E "^ +8 |median" $OUT/fr-$fr-$round.log
done; done
echo "total $(( $(date +%s) - s )) s"
