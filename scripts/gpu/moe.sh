#!/usr/bin/env bash
# W4A16 MoE decode on the H200 (issue 20, moe5), from a plain copy of the tree with the image's python3
# (torch 2.11, triton 3.6.0; no vLLM). For each build (sm_89 first: the step's build; then native; one
# process each): numerics first (every timed ds4lab row, every adversarial case of MOE_CASES, the real
# TP=4 shape at T=16), then the rows of MOE_LABELS (default: the decode rows pick_config returns (session 15): mmaq_n64s4xl up to
# 95 pairs, mmaq_n64s4xl_w2n128 from 96; with mmaq_n64s2x, the old row),
# and vLLM's Triton fused_moe_kernel_gptq_awq at its two best configs of the last run (m16n32k128w4s4:
# T=1; m16n32k64w2s4: T=4/16; loaded from PEER_SRC, a copy of vLLM's source: `make peer-src` writes
# .peer/), timed with the bench's timer (CUDA graph, cold L2 by rotating weight sets) at TP=4,
# T = 1, 16, 4. Rows -> $OUT/moe_bench.csv (appended as measured), logs -> $OUT/moe_<build>.log; the
# table last. Usage: OUT=DIR [PEER_SRC=DIR] bash scripts/gpu/moe.sh     ~112-160 s (80 s per build: 62 s cut the sm89 T=4 rows in session 5); fail-soft per build.
# Knobs (env): MOE_BUILDS (default "sm89 native"), MOE_T (default "1 16 4"), MOE_PEER=0 (no peer rows),
# MOE_BITEQ=LABEL (every other row must give LABEL's bits: numerics cases in both output modes and each T's
# set 0; "biteq ... FAIL" lines below), MOE_NUMERICS_T (default 16), MOE_BUILD_TIMEOUT (s per build, 80).
# e.g. candidate rows against the narrow default, sm89 build only, T=1 and 2, ~90-120 s:
#   MOE_LABELS="mmaq_n64s4x <rows>" MOE_BUILDS=sm89 MOE_T="1 2" MOE_PEER=0 MOE_BITEQ=mmaq_n64s4x \
#   MOE_BUILD_TIMEOUT=170 OUT=$OUT bash scripts/gpu/moe.sh
# MOE_BITEQ may name per-row references: "REF ROW=REF2 ROW3=-" (ROW3: no bit check). MOE_ROUTING (default
# "distinct"; "distinct uniform" also times each T with tokens' top-k drawn independently, as random routing).
# MOE_SET=moe16 (issue 20, 16-32 tokens): the wide-row candidates beside the two defaults, sm89 build, T=1 4 16 32,
# both routings, no peer, bit checks (l rows vs the default, n32s1xl vs n64s1xl), ~100-140 s:
#   MOE_SET=moe16 OUT=$OUT bash scripts/gpu/moe.sh
set -uo pipefail
if [ "${MOE_SET:-}" = moe16 ]; then
  MOE_LABELS=${MOE_LABELS-mmaq_n64s4x mmaq_n64s2x mmaq_n64s2xl mmaq_n64s2xl_w2n128 mmaq_n64s1xl_w2n128 mmaq_n32s1xl_w2n128 mmaq_n32s1xl_w2n128s4}
  MOE_BUILDS=${MOE_BUILDS:-sm89}
  MOE_T=${MOE_T:-1 4 16 32}
  MOE_PEER=${MOE_PEER:-0}
  MOE_ROUTING=${MOE_ROUTING:-distinct uniform}
  MOE_BITEQ=${MOE_BITEQ-mmaq_n64s2x mmaq_n64s4x=- mmaq_n64s1xl_w2n128=- mmaq_n32s1xl_w2n128=mmaq_n64s1xl_w2n128 mmaq_n32s1xl_w2n128s4=mmaq_n64s1xl_w2n128}
  MOE_BUILD_TIMEOUT=${MOE_BUILD_TIMEOUT:-170}
fi
OUT=${OUT:-${1:-results/local/moe}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # caller-relative, before the cd below
[ -n "${PEER_SRC:-}" ] && [ -d "$PEER_SRC" ] && PEER_SRC=$(cd "$PEER_SRC" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
export DS4LAB_GIT_SHA=${DS4LAB_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
PEER_SRC=${PEER_SRC:-}
[ -z "$PEER_SRC" ] && [ -d .peer/vllm ] && PEER_SRC=.peer
peer_arg=()
[ -n "$PEER_SRC" ] && peer_arg=(--peer-src "$PEER_SRC")
[ -z "$PEER_SRC" ] && echo "moe.sh: no PEER_SRC and no .peer/: the vLLM peer rows will be missing (installed vllm if any)"
# the rows timed: today's defaults (the narrow row up to 12 pairs, the decode row above, the wide row from 96) against the peer;
# the other mmaq_* rows were timed in sessions 5 and 9 (NOTES moe5, moe9). MOE_LABELS="" times every default +
# mmaq_* row (session 5: over the 80 s build limit).
MOE_LABELS=${MOE_LABELS-mmaq_n64s4xl mmaq_n64s4xl_w2n128 mmaq_n64s2x}
MOE_BUILDS=${MOE_BUILDS:-sm89 native}
MOE_T=${MOE_T:-1 16 4}
extra=(--numerics-t "${MOE_NUMERICS_T:-16}")
[ "${MOE_PEER:-1}" = 0 ] && extra+=(--no-peer)
[ -n "${MOE_BITEQ:-}" ] && extra+=(--biteq $MOE_BITEQ)
[ -n "${MOE_ROUTING:-}" ] && extra+=(--routing $MOE_ROUTING)
rc=0
t0=$SECONDS
for arch in $MOE_BUILDS; do
  timeout ${MOE_BUILD_TIMEOUT:-80} python3 -m ds4lab.harness.moe_bench --arch "$arch" --tp 4 --T $MOE_T \
    ${MOE_LABELS:+--labels $MOE_LABELS} --peer-configs m16n32k128w4s4 m16n32k64w2s4 --straw-max-t 0 \
    "${extra[@]}" --out "$OUT" "${peer_arg[@]}" > "$OUT/moe_$arch.log" 2>&1 || { echo "FAILED or cut short: build $arch (rc $?)"; rc=1; }
  grep -E "^numerics .*FAIL|^biteq .*FAIL|^FAIL|^ERROR|^peer" "$OUT/moe_$arch.log" | cut -c1-220
  echo "biteq checks passed: $(grep -cE '^biteq .*PASS' "$OUT/moe_$arch.log"), failed: $(grep -cE '^biteq .*FAIL' "$OUT/moe_$arch.log")"
  echo "build $arch done at $((SECONDS - t0)) s"
done
echo
[ -f "$OUT/moe_bench.csv" ] && python3 -m ds4lab.harness.moe_bench --table "$OUT/moe_bench.csv"
exit $rc
