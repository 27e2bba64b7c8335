"""Fused attention/MLP glue: per-row RMSNorm + GPT-J RoPE (``rmsnorm_rope``), the q_norm + kv_norm +
kv RoPE of the fused ``wq_a | wkv`` output (``q_kv_rmsnorm_rope``), the attention q's norm + RoPE with the
indexer q's RoPE + FP8 quant (``q_norm_rope_indexer_q``) and the clamped SwiGLU of the shared expert
(``swiglu_clamp``), one launch each.

Semantics (vLLM 0.32 ``models/deepseek_v4``; ds4lab twin ``ds4lab/model/backend_ref.py``):

* ``rmsnorm_rope``: for every row ``x_r`` (the last dim ``D`` of ``x``), in float32,
  ``y = x * rsqrt(mean(x^2) + eps)`` (times ``weight`` where given; ``norm=False`` skips the norm),
  then, where ``positions`` is given, GPT-J interleaved RoPE on the LAST ``R = cos_sin.shape[1]``
  dims: pairs ``(2i, 2i+1)``, ``y0' = y0 cos - y1 sin``, ``y1' = y1 cos + y0 sin``, ``cos/sin``
  taken at row ``positions[t]`` of the float32 ``cos || sin`` table (:mod:`ds4lab.reference.rope`).
  One bfloat16 rounding at the end. This covers the q head norm (``(T, H, 512)``, no weight, norm
  + rope), ``q_norm`` / ``kv_norm`` (weight, no rope) and the kv latent RoPE (no norm, rope).
* ``q_kv_rmsnorm_rope``: ``x (T, q_dim + Dkv)``: ``q = bf16(rms(x[:, :q_dim]) * q_weight)`` and
  ``kv = bf16(rope(bf16(rms(x[:, q_dim:]) * kv_weight)))`` (the kv rounded to bf16 between norm and
  rotation, the boundary vLLM's separate ``kv_norm`` module has), two contiguous outputs.
* ``q_norm_rope_indexer_q``: a C4A layer's ``rmsnorm_rope`` of the attention q heads (no weight, norm +
  rope) and ``indexer.indexer_q_rope_quant`` of the indexer q in one grid (a program-id switch between
  the two jobs, each the other launcher's code), bit for bit the two launches.
* ``swiglu_clamp``: ``gu (T, 2I)`` -> ``silu(min(g, limit)) * clamp(u, -limit, limit)`` with
  ``g = gu[:, :I]``, ``u = gu[:, I:]`` (float32 math, bf16 out).
"""
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from . import _checks
from . import mla_cache
from ._arch import arch_of, require_fp8
from ._fp8 import ACT_QUANT_EPS, fp32_pow2_to_ue8m0, quant_rows_e4m3_pow2
from .indexer import Q_EPS as INDEXER_Q_EPS, indexer_q_rows
from .mla_cache import fp8_ds_mla_pack

__all__ = ["rmsnorm_rope", "q_kv_rmsnorm_rope", "q_norm_rope_indexer_q", "swiglu_clamp", "CONFIGS", "rms_rstd",
           "rope_cos_sin", "rope_rotate", "head_rmsnorm_rope", "rmsnorm_rope_rows"]


# ---- shared @triton.jit helpers: the one home of the norm and the RoPE convention ----------------
# (also read by sparse_mla's fused q load, so both paths compute the same float32 numbers)
@triton.jit
def rms_rstd(x, D, eps, AXIS: tl.constexpr):
    """``rsqrt(mean(x^2) + eps)`` of float32 ``x`` along ``AXIS`` (``D`` the true width: masked lanes
    load 0)."""
    return tl.math.rsqrt(tl.sum(x * x, axis=AXIS) / D + eps)


@triton.jit
def rope_cos_sin(cs_ptr, p, max_pos, i, R: tl.constexpr):
    """``(cos, sin)`` of pair ``i`` (ints in ``[0, R/2)``, any shape) at row ``p`` (int64 scalar) of the
    float32 ``(max_pos, R)`` ``cos || sin`` table; NaN when ``p`` is outside ``[0, max_pos)`` (an
    out-of-table position never reads a wrong angle; no host sync to check it)."""
    ok = (p >= 0) & (p < max_pos)
    pc = tl.where(ok, p, 0)
    c = tl.where(ok, tl.load(cs_ptr + pc * R + i), float("nan"))
    s = tl.where(ok, tl.load(cs_ptr + pc * R + R // 2 + i), float("nan"))
    return c, s


@triton.jit
def rope_rotate(x, partner, c, s, even):
    """GPT-J interleaved RoPE of one element of the pair ``(2i, 2i+1)``, ``partner`` the other one:
    the even element ``x0 -> x0 cos - x1 sin``, the odd ``x1 -> x1 cos + x0 sin`` (``even`` a bool,
    scalar or tensor)."""
    return tl.where(even, x * c - partner * s, x * c + partner * s)


@triton.jit
def head_rmsnorm_rope(row_ptr, rmask, p, cs_ptr, max_pos, eps, D: tl.constexpr, R: tl.constexpr):
    """``(M, D)`` float32: the weight-free RMSNorm of ``M`` bf16 rows of ``D`` values (``row_ptr``
    ``(M,)`` pointers to each row's first value, ``rmask`` ``(M,)`` which rows exist; masked rows are
    zeros), then GPT-J RoPE on the last ``R`` dims at table row ``p``: the same float32 operations as
    ``_rmsnorm_rope_kernel`` (``x * rstd``, then each (even, odd) pair of the tail rotated by
    :func:`rope_rotate`), on one tile in the caller's layout. The even and odd elements load as two
    ``(M, D/2)`` halves, joined back for the sum of squares and the result (a full-tile load + ``tl.split``
    or a second partner-tile load spilled 8-24 B in sparse_mla's split kernel on sm_90a / sm_120)."""
    j = tl.arange(0, D // 2)
    pair = row_ptr[:, None] + 2 * j[None, :]
    ev = tl.load(pair, mask=rmask[:, None], other=0.0).to(tl.float32)          # (M, D/2) even elements
    od = tl.load(pair + 1, mask=rmask[:, None], other=0.0).to(tl.float32)      # (M, D/2) odd elements
    x = tl.reshape(tl.join(ev, od), (ev.shape[0], D))
    rstd = tl.where(rmask, rms_rstd(x, D, eps, 1), 0.0)[:, None]
    ev = ev * rstd
    od = od * rstd
    rope = (j >= (D - R) // 2)[None, :]
    c, s = rope_cos_sin(cs_ptr, p, max_pos, tl.maximum(j - (D - R) // 2, 0), R)
    c, s = c[None, :], s[None, :]
    ev2 = tl.where(rope, rope_rotate(ev, od, c, s, True), ev)
    od2 = tl.where(rope, rope_rotate(od, ev, c, s, False), od)
    return tl.reshape(tl.join(ev2, od2), (ev.shape[0], D))


@triton.jit
def rmsnorm_rope_rows(x_ptr, w_ptr, pos_ptr, cs_ptr, y_ptr, pid, n_rows, rows_per_token, stride_xt, D, max_pos, eps,
                      HAS_W: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr,
                      BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """The rows of program ``pid`` of ``_rmsnorm_rope_kernel`` (also the q job of
    ``_q_norm_rope_indexer_q_kernel``): ``ROWS`` whole rows of ``D`` bf16 values: the fp32 sum of
    squares, the scaled body ``[0, D - R)`` and, with ``ROPE``, the ``R/2`` rotated (even, odd) pairs
    of the tail. Row ``r`` (token ``r // rows_per_token``) is read at ``token * stride_xt +
    (r % rows_per_token) * D`` and written contiguously."""
    cols = tl.arange(0, BLOCK_D)
    half = tl.arange(0, R // 2)
    dmask = cols < D
    if ROPE:
        body = cols < D - R                      # the rope tail is written by the pair path below
    else:
        body = dmask
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=dmask, other=0.0).to(tl.float32)
    for i in tl.static_range(ROWS):
        r = pid * ROWS + i
        if r < n_rows:
            row = r.to(tl.int64) * D
            xrow = (r // rows_per_token).to(tl.int64) * stride_xt + (r % rows_per_token) * D
            x = tl.load(x_ptr + xrow + cols, mask=dmask, other=0.0).to(tl.float32)
            if NORM:
                rstd = rms_rstd(x, D, eps, 0)
            else:
                rstd = 1.0
            y = x * rstd
            if HAS_W:
                y = y * w
            tl.store(y_ptr + row + cols, y.to(tl.bfloat16), mask=body)
            if ROPE:
                e_off = D - R + 2 * half
                ev = tl.load(x_ptr + xrow + e_off).to(tl.float32) * rstd
                od = tl.load(x_ptr + xrow + e_off + 1).to(tl.float32) * rstd
                if HAS_W:
                    ev = ev * tl.load(w_ptr + e_off).to(tl.float32)
                    od = od * tl.load(w_ptr + e_off + 1).to(tl.float32)
                c, s = rope_cos_sin(cs_ptr, tl.load(pos_ptr + r // rows_per_token).to(tl.int64), max_pos, half, R)
                tl.store(y_ptr + row + e_off, rope_rotate(ev, od, c, s, True).to(tl.bfloat16))
                tl.store(y_ptr + row + e_off + 1, rope_rotate(od, ev, c, s, False).to(tl.bfloat16))


@triton.jit
def _rmsnorm_rope_kernel(x_ptr, w_ptr, pos_ptr, cs_ptr, y_ptr, n_rows, rows_per_token, stride_xt, D, max_pos, eps,
                         HAS_W: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr,
                         BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """Grid ``(cdiv(n_rows, ROWS),)``.
    One program owns ``ROWS`` whole rows (:func:`rmsnorm_rope_rows`)."""
    rmsnorm_rope_rows(x_ptr, w_ptr, pos_ptr, cs_ptr, y_ptr, tl.program_id(0), n_rows, rows_per_token, stride_xt, D,
                      max_pos, eps, HAS_W, NORM, ROPE, R, BLOCK_D, ROWS)


@triton.jit
def _q_kv_norm_rope_kernel(x_ptr, wq_ptr, wkv_ptr, pos_ptr, cs_ptr, q_ptr, kv_ptr, stride_xt, DQ, DKV, max_pos,
                           eps, slot_ptr, c_u8_ptr, c_f8_ptr, c_bf16_ptr, stride_blk, n_slots, q8_ptr, qs_ptr,
                           q8_eps, R: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                           CACHE: tl.constexpr, CACHE_BLOCK: tl.constexpr, Q_FP8: tl.constexpr):
    """Grid ``(T, 2)``.
    One program owns one segment of token ``t``: ``(t, 0)`` the q segment ``x[t, :DQ]`` (norm x gain
    -> ``q[t]``); ``(t, 1)`` the kv segment ``x[t, DQ:DQ+DKV]`` (norm x gain, bf16 round, GPT-J RoPE on the last
    ``R`` dims as ``R/2`` (even, odd) pairs -> ``kv[t]``; with ``CACHE`` (DKV 512, R 64) the row is not
    stored but written as the fp8_ds_mla entry of slot ``slot_ptr[t]`` (``mla_cache.fp8_ds_mla_pack``)).
    ``Q_FP8``: the q program also writes the bf16 q row's 1x128 FP8 quant (e4m3 ``q8[t]``, UE8M0 bytes
    ``qs[t]``: ``fp8_gemm``'s prologue quant, ``_fp8.quant_rows_e4m3_pow2``), the next linear's operand."""
    t = tl.program_id(0)
    seg = tl.program_id(1)
    xrow = x_ptr + t.to(tl.int64) * stride_xt
    # each branch names its own values: Triton merges a name bound in both branches into one type
    if seg == 0:
        cq = tl.arange(0, BLOCK_Q)
        mq = cq < DQ
        xq = tl.load(xrow + cq, mask=mq, other=0.0).to(tl.float32)
        rq = rms_rstd(xq, DQ, eps, 0)
        wq = tl.load(wq_ptr + cq, mask=mq, other=0.0).to(tl.float32)
        qb = (xq * rq * wq).to(tl.bfloat16)
        tl.store(q_ptr + t.to(tl.int64) * DQ + cq, qb, mask=mq)
        if Q_FP8:
            # groups past DQ (BLOCK_Q > DQ) hold zeros and are not stored
            g8, s8 = quant_rows_e4m3_pow2(tl.reshape(qb.to(tl.float32), (BLOCK_Q // 128, 128)), q8_eps, True)
            tl.store(q8_ptr + t.to(tl.int64) * DQ + cq, tl.reshape(g8, (BLOCK_Q,)), mask=mq)
            gi = tl.arange(0, BLOCK_Q // 128)
            tl.store(qs_ptr + t.to(tl.int64) * (DQ // 128) + gi, fp32_pow2_to_ue8m0(s8).to(tl.uint8),
                     mask=gi < DQ // 128)
    else:
        ck = tl.arange(0, BLOCK_KV)
        mk = ck < DKV
        xk = tl.load(xrow + DQ + ck, mask=mk, other=0.0).to(tl.float32)
        rk = rms_rstd(xk, DKV, eps, 0)
        wk = tl.load(wkv_ptr + ck, mask=mk, other=0.0).to(tl.float32)
        body = (xk * rk * wk).to(tl.bfloat16)
        half = tl.arange(0, R // 2)
        e_off = DKV - R + 2 * half
        # the normed kv is rounded to bf16 before the rotation (vLLM: kv_norm's bf16 output feeds the rope)
        ev = (tl.load(xrow + DQ + e_off).to(tl.float32) * rk
              * tl.load(wkv_ptr + e_off).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
        od = (tl.load(xrow + DQ + e_off + 1).to(tl.float32) * rk
              * tl.load(wkv_ptr + e_off + 1).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
        cs, sn = rope_cos_sin(cs_ptr, tl.load(pos_ptr + t).to(tl.int64), max_pos, half, R)
        r_ev = rope_rotate(ev, od, cs, sn, True).to(tl.bfloat16)
        r_od = rope_rotate(od, ev, cs, sn, False).to(tl.bfloat16)
        if CACHE:
            # the entry as 8 tiles of 64: the 7 NoPE tiles of the body, then the rotated pairs in dim order
            g = tl.arange(0, 8)
            rope = tl.interleave(r_ev, r_od)
            ent = tl.where(g[:, None] == 7, rope[None, :], tl.reshape(body, (8, 64)))
            slot = tl.load(slot_ptr + t).to(tl.int64)
            fp8_ds_mla_pack(c_u8_ptr, c_f8_ptr, c_bf16_ptr, slot, n_slots, stride_blk, ent, CACHE_BLOCK)
        else:
            orow = kv_ptr + t.to(tl.int64) * DKV
            tl.store(orow + ck, body, mask=ck < DKV - R)
            tl.store(orow + e_off, r_ev)
            tl.store(orow + e_off + 1, r_od)


@triton.jit(do_not_specialize=["n_q", "q_progs", "n_i"])
def _q_norm_rope_indexer_q_kernel(q_ptr, pos_ptr, cs_ptr, qo_ptr, n_q, q_heads, stride_qt, D, q_progs,
                                  iq_ptr, iw_ptr, i8_ptr, iwo_ptr, n_i, IH, stride_it, stride_ih, stride_wt,
                                  w_scale, max_pos, eps, i_eps, R: tl.constexpr, BLOCK_D: tl.constexpr,
                                  QROWS: tl.constexpr, ID: tl.constexpr, IROWS: tl.constexpr, EXACT: tl.constexpr):
    """Grid ``(q_progs + cdiv(n_i, IROWS),)``, ``q_progs = cdiv(n_q, QROWS)``: two independent jobs in one
    launch. Programs ``[0, q_progs)``: the attention q's weight-free RMSNorm + RoPE, ``QROWS`` of the
    ``n_q = T * q_heads`` rows of ``D`` each (:func:`rmsnorm_rope_rows`, the code of ``rmsnorm_rope``);
    programs ``[q_progs, ...)``: the indexer q's RoPE + FP8 quant + head weights, ``IROWS`` of the
    ``n_i = T * IH`` rows of ``ID`` each (``indexer.indexer_q_rows``, the code of ``indexer_q_rope_quant``,
    ``EXACT`` products on a GPU: this kernel is built with fp fusion on, as ``rmsnorm_rope``'s)."""
    pid = tl.program_id(0)
    if pid < q_progs:
        rmsnorm_rope_rows(q_ptr, q_ptr, pos_ptr, cs_ptr, qo_ptr, pid, n_q, q_heads, stride_qt, D, max_pos, eps,
                          False, True, True, R, BLOCK_D, QROWS)
    else:
        indexer_q_rows(iq_ptr, pos_ptr, cs_ptr, iw_ptr, i8_ptr, iwo_ptr, pid - q_progs, n_i, IH, max_pos, stride_it,
                       stride_ih, stride_wt, w_scale, i_eps, ID, R, IROWS, EXACT)


@triton.jit
def _swiglu_clamp_kernel(gu_ptr, y_ptr, I, stride_gu, limit, BLOCK: tl.constexpr):
    """Grid ``(T, cdiv(I, BLOCK))``.
    One program owns ``BLOCK`` output columns of one token (their gate and up inputs)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    row = gu_ptr + t.to(tl.int64) * stride_gu
    g = tl.load(row + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(row + I + cols, mask=m, other=0.0).to(tl.float32)
    g = tl.where(g > limit, limit, g)
    u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + t.to(tl.int64) * I + cols, y.to(tl.bfloat16), mask=m)


def _check_tensor(name, t, dtypes):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")


def rmsnorm_rope(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                 positions: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None,
                 norm: bool = True, config: dict | None = None) -> torch.Tensor:
    """Per-row RMSNorm (optional weight) then GPT-J RoPE on the last ``R`` dims, one launch.

    Grid: ``(cdiv(N, ROWS),)`` over the ``N = x.numel() // D`` rows; a program owns ``ROWS``
    whole rows (``BLOCK_D = next_pow2(D)`` lanes, the rope tail as ``R/2`` even/odd pairs).

    Args:
        x: bfloat16 ``(T, D)`` or ``(T, H, D)`` (a ``(T, H, D)`` row belongs to token ``row // H``),
            rows contiguous within a token (``stride(-1) == 1``, ``stride(1) == D`` for 3-d); any
            token stride ``stride(0)`` (a column slice of a wider GEMM output). ``D <= 16384``.
        weight: None, or ``(D,)`` bfloat16/float32 norm gain.
        eps: RMSNorm epsilon (``rms_norm_eps``).
        positions: None (no RoPE) or ``(T,)`` int32/int64 token positions in ``[0, cos_sin.shape[0])``;
            a position outside the table gives NaN in that row's rope dims (no host sync to check).
        cos_sin: float32 ``(max_pos, R)`` ``cos || sin`` table (:func:`ds4lab.reference.rope.cos_sin_cache`),
            ``R`` even, ``R <= D``, a power of two; required with ``positions``.
        norm: False skips the RMSNorm (plain RoPE, ``weight`` must then be None).
        config: a row of ``CONFIGS["rmsnorm_rope"][arch]`` to force; default picks by arch and rows.

    Returns:
        bfloat16 tensor of ``x``'s shape, contiguous (one rounding of the float32 result).

    Raises:
        TypeError: wrong dtypes. ValueError: wrong shapes, ``x`` rows not contiguous, missing ``cos_sin``,
        devices that differ.

    Semantics: DeepSeek-V4 q/kv RMSNorm and RoPE (vLLM 0.32 ``models/deepseek_v4``,
    :mod:`ds4lab.reference.norm_rope`).
    """
    _check_tensor("x", x, (torch.bfloat16,))
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected (T, D) or (T, H, D), got shape {tuple(x.shape)}")
    T, D = x.shape[0], x.shape[-1]
    if x.numel() and ((D > 1 and x.stride(-1) != 1) or (x.dim() == 3 and x.shape[1] > 1 and x.stride(1) != D)):
        raise ValueError(f"x: rows must be contiguous within a token (stride(-1) == 1, stride(1) == D), "
                         f"got strides {tuple(x.stride())}")
    if not 1 <= D <= 16384:
        raise ValueError(f"x: last dim {D} outside 1..16384")
    if weight is not None:
        _check_tensor("weight", weight, (torch.bfloat16, torch.float32))
        if tuple(weight.shape) != (D,):
            raise ValueError(f"weight: expected shape ({D},), got {tuple(weight.shape)}")
        if not norm:
            raise ValueError("weight: given with norm=False (a gain without the norm is not this op)")
        weight = weight.contiguous()
    eps = _checks.fp32_scalar("eps", eps, nonnegative=True)
    rope = positions is not None
    R = 2
    if rope:
        _check_tensor("positions", positions, (torch.int32, torch.int64))
        if positions.dim() != 1 or positions.shape[0] != T:
            raise ValueError(f"positions: expected shape ({T},), got {tuple(positions.shape)}")
        if cos_sin is None:
            raise ValueError("cos_sin: required when positions is given")
        _check_tensor("cos_sin", cos_sin, (torch.float32,))
        if cos_sin.dim() != 2 or cos_sin.shape[1] % 2 or cos_sin.shape[1] > D or \
                cos_sin.shape[1] & (cos_sin.shape[1] - 1) or cos_sin.shape[1] < 2:
            raise ValueError(f"cos_sin: expected (max_pos, R) with R even, a power of two, <= D={D}; "
                             f"got {tuple(cos_sin.shape)}")
        R = cos_sin.shape[1]
        cos_sin = cos_sin.contiguous()
        positions = positions.contiguous()
    elif not norm:
        raise ValueError("positions: None with norm=False leaves nothing to do")
    for n, t in (("weight", weight), ("positions", positions), ("cos_sin", cos_sin)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{n}: device {t.device} != x device {x.device}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = x.numel() // D if D else 0
    if n_rows == 0:
        return y
    cfg = config or pick_config("rmsnorm_rope", n_rows, x.device)
    rows = cfg["ROWS"]
    dummy = x
    _rmsnorm_rope_kernel[(triton.cdiv(n_rows, rows),)](
        x, weight if weight is not None else dummy, positions if rope else dummy,
        cos_sin if rope else dummy, y, n_rows, n_rows // T, x.stride(0), D, cos_sin.shape[0] if rope else 0,
        float(eps),
        HAS_W=weight is not None, NORM=bool(norm), ROPE=rope, R=R, BLOCK_D=triton.next_power_of_2(D),
        ROWS=rows, num_warps=cfg["num_warps"], num_stages=1)
    return y


def q_kv_rmsnorm_rope(x: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor, q_dim: int, eps: float,
                      positions: torch.Tensor, cos_sin: torch.Tensor, config: dict | None = None, *,
                      kv_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                      block_size: int = 64, q_fp8: bool = False):
    """The q_norm and kv_norm of the fused ``wq_a | wkv`` output, and the kv RoPE, one launch;
    optionally the kv's fp8_ds_mla cache insert in the same launch.

    Grid: ``(T, 2)``; program ``(t, 0)`` norms token ``t``'s q segment, ``(t, 1)`` its kv segment
    and rotates the kv rope tail (with ``kv_cache``: and writes it as token ``t``'s cache entry).

    Args:
        x: bfloat16 ``(T, q_dim + Dkv)`` (the ``wqkv_a`` GEMM output), last dim contiguous, any
            row stride. ``q_dim``, ``Dkv`` in ``1..16384``.
        q_weight: ``(q_dim,)`` bfloat16/float32 ``q_norm`` gain; kv_weight: ``(Dkv,)`` ``kv_norm`` gain.
        q_dim: width of the q segment (``q_lora_rank``).
        eps: RMSNorm epsilon (both norms).
        positions: ``(T,)`` int32/int64 token positions; outside ``[0, cos_sin.shape[0])`` gives NaN
            in that token's kv rope dims (no host sync to check).
        cos_sin: float32 ``(max_pos, R)`` ``cos || sin`` table, ``R`` even, a power of two, ``<= Dkv``.
        config: a row of ``CONFIGS["q_kv_rmsnorm_rope"][arch]`` to force.
        kv_cache: None, or the fp8_ds_mla cache (uint8, the layout of
            :func:`ds4lab_kernels.mla_cache.fp8_ds_mla_insert`, written in place) that receives the kv
            rows instead of returning them; needs ``Dkv == 512`` and ``R == 64``.
        slot_mapping: with ``kv_cache``: ``(T,)`` int32/int64 global slots ``block * block_size + pos``;
            a slot outside ``[0, num_blocks * block_size)`` (``-1``) skips the token; slots must be
            distinct (as for the insert).
        block_size: with ``kv_cache``: entries per cache block.
        q_fp8: also return the q rows' 1x128 FP8 quant, the operand of the next block-FP8 linear
            (``wq_b``) written by this launch: ``q_dim`` a multiple of 128, a device with FP8.

    Returns:
        ``(q (T, q_dim), kv (T, Dkv))`` bfloat16, contiguous: ``q = bf16(rms(x_q) * q_weight)``,
        ``kv = bf16(rope(bf16(rms(x_kv) * kv_weight)))`` (float32 math; the kv is rounded to bf16
        between its norm and its rotation, as vLLM's ``kv_norm`` output feeds its rope kernel).
        With ``kv_cache``: ``q`` only; the cache holds, byte for byte, what
        ``fp8_ds_mla_insert(kv, slot_mapping, kv_cache, block_size)`` writes.
        With ``q_fp8``: ``q`` is replaced by ``(q, q_fp8 (T, q_dim) float8_e4m3fn, q_scale (T, q_dim/128)
        uint8 UE8M0)``, byte for byte ``fp8_quant.per_token_group_quant_fp8(q, 128, "ue8m0", eps=1e-10)``
        (what ``fp8_gemm.w8a8_block_fp8_linear`` quantizes in its prologue), so the linear can run
        ``fp8_gemm_nt`` on it.

    Raises:
        TypeError: wrong dtypes. ValueError: wrong shapes, ``q_dim`` outside the row, last dim not
        contiguous, bad ``cos_sin``, devices that differ; with ``kv_cache``: ``Dkv != 512`` or
        ``R != 64``, a bad cache / ``block_size`` / ``slot_mapping`` (named), a device without FP8;
        with ``q_fp8``: ``q_dim`` not a multiple of 128, a device without FP8.

    Semantics: vLLM 0.32 ``models/deepseek_v4`` attention (``q_norm``, ``kv_norm`` RMSNorm modules,
    then the kv side of ``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert``);
    :func:`ds4lab.reference.norm_rope.q_kv_rmsnorm_rope`.
    """
    _check_tensor("x", x, (torch.bfloat16,))
    if x.dim() != 2:
        raise ValueError(f"x: expected (T, q_dim + Dkv), got shape {tuple(x.shape)}")
    if x.numel() and x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x: last dim must be contiguous, got strides {tuple(x.stride())}")
    T, D = x.shape
    if not isinstance(q_dim, int) or isinstance(q_dim, bool) or not 1 <= q_dim < D or q_dim > 16384 or \
            D - q_dim > 16384:
        raise ValueError(f"q_dim={q_dim!r}: expected an int with 1 <= q_dim < x.shape[1]={D}, both segments "
                         f"<= 16384 wide")
    dkv = D - q_dim
    for n, w, d in (("q_weight", q_weight, q_dim), ("kv_weight", kv_weight, dkv)):
        _check_tensor(n, w, (torch.bfloat16, torch.float32))
        if tuple(w.shape) != (d,):
            raise ValueError(f"{n}: expected shape ({d},), got {tuple(w.shape)}")
    eps = _checks.fp32_scalar("eps", eps, nonnegative=True)
    _check_tensor("positions", positions, (torch.int32, torch.int64))
    if positions.dim() != 1 or positions.shape[0] != T:
        raise ValueError(f"positions: expected shape ({T},), got {tuple(positions.shape)}")
    _check_tensor("cos_sin", cos_sin, (torch.float32,))
    R = cos_sin.shape[1] if cos_sin.dim() == 2 else 0
    if cos_sin.dim() != 2 or R < 2 or R % 2 or R > dkv or R & (R - 1):
        raise ValueError(f"cos_sin: expected (max_pos, R) with R even, a power of two, <= Dkv={dkv}; "
                         f"got {tuple(cos_sin.shape)}")
    for n, t in (("q_weight", q_weight), ("kv_weight", kv_weight), ("positions", positions), ("cos_sin", cos_sin)):
        if t.device != x.device:
            raise ValueError(f"{n}: device {t.device} != x device {x.device}")
    fused = kv_cache is not None
    q = torch.empty(T, q_dim, dtype=torch.bfloat16, device=x.device)
    if not isinstance(q_fp8, bool):
        raise TypeError(f"q_fp8={q_fp8!r}: expected a bool")
    if q_fp8:
        if q_dim % 128:
            raise ValueError(f"q_fp8: needs q_dim a multiple of 128 (1x128 quant groups), got q_dim={q_dim}")
        require_fp8("x", x.device, "q_kv_rmsnorm_rope(q_fp8=True)")
        q8 = torch.empty(T, q_dim, dtype=torch.float8_e4m3fn, device=x.device)
        qs = torch.empty(T, q_dim // 128, dtype=torch.uint8, device=x.device)
    else:
        q8 = qs = q                              # dummy pointers (not written)
    ret_q = (q, q8, qs) if q_fp8 else q
    if fused:
        if dkv != mla_cache.HEAD_DIM or R != mla_cache.ROPE_DIM:
            raise ValueError(f"kv_cache: the fp8_ds_mla entry needs Dkv={mla_cache.HEAD_DIM} and R="
                             f"{mla_cache.ROPE_DIM} rope dims, got Dkv={dkv}, R={R}")
        if slot_mapping is None:
            raise ValueError("slot_mapping: required with kv_cache")
        u8, f8, bf, stride, n_slots, slots = mla_cache.writer_args(
            "kv_cache", kv_cache, block_size, "slot_mapping", slot_mapping, "q_kv_rmsnorm_rope(kv_cache=...)", x=x)
        if slots.shape[0] != T:
            raise ValueError(f"slot_mapping: {slots.shape[0]} slots for {T} tokens")
        kv = q                                   # not written (dummy pointer)
    else:
        if slot_mapping is not None:
            raise ValueError("slot_mapping: given without kv_cache")
        kv = torch.empty(T, dkv, dtype=torch.bfloat16, device=x.device)
        u8 = f8 = bf = slots = x                 # dummy pointers (not read)
        stride = n_slots = 0
    if T == 0:
        return ret_q if fused else (ret_q, kv)
    if fused and n_slots == 0:
        u8 = f8 = bf = x                         # an empty cache: every slot is skipped
    cfg = config or pick_config("q_kv_rmsnorm_rope", T, x.device)
    _q_kv_norm_rope_kernel[(T, 2)](x, q_weight.contiguous(), kv_weight.contiguous(), positions.contiguous(),
                                   cos_sin.contiguous(), q, kv, x.stride(0), q_dim, dkv, cos_sin.shape[0],
                                   float(eps), slots, u8, f8, bf, stride, n_slots, q8, qs, ACT_QUANT_EPS, R=R,
                                   BLOCK_Q=max(128, triton.next_power_of_2(q_dim)),
                                   BLOCK_KV=triton.next_power_of_2(dkv), CACHE=fused,
                                   CACHE_BLOCK=block_size if fused else 1, Q_FP8=q_fp8,
                                   num_warps=cfg["num_warps"], num_stages=1)
    return ret_q if fused else (ret_q, kv)


def q_norm_rope_indexer_q(q: torch.Tensor, iq: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                          weights: torch.Tensor, eps: float, config: dict | None = None):
    """The attention q's per-head RMSNorm + RoPE and the indexer q's RoPE + FP8 quant (a C4A layer's
    two q preparations after the fused ``wq_b | indexer wq_b`` GEMM), one launch.

    Grid: ``(cdiv(T*H, QROWS) + cdiv(T*IH, IROWS),)``; programs ``[0, cdiv(T*H, QROWS))`` run
    :func:`rmsnorm_rope`'s code on ``QROWS`` q rows each, the rest
    :func:`ds4lab_kernels.indexer.indexer_q_rope_quant`'s code on ``IROWS`` indexer rows each.

    Args:
        q: bfloat16 ``(T, H, D)`` attention q (16 heads x 512 at TP=4), rows contiguous within a token
            (``stride(2) == 1``, ``stride(1) == D``), any token stride (a column slice of the fused GEMM
            output). ``D <= 16384``.
        iq: bfloat16 ``(T, IH, ID)`` indexer q (64 heads x 128), last dim contiguous, any head / token
            stride; ``ID`` a power of two ``<= 1024``.
        positions: ``(T,)`` int32/int64 token positions; outside ``[0, cos_sin.shape[0])`` gives NaN in
            that token's q rope dims and a NaN scale / weight for all its indexer heads (no host sync).
        cos_sin: float32 ``(max_pos, R)`` ``cos || sin`` table, ``R`` even, a power of two, ``<= ID`` and
            ``<= D`` (both q's rope the last ``R`` dims of each head with it).
        weights: ``(T, IH)`` bfloat16/float32 indexer head weights (``weights_proj`` output; a column
            slice is fine), last dim contiguous.
        eps: the q RMSNorm epsilon (``rms_norm_eps``).
        config: a row of ``CONFIGS["q_norm_rope_indexer_q"][arch]`` (``QROWS``, ``IROWS``, ``num_warps``).

    Returns:
        ``(q_normed (T, H, D) bfloat16, q_fp8 (T, IH, ID) float8_e4m3fn, w (T, IH) float32)``, contiguous:
        bit for bit ``rmsnorm_rope(q, None, eps, positions, cos_sin)`` and
        ``indexer_q_rope_quant(iq, positions, cos_sin, weights)`` (each job's NaN / inf rules included).
        The indexer job's rotation products are PTX ``mul.rn`` on a GPU, so this launch (fp fusion on,
        as ``rmsnorm_rope``) rounds them as ``indexer_q_rope_quant`` (fp fusion off) does.

    Raises:
        TypeError: wrong dtypes. ValueError: wrong shapes or strides, token counts that differ, a bad
        ``cos_sin``, devices that differ (each named); a device without FP8.

    Semantics: vLLM 0.32 ``models/deepseek_v4`` (the q side of
    ``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert``; ``Indexer`` q RoPE + ``per_token_group_quant_fp8``),
    :func:`ds4lab.reference.q_indexer.q_norm_rope_indexer_q`.
    """
    check = _checks
    check.tensor("q", q, torch.bfloat16, ndim=3)
    T, H, D = q.shape
    if q.numel() and ((D > 1 and q.stride(2) != 1) or (H > 1 and q.stride(1) != D)):
        raise ValueError(f"q: rows must be contiguous within a token (stride(2) == 1, stride(1) == D), "
                         f"got strides {tuple(q.stride())}")
    if not 1 <= D <= 16384:
        raise ValueError(f"q: last dim {D} outside 1..16384")
    check.tensor("iq", iq, torch.bfloat16, ndim=3)
    if iq.shape[0] != T:
        raise ValueError(f"iq: {iq.shape[0]} tokens, q has {T}")
    IH, ID = iq.shape[1], iq.shape[2]
    check.last_dim_contiguous("iq", iq)
    if ID < 2 or ID & (ID - 1) or ID > 1024:
        raise ValueError(f"iq: head_dim={ID} must be a power of two in 2..1024")
    check.tensor("positions", positions, (torch.int32, torch.int64), ndim=1)
    if positions.shape[0] != T:
        raise ValueError(f"positions: shape {tuple(positions.shape)}, expected ({T},)")
    check.tensor("cos_sin", cos_sin, torch.float32, ndim=2)
    R = cos_sin.shape[1]
    if R < 2 or R & (R - 1) or R > ID or R > D:
        raise ValueError(f"cos_sin: rope_dim={R} must be an even power of two <= iq head_dim={ID} and <= q "
                         f"head_dim={D}; got shape {tuple(cos_sin.shape)}")
    check.tensor("weights", weights, (torch.bfloat16, torch.float32), ndim=2)
    if tuple(weights.shape) != (T, IH):
        raise ValueError(f"weights: shape {tuple(weights.shape)}, expected ({T}, {IH})")
    check.last_dim_contiguous("weights", weights)
    eps = check.fp32_scalar("eps", eps, nonnegative=True)
    check.same_device("q", q, iq=iq, positions=positions, cos_sin=cos_sin, weights=weights)
    require_fp8("iq", iq.device, "q_norm_rope_indexer_q")
    qo = torch.empty((T, H, D), dtype=torch.bfloat16, device=q.device)
    i8 = torch.empty((T, IH, ID), dtype=torch.float8_e4m3fn, device=q.device)
    wo = torch.empty((T, IH), dtype=torch.float32, device=q.device)
    n_q, n_i = T * H, T * IH
    if n_q == 0 and n_i == 0:
        return qo, i8, wo
    cfg = config or pick_config("q_norm_rope_indexer_q", n_q, q.device)
    q_progs = triton.cdiv(n_q, cfg["QROWS"])
    _q_norm_rope_indexer_q_kernel[(q_progs + triton.cdiv(n_i, cfg["IROWS"]),)](
        q, positions.contiguous(), cos_sin.contiguous(), qo, n_q, H, q.stride(0), D, q_progs,
        iq, weights, i8, wo, n_i, IH, iq.stride(0), iq.stride(1), weights.stride(0), ID ** -0.5 * IH ** -0.5,
        cos_sin.shape[0], float(eps), INDEXER_Q_EPS, R=R, BLOCK_D=triton.next_power_of_2(D), QROWS=cfg["QROWS"],
        ID=ID, IROWS=cfg["IROWS"], EXACT=not _INTERPRETED, num_warps=cfg["num_warps"], num_stages=1)
    return qo, i8, wo


#: the Triton CPU interpreter (no inline asm: the indexer job's plain products, as its own launcher)
_INTERPRETED = isinstance(_q_norm_rope_indexer_q_kernel, InterpretedFunction)


def swiglu_clamp(gu: torch.Tensor, limit: float, config: dict | None = None) -> torch.Tensor:
    """Clamped SwiGLU of the fused gate/up projection, one launch.

    Grid: ``(T, cdiv(I, BLOCK))``; a program owns ``BLOCK`` output columns of one token.

    Args:
        gu: bfloat16 ``(T, 2I)`` (gate ``[:, :I]`` then up ``[:, I:]``), last dim contiguous.
        limit: ``swiglu_limit`` (10.0): gate clamped above at ``limit``, up to ``[-limit, limit]``.
        config: a row of ``CONFIGS["swiglu_clamp"][arch]`` to force.

    Returns:
        bfloat16 ``(T, I)``: ``silu(min(g, limit)) * clamp(u, -limit, limit)`` in float32, rounded once.

    Raises:
        TypeError: wrong dtype. ValueError: odd width, non-contiguous last dim, bad ``limit``.

    Semantics: vLLM 0.32 DeepSeek-V4 shared-expert activation (``swiglu_limit``),
    :func:`ds4lab.reference.moe.swiglu_clamp`.
    """
    _check_tensor("gu", gu, (torch.bfloat16,))
    if gu.dim() != 2 or gu.shape[1] % 2:
        raise ValueError(f"gu: expected (T, 2I), got shape {tuple(gu.shape)}")
    if gu.shape[0] and gu.stride(1) != 1:
        raise ValueError(f"gu: last dim must be contiguous, got strides {tuple(gu.stride())}")
    limit = _checks.fp32_scalar("limit", limit, positive=True)
    T, I = gu.shape[0], gu.shape[1] // 2
    y = torch.empty(T, I, dtype=torch.bfloat16, device=gu.device)
    if T == 0 or I == 0:
        return y
    cfg = config or pick_config("swiglu_clamp", T, gu.device)
    _swiglu_clamp_kernel[(T, triton.cdiv(I, cfg["BLOCK"]))](gu, y, I, gu.stride(0), float(limit),
                                                           BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"],
                                                           num_stages=1)
    return y


# ---- config tables ------------------------------------------------------------------------------
# Both ops are pure bandwidth (one read, one write of a row), no shared memory beyond the row sum.
# Decode rows are few (T*H = 16..1024 at TP=4), one row per program keeps the grid wide; large
# batches take 4 rows per program. The CPU interpreter takes 8 rows (fewer Python programs).
CONFIGS = {
    "rmsnorm_rope": {
        "sm_89": {"row1": {"ROWS": 1, "num_warps": 4}, "row4": {"ROWS": 4, "num_warps": 4}},
        "sm_90": {"row1": {"ROWS": 1, "num_warps": 4}, "row4": {"ROWS": 4, "num_warps": 4}},
    },
    "q_kv_rmsnorm_rope": {
        "sm_89": {"w4": {"num_warps": 4}, "w8": {"num_warps": 8}},
        "sm_90": {"w4": {"num_warps": 4}, "w8": {"num_warps": 8}},
    },
    # the C4A layer's two q preparations in one grid: one num_warps for both jobs. 4 warps suit each:
    # rmsnorm_rope's q rows (512 wide, "row1" / "row4") and indexer_q_rope_quant's 4 x 128 tiles ("r4" /
    # "r16"), 4 values a thread either way; q2i8 halves the programs (T=1: 16 instead of 32).
    # PROVISIONAL: not timed yet (scripts/gpu/qidx.sh).
    "q_norm_rope_indexer_q": {
        a: {"q1i4": {"QROWS": 1, "IROWS": 4, "num_warps": 4}, "q2i8": {"QROWS": 2, "IROWS": 8, "num_warps": 4},
            "q4i16": {"QROWS": 4, "IROWS": 16, "num_warps": 4}} for a in ("sm_89", "sm_90")},
    "swiglu_clamp": {
        "sm_89": {"b1024": {"BLOCK": 1024, "num_warps": 4}, "b256": {"BLOCK": 256, "num_warps": 2}},
        "sm_90": {"b1024": {"BLOCK": 1024, "num_warps": 4}, "b256": {"BLOCK": 256, "num_warps": 2}},
    },
}


def pick_config(op: str, rows: int, device: torch.device) -> dict:
    """The default config of ``op`` (``"rmsnorm_rope"`` / ``"q_kv_rmsnorm_rope"`` / ``"swiglu_clamp"`` /
    ``"q_norm_rope_indexer_q"``) for ``rows`` rows (tokens for ``q_kv_rmsnorm_rope``: one program per
    segment of a token, 4 warps for the 1536-wide q segment; the attention q rows for
    ``q_norm_rope_indexer_q``: the two launchers' own choices, ``row1`` + ``r4`` below 4096 rows; timed by
    the registry's configs)."""
    if device.type != "cuda":
        return {"rmsnorm_rope": {"ROWS": 8, "num_warps": 4}, "q_kv_rmsnorm_rope": {"num_warps": 4},
                "swiglu_clamp": {"BLOCK": 1024, "num_warps": 4},
                "q_norm_rope_indexer_q": {"QROWS": 8, "IROWS": 256, "num_warps": 4}}[op]
    table = CONFIGS[op][arch_of(device)]
    if op == "q_kv_rmsnorm_rope":
        return table["w4"]
    if op == "q_norm_rope_indexer_q":
        return table["q4i16"] if rows >= 4096 else table["q1i4"]
    if op == "rmsnorm_rope":
        return table["row4"] if rows >= 4096 else table["row1"]
    return table["b1024"] if rows >= 64 else table["b256"]
