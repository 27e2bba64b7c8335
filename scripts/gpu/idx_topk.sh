#!/usr/bin/env bash
# Paged indexer logits + top-k in ONE launch on the H200 (issue 20, idx6): fp8_paged_mqa_topk against
# the decode step's two-launch path (fp8_paged_mqa_logits + topk_indices; at N > 4095 topk_indices is
# itself the 3-launch r3 split), the paged logits + torch.topk, and either top-k alone on the same logits.
# Per build (sm_89 assembled for the H200 first, then native), each in its own process: numerics
# (scripts/gpu/idx_topk_check.py: indices equal to the two-launch path's and the workspace equal to
# the paged logits bit for bit at R = B*next_n in {1, 2, 16, 32}, N in {2048, 8192}, every case and
# config row; the registry check; torch.topk's set; CUDA-graph replay with the counters back at 0), then
# ds4lab bench (check, then time: CUDA graph, cold L2 rotation) of fp8_paged_mqa_topk: every config
# row of the build's table plus the baselines two_launch / paged+torch_topk / torch_topk_only /
# topk_indices_only / two_launch_r2048 / topk_r2048_only (the last two: topk's register-select row
# b1024r2048c, NOTES.md "idx10c"; it was the unrolled b1024r2048 until that row was removed), at the same 14 shapes.
# Rows: $OUT/bench.csv, $OUT/idx_topk_check_<build>.csv; logs $OUT/*_<build>.log; the table prints last.
# Run from a plain copy of the tree with the image's python3:  OUT=/some/dir bash scripts/gpu/idx_topk.sh
# Expected: ~60-80 s (numerics of both builds in parallel ~15-25 s, then a bench per build ~20-25 s;
# session 10 added 2 config rows and 2 baselines, so the timeouts are 60 + 2 x 60 s, ~180 s at most).
# The register-select row is p2r2048h11b6cw (idx10w, the sm_89 default; the graph check replays it too: its
# warmer's scratch lives in the arrivals buffer); the superseded register rows of idx10 / idx10c / idx10w
# (p2r2048b6, p2r2048h11b6, p2r2048b6c, p2r2048h11b6c, p2r2048b6cw) were removed (git history). Timeouts 90 + 90 s.
#   BUILDS="sm89" to time one build only.
#   ROWS="p2s512,p2r2048h11b6cw": check and time these config rows only (no baselines; one bench process
#   per row, ~15 s each).
# Fail-soft: a failing check or build is reported, the rest still runs; exit 1 if anything failed.
set -u
: "${OUT:?set OUT to an output folder}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # caller-relative, before the cd below
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
export DS4LAB_GIT_SHA="${DS4LAB_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
BUILDS=${BUILDS:-sm89 native}
ROWS=${ROWS:-}
rc=0
t0=$SECONDS
# numerics of both builds in parallel (compile-bound; each build has its own triton cache, which the
# bench then finds warm), then the benches one at a time (the GPU to themselves)
pids=()
for build in $BUILDS; do
  timeout 90 python3 scripts/gpu/idx_topk_check.py --arch "$build" --out "$OUT" ${ROWS:+--rows "$ROWS"} \
    > "$OUT/idx_topk_check_${build}.log" 2>&1 &
  pids+=($!)
done
i=0
for build in $BUILDS; do
  wait "${pids[$i]}" || { echo "idx_topk_check --arch $build: exit $?"; rc=1; }
  i=$((i + 1))
done
echo "numerics: $((SECONDS - t0)) s"
for build in $BUILDS; do
  if [ -n "$ROWS" ]; then
    for row in ${ROWS//,/ }; do
      timeout 60 python3 -m ds4lab.harness.bench fp8_paged_mqa_topk --tp 4 --arch "$build" --config "$row" \
        --no-baselines --out "$OUT" >> "$OUT/bench_${build}.log" 2>&1 || { echo "bench --arch $build $row: exit $?"; rc=1; }
    done
  else
    timeout 90 python3 -m ds4lab.harness.bench fp8_paged_mqa_topk --tp 4 --arch "$build" \
      --out "$OUT" > "$OUT/bench_${build}.log" 2>&1 || { echo "bench --arch $build: exit $?"; rc=1; }
  fi
done
for build in $BUILDS; do
  echo "== $build: numerics =="; sed -n '/^build /,$p' "$OUT/idx_topk_check_${build}.log"
  grep '^FAIL' "$OUT/idx_topk_check_${build}.log" | head -5
done
python3 - "$OUT/bench.csv" <<'PY'
import csv, json, sys
try:
    rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["kernel"] == "fp8_paged_mqa_topk"]
except OSError as e:
    sys.exit(f"no bench rows: {e}")
best, labels = {}, set()
for r in rows:
    s = json.loads(r["shape"])
    key = (r["build"], s["B"], s["next_n"], s["ctx"])
    p = float(r["p50_us"]) if r["p50_us"] else float("nan")
    name = r["config_label"] if r["impl"] == "ds4lab" else r["impl"]
    if r["status"] == "OK":
        best.setdefault(key, {})[name] = p
        if r["impl"] == "ds4lab":
            labels.add(name)
print(f"\n{'build':<7} {'R':>3} {'B':>3} {'nn':>2} {'N':>5}  {'fused best':<16} {'two_launch':>10} {'speedup':>7}  others (us)")
for (b, B, nn, N), d in best.items():
    fused = {n: p for n, p in d.items() if n in labels}     # the config rows; the rest are baselines
    if not fused:
        continue
    lb, p = min(fused.items(), key=lambda kv: kv[1])
    two = d.get("two_launch", float("nan"))
    others = ", ".join(f"{n} {q:.2f}" for n, q in sorted(d.items()) if n != lb)
    print(f"{b:<7} {B * nn:>3} {B:>3} {nn:>2} {N:>5}  {lb + ' ' + format(p, '.2f'):<16} {two:>10.2f} {two / p:>6.2f}x  {others}")
# the streaming p2s512 against the code-warming register row (the sm_89 default); a row not run shows nan
cols = ["p2s512", "p2r2048h11b6cw"]
print(f"\n{'build':<7} {'B':>3} {'nn':>2} {'N':>5}  " + " ".join(f"{c:>14}" for c in cols) + "   (us, p50)")
for (b, B, nn, N), d in best.items():
    print(f"{b:<7} {B:>3} {nn:>2} {N:>5}  " + " ".join(f"{d.get(c, float('nan')):14.2f}" for c in cols))
PY
echo "total: $((SECONDS - t0)) s"
exit $rc
