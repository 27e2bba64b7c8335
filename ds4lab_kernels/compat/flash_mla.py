"""FlashMLA's sparse interface on ds4lab's sparse MLA kernels (DeepSeek-V4 MODEL1 / fp8_ds_mla).

Semantics source: FlashMLA ``flash_mla/flash_mla_interface.py`` (``get_mla_metadata``,
``flash_mla_with_kvcache``, ``flash_mla_sparse_fwd``, ``FlashMLASchedMeta``) and its reference
``tests/ref.py`` (``ref_sparse_attn_decode``, ``ref_sparse_attn_fwd``), as vLLM 0.32 calls them from
``vllm/models/deepseek_v4/nvidia/flashmla.py`` (``_forward_decode``, ``_forward_prefill``) and
``vllm/v1/attention/backends/mla/sparse_swa.py`` (``build_tile_scheduler``).

Only the sparse modes exist here: FlashMLA's dense decode (``indices=None``), the V3.2 576-byte
FP8 layout (d_qk 576) and a bf16 KV cache raise ``NotImplementedError`` naming the argument.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..sparse_mla import HEAD_DIM, sparse_mla_decode, sparse_mla_prefill

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd"]

ENTRY_BYTES = 584           # fp8_ds_mla: 448 e4m3 + 64 bf16 + 7 UE8M0 + 1 pad (SPEC.md §3)
HEADS_Q = (64, 128)         # FlashMLA sparse decode/prefill kernels: h_q 64 or 128 (vLLM pads to these)


@dataclasses.dataclass
class FlashMLASchedMeta:
    """FlashMLA's tile-scheduler holder (same fields). ds4lab's kernels need no scheduler plan (the
    split count depends on shapes only), so ``tile_scheduler_metadata`` / ``num_splits`` stay None;
    ``config`` is recorded on the first call and later calls must agree, as in FlashMLA."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: int | None
        extra_page_block_size: int | None
        extra_topk: int | None

    have_initialized: bool = False
    config: Config | None = None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    """A fresh, empty :class:`FlashMLASchedMeta` and ``None`` (FlashMLA's current interface; the
    arguments of the old interface are accepted and ignored, as FlashMLA does)."""
    return FlashMLASchedMeta(), None


def _cache_3d(name: str, cache: torch.Tensor) -> torch.Tensor:
    """(num_blocks, block_size, 1, 584) or (num_blocks, block_size, 584) uint8/e4m3 -> 3-D uint8 view."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype == torch.float8_e4m3fn:
        cache = cache.view(torch.uint8)
    if cache.dtype != torch.uint8:
        raise NotImplementedError(f"{name}: dtype {cache.dtype}; only the FP8 fp8_ds_mla cache (uint8 bytes) "
                                  "is supported (is_fp8_kvcache=True)")
    if cache.dim() == 4:
        if cache.shape[2] != 1:
            raise ValueError(f"{name}: num_heads_k={cache.shape[2]}, expected 1 (shape {tuple(cache.shape)})")
        cache = cache.squeeze(2)
    if cache.dim() != 3:
        raise ValueError(f"{name}: expected (num_blocks, page_block_size, 1, {ENTRY_BYTES}), got {tuple(cache.shape)}")
    if cache.shape[2] != ENTRY_BYTES:
        raise NotImplementedError(f"{name}: {cache.shape[2]} bytes per token; only the MODEL1 fp8_ds_mla layout "
                                  f"({ENTRY_BYTES} B: d_qk 512) is supported (656 B is the V3.2 layout)")
    return cache


def _indices_2d(name: str, idx: torch.Tensor, b: int, s_q: int) -> torch.Tensor:
    """(b, s_q, topk) int32 (or (b, topk) with s_q = 1, as vLLM passes the SWA indices) -> (b*s_q, topk)."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(idx).__name__}")
    if idx.dim() == 2 and s_q == 1:
        idx = idx.unsqueeze(1)
    if idx.dim() != 3 or tuple(idx.shape[:2]) != (b, s_q):
        raise ValueError(f"{name}: expected shape ({b}, {s_q}, topk), got {tuple(idx.shape)}")
    return idx.reshape(b * s_q, idx.shape[2])


def _lens_per_row(name: str, lens: torch.Tensor | None, b: int, s_q: int, width: int, device) -> torch.Tensor:
    """FlashMLA's per-batch ``(b,)`` lengths -> the native per-row ``(b*s_q,)`` int32 lengths."""
    if lens is None:
        return torch.full((b * s_q,), width, dtype=torch.int32, device=device)
    if not isinstance(lens, torch.Tensor) or lens.dtype != torch.int32:
        raise TypeError(f"{name}: expected an int32 tensor, got {getattr(lens, 'dtype', type(lens).__name__)}")
    if tuple(lens.shape) != (b,):
        raise ValueError(f"{name}: expected shape ({b},) (batch_size), got {tuple(lens.shape)}")
    return lens.contiguous() if s_q == 1 else lens.repeat_interleave(s_q)


def _sink(attn_sink, h_q: int, device) -> torch.Tensor:
    if attn_sink is None:  # no sink: e^-inf = 0 in the denominator
        return torch.full((h_q,), float("-inf"), dtype=torch.float32, device=device)
    return attn_sink


def _check_meta(meta, cfg: FlashMLASchedMeta.Config) -> None:
    if not isinstance(meta, FlashMLASchedMeta):
        raise TypeError(f"tile_scheduler_metadata: expected a FlashMLASchedMeta from get_mla_metadata(), "
                        f"got {type(meta).__name__}")
    if not meta.have_initialized:
        meta.have_initialized, meta.config = True, cfg
    elif meta.config != cfg:
        raise ValueError(f"tile_scheduler_metadata: planned for {meta.config}, called with {cfg}; reuse a "
                         "FlashMLASchedMeta only for calls with the same shapes (FlashMLA's rule)")


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA sparse FP8 decode (MODEL1 / fp8_ds_mla), on :func:`ds4lab_kernels.sparse_mla.sparse_mla_decode`.

    Args:
        q: ``(batch_size, seq_len_q, num_heads_q, 512)`` bfloat16, num_heads_q 64 or 128 (vLLM pads a
            TP rank's 16/32 heads up with ``-inf`` sinks), seq_len_q >= 1 (MTP: 1-3), last dim contiguous.
        k_cache: uint8 (or float8_e4m3fn) ``(num_blocks, page_block_size, 1, 584)`` fp8_ds_mla cache
            (per block: ``page_block_size`` 576-byte entries, then 8 scale bytes each; block stride free,
            bytes within a block contiguous). Any page_block_size >= 1.
        block_table, cache_seqlens: unused in sparse mode (as in FlashMLA); may be None.
        head_dim_v: must be 512.
        tile_scheduler_metadata: from :func:`get_mla_metadata`; reusable across calls of equal shapes.
        num_splits: must be None.
        softmax_scale: scale on ``q.k`` (default ``512^-0.5``).
        causal: must be False (sparse attention).
        is_fp8_kvcache: must be True.
        indices: ``(batch_size, seq_len_q, topk)`` int32 slots ``block * page_block_size + offset``
            into ``k_cache``; ``-1`` (or out of the cache) skipped. ``(batch_size, topk)`` is accepted
            with seq_len_q 1 (vLLM's SWA indices).
        attn_sink: optional ``(num_heads_q,)`` float32: the output is scaled by
            ``e^lse / (e^lse + e^sink)``; ``+inf`` zeroes a head, ``-inf`` is no sink.
        extra_k_cache / extra_indices_in_kvcache: a second cache (its own page_block_size, e.g. 64 for
            C4, 2 for C128) and its ``(batch_size, seq_len_q, extra_topk)`` int32 slots.
        topk_length / extra_topk_length: optional ``(batch_size,)`` int32: only the leftmost that many
            indices of each row are read.
        out: optional ``(batch_size, seq_len_q, num_heads_q, 512)`` bfloat16 written in place (must be
            viewable as ``(batch_size*seq_len_q, num_heads_q, 512)`` with a contiguous last dim).

    Returns:
        ``(out, softmax_lse)``: out ``(batch_size, seq_len_q, num_heads_q, 512)`` bfloat16; softmax_lse
        ``(batch_size, num_heads_q, seq_len_q)`` float32 (a transposed view of a ``(b, s_q, h_q)``
        buffer): natural-log ``logsumexp`` of the scaled scores over the valid candidates, the sink
        outside it, ``+inf`` for a row with no valid candidate (whose output is zeros).

    Raises:
        NotImplementedError: ``indices=None`` (dense decode), ``is_fp8_kvcache=False`` or a bf16 cache,
            d_qk / bytes per token of another model (576 / 656), ``head_dim_v != 512``.
        TypeError / ValueError: naming the argument (shapes, dtypes, ``causal=True``, ``num_splits``,
            a scheduler holder planned for other shapes) or from the native launcher.
    """
    if indices is None:
        raise NotImplementedError("indices=None: FlashMLA's dense decode is not provided by ds4lab "
                                  "(only the sparse fp8_ds_mla decode)")
    if not is_fp8_kvcache:
        raise NotImplementedError("is_fp8_kvcache=False: only the FP8 fp8_ds_mla cache is supported")
    if causal:
        raise ValueError("causal=True: must be False with sparse attention (FlashMLA)")
    if num_splits is not None:
        raise ValueError("num_splits: must be None (FlashMLA's current interface)")
    if head_dim_v != HEAD_DIM:
        raise NotImplementedError(f"head_dim_v={head_dim_v!r}: only 512 is supported")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q: expected (batch_size, seq_len_q, num_heads_q, 512), got {tuple(q.shape)}")
    b, s_q, h_q, d_qk = q.shape
    if d_qk != HEAD_DIM:
        raise NotImplementedError(f"q: d_qk={d_qk}; only DeepSeek-V4's 512 (MODEL1) is supported")
    if h_q not in HEADS_Q:
        raise ValueError(f"q: num_heads_q={h_q}; FlashMLA's sparse decode takes 64 or 128 (pad the heads, "
                         "as vLLM's get_padded_num_q_heads does)")
    kc = _cache_3d("k_cache", k_cache)
    ec = None if extra_k_cache is None else _cache_3d("extra_k_cache", extra_k_cache)
    if (ec is None) != (extra_indices_in_kvcache is None):
        raise ValueError("extra_k_cache / extra_indices_in_kvcache: give both or neither")
    if ec is None and extra_topk_length is not None:
        raise ValueError("extra_topk_length: given without extra_k_cache")
    idx = _indices_2d("indices", indices, b, s_q)
    eidx = None if ec is None else _indices_2d("extra_indices_in_kvcache", extra_indices_in_kvcache, b, s_q)
    _check_meta(tile_scheduler_metadata, FlashMLASchedMeta.Config(
        b, s_q, h_q, kc.shape[1], 1, bool(causal), bool(is_fp8_kvcache), idx.shape[1],
        None if ec is None else ec.shape[1], None if eidx is None else eidx.shape[1]))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale={softmax_scale!r}: expected a positive finite float")
    T = b * s_q
    q3 = q.reshape(T, h_q, d_qk)
    o3 = None
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or tuple(out.shape) != (b, s_q, h_q, d_qk):
            raise ValueError(f"out: expected a bfloat16 {(b, s_q, h_q, d_qk)} tensor, got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
        try:
            o3 = out.view(T, h_q, d_qk)
        except RuntimeError:
            raise ValueError(f"out: strides {tuple(out.stride())} cannot be viewed as ({T}, {h_q}, {d_qk}); "
                             "pass a tensor whose batch and seq_len_q dims merge") from None
    res, lse = sparse_mla_decode(
        q3, kc, idx, _lens_per_row("topk_length", topk_length, b, s_q, idx.shape[1], q.device),
        _sink(attn_sink, h_q, q.device),
        comp_cache=ec, comp_indices=eidx,
        comp_lens=None if ec is None else _lens_per_row("extra_topk_length", extra_topk_length, b, s_q,
                                                        eidx.shape[1], q.device),
        swa_block_size=kc.shape[1], comp_block_size=64 if ec is None else ec.shape[1],
        scale=scale, out=o3, return_lse=True)
    o4 = out if out is not None else res.view(b, s_q, h_q, d_qk)
    return o4, lse.view(b, s_q, h_q).transpose(1, 2)


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA sparse prefill, on :func:`ds4lab_kernels.sparse_mla.sparse_mla_prefill`.

    Args:
        q: ``(s_q, h_q, 512)`` bfloat16, h_q 64 or 128, last dim contiguous.
        kv: ``(s_kv, 1, 512)`` bfloat16 gathered workspace (K = V; h_kv 1), last dim contiguous.
        indices: ``(s_q, 1, topk)`` int32 rows of ``kv``; ``-1`` or ``>= s_kv`` skipped.
        sm_scale: scale on ``q.k``.
        d_v: must be 512.
        attn_sink: optional ``(h_q,)`` float32 (outside the LSE; ``+inf`` zeroes a head).
        topk_length: optional ``(s_q,)`` int32: row ``i`` reads ``indices[i, :, :topk_length[i]]``.
        out: optional ``(s_q, h_q, 512)`` bfloat16 written in place (vLLM passes its output slice).

    Returns:
        ``(out, max_logits, lse)``: ``(s_q, h_q, 512)`` bfloat16, ``(s_q, h_q)`` float32 max scaled
        score (``-inf`` without a candidate) and ``(s_q, h_q)`` float32 natural-log LSE (``+inf``
        without a candidate), FlashMLA ``tests/ref.py::ref_sparse_attn_fwd``.

    Raises:
        NotImplementedError: d_qk (``q``/``kv`` last dim) other than 512, ``d_v != 512``, h_kv > 1.
        TypeError / ValueError: naming the argument.
    """
    if d_v != HEAD_DIM:
        raise NotImplementedError(f"d_v={d_v!r}: only 512 is supported")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q: expected (s_q, h_q, 512), got {tuple(getattr(q, 'shape', ()))}")
    if q.shape[2] != HEAD_DIM:
        raise NotImplementedError(f"q: d_qk={q.shape[2]}; only DeepSeek-V4's 512 is supported")
    if q.shape[1] not in HEADS_Q:
        raise ValueError(f"q: h_q={q.shape[1]}; FlashMLA's sparse prefill takes 64 or 128")
    if not isinstance(kv, torch.Tensor) or kv.dim() != 3:
        raise ValueError(f"kv: expected (s_kv, 1, 512), got {tuple(getattr(kv, 'shape', ()))}")
    if kv.shape[1] != 1:
        raise NotImplementedError(f"kv: h_kv={kv.shape[1]}; only one latent KV head (MLA) is supported")
    if kv.shape[2] != HEAD_DIM:
        raise NotImplementedError(f"kv: d_qk={kv.shape[2]}; only 512 is supported")
    if not isinstance(indices, torch.Tensor) or indices.dim() != 3 or indices.shape[:2] != (q.shape[0], 1):
        raise ValueError(f"indices: expected ({q.shape[0]}, 1, topk), got {tuple(getattr(indices, 'shape', ()))}")
    if topk_length is not None and (not isinstance(topk_length, torch.Tensor) or topk_length.dim() != 1):
        raise ValueError(f"topk_length: expected ({q.shape[0]},) int32, got {tuple(getattr(topk_length, 'shape', ()))}")
    return sparse_mla_prefill(q, kv[:, 0, :], indices[:, 0, :], _sink(attn_sink, q.shape[1], q.device),
                              lengths=topk_length, scale=float(sm_scale), out=out, return_lse=True)
