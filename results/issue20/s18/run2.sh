#!/usr/bin/env bash
# Session 18, device call 2 (issue 20; ~7 min): the rows call 1's step did not time, and Nsight Compute of the new rows.
#   1. the step, sm89, batch 1 and 16, plain and MTP, ABBA: all three decode rows persistent (STEP_ROWS=persist, the
#      default: call 1 timed the fused rows) or fused (STEP_ROWS=fused: call 1's moe_b failed and it timed persist);
#   2. ncu: the fused and persistent rows at T=16 under the step's routing (pool19) and at T=1.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> [STEP_ROWS=persist|fused] bash results/issue20/s18/run2.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
. scripts/gpu/step_ab.sh   # step NAME TIMEOUT ARGS...
F="moe_w4a16.DECODE_ROW_NARROW='mmaq_n64f8xl',moe_w4a16.DECODE_ROW={'sm_89': 'mmaq_n64f8xl', 'sm_90': 'mmaq_n64s4xl'},moe_w4a16.DECODE_ROW_WIDE={'sm_89': 'mmaq_n64f8xl_w2n128', 'sm_90': 'mmaq_n64s4xl_w2n128'}"
P="moe_w4a16.DECODE_ROW_NARROW='mmaq_n64p8xl',moe_w4a16.DECODE_ROW={'sm_89': 'mmaq_n64p8xl', 'sm_90': 'mmaq_n64s4xl'},moe_w4a16.DECODE_ROW_WIDE={'sm_89': 'mmaq_n64p8xl_w2n128', 'sm_90': 'mmaq_n64s4xl_w2n128'}"
if [ "${STEP_ROWS:-persist}" = fused ]; then
  step fused_sm89 250 --arch sm89 --batch 1 --batch 16 --mode plain --mode mtp --abba --ab "$F"
else
  step persist_sm89 250 --arch sm89 --batch 1 --batch 16 --mode plain --mode mtp --abba --ab "$P"
fi
OUT="$OUT/ncu" timeout 150 bash scripts/gpu/ncu_decode.sh "fused_moe_w4a16:T=16,routing=pool19,row=mmaq_n64f8xl_w2n128" \
  "fused_moe_w4a16:T=16,routing=pool19,row=mmaq_n64p8xl_w2n128" "fused_moe_w4a16:T=16,routing=pool19" \
  "fused_moe_w4a16:T=1,row=mmaq_n64f8xl" > "$OUT/ncu.log" 2>&1
echo "ncu: rc=$? ($((SECONDS - T0)) s)"; cut -c1-220 "$OUT/ncu.log" | tail -14
echo "done ($((SECONDS - T0)) s)"
