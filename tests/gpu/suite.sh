#!/usr/bin/env bash
# tests/gpu/suite.sh LABEL [extra test args]: the GPU suite, logged to ${OUT:-/tmp}/suite-LABEL.log
# Run from the repository root on a GPU host, after tests/gpu/bundle (and tests/gpu/nccl
# VERSION) here and with the tree carried there (.gpu included). Logs go to $OUT (default /tmp).
set -o pipefail
label=$1; shift
log=${OUT:-/tmp}/suite-$label.log
{ date; nvidia-smi -L; echo "NCCL_LIBRARY=${NCCL_LIBRARY:-}"; } > "$log" 2>&1
start=$(date +%s)
.gpu/run tests "$@" >> "$log" 2>&1
rc=$?
echo "suite $label rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$log"
grep -E "^=== |test result|SKIPPED|panicked|FAILED|Aborted|GPU suite|ran,|skipped |total:" "$log" | grep -v "^\[.*rank" | tail -60
