#!/usr/bin/env bash
# tests/gpu/older_nccl.sh VERSION: the parity tests against an older NCCL whose library tests/gpu/nccl
# (or its cu12 variant) packed into .carry/nccl-VERSION; .carry/gpu_parity-fix is a newer
# gpu_parity test binary to use in place of the bundled one (drop that line if the bundle is current).
# old.sh VERSION: the parity tests against an older NCCL packed in .carry/nccl-VERSION
v=$1; home=/tmp/nccl-$v; mkdir -p $home/lib
python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' .carry/nccl-$v/libnccl.so.2.xz $home/lib/libnccl.so.2
export NCCL_LIBRARY=$home/lib/libnccl.so.2
eval "$(.gpu/run env 2>/dev/null | sed 's/^/export /')"
p=$(.gpu/run path tests/gpu_parity-test); cp .carry/gpu_parity-fix "$p"
for t in gpu_scalable_init gpu_parity params_and_simulation; do
  echo "=== $t"; timeout 90 "$(.gpu/run path tests/$t-test)" --include-ignored --test-threads=1 --nocapture 2>&1 | grep -vE "^\[20"; echo "--- $t rc=${PIPESTATUS[0]}"
done > $OUT/old-$v.log 2>&1
grep -E "^---|SCALABLE_OK rank=0|ESTIMATE rank=0|SKIPPED|panicked|Unsupported|test result: F" $OUT/old-$v.log | cut -c1-220 | head -30
