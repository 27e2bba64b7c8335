#!/usr/bin/env bash
# Session 11, H200 call 2 (issue 20): qidx's GPU checks (fused == the two launches bit for bit; the tiny C4A
# layer's logits on == off) + bench; the step A/B of the stream order / priority at batch 1 and 16, plain and MTP
# (ABBA); then the idx10c cold-code probe and the moeh kernel rows while time is left.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s11/run2.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
left() { echo $((575 - (SECONDS - T0))); }
OUT=$OUT/q bash scripts/gpu/qidx.sh > "$OUT/qidx.log" 2>&1; echo "qidx.sh: rc=$? ($((SECONDS - T0)) s)"; tail -25 "$OUT/qidx.log"
PRIO="backend_kernel.BRANCH_PRIORITY=True"
MAINF="backend_kernel.BRANCH_MAIN_FIRST=('attn','moe')"
timeout $(( $(left) - 150 )) python3 -m ds4lab.harness.step --tp 4 --batch 1 --batch 16 --ctx 8192 --mode plain --mode mtp \
  --arch sm89 --ab "$PRIO" --ab "$MAINF" --ab "$PRIO,$MAINF" --abba --out "$OUT" > "$OUT/step.log" 2>&1
echo "step: rc=$? ($((SECONDS - T0)) s)"; grep -E "^sm89|rows ->" "$OUT/step.log" | cut -c1-200
[ "$(left)" -gt 80 ] && { timeout $(( $(left) - 5 )) python3 scripts/gpu/idx_in_step.py --arch sm89 --cold \
  --rows p2s512,p2r2048h11b6,p2r2048h11b6c,p2r2048b6c --out "$OUT/ins" > "$OUT/idx_in_step.log" 2>&1
  echo "idx_in_step: rc=$? ($((SECONDS - T0)) s)"; tail -30 "$OUT/idx_in_step.log"; }
echo "done ($((SECONDS - T0)) s)"
