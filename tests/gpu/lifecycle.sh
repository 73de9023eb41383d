#!/usr/bin/env bash
# tests/gpu/lifecycle.sh: the shipped kernels' lifecycle (issue 41) on the GPUs visible (one GPU:
# two ranks sharing it as one LSA team): the lifecycle and kernels' tests, the diagnostics and
# fault-tolerance tests, and nccl-candle's GPU tests (tests/gpu/candle.sh, after
# nccl-candle/tools/gpu-bundle), with the bundled NCCL (2.32.3) and the system's 2.28.3 (the
# kernels refused, typed: their tests skip, said). Logs under $OUT.
source tests/gpu/lib.sh
life=$(.gpu/run path tests/gpu_kernel_lifecycle-test)
lsa=$(.gpu/run path tests/gpu_lsa_all_reduce-test)
sys=/lib/x86_64-linux-gnu/libnccl.so.2
HEAD=24 run lifecycle 200 "$life" --include-ignored --test-threads=1 --nocapture
HEAD=12 run lifecycle-nccl228 60 env NCCL_LIBRARY=$sys "$life" --include-ignored --test-threads=1
HEAD=14 run lsa 200 "$lsa" --include-ignored --test-threads=1
run lsa-nccl228 60 env NCCL_LIBRARY=$sys "$lsa" --include-ignored --test-threads=1
HEAD=14 run diagnostics 200 "$(.gpu/run path tests/gpu_diagnostics-test)" --include-ignored --test-threads=1
[[ ${FAULT:-1} == 1 ]] && HEAD=20 run fault 240 "$(.gpu/run path tests/gpu_fault_tolerance-test)" --include-ignored --test-threads=1
if [[ -f .gpu/candle/bin.tar.xz ]]; then
  HEAD=40 run candle 300 tests/gpu/candle.sh
  HEAD=40 run candle-nccl228 120 env NCCL_LIBRARY=$sys tests/gpu/candle.sh
fi
pack_logs
