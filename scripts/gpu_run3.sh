#!/usr/bin/env bash
# H200 run 3 (see NOTES.md): GPU numerics with full log, native rows for the kernels that failed or
# were missing in run 2, and the sm_89 build (a third of the shapes) of every kernel.
set -uo pipefail
OUT=$1
cd "$(dirname "$0")/.."
TEST_TIMEOUT=200 BUILDS=native BENCH_TIMEOUT=170 bash scripts/gpu_suite.sh "$OUT" fp8_mqa_logits fp8_paged_mqa_logits o_proj \
  hc_prenorm_gemm mhc_pre mhc_pre_broadcast mhc_post mhc_fused_post_pre hc_head sqrtsoftplus_topk fused_moe_w4a16
SKIP_TESTS=1 BUILDS=sm89 BENCH_TIMEOUT=190 BENCH_ARGS=--quick bash scripts/gpu_suite.sh "$OUT"
