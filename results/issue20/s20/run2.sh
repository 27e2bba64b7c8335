#!/usr/bin/env bash
# Session 20, device call 2 (issue 20; ~4 min): sparse MLA's native (sm_90) defaults on triton 3.6.0, where h32n32 (the
# default above 16 heads at T > 1) spills 976-980 B (ds4lab aot --arch sm_90): the kernel bench, native build,
#   1. TP=1 (64 heads), the batched shapes (T = 2, 16, 32, 128; C128A): every row, h16n16 (no spill) vs h32n32;
#   2. TP=4 (16 heads), the T=1 targets (with the step's o_fp8 form): the T <= 2 default h16n16m1 beside the rest.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s20/run2.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
mkdir -p "$OUT"
T0=$SECONDS
for part in "batched 1" "targets 4"; do
  set -- $part
  mkdir -p "$OUT/mla90_$1"
  DS4LAB_BENCH_SHAPES=$1 timeout 240 python3 -m ds4lab.harness.bench sparse_mla_decode --tp "$2" --arch native \
    --out "$OUT/mla90_$1" > "$OUT/mla90_$1.log" 2>&1
  echo "mla native $1 tp$2: rc=$? ($((SECONDS - T0)) s)"; grep -E "FAIL|Error|Traceback" "$OUT/mla90_$1.log" | head -5
  grep -E "p50=" "$OUT/mla90_$1.log" | cut -c1-220   # the bench prints each timed row
done
echo "done ($((SECONDS - T0)) s)"
