#!/usr/bin/env bash
# The decode step on the H200 (issue 19 item 3), from a plain copy of the tree with the image's own
# python3 (torch 2.11, triton 3.6.0; no vLLM, no Jupyter, nothing to install):
#   1. the model's real-shape check (layer 0 SWA, 2 C4A, 3 C128A of a TP=4 rank vs the reference) at
#      batch 2 x next_n 2 (MTP verify) and batch 4 x next_n 1 (plain decode),
#   2. `ds4lab step` for each build (native, then sm_89 assembled for the H200), each in its own
#      process (the build is chosen before triton is imported), rows -> $OUT/decode_step.csv,
#   3. the table last.
# Usage: OUT=DIR bash scripts/gpu/step.sh
#   MODE=smoke (default: batch 1 and 16, ctx 8k and 32k, plain + MTP, TP=4; ~2-3 min a build)
#   MODE=full  (batch 1/4/8/16, ctx 8k/32k/128k; one build per 10-minute run: BUILDS=sm89 MODE=full)
#   BUILDS="native sm89" (default), TPS="4" (e.g. "4 8"), STEP_TIMEOUT (s, per build)
#   RETIME_MOE=1: also re-time fused_moe_w4a16 at TP4 with the cold-L2 set count (rows -> $OUT/bench.csv)
#   BENCH_GLUE=1: also check + time the norm_rope family (rmsnorm_rope, swiglu_clamp) at TP4 (~1 min a build)
#   BENCH_MAPS=1: also check + time step_index_maps (one launch) vs its torch reference at TP4 (~30 s a build)
#   STEP_ARGS: the points instead of the MODE's (e.g. "--batch 1 --batch 16 --ctx 8192")
#   AB="A;B;...": A/B variants of switches, each a comma list of MODULE.NAME=VALUE (ds4lab.harness.switches):
#      every point is timed with the defaults, then once per variant (one model build and cache fill);
#      ABBA=1: then again in reverse order (--abba; ab_table averages: a drift over the run cancels)
#   CHECK_SETS="A;B": after the default model check, one more check per comma list of settings (--set)
# Fail-soft: a failing check or build is reported and the rest still runs; exit 1 if any failed.
set -uo pipefail
OUT=${OUT:-${1:-results}}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
MODE=${MODE:-smoke}
BUILDS=${BUILDS:-native sm89}
TPS=${TPS:-4}
if [ "$MODE" = smoke ]; then flag=--smoke; limit=${STEP_TIMEOUT:-200}; else flag=; limit=${STEP_TIMEOUT:-560}; fi
tp_args=""; for t in $TPS; do tp_args="$tp_args --tp $t"; done
[ -n "${STEP_ARGS:-}" ] && flag=$STEP_ARGS
ab_args=(); IFS=';' read -r -a abs <<< "${AB:-}"; for v in "${abs[@]}"; do [ -n "$v" ] && ab_args+=(--ab "$v"); done
[ "${ABBA:-0}" = 1 ] && [ ${#ab_args[@]} -gt 0 ] && ab_args+=(--abba)
export DS4LAB_GIT_SHA=${DS4LAB_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
rc=0
t0=$SECONDS
# 1. numerics first: the model's layers at real shapes against the reference twin
if python3 -c "import ds4lab.model.check" 2>/dev/null; then
  timeout ${CHECK_TIMEOUT:-150} python3 -m ds4lab.model.check --tp 4 --layers 0 2 3 > "$OUT/model_check.log" 2>&1 \
    || { echo "MODEL CHECK FAILED (see model_check.log)"; rc=1; }
  tail -20 "$OUT/model_check.log"
  # plain decode (next_n 1) with several requests: the C128A layer failed there on the H200 while batch 2 x
  # next_n 2 passed (session 7), so every run checks both shapes
  timeout ${CHECK_TIMEOUT:-150} python3 -m ds4lab.model.check --tp 4 --layers 0 2 3 --batch 4 --next-n 1 \
    > "$OUT/model_check_n1.log" 2>&1 || { echo "MODEL CHECK FAILED at batch 4 x next_n 1 (see model_check_n1.log)"; rc=1; }
  echo "== check at batch 4 x next_n 1"; tail -8 "$OUT/model_check_n1.log"
  IFS=';' read -r -a csets <<< "${CHECK_SETS:-}"
  for i in "${!csets[@]}"; do
    set_args=(); IFS=',' read -r -a kv <<< "${csets[$i]}"; for x in "${kv[@]}"; do set_args+=(--set "$x"); done
    timeout ${CHECK_TIMEOUT:-150} python3 -m ds4lab.model.check --tp 4 --layers 0 2 3 ${CHECK_ARGS:-} "${set_args[@]}" \
      > "$OUT/model_check_set$i.log" 2>&1 || { echo "MODEL CHECK FAILED with ${csets[$i]} (model_check_set$i.log)"; rc=1; }
    echo "== check with ${csets[$i]} ${CHECK_ARGS:-}"; tail -8 "$OUT/model_check_set$i.log"
  done
else
  echo "ds4lab.model.check is not in this tree: real-shape check NOT run" | tee "$OUT/model_check.log"; rc=1
fi
echo "check: $((SECONDS - t0)) s"
# 2. the step, one process per build
for build in $BUILDS; do
  tb=$SECONDS
  timeout $limit python3 -m ds4lab.harness.step $flag $tp_args --arch $build --out "$OUT" "${ab_args[@]}" \
    > "$OUT/step_$build.log" 2>&1 || { echo "STEP $build: exit $? (see step_$build.log)"; rc=1; }
  grep -E "roofs|built|p50|ERROR|Traceback|Error|rows ->" "$OUT/step_$build.log" | tail -40
  echo "step $build: $((SECONDS - tb)) s"
done
# optional: re-time the MoE rows with the cold-L2 rotation of issue 19 item 4 (bench.n_sets)
if [ "${RETIME_MOE:-0}" = 1 ]; then
  for build in $BUILDS; do
    timeout ${MOE_TIMEOUT:-120} python3 -m ds4lab.harness.bench fused_moe_w4a16 --tp 4 --arch $build --out "$OUT" \
      > "$OUT/moe_$build.log" 2>&1 || { echo "MOE $build: exit $?"; rc=1; }
    grep -E "fused_moe|FAIL|Error" "$OUT/moe_$build.log" | tail -12
  done
fi
# optional: the norm_rope glue kernels against the torch glue they replaced (issue 19, `glue`)
if [ "${BENCH_GLUE:-0}" = 1 ]; then
  for build in $BUILDS; do
    timeout ${GLUE_TIMEOUT:-120} python3 -m ds4lab.harness.bench norm_rope --tp 4 --arch $build --out "$OUT" \
      > "$OUT/glue_$build.log" 2>&1 || { echo "GLUE $build: exit $?"; rc=1; }
    grep -E "rmsnorm_rope|swiglu_clamp|FAIL|Error" "$OUT/glue_$build.log" | tail -30
  done
fi
# optional: the step's index maps in one launch against the torch reference it replaced (issue 20, `maps6`)
if [ "${BENCH_MAPS:-0}" = 1 ]; then
  for build in $BUILDS; do
    timeout ${MAPS_TIMEOUT:-90} python3 -m ds4lab.harness.bench step_maps --tp 4 --arch $build --out "$OUT" \
      > "$OUT/maps_$build.log" 2>&1 || { echo "MAPS $build: exit $?"; rc=1; }
    grep -E "step_index_maps|FAIL|Error" "$OUT/maps_$build.log" | tail -30
  done
fi
# 3. the table
python3 - "$OUT/decode_step.csv" <<'PY'
import sys
from ds4lab.harness.step import ab_table, load_rows, summary_table
from ds4lab.tables import format_table
rows = load_rows(sys.argv[1])
print(format_table(summary_table(rows), digits=4))
ab = ab_table(rows)
if ab:   # the A/B variants against their run's defaults (d_p50_us: every point is timed before any profiling, NOTES "cupti"; d_groups_us double-counts what two streams overlap)
    print(format_table(ab, digits=5))
PY
echo "total: $((SECONDS - t0)) s"
exit $rc
