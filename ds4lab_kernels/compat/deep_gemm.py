"""DeepGEMM's Python API (the subset vLLM 0.32's DeepSeek-V4 path binds) on ds4lab's kernels.

vLLM's ``vllm/utils/deep_gemm.py::_lazy_init`` binds each of these by ``getattr(deep_gemm, name)``;
a name absent here stays None there (vLLM then raises its own "DeepGEMM backend is unavailable").
Semantics source: DeepGEMM ``deep_gemm/__init__.py`` + ``csrc/apis/{gemm,attention,einsum,
hyperconnection,layout}.hpp`` and its tests (``tests/test_fp8.py``, ``test_attention.py``,
``test_einsum.py``, ``test_hyperconnection.py``, ``test_layout.py``), as vLLM's wrappers in
``vllm/utils/deep_gemm.py`` call them.

Scale layouts: this module behaves like DeepGEMM on SM90 (what vLLM's scale-format oracle picks on
every non-SM100 GPU, ``DeepGemmQuantScaleFMT.FLOAT32_CEIL_UE8M0``): fp32 scales, 1x128 activation
scales MN-major and TMA-aligned, 128x128 weight scales as they are. Packed UE8M0 int32 scales (the
SM100 layout ``transform_sf_into_required_layout`` makes there) are accepted for activations and
for per-128-row weight blocks; per-row packed weight scales raise ``NotImplementedError``.
"""
from __future__ import annotations

import torch

from .._arch import num_sms
from ..fp8_gemm import fp8_gemm_nt as _fp8_gemm_nt
from ..indexer import fp8_mqa_logits as _fp8_mqa_logits
from ..indexer import fp8_paged_mqa_logits as _fp8_paged_mqa_logits
from ..mhc import hc_prenorm_gemm as _hc_prenorm_gemm
from ..o_proj import fp8_einsum_bhr_hdr_bhd as _fp8_einsum

__all__ = ["fp8_gemm_nt", "fp8_einsum", "fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits",
           "get_paged_mqa_logits_metadata", "tf32_hc_prenorm_gemm", "transform_sf_into_required_layout",
           "get_mn_major_tma_aligned_tensor", "get_mn_major_tma_aligned_packed_ue8m0_tensor", "get_tma_aligned_size", "get_num_sms", "set_num_sms"]

BLOCK = 128                     # DeepGEMM's 1x128 / 128x128 scale granularity
_RECIPES = (None, (1, 128, 128), (128, 128))
_NUM_SMS: int | None = None


# ---- device / layout helpers ----------------------------------------------------------------------
def get_num_sms() -> int:
    """SM count the kernels may use (DeepGEMM ``get_num_sms``): the value of :func:`set_num_sms`, else
    the current device's multiprocessor count (:func:`ds4lab_kernels._arch.num_sms`: its CPU answer
    without CUDA)."""
    if _NUM_SMS is not None:
        return _NUM_SMS
    return num_sms(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def set_num_sms(num_sms: int) -> None:
    """DeepGEMM ``set_num_sms``: a positive int, at most the device's SM count."""
    global _NUM_SMS
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"num_sms={num_sms!r}: expected a positive int")
    _NUM_SMS = num_sms


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """``x`` rounded up to 16 bytes' worth of elements (DeepGEMM ``get_tma_aligned_size``)."""
    if 16 % element_size:
        raise ValueError(f"element_size={element_size}: must divide 16")
    a = 16 // element_size
    return -(-x // a) * a


def get_mn_major_tma_aligned_tensor(x: torch.Tensor) -> torch.Tensor:
    """DeepGEMM ``get_mn_major_tma_aligned_tensor``: the same values as ``x`` ``(..., mn, k)`` (2-D or
    3-D float32/int32) laid out MN-major, ``stride(-2) == 1``, ``stride(-1) = get_tma_aligned_size(mn)``
    (and for 3-D ``stride(0) = that * k``). Returns ``x`` itself when it already has that layout."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.int32) or x.dim() not in (2, 3):
        raise TypeError(f"x: expected a 2-D/3-D float32 or int32 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    mn, k = x.shape[-2], x.shape[-1]
    amn = get_tma_aligned_size(mn, x.element_size())
    if x.stride(-2) == 1 and x.stride(-1) == amn and (x.dim() == 2 or x.stride(0) == amn * k):
        return x
    b = x.shape[0] if x.dim() == 3 else 1
    buf = torch.empty((b, k, amn), dtype=x.dtype, device=x.device)
    y = buf.transpose(1, 2)[:, :mn, :]
    y.copy_(x.reshape(b, mn, k))
    return y if x.dim() == 3 else y[0]


def get_mn_major_tma_aligned_packed_ue8m0_tensor(x: torch.Tensor) -> torch.Tensor:
    """DeepGEMM ``get_mn_major_tma_aligned_packed_ue8m0_tensor``: fp32 power-of-two scales
    ``([g,] mn, kb)`` -> int32 ``([g,] mn, ceil(kb/4))``, four UE8M0 exponent bytes per word,
    little-endian along k, laid out MN-major and TMA-aligned (the SM100 scale layout)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() not in (2, 3):
        raise TypeError(f"x: expected 2-D/3-D float32 scales, got {getattr(x, 'dtype', type(x).__name__)}")
    return get_mn_major_tma_aligned_tensor(_pack_rows(x))


def _pack_rows(sf: torch.Tensor) -> torch.Tensor:
    e = (sf.contiguous().view(torch.int32) >> 23) & 0xFF
    kb = sf.shape[-1]
    pad = (-kb) % 4
    if pad:
        e = torch.nn.functional.pad(e, (0, pad))
    e = e.reshape(*e.shape[:-1], -1, 4)
    return e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)


def transform_sf_into_required_layout(sf: torch.Tensor, mn: int, k: int, recipe: tuple, num_groups: int | None = None,
                                      is_sfa: bool = False, disable_ue8m0_cast: bool = False) -> torch.Tensor:
    """DeepGEMM ``transform_sf_into_required_layout`` with SM90 semantics (see module docstring).

    Args:
        sf: float32 scales ``([num_groups,] ceil(mn/gran_mn), ceil(k/128))`` or already-packed int32
            ``([num_groups,] mn, ceil(k/512))``.
        mn, k: the operand's MN and K extents.
        recipe: ``(gran_m, gran_n, gran_k)`` (or a 2-tuple ``(gran_mn, gran_k)``); the granularity is
            ``(recipe[0] if is_sfa else recipe[1], recipe[2])``, which must be (1, 128) or (128, 128).
        num_groups: the leading group count of a 3-D ``sf``, or None for 2-D.
        is_sfa: activation (True) or weight (False) scales.
        disable_ue8m0_cast: accepted; on SM90 semantics fp32 scales stay fp32 either way.

    Returns:
        (1, 128) fp32: :func:`get_mn_major_tma_aligned_tensor` of ``sf``; (128, 128) fp32: ``sf``
        unchanged; int32: ``sf`` MN-major TMA-aligned.

    Raises:
        NotImplementedError: another granularity. ValueError: a shape that disagrees with mn/k.
        TypeError: dtype not float32/int32.
    """
    if len(recipe) == 3:
        gran = (recipe[0] if is_sfa else recipe[1], recipe[2])
    elif len(recipe) == 2:
        gran = (recipe[0], recipe[1])
    else:
        raise ValueError(f"recipe={recipe!r}: expected (gran_m, gran_n, gran_k) or (gran_mn, gran_k)")
    if gran not in ((1, BLOCK), (BLOCK, BLOCK)):
        raise NotImplementedError(f"recipe={recipe!r} (is_sfa={is_sfa}): granularity {gran}; only (1, 128) and "
                                  "(128, 128) scales are supported")
    if not isinstance(sf, torch.Tensor) or sf.dtype not in (torch.float32, torch.int32):
        raise TypeError(f"sf: expected float32 or int32 scales, got {getattr(sf, 'dtype', type(sf).__name__)}")
    want_dim = 2 if num_groups is None else 3
    if sf.dim() != want_dim or (num_groups is not None and sf.shape[0] != num_groups):
        raise ValueError(f"sf: shape {tuple(sf.shape)}, expected {want_dim} dims"
                         + ("" if num_groups is None else f" with {num_groups} groups first"))
    rows = -(-mn // gran[0]) if sf.dtype == torch.float32 else mn
    cols = -(-k // (gran[1] * (1 if sf.dtype == torch.float32 else 4)))
    if tuple(sf.shape[-2:]) != (rows, cols):
        raise ValueError(f"sf: trailing shape {tuple(sf.shape[-2:])}, expected ({rows}, {cols}) for mn={mn}, "
                         f"k={k}, granularity {gran}, {sf.dtype}")
    if sf.dtype == torch.float32 and gran == (BLOCK, BLOCK):
        return sf
    return get_mn_major_tma_aligned_tensor(sf)


# ---- GEMMs ---------------------------------------------------------------------------------------
def _pair(name: str, x) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError(f"{name}: expected a (tensor, scale) pair, got {type(x).__name__}")
    return x[0], x[1]


def _check_recipe(recipe) -> None:
    if recipe is not None and tuple(recipe) not in _RECIPES[1:]:
        raise NotImplementedError(f"recipe={recipe!r}: only 1x128 activation / 128x128 weight scales "
                                  "((1, 128, 128)) are supported")


def _weight_scale(name: str, s: torch.Tensor, n: int) -> torch.Tensor:
    """A packed int32 weight scale must be per 128-row block; SM100's per-row packing is refused."""
    if isinstance(s, torch.Tensor) and s.dtype == torch.int32 and s.dim() >= 2 and s.shape[-2] == n and n > BLOCK:
        raise NotImplementedError(f"{name}: per-row packed UE8M0 weight scales (SM100 layout, shape "
                                  f"{tuple(s.shape)}); pass ({-(-n // BLOCK)}, K/512) per-block scales")
    return s


def fp8_gemm_nt(a, b, d: torch.Tensor, c: torch.Tensor | None = None, recipe=None, compiled_dims: str = "nk",
                disable_ue8m0_cast: bool = False) -> None:
    """DeepGEMM ``fp8_gemm_nt``: ``d = (a * sfa) @ (b * sfb)^T`` (NT), written into ``d``.

    Args:
        a: ``(a_fp8 (M, K) float8_e4m3fn, sfa)``; sfa ``(M, K/128)`` float32 (any strides, e.g. MN-major
            TMA-aligned) or ``(M, ceil(K/512))`` int32 packed UE8M0.
        b: ``(b_fp8 (N, K) float8_e4m3fn, sfb)``; sfb ``(ceil(N/128), K/128)`` float32 or
            ``(ceil(N/128), ceil(K/512))`` int32 packed.
        d: ``(M, N)`` bfloat16 output, ``stride(1) == 1``.
        c: must be None (no accumulation into ``d``).
        recipe: None or ``(1, 128, 128)``.
        compiled_dims, disable_ue8m0_cast: accepted (JIT hints in DeepGEMM; no effect here).

    Returns:
        None (``d`` is written), as DeepGEMM.

    Raises:
        NotImplementedError: ``c`` given, ``d`` float32, another recipe, per-row packed ``sfb``.
        TypeError / ValueError: from :func:`ds4lab_kernels.fp8_gemm.fp8_gemm_nt`, naming the argument.
    """
    if c is not None:
        raise NotImplementedError("c: accumulation (d = c + a @ b^T) is not supported; pass c=None")
    _check_recipe(recipe)
    if isinstance(d, torch.Tensor) and d.dtype == torch.float32:
        raise NotImplementedError("d: float32 output is not supported (bfloat16)")
    a_t, sfa = _pair("a", a)
    b_t, sfb = _pair("b", b)
    _fp8_gemm_nt(a_t, sfa, b_t, _weight_scale("b[1] (sfb)", sfb, b_t.shape[0]), out=d)


def fp8_einsum(expr: str, a, b, d: torch.Tensor, c: torch.Tensor | None = None, recipe=None) -> None:
    """DeepGEMM ``fp8_einsum`` for ``"bhr,hdr->bhd"`` (the DeepSeek-V4 o-projection's grouped ``wo_a``,
    vLLM ``models/deepseek_v4/nvidia/ops/o_proj.py::deep_gemm_fp8_o_proj``).

    Args:
        expr: must be ``"bhr,hdr->bhd"``.
        a: ``(x (T, G, K) float8_e4m3fn, sfx (T, G, K/128) float32)``.
        b: ``(w, sfw)``: w ``(G, N, K)`` (or ``(G*N, K)``) float8_e4m3fn, sfw ``(G, N/128, K/128)`` (or
            ``(G*N/128, K/128)``) float32.
        d: ``(T, G, N)`` contiguous bfloat16 output.
        c: must be None. recipe: None or ``(1, 128, 128)`` (vLLM's SM90 recipe; SM100's ``(1, 1, 128)``
            per-row weight scales raise).

    Returns:
        None (``d`` is written).

    Raises:
        NotImplementedError: another expression, ``c``, another recipe.
        TypeError / ValueError: from :func:`ds4lab_kernels.o_proj.fp8_einsum_bhr_hdr_bhd`.
    """
    if expr.replace(" ", "") != "bhr,hdr->bhd":
        raise NotImplementedError(f"expr={expr!r}: only 'bhr,hdr->bhd' is supported")
    if c is not None:
        raise NotImplementedError("c: accumulation is not supported; pass c=None")
    _check_recipe(recipe)
    x, sx = _pair("a", a)
    w, sw = _pair("b", b)
    if isinstance(x, torch.Tensor) and x.dim() == 3 and isinstance(w, torch.Tensor) and w.dim() == 2:
        g = x.shape[1]
        w = w.view(g, w.shape[0] // g, w.shape[1])
        if isinstance(sw, torch.Tensor) and sw.dim() == 2:
            sw = sw.view(g, sw.shape[0] // g, sw.shape[1])
    _fp8_einsum(x, sx, w, sw, out=d)


# ---- indexer logits --------------------------------------------------------------------------------
def _fp8_q(q) -> torch.Tensor:
    if isinstance(q, torch.Tensor):
        return q
    qv, qs = _pair("q", q)
    if qs is not None:
        raise NotImplementedError("q: an FP4 (values, scales) pair is not supported; pass (q_fp8, None)")
    return qv


def fp8_fp4_mqa_logits(q, kv, weights: torch.Tensor, cu_seq_len_k_start: torch.Tensor,
                       cu_seq_len_k_end: torch.Tensor, clean_logits: bool = True, max_seqlen_k: int = 0) -> torch.Tensor:
    """DeepGEMM ``fp8_fp4_mqa_logits`` (ragged prefill), FP8 path.

    ``logits[m, n] = sum_h weights[m, h] * relu(q[m, h] . k[n]) * k_scale[n]`` for
    ``cu_seq_len_k_start[m] <= n < cu_seq_len_k_end[m]``, ``-inf`` elsewhere (always written, so
    ``clean_logits`` is satisfied either way).

    Args:
        q: ``(q_fp8 (M, H, 128) float8_e4m3fn, None)`` (or the bare tensor).
        kv: ``(k (N, 128) float8_e4m3fn, k_scale (N,) float32)``.
        weights: ``(M, H)`` float32. cu_seq_len_k_start / _end: ``(M,)`` int32.
        clean_logits: accepted. max_seqlen_k: must be 0 (the compressed ``(M, max_seqlen_k)`` output
            form is not supported).

    Returns:
        ``(M, N)`` float32.

    Raises:
        NotImplementedError: FP4 q, ``max_seqlen_k != 0``. TypeError / ValueError: from
        :func:`ds4lab_kernels.indexer.fp8_mqa_logits`.
    """
    if max_seqlen_k:
        raise NotImplementedError(f"max_seqlen_k={max_seqlen_k}: the compressed logits layout is not supported")
    return _fp8_mqa_logits(_fp8_q(q), tuple(kv) if isinstance(kv, list) else kv, weights,
                           cu_seq_len_k_start, cu_seq_len_k_end)


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int,
                                  indices: torch.Tensor | None = None) -> torch.Tensor:
    """DeepGEMM ``get_paged_mqa_logits_metadata``: an int32 ``(num_sms + 1, 2)`` tensor on
    ``context_lens``'s device. ds4lab's paged kernel schedules from shapes alone (CUDA-graph safe), so
    the table is zeros and only its shape and device follow DeepGEMM; pass it back unchanged.

    Raises:
        NotImplementedError: ``indices`` (varlen rows) given. ValueError: bad ``num_sms``/``block_kv``.
    """
    if indices is not None:
        raise NotImplementedError("indices: varlen paged MQA rows are not supported")
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"num_sms={num_sms!r}: expected a positive int")
    if not isinstance(block_kv, int) or block_kv < 1:
        raise ValueError(f"block_kv={block_kv!r}: expected a positive int")
    return torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=context_lens.device)


def fp8_fp4_paged_mqa_logits(q, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                             block_table: torch.Tensor, schedule_meta: torch.Tensor, max_context_len: int,
                             clean_logits: bool = False, indices: torch.Tensor | None = None) -> torch.Tensor:
    """DeepGEMM ``fp8_fp4_paged_mqa_logits`` (decode / MTP verification), FP8 path.

    Args:
        q: ``(q_fp8 (B, next_n, H, 128) float8_e4m3fn, None)``, next_n 1 or 2.
        kv_cache: uint8 ``(num_blocks, block_size, 1, 132)`` indexer K cache (128 e4m3 bytes per entry,
            then the block's fp32 scales, planar).
        weights: ``(B*next_n, H)`` float32.
        context_lens: ``(B,)`` int32 (row ``i`` of request ``b`` sees ``ctx - next_n + i + 1`` entries) or
            ``(B, next_n)`` int32 per-row limits (vLLM's native MTP rows).
        block_table: ``(B, max_blocks)`` int32. schedule_meta: from :func:`get_paged_mqa_logits_metadata`
            (unused). max_context_len: output width. clean_logits: accepted (``-inf`` is always written
            past each row's limit).
        indices: must be None.

    Returns:
        ``(B*next_n, max_context_len)`` float32.

    Raises:
        NotImplementedError: FP4 q, ``indices`` given, next_n > 2. TypeError / ValueError: from
        :func:`ds4lab_kernels.indexer.fp8_paged_mqa_logits`.
    """
    if indices is not None:
        raise NotImplementedError("indices: varlen paged MQA rows are not supported")
    qv = _fp8_q(q)
    if isinstance(qv, torch.Tensor) and qv.dim() == 4 and qv.shape[1] not in (1, 2):
        raise NotImplementedError(f"q: next_n={qv.shape[1]}; only 1 and 2 are supported")
    if block_table.dim() == 2 and block_table.shape[1] == 1 and block_table.stride(-1) != 1:
        block_table = block_table.clone(memory_format=torch.contiguous_format)
    return _fp8_paged_mqa_logits(qv, kv_cache, weights, context_lens, block_table, int(max_context_len))


# ---- mHC ---------------------------------------------------------------------------------------------
def tf32_hc_prenorm_gemm(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, sqr_sum: torch.Tensor,
                         num_splits: int | None = None) -> None:
    """DeepGEMM ``tf32_hc_prenorm_gemm``: ``sum_s d[s] = a.float() @ b.T`` and
    ``sum_s sqr_sum[s] = (a.float() ** 2).sum(-1)`` (TF32 products, fp32 sums), written in place.

    The native kernel writes straight into ``d`` / ``sqr_sum`` (no staging buffer, no copy: the
    H200 run had the compat call 2.2 us over the launcher from two ``copy_`` kernels).

    Args:
        a: ``(M, K)`` bfloat16 (the residual ``(T, 4, 4096)`` viewed as ``(T, 16384)``).
        b: ``(N, K)`` float32 (N = 24 mixes, or 4 for hc_head).
        d: ``(num_splits, M, N)`` float32 (``(M, N)`` with ``num_splits=None``), N-major (last dim
            contiguous), as DeepGEMM asserts.
        sqr_sum: ``(num_splits, M)`` float32 (``(M,)`` with ``num_splits=None``), contiguous.
        num_splits: the split count the caller sums over.

    Returns:
        None. Every split slice is written; when K has fewer ``BLOCK_K`` blocks than ``num_splits``,
        the surplus slices are zeros.

    Raises:
        ValueError: ``d``/``sqr_sum`` shapes, dtypes or layouts; TypeError / ValueError from
        :func:`ds4lab_kernels.mhc.hc_prenorm_gemm`.
    """
    M, N = a.shape[0], b.shape[0]
    S = 1 if num_splits is None else num_splits
    want_d = (M, N) if num_splits is None else (S, M, N)
    want_s = (M,) if num_splits is None else (S, M)
    for name, t, want in (("d", d, want_d), ("sqr_sum", sqr_sum, want_s)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != want:
            raise ValueError(f"{name}: expected a float32 {want} tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if d.numel() and d.stride(-1) != 1:
        raise ValueError(f"d: must be N-major (last dim contiguous), got strides {tuple(d.stride())}")
    if not sqr_sum.is_contiguous():
        raise ValueError(f"sqr_sum: must be contiguous, got strides {tuple(sqr_sum.stride())}")
    out = (d, sqr_sum) if num_splits is not None else (d.unsqueeze(0), sqr_sum.unsqueeze(0))
    _hc_prenorm_gemm(a, b, out=out)
