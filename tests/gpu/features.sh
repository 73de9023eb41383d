#!/usr/bin/env bash
# tests/gpu/features.sh LABEL [NCCL_LIBRARY]: the GPU checks of the 2.32 parity and device-API
# features, each step bounded, logged to ${OUT:-/tmp}/features-LABEL.log. Run from the repository
# root on a GPU host after tests/gpu/bundle (and tests/gpu/nccl VERSION); a second argument
# picks another library (e.g. the system NCCL) over the packed one.
label=$1
[[ -n ${2:-} ]] && export NCCL_LIBRARY=$2
log=${OUT:-/tmp}/features-$label.log
: > "$log"
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
step() { # seconds, label, command...
  local limit=$1 name=$2; shift 2
  echo "=== $name" >> "$log"
  local start=$(date +%s)
  timeout -k 5 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "--- $name rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$log"
}
t() { .gpu/run path "tests/$1"; }
{ date; nvidia-smi -L; echo "NCCL_LIBRARY=${NCCL_LIBRARY:-}"; command -v nvcc || ls /usr/local/cuda/bin/nvcc; } >> "$log" 2>&1
step 150 device_allreduce env NCCL_MULTI_RANK_GPU_ENABLE=1 .gpu/run examples/device_allreduce
step 150 gpu_device "$(t gpu_device-test)" --include-ignored --test-threads=1 --nocapture
step 120 gpu_parity "$(t gpu_parity-test)" --include-ignored --test-threads=1 --nocapture
step 120 gpu_parity_hosts env NCCL_RS_GPU_SHAPE=hosts "$(t gpu_parity-test)" --include-ignored --test-threads=1 --nocapture
step 60 params_and_simulation "$(t params_and_simulation-test)" --include-ignored --test-threads=1 --nocapture
step 150 gpu_scalable_init "$(t gpu_scalable_init-test)" --include-ignored --test-threads=1 --nocapture
step 90 bench_simulate env NCCL_RS_GPU_SHARING=hosts .gpu/run examples/bench --ranks 2 -b 8 -e 64M -f 8 -n 20 -w 5 --simulate
grep -E "^---|PASSED|FAILED|SKIPPED|panicked|test result|LSA team|checked|MEMSTATS|ESTIMATE|ENC_|SCALABLE_OK|FROM_ENV_OK|DONE|simulate:|refused before|toolchain|error" "$log" | cut -c1-300 | head -150
