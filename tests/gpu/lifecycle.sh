#!/usr/bin/env bash
# tests/gpu/lifecycle.sh: the shipped kernels' lifecycle and the kernels' own tests, on the GPUs
# visible (one GPU: two ranks sharing it as one LSA team), with the bundled NCCL (2.32.3) and the
# system's 2.28.3 (the kernels refused, typed; every test but the stream one skips), then the
# fault-tolerance tests (the abort stop). Logs under $OUT.
source tests/gpu/lib.sh
life=$(.gpu/run path tests/gpu_kernel_lifecycle-test)
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
HEAD=20 run lifecycle 200 "$life" --include-ignored --test-threads=1
HEAD=12 run lifecycle-nccl228 60 env NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 "$life" --include-ignored --test-threads=1
HEAD=14 run lsa 200 "$lsa" --include-ignored --test-threads=1
run lsa-nccl228 60 env NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 "$lsa" --include-ignored --test-threads=1
HEAD=20 run fault 240 "$(.gpu/run path tests/gpu_fault_tolerance-test)" --include-ignored --test-threads=1
pack_logs
