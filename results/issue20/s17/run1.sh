#!/usr/bin/env bash
# Session 17, device call 1 (issue 20; ~9 min, fail-soft parts, most decisive first): the persistent w13 launch
# (rows mmaq_n64p8xl / mmaq_n64p8xl_w2n128: one wave of SMs x CTAS programs looping over (tile, column block, split)
# units, the split count 1..8 picked in-kernel from the tile count). Session 16's ncu (results/issue20/s16/call1)
# found the grid row's w13 at batch 16 under the step's routing busy 38-69 K of 78 K cycles per SM: ~592 units of
# 8 groups on 528 resident CTAs, a second round on about half the SMs.
#   1. the kernel bench, sm89: both persistent rows beside the two grid defaults at T = 1, 4, 16 under the step's
#      routing (pool19) and distinct experts; numerics of every row first (the persistent rows' bits differ from the
#      grid rows' where the picked split count is not 4: reference checks only);
#   2. the step, sm89, batch 1 and 16, plain and MTP, ABBA: all three decode rows persistent;
#   3. ncu of the persistent rows (T=16 pool19, T=1) beside the default at T=16 pool19.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s17/run1.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
. scripts/gpu/step_ab.sh   # step NAME TIMEOUT ARGS...
MOE_LABELS="mmaq_n64s4xl mmaq_n64p8xl mmaq_n64s4xl_w2n128 mmaq_n64p8xl_w2n128" MOE_BUILDS=sm89 MOE_BUILD_TIMEOUT=170 \
  MOE_T="1 4 16" MOE_PEER=0 MOE_ROUTING="pool19 distinct" MOE_NUMERICS_T=16 \
  MOE_BITEQ="mmaq_n64s4xl mmaq_n64p8xl=- mmaq_n64p8xl_w2n128=-" OUT="$OUT/moe" \
  bash scripts/gpu/moe.sh > "$OUT/moe.log" 2>&1
echo "moe sm89: rc=$? ($((SECONDS - T0)) s)"; grep -E "biteq|FAIL" "$OUT/moe.log" | head -4; tail -22 "$OUT/moe.log"
P="moe_w4a16.DECODE_ROW_NARROW='mmaq_n64p8xl',moe_w4a16.DECODE_ROW={'sm_89': 'mmaq_n64p8xl', 'sm_90': 'mmaq_n64s4xl'},moe_w4a16.DECODE_ROW_WIDE={'sm_89': 'mmaq_n64p8xl_w2n128', 'sm_90': 'mmaq_n64s4xl_w2n128'}"
step persist_sm89 250 --arch sm89 --batch 1 --batch 16 --mode plain --mode mtp --abba --ab "$P"
OUT="$OUT/ncu" timeout 120 bash scripts/gpu/ncu_decode.sh "fused_moe_w4a16:T=16,routing=pool19,row=mmaq_n64p8xl_w2n128" \
  "fused_moe_w4a16:T=16,routing=pool19" "fused_moe_w4a16:T=1,row=mmaq_n64p8xl" > "$OUT/ncu.log" 2>&1
echo "ncu: rc=$? ($((SECONDS - T0)) s)"; cut -c1-220 "$OUT/ncu.log" | tail -12
echo "done ($((SECONDS - T0)) s)"
