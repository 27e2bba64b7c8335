#!/usr/bin/env bash
# Several real-shape model checks (`python3 -m ds4lab.model.check --tp 4 --layers 0 2 3 ...`) on the H200 in
# parallel (compile-bound on the CPU; each is ~35 s of one process), e.g. to find which candidate switch
# breaks a layer: one check per ';'-separated entry of CHECKS, each entry the extra arguments (--batch,
# --next-n, --set MODULE.NAME=VALUE ...; ds4lab.harness.switches).
# Usage: OUT=DIR CHECKS="--batch 4 --next-n 1;--batch 4 --next-n 1 --set backend_kernel.COMPRESS_ONE_LAUNCH=True" \
#          bash scripts/gpu/checks.sh          logs: $OUT/check_<i>.log; exit 1 if any check failed.
set -uo pipefail
: "${OUT:?set OUT to an output folder}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
IFS=';' read -r -a entries <<< "${CHECKS:?set CHECKS (see the header)}"
pids=()
for i in "${!entries[@]}"; do
  # shellcheck disable=SC2086  # each entry is a list of arguments
  timeout "${CHECK_TIMEOUT:-150}" python3 -m ds4lab.model.check --tp 4 --layers 0 2 3 ${entries[$i]} > "$OUT/check_$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!entries[@]}"; do
  wait "${pids[$i]}"; r=$?
  [ $r = 0 ] || rc=1
  echo "== check $i (exit $r): ${entries[$i]}"
  grep -E "^layer [0-9]+ \(|^MODEL CHECK|Error|Traceback" "$OUT/check_$i.log" | cut -c1-200
done
exit $rc
