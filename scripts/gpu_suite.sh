#!/usr/bin/env bash
# The whole GPU suite on the H200 benchmark machine, from a plain copy of the tree with the image's
# own python3 (torch 2.11, triton 3.6.0; no vLLM/plotly there):
#   1. numerics of every registered kernel on the GPU (pytest registry sweep + family tests),
#   2. native (sm_90) benchmark rows, 3. the sm_89 build of every kernel assembled for the H200.
# Usage: bash scripts/gpu_suite.sh OUTDIR [kernel ...]   (CSV rows -> OUTDIR/bench.csv)
set -uo pipefail
OUT=${1:-results}; shift || true
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m "not vllm and not notebook and not aot" \
    --tb=short tests/test_kernels_registry.py $(ls tests/test_*.py | grep -E "fp8|o_proj|indexer|topk|mla|mhc|moe" ) \
    > "$OUT/gpu_tests.log" 2>&1 || rc=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -60
fi
for build in ${BUILDS:-native sm89}; do
  extra=""; [ "$build" = sm89 ] && extra="--no-baselines"
  timeout ${BENCH_TIMEOUT:-300} python3 -m ds4lab.harness.bench "$@" --arch $build $extra --out "$OUT" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench_$build.log" | grep -E "FAIL|ERROR|rows ->|roofs|Traceback|Error" | tail -40 || rc=1
done
exit $rc
