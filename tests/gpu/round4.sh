#!/usr/bin/env bash
# tests/gpu/round4.sh: the J2 destroy case on every GPU, then issue 30's GPU tests in the one-GPU
# shape (GPU 0 only; two ranks share it on NCCL 2.30+). Packed NCCL. Logs under $OUT.
export OUT RUST_BACKTRACE=1
s=$(date +%s)
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
t() { timeout -k 5 "$1" "$(.gpu/run path tests/$2-test)" --include-ignored --test-threads=1 "${@:3}" 2>&1 | grep -vE "^\[20|NCCL INFO"; }
{ t 60 gpu_hardening destroy_refuses --nocapture; } > $OUT/destroy.log
echo "destroy at $(( $(date +%s) - s )) s"; grep -E "ENDED|FREED|BUSY|test result|panicked" $OUT/destroy.log
export CUDA_VISIBLE_DEVICES=0
{ t 100 gpu_hardening side_stream; t 60 gpu_parity simulated_broadcasts; t 90 gpu_device j1_; t 60 gpu_device m5_; } > $OUT/one-gpu.log
echo "one GPU at $(( $(date +%s) - s )) s"; grep -E "RUNS|SKIPPED|test result|panicked" $OUT/one-gpu.log
