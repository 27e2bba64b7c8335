#!/usr/bin/env bash
# Session 12, H200 call 1 (issue 20): idx10w (session 11's code-warming select rows, never run): numerics + bench;
# the GPU streams test with the q/kv norm issued before the side chain ("attn2"); the step A/B (sm89 ABBA, batch 1
# and 16, plain and MTP) of the warm row (+ next_n 2 on one launch) and of attn2; then the cold-code probe.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s12/run1.sh   (BUDGET s, default 570)
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
mkdir -p /tmp/s12
left() { echo $((${BUDGET:-570} - (SECONDS - T0))); }
ROWS=p2r2048h11b6c,p2r2048b6cw,p2r2048h11b6cw BUILDS=sm89 OUT=/tmp/s12/idx bash scripts/gpu/idx_topk.sh > "$OUT/idx.log" 2>&1
echo "idx_topk: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s12/idx/bench.csv "$OUT/idx_bench.csv"
grep -E "checks|fail|FAIL" "$OUT/idx.log" | head -8; tail -22 "$OUT/idx.log"
python3 -m pytest tests/test_branch_streams.py -q -x -k "bit_identical" > "$OUT/streams.log" 2>&1
echo "streams test: rc=$? ($((SECONDS - T0)) s)"; tail -3 "$OUT/streams.log"
W="indexer.PAGED_TOPK_DEFAULT={'sm_89':'p2r2048h11b6cw','sm_90':'p2r2048h11b6cw'}"
N2="backend_kernel.INDEXER_FUSED_MAX_NEXT_N=2"
A2="backend_kernel.BRANCH_MAIN_FIRST=('attn2','moe')"
timeout $(( $(left) - 70 )) python3 -m ds4lab.harness.step --tp 4 ${STEP_BATCHES:---batch 1 --batch 16} --ctx 8192 --mode plain --mode mtp \
  --arch sm89 --ab "$W" --ab "$W,$N2" --ab "$A2" --abba --out /tmp/s12/sm89 > "$OUT/step_sm89.log" 2>&1
echo "step sm89: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s12/sm89/decode_step.csv "$OUT/sm89.csv"
grep -E "^sm89" "$OUT/step_sm89.log" | cut -c1-150
[ "$(left)" -gt 50 ] && { timeout $(left) python3 scripts/gpu/idx_in_step.py --arch sm89 --cold \
  --rows p2s512,p2r2048h11b6c,p2r2048h11b6cw --out /tmp/s12/ins > "$OUT/ins.log" 2>&1
  echo "idx_in_step: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s12/ins/idx_in_step.csv "$OUT/ins.csv"; grep -A6 "us per call" "$OUT/ins.log"; }
echo "done ($((SECONDS - T0)) s)"
