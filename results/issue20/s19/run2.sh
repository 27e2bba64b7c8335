#!/usr/bin/env bash
# Session 19, device call 2 (issue 20; ~7 min): sparse MLA with the merge in the split launch (rows h16n16m1f / h16n16f).
#   1. the kernel bench, sm89, TP=4, the T=1 target shapes, every row (check, then time; h16n16m1 is the default);
#   2. the step, sm89, batch 1 and 16, plain and MTP, ABBA: the f rows as sparse MLA's sm_89 defaults;
#   3. ncu of the T=1 C4A decode, both rows.
# Usage (device): OUT=DIR DS4LAB_GIT_SHA=<sha> bash results/issue20/s19/run2.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.."
T0=$SECONDS
. scripts/gpu/step_ab.sh   # step NAME TIMEOUT ARGS...
mkdir -p "$OUT/mla"
DS4LAB_BENCH_SHAPES=targets timeout 200 python3 -m ds4lab.harness.bench sparse_mla_decode --tp 4 --arch sm89 \
  --out "$OUT/mla" > "$OUT/mla_bench.log" 2>&1
echo "mla bench: rc=$? ($((SECONDS - T0)) s)"; grep -E "FAIL|Error|Traceback" "$OUT/mla_bench.log" | head -5
python3 - "$OUT/mla/bench.csv" <<'PY' || true
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    print(r["impl"], r["config_label"], r["shape"][:70], r["p50_us"], r["status"], r["numerics"][:30])
PY
M="sparse_mla.DEFAULTS={'sm_89': ((16, 2, 'h16n16m1f'), (None, None, 'h16n16f')), 'sm_90': ((16, 2, 'h16n16m1'), (None, 1, 'h16n16m1'), (16, None, 'h16n16'), (None, None, 'h32n32'))}"
step mla_fused_sm89 250 --arch sm89 --batch 1 --batch 16 --mode plain --mode mtp --abba --ab "$M"
OUT="$OUT/ncu" timeout 90 bash scripts/gpu/ncu_decode.sh "sparse_mla_decode:T=1,row=h16n16m1f" \
  "sparse_mla_decode:T=1,row=h16n16m1" > "$OUT/ncu.log" 2>&1
echo "ncu: rc=$? ($((SECONDS - T0)) s)"; cut -c1-220 "$OUT/ncu.log" | tail -8
echo "done ($((SECONDS - T0)) s)"
