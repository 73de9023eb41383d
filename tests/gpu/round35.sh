#!/usr/bin/env bash
# tests/gpu/round35.sh: one GPU. The shipped kernels' GPU tests where only one GPU is visible:
# two ranks sharing it, and one rank alone (one_rank_alone_gets_its_own_input_back). Logs
# under $OUT.
source tests/gpu/lib.sh
HEAD=12 run lsa-one-gpu 90 "$(.gpu/run path tests/gpu_lsa_all_reduce-test)" --include-ignored --test-threads=1
pack_logs
