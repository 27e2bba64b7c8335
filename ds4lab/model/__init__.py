"""One rank of DeepSeek-V4-Flash composed from ds4lab's ops (issue 19).

The face::

    from ds4lab.model import build_rank
    m = build_rank(cfg, tp, rank, weights, device, backend="kernel" | "reference")
    caches = m.new_caches(batch, max_ctx)            # paged fp8_ds_mla / indexer K / compressor states
    m.fill_caches(caches, ctx)                       # benchmark fill to ctx tokens per request
    logits = m.prefill(tokens, caches, req=0)        # chunked prefill of one request -> last logits
    logits = m.decode(tokens, positions, caches)     # tokens/positions (B, next_n) -> (B, next_n, V)
    draft = m.mtp_draft(tokens, positions, caches)   # MTP draft logits after a decode/prefill

``weights`` comes from :mod:`ds4lab.model.weights` (the tiny checkpoint's safetensors, or random
weights at the real per-rank shapes). The op interface both backends implement is
:mod:`ds4lab.model.ops` (``op_group`` + the step hook).
"""
from ds4lab.model.ops import op_group, set_hook  # noqa: F401

__all__ = ["build_rank", "op_group", "set_hook"]


def build_rank(cfg, tp, rank, weights, device="cpu", backend="kernel", **kw):
    """Build :class:`ds4lab.model.model.RankModel` (see the module docstring for its methods)."""
    from ds4lab.model.model import RankModel
    return RankModel(cfg, tp, rank, weights, device=device, backend=backend, **kw)
