#!/usr/bin/env bash
# Next session, device call 1 (issue 20; ~6 min, fail-soft parts), prepared in session 15:
#   1. Nsight Compute of the MoE's two launches (w13, then w2 + the top-k sum) at batch 16 under the step's routing
#      (pool19) and at batch 1, sm89: which half holds the ~68 us a layer, and its stall reasons (NOTES "Session 15
#      (lead)", Next);
#   2. the native batch-1 A/B of the narrow row session 15 shipped untimed natively (session 15's run4.sh);
#   3. the step with the shipped defaults, sm89 and native, batch 1 and 16, plain and MTP: the session's baseline.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s16/run1.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
. scripts/gpu/step_ab.sh   # step NAME TIMEOUT ARGS...
OUT="$OUT/ncu" timeout 200 bash scripts/gpu/ncu_decode.sh "fused_moe_w4a16:T=16,routing=pool19" "fused_moe_w4a16:T=16" \
  "fused_moe_w4a16:T=1" > "$OUT/ncu.log" 2>&1
echo "ncu: rc=$? ($((SECONDS - T0)) s)"; cut -c1-220 "$OUT/ncu.log" | tail -20
OUT="$OUT" timeout 160 bash results/issue20/s15/run4.sh
step defaults_sm89 130 --arch sm89 --batch 1 --batch 16 --mode plain --mode mtp
step defaults_native 130 --arch native --batch 1 --batch 16 --mode plain --mode mtp
echo "done ($((SECONDS - T0)) s)"
