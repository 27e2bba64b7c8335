#!/usr/bin/env bash
# Session 15, device call 3 (issue 20; ~4 min, fail-soft parts), at the commit shipping call 2's winners (sm_89
# DECODE_ROW mmaq_n64s4xl; both tables' wide row mmaq_n64s4xl_w2n128):
#   1. native batch 4 and 8, ABBA: DECODE_ROW mmaq_n64s4xl on the sm_90 table (the sm_89 win: batch 8 -521 us);
#   2. sm89 batch 1 plain and MTP (6 / 12 pairs: the narrow row), ABBA: the narrow row with the loop scan
#      (mmaq_n64s4xl, bit-equal to mmaq_n64s4x);
#   3. native batch 1 plain and MTP with the shipped defaults (the closing table's native row).
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s15/run3.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
. scripts/gpu/step_ab.sh   # step NAME TIMEOUT ARGS...
step b4b8_native 110 --arch native --batch 4 --batch 8 --mode plain --abba \
  --ab "moe_w4a16.DECODE_ROW={'sm_89': 'mmaq_n64s4xl', 'sm_90': 'mmaq_n64s4xl'}"
step b1_sm89_narrow 80 --arch sm89 --batch 1 --mode plain --mode mtp --abba --ab "moe_w4a16.DECODE_ROW_NARROW='mmaq_n64s4xl'"
step b1_native 60 --arch native --batch 1 --mode plain --mode mtp
echo "done ($((SECONDS - T0)) s)"
