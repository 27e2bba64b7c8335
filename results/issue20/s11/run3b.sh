#!/usr/bin/env bash
# Session 11, a short H200 call for idx10w when little device time is left: only the step A/B (sm89, TP=4, ctx 8k,
# batch 1 plain + MTP, ABBA) of the warm row, alone and with next_n 2 on the one launch (numerics: run3.sh).
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s11/run3b.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
W="indexer.PAGED_TOPK_DEFAULT={'sm_89':'p2r2048h11b6cw','sm_90':'p2r2048h11b6cw'}"
N2="backend_kernel.INDEXER_FUSED_MAX_NEXT_N=2"
timeout ${BUDGET:-200} python3 -m ds4lab.harness.step --tp 4 --batch 1 --ctx 8192 --mode plain --mode mtp \
  --arch sm89 --ab "$W" --ab "$W,$N2" --abba --out "$OUT" > "$OUT/step_sm89.log" 2>&1
echo "step sm89: rc=$?"; grep -E "^sm89" "$OUT/step_sm89.log" | cut -c1-150
