#!/usr/bin/env bash
# Session 12, H200 call 2 (issue 20): mhc16's one-launch token-parallel seam (seamt_d32): numerics at T 1-32 and
# kernel times beside decode / seam1_d64 / seamr_d64; moe16's wide W4A16 rows (MOE_SET=moe16: numerics + bench at
# T 1-32); the step A/B (sm89 ABBA, batch 1 and 16, plain and MTP) of seamt for 2-32 tokens and of two moe16 rows.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s12/run2.sh   (BUDGET s, default 570)
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
mkdir -p /tmp/s12
left() { echo $((${BUDGET:-570} - (SECONDS - T0))); }
MODE=seamt BUILDS=sm89 OUT=/tmp/s12/mhc timeout 120 bash scripts/gpu/mhc.sh > "$OUT/mhc.log" 2>&1
echo "mhc seamt: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s12/mhc/mhc_seamt_sm89.csv "$OUT/" 2>/dev/null
grep -E "numerics|FAIL" "$OUT/mhc.log" | head -8; tail -14 "$OUT/mhc.log"
MOE_SET=moe16 OUT=/tmp/s12/moe timeout 150 bash scripts/gpu/moe.sh > "$OUT/moe.log" 2>&1
echo "moe16: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s12/moe/moe_bench.csv "$OUT/" 2>/dev/null
grep -E "biteq|numerics|FAIL" "$OUT/moe.log" | head -6; grep -A12 -E "^T=(16|32)" "$OUT/moe.log" | head -60
ST="mhc.SEAM_DEFAULTS=((1,'seamr_d64'),(32,'seamt_d32'))"
MW="moe_w4a16.DECODE_ROW_WIDE='mmaq_n32s1xl_w2n128'"
ML="moe_w4a16.DECODE_ROW='mmaq_n64s2xl'"
timeout $(( $(left) - 60 )) python3 -m ds4lab.harness.step --tp 4 --batch 1 --batch 16 --ctx 8192 --mode plain --mode mtp \
  --arch sm89 --ab "$ST" --ab "$MW" --ab "$ML" --abba --out /tmp/s12/sm89 > "$OUT/step_sm89.log" 2>&1
echo "step sm89: rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s12/sm89/decode_step.csv "$OUT/sm89.csv"
grep -E "^sm89" "$OUT/step_sm89.log" | cut -c1-150
[ "$(left)" -gt 45 ] && { timeout $(( $(left) - 3 )) python3 -m ds4lab.harness.step --tp 4 --batch 1 --batch 16 --ctx 8192 \
  --mode plain --mode mtp --arch native --out /tmp/s12/native > "$OUT/step_native.log" 2>&1
  echo "step native (defaults): rc=$? ($((SECONDS - T0)) s)"; cp /tmp/s12/native/decode_step.csv "$OUT/native.csv"
  grep -E "^native" "$OUT/step_native.log" | cut -c1-150; }
echo "done ($((SECONDS - T0)) s)"
