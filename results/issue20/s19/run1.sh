#!/usr/bin/env bash
# Session 19, device call 1 (issue 20; ~7 min, fail-soft parts, most decisive first):
#   1. the one-launch MoE (rows mmaq_n64f8xl*, session 18) and the decode step with it: results/issue20/s18/run1.sh
#      with SKIP_A=1 (its fused kernel bench at T = 1 and 16 with numerics, then the step ABBA at batch 1 and 16,
#      plain and MTP, fused rows against the defaults; the persistent rows' step if the fused numerics fail);
#   2. sparse MLA with the merge in the split launch (rows h16n16m1f / h16n16f, session 19): its test file on the GPU
#      (bit-equal to the two-launch path with the real cross-program waits; a hang is cut at 150 s).
# Call 2 (run2.sh) times the merge rows and their step.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s19/run1.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
OUT="$OUT/moe" SKIP_A=1 bash results/issue20/s18/run1.sh
echo "moe part: ($((SECONDS - T0)) s)"
mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_sparse_mla_fused_merge.py > "$OUT/mla_tests.log" 2>&1
echo "mla tests: rc=$? ($((SECONDS - T0)) s)"; tail -4 "$OUT/mla_tests.log"
echo "done ($((SECONDS - T0)) s)"
