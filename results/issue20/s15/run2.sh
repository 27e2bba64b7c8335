#!/usr/bin/env bash
# Session 15, device call 2 (issue 20; ~8 min, every part fail-soft under its own timeout, most decisive first), at the
# commit that ships call 1's winners (sm_89 wide row mmaq_n64s4xl_w2n128; sm_90 gets the sm_89 table's loop-scan
# DECODE_ROW, the 2-split wide row and seamt_d32 up to 32 tokens):
#   1. batch 16 plain and MTP, sm89, ABBA: the wide row with 8 K splits (mmaq_n64s8xl_w2n128, bit-equal to mmaq_n64s8x);
#   2. the kernel bench under the step's routing (pool19 T=16, pool49 T=32), sm89 and native: the 2 / 4 / 8-split wide
#      rows, bit checks (the 4- and 8-split rows natively too: the sm_90 table may take them);
#   3. the native step at batch 16, plain and MTP, ABBA: the 4-split wide row on the sm_90 table;
#   4. batch 4 and 8, sm89, ABBA: DECODE_ROW with 4 splits (mmaq_n64s4xl), the wide row from 24 pairs;
#   5. batch 1 plain and MTP, sm89, with the shipped defaults (the closing table's row).
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s15/run2.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
. scripts/gpu/step_ab.sh   # step NAME TIMEOUT ARGS...
W="moe_w4a16.DECODE_ROW_WIDE"
step b16_sm89_s8 110 --arch sm89 --batch 16 --mode plain --mode mtp --abba \
  --ab "$W={'sm_89': 'mmaq_n64s8xl_w2n128', 'sm_90': 'mmaq_n64s2xl_w2n128'}"
MOE_LABELS="mmaq_n64s2xl_w2n128 mmaq_n64s4xl_w2n128 mmaq_n64s8xl_w2n128" MOE_BUILDS="sm89 native" MOE_BUILD_TIMEOUT=70 \
  MOE_T="16 32" MOE_PEER=0 MOE_ROUTING="pool19 pool49" MOE_NUMERICS_T=16 \
  MOE_BITEQ="mmaq_n64s2x mmaq_n64s4xl_w2n128=mmaq_n64s4x mmaq_n64s8xl_w2n128=mmaq_n64s8x" OUT="$OUT/moepool" \
  bash scripts/gpu/moe.sh > "$OUT/moepool.log" 2>&1
echo "moe pool: rc=$? ($((SECONDS - T0)) s)"; grep -E "biteq checks|FAIL" "$OUT/moepool.log" | head -6; grep -E "^build=|^  ds4lab" "$OUT/moepool.log"
step b16_native_s4 120 --arch native --batch 16 --mode plain --mode mtp --abba \
  --ab "$W={'sm_89': 'mmaq_n64s4xl_w2n128', 'sm_90': 'mmaq_n64s4xl_w2n128'}"
step b4b8_sm89 110 --arch sm89 --batch 4 --batch 8 --mode plain --abba \
  --ab "moe_w4a16.DECODE_ROW={'sm_89': 'mmaq_n64s4xl', 'sm_90': 'mmaq_n64s2xl'}" --ab "moe_w4a16.DECODE_WIDE_MIN_PAIRS=24"
step b1_sm89 60 --arch sm89 --batch 1 --mode plain --mode mtp
echo "done ($((SECONDS - T0)) s)"
