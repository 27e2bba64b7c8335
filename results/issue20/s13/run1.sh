#!/usr/bin/env bash
# Session 13, H200 call 1 (issue 20; ~8.7 device minutes left this session, so one short call, most decisive first):
#   1. the step A/B at batch 16 (plain = 16 tokens, MTP = 32 tokens; sm89 build, TP=4, ctx 8k, ABBA) of mhc16's
#      seamt_d32 for 5-32 tokens and of moe16's wide MoE row;
#   2. numerics + kernel times of seamt_d32 (sm89, T 1-32, fp64 reference, graph replays);
#   3. numerics (bit-equality to the default where it holds) + kernel times of the moe16 rows at T 16 and 32.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s13/run1.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
mkdir -p /tmp/s13
ST="mhc.SEAM_DEFAULTS=((1,'seamr_d64'),(4,'seam1_d64'),(32,'seamt_d32'))"
MW="moe_w4a16.DECODE_ROW_WIDE='mmaq_n32s1xl_w2n128'"
timeout 150 python3 -m ds4lab.harness.step --tp 4 --batch 16 --ctx 8192 --mode plain --mode mtp \
  --arch sm89 --ab "$ST" --ab "$MW" --abba --out /tmp/s13/sm89 > "$OUT/step_sm89.log" 2>&1
echo "step sm89: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s13/sm89/decode_step.csv "$OUT/sm89.csv"
grep -E "p50" "$OUT/step_sm89.log" | cut -c1-170
SEAMT_TIMEOUT=80 MODE=seamt BUILDS=sm89 OUT=/tmp/s13/mhc bash scripts/gpu/mhc.sh > "$OUT/mhc.log" 2>&1
echo "mhc seamt: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s13/mhc/mhc_seamt_sm89.* "$OUT/" 2>/dev/null
grep -E "numerics|FAIL" "$OUT/mhc.log" | head -8; tail -14 "$OUT/mhc.log"
MOE_BUILD_TIMEOUT=70 MOE_SET=moe16 MOE_T="16 32" MOE_ROUTING=distinct OUT=/tmp/s13/moe bash scripts/gpu/moe.sh > "$OUT/moe.log" 2>&1
echo "moe16: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s13/moe/moe_bench.csv "$OUT/" 2>/dev/null
grep -E "biteq|numerics|FAIL" "$OUT/moe.log" | head -6; tail -30 "$OUT/moe.log"
echo "done ($((SECONDS - T0)) s)"
