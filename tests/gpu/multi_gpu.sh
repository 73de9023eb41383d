#!/usr/bin/env bash
# tests/gpu/multi_gpu.sh: the multi-GPU measurements on a host with 2+ GPUs (one process per
# GPU), each step bounded, logs under $OUT (the figures of the READMEs' multi-GPU tables):
#  1. the shipped all-reduce kernels beside NCCL on symmetric windows (-R 2), one-shot and
#     two-shot, f32 and bf16, 8 B to 8 MiB, device time in CUDA graphs, at N and 2 ranks;
#  2. the fused epilogue (tp_epilogue) at N and 2 ranks;
#  3. gpt_ddp large at 1 and N ranks (mpirun; also at the 1-GPU global batch, checked);
#  4. llama_tp large at 1 and N ranks, eager and in CUDA graphs, NCCL and --lsa --fused
#     (the graph runs checked against one GPU);
#  5. the Hugging Face checkpoint qwen3-1b-bf16 (splits over 1, 2, 4, 8) through generate at
#     1, 2 and N ranks, eager and in graphs, checked against one GPU at N;
#  6. ExpertExchange (expert_exchange: dispatch and combine in CUDA graphs beside
#     all_to_all_v) at N and 2 ranks, decode shapes up to DeepEP's (128 tokens a rank, hidden
#     7168, 256 experts, top-8).
# Needs the bundle with nccl-candle's examples (tools/gpu-bundle STUBS llama_tp generate
# gpt_ddp hf_checkpoint) and a PyPI NCCL 2.29.2+ (tests/gpu/nccl 2.32.3) for the shipped kernels.
export OUT
source tests/gpu/lib.sh > /dev/null
ngpu=$(nvidia-smi -L | wc -l)
(( ngpu >= 2 )) || { echo "multi_gpu.sh: $ngpu GPU(s) here, needs 2 or more"; exit 1; }
all=$(seq -s, 0 $((ngpu - 1)))
nvidia-smi topo -m | head -$((ngpu + 2))
for gpus in $all 0,1; do for d in float bfloat16; do for k in flags twoshot; do
  bench_rows "$k-$d-small" $gpus -b 8 -e 32K -f 4 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d $d --lsa $k
  bench_rows "$k-$d" $gpus -b 64K -e 8M -f 2 -G 10 -n 20 -w 5 -R 2 --alloc nccl -d $d --lsa $k
done; done; [[ $all == 0,1 ]] && break; done
ep=$(.gpu/run path examples/tp_epilogue)
for gpus in $all 0,1; do
  echo "=== tp_epilogue, GPUs $gpus"
  CUDA_VISIBLE_DEVICES=$gpus timeout -k 5 60 "$ep" --iters 20 --launches 20 > "$OUT/ep-$gpus.log" 2>&1; echo "rc=$?"
  grep -E "^\|" "$OUT/ep-$gpus.log" | grep -v -- "---"
  [[ $all == 0,1 ]] && break
done
# gpt_ddp: its table row and checks.
d() { local label=$1 limit=$2; shift 2; echo "=== $label"; local t0; t0=$(date +%s); timeout -k 5 "$limit" env "$@" > "$OUT/$label.log" 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s"; grep -vE "NCCL INFO" "$OUT/$label.log" | grep -E "^\| large|PASS|FAIL|rror|panick|checks" | cut -c1-220; }
d ddp-large-1 60 NCCL_RS_LOCAL_RANKS=1 CUDA_VISIBLE_DEVICES=0 bash tests/gpu/candle.sh gpt_ddp --model large --steps 40
d ddp-large-$ngpu 60 CANDLE_MPI=$ngpu bash tests/gpu/candle.sh gpt_ddp --model large --global-batch $((64 * ngpu)) --steps 40 --no-check
d ddp-large-$ngpu-b64 60 CANDLE_MPI=$ngpu bash tests/gpu/candle.sh gpt_ddp --model large --steps 40
# llama_tp and generate: their timing rows and checks (candle.sh sets up CUDA's libraries).
lt() { local label=$1 limit=$2; shift 2; echo "=== $label"; local t0; t0=$(date +%s); timeout -k 5 "$limit" bash tests/gpu/candle.sh "$@" > "$OUT/$label.log" 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s"; grep -vE "NCCL INFO" "$OUT/$label.log" | grep -E "graph of batch 1|check|decode:|FAIL|^ +[0-9]+ \||rror|panick" | cut -c1-200; }
CUDA_VISIBLE_DEVICES=0 lt large-1-eager 70 llama_tp --model large --batch 1,8
CUDA_VISIBLE_DEVICES=0 lt large-1-graph 70 llama_tp --model large --batch 1,8 --graph
export CUDA_VISIBLE_DEVICES=$all
lt large-$ngpu-eager 75 llama_tp --model large --batch 1,8 --no-check
lt large-$ngpu-graph 90 llama_tp --model large --batch 1,8 --graph
lt large-$ngpu-fused-eager 75 llama_tp --model large --batch 1,8 --lsa --fused --no-check
lt large-$ngpu-fused-graph 90 llama_tp --model large --batch 1,8 --lsa --fused --graph
bash tests/gpu/candle.sh hf_checkpoint --preset qwen3-1b-bf16 --out /tmp/ckpts/qwen3-1b > "$OUT/ckpt.log" 2>&1 || echo "checkpoint failed: see ckpt.log"
q=(generate --model-dir /tmp/ckpts/qwen3-1b --prompt "The quick brown fox jumps over the lazy dog" --max-new-tokens 48)
CUDA_VISIBLE_DEVICES=0 lt q1-1-eager 45 "${q[@]}"
CUDA_VISIBLE_DEVICES=0 lt q1-1-graph 45 "${q[@]}" --graph
CUDA_VISIBLE_DEVICES=0,1 lt q1-2-graph 50 "${q[@]}" --graph
lt q1-$ngpu-eager 50 "${q[@]}"
lt q1-$ngpu-graph-check 60 "${q[@]}" --graph --check
lt q1-$ngpu-fused-graph-check 60 "${q[@]}" --lsa --fused --graph --check
ee=$(.gpu/run path examples/expert_exchange)
for gpus in $all 0,1; do
  for shape in "--tokens 8 --hidden 2048 --experts 16 --top-k 2" "--tokens 32 --hidden 4096 --experts 64 --top-k 4" \
      "--tokens 128 --hidden 7168 --experts 256 --top-k 8" "--tokens 256 --hidden 7168 --experts 256 --top-k 8"; do
    echo "=== expert_exchange $shape, GPUs $gpus"
    CUDA_VISIBLE_DEVICES=$gpus timeout -k 5 120 "$ee" $shape > "$OUT/ee-$gpus.log" 2>&1; echo "rc=$?"
    grep -vE "NCCL INFO" "$OUT/ee-$gpus.log" | tail -1
  done
  [[ $all == 0,1 ]] && break
done
pack_logs
