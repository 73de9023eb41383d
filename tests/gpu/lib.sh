# tests/gpu/lib.sh: what the suites share (sourced). Sets up NCCL from .gpu, and
# run LABEL LIMIT CMD...: runs CMD with a time limit into $OUT/LABEL.log, prints its exit
# status and the lines that matter (tests' results, NOTEs, SKIPs, panics; $HEAD of them).
# pack_logs: all logs into $OUT/all-logs.txt (the device returns only a few files).
export OUT
nvidia-smi -L
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
run() { local label=$1 limit=$2; shift 2; echo "=== $label"; local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$label.log" 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "^test .*FAILED$|SKIPPED|NOTE|test result|panicked|gave up" "$OUT/$label.log" | grep -v "^\[child" | cut -c1-300 | head -"${HEAD:-8}"; }
# bench_rows LABEL GPUS ARGS...: bench's table rows only.
bench_rows() { local label=$1 gpus=$2; shift 2; echo "=== bench $label, GPUs $gpus"
  timeout -k 5 60 env CUDA_VISIBLE_DEVICES="$gpus" "$(.gpu/run path examples/bench)" "$@" > "$OUT/bench-$label-$gpus.log" 2>&1; echo "rc=$?"
  grep -E "^ +[0-9]|rror" "$OUT/bench-$label-$gpus.log" | cut -c1-110; }
pack_logs() { ( cd "$OUT" && for f in *.log; do echo "##### $f"; grep -v "NCCL INFO" "$f"; done > all-logs.txt && rm -f ./*.log ); }
