"""The GPU catalogue (SPEC.md §4): the cards the planner knows and :func:`resolve_gpu`."""
from __future__ import annotations

from dataclasses import dataclass

from ds4lab.planner.terms import GiB, MiB

__all__ = ["GPU", "GPUS", "resolve_gpu"]


# ---------------------------------------------------------------------------------------------
# Hardware table (SPEC.md §4). Totals are what the driver reports (nvidia-smi "Total", MiB), the
# number vLLM multiplies by gpu_memory_utilization; pass gpu_bytes to override.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    """One card: ``total_bytes`` is the driver-reported total (what vLLM's util multiplies)."""
    key: str
    name: str
    total_bytes: int
    sm: str
    source: str


GPUS: dict[str, GPU] = {g.key: g for g in (
    GPU("rtx4090", "RTX 4090 24 GB", 24564 * MiB, "sm_89", "SPEC.md §4; nvidia-smi total 24564 MiB"),
    GPU("rtx4090-48g", "RTX 4090D 48 GB (modded)", 49140 * MiB, "sm_89",
        "SPEC.md §4 ('4090D 48G' mods); assumed same total as RTX 6000 Ada"),
    GPU("rtx6000ada", "RTX 6000 Ada 48 GB", 49140 * MiB, "sm_89", "SPEC.md §4; nvidia-smi total 49140 MiB"),
    GPU("l40s", "L40S 48 GB", 46068 * MiB, "sm_89", "SPEC.md §4; nvidia-smi total 46068 MiB"),
    GPU("h200", "H200 141 GB", 143771 * MiB, "sm_90", "SPEC.md §4 (measured card); nvidia-smi total 143771 MiB"),
)}


#: other spellings of the keys (notebook 09 / SPEC.md names, spaces and case are ignored)
_GPU_ALIASES = {"rtx4090-24g": "rtx4090", "4090": "rtx4090", "rtx4090d-48g": "rtx4090-48g",
                "4090d-48g": "rtx4090-48g", "4090-48g": "rtx4090-48g", "rtx6000-ada": "rtx6000ada",
                "6000ada": "rtx6000ada", "h200-141g": "h200"}


def resolve_gpu(gpu: str | GPU | int) -> GPU:
    """A :class:`GPU` from a table key, a GPU, or a total in bytes. Raises ValueError naming the key.

    Keys ignore case, spaces and underscores, and accept the names notebook 09 uses
    (``"RTX 4090-48G"`` is ``rtx4090-48g``)."""
    if isinstance(gpu, GPU):
        return gpu
    if isinstance(gpu, int) and not isinstance(gpu, bool):
        if gpu <= 0:
            raise ValueError(f"gpu={gpu!r}: a total in bytes must be positive")
        return GPU("custom", f"custom {gpu / GiB:.2f} GiB", gpu, "?", "given bytes")
    key = str(gpu).lower().replace(" ", "").replace("_", "-")
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise ValueError(f"gpu={gpu!r}: unknown card; known: {sorted(GPUS)} (or give a total in bytes)")
    return GPUS[key]

