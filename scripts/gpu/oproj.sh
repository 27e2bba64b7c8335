#!/usr/bin/env bash
# o_proj on the H200 (issue 20: <= 2 launches, <= 10 us at TP=4, T <= 8), from a plain copy of the
# tree with the image's python3 (torch 2.11, triton 3.6.0; no vLLM, nothing to install):
#   1. numerics first (sm_89 build): every o_proj candidate at TP=4 real shapes, T 1 and 8, every
#      case against the reference; per fused candidate the z-quant bit identity, determinism, tile
#      counters back at 0, CUDA-graph replay, kernels per call (scripts/gpu/oproj_check.py);
#   2. for each build (native, then sm_89 assembled for the H200; each its own process):
#      `python3 -m ds4lab.harness.bench o_proj --tp 4` at T 1/2/4/8/16 (DS4LAB_OPROJ_BENCH_T), every
#      candidate (fused, fused_s8, fused_zbf16, fused_auto, unfused = today's parts), each checked
#      against the reference before it is timed (baseline torch_bf16_upcast on the sm_89 build only);
#      rows -> $OUT/bench.csv;
#   3. the table last (p50 us per candidate x T, both builds).
# Usage: OUT=DIR bash scripts/gpu/oproj.sh     (~90-150 s, most of it Triton compiles; hard cap 5 min)
#   BUILDS="native sm89" (default), CHECK=0 skips step 1.
# Fail-soft: a failing step or build is reported and the rest still runs; exit 1 if any failed.
set -uo pipefail
OUT=${OUT:-${1:-results/oproj}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # caller-relative, before the cd below
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
BUILDS=${BUILDS:-native sm89}
export DS4LAB_OPROJ_BENCH_T=${DS4LAB_OPROJ_BENCH_T:-1,2,4,8,16}
export DS4LAB_GIT_SHA=${DS4LAB_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null | tee "$OUT/gpu.txt"
rc=0
t0=$SECONDS
if [ "${CHECK:-1}" != 0 ]; then
  timeout 60 python3 scripts/gpu/oproj_check.py --arch sm89 --out "$OUT" > "$OUT/oproj_check.log" 2>&1 \
    || { echo "NUMERICS CHECK FAILED or timed out (see oproj_check.log)"; rc=1; }
  tail -14 "$OUT/oproj_check.log"
  echo "check: $((SECONDS - t0)) s"
fi
for build in $BUILDS; do
  tb=$SECONDS
  extra=""; [ "$build" = native ] && extra=--no-baselines
  timeout 120 python3 -m ds4lab.harness.bench o_proj --tp 4 --arch "$build" --out "$OUT" $extra \
    > "$OUT/oproj_bench_$build.log" 2>&1 || { echo "BUILD $build: exit $? (see oproj_bench_$build.log)"; rc=1; }
  grep -E "FAIL|Error" "$OUT/oproj_bench_$build.log" | head -5
  echo "build $build: $((SECONDS - tb)) s"
done
python3 - "$OUT/bench.csv" <<'PY' || rc=1
import csv, json, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["kernel"] == "o_proj" and r["tp"] == "4"]
ts = sorted({json.loads(r["shape"])["T"] for r in rows})
cols = sorted({(r["build"], r["impl"] if r["impl"] != "ds4lab" else r["config_label"]) for r in rows})
print("o_proj TP=4 p50 us (cold L2, graph replay); FAIL = numerics failed, not timed")
print(f"{'build':<7} {'candidate':<18}" + "".join(f"{'T=' + str(t):>9}" for t in ts))
for b, c in cols:
    cell = {}
    for r in rows:
        if r["build"] == b and (r["impl"] if r["impl"] != "ds4lab" else r["config_label"]) == c:
            cell[json.loads(r["shape"])["T"]] = f"{float(r['p50_us']):.2f}" if r["status"] == "OK" and r["p50_us"] else r["status"][:8]
    print(f"{b:<7} {c:<18}" + "".join(f"{cell.get(t, '-'):>9}" for t in ts))
PY
echo "total: $((SECONDS - t0)) s"
exit $rc
