#!/usr/bin/env bash
# Regenerates the shipped kernels from every NAME.cu beside this script, as nccl-sys's bindings
# are: run by hand, the outputs checked in, so that building the crate needs neither CUDA nor
# nvcc.
#   NCCL_INCLUDE=/path/to/nccl-2.29.2/include NVCC=/path/to/nvcc src/device/shipped/generate.sh [NAME...]
# (NAMEs: only those sources, e.g. `moe`; the PTX of an unchanged source would differ in the
# compiler's internal name hashes.)
# The headers must be NCCL 2.29.2's (the ABI `mod.rs` records: the oldest versioned device
# communicator, whose LSA layout every later library keeps); nvcc 13.0 (PTX ISA 9.0, which
# driver 580 and later load). Outputs, per NAME.cu: NAME.sm_90.cubin (loaded as is on Hopper),
# NAME.compute_80.ptx (JIT-compiled by the driver on any other GPU from Ampere on) and
# NAME.toolchain (the nvcc that built them).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${NCCL_INCLUDE:?the include/ of NCCL 2.29.2 (pip download nvidia-nccl-cu13==2.29.2)}"
nvcc=${NVCC:-nvcc}
grep -q '#define NCCL_PATCH 2$' "$NCCL_INCLUDE/nccl.h" && grep -q '#define NCCL_MINOR 29$' "$NCCL_INCLUDE/nccl.h" \
  || { echo "generate.sh: $NCCL_INCLUDE is not NCCL 2.29.2" >&2; exit 1; }
shopt -s nullglob
sources=("$here"/*.cu)
if [ $# -gt 0 ]; then sources=(); for n in "$@"; do sources+=("$here/$n.cu"); done; fi
[ ${#sources[@]} -gt 0 ] || { echo "generate.sh: no .cu file in $here" >&2; exit 1; }
flags=(-std=c++17 -O3 -I"$NCCL_INCLUDE" -Xptxas=-warn-spills)
for source in "${sources[@]}"; do
  name=${source%.cu}
  "$nvcc" "${flags[@]}" -cubin -arch=sm_90 -o "$name.sm_90.cubin" "$source"
  "$nvcc" "${flags[@]}" -ptx -arch=compute_80 -o "$name.compute_80.ptx" "$source"
  "$nvcc" --version | tail -2 > "$name.toolchain"
  ls -l "$name.sm_90.cubin" "$name.compute_80.ptx"
done
