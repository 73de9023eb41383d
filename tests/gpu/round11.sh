#!/usr/bin/env bash
# tests/gpu/round11.sh: issue 32's first GPU round: the shipped LSA all-reduce kernels' tests
# (2 GPUs, two ranks sharing GPU 0, NCCL 2.28.3's refusal), then the bench's --lsa columns
# beside NCCL (-R 2, CUDA graphs, one process per GPU) and nccl-tests' all_reduce_perf -R 2 -G.
# Logs under $OUT.
export OUT; s=$(date +%s)
nvidia-smi -L
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
# nccl-tests, built in the background from the carried source (.gpu/nccl-tests-src.tar.xz).
( mkdir -p /tmp/nt && tar -C /tmp/nt -xJf .gpu/nccl-tests-src.tar.xz && cd /tmp/nt && \
  make -j16 MPI=1 MPI_HOME=/usr/lib/x86_64-linux-gnu/openmpi NCCL_HOME=/usr CUDA_HOME=/usr/local/cuda \
    NVCC_GENCODE=-gencode=arch=compute_90,code=sm_90 > $OUT/nccl-tests-build.log 2>&1; echo "nccl-tests build rc=$?" >> $OUT/nccl-tests-build.log ) &
t=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
run() { local label=$1 limit=$2; shift 2; echo "=== $label"; t0=$(date +%s)
  timeout -k 5 $limit "$@" > $OUT/$label.log 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "^test |RUNS|SKIPPED|test result|panicked" $OUT/$label.log | head -20; }
run tests-2gpu 150 $t --include-ignored --test-threads=1
run tests-shared 150 env NCCL_RS_GPU_SHAPE=shared $t --include-ignored --test-threads=1
run tests-nccl228 60 env NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 $t --include-ignored --test-threads=1
b=$(.gpu/run path examples/bench)
bench() { local label=$1; shift; echo "=== $label: $*"; timeout -k 5 60 $b "$@" > $OUT/$label.log 2>&1; echo "rc=$?"
  grep -vE "NCCL INFO|^\s*$" $OUT/$label.log | grep -E "^ +[0-9]|^#|rror" | tail -16; }
common=(-b 8 -e 64K -f 2 -G 10 -n 20 -w 5 -R 2 --alloc nccl)
bench lsa-flags-f32 "${common[@]}" -d float --lsa flags
bench lsa-barrier-f32 "${common[@]}" -d float --lsa barrier
bench lsa-flags-bf16 "${common[@]}" -d bf16 --lsa flags
wait
tail -1 $OUT/nccl-tests-build.log
echo "=== all_reduce_perf -R 2 -G 10 (NCCL $NCCL_LIBRARY)"
timeout -k 5 60 mpirun --allow-run-as-root --bind-to none -np 2 -x NCCL_NVLS_ENABLE=0 -x LD_LIBRARY_PATH=$(dirname $NCCL_LIBRARY) \
  /tmp/nt/build/all_reduce_perf -b 8 -e 64K -f 2 -G 10 -n 20 -w 5 -R 2 > $OUT/nccl-tests.log 2>&1; echo "rc=$?"
grep -E "^ +[0-9]|^# nccl|Avg bus" $OUT/nccl-tests.log | head -20
echo "total $(( $(date +%s) - s )) s"
