#!/usr/bin/env bash
# tests/gpu/round13.sh: the reviewed LsaAllReduce on 2 GPUs: its tests (2 GPUs, two ranks
# sharing GPU 0, NCCL 2.28.3's refusal), tp_epilogue, bench --lsa flags and barrier (f32,
# bf16; checked), the diagnostics tests on 2.28.3 and 2.32.3. Logs under $OUT.
export OUT; s=$(date +%s)
nvidia-smi -L | head -4
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
run() { local label=$1 limit=$2; shift 2; echo "=== $label"; t0=$(date +%s)
  timeout -k 5 $limit "$@" > $OUT/$label.log 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "^test .*(ok|FAILED)$|SKIPPED|NOTE|test result|panicked" $OUT/$label.log | head -${HEAD:-16}; }
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test); diag=$(.gpu/run path tests/gpu_diagnostics-test)
run lsa-2gpu 150 $lsa --include-ignored --test-threads=1
run lsa-shared 150 env NCCL_RS_GPU_SHAPE=shared $lsa --include-ignored --test-threads=1
run lsa-nccl228 40 env NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 $lsa --include-ignored --test-threads=1
echo "=== tp_epilogue 2 ranks"; timeout -k 5 60 .gpu/run examples/tp_epilogue > $OUT/tp-epilogue.log 2>&1; echo "rc=$?"
grep -E "^\||tp_epilogue" $OUT/tp-epilogue.log
b=$(.gpu/run path examples/bench)
for spec in "float flags 4M" "bfloat16 flags 64K" "float barrier 64K" "half flags 64K"; do set -- $spec
  echo "=== bench --lsa $2 -d $1 8 B - $3"; timeout -k 5 45 $b -b 8 -e $3 -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d $1 --lsa $2 > $OUT/lsa-$1-$2.log 2>&1; echo "rc=$?"
  grep -E "^ +[0-9]|rror" $OUT/lsa-$1-$2.log | cut -c1-120; done
run diag-nccl228 60 env NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 $diag --include-ignored --test-threads=1
run diag-2gpu 60 $diag --include-ignored --test-threads=1
echo "total $(( $(date +%s) - s )) s"
