#!/bin/sh
# Builds the CUPTI injection library: build.sh CUPTI_DIR CUDA_INCLUDE_DIR OUT_DIR
#   CUPTI_DIR         holds include/cupti.h and lib/libcupti.so.13 (e.g. PyPI nvidia-cuda-cupti
#                     13.0.*: site-packages/nvidia/cu13, or /usr/local/cuda/extras/CUPTI)
#   CUDA_INCLUDE_DIR  holds cuda.h (e.g. /usr/local/cuda/include)
#   OUT_DIR           gets libkernel_profile.so and, beside it, libcupti.so.13 (found through
#                     the library's $ORIGIN rpath: no LD_LIBRARY_PATH needed)
set -eu
if [ $# -ne 3 ]; then
    echo "usage: $0 CUPTI_DIR CUDA_INCLUDE_DIR OUT_DIR" >&2
    exit 2
fi
cupti=$1 cuda_inc=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
# CUPTI_DIR/lib or, as in the toolkit's extras/CUPTI, lib64
lib=$cupti/lib
[ -e "$lib/libcupti.so.13" ] || lib=$cupti/lib64
set -x
gcc -shared -fPIC -O2 -g -Wall -Wextra -fvisibility=hidden \
    -I "$cupti/include" -I "$cuda_inc" \
    -o "$out/libkernel_profile.so" "$here/kernel_profile.c" \
    -L "$lib" -l:libcupti.so.13 -lpthread -ldl -Wl,-rpath,'$ORIGIN' -Wl,--disable-new-dtags -Wl,--no-undefined
cp -L "$lib/libcupti.so.13" "$out/"
