#!/usr/bin/env bash
# Issue 22 item 2 on the H200: run the kernel notebooks 01-06 live (papermill, smoke parameters) with
# the image's own python3 (torch + triton, no Jupyter, no plotly: the notebooks show tables only),
# from a plain copy of the tree that carries .whl/ (papermill, nbclient, nbformat, ipykernel and their
# dependencies; download them with the command in the header of scripts/gpu/wheels.txt).
# Writes under $OUT: tour/ (executed notebooks, index.html, summary.json: the evidence to commit),
# local/ (the live bench rows, results/local/*/bench.csv, same columns as results/bench.csv), logs.
# Expected runtime: ~4-5 minutes (numerics 2 shapes per kernel, one smoke shape per kernel timed for
# the native and the sm_89 build; the compile report is skipped: it is the CPU machine's job).
# Usage: OUT=/some/dir bash scripts/gpu/notebooks.sh
set -u
OUT=${OUT:?set OUT to an output folder}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export DS4LAB_GIT_SHA=${DS4LAB_GIT_SHA:-$(cat .git_sha 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
t0=$(date +%s)
if ! ls .whl/*.whl >/dev/null 2>&1; then echo "no .whl/ wheels in this copy" >&2; exit 2; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || { echo "wheel install failed:"; tail -20 "$OUT/pip.log"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import papermill, nbclient, ipykernel, zmq, tornado; print('papermill', papermill.__version__, '| ipykernel', ipykernel.__version__)" || exit 2
python3 -c "import torch; print(torch.cuda.get_device_name(0), torch.__version__)" || exit 2
echo "set-up $(( $(date +%s) - t0 )) s"
# one papermill run per notebook inside the tour (kernel python3 = this interpreter via ipykernel)
python3 -m ds4lab tour 01 02 03 04 05 06 --out "$OUT/tour" --kernel python3 --timeout 500 \
  -p max_shapes=2 -p compile_report=false -p shapes=smoke -p tp=1 2>&1 | tee "$OUT/tour.log"
rc=${PIPESTATUS[0]}
mkdir -p "$OUT/local" && cp -r results/local/. "$OUT/local/" 2>/dev/null
echo "local rows: $(cat "$OUT"/local/*/bench.csv 2>/dev/null | grep -vc '^timestamp')"
echo "total $(( $(date +%s) - t0 )) s, tour exit $rc"
exit $rc
