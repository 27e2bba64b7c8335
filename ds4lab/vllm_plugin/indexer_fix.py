"""Let the CPU lightning-indexer decode path verify MTP drafts (vLLM 0.32).

With ``--speculative-config`` a decode request carries ``1 + num_speculative_tokens`` query
tokens. ``vllm/v1/attention/backends/mla/indexer.py::DeepseekV32IndexerMetadataBuilder`` then
takes its *native* decode layout (``[B, next_n]`` rows, ``_use_flattening`` is False because
``next_n <= 2`` counts as natively supported), but
``vllm/model_executor/layers/sparse_attn_indexer.py::SparseAttnIndexer.forward_cpu`` accepts one
query token per decode row only (``AssertionError: CPU sparse indexer decode path expects
exactly one query token per decode request``); it is reached once a C4A layer has more than
``index_topk`` compressed entries (context > 4 x 512 tokens).

The fix sets ``use_flattening = True`` on
``vllm/models/deepseek_v4/cpu/cpu_mla.py::DeepseekV4CPUIndexerMetadataBuilder`` instances: the
shared builder's own flattened path (``_prepare_decode_tensors`` with ``use_native=False``) then
expands each draft position into its own row with its causal length
(``seq_len - next_n + j + 1``), its request's block-table row and ``decode_len = 1`` -- exactly
the one-token-per-row layout ``forward_cpu`` and ``fp8_paged_mqa_logits_cpu`` expect. Without
speculation (``next_n = 1``) the flattened and native layouts coincide.
"""
from __future__ import annotations

__all__ = ["install"]


def install() -> list[str]:
    from vllm.models.deepseek_v4.cpu import cpu_mla

    cls = cpu_mla.DeepseekV4CPUIndexerMetadataBuilder
    if getattr(cls, "_ds4lab_flatten", False):
        return []
    orig_init = cls.__init__

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        self.use_flattening = True

    __init__.__wrapped__ = orig_init  # type: ignore[attr-defined]
    cls.__init__ = __init__
    cls._ds4lab_flatten = True
    return [f"{cls.__module__}.{cls.__qualname__}.__init__ (use_flattening=True)"]
