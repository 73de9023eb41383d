#!/usr/bin/env bash
# tests/gpu/rest.sh LABEL BINARY[:FILTER]...: chosen test binaries (and tests), each bounded, logged to
# ${OUT:-/tmp}/rest-LABEL.log with output uncaptured (a rank thread's panic shows even if the
# process is then aborted). Run from the repository root on a GPU host after tests/gpu/bundle.
label=$1; shift
log=${OUT:-/tmp}/rest-$label.log; : > "$log"
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
for spec in "$@"; do
  bin=${spec%%:*}; filter=${spec#*:}; [[ $filter == "$spec" ]] && filter=
  echo "=== $spec" >> "$log"
  start=$(date +%s)
  RUST_BACKTRACE=1 timeout -k 5 ${LIMIT:-150} "$(.gpu/run path tests/$bin-test)" --include-ignored --test-threads=1 --nocapture $filter >> "$log" 2>&1
  echo "--- $spec rc=$? in $(( $(date +%s) - start )) s" | tee -a "$log"
done
