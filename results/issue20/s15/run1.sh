#!/usr/bin/env bash
# Session 15, device call 1 (issue 20): session 14's call 2 (which never ran: no device started) plus the x copy 4 rows a
# step (the "_xr4" rows, new in session 15; bit-equal to their xperm-1 twins). ~9.5 min, every part fail-soft under its
# own timeout, most decisive first.
# Call 1 (NOTES "Session 14 (lead)") found the step's random-weight routing puts batch 16's 96 pairs on ~18.5
# experts a layer, so the wide MoE row's 2-split w13 programs are few and long; this call:
#   1. batch 16 plain and MTP, sm89, ABBA: the wide row with 4 K splits (mmaq_n64s4xl_w2n128, bit-equal to
#      mmaq_n64s4x), the split-1 row (mmaq_n64s1xl_w2n128), and the o_proj input quant in the attention merge at
#      32 tokens (FUSE_O_QUANT_MAX_T=16: one o_proj launch fewer at batch 16; +50 us at batch 16 in session 10, before seamt);
#   1b. the kernel bench of the wide rows under the step's routing (--routing pool19 / pool49: every token's top-k
#      from one pool of 19 / 49 experts, T=16 / 32), sm89: does the bench reproduce the step's ~80 us a layer?
#   2. (B4B8=1 only: the call was cut to ~8 min after three failed starts) batch 4 and 8, sm89, ABBA: DECODE_ROW with
#      4 splits (mmaq_n64s4xl) and the wide row from 48 pairs;
#   3. the native build's step at batch 4 and 16, ABBA: the sm_89 table's moe16 / seamt defaults on the sm_90 table;
#   4. the numerics those native rows need: the moe rows' bits in the native build (T=16) and seamt_d32's checks.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s15/run1.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
. scripts/gpu/step_ab.sh   # step NAME TIMEOUT ARGS...
W="moe_w4a16.DECODE_ROW_WIDE"
step b16_sm89 190 --arch sm89 --batch 16 --mode plain --mode mtp --abba \
  --ab "$W={'sm_89': 'mmaq_n64s4xl_w2n128', 'sm_90': None}" --ab "$W={'sm_89': 'mmaq_n64s1xl_w2n128', 'sm_90': None}" \
  --ab "$W={'sm_89': 'mmaq_n64s2xl_w2n128_xr4', 'sm_90': None}" --ab "backend_kernel.FUSE_O_QUANT_MAX_T=16"
MOE_LABELS="mmaq_n64s2xl_w2n128 mmaq_n64s2xl_w2n128_xr4 mmaq_n64s4xl_w2n128 mmaq_n64s4xl_w2n128_xr4 mmaq_n64s1xl_w2n128 mmaq_n64s2x" MOE_BUILDS=sm89 MOE_BUILD_TIMEOUT=90 \
  MOE_T="16 32" MOE_PEER=0 MOE_ROUTING="pool19 pool49" MOE_NUMERICS_T=16 \
  MOE_BITEQ="mmaq_n64s2x mmaq_n64s4xl_w2n128=mmaq_n64s4x mmaq_n64s4xl_w2n128_xr4=mmaq_n64s4x mmaq_n64s1xl_w2n128=-" OUT="$OUT/moepool" \
  bash scripts/gpu/moe.sh > "$OUT/moepool.log" 2>&1
echo "moe pool sm89: rc=$? ($((SECONDS - T0)) s)"; grep -E "biteq|FAIL" "$OUT/moepool.log" | head -4; tail -14 "$OUT/moepool.log"
[ -n "${B4B8:-}" ] && step b4b8_sm89 90 --arch sm89 --batch 4 --batch 8 --mode plain --abba \
  --ab "moe_w4a16.DECODE_ROW={'sm_89': 'mmaq_n64s4xl', 'sm_90': 'mmaq_n64s2x'}" --ab "moe_w4a16.DECODE_WIDE_MIN_PAIRS=48"
N90="moe_w4a16.DECODE_ROW={'sm_89': 'mmaq_n64s2xl', 'sm_90': 'mmaq_n64s2xl'},$W={'sm_89': 'mmaq_n64s2xl_w2n128', 'sm_90': 'mmaq_n64s2xl_w2n128'},mhc.SEAM_DEFAULTS={'sm_89': ((1,'seamr_d64'),(4,'seam1_d64'),(32,'seamt_d32')), 'sm_90': ((1,'seamr_d64'),(4,'seam1_d64'),(32,'seamt_d32'))}"
step b4b16_native 130 --arch native --batch 4 --batch 16 --mode plain --abba --ab "$N90"
MOE_LABELS="mmaq_n64s2x mmaq_n64s2xl mmaq_n64s2xl_w2n128" MOE_BUILDS=native MOE_BUILD_TIMEOUT=60 MOE_T="16" \
  MOE_PEER=0 MOE_BITEQ=mmaq_n64s2x MOE_ROUTING=distinct OUT="$OUT/moe" bash scripts/gpu/moe.sh > "$OUT/moe.log" 2>&1
echo "moe native: rc=$? ($((SECONDS - T0)) s)"; grep -E "biteq|FAIL" "$OUT/moe.log" | head -4; tail -8 "$OUT/moe.log"
SEAMT_TIMEOUT=60 MODE=seamt BUILDS="native" OUT="$OUT/mhc" bash scripts/gpu/mhc.sh > "$OUT/mhc.log" 2>&1
echo "mhc seamt native: rc=$? ($((SECONDS - T0)) s)"; grep -E "numerics|FAIL|^T=" "$OUT/mhc.log" | head -40
echo "done ($((SECONDS - T0)) s)"
