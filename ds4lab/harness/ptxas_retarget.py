#!/usr/bin/env python3
"""ptxas wrapper that assembles an sm_89 Triton build for the local (newer) GPU.

Used by ``ds4lab bench --arch sm89`` via ``TRITON_PTXAS_PATH``: Triton lowers the kernel exactly as
for Ada (``TRITON_OVERRIDE_ARCH=sm89``: mma.sync/QMMA, no wgmma/TMA) and calls this script as its
ptxas; we rewrite ``--gpu-name=sm_89`` and the PTX ``.target`` line to ``DS4LAB_RETARGET`` (default
sm_90) and run the triton wheel's real ptxas. ``--version`` passes straight through.
"""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile


def _real_ptxas() -> str:
    # set by ds4lab.harness.bench; else the triton wheel's ptxas, located without importing triton
    if os.environ.get("DS4LAB_REAL_PTXAS"):
        return os.environ["DS4LAB_REAL_PTXAS"]
    spec = importlib.util.find_spec("triton")
    if spec is None:
        sys.exit("ptxas_retarget: set DS4LAB_REAL_PTXAS or run with a python that has triton")
    return os.path.join(spec.submodule_search_locations[0], "backends", "nvidia", "bin", "ptxas")


REAL = _real_ptxas()
TARGET = os.environ.get("DS4LAB_RETARGET", "sm_90")

args = sys.argv[1:]
out = []
tmp = None
for a in args:
    if a.startswith("--gpu-name="):
        a = f"--gpu-name={TARGET}"
    elif a.endswith(".ptx") and os.path.exists(a):
        src = open(a).read()
        src = re.sub(r"^\.target\s+sm_\d+a?", f".target {TARGET}", src, count=1, flags=re.M)
        fd, tmp = tempfile.mkstemp(suffix=".ptx")
        with os.fdopen(fd, "w") as f:
            f.write(src)
        a = tmp
    out.append(a)
try:
    rc = subprocess.call([REAL] + out)
finally:
    if tmp:
        os.remove(tmp)
sys.exit(rc)
