#!/usr/bin/env bash
# Session 20, device call 1b (issue 20): run1.sh cut to what ~9 minutes of device time left fit (failed machine starts
# spent the rest): ONE step process (one cold compile), sm89, batch 1 and 16, plain, ABBA over three variants:
#   A   the defaults;
#   B1  sparse MLA's fp8 merge with 64 programs (OQ_MERGE_TILE 2048: one head a program; default 4096: 32 programs);
#   B2  the one-launch wide MoE row up to 128 pairs (batch 16's 96).
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s20/run1b.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
mkdir -p "$OUT"
T0=$SECONDS
. scripts/gpu/step_ab.sh   # step NAME TIMEOUT ARGS...
step ab_sm89 ${LIMIT:-420} --arch sm89 --batch 1 --batch 16 --mode plain --abba --ab "sparse_mla.OQ_MERGE_TILE=2048" \
  --ab "moe_w4a16.DECODE_ROW_FUSED_WIDE={'sm_89': 'mmaq_n64f8xl_w2n128', 'sm_90': None}"
tail -30 "$OUT/ab_sm89.log" | cut -c1-240
echo "done ($((SECONDS - T0)) s)"
