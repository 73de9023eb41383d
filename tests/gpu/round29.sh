#!/usr/bin/env bash
# tests/gpu/round29.sh: one GPU. The whole suite on the session's final kernels and abort path
# (.gpu/run tests: threaded tests as two ranks sharing GPU 0, process tests as simulated hosts).
source tests/gpu/lib.sh
t0=$(date +%s); timeout -k 5 480 .gpu/run tests > $OUT/suite.log 2>&1; echo "suite rc=$? in $(( $(date +%s) - t0 )) s"
grep -E "^=== |test result|FAILED|panicked|test binaries" $OUT/suite.log | grep -v "test result: ok" | grep -v "^=== " | head -30
grep -A30 "GPU suite summary" $OUT/suite.log | head -40
pack_logs
