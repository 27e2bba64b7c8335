#!/usr/bin/env bash
# Issue 20 (comp1) on the H200 from a plain copy of the tree with the image's python3 (torch 2.11,
# triton 3.6.0; nothing to install): compress_decode in one launch (the <name>_1l rows) vs the state write +
# compress pair, real per-rank shapes (C4 / C128 hd 512, the indexer's C4 hd 128), T = 1..64, next_n 1 and 2:
# bit identity of outputs, state rings and fused cache writes, then p50 us of the cache-write call (what the
# decode step runs) and kernels per call, per build (scripts/gpu/compress_1l.py). Rows:
# $OUT/compress_1l_<build>.csv, logs $OUT/compress_1l_<build>.log.
# Usage: OUT=DIR bash scripts/gpu/compress_1l.sh      (BUILDS="sm89 native" for both; ~20-40 s a build,
#   mostly first compiles). Fail-soft: every build runs; exit 1 if any failed.
set -uo pipefail
OUT=${OUT:-${1:-results}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
rc=0
t0=$SECONDS
for arch in ${BUILDS:-sm89}; do
  tb=$SECONDS
  timeout ${COMP1_TIMEOUT:-90} python3 scripts/gpu/compress_1l.py --arch $arch --out "$OUT" \
    > "$OUT/compress_1l_$arch.log" 2>&1 || { echo "COMPRESS_1L $arch FAILED (compress_1l_$arch.log)"; rc=1; }
  grep -E "^(FAIL|op|compress|[0-9]+ numerics)|Error" "$OUT/compress_1l_$arch.log" | tail -30
  echo "compress_1l $arch: $((SECONDS - tb)) s"
done
echo "total: $((SECONDS - t0)) s"
exit $rc
