#!/usr/bin/env bash
# Decode FP8 GEMM on the H200 (issue 20, "FP8 GEMM, decode"), from a plain copy of the tree with the
# image's own python3 (torch 2.11, triton 3.6.0; no vLLM, nothing to install):
#   1. numerics: fp8_gemm_nt and w8a8_block_fp8_linear (fused 1x128 quant) at every registry test
#      shape x adversarial case, against the torch reference, at the default configs and every
#      config in CONFIGS, plus the SwiGLU-prologue launcher on NaN / inf / beyond-clamp gate-up rows;
#   2. for each build (default sm89 only: the sm_89 build assembled for the H200), one process:
#      `python3 -m ds4lab.harness.gemm_sweep` at the TP=4 shapes, M in {1,4,16,32}: ours (the current
#      defaults and the candidates: the CUDA-core GEMV row gemv_w8 at M <= 4, the scale-prefetch MMA rows
#      decode_pf / decode_64pf, m16's fused-quant rows fq_16x32 / fq_16x64 (the fused launch's default at
#      3..32 tokens); fused-quant and plain), the quant+gemm pair at pick_config's row, for shared_down also the SwiGLU-prologue launcher
#      (ds4lab_fused+act) against swiglu_clamp + the linear (ds4lab_act+fused, today's step),
#      vLLM's Triton block-FP8 GEMM at the three configs that won anywhere in the session-4 7-config
#      sweeps (16x32_w4_s4, 16x32_w2_s5, 16x64_w4_s4), cuBLAS tensorwise / bf16 dequant as labelled
#      reference points; every candidate is checked before it is timed (CUDA graph, cold L2);
#   3. the table last: ours best vs peer best, ratio, per build / shape / M.
# Usage: OUT=DIR bash scripts/gpu/gemm.sh [--peer-src DIR]     (or PEER_SRC=DIR; default: ./.peer if
#   present, made by `make peer-src` and carried as an ignored folder). Without the peer source the
#   sweep says so in its log and CSV (SKIP rows) and times the rest.
#   BUILDS="sm89" (default; "sm89 native" adds the sm_90 build, about +70 s), MS=1,4,16,32,
#   BUILD_TIMEOUT (s, default 95), CHECK_TIMEOUT (s, 40), CONFIGS=label,label (ours and the peer's;
#   quant+gemm always; default: the list below; CONFIGS=all: every candidate and every peer config),
#   NO_BASELINES=1 (skip cuBLAS / bf16 dequant). Expected: ~100-140 s in all on the H200 (hard cap 40 + 95 s + the table).
# Rows -> $OUT/gemm_decode.csv (appended as measured), logs -> $OUT/gemm_*.log, table -> $OUT/gemm_table.txt.
# Fail-soft: a failing candidate, check or build is reported and the rest still runs; exit 1 if any failed.
set -uo pipefail
OUT=${OUT:-results}
PEER_SRC=${PEER_SRC:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --peer-src) PEER_SRC=$2; shift 2;;
    --peer-src=*) PEER_SRC=${1#*=}; shift;;
    *) echo "gemm.sh: unknown argument $1" >&2; exit 2;;
  esac
done
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # OUT and PEER_SRC are relative to the caller's folder
[ -n "$PEER_SRC" ] && [ -d "$PEER_SRC" ] && PEER_SRC=$(cd "$PEER_SRC" && pwd)
cd "$(dirname "$0")/../.."
if [ -z "$PEER_SRC" ] && [ -d .peer/vllm ]; then PEER_SRC=.peer; fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export DS4LAB_GIT_SHA=${DS4LAB_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
BUILDS=${BUILDS:-sm89}
MS=${MS:-1,4,16,32}
# m16: the rows that won or served a default somewhere in session 5 plus the fused-quant rows fq_16x32 /
# fq_16x64 (the fused launch's default at 3..32 tokens); dropped from the default list (still in CONFIGS=all):
# gemv / gemv_p8 / gemv_r4 (lost at M=4), decode_16x128 and decode_32x32_pf (never best), so that
# MS=4,8,16,32 BUILDS="sm89 native" stays within ~120 s
DEFAULT_CONFIGS=decode,decode_16x64,decode_32x32,decode_pf,decode_64pf,gemv_w8,fq_16x32,fq_16x64,16x32_w4_s4,16x32_w2_s5,16x64_w4_s4
CONFIGS=${CONFIGS:-$DEFAULT_CONFIGS}
peer_args=""; [ -n "$PEER_SRC" ] && peer_args="--peer-src $PEER_SRC"
[ "$CONFIGS" != all ] && peer_args="$peer_args --configs $CONFIGS"
[ -n "${NO_BASELINES:-}" ] && peer_args="$peer_args --no-baselines"
echo "peer source: ${PEER_SRC:-<installed vllm, if any>}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
rc=0
t0=$SECONDS
# 1. numerics first
timeout ${CHECK_TIMEOUT:-40} python3 -m ds4lab.harness.gemm_sweep --check ${CONFIGS:+--configs $CONFIGS} > "$OUT/gemm_check.log" 2>&1 \
  || { echo "NUMERICS CHECK FAILED or timed out (see gemm_check.log)"; rc=1; }
grep -E "FAIL|numerics:|Error" "$OUT/gemm_check.log" | tail -12
echo "check: $((SECONDS - t0)) s"
# 2. the sweep, one process per build
for build in $BUILDS; do
  tb=$SECONDS
  timeout ${BUILD_TIMEOUT:-95} python3 -m ds4lab.harness.gemm_sweep --arch $build --ms "$MS" --out "$OUT" $peer_args \
    > "$OUT/gemm_$build.log" 2>&1 || { echo "SWEEP $build: exit $? (see gemm_$build.log; rows so far are in the CSV)"; rc=1; }
  grep -E "peer:|precompile|FAIL|Traceback|Error|rows ->" "$OUT/gemm_$build.log" | tail -15
  echo "sweep $build: $((SECONDS - tb)) s"
done
# 3. the table
python3 -m ds4lab.harness.gemm_sweep --table "$OUT/gemm_decode.csv" | tee "$OUT/gemm_table.txt" || rc=1
echo "total: $((SECONDS - t0)) s"
exit $rc
