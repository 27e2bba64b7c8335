#!/usr/bin/env bash
# Router gate + indexer q on the H200 (issue 20): the fused gate GEMV + sqrtsoftplus top-k
# (gate_sqrtsoftplus_topk, 1 launch) and the fused indexer q RoPE + FP8 quant (indexer_q_rope_quant,
# 1 launch) against the decode-step glue they replace (F.linear fp32 + sqrtsoftplus_topk: 4 launches;
# torch RoPE + per_token_group_quant_fp8 + mul: ~9 launches) and vLLM GateLinear's cuBLAS tier.
# Per build (native, then sm_89 assembled for the H200), each in its own process: numerics first
# (scripts/gpu/route_check.py: registry checks at test + TP=4 bench shapes, bit-identity with the
# glue, determinism, CUDA-graph replay of the arrival counter), then ds4lab bench (check, then time:
# CUDA graph, cold L2) at TP=4, T in {1, 2, 16, 32}.
# Rows: $OUT/bench.csv, $OUT/route_check_<build>.csv; logs $OUT/*_<build>.log; the table prints last.
# Run from a plain copy of the tree with the image's python3:  OUT=/some/dir bash scripts/gpu/route.sh
# Expected: ~50-60 s (per build: numerics ~10-15 s, bench ~15-20 s; timeouts 20 + 25 s cap it at ~95 s).
# Fail-soft: a failing check or build is reported, the rest still runs; exit 1 if anything failed.
#
# --gate: the fused gate alone, short (scripts/gpu/gate_fast.py): per build (sm89, then native)
# numerics of the default and of every rows-path candidate (gate5), then every candidate and the
# torch.mm(bf16 -> fp32) + sqrtsoftplus_topk pair timed at TP=4, T in {1, 2, 4, 8, 16} (m16: the token-spread
# rows r4w8t2 / r4w8 also at T 8 and 16, checked and timed next to e32k16w8 and the pair); sm89 also with
# the step's timer (CUPTI kernel durations, with and without an L2 + TLB thrash; T in {1, 2}). The
# kernels of both builds compile first (one process per build x candidate, 17 in parallel).
#   OUT=/some/dir bash scripts/gpu/route.sh --gate      Expected ~65-90 s (timeouts 25 + 45 + 30: at most 100 s).
# Rows: $OUT/bench.csv, $OUT/gate_fast_<build>.csv (numerics), $OUT/gate_steplike_sm89.csv.
set -u
: "${OUT:?set OUT to an output folder}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # caller-relative, before the cd below
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
export DS4LAB_GIT_SHA="${DS4LAB_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
rc=0
t0=$SECONDS
case "${1:-}" in ""|--gate) ;; *) echo "route.sh: unknown argument '$1' (expected none or --gate)" >&2; exit 2;; esac
if [ "${1:-}" = "--gate" ]; then
  # compile in parallel first (one process per build x candidate, each build's own triton cache;
  # no timing runs meanwhile), then numerics + timing per build from the warm caches
  pids=()
  for build in sm89 native; do
    extra=""; [ "$build" = sm89 ] && extra=e32k16   # timed step-like only (gate_fast.STEPLIKE_EXTRA)
    for cfg in default $extra $(python3 -c 'from ds4lab_kernels.moe_gate import DECODE_CANDIDATES as C; print(*C)'); do
      timeout 25 python3 scripts/gpu/gate_fast.py --arch "$build" --out "$OUT" --warm-only --config "$cfg" \
        > "$OUT/gate_warm_${build}_${cfg}.log" 2>&1 &
      pids+=($!)
    done
  done
  for p in "${pids[@]}"; do wait "$p" || echo "warm-up pid $p: exit $? (that build compiles inline)"; done
  echo "compiled: $((SECONDS - t0)) s"
  timeout 45 python3 scripts/gpu/gate_fast.py --arch sm89 --steplike --out "$OUT" > "$OUT/gate_fast_sm89.log" 2>&1 \
    || { echo "gate_fast --arch sm89: exit $?"; rc=1; }
  timeout 30 python3 scripts/gpu/gate_fast.py --arch native --out "$OUT" > "$OUT/gate_fast_native.log" 2>&1 \
    || { echo "gate_fast --arch native: exit $?"; rc=1; }
  for build in sm89 native; do
    echo "== $build: numerics =="; echo "PASS rows: $(grep -c '^PASS' "$OUT/gate_fast_${build}.log")"
    grep '^FAIL' "$OUT/gate_fast_${build}.log" | head -8
    tail -1 "$OUT/gate_fast_${build}.log"
  done
  sed -n '/^step-like timer/,/^sm89: numerics/p' "$OUT/gate_fast_sm89.log" | grep -v '^sm89: numerics' 
else
for build in native sm89; do
  timeout 20 python3 scripts/gpu/route_check.py --arch "$build" --out "$OUT" > "$OUT/route_check_${build}.log" 2>&1 \
    || { echo "route_check --arch $build: exit $?"; rc=1; }
  timeout 25 python3 -m ds4lab.harness.bench gate_sqrtsoftplus_topk indexer_q_rope_quant --tp 4 --arch "$build" \
    --out "$OUT" > "$OUT/bench_${build}.log" 2>&1 || { echo "bench --arch $build: exit $?"; rc=1; }
done
for build in native sm89; do
  echo "== $build: numerics =="; sed -n '/^build /,$p' "$OUT/route_check_${build}.log"; grep '^FAIL' "$OUT/route_check_${build}.log" | head -5
done
fi
python3 - "$OUT/bench.csv" <<'PY'
import csv, json, sys
try:
    rows = list(csv.DictReader(open(sys.argv[1])))
except OSError as e:
    sys.exit(f"no bench rows: {e}")
print(f"\n{'build':<7} {'kernel':<24} {'T':>3} {'impl':<32} {'config':<9} {'p50 us':>8} {'status':<6}")
best = {}
for r in rows:
    T = json.loads(r["shape"]).get("T")
    p = float(r["p50_us"]) if r["p50_us"] else float("nan")
    print(f"{r['build']:<7} {r['kernel']:<24} {T:>3} {r['impl']:<32} {r['config_label']:<9} {p:>8.2f} {r['status']:<6}")
    k = (r["build"], r["kernel"], T, "ds4lab" if r["impl"] == "ds4lab" else r["impl"])
    if r["status"] == "OK" and (k not in best or p < best[k]):
        best[k] = p
print(f"\n{'build':<7} {'kernel':<24} {'T':>3} {'fused best us':>13} {'vs baselines (speedup)'}")
for (b, k, T, impl), p in best.items():
    if impl != "ds4lab":
        continue
    others = ", ".join(f"{i} {q:.2f} ({q / p:.2f}x)" for (b2, k2, T2, i), q in best.items()
                       if (b2, k2, T2) == (b, k, T) and i != "ds4lab")
    print(f"{b:<7} {k:<24} {T:>3} {p:>13.2f} {others}")
PY
echo "total: $((SECONDS - t0)) s"
exit $rc
