#!/usr/bin/env bash
# tests/gpu/candle.sh [NAME args...]: runs nccl-candle binaries carried in .gpu/candle/bin.tar.xz
# (built on a machine without CUDA against stub libraries) with the host's CUDA 13.0 libraries and
# .gpu/run's NCCL settings. Without arguments: the GPU tests (`gpu`, `gpu_*`), each in turn, in
# the shapes of nccl-rs's GPU suite (one GPU per rank where 2+ are visible, else two ranks
# sharing GPU 0, NCCL 2.30+; NCCL_RS_GPU_SHAPE=gpus|shared forces one), then the summary of
# what ran and what was skipped (`gpu_suite_summary`, from the ledger the tests kept).
set -o pipefail
bin=/tmp/nccl-candle-bin; mkdir -p $bin
[[ -f $bin/.unpacked ]] || { tar -C $bin -xJf .gpu/candle/bin.tar.xz && touch $bin/.unpacked; } || exit 1
cuda=$(dirname "$(ls /usr/local/cuda/lib64/libcublas.so.13 /usr/local/cuda/targets/x86_64-linux/lib/libcublas.so.13 2>/dev/null | head -1)")
export LD_LIBRARY_PATH=$cuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
# CANDLE_MPI=N: the binary under Open MPI's mpirun with N ranks, the NCCL settings passed on.
if (( $# )) && [[ -n ${CANDLE_MPI:-} ]]; then
  n=$1; shift
  exec mpirun --allow-run-as-root --bind-to none -np "$CANDLE_MPI" -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE \
    -x NCCL_LIBRARY -x NCCL_HOME -x RUST_BACKTRACE $bin/$n "$@"
fi
if (( $# )); then n=$1; shift; exec $bin/$n "$@"; fi
# This run's ledger, new: every GPU test records there what it did. After the tests, the
# summary binary prints it, run by name in its explicit mode (NCCL_RS_SUITE_SUMMARY): the
# binaries' order does not matter. Removed at the end.
ledger=$(mktemp /tmp/nccl-candle-gpu-suite.XXXXXX) || exit 1
trap 'rm -f "$ledger"' EXIT
summary=$bin/gpu_suite_summary
rc=0
for t in $bin/gpu $bin/gpu_*; do
  [[ -x $t && $t != "$summary" ]] || continue
  echo "=== ${t##*/}"; NCCL_RS_SUITE_LEDGER=$ledger $t --include-ignored --test-threads=1 || rc=1
done
echo "=== ${summary##*/}"
if [[ -x $summary ]]; then NCCL_RS_SUITE_SUMMARY=$ledger $summary --include-ignored --test-threads=1 || rc=1
else echo "no gpu_suite_summary in the bundle: rebuild it with tools/gpu-bundle"; rc=1; fi
exit $rc
