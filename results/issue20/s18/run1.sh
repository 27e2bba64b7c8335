#!/usr/bin/env bash
# Session 18, device call 1 (issue 20; ~8 min, fail-soft parts, most decisive first): session 17's persistent w13
# launch (rows mmaq_n64p8xl*) and session 18's one-launch MoE (rows mmaq_n64f8xl*: the persistent w13 units, then
# w2 units that wait for their tile's h; every program resident, 3 CTAs an SM).
#   1. the kernel bench, sm89, T = 1 and 16, routing pool19 (the step's) and distinct, numerics first: the two grid
#      defaults beside the persistent rows (moe_a), then the fused rows beside the wide default (moe_b: apart, so a
#      hang of the new spin-wait costs only its own part);
#   2. the step, sm89, batch 1 and 16, plain and MTP, ABBA: all three decode rows fused when moe_b passed its
#      numerics, else all three persistent (session 18 had ~17 minutes of device time left for one call).
# Call 2 (run2.sh) times the fused rows in the step and runs Nsight Compute.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> [SKIP_A=1] bash results/issue20/s18/run1.sh   (SKIP_A: no moe_a, ~2.5 min less)
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
. scripts/gpu/step_ab.sh   # step NAME TIMEOUT ARGS...
[ "${SKIP_A:-0}" = 1 ] || MOE_LABELS="mmaq_n64s4xl mmaq_n64p8xl mmaq_n64s4xl_w2n128 mmaq_n64p8xl_w2n128" MOE_BUILDS=sm89 MOE_BUILD_TIMEOUT=150 \
  MOE_T="1 16" MOE_PEER=0 MOE_ROUTING="pool19 distinct" MOE_NUMERICS_T=16 \
  MOE_BITEQ="mmaq_n64s4xl mmaq_n64p8xl=- mmaq_n64p8xl_w2n128=-" OUT="$OUT/moe_a" \
  bash scripts/gpu/moe.sh > "$OUT/moe_a.log" 2>&1
echo "moe_a: rc=$? ($((SECONDS - T0)) s)"; grep -E "biteq|FAIL" "$OUT/moe_a.log" | head -4; tail -14 "$OUT/moe_a.log"
MOE_LABELS="mmaq_n64s4xl_w2n128 mmaq_n64f8xl mmaq_n64f8xl_w2n128" MOE_BUILDS=sm89 MOE_BUILD_TIMEOUT=120 \
  MOE_T="1 16" MOE_PEER=0 MOE_ROUTING="pool19 distinct" MOE_NUMERICS_T=16 \
  MOE_BITEQ="mmaq_n64s4xl_w2n128 mmaq_n64f8xl=- mmaq_n64f8xl_w2n128=-" OUT="$OUT/moe_b" \
  bash scripts/gpu/moe.sh > "$OUT/moe_b.log" 2>&1
echo "moe_b: rc=$? ($((SECONDS - T0)) s)"; grep -E "biteq|FAIL" "$OUT/moe_b.log" | head -4; tail -12 "$OUT/moe_b.log"
P="moe_w4a16.DECODE_ROW_NARROW='mmaq_n64p8xl',moe_w4a16.DECODE_ROW={'sm_89': 'mmaq_n64p8xl', 'sm_90': 'mmaq_n64s4xl'},moe_w4a16.DECODE_ROW_WIDE={'sm_89': 'mmaq_n64p8xl_w2n128', 'sm_90': 'mmaq_n64s4xl_w2n128'}"
F="moe_w4a16.DECODE_ROW_NARROW='mmaq_n64f8xl',moe_w4a16.DECODE_ROW={'sm_89': 'mmaq_n64f8xl', 'sm_90': 'mmaq_n64s4xl'},moe_w4a16.DECODE_ROW_WIDE={'sm_89': 'mmaq_n64f8xl_w2n128', 'sm_90': 'mmaq_n64s4xl_w2n128'}"
# the fused rows' step when their bench part passed its numerics (no FAIL line, a timed f8xl row), else the persistent
if ! grep -q FAIL "$OUT/moe_b.log" && grep -q "mmaq_n64f8xl_w2n128" "$OUT/moe_b/moe_bench.csv" 2>/dev/null; then
  step fused_sm89 250 --arch sm89 --batch 1 --batch 16 --mode plain --mode mtp --abba --ab "$F"
else
  step persist_sm89 250 --arch sm89 --batch 1 --batch 16 --mode plain --mode mtp --abba --ab "$P"
fi
echo "done ($((SECONDS - T0)) s)"
