#!/usr/bin/env bash
# tests/gpu/round18.sh: issues 32 and 33 on 4 GPUs: the shipped kernels' tests (4 GPUs, NCCL
# 2.28.3's refusal), the bench's --lsa flags and NCCL -R 2 (f32, bf16) and nccl-tests'
# all_reduce_perf -R 2 -G 10 at 4 ranks, tp_epilogue at 4 ranks, the diagnostics tests on 4
# GPUs (2.32.3, 2.28.3), then the one-GPU shapes on GPU 0 alone (round17: two ranks sharing it,
# three simulated hosts on 2.28.3 with RAS's raw report). Logs under $OUT.
export OUT; s=$(date +%s)
nvidia-smi -L
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
( mkdir -p /tmp/nt && tar -C /tmp/nt -xJf .gpu/nccl-tests-src.tar.xz && cd /tmp/nt && \
  make -j12 MPI=1 MPI_HOME=/usr/lib/x86_64-linux-gnu/openmpi NCCL_HOME=/usr CUDA_HOME=/usr/local/cuda \
    NVCC_GENCODE=-gencode=arch=compute_90,code=sm_90 > $OUT/nccl-tests-build.log 2>&1; echo "nccl-tests build rc=$?" >> $OUT/nccl-tests-build.log ) &
run() { local label=$1 limit=$2; shift 2; echo "=== $label"; t0=$(date +%s)
  timeout -k 5 $limit "$@" > $OUT/$label.log 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "^test .*(ok|FAILED)$|RUNS|SKIPPED|NOTE|test result|panicked|SKIPPED collective|STALLED|MISMATCH" $OUT/$label.log | grep -v "^\[child" | head -${HEAD:-16}; }
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test); diag=$(.gpu/run path tests/gpu_diagnostics-test)
run lsa-4gpu 120 $lsa --include-ignored --test-threads=1
run lsa-nccl228 40 env NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 $lsa --include-ignored --test-threads=1
b=$(.gpu/run path examples/bench)
echo "=== bench --lsa flags -d float 8 B - 2 MiB, 4 ranks"; timeout -k 5 60 $b -b 8 -e 2M -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d float --lsa flags > $OUT/lsa-float.log 2>&1; echo "rc=$?"
grep -E "^ +[0-9]|^#.*(size|ranks)|rror" $OUT/lsa-float.log | cut -c1-120
echo "=== bench --lsa flags -d bfloat16 8 B - 64 KiB, 4 ranks"; timeout -k 5 45 $b -b 8 -e 64K -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d bfloat16 --lsa flags > $OUT/lsa-bf16.log 2>&1; echo "rc=$?"
grep -E "^ +[0-9]|rror" $OUT/lsa-bf16.log | cut -c1-120
echo "=== tp_epilogue 4 ranks"; timeout -k 5 90 .gpu/run examples/tp_epilogue > $OUT/tp-epilogue.log 2>&1; echo "rc=$?"
grep -E "^\||tp_epilogue|rror" $OUT/tp-epilogue.log
wait; tail -1 $OUT/nccl-tests-build.log
for R in 2 0; do echo "=== all_reduce_perf -R $R -G 10, 4 ranks (NCCL $NCCL_LIBRARY)"
  timeout -k 5 60 mpirun --allow-run-as-root --bind-to none -np 4 -x NCCL_NVLS_ENABLE=0 -x LD_LIBRARY_PATH=$(dirname $NCCL_LIBRARY) \
    /tmp/nt/build/all_reduce_perf -b 8 -e 2M -f 4 -G 10 -n 20 -w 5 -R $R > $OUT/nccl-tests-R$R.log 2>&1; echo "rc=$?"
  grep -E "^ +[0-9]|^# nccl|Avg bus" $OUT/nccl-tests-R$R.log | head -14; done
run diag-4gpu-2.32.3 120 $diag --include-ignored --test-threads=1 --nocapture
run diag-4gpu-2.28.3 120 env NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 $diag --include-ignored --test-threads=1 --nocapture
run lsa-one-gpu 60 env CUDA_VISIBLE_DEVICES=0 $lsa --include-ignored --test-threads=1
run diag-hosts-2.28.3 90 env CUDA_VISIBLE_DEVICES=0 NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 $diag --include-ignored --test-threads=1 a_rank_that_skips
awk '/RAS_RAW_REPORT_BEGIN/{p=1;n++} p&&n==1{print} /RAS_RAW_REPORT_END/{p=0}' $OUT/diag-hosts-2.28.3.log | head -40
echo "total $(( $(date +%s) - s )) s"
