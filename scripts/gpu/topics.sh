#!/usr/bin/env bash
# Several scripts/gpu/<topic>.sh in one H200 call (the device budget favours few, full calls).
# Usage: OUT=DIR TOPICS="gemm moe mhc route" bash scripts/gpu/topics.sh
#   each topic runs as `OUT=$OUT/<topic> bash scripts/gpu/<topic>.sh` under its own time limit
#   (TOPIC_TIMEOUT s, default 170), fail-soft: a failing or slow topic is reported, the rest still run.
#   PEER_SRC (default .peer when that folder exists): vLLM's peer source for the benches (`make peer-src`).
set -uo pipefail
OUT=${OUT:-results/gpu}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # OUT and PEER_SRC are relative to the caller's folder
[ -n "${PEER_SRC:-}" ] && [ -d "$PEER_SRC" ] && PEER_SRC=$(cd "$PEER_SRC" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
if [ -z "${PEER_SRC:-}" ] && [ -d .peer/vllm ]; then export PEER_SRC=$PWD/.peer; fi
[ -n "${PEER_SRC:-}" ] && export DS4LAB_PEER_SRC=$PEER_SRC
export DS4LAB_GIT_SHA=${DS4LAB_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
rc=0
n=0; for t in ${TOPICS:?set TOPICS, e.g. TOPICS="gemm moe"}; do n=$((n + 1)); done
if [ $((n * ${TOPIC_TIMEOUT:-170})) -gt "${CALL_BUDGET:-560}" ]; then
  echo "topics.sh: $n topics x TOPIC_TIMEOUT=${TOPIC_TIMEOUT:-170} s can exceed CALL_BUDGET=${CALL_BUDGET:-560} s" \
       "(a device call's limit is 600 s): split TOPICS over several calls, or lower TOPIC_TIMEOUT" >&2
  [ "${ALLOW_LONG:-0}" = 1 ] || exit 2
fi
for t in $TOPICS; do
  s=scripts/gpu/$t.sh
  if [ ! -f "$s" ]; then echo "== $t: no $s"; rc=1; continue; fi
  t0=$SECONDS
  echo "== $t"
  OUT="$OUT/$t" timeout "${TOPIC_TIMEOUT:-170}" bash "$s" > "$OUT/$t.log" 2>&1 || { echo "$t: exit $?"; rc=1; }
  tail -n "${TAIL:-40}" "$OUT/$t.log"
  echo "== $t: $((SECONDS - t0)) s"
done
exit $rc
