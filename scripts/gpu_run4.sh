#!/usr/bin/env bash
# H200 run 4 (NOTES.md): GPU numerics after the run-3 fixes; native rows for the kernels with new
# candidate configs (sparse_mla_decode, topk_indices, fused_moe_w4a16, mhc); sm_89 rows for the
# kernels run 3 did not reach (o_proj family, sparse MLA, top-k).
set -uo pipefail
OUT=$1
cd "$(dirname "$0")/.."
TEST_TIMEOUT=170 BUILDS=native BENCH_TIMEOUT=170 bash scripts/gpu_suite.sh "$OUT" sparse_mla_decode topk_indices \
  fused_moe_w4a16 mhc_fused_post_pre hc_prenorm_gemm
SKIP_TESTS=1 BUILDS=sm89 BENCH_TIMEOUT=110 bash scripts/gpu_suite.sh "$OUT" o_proj sparse_mla_decode sparse_mla_prefill topk_indices
