#!/usr/bin/env bash
# tests/gpu/round3.sh: issue 30's closing GPU run on 4 GPUs: the side-stream (J2) tests one
# process per rank, init and 8-byte overhead against raw NCCL (packed 2.32.3), then the suite on
# the system NCCL 2.28.3. Logs under $OUT.
export OUT RUST_BACKTRACE=1
s=$(date +%s)
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
{ timeout -k 5 150 "$(.gpu/run path tests/gpu_hardening-test)" --include-ignored --test-threads=1 side_stream --nocapture 2>&1 | grep -vE "NCCL INFO"; } > $OUT/j2.log 2>&1
echo "j2 at $(( $(date +%s) - s )) s"; grep -E "ENDED|FREED|BUSY|test result|panicked" $OUT/j2.log
{ timeout 60 .gpu/run benches/init; echo "rc=$?"; NCCL_RS_INIT_ROUNDS=10 timeout 60 .gpu/run benches/init; echo "rc=$?";
  timeout 60 .gpu/run examples/bench all_reduce -b 8 -e 8 -n 2000 -w 200 --compare --rounds 7; echo "rc=$?"; } > $OUT/bench.log 2>&1
echo "benches at $(( $(date +%s) - s )) s"; grep -E "^init: median|safe/raw|median of per-round|rc=" $OUT/bench.log
NCCL_LIBRARY=/lib/x86_64-linux-gnu/libnccl.so.2 NCCL_HOME= timeout -k 5 $(( 570 - ($(date +%s) - s) )) bash tests/gpu/suite.sh 2.28.3-x4 > /dev/null 2>&1
echo "suite at $(( $(date +%s) - s )) s"
grep -E "^=== |test result|panicked|Aborted|total:|rc=" $OUT/suite-2.28.3-x4.log | grep -v "^\[" | tail -45
