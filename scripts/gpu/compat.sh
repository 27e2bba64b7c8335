#!/usr/bin/env bash
# Compat APIs on the H200 (issue 21): numerics of every ds4lab_kernels.compat function at
# DeepSeek-V4-Flash shapes (TP 4 and 1) against the references, then compat vs native launcher timed
# with ds4lab bench's timer (CUDA graph, 8 input sets: cold L2), native build then the sm_89 build.
# Rows: $OUT/compat.csv (bench.FIELDS provenance), logs: $OUT/compat_<build>.log; a table prints last.
# Run from a plain copy of the tree with the image's python3:  OUT=/some/dir bash scripts/gpu/compat.sh
# Expected: ~2-3 min (each build capped at 115 s; one failing case or build does not stop the rest).
set -u
: "${OUT:?set OUT to an output folder}"
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export DS4LAB_GIT_SHA="${DS4LAB_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
rc=0
for build in native sm89; do
  timeout 115 python3 -m ds4lab.harness.compat_bench --arch "$build" --tp 4 1 --out "$OUT" \
    > "$OUT/compat_${build}.log" 2>&1 || { echo "compat_bench --arch $build: exit $?"; rc=1; }
done
for build in native sm89; do echo "== $build =="; tail -n 40 "$OUT/compat_${build}.log" | sed -n '/^kernel /,$p'; done
exit $rc
