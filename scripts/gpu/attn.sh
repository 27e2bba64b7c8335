#!/usr/bin/env bash
# Issue 20, sparse MLA decode (attn5: the one-pass / fused split merge), on the H200 from a plain copy of
# the tree with the image's python3 (torch 2.11, triton 3.6.0; no vLLM, nothing to install):
#   1. numerics: scripts/gpu/attn_check.py, one process per (build, table row) in parallel so the Triton
#      compiles overlap (16 cores): every row at T=1 (C4A, C128A 8K/128K; 16 and 64 heads) and T=2/16
#      (16 heads) x every registry case vs the fp64 reference, 3 calls bit-equal, the fused merge's
#      arrival counters zero afterwards, CUDA-graph replays of the fused rows == eager;
#   2. timing, one process per build (--arch native, then --arch sm89; the check filled the Triton
#      cache): `ds4lab.harness.bench sparse_mla_decode --tp 1 --tp 4` with DS4LAB_BENCH_SHAPES=issue20
#      (T=1 x 3 shapes at TP=1 and TP=4, T=2/16 x C4A/C128A-8K at TP=4), every candidate row next to
#      h16n16m1 and h16n16 (check-then-time), dequant-gather-bmm as the baseline;
#   3. the table last (per shape: best row per build, us, vs the 8 us target) and the DEFAULTS lines the
#      winners imply: `python3 scripts/gpu/attn_pick.py $OUT/bench.csv [--write]`; CSV in $OUT/bench.csv.
# Usage: OUT=DIR bash scripts/gpu/attn.sh      Expected ~100-150 s (check ~40-60 s in parallel, bench
#   ~30-45 s per build). TOPK=1 also checks and times top-k (+~60 s); TESTS=1 runs the sparse MLA test
#   file on the GPU first (native build, +~60 s). Fail-soft: every step runs; exit 1 if any failed.
set -uo pipefail
OUT=${OUT:-${1:-results}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # caller-relative, before the cd below
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
export DS4LAB_GIT_SHA=${DS4LAB_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export DS4LAB_BENCH_SHAPES=issue20
rc=0
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
if [ "${TESTS:-0}" = 1 ] && python3 -c "import pytest" 2>/dev/null; then
  files="tests/test_sparse_mla.py tests/test_sparse_mla_merge.py"
  [ "${TOPK:-0}" = 1 ] && files="$files tests/test_topk.py tests/test_topk_r3.py"
  timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -x -p no:cacheprovider $files > "$OUT/attn_tests.log" 2>&1 \
    || { echo "TESTS FAILED (attn_tests.log)"; rc=1; }
  tail -3 "$OUT/attn_tests.log"
fi
tb=$SECONDS
pids=()
for arch in native sm89; do
  table=$([ $arch = native ] && echo sm_90 || echo sm_89)
  rows=$(python3 -c "import sys; sys.path.insert(0, '.'); from ds4lab_kernels.sparse_mla import CONFIGS; print(*CONFIGS['$table'], 'default')")
  for row in $rows; do
    timeout ${CHECK_TIMEOUT:-150} python3 scripts/gpu/attn_check.py --arch $arch --configs $row \
      > "$OUT/attn_check_${arch}_$row.log" 2>&1 &
    pids+=("$!:$arch:$row")
  done
  if [ "${TOPK:-0}" = 1 ]; then
    timeout ${CHECK_TIMEOUT:-150} python3 scripts/gpu/attn_check.py --arch $arch --topk --configs none \
      > "$OUT/attn_check_${arch}_topk.log" 2>&1 &
    pids+=("$!:$arch:topk")
  fi
done
for p in "${pids[@]}"; do
  IFS=: read -r pid arch row <<< "$p"
  wait "$pid" || { echo "CHECK $arch $row FAILED (attn_check_${arch}_$row.log)"; rc=1; }
  grep -hE "^FAIL" "$OUT/attn_check_${arch}_$row.log" | head -4
done
for f in "$OUT"/attn_check_*.log; do echo "  $(basename "$f" .log): $(tail -1 "$f")"; done
echo "check (parallel): $((SECONDS - tb)) s"
kernels=sparse_mla_decode
[ "${TOPK:-0}" = 1 ] && kernels="topk_indices sparse_mla_decode"
for arch in native sm89; do
  tb=$SECONDS
  timeout ${BENCH_TIMEOUT:-200} python3 -m ds4lab.harness.bench $kernels --tp 1 --tp 4 \
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
