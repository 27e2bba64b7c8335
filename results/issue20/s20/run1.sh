#!/usr/bin/env bash
# Session 20, device call 1 (issue 20; ~9 min, fail-soft parts, most decisive first):
#   1. the step, sm89, batch 1 plain and MTP, ABBA: sparse MLA's fp8 merge with 64 programs (OQ_MERGE_TILE 2048:
#      one head a program) against 32 (4096, the default);
#   2. the step, sm89, batch 16 plain and MTP, ABBA: the one-launch wide MoE row up to 128 pairs (batch 16's 96;
#      not batch-16 MTP's 192, where it lost in session 19);
#   3. the kernel bench, sm89, sparse MLA at the T=1 targets (now also the step's o_fp8 form), merge tile 4096 then 2048;
#   4. the MoE kernel bench at T=16 pool19 and T=32 pool49 (the step's routings), wide grid row vs fused wide row,
#      then ncu of both at T=32 (the new bench shape), to see where the fused row loses at 192 pairs.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s20/run1.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
mkdir -p "$OUT"
T0=$SECONDS
. scripts/gpu/step_ab.sh   # step NAME TIMEOUT ARGS...
step merge64_sm89 200 --arch sm89 --batch 1 --mode plain --mode mtp --abba --ab "sparse_mla.OQ_MERGE_TILE=2048"
step fwide_sm89 200 --arch sm89 --batch 16 --mode plain --mode mtp --abba \
  --ab "moe_w4a16.DECODE_ROW_FUSED_WIDE={'sm_89': 'mmaq_n64f8xl_w2n128', 'sm_90': None}"
for tile in 4096 2048; do
  mkdir -p "$OUT/mla_$tile"
  DS4LAB_BENCH_SHAPES=targets timeout 100 python3 -c "
import sys
import ds4lab_kernels.sparse_mla as m
m.OQ_MERGE_TILE = $tile
import argparse
from ds4lab.harness import bench
ap = argparse.ArgumentParser()
bench.add_arguments(ap)
sys.exit(bench.main(ap.parse_args(['sparse_mla_decode', '--tp', '4', '--arch', 'sm89', '--out', '$OUT/mla_$tile'])))
" > "$OUT/mla_$tile.log" 2>&1
  echo "mla bench tile $tile: rc=$? ($((SECONDS - T0)) s)"; grep -E "FAIL|Error|Traceback" "$OUT/mla_$tile.log" | head -5
  grep -E "p50=" "$OUT/mla_$tile.log" | cut -c1-220   # the bench prints each timed row
done
mkdir -p "$OUT/moe"
timeout 150 python3 -m ds4lab.harness.moe_bench --arch sm89 --tp 4 --T 16 32 --routing pool19 pool49 --no-peer \
  --straw-max-t 0 --labels mmaq_n64s4xl_w2n128 mmaq_n64f8xl_w2n128 --biteq mmaq_n64s4xl_w2n128 mmaq_n64f8xl_w2n128=- \
  --out "$OUT/moe" > "$OUT/moe.log" 2>&1
echo "moe bench: rc=$? ($((SECONDS - T0)) s)"; grep -E "FAIL" "$OUT/moe.log" | head -4; tail -12 "$OUT/moe.log"
OUT="$OUT/ncu" timeout 120 bash scripts/gpu/ncu_decode.sh "fused_moe_w4a16:T=32,routing=pool49,row=mmaq_n64f8xl_w2n128" \
  "fused_moe_w4a16:T=32,routing=pool49" > "$OUT/ncu.log" 2>&1
echo "ncu: rc=$? ($((SECONDS - T0)) s)"; cut -c1-220 "$OUT/ncu.log" | tail -10
echo "done ($((SECONDS - T0)) s)"
