#!/usr/bin/env bash
# tests/gpu/round14.sh: LsaAllReduce again (tests on 2 GPUs and two ranks sharing GPU 0,
# tp_epilogue, bench --lsa), then the binaries the flight recorder's dispatch hook could
# break (gpu_parity, gpu_fault_tolerance, gpu_hardening) on NCCL 2.32.3. Logs under $OUT.
export OUT; s=$(date +%s)
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
run() { local label=$1 limit=$2; shift 2; echo "=== $label"; t0=$(date +%s)
  timeout -k 5 $limit "$@" > $OUT/$label.log 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "^test .*FAILED$|SKIPPED|test result|panicked" $OUT/$label.log | head -${HEAD:-12}; }
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
run lsa-2gpu 120 $lsa --include-ignored --test-threads=1
run lsa-shared 120 env NCCL_RS_GPU_SHAPE=shared $lsa --include-ignored --test-threads=1
echo "=== tp_epilogue 2 ranks"; timeout -k 5 60 .gpu/run examples/tp_epilogue > $OUT/tp-epilogue.log 2>&1; echo "rc=$?"
grep -E "^\||tp_epilogue" $OUT/tp-epilogue.log
b=$(.gpu/run path examples/bench)
for spec in "float flags" "bfloat16 flags"; do set -- $spec
  echo "=== bench --lsa $2 -d $1"; timeout -k 5 45 $b -b 8 -e 64K -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d $1 --lsa $2 > $OUT/lsa-$1-$2.log 2>&1; echo "rc=$?"
  grep -E "^ +[0-9]|rror" $OUT/lsa-$1-$2.log | cut -c1-100; done
for t in gpu_parity gpu_fault_tolerance gpu_hardening; do
  run $t 110 $(.gpu/run path tests/$t-test) --include-ignored --test-threads=1; done
echo "total $(( $(date +%s) - s )) s"
