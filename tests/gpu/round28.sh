#!/usr/bin/env bash
# tests/gpu/round28.sh: 4 GPUs. An abort stopping the shipped kernels first: the shipped
# kernels' GPU tests on 4 and 2 GPUs and one shared GPU, then the fault-tolerance tests (the
# abort path changed) on 4 GPUs. Logs under $OUT.
source tests/gpu/lib.sh
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
HEAD=12 run lsa-4gpu 120 "$lsa" --include-ignored --test-threads=1 --nocapture
HEAD=12 run lsa-2gpu 120 env CUDA_VISIBLE_DEVICES=0,1 "$lsa" --include-ignored --test-threads=1 --nocapture
HEAD=14 run lsa-shared 150 env CUDA_VISIBLE_DEVICES=0 "$lsa" --include-ignored --test-threads=1 --nocapture
run fault 200 "$(.gpu/run path tests/gpu_fault_tolerance-test)" --include-ignored --test-threads=1
pack_logs
