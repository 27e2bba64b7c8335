#!/usr/bin/env bash
# Next session, device call 1 (issue 20; ~9-11 min on a fresh H200, every part fail-soft under its own timeout,
# most decisive first). Session 13 set two sm_89 defaults from H100 A/Bs (NOTES "mhc16", "moe16",
# "Session 13 (lead)"); this call:
#   1. the step with today's defaults on the H200 (sm89 build, TP=4, ctx 8k): batch 1 and 16, plain and MTP: the
#      before/after of session 13 on the card the goals name;
#   2. batch-16 MTP (32 tokens) A/B: seamt_d32 for 17-32 tokens too (ABBA);
#   3. the native build's step (batch 1 and 16, plain and MTP): untimed since session 10;
#   4. seamt_d32 numerics + kernel times in both builds (T 1-32; session 13's table was cut after T=8);
#   5. the moe16 rows in the native build at T 16 / 32 (to decide DECODE_ROW_WIDE["sm_90"]);
#   6. batch 4 and 8 (24 / 48 pairs, DECODE_ROW's range) A/B of the loop id scan (mmaq_n64s2xl, bit-equal to
#      mmaq_n64s2x: 190.8 vs 206.0 us at 96 pairs on the H100; predicted 54-58 vs 58.6 at 24 pairs, NOTES "moe16").
# Every GPU step row now notes the routed experts a MoE layer touched (step.routed_experts): compare with the
# kernel bench's distinct / uniform routing (NOTES "moe16", "A discrepancy").
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s14/run1.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
PARTS=${PARTS:-"1 2 3 4 5 6"}   # which numbered parts run (one call's 600 s fits about four)
on() { [[ " $PARTS " == *" $1 "* ]]; }
step() {  # NAME TIMEOUT ARGS...: rows straight to $OUT/NAME/decode_step.csv (kept when the timeout cuts it)
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m ds4lab.harness.step --tp 4 --ctx 8192 --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? ($((SECONDS - T0)) s)"; grep -E "^TP=" "$OUT/$name.log" | cut -c1-190
}
on 1 && step sm89_defaults 150 --arch sm89 --batch 1 --batch 16 --mode plain --mode mtp
ST32="mhc.SEAM_DEFAULTS={'sm_89': ((1,'seamr_d64'),(4,'seam1_d64'),(32,'seamt_d32')), 'sm_90': ((1,'seamr_d64'),(4,'seam1_d64'))}"
on 2 && step sm89_seamt32 120 --arch sm89 --batch 16 --mode mtp --ab "$ST32" --abba
on 3 && step native_defaults 150 --arch native --batch 1 --batch 16 --mode plain --mode mtp
on 4 && { SEAMT_TIMEOUT=110 MODE=seamt BUILDS="sm89 native" OUT="$OUT/mhc" bash scripts/gpu/mhc.sh > "$OUT/mhc.log" 2>&1
echo "mhc seamt: rc=$? ($((SECONDS - T0)) s)"; grep -E "numerics|FAIL|^T=" "$OUT/mhc.log" | head -60; }
on 5 && { MOE_BUILDS=native MOE_BUILD_TIMEOUT=100 MOE_SET=moe16 MOE_T="16 32" MOE_ROUTING=distinct OUT="$OUT/moe" \
  bash scripts/gpu/moe.sh > "$OUT/moe.log" 2>&1
echo "moe16 native: rc=$? ($((SECONDS - T0)) s)"; grep -E "biteq|FAIL" "$OUT/moe.log" | head -4; tail -20 "$OUT/moe.log"; }
on 6 && step sm89_moe_loop 120 --arch sm89 --batch 4 --batch 8 --mode plain --ab "moe_w4a16.DECODE_ROW='mmaq_n64s2xl'" --abba
echo "done ($((SECONDS - T0)) s)"
