#!/usr/bin/env bash
# Issue 20 (qmla6) on the H200 from a plain copy of the tree with the image's python3 (torch 2.11,
# triton 3.6.0; nothing to install): sparse MLA decode with the q head RMSNorm + RoPE in its q load vs
# the unfused pair (rmsnorm_rope launch + sparse_mla_decode), TP=4 rank, T = 1/2/16, C4A / SWA-only /
# C128A 8K, numerics (every registry case: fused vs the composed reference, fused vs unfused) then
# p50 us of each, per build (scripts/gpu/qmla.py). Rows: $OUT/qmla_<build>.csv, logs $OUT/qmla_<build>.log.
# Usage: OUT=DIR bash scripts/gpu/qmla.sh      Expected ~60-90 s (mostly first compiles). Fail-soft:
#   both builds run; exit 1 if either failed.
set -uo pipefail
OUT=${OUT:-${1:-results}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
rc=0
t0=$SECONDS
for arch in ${BUILDS:-sm89 native}; do
  tb=$SECONDS
  timeout ${QMLA_TIMEOUT:-100} python3 scripts/gpu/qmla.py --arch $arch --out "$OUT" > "$OUT/qmla_$arch.log" 2>&1 \
    || { echo "QMLA $arch FAILED (qmla_$arch.log)"; rc=1; }
  grep -E "^(FAIL|check|time|qmla)|Error" "$OUT/qmla_$arch.log" | tail -30
  echo "qmla $arch: $((SECONDS - tb)) s"
done
echo "total: $((SECONDS - t0)) s"
exit $rc
