#!/usr/bin/env bash
# tests/gpu/teardown.sh: the teardown stress test on the NCCL packed in .gpu/nccl and the system's
# (SYSTEM_NCCL, 2.28.3 on the lent hosts) at once
# Run from the repository root on a GPU host, after tests/gpu/bundle (and tests/gpu/nccl
# VERSION) here and with the tree carried there (.gpu included). Logs go to $OUT (default /tmp).
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
t=$(.gpu/run path tests/gpu_teardown-test)
packed=${NCCL_LIBRARY:?no NCCL packed in .gpu/nccl (tests/gpu/nccl VERSION)}
export NCCL_RS_TEARDOWN_ITERS=${ITERS:-300} NCCL_RS_TEARDOWN_CONTROL_ITERS=${CONTROL:-100}
start=$(date +%s)
(NCCL_LIBRARY=$packed timeout 500 $t ending --include-ignored --nocapture > ${OUT:-/tmp}/teardown-packed.log 2>&1; echo "rc=$?" >> ${OUT:-/tmp}/teardown-packed.log) &
(NCCL_LIBRARY=${SYSTEM_NCCL:-/lib/x86_64-linux-gnu/libnccl.so.2} timeout 500 $t ending --include-ignored --nocapture > ${OUT:-/tmp}/teardown-system.log 2>&1; echo "rc=$?" >> ${OUT:-/tmp}/teardown-system.log) &
wait
echo "teardown in $(( $(date +%s) - start )) s"
grep -hE "TEARDOWN rank|failed collectives|rc=|panicked|test result" ${OUT:-/tmp}/teardown-*.log | cut -c1-400
