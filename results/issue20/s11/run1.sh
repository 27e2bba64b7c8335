#!/usr/bin/env bash
# Session 11, H200 call 1 (issue 20): numerics of every candidate in the model, the GPU streams test, then the
# step A/B (sm89 build, TP=4, ctx 8k, batch 1 plain + MTP, ABBA) of every candidate alone and all together.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s11/run1.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
PRIO="backend_kernel.BRANCH_PRIORITY=True"
MAINF="backend_kernel.BRANCH_MAIN_FIRST=('attn','moe')"
IDX="indexer.PAGED_TOPK_DEFAULT={'sm_89':'p2r2048h11b6c','sm_90':'p2r2048h11b6c'}"
IDX2="backend_kernel.INDEXER_FUSED_MAX_NEXT_N=2"
QIDX="backend_kernel.FUSE_Q_INDEXER_Q=True"
MOEH="moe_w4a16.DECODE_ROW_NARROW='mmaq_n64s4xh'"
ALL="$PRIO,$MAINF,$IDX,$IDX2,$QIDX,$MOEH"
# 1. the model check with every candidate on (numerics vs the reference twin), batch 1 x next_n 1 and 2
for nn in 1 2; do
  timeout 150 python3 -m ds4lab.model.check --tp 4 --layers 0 2 3 --batch 1 --next-n $nn \
    --set "$PRIO" --set "$MAINF" --set "$IDX" --set "$IDX2" --set "$QIDX" --set "$MOEH" > "$OUT/check_n$nn.log" 2>&1
  echo "check next_n $nn: rc=$? ($((SECONDS - T0)) s)"; tail -4 "$OUT/check_n$nn.log"
done
# 2. the GPU streams test (bit-identical logits: side first / main first / priority)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_branch_streams.py > "$OUT/streams_test.log" 2>&1
echo "streams test: rc=$? ($((SECONDS - T0)) s)"; tail -3 "$OUT/streams_test.log"
# 3. the step A/B
timeout $((560 - (SECONDS - T0))) python3 -m ds4lab.harness.step --tp 4 --batch 1 --ctx 8192 --mode plain --mode mtp \
  --arch sm89 --ab "$PRIO" --ab "$MAINF" --ab "$IDX" --ab "$IDX,$IDX2" --ab "$QIDX" --ab "$MOEH" --ab "$ALL" --abba \
  --out "$OUT" > "$OUT/step.log" 2>&1
echo "step: rc=$? ($((SECONDS - T0)) s)"; tail -45 "$OUT/step.log"
