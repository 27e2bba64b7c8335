#!/usr/bin/env bash
# Issue 20, attention side, on the H200 from a plain copy of the tree with the image's python3
# (torch 2.11, triton 3.6.0; no vLLM, nothing to install):
#   1. numerics: scripts/gpu/attn_check.py per build (every r3 top-k row x target shapes x every case, exact
#      indices, 3 calls each + offsets; sparse MLA T=1 C4A/C128A through every row's merge);
#   2. timing, one process per build (--arch native, --arch sm89): `ds4lab.harness.bench
#      topk_indices sparse_mla_decode --tp 1 --tp 4`, every candidate row (check-then-time), T=1
#      sparse MLA shapes only (DS4LAB_BENCH_SHAPES=targets), torch.topk / dequant-gather-bmm next to them;
#   3. the table last (per shape: best config per build, us, vs torch.topk / target) and the
#      DEFAULTS lines the winners imply: `python3 scripts/gpu/attn_pick.py $OUT/bench.csv [--write]`.
# Usage: OUT=DIR bash scripts/gpu/attn.sh      Expected ~2-2.5 min (mostly first compiles; the check
#   and the bench share the Triton cache). TESTS=1 also runs the top-k / sparse MLA test files on the
#   GPU first (native build, +~1 min). Fail-soft: every step runs; exit 1 if any failed.
set -uo pipefail
OUT=${OUT:-${1:-results}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # caller-relative, before the cd below
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
export DS4LAB_GIT_SHA=${DS4LAB_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export DS4LAB_BENCH_SHAPES=targets
rc=0
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
if [ "${TESTS:-0}" = 1 ] && python3 -c "import pytest" 2>/dev/null; then
  timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -x -p no:cacheprovider tests/test_topk.py tests/test_topk_r3.py \
    tests/test_sparse_mla.py > "$OUT/attn_tests.log" 2>&1 || { echo "TESTS FAILED (attn_tests.log)"; rc=1; }
  tail -3 "$OUT/attn_tests.log"
else
  echo "test files skipped (TESTS=1 runs them; attn_check.py runs either way)"
fi
echo "tests: $((SECONDS - t0)) s"
for arch in native sm89; do
  tb=$SECONDS
  timeout ${CHECK_TIMEOUT:-120} python3 scripts/gpu/attn_check.py --arch $arch > "$OUT/attn_check_$arch.log" 2>&1 \
    || { echo "CHECK $arch FAILED (attn_check_$arch.log)"; rc=1; }
  grep -E "FAIL|PASS|configs x" "$OUT/attn_check_$arch.log" | tail -12
  echo "check $arch: $((SECONDS - tb)) s"
done
for arch in native sm89; do
  tb=$SECONDS
  timeout ${BENCH_TIMEOUT:-200} python3 -m ds4lab.harness.bench topk_indices sparse_mla_decode --tp 1 --tp 4 \
    --arch $arch --out "$OUT" > "$OUT/attn_bench_$arch.log" 2>&1 || { echo "BENCH $arch: exit $? (attn_bench_$arch.log)"; rc=1; }
  grep -E "FAIL|Error|Traceback" "$OUT/attn_bench_$arch.log" | head -10
  echo "bench $arch: $((SECONDS - tb)) s"
done
if [ -f "$OUT/bench.csv" ]; then
  python3 scripts/gpu/attn_pick.py "$OUT/bench.csv" > "$OUT/attn_table.txt" || { echo "attn_pick failed"; rc=1; }
  cat "$OUT/attn_table.txt"
fi
echo "total: $((SECONDS - t0)) s"
exit $rc
