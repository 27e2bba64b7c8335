"""mHC (manifold-constrained hyper-connections) for DeepSeek-V4: TF32 pre-norm GEMM, pre (gates, Sinkhorn,
collapse + RMSNorm), post, fused post+pre between sublayers, and hc_head.

Semantics (vLLM ``model_executor/kernels/mhc/torch.py`` ``mhc_pre_torch`` / ``mhc_post_torch``, the TileLang
kernels in ``tilelang_kernels.py`` used by ``models/deepseek_v4/nvidia/model.py``, DeepGEMM
``tf32_hc_prenorm_gemm``). The residual has ``hc = 4`` streams ``res[T, 4, D]``; ``K = 4 D``.

- pre-norm GEMM: ``mixes = res.view(T, K) @ fn[24, K]^T`` and ``sqrsum = sum(res^2)`` per token, split-K
  into ``S`` partials ``[S, T, 24]`` / ``[S, T]`` whose sums are the full values.
- ``r = rsqrt(sqrsum / K + rms_eps)``; mixes order: pre ``[0:4]``, post ``[4:8]``, comb ``[8:24]`` (row-major 4x4):
  ``pre = sigmoid(mix[0:4] r scale[0] + base[0:4]) + hc_pre_eps``,
  ``post = sigmoid(mix[4:8] r scale[1] + base[4:8]) * hc_post_mult`` (2.0),
  ``comb = softmax_rows(mix[8:24] r scale[2] + base[8:24]) + eps``, then column-normalise, then
  ``sinkhorn_iters - 1`` times (row-normalise, column-normalise), each ``x / (sum + eps)``.
- collapse ``y = bf16(sum_i pre_i res_i)``; with a norm weight ``layer_input = bf16(y rsqrt(mean(y^2) + norm_eps) w)``.
- post: ``new[:, j] = sum_i comb[:, i, j] res[:, i] + post[:, j] x`` -> bf16 (``x`` bf16, or fp32 used
  unrounded: the MoE's fp32 shared + routed sum); with a second addend ``x2``
  (the MoE's shared expert) ``x`` is first ``bf16(x.float() + x2.float())``, the model's separate add.
- decode seam (``SEAM_*`` rows, issue 20): post + next pre in one launch, a grid barrier between the
  column programs' partials and their collapse, Sinkhorn in a program of its own (``_mhc_seam_kernel``).
- ``mhc_fused_post_pre(quant_out=True)`` (issue 20, pq-mhc): also the layer input's FP8 copy, e4m3 + one UE8M0
  byte per 128 columns, ``per_token_group_quant_fp8(layer_input, 128, "ue8m0")`` bit for bit, written by the
  kernel that writes the layer input where :func:`quant_out_path` says ``"fused"``.
- hc_head: 4 mixes, ``pre = sigmoid(mix r scale[0] + base) + hc_eps``, ``out = bf16(sum_i pre_i res_i)``.
"""
import os

import torch
import triton
import triton.language as tl

from . import _checks as check
from ._counters import zeroed_counters
from ._arch import arch_of, num_sms, require_fp8
from ._fp8 import ACT_QUANT_EPS, fp32_pow2_to_ue8m0, quant_rows_e4m3_pow2
from ._l2 import prefetch_kwargs, prefetch_regions, prefetch_regions_l2
from .fp8_quant import per_token_group_quant_fp8

HC = 4  # DeepSeek-V4 hc_mult
SEAM_MAX_TILES = 64  # token blocks the seam's barrier buffer serves (16 tokens each)
SEAM_MAX_T = 64  # the seam rows serve decode sizes; above, a seam row falls back to the two-pass kernels
PRECISIONS = ("tf32", "ieee")
QUANT_GROUP = 128  # mhc_fused_post_pre(quant_out=True): columns per UE8M0 scale (DeepSeek-V4's 1x128 activations)


# ---- kernels -------------------------------------------------------------------------------------
@triton.jit
def _hc_prenorm_gemm_kernel(
    x_ptr, fn_ptr, mix_ptr, sq_ptr,
    T, N, K, k_per_split,
    stride_xt, stride_fn, stride_ms, stride_mt, stride_ss,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(T, BLOCK_M), S)``.
    One program: BLOCK_M tokens x one K split: partial mixes ``[BLOCK_M, N]`` and partial sums of squares.

    Split-K partials: program (m, s) sums k in ``[s*k_per_split, (s+1)*k_per_split)``."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    tmask = rm < T
    nmask = rn < N
    k_lo = pid_s * k_per_split  # splits are contiguous; the last one is cut by the `< K` mask
    x_row = x_ptr + rm.to(tl.int64)[:, None] * stride_xt
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for it in range(0, k_per_split // BLOCK_K):  # bounds from plain args (triton 3.6 interpreter)
        kk = k_lo + it * BLOCK_K + rk
        kmask = kk < K
        x = tl.load(x_row + kk[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + rn[None, :] * stride_fn + kk[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        sq += tl.sum(x * x, axis=1)
    m_off = pid_s * stride_ms + rm.to(tl.int64)[:, None] * stride_mt + rn[None, :]
    tl.store(mix_ptr + m_off, acc, mask=tmask[:, None] & nmask[None, :])
    tl.store(sq_ptr + pid_s * stride_ss + rm, sq, mask=tmask)


@triton.jit
def _col(ptr, rows, stride, j, mask):
    """``ptr[rows, j]`` as an fp32 vector (per-token coefficient)."""
    return tl.load(ptr + rows.to(tl.int64) * stride + j, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _add_bf16(x, x2_ptrs, mask):
    """``bf16(x + x2)`` back in fp32: torch's ``(a.float() + b.float()).to(bf16)`` (the MoE's final add)."""
    return (x + tl.load(x2_ptrs, mask=mask, other=0.0).to(tl.float32)).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _post_stream(x, r0, r1, r2, r3, p, c0, c1, c2, c3):
    """new_j = post_j x + sum_i comb[i, j] r_i for one output stream j (fp32)."""
    return (p[:, None] * x + c0[:, None] * r0 + c1[:, None] * r1 + c2[:, None] * r2 + c3[:, None] * r3)


@triton.jit
def _mhc_post_kernel(
    x_ptr, x2_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, mix_ptr, sq_ptr,
    T, D, N, d_per_split,
    stride_xt, stride_x2t, stride_rt, stride_rh, stride_pt, stride_ct, stride_ot, stride_oh,
    stride_fn, stride_ms, stride_mt, stride_ss,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRENORM: tl.constexpr, PRECISION: tl.constexpr, HAS_X2: tl.constexpr,
):
    """Grid ``(cdiv(T, BLOCK_M), S)``.
    One program: BLOCK_M tokens x hidden columns ``[s*d_per_split, +d_per_split)`` of all 4 streams.

    Writes ``out = post(x, res)`` in bf16; with PRENORM also the split-K partials of the next sublayer's
    pre-norm GEMM over the bf16-rounded new residual (fn column ``j*D + d`` meets stream j, column d).
    HAS_X2: the sublayer output is ``bf16(x + x2)`` (fp32 add; the MoE's routed + shared expert sum).
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    tmask = rm < T
    rm64 = rm.to(tl.int64)[:, None]
    x_row = x_ptr + rm64 * stride_xt
    x2_row = x2_ptr + rm64 * stride_x2t
    r_row = res_ptr + rm64 * stride_rt
    o_row = out_ptr + rm64 * stride_ot
    d_lo = pid_s * d_per_split  # contiguous splits; the last one is cut by the `< D` mask
    if PRENORM:
        rn = tl.arange(0, BLOCK_N)
        nmask = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        w_col = fn_ptr + rn[None, :] * stride_fn
    for it in range(0, d_per_split // BLOCK_K):  # bounds from plain args (triton 3.6 interpreter)
        dd = d_lo + it * BLOCK_K + rk
        m2 = tmask[:, None] & (dd < D)[None, :]
        x = tl.load(x_row + dd[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_X2:
            x = _add_bf16(x, x2_row + dd[None, :], m2)
        r0 = tl.load(r_row + dd[None, :], mask=m2, other=0.0).to(tl.float32)
        r1 = tl.load(r_row + stride_rh + dd[None, :], mask=m2, other=0.0).to(tl.float32)
        r2 = tl.load(r_row + 2 * stride_rh + dd[None, :], mask=m2, other=0.0).to(tl.float32)
        r3 = tl.load(r_row + 3 * stride_rh + dd[None, :], mask=m2, other=0.0).to(tl.float32)
        for j in tl.static_range(4):
            # coefficients re-read per chunk (L1 hits): holding all 20 per-token vectors live spills on sm_89
            n = _post_stream(x, r0, r1, r2, r3, _col(post_ptr, rm, stride_pt, j, tmask),
                             _col(comb_ptr, rm, stride_ct, j, tmask), _col(comb_ptr, rm, stride_ct, 4 + j, tmask),
                             _col(comb_ptr, rm, stride_ct, 8 + j, tmask),
                             _col(comb_ptr, rm, stride_ct, 12 + j, tmask)).to(tl.bfloat16)
            tl.store(o_row + j * stride_oh + dd[None, :], n, mask=m2)
            if PRENORM:
                f = n.to(tl.float32)
                sq += tl.sum(f * f, axis=1)
                w = tl.load(w_col + (j * D + dd)[:, None], mask=nmask[None, :] & (dd < D)[:, None], other=0.0)
                acc = tl.dot(f, w, acc, input_precision=PRECISION)
    if PRENORM:
        m_off = pid_s * stride_ms + rm64 * stride_mt + rn[None, :]
        tl.store(mix_ptr + m_off, acc, mask=tmask[:, None] & nmask[None, :])
        tl.store(sq_ptr + pid_s * stride_ss + rm, sq, mask=tmask)


@triton.jit
def _mhc_apply_kernel(
    mix_ptr, sq_ptr, scale_ptr, base_ptr, res_ptr, w_ptr,
    post_ptr, comb_ptr, out_ptr, res_out_ptr, q_ptr, qs_ptr,
    T, S, D, rms_numel, rms_eps, pre_eps, sk_eps, post_mult, n_iters, norm_eps, q_eps,
    stride_ms, stride_mt, stride_ss, stride_rt, stride_rh, stride_ot, stride_rot, stride_roh, stride_qt, stride_qst,
    HC_: tl.constexpr, HEAD: tl.constexpr, HAS_NORM: tl.constexpr, BROADCAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr = False,
):
    """Grid ``(cdiv(T, BLOCK_T),)``.
    One program: BLOCK_T tokens, each with its whole hidden row (reduce, gates, Sinkhorn, collapse).

    Per token block: reduce the S partials, gates (+ Sinkhorn unless HEAD), collapse (+ RMSNorm).

    HEAD: hc_head (4 mixes, pre gates only, no norm). BROADCAST: the residual is one ``[T, D]`` row read for
    every stream (layer 0); the 4 copies are written to ``res_out``.
    QUANT (issue 20, pq-mhc): also the layer input's FP8 copy, from the bf16 values written: e4m3 to ``q_ptr``
    (row stride ``stride_qt``) and one UE8M0 byte per 128 columns to ``qs_ptr`` (``stride_qst``), the program's
    whole rows as ``[BLOCK_T * BLOCK_D / 128, 128]`` groups (:func:`_fp8.quant_rows_e4m3_pow2`, amax floor
    ``q_eps``); needs ``D % 128 == 0`` (groups past D are padding, not stored).
    """
    pid = tl.program_id(0)
    rt = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = rt < T
    rt64 = rt.to(tl.int64)
    h = tl.arange(0, HC_)
    hh = tl.arange(0, HC_ * HC_)
    pre_acc = tl.zeros((BLOCK_T, HC_), dtype=tl.float32)
    post_acc = tl.zeros((BLOCK_T, HC_), dtype=tl.float32)
    comb_acc = tl.zeros((BLOCK_T, HC_ * HC_), dtype=tl.float32)
    sq_acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        rs = s0 + tl.arange(0, BLOCK_S)
        m2 = (rs < S)[:, None] & tmask[None, :]
        off = rs.to(tl.int64)[:, None] * stride_ms + rt64[None, :] * stride_mt            # [BS, BT]
        pre_acc += tl.sum(tl.load(mix_ptr + off[:, :, None] + h[None, None, :], mask=m2[:, :, None], other=0.0),
                          axis=0)
        if not HEAD:
            post_acc += tl.sum(tl.load(mix_ptr + off[:, :, None] + HC_ + h[None, None, :], mask=m2[:, :, None],
                                       other=0.0), axis=0)
            comb_acc += tl.sum(tl.load(mix_ptr + off[:, :, None] + 2 * HC_ + hh[None, None, :],
                                       mask=m2[:, :, None], other=0.0), axis=0)
        sq_acc += tl.sum(tl.load(sq_ptr + rs.to(tl.int64)[:, None] * stride_ss + rt64[None, :], mask=m2, other=0.0),
                         axis=0)
    rms = tl.math.rsqrt(sq_acc / rms_numel + rms_eps)[:, None]                         # [BT, 1]
    pre = tl.sigmoid(pre_acc * rms * tl.load(scale_ptr) + tl.load(base_ptr + h)[None, :]) + pre_eps
    if not HEAD:
        post = tl.sigmoid(post_acc * rms * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC_ + h)[None, :]) * post_mult
        tl.store(post_ptr + rt64[:, None] * HC_ + h[None, :], post, mask=tmask[:, None])
        logits = comb_acc * rms * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC_ + hh)[None, :]
        cm = tl.reshape(logits, (BLOCK_T, HC_, HC_))                                  # [t, i, j]
        cm = tl.exp(cm - tl.max(cm, axis=2)[:, :, None])
        cm = cm / tl.sum(cm, axis=2)[:, :, None] + sk_eps
        cm = cm / (tl.sum(cm, axis=1)[:, None, :] + sk_eps)
        for _ in range(1, n_iters):
            cm = cm / (tl.sum(cm, axis=2)[:, :, None] + sk_eps)
            cm = cm / (tl.sum(cm, axis=1)[:, None, :] + sk_eps)
        tl.store(comb_ptr + rt64[:, None] * (HC_ * HC_) + hh[None, :], tl.reshape(cm, (BLOCK_T, HC_ * HC_)),
                 mask=tmask[:, None])
    # collapse y = sum_i pre_i res_i over the whole hidden row
    rd = tl.arange(0, BLOCK_D)
    dmask = rd < D
    m2d = tmask[:, None] & dmask[None, :]
    r_row = res_ptr + rt64[:, None] * stride_rt + rd[None, :]
    if BROADCAST:
        r = tl.load(r_row, mask=m2d, other=0.0)
        for i in tl.static_range(HC_):
            tl.store(res_out_ptr + rt64[:, None] * stride_rot + i * stride_roh + rd[None, :], r, mask=m2d)
        y = tl.sum(pre, axis=1)[:, None] * r.to(tl.float32)
    else:
        y = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for i in tl.static_range(HC_):
            p_i = tl.sum(tl.where(h[None, :] == i, pre, 0.0), axis=1)
            y += p_i[:, None] * tl.load(r_row + i * stride_rh, mask=m2d, other=0.0).to(tl.float32)
    yb = y.to(tl.bfloat16)
    o_row = out_ptr + rt64[:, None] * stride_ot + rd[None, :]
    if HAS_NORM:
        yf = yb.to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(yf * yf, axis=1) / D + norm_eps)
        w = tl.load(w_ptr + rd, mask=dmask, other=0.0).to(tl.float32)
        ob = (yf * inv[:, None] * w[None, :]).to(tl.bfloat16)
        tl.store(o_row, ob, mask=m2d)
    else:
        ob = yb
        tl.store(o_row, yb, mask=m2d)
    if QUANT:
        NG: tl.constexpr = BLOCK_D // 128
        tl.static_assert(BLOCK_D % 128 == 0)
        q, sc = quant_rows_e4m3_pow2(tl.reshape(ob.to(tl.float32), (BLOCK_T * NG, 128)), q_eps)
        tl.store(q_ptr + rt64[:, None] * stride_qt + rd[None, :], tl.reshape(q, (BLOCK_T, BLOCK_D)), mask=m2d)
        rg = tl.arange(0, NG)
        tl.store(qs_ptr + rt64[:, None] * stride_qst + rg[None, :],
                 tl.reshape(fp32_pow2_to_ue8m0(sc).to(tl.uint8), (BLOCK_T, NG)),
                 mask=tmask[:, None] & (rg < D // 128)[None, :])


@triton.jit
def _grid_barrier(sync_ptr, n_programs):
    """Wait until ``n_programs`` programs sharing ``sync_ptr`` (int32: arrival count at [0], generation
    at [32], a separate 128-byte line) have arrived. Self-resetting: the last arrival zeroes the count,
    then bumps the generation (release) the others spin on (volatile loads, then one acquire read).
    Every program of the grid must be resident at once (the launcher keeps the grid <= the SM count)."""
    tl.debug_barrier()  # the whole CTA's stores precede thread 0's release below
    gen = tl.atomic_add(sync_ptr + 32, 0, sem="acquire")
    arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
    if arrived == n_programs - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
        tl.atomic_add(sync_ptr + 32, 1, sem="release")
    else:
        cur = tl.load(sync_ptr + 32, volatile=True)
        while cur == gen:
            cur = tl.load(sync_ptr + 32, volatile=True)
        tl.atomic_add(sync_ptr + 32, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _seam_stream(x, r0, r1, r2, r3, post_ptr, comb_ptr, rm, stride_pt, stride_ct, tmask, j: tl.constexpr):
    """New stream j of the post, rounded to bf16 (the model's residual boundary)."""
    return _post_stream(x, r0, r1, r2, r3, _col(post_ptr, rm, stride_pt, j, tmask),
                        _col(comb_ptr, rm, stride_ct, j, tmask), _col(comb_ptr, rm, stride_ct, 4 + j, tmask),
                        _col(comb_ptr, rm, stride_ct, 8 + j, tmask),
                        _col(comb_ptr, rm, stride_ct, 12 + j, tmask)).to(tl.bfloat16)


@triton.jit
def _seam_partials(f, w_row, D, dd, dmask, nmask, acc, PRECISION: tl.constexpr, j: tl.constexpr,
                   USE_DOT: tl.constexpr):
    """Stream j's share of the mixes: ``acc[t, n] += sum_d f[t, d] fn[n, j*D + d]``; the fn tile is loaded
    ``[BLOCK_N, BLOCK_D]`` (rows contiguous in d: vector loads, few address registers). USE_DOT: TF32/ieee
    ``tl.dot`` (16-token blocks); else fp32 FMA on a ``[BLOCK_M, BLOCK_N, BLOCK_D]`` product (1-4 tokens),
    summed over d at once."""
    w = tl.load(w_row + j * D + dd[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
    if USE_DOT:
        acc = tl.dot(f, tl.trans(w), acc, input_precision=PRECISION)
    else:
        acc = acc + tl.sum(f[:, None, :] * w[None, :, :], axis=2)
    return acc


@triton.jit
def _sum_parts(ptr, row, lm, col0, WIDTH: tl.constexpr, ROW: tl.constexpr):
    """``sum_s ptr[row[s, t], col0 : col0 + WIDTH]`` -> ``[BLOCK_M, WIDTH]`` (L2 reads: other SMs wrote them)."""
    c = tl.arange(0, WIDTH)
    return tl.sum(tl.load(ptr + row[:, :, None] * ROW + col0 + c[None, None, :], mask=lm, other=0.0,
                          cache_modifier=".cg"), axis=0)


@triton.jit
def _norm4(a, b, c, d, eps):
    """``v / (a + b + c + d + eps)`` for the four entries of one Sinkhorn row or column (per thread)."""
    inv = 1.0 / (a + b + c + d + eps)
    return a * inv, b * inv, c * inv, d * inv


@triton.jit
def _softmax4(a, b, c, d, eps):
    """Softmax over four same-shape fp32 tensors (elementwise across the four), plus ``eps`` on each."""
    m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = tl.exp(a - m), tl.exp(b - m), tl.exp(c - m), tl.exp(d - m)
    inv = 1.0 / (a + b + c + d)
    return a * inv + eps, b * inv + eps, c * inv + eps, d * inv + eps


@triton.jit
def _cols4(c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33, eps):
    """One Sinkhorn column pass of a 4x4 tile held as 16 per-thread values ``c{i}{j}``: ``c / (sum_i c + eps)``."""
    c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
    c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
    c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
    c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    return c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33


@triton.jit
def _sinkhorn_rows(c_row, logits, hh, tmask, eps, n_iters):
    """Sinkhorn of each token's 4x4 comb logits, written to ``c_row[t] + 0..15`` (fp32, row-major [i, j]).

    ``logits`` ``[BLOCK_M, 16]`` goes out to ``c_row`` and comes back one entry per register (16 per-thread
    values: no shuffles, no CTA barriers inside the 2 x n_iters passes): softmax over each row + eps, a
    column pass, then ``n_iters - 1`` (row pass, column pass), each ``x / (sum + eps)``."""
    tl.store(c_row[:, None] + hh[None, :], logits, mask=tmask[:, None])
    tl.debug_barrier()  # the logits come back one entry per register: no cross-thread sums below
    c00 = tl.load(c_row + 0, mask=tmask, other=0.0)
    c01 = tl.load(c_row + 1, mask=tmask, other=0.0)
    c02 = tl.load(c_row + 2, mask=tmask, other=0.0)
    c03 = tl.load(c_row + 3, mask=tmask, other=0.0)
    c10 = tl.load(c_row + 4, mask=tmask, other=0.0)
    c11 = tl.load(c_row + 5, mask=tmask, other=0.0)
    c12 = tl.load(c_row + 6, mask=tmask, other=0.0)
    c13 = tl.load(c_row + 7, mask=tmask, other=0.0)
    c20 = tl.load(c_row + 8, mask=tmask, other=0.0)
    c21 = tl.load(c_row + 9, mask=tmask, other=0.0)
    c22 = tl.load(c_row + 10, mask=tmask, other=0.0)
    c23 = tl.load(c_row + 11, mask=tmask, other=0.0)
    c30 = tl.load(c_row + 12, mask=tmask, other=0.0)
    c31 = tl.load(c_row + 13, mask=tmask, other=0.0)
    c32 = tl.load(c_row + 14, mask=tmask, other=0.0)
    c33 = tl.load(c_row + 15, mask=tmask, other=0.0)
    c00, c01, c02, c03 = _softmax4(c00, c01, c02, c03, eps)
    c10, c11, c12, c13 = _softmax4(c10, c11, c12, c13, eps)
    c20, c21, c22, c23 = _softmax4(c20, c21, c22, c23, eps)
    c30, c31, c32, c33 = _softmax4(c30, c31, c32, c33, eps)
    c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33 = _cols4(
        c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33, eps)
    for _ in range(1, n_iters):
        c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, eps)   # row pass
        c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, eps)
        c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, eps)
        c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, eps)
        c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33 = _cols4(
            c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33, eps)
    tl.debug_barrier()  # every thread has read the logits before any overwrites them
    tl.store(c_row + 0, c00, mask=tmask)
    tl.store(c_row + 1, c01, mask=tmask)
    tl.store(c_row + 2, c02, mask=tmask)
    tl.store(c_row + 3, c03, mask=tmask)
    tl.store(c_row + 4, c10, mask=tmask)
    tl.store(c_row + 5, c11, mask=tmask)
    tl.store(c_row + 6, c12, mask=tmask)
    tl.store(c_row + 7, c13, mask=tmask)
    tl.store(c_row + 8, c20, mask=tmask)
    tl.store(c_row + 9, c21, mask=tmask)
    tl.store(c_row + 10, c22, mask=tmask)
    tl.store(c_row + 11, c23, mask=tmask)
    tl.store(c_row + 12, c30, mask=tmask)
    tl.store(c_row + 13, c31, mask=tmask)
    tl.store(c_row + 14, c32, mask=tmask)
    tl.store(c_row + 15, c33, mask=tmask)


@triton.jit
def _seam_layer_input(pre_acc, gram, h, hh, n0, n1, n2, n3, scale_ptr, base_ptr, rms_numel, rms_eps, pre_eps, D,
                      norm_eps, HC_: tl.constexpr):
    """The seam's layer input from the reduced pre mixes and Gram matrix (both seam kernels):
    ``pre = sigmoid(mix * rsqrt(trace(G) / numel + eps) * scale + base) + pre_eps`` (``[BLOCK_M, HC]``),
    ``y = sum_i pre_i * n_i`` (the new residual streams ``n0..n3`` ``[BLOCK_M, BLOCK_D]``) rounded to bf16,
    and its RMSNorm's ``1 / rms`` from ``pre^T G pre / D`` (``[BLOCK_M]``; the caller applies the weight)."""
    sq = tl.sum(tl.where((hh % (HC_ + 1) == 0)[None, :], gram, 0.0), axis=1)      # trace(G)
    rms = tl.math.rsqrt(sq / rms_numel + rms_eps)[:, None]
    pre = tl.sigmoid(pre_acc * rms * tl.load(scale_ptr) + tl.load(base_ptr + h)[None, :]) + pre_eps
    p0 = tl.sum(tl.where(h[None, :] == 0, pre, 0.0), axis=1)
    p1 = tl.sum(tl.where(h[None, :] == 1, pre, 0.0), axis=1)
    p2 = tl.sum(tl.where(h[None, :] == 2, pre, 0.0), axis=1)
    p3 = tl.sum(tl.where(h[None, :] == 3, pre, 0.0), axis=1)
    y = p0[:, None] * n0.to(tl.float32)
    y += p1[:, None] * n1.to(tl.float32)
    y += p2[:, None] * n2.to(tl.float32)
    y += p3[:, None] * n3.to(tl.float32)
    ia = (hh // HC_)[None, :]
    ib = (hh % HC_)[None, :]
    pa = tl.where(ia == 0, p0[:, None], tl.where(ia == 1, p1[:, None], tl.where(ia == 2, p2[:, None], p3[:, None])))
    pb = tl.where(ib == 0, p0[:, None], tl.where(ib == 1, p1[:, None], tl.where(ib == 2, p2[:, None], p3[:, None])))
    ysq = tl.maximum(tl.sum(gram * pa * pb, axis=1), 0.0)
    return y.to(tl.bfloat16), tl.math.rsqrt(ysq / D + norm_eps)


@triton.jit
def _mhc_seam_kernel(
    x_ptr, x2_ptr, res_ptr, post_in_ptr, comb_in_ptr, res_out_ptr,
    fn_ptr, scale_ptr, base_ptr, w_ptr, mix_part_ptr, gram_part_ptr, sync_ptr,
    post_ptr, comb_ptr, out_ptr,
    T, D, S, rms_numel, rms_eps, pre_eps, sk_eps, post_mult, n_iters, norm_eps,
    stride_xt, stride_x2t, stride_rt, stride_rh, stride_pt, stride_ct, stride_ot, stride_oh, stride_fn,
    stride_yt,
    HC_: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, HAS_X2: tl.constexpr, HAS_NORM: tl.constexpr, PHASE: tl.constexpr,
    PRECISION: tl.constexpr, USE_DOT: tl.constexpr,
):
    """Grid ``(cdiv(T, BLOCK_M), S + 1)``; ``S = cdiv(D, BLOCK_D)``.
    One program (m, s < S) owns tokens ``[m*BLOCK_M, +BLOCK_M)`` x hidden columns
    ``[s*BLOCK_D, +BLOCK_D)`` of all 4 streams; program (m, S) computes the post gates and Sinkhorn.

    Phase A (s < S): the new streams (bf16, written to ``res_out``) and their partials: the 24 mixes
    (``tl.dot`` with fn columns ``j*D + d`` for 16-token blocks, fp32 FMA for 1-4 tokens) and the 4x4
    Gram matrix ``G[a, b] = sum_d new_a new_b`` (fp32; trace(G) is the pre-norm's sum of squares).
    Grid barrier (one per token block). Phase B: every program reduces the S partials itself (no serial
    tail), forms the pre gates, collapses its own columns from registers and normalises with
    ``mean(y^2) = pre^T G pre / D`` (fp32 y; the unfused pair squares bf16(y): relative ~1e-5, below the
    bf16 output step, unless the weighted streams cancel to ~1e-2 of their size). Program S reduces the
    post/comb partials and runs Sinkhorn on 16 per-thread registers, beside the collapse.

    PHASE 0: both phases and the barrier (GPU). PHASE 1 / 2: phase A / B as two launches (the CPU
    interpreter, which runs programs one after another, and the barrier-free candidate); phase B
    then re-reads its columns of ``res_out``.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rt = tl.arange(0, BLOCK_M)
    rm = pid_m * BLOCK_M + rt
    tmask = rm < T
    rm64 = rm.to(tl.int64)
    h = tl.arange(0, HC_)
    hh = tl.arange(0, HC_ * HC_)
    HH: tl.constexpr = HC_ * HC_
    if pid_s < S:
        dd = pid_s * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = dd < D
        m2 = tmask[:, None] & dmask[None, :]
        o_row = res_out_ptr + rm64[:, None] * stride_ot + dd[None, :]
        if PHASE != 2:
            x = tl.load(x_ptr + rm64[:, None] * stride_xt + dd[None, :], mask=m2, other=0.0).to(tl.float32)
            if HAS_X2:
                x = _add_bf16(x, x2_ptr + rm64[:, None] * stride_x2t + dd[None, :], m2)
            r_row = res_ptr + rm64[:, None] * stride_rt + dd[None, :]
            r0 = tl.load(r_row, mask=m2, other=0.0).to(tl.float32)
            r1 = tl.load(r_row + stride_rh, mask=m2, other=0.0).to(tl.float32)
            r2 = tl.load(r_row + 2 * stride_rh, mask=m2, other=0.0).to(tl.float32)
            r3 = tl.load(r_row + 3 * stride_rh, mask=m2, other=0.0).to(tl.float32)
            n0 = _seam_stream(x, r0, r1, r2, r3, post_in_ptr, comb_in_ptr, rm, stride_pt, stride_ct, tmask, 0)
            n1 = _seam_stream(x, r0, r1, r2, r3, post_in_ptr, comb_in_ptr, rm, stride_pt, stride_ct, tmask, 1)
            n2 = _seam_stream(x, r0, r1, r2, r3, post_in_ptr, comb_in_ptr, rm, stride_pt, stride_ct, tmask, 2)
            n3 = _seam_stream(x, r0, r1, r2, r3, post_in_ptr, comb_in_ptr, rm, stride_pt, stride_ct, tmask, 3)
            tl.store(o_row, n0, mask=m2)
            tl.store(o_row + stride_oh, n1, mask=m2)
            tl.store(o_row + 2 * stride_oh, n2, mask=m2)
            tl.store(o_row + 3 * stride_oh, n3, mask=m2)
            f0, f1, f2, f3 = n0.to(tl.float32), n1.to(tl.float32), n2.to(tl.float32), n3.to(tl.float32)
            rn = tl.arange(0, BLOCK_N)
            nmask = rn < 6 * HC_
            w_row = fn_ptr + rn[:, None] * stride_fn
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = _seam_partials(f0, w_row, D, dd, dmask, nmask, acc, PRECISION, 0, USE_DOT)
            acc = _seam_partials(f1, w_row, D, dd, dmask, nmask, acc, PRECISION, 1, USE_DOT)
            acc = _seam_partials(f2, w_row, D, dd, dmask, nmask, acc, PRECISION, 2, USE_DOT)
            acc = _seam_partials(f3, w_row, D, dd, dmask, nmask, acc, PRECISION, 3, USE_DOT)
            part_row = ((pid_m * S + pid_s) * BLOCK_M + rt).to(tl.int64)
            tl.store(mix_part_ptr + part_row[:, None] * BLOCK_N + rn[None, :], acc, mask=tmask[:, None])
            g_row = gram_part_ptr + part_row * HH
            g01 = tl.sum(f0 * f1, axis=1)
            g02 = tl.sum(f0 * f2, axis=1)
            g03 = tl.sum(f0 * f3, axis=1)
            g12 = tl.sum(f1 * f2, axis=1)
            g13 = tl.sum(f1 * f3, axis=1)
            g23 = tl.sum(f2 * f3, axis=1)
            tl.store(g_row + 0, tl.sum(f0 * f0, axis=1), mask=tmask)
            tl.store(g_row + 5, tl.sum(f1 * f1, axis=1), mask=tmask)
            tl.store(g_row + 10, tl.sum(f2 * f2, axis=1), mask=tmask)
            tl.store(g_row + 15, tl.sum(f3 * f3, axis=1), mask=tmask)
            tl.store(g_row + 1, g01, mask=tmask)
            tl.store(g_row + 4, g01, mask=tmask)
            tl.store(g_row + 2, g02, mask=tmask)
            tl.store(g_row + 8, g02, mask=tmask)
            tl.store(g_row + 3, g03, mask=tmask)
            tl.store(g_row + 12, g03, mask=tmask)
            tl.store(g_row + 6, g12, mask=tmask)
            tl.store(g_row + 9, g12, mask=tmask)
            tl.store(g_row + 7, g13, mask=tmask)
            tl.store(g_row + 13, g13, mask=tmask)
            tl.store(g_row + 11, g23, mask=tmask)
            tl.store(g_row + 14, g23, mask=tmask)
        if PHASE == 0:
            _grid_barrier(sync_ptr + pid_m * 64, S + 1)
        if PHASE == 2:
            n0 = tl.load(o_row, mask=m2, other=0.0)
            n1 = tl.load(o_row + stride_oh, mask=m2, other=0.0)
            n2 = tl.load(o_row + 2 * stride_oh, mask=m2, other=0.0)
            n3 = tl.load(o_row + 3 * stride_oh, mask=m2, other=0.0)
        if PHASE != 1:
            pre_acc = tl.zeros((BLOCK_M, HC_), dtype=tl.float32)
            gram = tl.zeros((BLOCK_M, HH), dtype=tl.float32)
            for s0 in range(0, S, BLOCK_S):
                rs = s0 + tl.arange(0, BLOCK_S)
                row = ((pid_m * S + rs)[:, None] * BLOCK_M + rt[None, :]).to(tl.int64)      # [BS, BM]
                lm = ((rs < S)[:, None] & tmask[None, :])[:, :, None]
                pre_acc += _sum_parts(mix_part_ptr, row, lm, 0, HC_, BLOCK_N)
                gram += _sum_parts(gram_part_ptr, row, lm, 0, HH, HH)
            yb, inv = _seam_layer_input(pre_acc, gram, h, hh, n0, n1, n2, n3, scale_ptr, base_ptr, rms_numel,
                                        rms_eps, pre_eps, D, norm_eps, HC_)
            y_row = out_ptr + rm64[:, None] * stride_yt + dd[None, :]
            if HAS_NORM:
                w = tl.load(w_ptr + dd, mask=dmask, other=0.0).to(tl.float32)
                tl.store(y_row, (yb.to(tl.float32) * inv[:, None] * w[None, :]).to(tl.bfloat16), mask=m2)
            else:
                tl.store(y_row, yb, mask=m2)
    else:
        if PHASE == 0:
            _grid_barrier(sync_ptr + pid_m * 64, S + 1)
        if PHASE != 1:
            post_acc = tl.zeros((BLOCK_M, HC_), dtype=tl.float32)
            comb_acc = tl.zeros((BLOCK_M, HH), dtype=tl.float32)
            gram = tl.zeros((BLOCK_M, HH), dtype=tl.float32)
            for s0 in range(0, S, BLOCK_S):
                rs = s0 + tl.arange(0, BLOCK_S)
                row = ((pid_m * S + rs)[:, None] * BLOCK_M + rt[None, :]).to(tl.int64)
                lm = ((rs < S)[:, None] & tmask[None, :])[:, :, None]
                post_acc += _sum_parts(mix_part_ptr, row, lm, HC_, HC_, BLOCK_N)
                comb_acc += _sum_parts(mix_part_ptr, row, lm, 2 * HC_, HH, BLOCK_N)
                gram += _sum_parts(gram_part_ptr, row, lm, 0, HH, HH)
            sq = tl.sum(tl.where((hh % (HC_ + 1) == 0)[None, :], gram, 0.0), axis=1)
            rms = tl.math.rsqrt(sq / rms_numel + rms_eps)[:, None]
            post = tl.sigmoid(post_acc * rms * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC_ + h)[None, :])
            tl.store(post_ptr + rm64[:, None] * HC_ + h[None, :], post * post_mult, mask=tmask[:, None])
            logits = comb_acc * rms * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC_ + hh)[None, :]
            _sinkhorn_rows(comb_ptr + rm64 * HH, logits, hh, tmask, sk_eps, n_iters)


@triton.jit
def _arrival_rank(old, n_programs, STEP: tl.constexpr):
    """A program's arrival rank (0 = first, ``n_programs - 1`` = the last arriver) in the :func:`_count_sync`
    protocol, from the counter value its add returned: the residue ``old % STEP`` counts the earlier +1 adds, plus
    ``STEP - (n - 1)`` once program 0 has added (told apart while ``2 (n - 1) < STEP``: the launchers prefetch
    only then). Distinct for every program of one sync."""
    r = old & (STEP - 1)
    big = STEP - (n_programs - 1)
    return tl.where(r >= big, r - big + 1, r)


@triton.jit
def _count_sync(cnt_ptr, pid_s, n_programs, STEP: tl.constexpr, PF: tl.constexpr = 0, pf_part0=0, pf_parts=1,
                pf_ptrs=None, pf_bytes=None, PF_BLOCK: tl.constexpr = 256, PF_EVICT_LAST: tl.constexpr = True):
    """One-level grid sync on one int32 counter (no reset, no generation word): every program adds 1,
    program 0 adds ``STEP - (n_programs - 1)``, so a launch moves the counter by exactly STEP (a power of
    two >= n_programs; 2^32 wrap-around keeps ``count % STEP == 0`` between launches, so the buffer is
    zeroed once and serves any number of launches and graph replays). Only the full sum reaches the next
    multiple of STEP: that program arrived last and returns at once (True); the others spin (volatile
    loads) until the counter shows it, then acquire (False). The add is acq_rel: this CTA's stores are
    released, the others' acquired. Every program of the grid must be resident at once (the launcher
    keeps the grid <= the SM count).

    PF > 0 (l2pf): a waiter first issues its share of the L2 prefetch (:func:`_l2.prefetch_regions_l2`, part
    ``pf_part0 + arrival rank`` of ``pf_parts``) while the later programs still arrive; the last arriver, whose
    path is the launch's critical one, issues none (the ``n_programs - 1`` waiters own every part)."""
    tl.debug_barrier()  # the whole CTA's stores precede thread 0's release below
    inc = tl.where(pid_s == 0, STEP - (n_programs - 1), 1)
    old = tl.atomic_add(cnt_ptr, inc, sem="acq_rel")
    target = old - (old & (STEP - 1)) + STEP
    last = old + inc == target
    if old + inc != target:
        if PF > 0:
            prefetch_regions_l2(pf_part0 + _arrival_rank(old, n_programs, STEP), pf_parts, pf_ptrs, pf_bytes, PF,
                                PF_BLOCK, PF_EVICT_LAST)
        cur = tl.load(cnt_ptr, volatile=True)
        while cur != target:
            cur = tl.load(cnt_ptr, volatile=True)
        tl.atomic_add(cnt_ptr, 0, sem="acquire")
    tl.debug_barrier()
    return last


@triton.jit
def _mhc_seam1_kernel(
    x_ptr, x2_ptr, res_ptr, post_in_ptr, comb_in_ptr, res_out_ptr,
    fn_ptr, scale_ptr, base_ptr, w_ptr, part_ptr, cnt_ptr,
    post_ptr, comb_ptr, out_ptr, q_ptr, qs_ptr,
    T, D, S, rms_numel, rms_eps, pre_eps, sk_eps, post_mult, n_iters, norm_eps, q_eps,
    stride_xt, stride_x2t, stride_rt, stride_rh, stride_pt, stride_ct, stride_ot, stride_oh, stride_fn,
    stride_yt, stride_qt, stride_qst,
    HC_: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    PART_W: tl.constexpr, STEP: tl.constexpr,
    HAS_X2: tl.constexpr, HAS_NORM: tl.constexpr, PHASE: tl.constexpr, QUANT: tl.constexpr = False,
    PF: tl.constexpr = 0, PF_BLOCK: tl.constexpr = 256, PF_EVICT_LAST: tl.constexpr = True, pf_ptrs=None,
    pf_bytes=None,
):
    """Grid ``(cdiv(T, BLOCK_M), S)``; ``S = cdiv(D, BLOCK_D)``; 1-4 token blocks (fp32 FMA mixes).
    One program (m, s) owns tokens ``[m*BLOCK_M, +BLOCK_M)`` x hidden columns ``[s*BLOCK_D, +BLOCK_D)`` of
    all 4 streams. The decode seam with one grid-wide dependency (issue 20, ``seam1_*`` rows):

    - every global load first (x, x2, the 4 residual streams, the gate coefficients, the 24 fn rows of
      the 4 streams' columns as 8 tiles, the norm weight): one DRAM round trip, no load behind a CTA barrier;
    - the post (bf16 residual out), then the partial mixes as fp32 FMA ``P[t, n, d] = sum_j fn_j[n, d]
      new_j[t, d]`` summed over d once (pre+post rows, comb rows) and the 4x4 Gram matrix of the new
      streams in one more sum: 3 reductions (the ``seam_*`` kernel does 14, the fn loads serialised
      behind them);
    - one counter (:func:`_count_sync`): the LAST arriver reduces the post/comb partials and runs
      Sinkhorn (no spin-wait on its path), the others spin on the same counter; every program then
      reduces the pre/Gram partials (all S rows in one load for BLOCK_S >= S) and collapses its own
      columns from registers, normalised with ``mean(y^2) = pre^T G pre / D`` as the ``seam_*`` kernel.

    Partial row layout (``PART_W`` fp32): pre 0-3, post 4-7, comb 8-23, Gram 24-39; sums over s run in a
    fixed order (the same bits whichever program is last). PHASE 0: one launch (GPU). PHASE 1 / 2: phase
    A / B as two launches (the interpreter, ``SEAM1_LAUNCHES = 2`` rows, grids above the SM count);
    phase B then re-reads its columns of ``res_out`` and program s = 0 runs Sinkhorn.
    QUANT (phase B; ``BLOCK_D`` divides 128, ``D % 128 == 0``): also the layer input's FP8 copy, as the seamr
    kernel: every program collapses its whole 128-column group from the group's new streams (re-read from
    L2 after the sync) and stores its own columns (:func:`_quant_group_store`).
    PF > 0 (l2pf, ``mhc_fused_post_pre(prefetch=...)``): the L2 prefetch of the ``PF`` regions ``(pf_ptrs,
    pf_bytes)``, issued by the waiters of the counter sync (:func:`_count_sync`), or at the end of phase B by
    every program (PHASE 2).
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rt = tl.arange(0, BLOCK_M)
    rm = pid_m * BLOCK_M + rt
    tmask = rm < T
    rm64 = rm.to(tl.int64)
    h = tl.arange(0, HC_)
    hh = tl.arange(0, HC_ * HC_)
    HH: tl.constexpr = HC_ * HC_
    dd = pid_s * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dd < D
    m2 = tmask[:, None] & dmask[None, :]
    o_row = res_out_ptr + rm64[:, None] * stride_ot + dd[None, :]
    part_row = ((pid_m * S + pid_s) * BLOCK_M + rt).to(tl.int64) * PART_W
    if HAS_NORM:
        wn = tl.load(w_ptr + dd, mask=dmask, other=0.0).to(tl.float32)
    if PHASE != 2:
        ra = tl.arange(0, 2 * HC_)
        rb = tl.arange(0, HH)
        wa_row = fn_ptr + ra[:, None] * stride_fn + dd[None, :]                 # pre + post rows [8, BD]
        wb_row = fn_ptr + (2 * HC_ + rb)[:, None] * stride_fn + dd[None, :]     # comb rows [16, BD]
        wa0 = tl.load(wa_row, mask=dmask[None, :], other=0.0)
        wa1 = tl.load(wa_row + D, mask=dmask[None, :], other=0.0)
        wa2 = tl.load(wa_row + 2 * D, mask=dmask[None, :], other=0.0)
        wa3 = tl.load(wa_row + 3 * D, mask=dmask[None, :], other=0.0)
        wb0 = tl.load(wb_row, mask=dmask[None, :], other=0.0)
        wb1 = tl.load(wb_row + D, mask=dmask[None, :], other=0.0)
        wb2 = tl.load(wb_row + 2 * D, mask=dmask[None, :], other=0.0)
        wb3 = tl.load(wb_row + 3 * D, mask=dmask[None, :], other=0.0)
        x = tl.load(x_ptr + rm64[:, None] * stride_xt + dd[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_X2:
            x = _add_bf16(x, x2_ptr + rm64[:, None] * stride_x2t + dd[None, :], m2)
        r_row = res_ptr + rm64[:, None] * stride_rt + dd[None, :]
        r0 = tl.load(r_row, mask=m2, other=0.0).to(tl.float32)
        r1 = tl.load(r_row + stride_rh, mask=m2, other=0.0).to(tl.float32)
        r2 = tl.load(r_row + 2 * stride_rh, mask=m2, other=0.0).to(tl.float32)
        r3 = tl.load(r_row + 3 * stride_rh, mask=m2, other=0.0).to(tl.float32)
        n0 = _seam_stream(x, r0, r1, r2, r3, post_in_ptr, comb_in_ptr, rm, stride_pt, stride_ct, tmask, 0)
        n1 = _seam_stream(x, r0, r1, r2, r3, post_in_ptr, comb_in_ptr, rm, stride_pt, stride_ct, tmask, 1)
        n2 = _seam_stream(x, r0, r1, r2, r3, post_in_ptr, comb_in_ptr, rm, stride_pt, stride_ct, tmask, 2)
        n3 = _seam_stream(x, r0, r1, r2, r3, post_in_ptr, comb_in_ptr, rm, stride_pt, stride_ct, tmask, 3)
        tl.store(o_row, n0, mask=m2)
        tl.store(o_row + stride_oh, n1, mask=m2)
        tl.store(o_row + 2 * stride_oh, n2, mask=m2)
        tl.store(o_row + 3 * stride_oh, n3, mask=m2)
        f0 = n0.to(tl.float32)[:, None, :]
        f1 = n1.to(tl.float32)[:, None, :]
        f2 = n2.to(tl.float32)[:, None, :]
        f3 = n3.to(tl.float32)[:, None, :]
        pa = f0 * wa0[None, :, :] + f1 * wa1[None, :, :] + f2 * wa2[None, :, :] + f3 * wa3[None, :, :]
        pb = f0 * wb0[None, :, :] + f1 * wb1[None, :, :] + f2 * wb2[None, :, :] + f3 * wb3[None, :, :]
        ia = (rb // HC_)[None, :, None]
        ib = (rb % HC_)[None, :, None]
        ga = tl.where(ia == 0, f0, tl.where(ia == 1, f1, tl.where(ia == 2, f2, f3)))
        gb = tl.where(ib == 0, f0, tl.where(ib == 1, f1, tl.where(ib == 2, f2, f3)))
        tl.store(part_ptr + part_row[:, None] + ra[None, :], tl.sum(pa, axis=2), mask=tmask[:, None])
        tl.store(part_ptr + part_row[:, None] + 2 * HC_ + rb[None, :], tl.sum(pb, axis=2), mask=tmask[:, None])
        tl.store(part_ptr + part_row[:, None] + 6 * HC_ + rb[None, :], tl.sum(ga * gb, axis=2),
                 mask=tmask[:, None])
    if PHASE == 0:
        if PF > 0:
            last = _count_sync(cnt_ptr + pid_m * 32, pid_s, S, STEP, PF, pid_m * (S - 1),
                               tl.num_programs(0) * (S - 1), pf_ptrs, pf_bytes, PF_BLOCK, PF_EVICT_LAST)
        else:
            last = _count_sync(cnt_ptr + pid_m * 32, pid_s, S, STEP)
    else:
        last = pid_s == 0
    if PHASE == 2:
        if not QUANT:
            n0 = tl.load(o_row, mask=m2, other=0.0)
            n1 = tl.load(o_row + stride_oh, mask=m2, other=0.0)
            n2 = tl.load(o_row + 2 * stride_oh, mask=m2, other=0.0)
            n3 = tl.load(o_row + 3 * stride_oh, mask=m2, other=0.0)
    if PHASE != 1:
        if QUANT:  # the whole 128-column group's new streams (other programs wrote some: L2 reads)
            gc = (pid_s * BLOCK_D // 128) * 128 + tl.arange(0, 128)
            gm = tmask[:, None] & (gc < D)[None, :]
            g_row = res_out_ptr + rm64[:, None] * stride_ot + gc[None, :]
            g0 = tl.load(g_row, mask=gm, other=0.0, cache_modifier=".cg")
            g1 = tl.load(g_row + stride_oh, mask=gm, other=0.0, cache_modifier=".cg")
            g2 = tl.load(g_row + 2 * stride_oh, mask=gm, other=0.0, cache_modifier=".cg")
            g3 = tl.load(g_row + 3 * stride_oh, mask=gm, other=0.0, cache_modifier=".cg")
        if last:  # post gates + Sinkhorn: only the next seam reads them
            post_acc = tl.zeros((BLOCK_M, HC_), dtype=tl.float32)
            comb_acc = tl.zeros((BLOCK_M, HH), dtype=tl.float32)
            sq_acc = tl.zeros((BLOCK_M, HH), dtype=tl.float32)
            for s0 in range(0, S, BLOCK_S):
                rs = s0 + tl.arange(0, BLOCK_S)
                row = ((pid_m * S + rs)[:, None] * BLOCK_M + rt[None, :]).to(tl.int64)
                lm = ((rs < S)[:, None] & tmask[None, :])[:, :, None]
                post_acc += _sum_parts(part_ptr, row, lm, HC_, HC_, PART_W)
                comb_acc += _sum_parts(part_ptr, row, lm, 2 * HC_, HH, PART_W)
                sq_acc += _sum_parts(part_ptr, row, lm, 6 * HC_, HH, PART_W)
            sq = tl.sum(tl.where((hh % (HC_ + 1) == 0)[None, :], sq_acc, 0.0), axis=1)
            rms = tl.math.rsqrt(sq / rms_numel + rms_eps)[:, None]
            post = tl.sigmoid(post_acc * rms * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC_ + h)[None, :])
            tl.store(post_ptr + rm64[:, None] * HC_ + h[None, :], post * post_mult, mask=tmask[:, None])
            logits = comb_acc * rms * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC_ + hh)[None, :]
            _sinkhorn_rows(comb_ptr + rm64 * HH, logits, hh, tmask, sk_eps, n_iters)
        pre_acc = tl.zeros((BLOCK_M, HC_), dtype=tl.float32)
        gram = tl.zeros((BLOCK_M, HH), dtype=tl.float32)
        for s0 in range(0, S, BLOCK_S):
            rs = s0 + tl.arange(0, BLOCK_S)
            row = ((pid_m * S + rs)[:, None] * BLOCK_M + rt[None, :]).to(tl.int64)
            lm = ((rs < S)[:, None] & tmask[None, :])[:, :, None]
            pre_acc += _sum_parts(part_ptr, row, lm, 0, HC_, PART_W)
            gram += _sum_parts(part_ptr, row, lm, 6 * HC_, HH, PART_W)
        if QUANT:
            yb, inv = _seam_layer_input(pre_acc, gram, h, hh, g0, g1, g2, g3, scale_ptr, base_ptr, rms_numel,
                                        rms_eps, pre_eps, D, norm_eps, HC_)
            if HAS_NORM:
                gw = tl.load(w_ptr + gc, mask=gc < D, other=0.0).to(tl.float32)
                yb = (yb.to(tl.float32) * inv[:, None] * gw[None, :]).to(tl.bfloat16)
            _quant_group_store(yb, gc, pid_s * BLOCK_D, rm64, tmask, out_ptr, stride_yt, q_ptr, stride_qt, qs_ptr,
                               stride_qst, q_eps, BLOCK_D)
        else:
            yb, inv = _seam_layer_input(pre_acc, gram, h, hh, n0, n1, n2, n3, scale_ptr, base_ptr, rms_numel,
                                        rms_eps, pre_eps, D, norm_eps, HC_)
            y_row = out_ptr + rm64[:, None] * stride_yt + dd[None, :]
            if HAS_NORM:
                tl.store(y_row, (yb.to(tl.float32) * inv[:, None] * wn[None, :]).to(tl.bfloat16), mask=m2)
            else:
                tl.store(y_row, yb, mask=m2)
    if PF > 0:
        if PHASE == 2:  # the two-launch fallback: no sync to hide it behind, every program at its end
            prefetch_regions_l2(pid_m * S + pid_s, tl.num_programs(0) * S, pf_ptrs, pf_bytes, PF, PF_BLOCK,
                                PF_EVICT_LAST)


# ---- the row-tile seam (issue 20, mhc6: `seamr_*` rows) -------------------------------------------
@triton.jit
def _norm4_fast(a, b, c, d, eps):
    """``v / (a + b + c + d + eps)`` with a two-level sum and the approximate division (MUFU.RCP + FMUL,
    ~2 ulp): the 40 dependent passes of Sinkhorn are its critical path."""
    inv = tl.math.fdiv(1.0, (a + b) + ((c + d) + eps), ieee_rounding=False)
    return a * inv, b * inv, c * inv, d * inv


@triton.jit
def _sinkhorn16(c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33, eps, n_iters):
    """Sinkhorn of one 4x4 comb held as 16 per-thread scalars (logits in): row softmax + eps, a column pass,
    then ``n_iters - 1`` (row pass, column pass), each ``x / (sum + eps)`` (:func:`_norm4_fast`)."""
    c00, c01, c02, c03 = _softmax4(c00, c01, c02, c03, eps)
    c10, c11, c12, c13 = _softmax4(c10, c11, c12, c13, eps)
    c20, c21, c22, c23 = _softmax4(c20, c21, c22, c23, eps)
    c30, c31, c32, c33 = _softmax4(c30, c31, c32, c33, eps)
    c00, c10, c20, c30 = _norm4_fast(c00, c10, c20, c30, eps)
    c01, c11, c21, c31 = _norm4_fast(c01, c11, c21, c31, eps)
    c02, c12, c22, c32 = _norm4_fast(c02, c12, c22, c32, eps)
    c03, c13, c23, c33 = _norm4_fast(c03, c13, c23, c33, eps)
    for _ in range(1, n_iters):
        c00, c01, c02, c03 = _norm4_fast(c00, c01, c02, c03, eps)
        c10, c11, c12, c13 = _norm4_fast(c10, c11, c12, c13, eps)
        c20, c21, c22, c23 = _norm4_fast(c20, c21, c22, c23, eps)
        c30, c31, c32, c33 = _norm4_fast(c30, c31, c32, c33, eps)
        c00, c10, c20, c30 = _norm4_fast(c00, c10, c20, c30, eps)
        c01, c11, c21, c31 = _norm4_fast(c01, c11, c21, c31, eps)
        c02, c12, c22, c32 = _norm4_fast(c02, c12, c22, c32, eps)
        c03, c13, c23, c33 = _norm4_fast(c03, c13, c23, c33, eps)
    return c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33


@triton.jit
def _at(v, c, k):
    """Entry ``k`` of the 1-D vector ``v`` indexed by ``c`` (a reduction within the threads holding it)."""
    return tl.sum(tl.where(c == k, v, 0.0), axis=0)


@triton.jit
def _pick4(i, v0, v1, v2, v3):
    """``v_i`` for ``i`` in 0..3 (any shape, broadcast): one of the 4 residual streams' values, no indexing."""
    return tl.where(i == 0, v0, tl.where(i == 1, v1, tl.where(i == 2, v2, v3)))


@triton.jit
def _gram_ab(r):
    """The stream pair (a, b), a <= b, of packed Gram entry r in 0..9: 00 01 02 03 11 12 13 22 23 33."""
    a = tl.where(r < 4, 0, tl.where(r < 7, 1, tl.where(r < 9, 2, 3)))
    b = tl.where(r < 4, r, tl.where(r < 7, r - 3, tl.where(r < 9, r - 5, 3)))
    return a, b


@triton.jit
def _quant_group_store(y, gc, d0, rows64, rmask, out_ptr, stride_yt, q_ptr, stride_qt, qs_ptr, stride_qst, q_eps,
                       BLOCK_D: tl.constexpr):
    """Store a seam program's share of the layer input ``y`` (bf16 ``[BLOCK_M, 128]``: the whole 128-column
    group ``gc`` holding columns ``[d0, d0 + BLOCK_D)``, the same bits in every program of the group) and of
    its FP8 copy: the program's own columns of ``y`` (bf16) and of ``q`` (e4m3), and (the group's first
    program) the group's UE8M0 byte per token; ``q, s = quant_rows_e4m3_pow2(y)`` as
    ``per_token_group_quant_fp8(layer_input, 128, "ue8m0")``. ``rows64`` ``[BLOCK_M]`` int64 token rows,
    ``rmask`` their validity; the caller guarantees ``D % 128 == 0``."""
    tl.static_assert(128 % BLOCK_D == 0)
    own = ((gc >= d0) & (gc < d0 + BLOCK_D))[None, :] & rmask[:, None]
    tl.store(out_ptr + rows64[:, None] * stride_yt + gc[None, :], y, mask=own)
    q, sc = quant_rows_e4m3_pow2(y.to(tl.float32), q_eps)
    tl.store(q_ptr + rows64[:, None] * stride_qt + gc[None, :], q, mask=own)
    tl.store(qs_ptr + rows64 * stride_qst + d0 // 128, fp32_pow2_to_ue8m0(sc).to(tl.uint8),
             mask=rmask & (d0 % 128 == 0))


@triton.jit
def _rows_token_a(x_ptr, x2_ptr, res_ptr, post_in_ptr, comb_in_ptr, res_out_ptr, part_ptr, tok, valid, dd, dmask,
                  wa0, wa1, wa2, wa3, wb0, wb1, wb2, wb3, prow,
                  stride_xt, stride_x2t, stride_rt, stride_rh, stride_pt, stride_ct, stride_ot, stride_oh,
                  HAS_X2: tl.constexpr):
    """Phase A of one token: the post (bf16 streams to ``res_out``) and the token's partial row at ``prow``:
    Gram 0-9 (packed, :func:`_gram_ab`), pre 10-13, post 16-19, comb 20-35, each a sum over this program's
    columns of a 2-D ``[rows, BLOCK_D]`` tile (fn rows x columns; the stream a broadcast row: no 3-D
    tiles, the sums over d stay inside a warp)."""
    m = dmask & valid
    tok64 = tok.to(tl.int64)
    x = tl.load(x_ptr + tok64 * stride_xt + dd, mask=m, other=0.0).to(tl.float32)
    if HAS_X2:
        x = _add_bf16(x, x2_ptr + tok64 * stride_x2t + dd, m)
    r_row = res_ptr + tok64 * stride_rt + dd
    r0 = tl.load(r_row, mask=m, other=0.0).to(tl.float32)
    r1 = tl.load(r_row + stride_rh, mask=m, other=0.0).to(tl.float32)
    r2 = tl.load(r_row + 2 * stride_rh, mask=m, other=0.0).to(tl.float32)
    r3 = tl.load(r_row + 3 * stride_rh, mask=m, other=0.0).to(tl.float32)
    p_row = post_in_ptr + tok64 * stride_pt
    c_row = comb_in_ptr + tok64 * stride_ct
    o_row = res_out_ptr + tok64 * stride_ot + dd
    n0 = (tl.load(p_row, mask=valid, other=0.0) * x + tl.load(c_row, mask=valid, other=0.0) * r0
          + tl.load(c_row + 4, mask=valid, other=0.0) * r1 + tl.load(c_row + 8, mask=valid, other=0.0) * r2
          + tl.load(c_row + 12, mask=valid, other=0.0) * r3).to(tl.bfloat16)
    n1 = (tl.load(p_row + 1, mask=valid, other=0.0) * x + tl.load(c_row + 1, mask=valid, other=0.0) * r0
          + tl.load(c_row + 5, mask=valid, other=0.0) * r1 + tl.load(c_row + 9, mask=valid, other=0.0) * r2
          + tl.load(c_row + 13, mask=valid, other=0.0) * r3).to(tl.bfloat16)
    n2 = (tl.load(p_row + 2, mask=valid, other=0.0) * x + tl.load(c_row + 2, mask=valid, other=0.0) * r0
          + tl.load(c_row + 6, mask=valid, other=0.0) * r1 + tl.load(c_row + 10, mask=valid, other=0.0) * r2
          + tl.load(c_row + 14, mask=valid, other=0.0) * r3).to(tl.bfloat16)
    n3 = (tl.load(p_row + 3, mask=valid, other=0.0) * x + tl.load(c_row + 3, mask=valid, other=0.0) * r0
          + tl.load(c_row + 7, mask=valid, other=0.0) * r1 + tl.load(c_row + 11, mask=valid, other=0.0) * r2
          + tl.load(c_row + 15, mask=valid, other=0.0) * r3).to(tl.bfloat16)
    tl.store(o_row, n0, mask=m)
    tl.store(o_row + stride_oh, n1, mask=m)
    tl.store(o_row + 2 * stride_oh, n2, mask=m)
    tl.store(o_row + 3 * stride_oh, n3, mask=m)
    f0 = n0.to(tl.float32)[None, :]
    f1 = n1.to(tl.float32)[None, :]
    f2 = n2.to(tl.float32)[None, :]
    f3 = n3.to(tl.float32)[None, :]
    ra = tl.arange(0, 8)
    rb = tl.arange(0, 16)
    pa = tl.sum(f0 * wa0 + f1 * wa1 + f2 * wa2 + f3 * wa3, axis=1)                      # pre 0-3, post 4-7
    qb = f0 * wb0 + f1 * wb1 + f2 * wb2 + f3 * wb3
    pb = tl.sum(qb, axis=1)                                                             # comb 0-15
    ga, gb = _gram_ab(rb)
    # rows 10-15 (never stored) take the comb products: the Gram tile then shares the fn tiles' layout (no
    # conversion of the streams, sums within a warp)
    gt = _pick4(ga[:, None], f0, f1, f2, f3) * _pick4(gb[:, None], f0, f1, f2, f3)
    g = tl.sum(tl.where(rb[:, None] < 10, gt, qb), axis=1)
    tl.store(part_ptr + prow + rb, g, mask=valid & (rb < 10))
    tl.store(part_ptr + prow + tl.where(ra < 4, 10 + ra, 12 + ra), pa, mask=valid)
    tl.store(part_ptr + prow + 20 + rb, pb, mask=valid)


@triton.jit
def _rows_token_b(part_ptr, res_out_ptr, w_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, out_ptr,
                  tok, valid, dd, dmask, prow0, S, rms_numel, rms_eps, pre_eps, sk_eps, post_mult, n_iters,
                  norm_eps, D, stride_ot, stride_oh, stride_yt, last,
                  BLOCK_S: tl.constexpr, PART_W: tl.constexpr, ROW_STEP: tl.constexpr, HAS_NORM: tl.constexpr,
                  q_ptr, qs_ptr, stride_qt, stride_qst, q_eps, d0, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
    """Phase B of one token: reduce its S partial rows (``prow0 + s * ROW_STEP``), the pre gates and the layer
    input of this program's columns (``mean(y^2) = pre^T G pre / D`` from the packed Gram entries, as the
    seam1 kernel); ``last``: also the post gates and Sinkhorn of the comb (16 per-thread scalars).

    QUANT: the layer input of the whole 128-column group holding this program's ``BLOCK_D`` columns (from
    ``d0``; ``BLOCK_D`` divides 128) from the group's new streams (L2), the same values in every program
    of the group; the program stores its own columns of it (bf16 and e4m3) and the group's first program
    the UE8M0 byte (:func:`_quant_group_store`)."""
    m = dmask & valid
    tok64 = tok.to(tl.int64)
    if QUANT:
        gc = (d0 // 128) * 128 + tl.arange(0, 128)
        gmask = (gc < D) & valid
        o_row = res_out_ptr + tok64 * stride_ot + gc
        n0 = tl.load(o_row, mask=gmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        n1 = tl.load(o_row + stride_oh, mask=gmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        n2 = tl.load(o_row + 2 * stride_oh, mask=gmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        n3 = tl.load(o_row + 3 * stride_oh, mask=gmask, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        o_row = res_out_ptr + tok64 * stride_ot + dd
        n0 = tl.load(o_row, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        n1 = tl.load(o_row + stride_oh, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        n2 = tl.load(o_row + 2 * stride_oh, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        n3 = tl.load(o_row + 3 * stride_oh, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    c = tl.arange(0, 16)
    g = tl.zeros((16,), dtype=tl.float32)
    v = tl.zeros((32,), dtype=tl.float32)
    c32 = tl.arange(0, 32)
    for s0 in range(0, S, BLOCK_S):
        rs = s0 + tl.arange(0, BLOCK_S)
        rows = prow0 + rs.to(tl.int64) * ROW_STEP
        lm = (rs < S)[:, None] & valid
        g += tl.sum(tl.load(part_ptr + rows[:, None] + c[None, :], mask=lm & (c < 14)[None, :], other=0.0,
                            cache_modifier=".cg"), axis=0)
        if last:
            v += tl.sum(tl.load(part_ptr + rows[:, None] + 16 + c32[None, :], mask=lm & (c32 < 20)[None, :],
                                other=0.0, cache_modifier=".cg"), axis=0)
    ga, gb = _gram_ab(c)
    sq = tl.sum(tl.where((c < 10) & (ga == gb), g, 0.0), axis=0)                    # trace(G)
    rms = tl.math.rsqrt(sq / rms_numel + rms_eps)
    s0_ = tl.load(scale_ptr)
    p0 = tl.sigmoid(_at(g, c, 10) * rms * s0_ + tl.load(base_ptr)) + pre_eps
    p1 = tl.sigmoid(_at(g, c, 11) * rms * s0_ + tl.load(base_ptr + 1)) + pre_eps
    p2 = tl.sigmoid(_at(g, c, 12) * rms * s0_ + tl.load(base_ptr + 2)) + pre_eps
    p3 = tl.sigmoid(_at(g, c, 13) * rms * s0_ + tl.load(base_ptr + 3)) + pre_eps
    wq = _pick4(ga, p0, p1, p2, p3) * _pick4(gb, p0, p1, p2, p3) * tl.where(ga == gb, 1.0, 2.0)
    ysq = tl.maximum(tl.sum(tl.where(c < 10, g * wq, 0.0), axis=0), 0.0)
    inv = tl.math.rsqrt(ysq / D + norm_eps)
    y = (p0 * n0 + p1 * n1 + p2 * n2 + p3 * n3).to(tl.bfloat16)
    if QUANT:
        if HAS_NORM:
            y = (y.to(tl.float32) * inv * tl.load(w_ptr + gc, mask=gc < D, other=0.0).to(tl.float32)).to(tl.bfloat16)
        one = tl.arange(0, 1)
        _quant_group_store(y[None, :], gc, d0, tok64 + one.to(tl.int64), (one == 0) & valid, out_ptr, stride_yt,
                           q_ptr, stride_qt, qs_ptr, stride_qst, q_eps, BLOCK_D)
    else:
        y_row = out_ptr + tok64 * stride_yt + dd
        if HAS_NORM:
            wn = tl.load(w_ptr + dd, mask=dmask, other=0.0).to(tl.float32)
            tl.store(y_row, (y.to(tl.float32) * inv * wn).to(tl.bfloat16), mask=m)
        else:
            tl.store(y_row, y, mask=m)
    if last:  # post gates + Sinkhorn: only the next seam reads them
        post = tl.sigmoid(v * rms * tl.load(scale_ptr + 1) + tl.load(base_ptr + 4 + c32, mask=c32 < 4, other=0.0))
        tl.store(post_ptr + tok64 * 4 + c32, post * post_mult, mask=(c32 < 4) & valid)
        lg = v * rms * tl.load(scale_ptr + 2) + tl.load(base_ptr + 4 + c32, mask=c32 < 20, other=0.0)
        k00, k01, k02, k03, k10, k11, k12, k13, k20, k21, k22, k23, k30, k31, k32, k33 = _sinkhorn16(
            _at(lg, c32, 4), _at(lg, c32, 5), _at(lg, c32, 6), _at(lg, c32, 7),
            _at(lg, c32, 8), _at(lg, c32, 9), _at(lg, c32, 10), _at(lg, c32, 11),
            _at(lg, c32, 12), _at(lg, c32, 13), _at(lg, c32, 14), _at(lg, c32, 15),
            _at(lg, c32, 16), _at(lg, c32, 17), _at(lg, c32, 18), _at(lg, c32, 19), sk_eps, n_iters)
        cr = comb_ptr + tok64 * 16
        tl.store(cr + 0, k00, mask=valid)
        tl.store(cr + 1, k01, mask=valid)
        tl.store(cr + 2, k02, mask=valid)
        tl.store(cr + 3, k03, mask=valid)
        tl.store(cr + 4, k10, mask=valid)
        tl.store(cr + 5, k11, mask=valid)
        tl.store(cr + 6, k12, mask=valid)
        tl.store(cr + 7, k13, mask=valid)
        tl.store(cr + 8, k20, mask=valid)
        tl.store(cr + 9, k21, mask=valid)
        tl.store(cr + 10, k22, mask=valid)
        tl.store(cr + 11, k23, mask=valid)
        tl.store(cr + 12, k30, mask=valid)
        tl.store(cr + 13, k31, mask=valid)
        tl.store(cr + 14, k32, mask=valid)
        tl.store(cr + 15, k33, mask=valid)


@triton.jit
def _ld_acquire(ptr):
    """``ld.acquire.gpu`` of one int32 (every thread): a spin read that is also the acquire, so leaving the
    spin costs no further round trip (``_count_sync`` re-reads with an acquire atomic). GPU builds only
    (inline PTX; the interpreter runs the seams as two launches)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _count_sync_acq(cnt_ptr, pid_s, n_programs, STEP: tl.constexpr, PF: tl.constexpr = 0, pf_part0=0, pf_parts=1,
                    pf_ptrs=None, pf_bytes=None, PF_BLOCK: tl.constexpr = 256, PF_EVICT_LAST: tl.constexpr = True):
    """:func:`_count_sync` (the same counter protocol, last-arriver rule and PF prefetch by the waiters) with the
    waiters spinning on :func:`_ld_acquire`: one L2 round trip less between the last arrival and the waiters'
    partial reads."""
    tl.debug_barrier()  # the whole CTA's stores precede thread 0's release below
    inc = tl.where(pid_s == 0, STEP - (n_programs - 1), 1)
    old = tl.atomic_add(cnt_ptr, inc, sem="acq_rel")
    target = old - (old & (STEP - 1)) + STEP
    last = old + inc == target
    if old + inc != target:
        if PF > 0:
            prefetch_regions_l2(pf_part0 + _arrival_rank(old, n_programs, STEP), pf_parts, pf_ptrs, pf_bytes, PF,
                                PF_BLOCK, PF_EVICT_LAST)
        cur = _ld_acquire(cnt_ptr)
        while cur != target:
            cur = _ld_acquire(cnt_ptr)
    tl.debug_barrier()
    return last


@triton.jit
def _mhc_seam_rows_kernel(
    x_ptr, x2_ptr, res_ptr, post_in_ptr, comb_in_ptr, res_out_ptr,
    fn_ptr, scale_ptr, base_ptr, w_ptr, part_ptr, cnt_ptr,
    post_ptr, comb_ptr, out_ptr, q_ptr, qs_ptr,
    T, D, S, rms_numel, rms_eps, pre_eps, sk_eps, post_mult, n_iters, norm_eps, q_eps,
    stride_xt, stride_x2t, stride_rt, stride_rh, stride_pt, stride_ct, stride_ot, stride_oh, stride_fn,
    stride_yt, stride_qt, stride_qst,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PART_W: tl.constexpr,
    STEP: tl.constexpr, HAS_X2: tl.constexpr, HAS_NORM: tl.constexpr, PHASE: tl.constexpr,
    QUANT: tl.constexpr = False, PF: tl.constexpr = 0, PF_BLOCK: tl.constexpr = 256,
    PF_EVICT_LAST: tl.constexpr = True, pf_ptrs=None, pf_bytes=None,
):
    """Grid ``(cdiv(T, BLOCK_M), S)``; ``S = cdiv(D, BLOCK_D)``.
    One program (m, s) owns tokens ``[m*BLOCK_M, +BLOCK_M)`` (1-4, or 8 at most; one token after the other) x hidden columns
    ``[s*BLOCK_D, +BLOCK_D)`` of all 4 streams: the seam1 protocol (every fn load first, one counter sync per
    token block, the last arriver runs the post gates and Sinkhorn), with

    - 2-D tiles only: the fn rows of the program's columns ``[8|16, BLOCK_D]`` stay in their load layout and
      every stream is a broadcast row, so no fn tile crosses shared memory (the 3-D tiles of the seam1
      kernel converted all 24 KiB of them) and the sums over d stay within a warp;
    - the Gram matrix packed (10 entries): a partial row is 36 fp32 (Gram 0-9, pre 10-13, post 16-19,
      comb 20-35); the collapsing programs read 16 of them, the last arriver 36, in one load per chunk;
    - Sinkhorn on 16 per-thread scalars taken from the reduced row in registers (no global round trip of
      the logits), with two-level sums and the approximate division (~2 ulp per pass);
    - the layer input per token from the new streams re-read (L2) beside the partial rows.

    Token blocks have their own counters, so several run in one launch: the launcher keeps the grid within
    the programs that are resident at once (2 per SM at 4 warps: at most 255 x 128 registers each).
    PHASE 0: one launch (GPU). PHASE 1 / 2: phase A / B as two launches (the interpreter, grids above the
    resident limit); program s = 0 is then the one that runs Sinkhorn.
    QUANT (phase B; ``BLOCK_D`` divides 128, ``D % 128 == 0``): also the layer input's FP8 copy (e4m3 to
    ``q_ptr``, a UE8M0 byte per 128 columns to ``qs_ptr``): each program computes the layer input of its whole
    128-column group from the group's new streams (the partner programs' columns re-read from L2, like its
    own), stores its own columns of it and of the quant (:func:`_quant_group_store`).
    PF > 0 (l2pf, ``mhc_fused_post_pre(prefetch=...)``): the L2 prefetch of the ``PF`` regions ``(pf_ptrs,
    pf_bytes)`` in ``num_programs(0) * (S - 1)`` parts, issued by the waiters of each token block's sync
    (:func:`_count_sync_acq`), or at the end of phase B by every program (PHASE 2).
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    dd = pid_s * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dd < D
    blk = (pid_m * S + pid_s).to(tl.int64) * BLOCK_M  # this program's first partial row
    if PHASE != 2:
        ra = tl.arange(0, 8)
        rb = tl.arange(0, 16)
        wa_row = fn_ptr + ra[:, None] * stride_fn + dd[None, :]                 # pre + post rows [8, BD]
        wb_row = fn_ptr + (8 + rb)[:, None] * stride_fn + dd[None, :]           # comb rows [16, BD]
        wa0 = tl.load(wa_row, mask=dmask[None, :], other=0.0)
        wa1 = tl.load(wa_row + D, mask=dmask[None, :], other=0.0)
        wa2 = tl.load(wa_row + 2 * D, mask=dmask[None, :], other=0.0)
        wa3 = tl.load(wa_row + 3 * D, mask=dmask[None, :], other=0.0)
        wb0 = tl.load(wb_row, mask=dmask[None, :], other=0.0)
        wb1 = tl.load(wb_row + D, mask=dmask[None, :], other=0.0)
        wb2 = tl.load(wb_row + 2 * D, mask=dmask[None, :], other=0.0)
        wb3 = tl.load(wb_row + 3 * D, mask=dmask[None, :], other=0.0)
        for t in tl.static_range(BLOCK_M):
            tok = pid_m * BLOCK_M + t
            _rows_token_a(x_ptr, x2_ptr, res_ptr, post_in_ptr, comb_in_ptr, res_out_ptr, part_ptr, tok, tok < T,
                          dd, dmask, wa0, wa1, wa2, wa3, wb0, wb1, wb2, wb3, (blk + t) * PART_W,
                          stride_xt, stride_x2t, stride_rt, stride_rh, stride_pt, stride_ct, stride_ot, stride_oh,
                          HAS_X2)
    if PHASE == 0:
        if PF > 0:
            last = _count_sync_acq(cnt_ptr + pid_m * 32, pid_s, S, STEP, PF, pid_m * (S - 1),
                                   tl.num_programs(0) * (S - 1), pf_ptrs, pf_bytes, PF_BLOCK, PF_EVICT_LAST)
        else:
            last = _count_sync_acq(cnt_ptr + pid_m * 32, pid_s, S, STEP)
    else:
        last = pid_s == 0
    if PHASE != 1:
        for t in tl.static_range(BLOCK_M):
            tok = pid_m * BLOCK_M + t
            _rows_token_b(part_ptr, res_out_ptr, w_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, out_ptr,
                          tok, tok < T, dd, dmask, (pid_m.to(tl.int64) * S * BLOCK_M + t) * PART_W, S, rms_numel,
                          rms_eps, pre_eps, sk_eps, post_mult, n_iters, norm_eps, D, stride_ot, stride_oh,
                          stride_yt, last, BLOCK_S, PART_W, BLOCK_M * PART_W, HAS_NORM,
                          q_ptr, qs_ptr, stride_qt, stride_qst, q_eps, pid_s * BLOCK_D, BLOCK_D, QUANT)
    if PF > 0:
        if PHASE == 2:  # the two-launch fallback: no sync to hide it behind, every program at its end
            prefetch_regions_l2(pid_m * S + pid_s, tl.num_programs(0) * S, pf_ptrs, pf_bytes, PF, PF_BLOCK,
                                PF_EVICT_LAST)


# ---- the token-parallel decode seam (issue 20, mhc16: `seamt_*` rows) ------------------------------
@triton.jit
def _mhc_seam_tok_kernel(
    x_ptr, x2_ptr, res_ptr, post_in_ptr, comb_in_ptr, res_out_ptr,
    fn_ptr, scale_ptr, base_ptr, w_ptr, part_ptr, cnt_ptr,
    post_ptr, comb_ptr, out_ptr, q_ptr, qs_ptr,
    T, D, S, n_tasks, n_chunks, rms_numel, rms_eps, pre_eps, sk_eps, post_mult, n_iters, norm_eps, q_eps,
    stride_xt, stride_x2t, stride_rt, stride_rh, stride_pt, stride_ct, stride_ot, stride_oh, stride_fn,
    stride_yt, stride_qt, stride_qst,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PART_ROWS: tl.constexpr,
    CHUNK: tl.constexpr, PART_W: tl.constexpr, STEP: tl.constexpr, PRECISION: tl.constexpr,
    HAS_X2: tl.constexpr, HAS_NORM: tl.constexpr, PHASE: tl.constexpr, QUANT: tl.constexpr = False,
):
    """Grid ``(cdiv(T, BLOCK_M), S)``; ``S = cdiv(D, BLOCK_D)``; ``P = cdiv(T, BLOCK_M) * S`` programs.
    One program owns a (token block, column chunk) tile in phase A and a share of the (token, chunk) tasks in phase
    B; ONE counter sync for the whole grid (issue 20, mhc16, ``seamt_*`` rows: 1 to ``SEAMT_MAX_T`` tokens).

    Phase A, program (m, s): tokens ``[m*BLOCK_M, +BLOCK_M)`` x columns ``[s*BLOCK_D, +BLOCK_D)`` of the 4 streams,
    every global load first (the 4 ``fn^T`` tiles ``[BLOCK_D, 32]``, x, x2, the residual, the coefficients, the
    norm weight of its phase-B chunk): the post (bf16 residual out), the partial mixes as ``tl.dot`` (``PRECISION``:
    TF32 or ieee, as the two-pass ``decode`` kernel) and the packed 4x4 Gram matrix of the new streams (fp32 FMA).
    Partial row ``token * S + s`` (``PART_W`` fp32): mixes 0-23 (pre 0-3, post 4-7, comb 8-23), Gram 24-33
    (:func:`_gram_ab` order).

    Phase B, after the sync, is token-parallel (the ``seamr`` kernel ran its block's tokens one after the other
    and all Sinkhorns in one program): task ``k`` in ``[0, n_tasks)`` (``n_tasks = T * n_chunks``, program ``pid``
    takes ``pid, pid + P, ...``) is token ``k // n_chunks`` x columns ``[(k % n_chunks) * CHUNK, +CHUNK)``: it
    reduces the token's S partial rows (fixed order: the same bits in every task of the token), forms the pre
    gates, collapses its columns from the new streams (L2), normalises with ``mean(y^2) = pre^T G pre / D`` (as the
    seam1 / seamr kernels) and stores the layer input (+ its FP8 copy with QUANT: ``CHUNK`` is a multiple of 128);
    chunk 0's task also writes the post gates and runs Sinkhorn (:func:`_sinkhorn16`) for its token.
    PHASE 0: one launch (GPU; every program resident at once). PHASE 1 / 2: phase A / B as two launches
    (the interpreter, grids above the resident limit)."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    P = tl.num_programs(0) * S
    pid = pid_m * S + pid_s
    cb = tl.arange(0, CHUNK)
    if PHASE != 1:  # the norm weight of this program's first phase-B chunk: its DRAM trip before the sync
        ch0 = pid % n_chunks
        if HAS_NORM:
            w_first = tl.load(w_ptr + ch0 * CHUNK + cb, mask=(ch0 * CHUNK + cb < D) & (pid < n_tasks),
                              other=0.0).to(tl.float32)
    if PHASE != 2:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        tmask = rm < T
        rm64 = rm.to(tl.int64)
        dd = pid_s * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = dd < D
        m2 = tmask[:, None] & dmask[None, :]
        rn = tl.arange(0, 32)
        nmask = rn < 24
        w_col = fn_ptr + rn[None, :] * stride_fn + dd[:, None]                   # fn^T [BLOCK_D, 32], stream 0
        wm = dmask[:, None] & nmask[None, :]
        fw0 = tl.load(w_col, mask=wm, other=0.0)
        fw1 = tl.load(w_col + D, mask=wm, other=0.0)
        fw2 = tl.load(w_col + 2 * D, mask=wm, other=0.0)
        fw3 = tl.load(w_col + 3 * D, mask=wm, other=0.0)
        x = tl.load(x_ptr + rm64[:, None] * stride_xt + dd[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_X2:
            x = _add_bf16(x, x2_ptr + rm64[:, None] * stride_x2t + dd[None, :], m2)
        r_row = res_ptr + rm64[:, None] * stride_rt + dd[None, :]
        r0 = tl.load(r_row, mask=m2, other=0.0).to(tl.float32)
        r1 = tl.load(r_row + stride_rh, mask=m2, other=0.0).to(tl.float32)
        r2 = tl.load(r_row + 2 * stride_rh, mask=m2, other=0.0).to(tl.float32)
        r3 = tl.load(r_row + 3 * stride_rh, mask=m2, other=0.0).to(tl.float32)
        # the 20 per-token coefficients after the tile loads (source order is load order): Triton converts each
        # [BLOCK_M] vector into the tiles' row layout right after its load (STS + 2 BAR.SYNC, sm_89 SASS), so each
        # coefficient load waits for the previous one (L1 hits after the first): a ~20-step chain, overlapped
        # with the fn / x / residual DRAM wave issued before it
        q0 = _col(post_in_ptr, rm, stride_pt, 0, tmask)
        q1 = _col(post_in_ptr, rm, stride_pt, 1, tmask)
        q2 = _col(post_in_ptr, rm, stride_pt, 2, tmask)
        q3 = _col(post_in_ptr, rm, stride_pt, 3, tmask)
        a00 = _col(comb_in_ptr, rm, stride_ct, 0, tmask)
        a01 = _col(comb_in_ptr, rm, stride_ct, 1, tmask)
        a02 = _col(comb_in_ptr, rm, stride_ct, 2, tmask)
        a03 = _col(comb_in_ptr, rm, stride_ct, 3, tmask)
        a10 = _col(comb_in_ptr, rm, stride_ct, 4, tmask)
        a11 = _col(comb_in_ptr, rm, stride_ct, 5, tmask)
        a12 = _col(comb_in_ptr, rm, stride_ct, 6, tmask)
        a13 = _col(comb_in_ptr, rm, stride_ct, 7, tmask)
        a20 = _col(comb_in_ptr, rm, stride_ct, 8, tmask)
        a21 = _col(comb_in_ptr, rm, stride_ct, 9, tmask)
        a22 = _col(comb_in_ptr, rm, stride_ct, 10, tmask)
        a23 = _col(comb_in_ptr, rm, stride_ct, 11, tmask)
        a30 = _col(comb_in_ptr, rm, stride_ct, 12, tmask)
        a31 = _col(comb_in_ptr, rm, stride_ct, 13, tmask)
        a32 = _col(comb_in_ptr, rm, stride_ct, 14, tmask)
        a33 = _col(comb_in_ptr, rm, stride_ct, 15, tmask)
        n0 = _post_stream(x, r0, r1, r2, r3, q0, a00, a10, a20, a30).to(tl.bfloat16)
        n1 = _post_stream(x, r0, r1, r2, r3, q1, a01, a11, a21, a31).to(tl.bfloat16)
        n2 = _post_stream(x, r0, r1, r2, r3, q2, a02, a12, a22, a32).to(tl.bfloat16)
        n3 = _post_stream(x, r0, r1, r2, r3, q3, a03, a13, a23, a33).to(tl.bfloat16)
        f0 = n0.to(tl.float32)
        f1 = n1.to(tl.float32)
        f2 = n2.to(tl.float32)
        f3 = n3.to(tl.float32)
        acc = tl.dot(f0, fw0, tl.zeros((BLOCK_M, 32), dtype=tl.float32), input_precision=PRECISION)
        acc = tl.dot(f1, fw1, acc, input_precision=PRECISION)
        acc = tl.dot(f2, fw2, acc, input_precision=PRECISION)
        acc = tl.dot(f3, fw3, acc, input_precision=PRECISION)
        o_row = res_out_ptr + rm64[:, None] * stride_ot + dd[None, :]
        tl.store(o_row, n0, mask=m2)
        tl.store(o_row + stride_oh, n1, mask=m2)
        tl.store(o_row + 2 * stride_oh, n2, mask=m2)
        tl.store(o_row + 3 * stride_oh, n3, mask=m2)
        prow = (rm64 * S + pid_s) * PART_W
        tl.store(part_ptr + prow[:, None] + rn[None, :], acc, mask=tmask[:, None] & nmask[None, :])
        g_row = part_ptr + prow + 24
        tl.store(g_row + 0, tl.sum(f0 * f0, axis=1), mask=tmask)
        tl.store(g_row + 1, tl.sum(f0 * f1, axis=1), mask=tmask)
        tl.store(g_row + 2, tl.sum(f0 * f2, axis=1), mask=tmask)
        tl.store(g_row + 3, tl.sum(f0 * f3, axis=1), mask=tmask)
        tl.store(g_row + 4, tl.sum(f1 * f1, axis=1), mask=tmask)
        tl.store(g_row + 5, tl.sum(f1 * f2, axis=1), mask=tmask)
        tl.store(g_row + 6, tl.sum(f1 * f3, axis=1), mask=tmask)
        tl.store(g_row + 7, tl.sum(f2 * f2, axis=1), mask=tmask)
        tl.store(g_row + 8, tl.sum(f2 * f3, axis=1), mask=tmask)
        tl.store(g_row + 9, tl.sum(f3 * f3, axis=1), mask=tmask)
    if PHASE == 0:
        _count_sync_acq(cnt_ptr, pid, P, STEP)
    if PHASE != 1:
        c = tl.arange(0, 64)
        ga, gb = _gram_ab(c - 24)
        gmask = (c >= 24) & (c < 34)
        for task in range(pid, n_tasks, P):
            t = task // n_chunks
            ch = task - t * n_chunks
            t64 = t.to(tl.int64)
            cols = ch * CHUNK + cb
            cm = cols < D
            b_row = res_out_ptr + t64 * stride_ot + cols
            b0 = tl.load(b_row, mask=cm, other=0.0, cache_modifier=".cg").to(tl.float32)
            b1 = tl.load(b_row + stride_oh, mask=cm, other=0.0, cache_modifier=".cg").to(tl.float32)
            b2 = tl.load(b_row + 2 * stride_oh, mask=cm, other=0.0, cache_modifier=".cg").to(tl.float32)
            b3 = tl.load(b_row + 3 * stride_oh, mask=cm, other=0.0, cache_modifier=".cg").to(tl.float32)
            v = tl.zeros((64,), dtype=tl.float32)
            for k in tl.static_range(BLOCK_S // PART_ROWS):
                rs = k * PART_ROWS + tl.arange(0, PART_ROWS)
                rows = (t64 * S + rs) * PART_W
                v += tl.sum(tl.load(part_ptr + rows[:, None] + c[None, :], mask=(rs < S)[:, None] & (c < 34)[None, :],
                                    other=0.0, cache_modifier=".cg"), axis=0)
            sq = tl.sum(tl.where(gmask & (ga == gb), v, 0.0), axis=0)                 # trace(G)
            rms = tl.math.rsqrt(sq / rms_numel + rms_eps)
            s0_ = tl.load(scale_ptr)
            p0 = tl.sigmoid(_at(v, c, 0) * rms * s0_ + tl.load(base_ptr)) + pre_eps
            p1 = tl.sigmoid(_at(v, c, 1) * rms * s0_ + tl.load(base_ptr + 1)) + pre_eps
            p2 = tl.sigmoid(_at(v, c, 2) * rms * s0_ + tl.load(base_ptr + 2)) + pre_eps
            p3 = tl.sigmoid(_at(v, c, 3) * rms * s0_ + tl.load(base_ptr + 3)) + pre_eps
            wq = _pick4(ga, p0, p1, p2, p3) * _pick4(gb, p0, p1, p2, p3) * tl.where(ga == gb, 1.0, 2.0)
            ysq = tl.maximum(tl.sum(tl.where(gmask, v * wq, 0.0), axis=0), 0.0)
            y = (p0 * b0 + p1 * b1 + p2 * b2 + p3 * b3).to(tl.bfloat16)
            if HAS_NORM:
                inv = tl.math.rsqrt(ysq / D + norm_eps)
                wv = tl.load(w_ptr + cols, mask=cm & (task != pid), other=0.0).to(tl.float32)
                y = (y.to(tl.float32) * inv * tl.where(task == pid, w_first, wv)).to(tl.bfloat16)
            tl.store(out_ptr + t64 * stride_yt + cols, y, mask=cm)
            if QUANT:
                NG: tl.constexpr = CHUNK // 128
                q, sc = quant_rows_e4m3_pow2(tl.reshape(y.to(tl.float32), (NG, 128)), q_eps)
                tl.store(q_ptr + t64 * stride_qt + cols, tl.reshape(q, (CHUNK,)), mask=cm)
                rg = tl.arange(0, NG)
                tl.store(qs_ptr + t64 * stride_qst + ch * NG + rg, fp32_pow2_to_ue8m0(sc).to(tl.uint8),
                         mask=ch * CHUNK + rg * 128 < D)
            if ch == 0:  # the token's post gates and Sinkhorn (only the next seam reads them)
                post = tl.sigmoid(v * rms * tl.load(scale_ptr + 1)
                                  + tl.load(base_ptr + c, mask=(c >= 4) & (c < 8), other=0.0))
                tl.store(post_ptr + t64 * 4 + (c - 4), post * post_mult, mask=(c >= 4) & (c < 8))
                lg = v * rms * tl.load(scale_ptr + 2) + tl.load(base_ptr + c, mask=(c >= 8) & (c < 24), other=0.0)
                k00, k01, k02, k03, k10, k11, k12, k13, k20, k21, k22, k23, k30, k31, k32, k33 = _sinkhorn16(
                    _at(lg, c, 8), _at(lg, c, 9), _at(lg, c, 10), _at(lg, c, 11),
                    _at(lg, c, 12), _at(lg, c, 13), _at(lg, c, 14), _at(lg, c, 15),
                    _at(lg, c, 16), _at(lg, c, 17), _at(lg, c, 18), _at(lg, c, 19),
                    _at(lg, c, 20), _at(lg, c, 21), _at(lg, c, 22), _at(lg, c, 23), sk_eps, n_iters)
                cr = comb_ptr + t64 * 16
                tl.store(cr + 0, k00)
                tl.store(cr + 1, k01)
                tl.store(cr + 2, k02)
                tl.store(cr + 3, k03)
                tl.store(cr + 4, k10)
                tl.store(cr + 5, k11)
                tl.store(cr + 6, k12)
                tl.store(cr + 7, k13)
                tl.store(cr + 8, k20)
                tl.store(cr + 9, k21)
                tl.store(cr + 10, k22)
                tl.store(cr + 11, k23)
                tl.store(cr + 12, k30)
                tl.store(cr + 13, k31)
                tl.store(cr + 14, k32)
                tl.store(cr + 15, k33)


# ---- input checks --------------------------------------------------------------------------------
def _check_hidden(name, D):
    if D % 16 or D <= 0 or D > 16384:
        raise ValueError(f"{name}: hidden size {D} must be a positive multiple of 16, at most 16384")


def _check_precision(precision):
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")


def _check_mhc_params(fn, hc_scale, hc_base, norm_weight, K, D, ref, n_mix=(2 + HC) * HC, n_scale=3):
    """``ref``: ``(name, tensor)`` whose device every parameter must share."""
    check.tensor("fn", fn, torch.float32, 2)
    check.shape("fn", fn, (n_mix, K))
    check.last_dim_contiguous("fn", fn)
    for name, t, n in (("hc_scale", hc_scale, n_scale), ("hc_base", hc_base, n_mix)):
        check.tensor(name, t, torch.float32, 1)
        check.shape(name, t, (n,))
        check.contiguous(name, t)
    if norm_weight is not None:
        check.tensor("norm_weight", norm_weight, (torch.bfloat16, torch.float32), 1)
        check.shape("norm_weight", norm_weight, (D,))
        check.contiguous("norm_weight", norm_weight)
    check.same_device(*ref, fn=fn, hc_scale=hc_scale, hc_base=hc_base, norm_weight=norm_weight)


def _check_scalars(sinkhorn_iters=None, hc_post_mult=None, **eps):
    """Every float the apply kernel takes: the eps terms (finite, >= 0, zero or normal float32) and
    the post multiplier (finite normal float32); returns them as floats, in the order given."""
    out = {k: check.fp32_scalar(k, v, nonnegative=True) for k, v in eps.items()}
    if hc_post_mult is not None:
        out["hc_post_mult"] = check.fp32_scalar("hc_post_mult", hc_post_mult)
    if sinkhorn_iters is not None and (isinstance(sinkhorn_iters, bool) or int(sinkhorn_iters) < 1):
        raise ValueError(f"sinkhorn_iters={sinkhorn_iters}: must be >= 1")
    return out


def _check_residual(name, residual):
    check.tensor(name, residual, torch.bfloat16, 3)
    if residual.shape[1] != HC:
        raise ValueError(f"{name}: hc_mult={residual.shape[1]} (shape {tuple(residual.shape)}); "
                         f"these kernels are built for DeepSeek-V4's hc_mult={HC}")
    _check_hidden(name, residual.shape[2])
    check.contiguous(name, residual)
    return residual.shape[0], residual.shape[2]


# ---- config plumbing -----------------------------------------------------------------------------
# the rows pick_config can return on a GPU (the rest are benchmark candidates or interpreter sizes);
# the compile report builds these for sm_120, tests/test_arch.py sweeps pick_config against them
GPU_DEFAULTS = {"sm_89": ("decode", "prefill", "seamr_d64", "seam1_d64", "seamt_d32"),
                "sm_90": ("decode", "prefill", "fused_m64k16", "seamr_d64", "seam1_d64", "seamt_d32")}
#: the one-launch seam rows pick_config(fused=True) returns, per table: ``(max tokens, label)``, first match wins;
#: above the last bound the two-pass ``decode`` row. Both tables: seamr_d64 at one token, seam1_d64 at 2-4 (H200,
#: session 6, results/issue20/s6/mhc_table.csv, TP4 p50 us, sm_89 build / native: seamr_d64 T=1 9.93 / 9.77 vs
#: seam1_d64 10.61 / 10.53; seamr loses from T=2, 14.42 vs 11.89, and to ``decode`` from T=4, 25.87 vs 17.48).
#: sm_89 only (issue 20, mhc16; session 13, H100 80GB HBM3, sm_89 build, results/issue20/s13/call1): the
#: token-parallel seamt_d32 at 5-16 tokens: kernel T=8 14.68 us vs ``decode`` 18.84 (T=4 14.29 vs seam1_d64 18.91,
#: T=2 14.23 vs 13.87); the batch-16 step (ABBA) 10,326 -> 10,040 us, 24.1 -> 22.1 launches a layer, the two mHC
#: groups 769 + 746 -> 606 + 583 us. Session 14 (H100 80GB HBM3, sm_89 build, results/issue20/s14/call1): up to 32
#: tokens too, the batch-16 MTP verify step (ABBA) 12,934 -> 12,494 us, 26.6 -> 24.6 launches a layer. sm_90 the same
#: from session 15 (H100 80GB HBM3, native build, results/issue20/s15/call1; seamt numerics native: 24 cases pass):
#: the native step with the sm_89 table's seam and MoE defaults (ABBA) batch 16 10,417 -> 9,371 us, 24.1 -> 22.1
#: launches a layer, batch 4 8,428 -> 8,205. pick_config reads it on every call, so
#: ``ds4lab step --ab "mhc.SEAM_DEFAULTS={'sm_89': ((1,'seamr_d64'),(4,'seam1_d64'),(32,'seamt_d32')), 'sm_90':
#: ((1,'seamr_d64'),(4,'seam1_d64'))}"`` times another split inside the step.
SEAM_DEFAULTS = {"sm_89": ((1, "seamr_d64"), (4, "seam1_d64"), (32, "seamt_d32")),
                 "sm_90": ((1, "seamr_d64"), (4, "seam1_d64"), (32, "seamt_d32"))}


def pick_config(num_tokens: int, device: torch.device, fused: bool = False) -> dict:
    """``decode`` up to 64 tokens, ``prefill`` above. On the CPU interpreter (every program instance runs
    in Python) the apply kernel packs 16 (64 above 64 tokens) tokens per program; the GPU rows run as-is when passed as
    ``config=`` (the registry sweep and tests/test_mhc.py do)."""
    table = CONFIGS[arch_of(device)]
    cfg = table["decode"] if num_tokens <= 64 else table["prefill"]
    seams = SEAM_DEFAULTS[arch_of(device)]
    if fused and num_tokens <= max(top for top, _ in seams) and device.type == "cuda":
        # H200 (issue 20, session 5; results/issue20/s5/mhc_bench.csv): mhc_fused_post_pre TP4, sm_89 build /
        # native, us: seam1_d64 T=1 10.62 / 10.67, T=2 11.89 / 11.92, T=4 16.19 / 16.20 vs decode 17.65 /
        # 17.7, 18.08 / 17.87, 17.87 / 18.1 and seam_d64 13.36 / 13.38, 17.03 / 17.05, 20.9 / 20.84
        cfg = table[next(label for top, label in seams if num_tokens <= top)]
    if fused and num_tokens > 64 and device.type == "cuda" and arch_of(device) == "sm_90":
        # H200 run 4: fused_m64k16 63.4 us at T=512 and 247.6 us at T=2048 vs prefill 83.4 / 312.7 us
        cfg = table["fused_m64k16"]
    if device.type != "cuda":
        cfg = {**cfg, "APPLY_BLOCK_T": 16 if num_tokens <= 64 else 64}
    return cfg


def _splits(n_tiles_m: int, n_blocks_k: int, device, cfg) -> int:
    """Split count so that about ``WAVES`` x SMs programs run, each with >= MIN_K_BLOCKS k-blocks."""
    want = max(1, (cfg["WAVES"] * num_sms(device)) // max(n_tiles_m, 1))
    return max(1, min(want, n_blocks_k // cfg["MIN_K_BLOCKS"], 128))


def _prenorm_out(out, T, N, num_splits, device):
    """Check a caller's ``(mixes (S, T, N), sqrsum (S, T))`` float32 buffers (inner dims unit-stride); return S."""
    if not isinstance(out, (tuple, list)) or len(out) != 2 or not all(isinstance(t, torch.Tensor) for t in out):
        raise TypeError(f"out: expected a (mixes, sqrsum) pair of tensors, got {type(out).__name__}")
    mixes, sqrsum = out
    S = mixes.shape[0] if mixes.dim() == 3 else 0
    for name, t, want in (("out[0] (mixes)", mixes, (S, T, N)), ("out[1] (sqrsum)", sqrsum, (S, T))):
        if t.dtype != torch.float32 or tuple(t.shape) != want or S < 1 or t.device != device:
            raise ValueError(f"{name}: expected a float32 {want} tensor with S >= 1 on {device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous, got strides {tuple(t.stride())}")
    if num_splits is not None and num_splits != S:
        raise ValueError(f"num_splits={num_splits}: out holds {S} splits")
    return S


def _prenorm_partials(x2d, fn, num_splits, precision, cfg, out=None):
    T, K = x2d.shape
    N = fn.shape[0]
    BM, BK = cfg["GEMM_BLOCK_M"], cfg["GEMM_BLOCK_K"]
    n_kb = triton.cdiv(K, BK)
    S = num_splits or _splits(triton.cdiv(T, BM), n_kb, x2d.device, cfg)
    kps = triton.cdiv(n_kb, S) * BK
    if out is not None:  # all S programs run; those whose K range starts past K write zeros
        mixes, sqrsum = out
    else:
        S = triton.cdiv(K, kps)
        mixes = torch.empty((S, T, N), dtype=torch.float32, device=x2d.device)
        sqrsum = torch.empty((S, T), dtype=torch.float32, device=x2d.device)
    if T == 0:
        return mixes, sqrsum
    _hc_prenorm_gemm_kernel[(triton.cdiv(T, BM), S)](
        x2d, fn, mixes, sqrsum, T, N, K, kps,
        x2d.stride(0), fn.stride(0), mixes.stride(0), mixes.stride(1), sqrsum.stride(0),
        BLOCK_M=BM, BLOCK_N=max(16, triton.next_power_of_2(N)), BLOCK_K=BK, PRECISION=precision,
        num_warps=cfg["GEMM_WARPS"], num_stages=cfg["GEMM_STAGES"])
    return mixes, sqrsum


def _apply(mixes, sqrsum, hc_scale, hc_base, res, res_strides, norm_weight, D, rms_numel, rms_eps, pre_eps,
           sk_eps, post_mult, n_iters, norm_eps, cfg, head=False, res_out=None, quant=None):
    """``quant``: optional ``(q (T, D) float8_e4m3fn, s (T, D/128) uint8)`` the kernel fills too (QUANT)."""
    S, T = sqrsum.shape
    dev = sqrsum.device
    out = torch.empty((T, D), dtype=torch.bfloat16, device=dev)
    post = torch.empty((T, HC, 1), dtype=torch.float32, device=dev)
    comb = torch.empty((T, HC, HC), dtype=torch.float32, device=dev)
    if T == 0:
        return post, comb, out
    BT = cfg["APPLY_BLOCK_T"]
    q, qs = quant if quant is not None else (out, out)
    _mhc_apply_kernel[(triton.cdiv(T, BT),)](
        mixes, sqrsum, hc_scale, hc_base, res, norm_weight if norm_weight is not None else out,
        post, comb, out, res_out if res_out is not None else out, q, qs,
        T, S, D, float(rms_numel), float(rms_eps), float(pre_eps), float(sk_eps), float(post_mult), int(n_iters),
        float(norm_eps), ACT_QUANT_EPS,
        mixes.stride(0), mixes.stride(1), sqrsum.stride(0), res_strides[0], res_strides[1], out.stride(0),
        res_out.stride(0) if res_out is not None else 0, res_out.stride(1) if res_out is not None else 0,
        q.stride(0), qs.stride(0),
        HC_=HC, HEAD=head, HAS_NORM=norm_weight is not None, BROADCAST=res_out is not None,
        BLOCK_T=BT, BLOCK_S=min(64, triton.next_power_of_2(S)), BLOCK_D=triton.next_power_of_2(D),
        QUANT=quant is not None, num_warps=cfg["APPLY_WARPS"], num_stages=1)
    return post, comb, out


def _post(x, residual, post_mix, comb_mix, out, cfg, fn=None, precision="tf32", num_splits=None, x2=None):
    T, _, D = residual.shape
    prenorm = fn is not None
    key = "POST" if prenorm else "PLAIN"
    BM, BK = cfg[f"{key}_BLOCK_M"], cfg[f"{key}_BLOCK_K"]
    n_kb = triton.cdiv(D, BK)
    S = num_splits or _splits(triton.cdiv(T, BM), n_kb, residual.device, cfg)
    S = max(1, min(S, n_kb))
    dps = triton.cdiv(n_kb, S) * BK
    S = triton.cdiv(D, dps)
    N = fn.shape[0] if prenorm else 0
    mixes = torch.empty((S, T, N), dtype=torch.float32, device=residual.device) if prenorm else None
    sqrsum = torch.empty((S, T), dtype=torch.float32, device=residual.device) if prenorm else None
    if T == 0:
        return mixes, sqrsum
    _mhc_post_kernel[(triton.cdiv(T, BM), S)](
        x, x2 if x2 is not None else x, residual, post_mix, comb_mix, out,
        fn if prenorm else out, mixes if prenorm else out, sqrsum if prenorm else out,
        T, D, N, dps,
        x.stride(0), x2.stride(0) if x2 is not None else 0, residual.stride(0), residual.stride(1), post_mix.stride(0), comb_mix.stride(0),
        out.stride(0), out.stride(1),
        fn.stride(0) if prenorm else 0, mixes.stride(0) if prenorm else 0, mixes.stride(1) if prenorm else 0,
        sqrsum.stride(0) if prenorm else 0,
        BLOCK_M=BM, BLOCK_N=max(16, triton.next_power_of_2(max(N, 1))), BLOCK_K=BK,
        PRENORM=prenorm, PRECISION=precision, HAS_X2=x2 is not None,
        num_warps=cfg[f"{key}_WARPS"], num_stages=cfg.get("POST_STAGES", 1))
    return mixes, sqrsum


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")




def _sync_buffer(device) -> torch.Tensor:
    """The seam's grid-barrier words (count, generation; 64 int32 per token block), zeroed once per
    device and self-resetting, so any number of launches and CUDA-graph replays reuse it. Shared by every
    seam launch on the device: seam launches must not run concurrently on two streams (the model runs
    them in one stream order); the first call must be eager (:func:`ds4lab_kernels._counters.zeroed_counters`
    raises during CUDA-graph capture)."""
    return zeroed_counters("mhc.seam", device, 64 * SEAM_MAX_TILES, 0)


def seam_plan(T: int, D: int, device, cfg, compiled: bool | None = None) -> dict:
    """The seam kernel's launch plan: token block, column split, grid, launches (1 with the grid barrier,
    2 without: the interpreter, ``SEAM_LAUNCHES = 2`` rows, or a grid larger than the SM count, whose
    programs could not all be resident at once). ``compiled``: plan for compiled kernels (True) or the
    interpreter (False) whatever this process runs (None: this process)."""
    BM = 16 if T > 4 else max(1, triton.next_power_of_2(T))
    # 16-token blocks take the tl.dot path, whose 4 fp32 stream tiles + 4 fn tiles spill above 32 columns
    # on sm_89 (255 registers at 64, as _mhc_post_kernel's POST_BLOCK_K): SEAM_DOT_BLOCK_D caps them
    BD = cfg["SEAM_BLOCK_D"] if BM < 16 else min(cfg["SEAM_BLOCK_D"], cfg["SEAM_DOT_BLOCK_D"])
    S = triton.cdiv(D, BD)
    m_tiles = triton.cdiv(T, BM)
    launches = cfg.get("SEAM_LAUNCHES", 1)
    interp = _interpreting() if compiled is None else not compiled
    if interp or m_tiles * (S + 1) > num_sms(device) or m_tiles > SEAM_MAX_TILES:
        launches = 2
    BS = min(triton.next_power_of_2(S), max(1, cfg.get("SEAM_PART_ELEMS", 4096) // (BM * HC * HC)))
    return {"BLOCK_M": BM, "BLOCK_D": BD, "S": S, "m_tiles": m_tiles, "launches": launches, "BLOCK_S": BS}


def _seam_outputs(residual):
    """The fused seams' outputs for ``residual (T, HC, D)``: ``(res_cur (T, HC, D) like residual, post (T, HC, 1)
    fp32, comb (T, HC, HC) fp32, out (T, D) bf16)``, uninitialised."""
    T, _, D = residual.shape
    dev = residual.device
    return (torch.empty_like(residual), torch.empty((T, HC, 1), dtype=torch.float32, device=dev),
            torch.empty((T, HC, HC), dtype=torch.float32, device=dev),
            torch.empty((T, D), dtype=torch.bfloat16, device=dev))


def _seam_strides(x, x2, residual, post_mix, comb_mix, res_cur, fn, out) -> tuple:
    """The row strides every fused seam kernel takes, in its argument order (x2 None: 0)."""
    return (x.stride(0), x2.stride(0) if x2 is not None else 0, residual.stride(0), residual.stride(1),
            post_mix.stride(0), comb_mix.stride(0), res_cur.stride(0), res_cur.stride(1), fn.stride(0), out.stride(0))


def _seam(x, x2, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, rms_eps, pre_eps, sk_eps,
          post_mult, n_iters, norm_eps, precision, cfg):
    T, _, D = residual.shape
    dev = residual.device
    res_cur, post, comb, out = _seam_outputs(residual)
    if T == 0:
        return res_cur, post, comb, out
    plan = seam_plan(T, D, dev, cfg)
    BM, S, mt = plan["BLOCK_M"], plan["S"], plan["m_tiles"]
    BN = 32
    mix_part = torch.empty((mt * S * BM, BN), dtype=torch.float32, device=dev)
    gram_part = torch.empty((mt * S * BM, HC * HC), dtype=torch.float32, device=dev)
    sync = _sync_buffer(dev) if plan["launches"] == 1 else mix_part
    args = (x, x2 if x2 is not None else x, residual, post_mix, comb_mix, res_cur,
            fn, hc_scale, hc_base, norm_weight if norm_weight is not None else out, mix_part, gram_part, sync,
            post, comb, out,
            T, D, S, float(HC * D), float(rms_eps), float(pre_eps), float(sk_eps), float(post_mult), int(n_iters),
            float(norm_eps),
            *_seam_strides(x, x2, residual, post_mix, comb_mix, res_cur, fn, out))
    meta = dict(HC_=HC, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=plan["BLOCK_D"], BLOCK_S=plan["BLOCK_S"],
                HAS_X2=x2 is not None, HAS_NORM=norm_weight is not None, PRECISION=precision, USE_DOT=BM >= 16,
                num_warps=cfg["SEAM_WARPS"], num_stages=1)
    if plan["launches"] == 1:
        _mhc_seam_kernel[(mt, S + 1)](*args, PHASE=0, **meta)
    else:
        _mhc_seam_kernel[(mt, S)](*args, PHASE=1, **meta)
        _mhc_seam_kernel[(mt, S + 1)](*args, PHASE=2, **meta)
    return res_cur, post, comb, out


def _seam_prefetch(pf, S, launches, num_warps) -> tuple[dict, dict]:
    """The seam kernels' prefetch keyword arguments (``mhc_fused_post_pre(prefetch=...)``, l2pf) for the one-launch
    kernel and for the phase-B kernel of the two-launch fallback: none on the interpreter (no inline PTX), none
    for a single column program (no waiter to issue them) or when the sync's arrival ranks are ambiguous
    (``2 (S - 1) >= SEAM1_STEP``: :func:`_arrival_rank`)."""
    kw = prefetch_kwargs(pf, not _interpreting() and S >= 2 and 2 * (S - 1) < SEAM1_STEP, num_warps)
    return (kw, {}) if launches == 1 else ({}, kw)


SEAM1_STEP = 1024  # the counter step of _count_sync: at most this many column programs per token block
SEAM1_MAX_T = 4    # seam1 rows: 1-4 token blocks (fp32 FMA mixes); above, the two-pass kernels (`decode`)


def _count_buffer(device) -> torch.Tensor:
    """The seam1 counters (one int32 per token block, 128 bytes apart), zeroed once per device; the
    protocol of :func:`_count_sync` keeps them valid across launches and graph replays without a reset.
    Not shared with the ``seam_*`` barrier (a different protocol); the same one-stream rule applies."""
    return zeroed_counters("mhc.seam1", device, 32 * SEAM_MAX_TILES, 0)


def seam1_plan(T: int, D: int, device, cfg, compiled: bool | None = None) -> dict:
    """Launch plan of ``_mhc_seam1_kernel``: token block (1, 2 or 4), column split, launches (1 with the
    counter sync; 2 on the interpreter, for ``SEAM1_LAUNCHES = 2`` rows, or when the grid exceeds the SM
    count), partial rows reduced per load. ``compiled`` as :func:`seam_plan`."""
    if not 1 <= T <= SEAM1_MAX_T:
        raise ValueError(f"num_tokens={T}: the seam1 kernel serves 1..{SEAM1_MAX_T} tokens")
    BM = triton.next_power_of_2(T)
    BD = cfg["SEAM1_BLOCK_D"]
    S = triton.cdiv(D, BD)
    launches = cfg.get("SEAM1_LAUNCHES", 1)
    interp = _interpreting() if compiled is None else not compiled
    if interp or S > num_sms(device) or S > SEAM1_STEP:
        launches = 2
    BS = min(triton.next_power_of_2(S), max(1, cfg["SEAM1_PART_ELEMS"] // (BM * HC * HC)))
    return {"BLOCK_M": BM, "BLOCK_D": BD, "S": S, "m_tiles": 1, "launches": launches, "BLOCK_S": BS}


def _seam1(x, x2, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, rms_eps, pre_eps, sk_eps,
           post_mult, n_iters, norm_eps, cfg, quant=None, pf=()):
    T, _, D = residual.shape
    dev = residual.device
    res_cur, post, comb, out = _seam_outputs(residual)
    plan = seam1_plan(T, D, dev, cfg)
    BM, S = plan["BLOCK_M"], plan["S"]
    part_w = 64  # pre 0-3, post 4-7, comb 8-23, Gram 24-39 (fp32; 256-byte rows)
    part = torch.empty((S * BM, part_w), dtype=torch.float32, device=dev)
    cnt = _count_buffer(dev) if plan["launches"] == 1 else part
    q, qs = quant if quant is not None else (out, out)
    args = (x, x2 if x2 is not None else x, residual, post_mix, comb_mix, res_cur,
            fn, hc_scale, hc_base, norm_weight if norm_weight is not None else out, part, cnt,
            post, comb, out, q, qs,
            T, D, S, float(HC * D), float(rms_eps), float(pre_eps), float(sk_eps), float(post_mult), int(n_iters),
            float(norm_eps), ACT_QUANT_EPS,
            *_seam_strides(x, x2, residual, post_mix, comb_mix, res_cur, fn, out), q.stride(0), qs.stride(0))
    meta = dict(HC_=HC, BLOCK_M=BM, BLOCK_D=plan["BLOCK_D"], BLOCK_S=plan["BLOCK_S"], PART_W=part_w,
                STEP=SEAM1_STEP, HAS_X2=x2 is not None, HAS_NORM=norm_weight is not None,
                num_warps=cfg["SEAM1_WARPS"], num_stages=1)
    pf1, pf2 = _seam_prefetch(pf, S, plan["launches"], cfg["SEAM1_WARPS"])
    if plan["launches"] == 1:
        _mhc_seam1_kernel[(1, S)](*args, PHASE=0, QUANT=quant is not None, **meta, **pf1)
    else:
        _mhc_seam1_kernel[(1, S)](*args, PHASE=1, **meta)
        _mhc_seam1_kernel[(1, S)](*args, PHASE=2, QUANT=quant is not None, **meta, **pf2)
    return res_cur, post, comb, out


SEAMR_MAX_T = 16   # seamr rows: 1-16 tokens (token blocks of SEAMR_BLOCK_M); above, the two-pass kernels (`decode`)
#: the seamr kernel issues ``prefetch=`` (l2pf) up to token blocks of this many tokens: with a ``prefetch``
#: instruction in it, ptxas keeps the sm_89 build at <= 128 registers, and the 4-token block (152-155 registers
#: without) then spills 8-16 B; 1-2 token blocks fit (T=1, the default: 90-112 registers, no spill)
SEAMR_PREFETCH_MAX_M = 2
SEAMR_PART_W = 48  # fp32 per partial row: Gram 0-9, pre 10-13, post 16-19, comb 20-35 (192-byte rows)


def resident_per_sm(num_warps: int) -> int:
    """Programs of a seam kernel resident per SM at once, whatever its register count: 4 warps x 255
    registers (256 allocated per thread) are 32,768 of the 65,536 registers of an sm_89 / sm_90 / sm_120
    SM, and the seam kernels' 2 KiB of shared memory never limit; 8 warps: 1 at up to 255 registers."""
    return 2 if num_warps <= 4 else 1


def seamr_plan(T: int, D: int, device, cfg, compiled: bool | None = None) -> dict:
    """Launch plan of ``_mhc_seam_rows_kernel``: token block (``min(next_pow2(T), SEAMR_BLOCK_M)``), token
    blocks, column split, launches (1 with the counter sync; 2 on the interpreter, for ``SEAMR_LAUNCHES = 2``
    rows, or when the grid exceeds the programs resident at once: :func:`resident_per_sm` x SMs), partial
    rows reduced per load. ``compiled`` as :func:`seam_plan`."""
    top = cfg.get("SEAMR_MAX_T", SEAMR_MAX_T)
    if not 1 <= T <= top:
        raise ValueError(f"num_tokens={T}: this seamr row serves 1..{top} tokens")
    BM = min(triton.next_power_of_2(T), cfg["SEAMR_BLOCK_M"])
    BD = cfg["SEAMR_BLOCK_D"]
    S = triton.cdiv(D, BD)
    mt = triton.cdiv(T, BM)
    launches = cfg.get("SEAMR_LAUNCHES", 1)
    interp = _interpreting() if compiled is None else not compiled
    if (interp or mt * S > resident_per_sm(cfg["SEAMR_WARPS"]) * num_sms(device) or S > SEAM1_STEP
            or mt > SEAM_MAX_TILES):
        launches = 2
    BS = min(triton.next_power_of_2(S), cfg["SEAMR_PART_ROWS"])
    return {"BLOCK_M": BM, "BLOCK_D": BD, "S": S, "m_tiles": mt, "launches": launches, "BLOCK_S": BS}


def _seam_rows(x, x2, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, rms_eps, pre_eps, sk_eps,
               post_mult, n_iters, norm_eps, cfg, quant=None, pf=()):
    T, _, D = residual.shape
    dev = residual.device
    res_cur, post, comb, out = _seam_outputs(residual)
    plan = seamr_plan(T, D, dev, cfg)
    BM, S, mt = plan["BLOCK_M"], plan["S"], plan["m_tiles"]
    part = torch.empty((mt * S * BM, SEAMR_PART_W), dtype=torch.float32, device=dev)
    cnt = _count_buffer(dev) if plan["launches"] == 1 else part
    q, qs = quant if quant is not None else (out, out)
    args = (x, x2 if x2 is not None else x, residual, post_mix, comb_mix, res_cur,
            fn, hc_scale, hc_base, norm_weight if norm_weight is not None else out, part, cnt,
            post, comb, out, q, qs,
            T, D, S, float(HC * D), float(rms_eps), float(pre_eps), float(sk_eps), float(post_mult), int(n_iters),
            float(norm_eps), ACT_QUANT_EPS,
            *_seam_strides(x, x2, residual, post_mix, comb_mix, res_cur, fn, out), q.stride(0), qs.stride(0))
    meta = dict(BLOCK_M=BM, BLOCK_D=plan["BLOCK_D"], BLOCK_S=plan["BLOCK_S"], PART_W=SEAMR_PART_W,
                STEP=SEAM1_STEP, HAS_X2=x2 is not None, HAS_NORM=norm_weight is not None,
                num_warps=cfg["SEAMR_WARPS"], num_stages=1)
    pf1, pf2 = _seam_prefetch(pf if BM <= SEAMR_PREFETCH_MAX_M else (), S, plan["launches"], cfg["SEAMR_WARPS"])
    if plan["launches"] == 1:
        _mhc_seam_rows_kernel[(mt, S)](*args, PHASE=0, QUANT=quant is not None, **meta, **pf1)
    else:
        _mhc_seam_rows_kernel[(mt, S)](*args, PHASE=1, **meta)
        _mhc_seam_rows_kernel[(mt, S)](*args, PHASE=2, QUANT=quant is not None, **meta, **pf2)
    return res_cur, post, comb, out


SEAMT_MAX_T = 32   # seamt rows: 1-32 tokens by default (the step's batch-16 MTP verify); above, the two-pass kernels
SEAMT_PART_W = 48  # fp32 per partial row: mixes 0-23, Gram 24-33 (192-byte rows)
SEAMT_MAX_CHUNK = 2048  # phase-B columns a task collapses at most (above, a program runs several tasks)


def seamt_plan(T: int, D: int, device, cfg, compiled: bool | None = None) -> dict:
    """Launch plan of ``_mhc_seam_tok_kernel`` (``seamt_*`` rows): phase-A token block ``SEAMT_BLOCK_M`` (16: the
    ``tl.dot`` minimum) x ``SEAMT_BLOCK_D`` columns, ``P = m_tiles * S`` programs; phase B: the smallest
    ``CHUNK`` (a power of two, >= 128 so that every FP8 group is one task's, <= ``SEAMT_MAX_CHUNK``) with
    ``T * cdiv(D, CHUNK) <= P`` tasks; launches (1 with the counter sync; 2 on the interpreter, for
    ``SEAMT_LAUNCHES = 2`` rows, or when P exceeds the programs resident at once: :func:`resident_per_sm` x SMs).
    ``compiled`` as :func:`seam_plan`. Raises ValueError outside ``1..SEAMT_MAX_T`` tokens."""
    top = cfg.get("SEAMT_MAX_T", SEAMT_MAX_T)
    if not 1 <= T <= top:
        raise ValueError(f"num_tokens={T}: this seamt row serves 1..{top} tokens")
    BM, BD = cfg["SEAMT_BLOCK_M"], cfg["SEAMT_BLOCK_D"]
    S = triton.cdiv(D, BD)
    mt = triton.cdiv(T, BM)
    P = mt * S
    chunk = 128
    while chunk < min(SEAMT_MAX_CHUNK, triton.next_power_of_2(D)) and T * triton.cdiv(D, chunk) > P:
        chunk *= 2
    n_chunks = triton.cdiv(D, chunk)
    launches = cfg.get("SEAMT_LAUNCHES", 1)
    interp = _interpreting() if compiled is None else not compiled
    if interp or P > resident_per_sm(cfg["SEAMT_WARPS"]) * num_sms(device) or P > SEAM1_STEP:
        launches = 2
    BS = triton.next_power_of_2(S)
    return {"BLOCK_M": BM, "BLOCK_D": BD, "S": S, "m_tiles": mt, "programs": P, "launches": launches,
            "BLOCK_S": BS, "PART_ROWS": min(BS, cfg["SEAMT_PART_ROWS"]), "CHUNK": chunk, "n_chunks": n_chunks,
            "n_tasks": T * n_chunks}


def _seam_tok(x, x2, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, rms_eps, pre_eps, sk_eps,
              post_mult, n_iters, norm_eps, precision, cfg, quant=None):
    T, _, D = residual.shape
    dev = residual.device
    res_cur, post, comb, out = _seam_outputs(residual)
    plan = seamt_plan(T, D, dev, cfg)
    BM, S, mt = plan["BLOCK_M"], plan["S"], plan["m_tiles"]
    part = torch.empty((mt * BM * S, SEAMT_PART_W), dtype=torch.float32, device=dev)
    cnt = _count_buffer(dev) if plan["launches"] == 1 else part
    q, qs = quant if quant is not None else (out, out)
    args = (x, x2 if x2 is not None else x, residual, post_mix, comb_mix, res_cur,
            fn, hc_scale, hc_base, norm_weight if norm_weight is not None else out, part, cnt,
            post, comb, out, q, qs,
            T, D, S, plan["n_tasks"], plan["n_chunks"], float(HC * D), float(rms_eps), float(pre_eps), float(sk_eps),
            float(post_mult), int(n_iters), float(norm_eps), ACT_QUANT_EPS,
            *_seam_strides(x, x2, residual, post_mix, comb_mix, res_cur, fn, out), q.stride(0), qs.stride(0))
    meta = dict(BLOCK_M=BM, BLOCK_D=plan["BLOCK_D"], BLOCK_S=plan["BLOCK_S"], PART_ROWS=plan["PART_ROWS"],
                CHUNK=plan["CHUNK"], PART_W=SEAMT_PART_W, STEP=SEAM1_STEP, PRECISION=precision,
                HAS_X2=x2 is not None, HAS_NORM=norm_weight is not None, num_warps=cfg["SEAMT_WARPS"], num_stages=1)
    if plan["launches"] == 1:
        _mhc_seam_tok_kernel[(mt, S)](*args, PHASE=0, QUANT=quant is not None, **meta)
    else:
        _mhc_seam_tok_kernel[(mt, S)](*args, PHASE=1, **meta)
        _mhc_seam_tok_kernel[(mt, S)](*args, PHASE=2, QUANT=quant is not None, **meta)
    return res_cur, post, comb, out


def _check_post_inputs(x, residual, post_mix, comb_mix, x2=None):
    T, D = _check_residual("residual", residual)
    check.tensor("x", x, (torch.bfloat16, torch.float32), 2)   # fp32: the MoE's fp32 sum, used unrounded
    check.shape("x", x, (T, D))
    check.last_dim_contiguous("x", x)
    if x2 is not None:
        check.tensor("x2", x2, torch.bfloat16, 2)
        check.shape("x2", x2, (T, D))
        check.last_dim_contiguous("x2", x2)
        check.same_device("residual", residual, x2=x2)
    check.tensor("post_mix", post_mix, torch.float32)
    if tuple(post_mix.shape) not in ((T, HC), (T, HC, 1)):
        raise ValueError(f"post_mix: expected shape ({T}, {HC}) or ({T}, {HC}, 1), got {tuple(post_mix.shape)}")
    check.contiguous("post_mix", post_mix)
    check.tensor("comb_mix", comb_mix, torch.float32, 3)
    check.shape("comb_mix", comb_mix, (T, HC, HC))
    check.contiguous("comb_mix", comb_mix)
    check.same_device("residual", residual, x=x, post_mix=post_mix, comb_mix=comb_mix)
    return T, D


# ---- public launchers ----------------------------------------------------------------------------
def hc_prenorm_gemm(x: torch.Tensor, fn: torch.Tensor, num_splits: int | None = None, precision: str = "tf32",
                    config: dict | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Split-K pre-norm GEMM of mHC: partial mixes and partial sums of squares.

    Semantics: DeepGEMM ``tf32_hc_prenorm_gemm(x, fn, out, sqrsum, num_splits)``:
    ``sum_s mixes[s] = x.float() @ fn.T`` and ``sum_s sqrsum[s] = (x.float() ** 2).sum(-1)``.

    Args:
        x: ``(num_tokens, K)`` bfloat16, last dim contiguous; the residual ``(T, 4, 4096)`` viewed as
            ``(T, 16384)``.
        fn: ``(N, K)`` float32 (``N = 24`` mixes: pre 4, post 4, comb 16; or 4 for hc_head), last dim contiguous.
        num_splits: number of K partials ``S``; default picks from the SM count so ~2 waves run. The result
            may have fewer splits than asked if ``K`` has fewer ``BLOCK_K`` blocks.
        precision: ``"tf32"`` (tensor cores, DeepGEMM's choice; ~1e-3 relative per product) or ``"ieee"``
            (fp32 FMA). The CPU interpreter computes fp32 either way.
        config: a row of ``CONFIGS`` (keys ``GEMM_*``, ``WAVES``, ``MIN_K_BLOCKS``).
        out: optional ``(mixes, sqrsum)`` float32 buffers ``(S, num_tokens, N)`` / ``(S, num_tokens)``
            (last dim contiguous; DeepGEMM's ``d`` / ``sqr_sum``) written in place, no copy; ``S`` is
            their first dim (``num_splits`` must be None or equal). Every one of the S slices is written:
            a split whose K range starts past ``K`` (S above the K block count) holds zeros.

    Returns:
        ``(mixes, sqrsum)``: ``(S, num_tokens, N)`` and ``(S, num_tokens)`` float32 partials over contiguous
        K ranges (``out`` itself when given); callers sum over the first axis.

    Raises:
        TypeError: wrong dtypes. ValueError: shapes, strides, devices, ``K % 16``, precision, num_splits < 1.
    """
    check.tensor("x", x, torch.bfloat16, 2)
    T, K = x.shape
    check.tensor("fn", fn, torch.float32, 2)
    check.same_device("x", x, fn=fn)
    if fn.shape[1] != K or not 1 <= fn.shape[0] <= 64:
        raise ValueError(f"fn: expected shape (N <= 64, {K}), got {tuple(fn.shape)}")
    if K % 16 or K == 0:
        raise ValueError(f"x: K={K} must be a positive multiple of 16")
    if x.stride(1) != 1 or fn.stride(1) != 1:
        raise ValueError(f"x / fn: last dim must be contiguous, got strides {tuple(x.stride())} / {tuple(fn.stride())}")
    _check_precision(precision)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r}: expected a positive int or None")
    cfg = config or pick_config(T, x.device)
    if out is not None:
        num_splits = _prenorm_out(out, T, fn.shape[0], num_splits, x.device)
    return _prenorm_partials(x, fn, num_splits, precision, cfg, out)


def mhc_pre(residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
            norm_weight: torch.Tensor | None = None, rms_eps: float = 1e-6, hc_pre_eps: float = 1e-6,
            hc_sinkhorn_eps: float = 1e-6, hc_post_mult: float = 2.0, sinkhorn_iters: int = 20,
            norm_eps: float = 1e-6, precision: str = "tf32", config: dict | None = None):
    """mHC pre block: gates, Sinkhorn-normalised 4x4 comb, collapsed and RMS-normalised layer input.

    Semantics: vLLM ``mhc_pre_tilelang`` (pre-norm GEMM + ``mhc_pre_big_fuse_with_norm``) and
    ``mhc_pre_torch``; see the module docstring for the formulas.

    Args:
        residual: ``(num_tokens, 4, hidden)`` bfloat16, contiguous (the hyper-connection streams).
        fn: ``(24, 4*hidden)`` float32 mix projection (rows: pre 0-3, post 4-7, comb 8-23 row-major).
        hc_scale: ``(3,)`` float32 (pre, post, comb logit scales). hc_base: ``(24,)`` float32 logit biases.
        norm_weight: ``(hidden,)`` bfloat16/float32 RMSNorm weight of the sublayer, or None (raw collapse).
        rms_eps: eps of the mix pre-norm (``rms_norm_eps``). hc_pre_eps / hc_sinkhorn_eps: ``hc_eps``.
        hc_post_mult: post gate multiplier (2.0). sinkhorn_iters: ``hc_sinkhorn_iters`` (20), >= 1.
        norm_eps: eps of the layer-input RMSNorm. precision: ``"tf32"`` or ``"ieee"`` for the GEMM.
            The eps terms are 0 or positive normal float32s, ``hc_post_mult`` a finite normal float32
            (they reach the kernel as fp32 arguments; ``ValueError`` naming the argument otherwise).
        config: a row of ``CONFIGS``.

    Returns:
        ``(post_mix, comb_mix, layer_input)``: ``(num_tokens, 4, 1)`` float32, ``(num_tokens, 4, 4)`` float32
        (``comb[t, i, j]`` weighs residual stream i into new stream j), ``(num_tokens, hidden)`` bfloat16.

    Raises:
        TypeError / ValueError naming the offending argument (dtype, shape, contiguity, device, hc_mult != 4).
    """
    T, D = _check_residual("residual", residual)
    _check_mhc_params(fn, hc_scale, hc_base, norm_weight, HC * D, D, ("residual", residual))
    _check_scalars(sinkhorn_iters, hc_post_mult, rms_eps=rms_eps, hc_pre_eps=hc_pre_eps,
                   hc_sinkhorn_eps=hc_sinkhorn_eps, norm_eps=norm_eps)
    _check_precision(precision)
    cfg = config or pick_config(T, residual.device)
    mixes, sqrsum = _prenorm_partials(residual.view(T, HC * D), fn, None, precision, cfg)
    return _apply(mixes, sqrsum, hc_scale, hc_base, residual, (residual.stride(0), residual.stride(1)),
                  norm_weight, D, HC * D, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult, sinkhorn_iters,
                  norm_eps, cfg)


def mhc_pre_broadcast(x: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                      norm_weight: torch.Tensor | None = None, rms_eps: float = 1e-6, hc_pre_eps: float = 1e-6,
                      hc_sinkhorn_eps: float = 1e-6, hc_post_mult: float = 2.0, sinkhorn_iters: int = 20,
                      norm_eps: float = 1e-6, fn_broadcast: torch.Tensor | None = None, precision: str = "tf32",
                      config: dict | None = None):
    """Layer-0 mHC pre: the residual is the embedding broadcast to 4 identical streams.

    Semantics: vLLM ``mhc_pre_broadcast_tilelang`` (``fn_broadcast = fn.view(24, 4, hidden).sum(1)``; the
    GEMM runs over ``hidden`` only; the mean of squares over the 4 copies equals the mean over ``hidden``).
    Equal to ``mhc_pre(x[:, None].expand(T, 4, hidden))`` and also returns that expanded residual.

    Args:
        x: ``(num_tokens, hidden)`` bfloat16, contiguous (token embeddings).
        fn_broadcast: optional precomputed ``(24, hidden)`` float32; computed from ``fn`` when None.
        Others: as :func:`mhc_pre`.

    Returns:
        ``(residual, post_mix, comb_mix, layer_input)``: ``(num_tokens, 4, hidden)`` bfloat16 (4 copies of x),
        then as :func:`mhc_pre`.

    Raises:
        TypeError / ValueError naming the offending argument.
    """
    check.tensor("x", x, torch.bfloat16, 2)
    T, D = x.shape
    _check_hidden("x", D)
    check.contiguous("x", x)
    _check_mhc_params(fn, hc_scale, hc_base, norm_weight, HC * D, D, ("x", x))
    _check_scalars(sinkhorn_iters, hc_post_mult, rms_eps=rms_eps, hc_pre_eps=hc_pre_eps,
                   hc_sinkhorn_eps=hc_sinkhorn_eps, norm_eps=norm_eps)
    _check_precision(precision)
    n_mix = fn.shape[0]
    if fn_broadcast is None:
        fn_broadcast = fn.view(n_mix, HC, D).sum(dim=1)
    else:
        check.tensor("fn_broadcast", fn_broadcast, torch.float32, 2)
        check.shape("fn_broadcast", fn_broadcast, (n_mix, D))
        check.contiguous("fn_broadcast", fn_broadcast)
        check.same_device("x", x, fn_broadcast=fn_broadcast)
    cfg = config or pick_config(T, x.device)
    res_out = torch.empty((T, HC, D), dtype=torch.bfloat16, device=x.device)
    mixes, sqrsum = _prenorm_partials(x, fn_broadcast, None, precision, cfg)
    post, comb, out = _apply(mixes, sqrsum, hc_scale, hc_base, x, (x.stride(0), 0), norm_weight, D, D, rms_eps,
                             hc_pre_eps, hc_sinkhorn_eps, hc_post_mult, sinkhorn_iters, norm_eps, cfg,
                             res_out=res_out)
    return res_out, post, comb, out


def mhc_post(x: torch.Tensor, residual: torch.Tensor, post_mix: torch.Tensor, comb_mix: torch.Tensor,
             out: torch.Tensor | None = None, config: dict | None = None,
             x2: torch.Tensor | None = None) -> torch.Tensor:
    """mHC post block: ``new[:, j] = sum_i comb[:, i, j] residual[:, i] + post[:, j] x`` in fp32, bf16 out.

    Semantics: vLLM ``mhc_post_torch`` / ``mhc_post_tilelang``.

    Args:
        x: ``(num_tokens, hidden)`` bfloat16 or float32, last dim contiguous (the sublayer output; a float32
            x, the MoE's shared + routed sum accumulated in fp32 (issue 20 moe1), is used as is, unrounded).
        x2: optional second addend like ``x`` (the MoE's shared-expert output): the post then runs on
            ``(x.float() + x2.float()).to(bfloat16)``, the rounding of the separate add it replaces.
        residual: ``(num_tokens, 4, hidden)`` bfloat16, contiguous.
        post_mix: ``(num_tokens, 4)`` or ``(num_tokens, 4, 1)`` float32, contiguous.
        comb_mix: ``(num_tokens, 4, 4)`` float32, contiguous.
        out: optional ``(num_tokens, 4, hidden)`` bfloat16 contiguous destination (may not alias residual).
        config: a row of ``CONFIGS`` (keys ``POST_*``).

    Returns:
        ``(num_tokens, 4, hidden)`` bfloat16.

    Raises:
        TypeError / ValueError naming the offending argument.
    """
    T, D = _check_post_inputs(x, residual, post_mix, comb_mix, x2)
    if out is None:
        out = torch.empty_like(residual)
    else:
        check.tensor("out", out, torch.bfloat16, 3)
        check.shape("out", out, residual.shape)
        check.contiguous("out", out)
        check.same_device("residual", residual, out=out)
        if out.data_ptr() == residual.data_ptr() and T:
            raise ValueError("out: must not alias residual (other programs still read it)")
    cfg = config or pick_config(T, residual.device)
    _post(x, residual, post_mix, comb_mix, out, cfg, x2=x2)
    return out


def mhc_fused_post_pre(x: torch.Tensor, residual: torch.Tensor, post_mix: torch.Tensor, comb_mix: torch.Tensor,
                       fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                       norm_weight: torch.Tensor | None = None, rms_eps: float = 1e-6, hc_pre_eps: float = 1e-6,
                       hc_sinkhorn_eps: float = 1e-6, hc_post_mult: float = 2.0, sinkhorn_iters: int = 20,
                       norm_eps: float = 1e-6, precision: str = "tf32", config: dict | None = None,
                       x2: torch.Tensor | None = None, quant_out: bool = False, prefetch=None):
    """mHC post of one sublayer fused with the pre of the next (the per-sublayer seam).

    Semantics: vLLM ``mhc_fused_post_pre_tilelang``: ``residual_cur = mhc_post(x, residual, post, comb)``
    (bf16), then ``mhc_pre(residual_cur, fn, ...)``. The pre-norm GEMM runs on the bf16-rounded new
    residual, so the result equals the unfused pair exactly in semantics.

    Pass 1 (one kernel) reads ``residual`` and ``x``, writes ``residual_cur`` and the split-K partial mixes
    of the next pre; pass 2 reduces the partials, computes gates and Sinkhorn, and collapses ``residual_cur``
    (L2-resident for moderate T) into the normalised layer input.

    Decode rows (``SEAM_BLOCK_D`` in the config, up to 64 tokens): one launch of ``_mhc_seam_kernel``
    (``cdiv(hidden, SEAM_BLOCK_D) + 1`` programs per 16-token block, a grid barrier between the partial
    mixes and the collapse; Sinkhorn in its own program). Its layer input normalises with
    ``mean(y^2)`` from the streams' Gram matrix (fp32 ``y``) instead of squaring ``bf16(y)``; the two
    differ by ~1e-5 relative (a bf16 output may move by one step).

    Args: as :func:`mhc_post` (``x2`` included) then :func:`mhc_pre`, and

        quant_out: also return the layer input's FP8 copy (issue 20, pq-mhc: the input of the FP8 linears that
            read it, ``wqkv_a`` / ``shared_w13``, then skips their quant prologue). A bool; needs
            ``hidden % 128 == 0`` and an FP8 device (compute capability >= 8.9, or the CPU interpreter).
        prefetch: None, or a tuple / list of up to ``_l2.MAX_REGIONS`` (8) contiguous tensors of any dtype on the
            call's device (issue 20, l2pf: the weights the next kernels read, e.g. the router gate, the shared
            expert's w13 and the next seam's ``fn``): the launch also issues an L2 prefetch
            (``prefetch.global.L2::evict_last``, ``_l2.PREFETCH_EVICT``) of every 128-byte line of their bytes,
            split over the programs that wait at the grid sync (the last arriver issues none), so those kernels
            find them in L2. Outputs unchanged (a prefetch writes nothing). Implemented where the decode
            defaults run (``SEAM_DEFAULTS``): the ``seam1_*`` rows and the ``seamr_*`` rows in token blocks of up to
            ``SEAMR_PREFETCH_MAX_M`` tokens (:func:`prefetch_issued`; a two-launch fallback issues it at the end
            of its second launch); larger seamr token blocks, the ``seam_*`` rows, the two-pass ``decode`` /
            ``prefill`` kernels (T > 4 by default) and the CPU interpreter (which runs no inline PTX) check it and
            ignore it.

    Returns:
        ``(residual_cur, post_mix, comb_mix, layer_input)``: ``(num_tokens, 4, hidden)`` bfloat16,
        ``(num_tokens, 4, 1)`` float32, ``(num_tokens, 4, 4)`` float32, ``(num_tokens, hidden)`` bfloat16.
        With ``quant_out=True`` a 5-tuple ``(residual_cur, post_mix, comb_mix, layer_input,
        (layer_input_fp8, layer_input_scale))``: ``(num_tokens, hidden)`` float8_e4m3fn and
        ``(num_tokens, hidden / 128)`` uint8 UE8M0 exponent bytes (scale ``2^(b - 127)``), both contiguous
        (row-major; scale ``[t, g]`` covers columns ``[128 g, 128 g + 128)``), bit for bit
        ``ds4lab_kernels.fp8_quant.per_token_group_quant_fp8(layer_input, 128, scale_fmt="ue8m0", eps=1e-10)``
        of the bf16 ``layer_input`` returned (an all-zero group: scale ``ceil_pow2(1e-10 / 448)``, zeros; a
        group with NaN: byte 255). The other four outputs are the ``quant_out=False`` ones, bit for bit.
        Where the quant is fused (:func:`quant_out_path`): the ``seamr_*`` and ``seam1_*`` kernels (every
        program computes its whole 128-column group's layer input, stores its own columns) and the two-pass
        apply kernel (``decode`` / ``prefill`` rows: whole rows per program), i.e. every path the decode
        defaults (``SEAM_DEFAULTS``, then ``decode``) take; the ``seam_*`` rows run
        ``per_token_group_quant_fp8`` as a second launch.

    Raises:
        TypeError / ValueError naming the offending argument (``quant_out`` not a bool, or True with
        ``hidden % 128 != 0`` or a device without FP8; ``prefetch`` not None / a tuple or list of tensors, more
        than 8 of them, one on another device, not contiguous or of 2 GiB or more).
    """
    T, D = _check_post_inputs(x, residual, post_mix, comb_mix, x2)
    _check_mhc_params(fn, hc_scale, hc_base, norm_weight, HC * D, D, ("residual", residual))
    _check_scalars(sinkhorn_iters, hc_post_mult, rms_eps=rms_eps, hc_pre_eps=hc_pre_eps,
                   hc_sinkhorn_eps=hc_sinkhorn_eps, norm_eps=norm_eps)
    _check_precision(precision)
    _check_quant_out(quant_out, D, residual.device)
    pf = prefetch_regions(prefetch, residual.device)
    cfg = config or pick_config(T, residual.device, fused=True)
    path = seam_path(T, cfg)
    quant = None
    if quant_out and quant_out_path(T, cfg) == "fused":
        quant = (torch.empty((T, D), dtype=torch.float8_e4m3fn, device=residual.device),
                 torch.empty((T, D // QUANT_GROUP), dtype=torch.uint8, device=residual.device))
    if path == "seamt":
        outs = _seam_tok(x, x2, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, rms_eps,
                         hc_pre_eps, hc_sinkhorn_eps, hc_post_mult, sinkhorn_iters, norm_eps, precision, cfg, quant)
    elif path == "seamr":
        outs = _seam_rows(x, x2, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, rms_eps,
                          hc_pre_eps, hc_sinkhorn_eps, hc_post_mult, sinkhorn_iters, norm_eps, cfg, quant, pf)
    elif path == "seam1":
        outs = _seam1(x, x2, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, rms_eps, hc_pre_eps,
                      hc_sinkhorn_eps, hc_post_mult, sinkhorn_iters, norm_eps, cfg, quant, pf)
    elif path == "seam":
        outs = _seam(x, x2, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, rms_eps, hc_pre_eps,
                     hc_sinkhorn_eps, hc_post_mult, sinkhorn_iters, norm_eps, precision, cfg)
    else:
        res_cur = torch.empty_like(residual)
        mixes, sqrsum = _post(x, residual, post_mix, comb_mix, res_cur, cfg, fn=fn, precision=precision, x2=x2)
        post, comb, out = _apply(mixes, sqrsum, hc_scale, hc_base, res_cur, (res_cur.stride(0), res_cur.stride(1)),
                                 norm_weight, D, HC * D, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult,
                                 sinkhorn_iters, norm_eps, cfg, quant=quant)
        outs = (res_cur, post, comb, out)
    if not quant_out:
        return outs
    if quant is None:  # a path without the fused write: the standalone quant of the bf16 layer input
        quant = per_token_group_quant_fp8(outs[3], QUANT_GROUP, scale_fmt="ue8m0", eps=ACT_QUANT_EPS)
    return (*outs, quant)


def seam_path(num_tokens: int, cfg: dict) -> str:
    """Which kernels :func:`mhc_fused_post_pre` runs for ``num_tokens`` with config row ``cfg``: ``"seamr"``
    (``_mhc_seam_rows_kernel``), ``"seam1"`` (``_mhc_seam1_kernel``), ``"seam"`` (``_mhc_seam_kernel``) or
    ``"two_pass"`` (``_mhc_post_kernel`` + ``_mhc_apply_kernel``), or ``"seamt"`` (``_mhc_seam_tok_kernel``,
    checked first); the first whose row keys and token range match, in that order."""
    T = num_tokens
    if cfg.get("SEAMT_BLOCK_D") and 1 <= T <= cfg.get("SEAMT_MAX_T", SEAMT_MAX_T):
        return "seamt"
    if cfg.get("SEAMR_BLOCK_D") and 1 <= T <= cfg.get("SEAMR_MAX_T", SEAMR_MAX_T):
        return "seamr"
    if cfg.get("SEAM1_BLOCK_D") and 1 <= T <= SEAM1_MAX_T:
        return "seam1"
    if cfg.get("SEAM_BLOCK_D") and T <= SEAM_MAX_T:
        return "seam"
    return "two_pass"


def prefetch_issued(num_tokens: int, cfg: dict) -> bool:
    """True where :func:`mhc_fused_post_pre` ``(prefetch=...)`` issues the L2 prefetch on a GPU for ``num_tokens``
    with config row ``cfg`` (with at least two column programs): the ``seam1`` path, the ``seamr`` path in token
    blocks of up to :data:`SEAMR_PREFETCH_MAX_M` tokens; False where it ignores it (larger seamr token blocks, the
    ``seam`` rows, the two-pass kernels)."""
    path = seam_path(num_tokens, cfg)
    if path == "seamr":
        return min(triton.next_power_of_2(num_tokens), cfg["SEAMR_BLOCK_M"]) <= SEAMR_PREFETCH_MAX_M
    return path == "seam1"


def quant_out_path(num_tokens: int, cfg: dict) -> str:
    """``"fused"`` when :func:`mhc_fused_post_pre` ``(quant_out=True)`` writes the FP8 copy from the kernel that
    writes the layer input (a seamr / seam1 row whose column block divides 128, or the two-pass apply kernel),
    else ``"separate"`` (one ``per_token_group_quant_fp8`` launch after: the ``seam_*`` rows)."""
    path = seam_path(num_tokens, cfg)
    if path in ("two_pass", "seamt"):
        return "fused"
    if path in ("seamr", "seam1"):
        bd = cfg["SEAMR_BLOCK_D"] if path == "seamr" else cfg["SEAM1_BLOCK_D"]
        return "fused" if QUANT_GROUP % bd == 0 else "separate"
    return "separate"


def _check_quant_out(quant_out, D, device):
    if not isinstance(quant_out, bool):
        raise TypeError(f"quant_out={quant_out!r}: expected a bool")
    if quant_out:
        if D % QUANT_GROUP:
            raise ValueError(f"quant_out=True: hidden={D} is not a multiple of {QUANT_GROUP} (the FP8 copy's "
                             f"1x{QUANT_GROUP} scale groups)")
        require_fp8("quant_out", device, "mhc_fused_post_pre(quant_out=True)")


def hc_head(residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
            rms_eps: float = 1e-6, hc_eps: float = 1e-6, precision: str = "tf32",
            config: dict | None = None) -> torch.Tensor:
    """hc_head: collapse the 4 streams at the model exit (and the MTP head) with sigmoid gates.

    Semantics: vLLM ``hc_head_fused_kernel_tilelang``: ``mix = res.view(T, 4 hidden) @ fn.T``,
    ``pre = sigmoid(mix rsqrt(mean(res^2) + rms_eps) scale[0] + base) + hc_eps``,
    ``out = bf16(sum_i pre_i res_i)`` (the model's final RMSNorm follows separately).

    Args:
        residual: ``(num_tokens, 4, hidden)`` bfloat16, contiguous.
        fn: ``(4, 4*hidden)`` float32. hc_scale: ``(1,)`` float32. hc_base: ``(4,)`` float32.

    Returns:
        ``(num_tokens, hidden)`` bfloat16.

    Raises:
        TypeError / ValueError naming the offending argument.
    """
    T, D = _check_residual("residual", residual)
    _check_mhc_params(fn, hc_scale, hc_base, None, HC * D, D, ("residual", residual), n_mix=HC, n_scale=1)
    _check_scalars(rms_eps=rms_eps, hc_eps=hc_eps)
    _check_precision(precision)
    cfg = config or pick_config(T, residual.device)
    mixes, sqrsum = _prenorm_partials(residual.view(T, HC * D), fn, None, precision, cfg)
    _, _, out = _apply(mixes, sqrsum, hc_scale, hc_base, residual, (residual.stride(0), residual.stride(1)),
                       None, D, HC * D, rms_eps, hc_eps, 0.0, 1.0, 1, 0.0, cfg, head=True)
    return out


# ---- config table --------------------------------------------------------------------------------
# GEMM_*: split-K pre-norm GEMM tiles (x tile bf16 -> fp32 in registers, fn^T tile fp32, N=24 padded to 32).
# POST_*: fused post + partial GEMM tiles over (tokens, hidden columns of all 4 streams); BLOCK_K is small
#   because the 4 fp32 stream tiles, 4 fn^T tiles and their 64-bit pointer tiles are live together (BK=64
#   spills on sm_89 at 255 registers; BK=32/16 do not). PLAIN_*: the standalone post (no dot, M may be 1).
# APPLY_*: gates/Sinkhorn/collapse, one token per program, whole hidden row in registers.
# WAVES x SMs programs are targeted by choosing the split count; each split keeps >= MIN_K_BLOCKS blocks.
_PREFILL_89 = {"GEMM_BLOCK_M": 64, "GEMM_BLOCK_K": 64, "GEMM_WARPS": 8, "GEMM_STAGES": 3,
               "POST_BLOCK_M": 64, "POST_BLOCK_K": 16, "POST_WARPS": 4, "POST_STAGES": 1,
               "PLAIN_BLOCK_M": 4, "PLAIN_BLOCK_K": 512, "PLAIN_WARPS": 4,
               "APPLY_BLOCK_T": 1, "APPLY_WARPS": 8, "WAVES": 2, "MIN_K_BLOCKS": 2}
_PREFILL_90 = {"GEMM_BLOCK_M": 64, "GEMM_BLOCK_K": 128, "GEMM_WARPS": 4, "GEMM_STAGES": 3,
               "POST_BLOCK_M": 64, "POST_BLOCK_K": 32, "POST_WARPS": 8, "POST_STAGES": 1,
               "PLAIN_BLOCK_M": 4, "PLAIN_BLOCK_K": 512, "PLAIN_WARPS": 4,
               "APPLY_BLOCK_T": 1, "APPLY_WARPS": 8, "WAVES": 2, "MIN_K_BLOCKS": 2}
_DECODE_89 = {"GEMM_BLOCK_M": 16, "GEMM_BLOCK_K": 128, "GEMM_WARPS": 4, "GEMM_STAGES": 2,
              "POST_BLOCK_M": 16, "POST_BLOCK_K": 32, "POST_WARPS": 4, "POST_STAGES": 1,
              "PLAIN_BLOCK_M": 1, "PLAIN_BLOCK_K": 256, "PLAIN_WARPS": 2,
              "APPLY_BLOCK_T": 1, "APPLY_WARPS": 4, "WAVES": 2, "MIN_K_BLOCKS": 1}
_DECODE_90 = {**_DECODE_89, "GEMM_STAGES": 3}  # the only decode difference
# SEAM_*: the one-launch decode seam (mhc_fused_post_pre, T <= 64): cdiv(D, SEAM_BLOCK_D) column programs
#   + 1 Sinkhorn program per 16-token block, SEAM_WARPS warps each, a grid barrier between partials and
#   collapse (SEAM_LAUNCHES 2: the same kernel as two launches, no barrier); SEAM_PART_ELEMS bounds the
#   partial tile one phase-B load brings in (S x tokens x 16 fp32). Issue 20 candidates: the other
#   launchers read these rows as the decode row.
_SEAM = {"SEAM_BLOCK_D": 64, "SEAM_DOT_BLOCK_D": 32, "SEAM_WARPS": 4, "SEAM_LAUNCHES": 1, "SEAM_PART_ELEMS": 1024}
SEAM_ROWS = {
    "seam_d64": {},
    "seam_d32": {"SEAM_BLOCK_D": 32},         # 129 programs: one launch on 129+ SMs (H200 132), else two
}
# measured and dropped (H200, TP=4, p50 us at T=1/2/4/16, sm89 build; NOTES.md "mHC seam (issue 20, mhc5)"):
# seam_d64_w8 {"SEAM_WARPS": 8} 14.81/17.73/22.29/27.03, seam2_d64 {"SEAM_LAUNCHES": 2} 13.01/18.86/20.66/35.93
# SEAM1_*: the one-level seam (_mhc_seam1_kernel, 1-4 tokens; above, the two-pass `decode` kernels):
#   cdiv(D, SEAM1_BLOCK_D) column programs, SEAM1_WARPS warps each, one counter sync (SEAM1_LAUNCHES 2: the
#   same kernel as two launches); SEAM1_PART_ELEMS bounds the partial tile one phase-B load brings in.
_SEAM1 = {"SEAM1_BLOCK_D": 64, "SEAM1_WARPS": 4, "SEAM1_LAUNCHES": 1, "SEAM1_PART_ELEMS": 2048}
SEAM1_ROWS = {
    "seam1_d64": {},                          # 64 programs at D=4096: one launch on Ada's 128 SMs too
    # 128 programs: half the fn bytes per program, one launch on 128 SMs; 64-row partial loads (128: a 4 B
    # spill at T=1 with x2 on sm_89 / sm_90)
    "seam1_d32": {"SEAM1_BLOCK_D": 32, "SEAM1_PART_ELEMS": 1024},
    # the seam1_d64 math in two launches (what the counter sync costs); 64-row partial loads: 2048 spills
    # 4-8 B in its phase-2 kernel at T=2/4 (sm_89 / sm_90), so its partial sums group differently at T >= 2
    "seam1x2_d64": {"SEAM1_LAUNCHES": 2, "SEAM1_PART_ELEMS": 1024},
}
# SEAMR_*: the row-tile seam (_mhc_seam_rows_kernel, 1-16 tokens; above, the two-pass `decode` kernels):
#   cdiv(D, SEAMR_BLOCK_D) column programs per token block of SEAMR_BLOCK_M tokens, SEAMR_WARPS warps, one
#   counter per token block (one launch while the grid fits the resident programs; SEAMR_LAUNCHES 2: the same
#   kernel as two launches); SEAMR_PART_ROWS bounds the partial rows one phase-B load brings in.
_SEAMR = {"SEAMR_BLOCK_D": 64, "SEAMR_BLOCK_M": 4, "SEAMR_WARPS": 4, "SEAMR_LAUNCHES": 1, "SEAMR_PART_ROWS": 128}
SEAMR_ROWS = {
    "seamr_d64": {},                          # 64 programs a token block: T=16 is 4 x 64 = 256 (2 per SM)
    # 128 programs a token block: one wave of 128 / 132 SMs at T<=4, 256 at T=8; up to 8 tokens (at 16 its
    # 512 programs take two launches, whose phase-A kernel spills 8 B with x2 on sm_89)
    "seamr_d32": {"SEAMR_BLOCK_D": 32, "SEAMR_MAX_T": 8},
    # 8 warps over 128 columns: T=16 is 4 x 32 = 128 programs, one a SM (8-token blocks, 2 x 64 programs at
    # 4 warps: 16 B spill on sm_89, ptxas hoists all 8 tokens' loads)
    "seamr_d128w8": {"SEAMR_BLOCK_D": 128, "SEAMR_WARPS": 8},
}
# SEAMT_*: the token-parallel seam (_mhc_seam_tok_kernel, 1-SEAMT_MAX_T tokens; issue 20, mhc16): phase A in
#   SEAMT_BLOCK_M-token (tl.dot) x SEAMT_BLOCK_D-column programs, one counter sync for the grid, phase B as
#   (token, column chunk) tasks over every program (Sinkhorn per token in parallel); SEAMT_PART_ROWS bounds the
#   partial rows one phase-B load brings in. seamt_d32 is the sm_89 table's default at 5-16 tokens (SEAM_DEFAULTS).
_SEAMT = {"SEAMT_BLOCK_M": 16, "SEAMT_BLOCK_D": 64, "SEAMT_WARPS": 4, "SEAMT_LAUNCHES": 1, "SEAMT_PART_ROWS": 64}
SEAMT_ROWS = {
    # 128 programs a 16-token block: T=32 is 256 (2 a SM); sm_89 168-220 registers, 0 spills
    "seamt_d32": {"SEAMT_BLOCK_D": 32},
    # not rows (sm_89, ds4lab aot, quant_out, T=2 / 32): 64-column programs spill at 255 registers, 4 warps
    # 28 / 40 B, 8 warps ({"SEAMT_BLOCK_D": 64, "SEAMT_WARPS": 8}) 44 / 20 B
}
CONFIGS = {
    "sm_89": {
        "decode": _DECODE_89,
        "prefill": _PREFILL_89,
        # candidates (H200 run 4; never picked by pick_config): the prefill row with one change each.
        # fused pass 1 at 1 CTA/SM (228 regs x 256 threads on sm_90): smaller tiles, more programs in flight
        # fused_m32 / fused_m32_waves8 (sm_90 table) spill 36/28 B on sm_89 (ds4lab aot): not listed here
        "fused_m64k16": {**_PREFILL_89, "POST_BLOCK_M": 64, "POST_BLOCK_K": 16, "POST_WARPS": 4, "WAVES": 4},
        # gemm_waves8 / gemm_m32 (pre-norm GEMM, T=4096): 124.6 / 155.1 us vs prefill 118.9 (H200 run 4): dropped
        **{k: {**_DECODE_89, **_SEAM, **v} for k, v in SEAM_ROWS.items()},
        **{k: {**_DECODE_89, **_SEAM1, **v} for k, v in SEAM1_ROWS.items()},
        **{k: {**_DECODE_89, **_SEAMR, **v} for k, v in SEAMR_ROWS.items()},
        **{k: {**_DECODE_89, **_SEAMT, **v} for k, v in SEAMT_ROWS.items()},
    },
    "sm_90": {
        "decode": _DECODE_90,
        "prefill": _PREFILL_90,
        # candidates (H200 run 4; never picked by pick_config): the prefill row with one change each.
        # fused pass 1 at 1 CTA/SM (228 regs x 256 threads on sm_90): smaller tiles, more programs in flight
        # fused_m32 / fused_m32_waves8 spill 16/8 B on sm_90a too (ds4lab aot): out of the table; their H200
        # run-4 rows stay in results/bench.csv
        "fused_m64k16": {**_PREFILL_90, "POST_BLOCK_M": 64, "POST_BLOCK_K": 16, "POST_WARPS": 4, "WAVES": 4},
        # gemm_waves8 / gemm_m32 (pre-norm GEMM, T=4096): 124.6 / 155.1 us vs prefill 118.9 (H200 run 4): dropped
        **{k: {**_DECODE_90, **_SEAM, **v} for k, v in SEAM_ROWS.items()},
        **{k: {**_DECODE_90, **_SEAM1, **v} for k, v in SEAM1_ROWS.items()},
        # seamr_d32 spills 4 B on sm_90a at T=8 (ptxas stops at 128 registers; 151 / 0 on sm_89): not listed
        **{k: {**_DECODE_90, **_SEAMR, **v} for k, v in SEAMR_ROWS.items() if k != "seamr_d32"},
        **{k: {**_DECODE_90, **_SEAMT, **v} for k, v in SEAMT_ROWS.items()},
    },
}
