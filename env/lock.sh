#!/usr/bin/env bash
# Resolve env/requirements-cpu.in into env/requirements-cpu.lock in a scratch venv.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
python3.11 -m venv "$tmp/v"
"$tmp/v/bin/pip" install -q "pip==25.3"
"$tmp/v/bin/pip" install -q -r env/requirements-cpu.in
{ echo "# Exact closure for env/requirements-cpu.in on CPython 3.11 x86-64. Installed with"
  echo "#   pip install --no-deps --only-binary=:all: -r env/requirements-cpu.lock"
  echo "# so nothing outside this list can be resolved in. Regenerate: make lock."
  "$tmp/v/bin/pip" freeze --all --exclude-editable | grep -v "^pip==" | grep -viE '^(torchvision|torchaudio|torchcodec)==' ; } > env/requirements-cpu.lock
rm -rf "$tmp"
echo "wrote env/requirements-cpu.lock"
