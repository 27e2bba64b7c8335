#!/usr/bin/env bash
# Session 12, H200 call 2 (short form, after failed machine starts left ~12 device minutes; issue 20):
# numerics + kernel times of mhc16's seamt_d32 (T 1-32) and moe16's wide rows (T 16 and 32), then the step A/B at
# batch 16 (plain and MTP: 16 and 32 tokens, sm89 ABBA) of seamt for 5-32 tokens and of the wide MoE row.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s12/run2b.sh   (BUDGET s, default 420)
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
mkdir -p /tmp/s12
left() { echo $((${BUDGET:-420} - (SECONDS - T0))); }
MODE=seamt BUILDS=sm89 OUT=/tmp/s12/mhc timeout 100 bash scripts/gpu/mhc.sh > "$OUT/mhc.log" 2>&1
echo "mhc seamt: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s12/mhc/mhc_seamt_sm89.csv "$OUT/" 2>/dev/null
grep -E "numerics|FAIL" "$OUT/mhc.log" | head -8; tail -14 "$OUT/mhc.log"
MOE_SET=moe16 MOE_T="16 32" MOE_ROUTING=distinct OUT=/tmp/s12/moe timeout 80 bash scripts/gpu/moe.sh > "$OUT/moe.log" 2>&1
echo "moe16: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s12/moe/moe_bench.csv "$OUT/" 2>/dev/null
grep -E "biteq|numerics|FAIL" "$OUT/moe.log" | head -6; tail -40 "$OUT/moe.log"
ST="mhc.SEAM_DEFAULTS=((1,'seamr_d64'),(4,'seam1_d64'),(32,'seamt_d32'))"
MW="moe_w4a16.DECODE_ROW_WIDE='mmaq_n32s1xl_w2n128'"
ML="moe_w4a16.DECODE_ROW='mmaq_n64s2xl'"
timeout $(( $(left) - 3 )) python3 -m ds4lab.harness.step --tp 4 --batch 16 --ctx 8192 --mode plain --mode mtp \
  --arch sm89 --ab "$ST" --ab "$MW" --abba --out /tmp/s12/sm89 > "$OUT/step_sm89.log" 2>&1
echo "step sm89: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s12/sm89/decode_step.csv "$OUT/sm89.csv"
grep -E "^sm89" "$OUT/step_sm89.log" | cut -c1-150
echo "done ($((SECONDS - T0)) s)"
