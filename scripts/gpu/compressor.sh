#!/usr/bin/env bash
# The decode compressor kernel on the H200 (issue 19), from a plain copy of the tree with the image's
# python3 (torch 2.11, triton 3.6.0; no vLLM): `ds4lab bench compress_decode` checks numerics against
# the float64 reference first, then times the kernel and the torch path it replaces (torch_eager
# baseline) at batch 1/16/64, C4 hd 512, C128 hd 512, C4 hd 128 (indexer), TP=4; native build,
# then the sm_89 build. Rows -> $OUT/bench.csv. ~1-2 min in all.
# Usage: OUT=DIR bash scripts/gpu/compressor.sh      Fail-soft: a failing build does not stop the other.
set -uo pipefail
OUT=${OUT:-${1:-results}}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
export DS4LAB_GIT_SHA=${DS4LAB_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
rc=0
for arch in native sm89; do
  timeout 240 python3 -m ds4lab.cli bench compress_decode --tp 4 --arch "$arch" --out "$OUT" \
    2>&1 | tee "$OUT/compressor_$arch.log" || { echo "FAILED: build $arch"; rc=1; }
done
[ -f "$OUT/bench.csv" ] && grep -i compress "$OUT/bench.csv" | cut -c1-200
exit $rc
