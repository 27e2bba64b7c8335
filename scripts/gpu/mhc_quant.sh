#!/usr/bin/env bash
# pq-mhc (issue 20): mhc_fused_post_pre(quant_out=True) on the H200, from a plain copy of the tree:
#   1. numerics: tests/test_mhc_quant_out.py on the GPU (every step row T 1..32 and forced rows at D=256: the
#      one-launch seams with their grid sync, so each 128-column group's programs meet for real);
#   2. per build: scripts/gpu/mhc_quant.py (D=4096, the step's row per T: check, then p50 off / on / the
#      standalone quant, kernels per call).
# Usage: OUT=DIR bash scripts/gpu/mhc_quant.sh    (BUILDS="sm89 native" default)
set -uo pipefail
OUT=${OUT:-${1:-results}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
rc=0
timeout ${CHECK_TIMEOUT:-240} python3 -m pytest tests/test_mhc_quant_out.py -q -p no:cacheprovider \
  > "$OUT/mhc_quant_check.log" 2>&1 || { echo "QUANT_OUT NUMERICS FAILED (see mhc_quant_check.log)"; rc=1; }
tail -3 "$OUT/mhc_quant_check.log"
for build in ${BUILDS:-sm89 native}; do
  timeout ${BENCH_TIMEOUT:-150} python3 scripts/gpu/mhc_quant.py --arch "$build" 2>&1 | tee "$OUT/mhc_quant_$build.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "mhc_quant.py $build failed"; rc=1; }
done
exit $rc
