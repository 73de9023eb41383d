#!/bin/sh
# On a GPU host: builds libkernel_profile.so and graph_smoke.cu, then runs graph_smoke under the
# profiler, which prints its report on stderr. README.md says what the report should show.
#   smoke.sh [OUT_DIR]     (default /tmp/kernel-profile; CUPTI_DIR, CUDA_HOME override the search)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-/tmp/kernel-profile}
cuda=${CUDA_HOME:-/usr/local/cuda}
cupti=${CUPTI_DIR:-}
if [ -z "$cupti" ]; then
    # the toolkit's CUPTI, else PyPI's nvidia-cuda-cupti (site-packages/nvidia/cu13)
    pip_dirs=$(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13") for p in nvidia.__path__))' 2>/dev/null || true)
    for d in "$cuda/extras/CUPTI" $pip_dirs; do
        if [ -e "$d/lib64/libcupti.so.13" ] || [ -e "$d/lib/libcupti.so.13" ]; then cupti=$d; break; fi
    done
fi
[ -n "$cupti" ] || { echo "smoke.sh: no libcupti.so.13 found: set CUPTI_DIR" >&2; exit 1; }
"$here/build.sh" "$cupti" "$cuda/include" "$out"
PATH=$cuda/bin:$PATH nvcc -O2 -arch=sm_90 -L "$cuda/lib64" -L "$cuda/lib" -o "$out/graph_smoke" "$here/graph_smoke.cu"
env -u KERNEL_PROFILE_OUT -u KERNEL_PROFILE_SKIP_REPLAYS \
    CUDA_INJECTION64_PATH="$out/libkernel_profile.so" "$out/graph_smoke"
