"""Fix for ``KeyError: 'c1a'`` in the CPU sparse-SWA metadata builder (vLLM 0.32, SPEC.md §6 (d)).

``vllm/v1/attention/backends/mla/sparse_swa.py::DeepseekSparseSWAMetadataBuilder.build`` reads
``tile_sched[...]`` for all five DeepSeek-V4 layer types (swaonly, c4a, c128a, c1a, c2a), but
``vllm/models/deepseek_v4/cpu/cpu_mla.py::DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler``
returns only the first three keys. The replacement returns ``None`` for every key the shared
builder knows (``_LAYER_TYPE_*`` constants), which is what the CPU path means: no FlashMLA
tile-scheduler plan on CPU.
"""
from __future__ import annotations

__all__ = ["build_tile_scheduler_all_none", "install"]


def _layer_type_keys() -> list[str]:
    from vllm.v1.attention.backends.mla import sparse_swa

    return [getattr(sparse_swa, n) for n in sorted(dir(sparse_swa)) if n.startswith("_LAYER_TYPE_")
            and isinstance(getattr(sparse_swa, n), str)]


def build_tile_scheduler_all_none(self, num_decode_tokens: int) -> dict:
    """``{layer_type: None}`` for every DeepSeek-V4 layer type (no tile-scheduler on CPU)."""
    return {k: None for k in _layer_type_keys()}


def install() -> list[str]:
    from vllm.models.deepseek_v4.cpu import cpu_mla

    cls = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    cls.build_tile_scheduler = build_tile_scheduler_all_none
    return [f"{cls.__module__}.{cls.__qualname__}.build_tile_scheduler"]
