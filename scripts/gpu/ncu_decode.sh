#!/usr/bin/env bash
# Nsight Compute counters of the decode step's largest kernels at batch 1 (issue 20): duration without
# launch overhead, DRAM throughput, occupancy, registers, top warp-stall reasons, per launch.
# Usage: OUT=DIR bash scripts/gpu/ncu_decode.sh [CASE ...]   (cases: scripts/gpu/ncu_decode.py --help)
#   BUILDS="sm89" (default; "native sm89" for both). ~20-40 s a build (ncu replays each launch ~40x).
# Writes $OUT/ncu_<build>.csv (ncu --page raw) and prints the digest (scripts/gpu/ncu_digest.py).
# Needs the Firecracker runtime (KINDS.md: ncu reads counters there; not on gVisor). Clocks left alone.
set -uo pipefail
OUT=${OUT:-results/ncu}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 2; }
rc=0
for build in ${BUILDS:-sm89}; do
  # compile outside the profiler first (ncu slows every API call), then profile the one marked call
  timeout 300 python3 scripts/gpu/ncu_decode.py --arch "$build" "$@" > "$OUT/warm_$build.log" 2>&1 \
    || { echo "warm-up $build failed (warm_$build.log)"; tail -5 "$OUT/warm_$build.log"; rc=1; }
  timeout 400 "$NCU" --profile-from-start off --clock-control none --cache-control all \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --csv --page raw \
    python3 scripts/gpu/ncu_decode.py --arch "$build" "$@" > "$OUT/ncu_$build.csv" 2> "$OUT/ncu_$build.err" \
    || { echo "ncu $build: exit $? (ncu_$build.err)"; tail -5 "$OUT/ncu_$build.err"; rc=1; }
  python3 scripts/gpu/ncu_digest.py "$OUT/ncu_$build.csv" | tee "$OUT/digest_$build.txt" || rc=1
done
exit $rc
