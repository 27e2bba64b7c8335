#!/usr/bin/env bash
# mHC decode seam on the H200 (issue 20: mhc_fused_post_pre <= 5 us at T=1, Sinkhorn off the critical path),
# from a plain copy of the tree with the image's python3 (torch 2.11, triton 3.6.0; nothing to install):
#   1. numerics: scripts/gpu/mhc_check.py (every seamr_* row at T 1..16, seam1_d64 at T 1/2/4, decode at 1/2; every
#      input case incl. x2, D=4096, vs the float64 reference; sync self-reset over eager repeats and
#      graph replays), ~60-80 s on a fresh machine (the 60 s limit of session 5 cut its last rows: now 90 s);
#   2. for each build (native, then sm_89 assembled for the H200), its own process:
#      `python3 -m ds4lab.harness.bench mhc_fused_post_pre --tp 4 --arch B --no-baselines --out $OUT`
#      (check-then-time at TP=4: decode and every seamr_* row at T in {1, 2, 4, 8, 16}, seam1_d64 at
#      {1, 2, 4}; cold L2, CUDA-graph replay), ~30 + ~55 s;
#   3. the table last (p50 us per config x T x build), also written to $OUT/mhc_table.csv; raw rows in
#      $OUT/bench.csv.
# Usage: OUT=DIR bash scripts/gpu/mhc.sh    (BUILDS="native sm89" default; 156 s measured on a fresh machine)
# MODE=seamt (issue 20, mhc16): instead, per build one process of scripts/gpu/mhc_seamt.py: numerics of every
#   seamt_* row at T = 1, 2, 4, 8, 16, 32 (quant_out, fp64 reference, graph replays), then p50 of decode, seam1_d64,
#   seamr_d64 and the seamt rows at those T (quant_out, cold L2, CUDA graph); table + $OUT/mhc_seamt_<build>.csv.
#   `MODE=seamt BUILDS=sm89 OUT=DIR bash scripts/gpu/mhc.sh`: ~60-110 s on a fresh machine (predicted).
# Fail-soft: a failing step is reported and the rest still runs; exit 1 if any failed.
set -uo pipefail
OUT=${OUT:-${1:-results}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # caller-relative, before the cd below
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export DS4LAB_GIT_SHA=${DS4LAB_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
BUILDS=${BUILDS:-native sm89}
rc=0
t0=$SECONDS
if [ "${MODE:-}" = seamt ]; then
  for build in $BUILDS; do
    timeout ${SEAMT_TIMEOUT:-170} python3 scripts/gpu/mhc_seamt.py --arch "$build" --out "$OUT" 2>&1 \
      | tee "$OUT/mhc_seamt_$build.log" | grep -E "^FAIL|numerics|^config|^(decode|seam|T=)|rows ->" \
      || { echo "SEAMT $build: failed or timed out (see mhc_seamt_$build.log)"; rc=1; }
    grep -q "0 failing" "$OUT/mhc_seamt_$build.log" || rc=1
  done
  echo "total: $((SECONDS - t0)) s"
  exit $rc
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
timeout ${CHECK_TIMEOUT:-90} python3 scripts/gpu/mhc_check.py > "$OUT/mhc_check.log" 2>&1 \
  || { echo "MHC NUMERICS FAILED or timed out (see mhc_check.log)"; rc=1; }
grep -E "^FAIL|numerics:" "$OUT/mhc_check.log" | tail -15
echo "numerics: $((SECONDS - t0)) s"
for build in $BUILDS; do
  t1=$SECONDS
  timeout ${BENCH_TIMEOUT:-75} python3 -m ds4lab.harness.bench mhc_fused_post_pre --tp 4 --arch "$build" \
    --no-baselines --out "$OUT" > "$OUT/bench_$build.log" 2>&1 \
    || { echo "BENCH $build: rc=$? (see bench_$build.log)"; rc=1; }
  grep -E "FAIL|rows ->" "$OUT/bench_$build.log" | tail -8
  echo "bench $build: $((SECONDS - t1)) s"
done
echo "total: $((SECONDS - t0)) s"
python3 - "$OUT/bench.csv" "$OUT/mhc_table.csv" <<'PY' || rc=1
import csv, json, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["kernel"] == "mhc_fused_post_pre" and r["tp"] == "4"]
cell = {}
for r in rows:
    T = json.loads(r["shape"])["T"]
    cell[(r["build"], r["config_label"], T)] = r["p50_us"] if r["status"] == "OK" else r["status"]
Ts = sorted({k[2] for k in cell})
keys = sorted({(k[0], k[1]) for k in cell})
with open(sys.argv[2], "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["build", "config"] + [f"p50_us_T{t}" for t in Ts])
    for b, c in keys:
        w.writerow([b, c] + [cell.get((b, c, t), "") for t in Ts])
print(f"\nmhc_fused_post_pre TP=4, p50 us (cold L2, graph replay); target <= 5 us at T=1; '-' = not timed "
      f"(seam1_* rows run `decode` above 4 tokens; seamr_* rows: one launch up to 16)")
print(f"{'build':<7} {'config':<13}" + "".join(f"{'T=' + str(t):>9}" for t in Ts))
for b, c in keys:
    print(f"{b:<7} {c:<13}" + "".join(f"{cell.get((b, c, t), '-'):>9}" for t in Ts))
PY
exit $rc
