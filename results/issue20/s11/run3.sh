#!/usr/bin/env bash
# Session 11, H200 call 3 (issue 20): idx10w (the code-warming program): numerics + bench of the rows, the step
# A/B (sm89 ABBA, batch 1 and 16, plain and MTP) of the warm row, then the cold-code probe (next_n 1 and 2) while
# the budget lasts (BUDGET s, default 330: device time was short after failed machine starts).
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s11/run3.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
mkdir -p /tmp/s11
left() { echo $((${BUDGET:-330} - (SECONDS - T0))); }
ROWS=p2r2048h11b6c,p2r2048b6cw,p2r2048h11b6cw BUILDS=sm89 OUT=/tmp/s11/idx bash scripts/gpu/idx_topk.sh > "$OUT/idx.log" 2>&1
echo "idx_topk: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s11/idx/bench.csv "$OUT/idx_bench.csv"
grep -E "checks|fail|FAIL" "$OUT/idx.log" | head -8; tail -22 "$OUT/idx.log"
W="indexer.PAGED_TOPK_DEFAULT={'sm_89':'p2r2048h11b6cw','sm_90':'p2r2048h11b6cw'}"
N2="backend_kernel.INDEXER_FUSED_MAX_NEXT_N=2"
timeout $(( $(left) - 10 )) python3 -m ds4lab.harness.step --tp 4 ${STEP_BATCHES:---batch 1 --batch 16} --ctx 8192 --mode plain --mode mtp \
  --arch sm89 --ab "$W" --ab "$W,$N2" --abba --out /tmp/s11/sm89 > "$OUT/step_sm89.log" 2>&1
echo "step sm89: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s11/sm89/decode_step.csv "$OUT/sm89.csv"
grep -E "^sm89" "$OUT/step_sm89.log" | cut -c1-150
[ "$(left)" -gt 60 ] && { timeout $(left) python3 scripts/gpu/idx_in_step.py --arch sm89 --cold \
  --rows p2s512,p2r2048h11b6c,p2r2048h11b6cw --out /tmp/s11/ins > "$OUT/ins.log" 2>&1
  echo "idx_in_step: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s11/ins/idx_in_step.csv "$OUT/ins.csv"; grep -A6 "us per call" "$OUT/ins.log"; }
echo "done ($((SECONDS - T0)) s)"
