"""Routed MoE experts, W4A16: compressed-tensors pack-quantized INT4 weights, bf16 activations.

Semantics: vLLM ``fused_moe`` with the compressed-tensors WNA16 MoE method (Marlin / Triton
``fused_moe_kernel_gptq_awq`` on sm_89) for DeepSeek-V4 experts, and the community checkpoint
``canada-quant/DeepSeek-V4-Flash-W4A16-FP8-MTP`` layout (SPEC.md §1): ``w13 [E, 2I, D/8]`` int32
(rows ``[0, I)`` gate = ``w1``, ``[I, 2I)`` up = ``w3``), ``w2 [E, D, I/8]`` int32; 8 nibbles per
int32 along K, nibble j (bits 4j..4j+3) is element 8c+j, value ``nibble - 8`` (uint4b8, symmetric);
one scale per 128 K-elements ``[E, N, K/128]``. Activation ``silu(min(g, 10)) * clamp(u, -10, 10)``
(vLLM ``SiluAndMulWithClamp``); output ``sum_j topk_weights[t, j] * expert_{ids[t,j]}(x_t)``.

Two paths, both deterministic (no atomics; fixed-order reductions):
- decode (few tokens, no sort): gate_up as a batched GEMV, one program per (token-expert pair,
  row tile, K split), nibbles dequantized in registers, FMA with fp32 accumulation, one scale
  multiply per 128-group; the down kernel sums the K splits in order, applies the clamped SwiGLU
  and streams each touched expert's ``w2`` rows, summing the top-k in slot order.
- prefill (tokens grouped by expert): pairs sorted by expert id (torch, on device, no host sync),
  ragged ``BLOCK_M`` tiles per expert, ``tl.dot`` on bf16 with the integer nibbles as the B operand
  (exact in bf16) and the group scale applied to each 128-deep partial product in fp32; SwiGLU
  fused after gate_up, stored as fp16 (the clamp bounds |h| <= 10 * silu(10) < 100, so fp16 cannot
  overflow and keeps 3 more mantissa bits than bf16: a bf16 h costs ~2e-3 RMS relative error);
  the down kernel (fp16 x nibbles) scales by the routing weight; a reduce sums the top-k.

Decode variant "mma" (the GPU default, rows ``mma_*``): pairs grouped by expert in-kernel, nibbles
dequantized in registers straight into the tensor-core operand layout, split-K by last-arriver
tickets, 2 launches. Its options (rows ``mmaq_*``, issue 20 moe5): ``"deq": "asm"`` dequantizes two
words per packed PTX block (lop3 + ``fma.rn.bf16x2``/``f16x2``, exact; :data:`DEQ_ASM_BF16`);
``"hperm"`` / ``"xperm"`` keep h / a copy of x in plane order (within each 128-group element
``8c + j`` at ``16j + c``) so the A operand of each nibble plane is contiguous and cp.async-pipelined;
``"pb": "tight"`` scans 16 ids instead of 128 up to 16 pairs. Same operands, same dot order: the
results are bit-equal to the ``mma_*`` row of the same tiles.
"""
import os

import torch
import triton
import triton.language as tl

from . import _checks as check
from ._counters import zeroed_counters
from ._arch import arch_of

GROUP = 128
PACK = 8
# largest swiglu_limit L the fp16 h of the prefill path holds: |h| <= L * silu(L) ~ L^2 = 65,025 < 65,504
SWIGLU_LIMIT_MAX = 255.0


@triton.jit
def _unpack_kn(p, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 ``[BLOCK_K/8, BLOCK_N]`` -> signed nibble values ``[BLOCK_K, BLOCK_N]`` (fp32)."""
    shifts = tl.arange(0, 8) * 4
    q = (p[:, None, :] >> shifts[None, :, None]) & 0xF
    return tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32) - 8.0


@triton.jit
def _gemv_tile(w_ptr, s_ptr, row_off, s_row_off, rmask, xv, k0, stride_sk,
               BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """sum_k dequant(W[rows, k0:k0+BLOCK_K]) * x[k0:k0+BLOCK_K] -> fp32 ``[BLOCK_N]``.
    ``xv`` is x's chunk as ``[BLOCK_K/8, 8]`` (element 8c+j at [c, j])."""
    NC: tl.constexpr = BLOCK_K // 8
    NG: tl.constexpr = BLOCK_K // 128
    c = tl.arange(0, NC)
    p = tl.load(w_ptr + row_off[:, None] + (k0 // 8 + c)[None, :], mask=rmask[:, None], other=0)
    shifts = tl.arange(0, 8) * 4
    q = ((p[:, :, None] >> shifts[None, None, :]) & 0xF).to(tl.float32) - 8.0     # [N, NC, 8]
    part = tl.sum(q * xv[None, :, :], axis=2)                                     # [N, NC]
    part = tl.sum(tl.reshape(part, (BLOCK_N, NG, 16)), axis=2)                    # [N, NG]
    g = tl.arange(0, NG)
    s = tl.load(s_ptr + s_row_off[:, None] + (k0 // 128 + g)[None, :] * stride_sk,
                mask=rmask[:, None], other=0.0).to(tl.float32)
    return tl.sum(part * s, axis=1)


@triton.jit
def _swiglu(g, u, limit):
    """``silu(min(g, limit)) * clamp(u, -limit, limit)`` in fp32, NaN propagating."""
    # where, not minimum/maximum: NaN must propagate (PTX min/max drop a NaN operand)
    g = tl.where(g > limit, limit, g)
    u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _decode_w13_kernel(
    x_ptr, w_ptr, s_ptr, ids_ptr, part_ptr,
    N2, K, K_SPLIT, E,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_ps, stride_pp,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid ``(pairs, cdiv(2*inter, BLOCK_N), SPLIT_K)``.
    One program: one (token, expert) pair x BLOCK_N rows of w13 x one K split: fp32 partials.

    part[split, pair, n] = sum over this split's K of dequant(w13[e, n, :]) . x[t, :]."""
    pair = tl.program_id(0)
    nb = tl.program_id(1)
    split = tl.program_id(2)
    e = tl.load(ids_ptr + pair)
    if (e >= 0) & (e < E):
        t = pair // TOPK
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N2
        e64 = e.to(tl.int64)
        row_off = e64 * stride_we + rows.to(tl.int64) * stride_wn
        s_row_off = e64 * stride_se + rows.to(tl.int64) * stride_sn
        c = tl.arange(0, BLOCK_K // 8)
        j = tl.arange(0, 8)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        k_lo = split * K_SPLIT
        for kk in range(0, K_SPLIT, BLOCK_K):
            k0 = k_lo + kk
            xv = tl.load(x_ptr + t.to(tl.int64) * stride_xt + k0 + c[:, None] * 8 + j[None, :]).to(tl.float32)
            acc += _gemv_tile(w_ptr, s_ptr, row_off, s_row_off, rmask, xv, k0, stride_sk, BLOCK_K, BLOCK_N)
        tl.store(part_ptr + split * stride_ps + pair.to(tl.int64) * stride_pp + rows, acc, mask=rmask)


@triton.jit
def _decode_w2_kernel(
    part_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, out_ptr,
    N, I, SPLITS, E, limit,
    stride_ps, stride_pp, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_ot,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid ``(num_tokens, cdiv(hidden, BLOCK_N))``.
    One program: one token x BLOCK_N output columns, summed over its top-k experts in slot order.

    out[t, n] = sum_j w[t,j] * dequant(w2[e_j, n, :]) . swiglu(sum_split part[:, pair_j, :])."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    c = tl.arange(0, BLOCK_K // 8)
    j8 = tl.arange(0, 8)
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    # unrolled over the top-k with masks instead of branches, so the loads of all experts can be
    # in flight together; an invalid slot (id < 0 or >= E) loads nothing and adds exactly 0
    for slot in tl.static_range(TOPK):
        pair = t * TOPK + slot
        e = tl.load(ids_ptr + pair)
        valid = (e >= 0) & (e < E)
        e64 = tl.where(valid, e, 0).to(tl.int64)
        vmask = rmask & valid
        row_off = e64 * stride_we + rows.to(tl.int64) * stride_wn
        s_row_off = e64 * stride_se + rows.to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + c[:, None] * 8 + j8[None, :]
            gsum = tl.zeros([BLOCK_K // 8, 8], dtype=tl.float32)
            usum = tl.zeros([BLOCK_K // 8, 8], dtype=tl.float32)
            for sp in range(SPLITS):
                base = part_ptr + sp * stride_ps + pair.to(tl.int64) * stride_pp
                gsum += tl.load(base + kk, mask=valid, other=0.0)
                usum += tl.load(base + I + kk, mask=valid, other=0.0)
            hv = _swiglu(gsum, usum, limit)
            acc += _gemv_tile(w_ptr, s_ptr, row_off, s_row_off, vmask, hv, k0, stride_sk, BLOCK_K, BLOCK_N)
        wt = tl.load(tw_ptr + pair)
        out += tl.where(valid, wt * acc, 0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + rows, out.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _nib(p, J: tl.constexpr):
    """Nibble J of each int32 word as fp32 ``q - 8`` without an I2F (quarter rate on sm_89/sm_90):
    ``q | 0x4B000000`` is the float ``2^23 + q`` (exact), minus ``2^23 + 8`` (exact)."""
    q = ((p >> (4 * J)) & 0xF) | 0x4B000000
    return q.to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _decode_w13_h_kernel(
    x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr,
    I, KW, E, limit,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_hp,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid ``(pairs, cdiv(inter, BLOCK_N))``.
    One program: one (token, expert) pair x BLOCK_N columns of h (gate and up rows, whole K).

    Decode variant "h" (config ``"unpack": "2d"``): h[pair, n] = swiglu(gate_e[n] . x_t,
    up_e[n] . x_t) over the whole K (no K split: gate and up rows in one program, SwiGLU fused, no
    partials). The packed words stay in the 2-D ``[BLOCK_N, BLOCK_K/8]`` load layout (contiguous
    along K, vector loads); nibble j of every word is multiplied by x[8c+j] (8 FMAs per word, no 3-D
    broadcast, no layout conversion); group scales are gathered per word (L1 hits)."""
    pair = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(ids_ptr + pair)
    if (e >= 0) & (e < E):
        NC: tl.constexpr = BLOCK_K // 8
        t = pair // TOPK
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < I
        e64 = e.to(tl.int64)
        g_off = e64 * stride_we + rows.to(tl.int64) * stride_wn
        u_off = g_off + I * stride_wn
        gs_off = e64 * stride_se + rows.to(tl.int64) * stride_sn
        us_off = gs_off + I * stride_sn
        c = tl.arange(0, NC)
        x_row = x_ptr + t.to(tl.int64) * stride_xt
        acc_g = tl.zeros([BLOCK_N, NC], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, NC], dtype=tl.float32)
        for w0 in range(0, KW, NC):
            w0 = tl.multiple_of(w0, NC)
            pg = tl.load(w_ptr + g_off[:, None] + (w0 + c)[None, :], mask=rmask[:, None], other=0)
            pu = tl.load(w_ptr + u_off[:, None] + (w0 + c)[None, :], mask=rmask[:, None], other=0)
            ig = tl.zeros([BLOCK_N, NC], dtype=tl.float32)
            iu = tl.zeros([BLOCK_N, NC], dtype=tl.float32)
            for j in tl.static_range(8):
                xj = tl.load(x_row + (w0 + c) * 8 + j).to(tl.float32)[None, :]
                ig += _nib(pg, j) * xj
                iu += _nib(pu, j) * xj
            grp = ((w0 + c) // 16)[None, :] * stride_sk
            sg = tl.load(s_ptr + gs_off[:, None] + grp, mask=rmask[:, None], other=0.0).to(tl.float32)
            su = tl.load(s_ptr + us_off[:, None] + grp, mask=rmask[:, None], other=0.0).to(tl.float32)
            acc_g += ig * sg
            acc_u += iu * su
        h = _swiglu(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), limit)
        tl.store(h_ptr + pair.to(tl.int64) * stride_hp + rows, h, mask=rmask)


@triton.jit
def _decode_w2_h_kernel(
    h_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, out_ptr,
    N, IW, E,
    stride_hp, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_ot,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid ``(num_tokens, cdiv(hidden, BLOCK_N))``.
    One program: one token x BLOCK_N output columns over its top-k pairs' rows of h.

    Decode variant "h": out[t, n] = sum_j w[t,j] * dequant(w2[e_j, n, :]) . h[pair_j, :] (h from
    ``_decode_w13_h_kernel``: one fp32 row per pair, no split partials to re-sum per program),
    same 2-D nibble loop; top-k unrolled with masks, summed in slot order."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    NC: tl.constexpr = BLOCK_K // 8
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    c = tl.arange(0, NC)
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in tl.static_range(TOPK):
        pair = t * TOPK + slot
        e = tl.load(ids_ptr + pair)
        valid = (e >= 0) & (e < E)
        e64 = tl.where(valid, e, 0).to(tl.int64)
        vmask = rmask & valid
        row_off = e64 * stride_we + rows.to(tl.int64) * stride_wn
        s_row_off = e64 * stride_se + rows.to(tl.int64) * stride_sn
        h_row = h_ptr + pair.to(tl.int64) * stride_hp
        acc = tl.zeros([BLOCK_N, NC], dtype=tl.float32)
        for w0 in range(0, IW, NC):
            w0 = tl.multiple_of(w0, NC)
            p = tl.load(w_ptr + row_off[:, None] + (w0 + c)[None, :], mask=vmask[:, None], other=0)
            it = tl.zeros([BLOCK_N, NC], dtype=tl.float32)
            for j in tl.static_range(8):
                hj = tl.load(h_row + (w0 + c) * 8 + j, mask=valid, other=0.0)[None, :]
                it += _nib(p, j) * hj
            s = tl.load(s_ptr + s_row_off[:, None] + ((w0 + c) // 16)[None, :] * stride_sk,
                        mask=vmask[:, None], other=0.0).to(tl.float32)
            acc += it * s
        wt = tl.load(tw_ptr + pair)
        out += tl.where(valid, wt * tl.sum(acc, axis=1), 0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + rows, out.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _prefill_w13_kernel(
    x_ptr, w_ptr, s_ptr, order_ptr, tile_e_ptr, tile_r0_ptr, tile_n_ptr, h_ptr,
    I, K, limit,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_ht,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid ``(cdiv(pairs, BLOCK_M) + num_experts, cdiv(inter, BLOCK_N))`` (unused tail tiles exit).
    One program: one ragged tile of <= BLOCK_M expert-sorted pairs of one expert x BLOCK_N columns of h.

    h[r, n] (sorted pair order) = swiglu(x_t . gate_e[n], x_t . up_e[n]) for one expert tile."""
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    nrows = tl.load(tile_n_ptr + tile)
    if nrows > 0:
        e64 = tl.load(tile_e_ptr + tile).to(tl.int64)
        r0 = tl.load(tile_r0_ptr + tile)
        m = tl.arange(0, BLOCK_M)
        mmask = m < nrows
        pair = tl.load(order_ptr + r0 + m, mask=mmask, other=0)
        tok = (pair // TOPK).to(tl.int64)
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < I
        kc = tl.arange(0, BLOCK_K // 8)
        kx = tl.arange(0, BLOCK_K)
        g_off = e64 * stride_we + n.to(tl.int64)[None, :] * stride_wn + kc[:, None]
        u_off = g_off + I * stride_wn
        gs_off = e64 * stride_se + n.to(tl.int64) * stride_sn
        us_off = gs_off + I * stride_sn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(x_ptr + tok[:, None] * stride_xt + k0 + kx[None, :], mask=mmask[:, None], other=0.0)
            pg = tl.load(w_ptr + g_off + k0 // 8, mask=nmask[None, :], other=0)
            pu = tl.load(w_ptr + u_off + k0 // 8, mask=nmask[None, :], other=0)
            bg = _unpack_kn(pg, BLOCK_K, BLOCK_N).to(tl.bfloat16)
            bu = _unpack_kn(pu, BLOCK_K, BLOCK_N).to(tl.bfloat16)
            sg = tl.load(s_ptr + gs_off + (k0 // 128) * stride_sk, mask=nmask, other=0.0).to(tl.float32)
            su = tl.load(s_ptr + us_off + (k0 // 128) * stride_sk, mask=nmask, other=0.0).to(tl.float32)
            acc_g += tl.dot(a, bg) * sg[None, :]
            acc_u += tl.dot(a, bu) * su[None, :]
        h = _swiglu(acc_g, acc_u, limit)
        rows = (r0 + m).to(tl.int64)
        tl.store(h_ptr + rows[:, None] * stride_ht + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _prefill_w2_kernel(
    h_ptr, w_ptr, s_ptr, order_ptr, tw_ptr, tile_e_ptr, tile_r0_ptr, tile_n_ptr, y_ptr,
    N, I,
    stride_ht, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_yp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid ``(cdiv(pairs, BLOCK_M) + num_experts, cdiv(hidden, BLOCK_N))``.
    One program: one expert tile of sorted pairs x BLOCK_N columns of y (weighted down projection).

    y[pair, n] = topk_weight[pair] * (h[r] . down_e[n]) for one expert tile (r sorted order)."""
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    nrows = tl.load(tile_n_ptr + tile)
    if nrows > 0:
        e64 = tl.load(tile_e_ptr + tile).to(tl.int64)
        r0 = tl.load(tile_r0_ptr + tile)
        m = tl.arange(0, BLOCK_M)
        mmask = m < nrows
        rows = (r0 + m).to(tl.int64)
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        kc = tl.arange(0, BLOCK_K // 8)
        kx = tl.arange(0, BLOCK_K)
        w_off = e64 * stride_we + n.to(tl.int64)[None, :] * stride_wn + kc[:, None]
        s_off = e64 * stride_se + n.to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            a = tl.load(h_ptr + rows[:, None] * stride_ht + k0 + kx[None, :], mask=mmask[:, None], other=0.0)
            p = tl.load(w_ptr + w_off + k0 // 8, mask=nmask[None, :], other=0)
            b = _unpack_kn(p, BLOCK_K, BLOCK_N).to(tl.float16)
            s = tl.load(s_ptr + s_off + (k0 // 128) * stride_sk, mask=nmask, other=0.0).to(tl.float32)
            acc += tl.dot(a, b) * s[None, :]
        pair = tl.load(order_ptr + r0 + m, mask=mmask, other=0)
        wt = tl.load(tw_ptr + pair, mask=mmask, other=0.0)
        tl.store(y_ptr + pair.to(tl.int64)[:, None] * stride_yp + n[None, :], acc * wt[:, None],
                 mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _topk_sum_kernel(y_ptr, ids_ptr, out_ptr, T, N, E, stride_yp, stride_ot,
                     TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, ACCUM: tl.constexpr = 0):
    """Grid ``(cdiv(num_tokens, BLOCK_T), cdiv(hidden, BLOCK_N))``.
    One program: BLOCK_T tokens x BLOCK_N columns of out, summing their top-k rows of y.

    out[t, n] = sum_{j in slot order, ids[t,j] >= 0} y[t*TOPK+j, n] (rows of skipped pairs are
    never read: they were never written). ACCUM: ``out`` (fp32) += that sum instead."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tmask = t < T
    nmask = n < N
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for j in range(TOPK):
        pair = t.to(tl.int64) * TOPK + j
        e = tl.load(ids_ptr + pair, mask=tmask, other=-1)
        ok = tmask & (e >= 0) & (e < E)
        y = tl.load(y_ptr + pair[:, None] * stride_yp + n[None, :], mask=ok[:, None] & nmask[None, :], other=0.0)
        acc += y
    o_ptrs = out_ptr + t.to(tl.int64)[:, None] * stride_ot + n[None, :]
    if ACCUM:
        acc = tl.load(o_ptrs, mask=tmask[:, None] & nmask[None, :], other=0.0) + acc
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & nmask[None, :])


# ---- decode variant "mma": expert-grouped tensor-core dequant (issue 20) --------------------------
@triton.jit
def _expert_lead(ids_ptr, pair0, P, E, PB: tl.constexpr, BLOCK_M: tl.constexpr):
    """Pair ``pair0``'s expert ``e``, the ``[PB]`` pair indices ``q``, where they hold ``e`` (``match`` and as int32
    ``mi``), how many come before ``pair0`` (``before``), and whether ``pair0`` leads a tile (``lead``: a valid
    ``e`` and ``before`` a multiple of ``BLOCK_M``); shared by :func:`_expert_rows` and :func:`_expert_rows_loop`."""
    e = tl.load(ids_ptr + pair0)
    q = tl.arange(0, PB)
    idq = tl.load(ids_ptr + q, mask=q < P, other=-1)
    match = (idq == e) & (q < P)
    mi = match.to(tl.int32)
    before = tl.sum(tl.where(q < pair0, mi, 0), axis=0)
    lead = (e >= 0) & (e < E) & (before % BLOCK_M == 0)
    return e, q, match, mi, before, lead


@triton.jit
def _expert_rows(ids_ptr, pair0, P, E, TOPK: tl.constexpr, PB: tl.constexpr, BLOCK_M: tl.constexpr):
    """The (token, expert) pairs a decode program owns, found in-kernel without a sort.

    Program ``pair0`` leads a tile if its id ``e`` is valid and ``pair0`` is the
    ``(BLOCK_M * c)``-th occurrence of ``e`` among the ``P`` pairs (c = 0, 1, ...): it then owns the
    occurrences ``c*BLOCK_M .. c*BLOCK_M + BLOCK_M - 1`` of ``e`` (ascending pair order).
    Returns ``(lead, e, prow [BLOCK_M] pair index, mvalid [BLOCK_M])``; every valid pair is owned by
    exactly one leader, so each expert's weights are read once per ``BLOCK_M`` of its pairs."""
    e, q, match, mi, before, lead = _expert_lead(ids_ptr, pair0, P, E, PB, BLOCK_M)
    occ = tl.cumsum(mi, axis=0) - mi
    m = tl.arange(0, BLOCK_M)
    sel = match[None, :] & (occ[None, :] == (before + m)[:, None])
    prow = tl.sum(tl.where(sel, q[None, :], 0), axis=1)
    mvalid = tl.sum(sel.to(tl.int32), axis=1) > 0
    return lead, e, prow, mvalid


@triton.jit
def _expert_rows_loop(ids_ptr, pair0, P, E, PB: tl.constexpr, BLOCK_M: tl.constexpr):
    """:func:`_expert_rows` with the same result for a leader, found without the ``[BLOCK_M, PB]`` one-hot
    selection (issue 20 moe16: ~790 instructions a program at 192 pairs, before its first weight load).
    A leader ``pair0`` is itself occurrence ``before`` of its expert, so its rows are ``pair0`` and the next
    ``min(BLOCK_M, total - before) - 1`` matches after it, each one ``[PB]`` min-reduction (at decode sizes
    an expert has ~1-2 pairs: 0-1 steps). Non-leaders get ``mvalid`` all false (the kernels read nothing of
    a non-leader but ``lead``). ``prow`` is 0 where ``mvalid`` is false, as in :func:`_expert_rows`."""
    e, q, match, mi, before, lead = _expert_lead(ids_ptr, pair0, P, E, PB, BLOCK_M)
    nrows = tl.where(lead, tl.minimum(tl.sum(mi, axis=0) - before, BLOCK_M), 0)
    m = tl.arange(0, BLOCK_M)
    prow = tl.where(m == 0, pair0, 0)
    prev = pair0
    for r in range(1, nrows):
        prev = tl.min(tl.where(match & (q > prev), q, PB), axis=0)
        prow = tl.where(m == r, prev, prow)
    return lead, e, prow, m < nrows


@triton.jit
def _nib16(p, J: tl.constexpr, DT: tl.constexpr):
    """Nibble J of each word as ``q - 8`` in ``DT`` (bf16/fp16, exact), via the 2^23 bit trick."""
    q = ((p >> (4 * J)) & 0xF) | 0x4B000000
    return (q.to(tl.float32, bitcast=True) - 8388616.0).to(DT)


@triton.jit
def _mma_group(acc, a_row_ptr, a_stride, prow_a, mvalid, k0, p, DT: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc[m, n] += sum_{c<16, j<8} A[prow_a[m], k0 + 8c + j] * (nibble j of p[c, n] - 8) over one
    128-group: 8 tensor-core dots of K=16, the A columns gathered in the words' nibble order."""
    c = tl.arange(0, 16)
    for j in tl.static_range(8):
        a = tl.load(a_row_ptr + prow_a[:, None] * a_stride + k0 + c[None, :] * 8 + j, mask=mvalid[:, None],
                    other=0.0).to(DT)
        acc = tl.dot(a, _nib16(p, j, DT), acc)
    return acc


# int4 -> bf16/fp16, two words per asm instance (``pack=2``: element e0 in the low half of each
# output register, e1 in the high half): prmt gathers nibbles 0-3 (4-7) of both words into one
# register's halves, then per nibble j one shift + one lop3 ``(r >> 4j) & 0x000F000F | BIAS`` gives
# the packed pair ``BIAS + q`` exactly (bf16 0x4300 = 128, fp16 0x6400 = 1024, q in the low mantissa
# bits) and one packed fma ``x * 1 - (BIAS + 8)`` gives ``q - 8`` exactly: 24 instructions per 16
# nibbles (the fp32 path: ~4.3 per nibble: shift, bfe, or, fadd, half a cvt pack).
_DEQ_ASM = """{{
.reg .b32 lo, hi, t, one, neg;
mov.b32 one, {one};
mov.b32 neg, {neg};
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
lop3.b32 t, lo, 0x000F000F, {bias}, 0xea;
fma.rn.{ty}x2 $0, t, one, neg;
shr.u32 t, lo, 4;
lop3.b32 t, t, 0x000F000F, {bias}, 0xea;
fma.rn.{ty}x2 $1, t, one, neg;
shr.u32 t, lo, 8;
lop3.b32 t, t, 0x000F000F, {bias}, 0xea;
fma.rn.{ty}x2 $2, t, one, neg;
shr.u32 t, lo, 12;
lop3.b32 t, t, 0x000F000F, {bias}, 0xea;
fma.rn.{ty}x2 $3, t, one, neg;
lop3.b32 t, hi, 0x000F000F, {bias}, 0xea;
fma.rn.{ty}x2 $4, t, one, neg;
shr.u32 t, hi, 4;
lop3.b32 t, t, 0x000F000F, {bias}, 0xea;
fma.rn.{ty}x2 $5, t, one, neg;
shr.u32 t, hi, 8;
lop3.b32 t, t, 0x000F000F, {bias}, 0xea;
fma.rn.{ty}x2 $6, t, one, neg;
shr.u32 t, hi, 12;
lop3.b32 t, t, 0x000F000F, {bias}, 0xea;
fma.rn.{ty}x2 $7, t, one, neg;
}}"""
# bf16: 128 + q (0x4300 | q), minus 136 (0xC308); fp16: 1024 + q (0x6400 | q), minus 1032 (0xE408)
DEQ_ASM_BF16 = tl.constexpr(_DEQ_ASM.format(ty="bf16", bias="0x43004300", one="0x3F803F80", neg="0xC308C308"))
DEQ_ASM_FP16 = tl.constexpr(_DEQ_ASM.format(ty="f16", bias="0x64006400", one="0x3C003C00", neg="0xE408E408"))


@triton.jit
def _nib8(p, DT: tl.constexpr, ASM: tl.constexpr):
    """All 8 nibbles of each word as ``q - 8`` in ``DT`` (bf16/fp16, exact): a tuple of 8 tensors
    shaped like ``p``. ``ASM``: packed PTX (:data:`DEQ_ASM_BF16`), else the 2^23 bit trick in fp32
    (the interpreter, which runs no PTX)."""
    if ASM:
        if DT == tl.bfloat16:
            return tl.inline_asm_elementwise(DEQ_ASM_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [p],
                                             dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(DEQ_ASM_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [p],
                                             dtype=(tl.float16,) * 8, is_pure=True, pack=2)
    else:
        return (_nib16(p, 0, DT), _nib16(p, 1, DT), _nib16(p, 2, DT), _nib16(p, 3, DT),
                _nib16(p, 4, DT), _nib16(p, 5, DT), _nib16(p, 6, DT), _nib16(p, 7, DT))


@triton.jit
def _mma_group_q(acc, a_row_ptr, a_stride, prow_a, mvalid, k0, p, DT: tl.constexpr, ASM: tl.constexpr,
                 APERM: tl.constexpr = 0):
    """:func:`_mma_group` with the 8 nibble planes of ``p`` dequantized by :func:`_nib8`.
    ``APERM``: the A rows are stored in plane order (:func:`_plane_col`), so plane j's 16 columns
    are contiguous (32 B per row: cp.async-pipelinable) instead of a stride-8 gather."""
    c = tl.arange(0, 16)
    b = _nib8(p, DT, ASM)
    for j in tl.static_range(8):
        if APERM:
            col = k0 + j * 16 + c
        else:
            col = k0 + c * 8 + j
        a = tl.load(a_row_ptr + prow_a[:, None] * a_stride + col[None, :], mask=mvalid[:, None],
                    other=0.0).to(DT)
        acc = tl.dot(a, b[j], acc)
    return acc


@triton.jit
def _plane_col(n):
    """Column of element ``n`` of a 128-grouped row stored in plane order: within each group,
    element ``8c + j`` (word c, nibble j of the weight it multiplies) at ``16j + c``."""
    return (n // 128) * 128 + (n % 8) * 16 + (n % 128) // 8


@triton.jit
def _w13_groups(w_ptr, s_ptr, a_ptr, a_stride, x_ptr, stride_xt, e, n, tok, mvalid, g_lo, g_hi, I,
                stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DEQ: tl.constexpr, ASM: tl.constexpr,
                XPERM: tl.constexpr):
    """gate/up partial sums of one w13 tile over the 128-groups ``[g_lo, g_hi)``: ``(acc_g, acc_u)``, fp32
    ``[BLOCK_M, BLOCK_N]`` (rows ``tok`` of the A operand ``a_ptr``, columns ``n`` and ``n + I`` of expert ``e``)."""
    e64 = e.to(tl.int64)
    c = tl.arange(0, 16)
    g_off = e64 * stride_we + n.to(tl.int64)[None, :] * stride_wn + c[:, None]
    u_off = g_off + I * stride_wn
    gs_off = e64 * stride_se + n.to(tl.int64) * stride_sn
    us_off = gs_off + I * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(g_lo, g_hi):
        pg = tl.load(w_ptr + g_off + g * 16)
        pu = tl.load(w_ptr + u_off + g * 16)
        sg = tl.load(s_ptr + gs_off + g * stride_sk).to(tl.float32)
        su = tl.load(s_ptr + us_off + g * stride_sk).to(tl.float32)
        zg = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        zu = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if DEQ:
            zg = _mma_group_q(zg, a_ptr, a_stride, tok, mvalid, g * 128, pg, tl.bfloat16, ASM, XPERM)
            zu = _mma_group_q(zu, a_ptr, a_stride, tok, mvalid, g * 128, pu, tl.bfloat16, ASM, XPERM)
        else:
            zg = _mma_group(zg, x_ptr, stride_xt, tok, mvalid, g * 128, pg, tl.bfloat16, BLOCK_M)
            zu = _mma_group(zu, x_ptr, stride_xt, tok, mvalid, g * 128, pu, tl.bfloat16, BLOCK_M)
        acc_g += zg * sg[None, :]
        acc_u += zu * su[None, :]
    return acc_g, acc_u


@triton.jit
def _w13_finish(acc_g, acc_u, h_ptr, part_ptr, cnt_ptr, cidx, split, nsplit, prow, mvalid, n, I, limit,
                stride_hp, stride_ps, stride_pp, SMAX: tl.constexpr, HPERM: tl.constexpr):
    """The w13 tile's epilogue. ``SMAX == 1``: h = swiglu(gate, up) stored fp16 ``h[pair, n]``. Else fp32 partials
    ``part[split, pair, :]``, a ticket on counter ``cnt_ptr + cidx``; the last of the ``nsplit`` (<= SMAX) programs sums
    the partials in split order (deterministic; every split's loads in flight up to 4 splits, then 4 at a time), applies the SwiGLU, stores h and resets the
    counter to 0. Returns whether this program stored h (always with ``SMAX == 1``)."""
    p64 = prow.to(tl.int64)
    smask = mvalid[:, None] & (n < I)[None, :]
    if HPERM:  # h in plane order: the w2 kernel's A loads are contiguous
        hcol = _plane_col(n)
    else:
        hcol = n
    done = True
    if SMAX == 1:
        h = _swiglu(acc_g, acc_u, limit)
        tl.store(h_ptr + p64[:, None] * stride_hp + hcol[None, :], h.to(tl.float16), mask=smask)
    else:
        base = part_ptr + p64[:, None] * stride_pp + n[None, :]
        tl.store(base + split * stride_ps, acc_g, mask=smask)
        tl.store(base + split * stride_ps + I, acc_u, mask=smask)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + cidx, 1, sem="acq_rel", scope="gpu")
        done = ticket == nsplit - 1
        if done:
            gs = tl.zeros(acc_g.shape, dtype=tl.float32)
            us = tl.zeros(acc_u.shape, dtype=tl.float32)
            if SMAX <= 4:
                for s in tl.static_range(SMAX):
                    gs += tl.load(base + s * stride_ps, mask=smask & (s < nsplit), other=0.0, cache_modifier=".cg")
                    us += tl.load(base + s * stride_ps + I, mask=smask & (s < nsplit), other=0.0, cache_modifier=".cg")
            else:   # 4 splits' loads in flight at a time (all SMAX at once: ~16 fp32 tiles of registers)
                for s0 in range(0, nsplit, 4):
                    for j in tl.static_range(4):
                        sm = smask & (s0 + j < nsplit)
                        gs += tl.load(base + (s0 + j) * stride_ps, mask=sm, other=0.0, cache_modifier=".cg")
                        us += tl.load(base + (s0 + j) * stride_ps + I, mask=sm, other=0.0, cache_modifier=".cg")
            h = _swiglu(gs, us, limit)
            tl.store(h_ptr + p64[:, None] * stride_hp + hcol[None, :], h.to(tl.float16), mask=smask)
            tl.atomic_xchg(cnt_ptr + cidx, 0, sem="relaxed", scope="gpu")
    return done


@triton.jit
def _dec_mma_w13_kernel(
    x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, part_ptr, cnt_ptr, xs_ptr,
    P, I, E, limit,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_hp, stride_ps, stride_pp,
    K: tl.constexpr, SPLIT: tl.constexpr, TOPK: tl.constexpr, PB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DEQ: tl.constexpr = 0, ASM: tl.constexpr = 0,
    HPERM: tl.constexpr = 0, XPERM: tl.constexpr = 0, SCAN: tl.constexpr = 0,
):
    """Grid ``(pairs, inter / BLOCK_N, SPLIT)``.
    One program (a leader, see ``_expert_rows``): up to BLOCK_M pairs of one expert x BLOCK_N gate
    columns and the same BLOCK_N up columns x one K split.

    gate/up[m, n] = sum_k x[tok_m, k] * dequant(w13[e, n (+I), k]) on tensor cores (bf16 x exact
    bf16 nibbles, fp32 accumulation, scale per 128-group in fp32). SPLIT == 1: h = swiglu(gate, up)
    stored fp16 ``h[pair, n]``. SPLIT > 1: fp32 partials ``part[split, pair, :]``, then a ticket
    (atomic counter per (leader, column block)); the last of the SPLIT programs sums the partials
    in split order (deterministic), applies the SwiGLU, stores h and resets the counter to 0
    (:func:`_w13_finish`).

    XPERM (needs DEQ): the program first copies its x rows' K split into ``xs [tokens, K]`` in plane
    order (:func:`_plane_col`) and reads the A operand from there (contiguous 32 B rows, pipelined
    like the weights) instead of 8 stride-8 gathers per group. Every program touching a token
    writes the same values (a benign race: identical bytes); each reads only what its own threads
    wrote before its barrier."""
    pair0 = tl.program_id(0)
    nb = tl.program_id(1)
    split = tl.program_id(2)
    if SCAN:   # moe16: the leader's rows by a short loop instead of the one-hot selection (same rows)
        lead, e, prow, mvalid = _expert_rows_loop(ids_ptr, pair0, P, E, PB, BLOCK_M)
    else:
        lead, e, prow, mvalid = _expert_rows(ids_ptr, pair0, P, E, TOPK, PB, BLOCK_M)
    if lead:
        KS: tl.constexpr = K // SPLIT
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        tok = (prow // TOPK).to(tl.int64)
        if XPERM:
            # one contiguous load + a permuted store per valid row (the valid rows are a prefix of the
            # tile: at decode sizes usually 1 of 16)
            kq = split * KS + tl.arange(0, KS)
            pc = _plane_col(kq)
            m_ar = tl.arange(0, BLOCK_M)
            for m in range(tl.sum(mvalid.to(tl.int32), axis=0)):
                t_m = tl.sum(tl.where(m_ar == m, tok, 0), axis=0)
                tl.store(xs_ptr + t_m * K + pc, tl.load(x_ptr + t_m * stride_xt + kq))
            tl.debug_barrier()
            a_ptr = xs_ptr
            a_stride = K
        else:
            a_ptr = x_ptr
            a_stride = stride_xt
        acc_g, acc_u = _w13_groups(w_ptr, s_ptr, a_ptr, a_stride, x_ptr, stride_xt, e, n, tok, mvalid,
                                   split * (KS // 128), (split + 1) * (KS // 128), I,
                                   stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                                   BLOCK_M, BLOCK_N, DEQ, ASM, XPERM)
        _w13_finish(acc_g, acc_u, h_ptr, part_ptr, cnt_ptr, pair0 * tl.num_programs(1) + nb, split, SPLIT, prow,
                    mvalid, n, I, limit, stride_hp, stride_ps, stride_pp, SPLIT, HPERM)


@triton.jit
def _moe_tiles(ids_ptr, P, E, PB: tl.constexpr, BLOCK_M: tl.constexpr, CH: tl.constexpr):
    """Every tile of the ``P`` pairs at once (the persistent kernels' schedule), no sort: pair ``q`` leads a tile
    when its id is valid (``0 <= id < E``) and it is occurrence ``c * BLOCK_M`` of its expert (the tiles of
    :func:`_expert_rows`). Returns ``(key [PB], n_tiles)``: ``key[q]`` the tile index of leader ``q`` (tiles in
    ascending leader order), -1 for the other pairs. Occurrences come from a ``[PB, CH]`` comparison per ``CH``
    pairs (``PB * PB`` in all)."""
    q = tl.arange(0, PB)
    idq = tl.load(ids_ptr + q, mask=q < P, other=-1)
    valid = (idq >= 0) & (idq < E) & (q < P)
    occ = tl.zeros([PB], dtype=tl.int32)
    for r0 in tl.static_range(0, PB, CH):
        r = r0 + tl.arange(0, CH)
        idr = tl.load(ids_ptr + r, mask=r < P, other=-2)
        occ += tl.sum(((idr[None, :] == idq[:, None]) & (r[None, :] < q[:, None])).to(tl.int32), axis=1)
    li = (valid & (occ % BLOCK_M == 0)).to(tl.int32)
    return tl.where(li > 0, tl.cumsum(li, axis=0) - li, -1), tl.sum(li, axis=0)


@triton.jit
def _pick_splits(tiles_nb, nprog, G: tl.constexpr, SMAX: tl.constexpr, OVH: tl.constexpr):
    """The K split count ``S`` in 1..SMAX of a persistent launch's w13 units: the ``S`` minimising
    ``ceil(tiles_nb * S / nprog) * (ceil(G / S) + OVH)`` (``tiles_nb`` tile-column blocks, ``nprog`` programs, ``G``
    128-groups, ``OVH`` a unit's fixed cost in groups), ties to fewer splits."""
    S = 1
    best = (tiles_nb + nprog - 1) // nprog * (G + OVH)
    for s in tl.static_range(2, SMAX + 1):
        cost = (tiles_nb * s + nprog - 1) // nprog * ((G + s - 1) // s + OVH)
        S = tl.where(cost < best, s, S)
        best = tl.minimum(cost, best)
    return S


@triton.jit
def _w13_unit(w, S, key, x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, part_ptr, cnt_ptr, xs_ptr, P, I, E, limit, NB,
              stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_hp, stride_ps, stride_pp,
              K: tl.constexpr, SMAX: tl.constexpr, TOPK: tl.constexpr, PB: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DEQ: tl.constexpr, ASM: tl.constexpr,
              HPERM: tl.constexpr, XPERM: tl.constexpr, XCH: tl.constexpr):
    """w13 unit ``w`` of a persistent launch: (tile ``w // (NB * S)``, column block, split ``w % S``) of
    :func:`_dec_mma_w13_kernel`'s tiles (``key``: :func:`_moe_tiles`). Split ``s`` of ``S`` covers the 128-groups
    ``[s*G//S, (s+1)*G//S)``; the last of the tile's ``S`` programs reduces the partials (:func:`_w13_finish`).
    Returns ``(tile, done)``: ``done`` when this program stored the tile column block's h."""
    G: tl.constexpr = K // 128
    per_tile = NB * S
    ti = w // per_tile
    nb = (w % per_tile) // S
    split = w % S
    pair0 = tl.sum(tl.where(key == ti, tl.arange(0, PB), 0), axis=0)
    _, e, prow, mvalid = _expert_rows_loop(ids_ptr, pair0, P, E, PB, BLOCK_M)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    tok = (prow // TOPK).to(tl.int64)
    g_lo = split * G // S
    g_hi = (split + 1) * G // S
    if XPERM:
        m_ar = tl.arange(0, BLOCK_M)
        for m in range(tl.sum(mvalid.to(tl.int32), axis=0)):
            t_m = tl.sum(tl.where(m_ar == m, tok, 0), axis=0)
            for k0 in range(g_lo * 128, g_hi * 128, XCH):
                kq = k0 + tl.arange(0, XCH)
                km = kq < g_hi * 128
                tl.store(xs_ptr + t_m * K + _plane_col(kq), tl.load(x_ptr + t_m * stride_xt + kq, mask=km),
                         mask=km)
        tl.debug_barrier()
        a_ptr = xs_ptr
        a_stride = K
    else:
        a_ptr = x_ptr
        a_stride = stride_xt
    acc_g, acc_u = _w13_groups(w_ptr, s_ptr, a_ptr, a_stride, x_ptr, stride_xt, e, n, tok, mvalid, g_lo, g_hi, I,
                               stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                               BLOCK_M, BLOCK_N, DEQ, ASM, XPERM)
    done = _w13_finish(acc_g, acc_u, h_ptr, part_ptr, cnt_ptr, pair0 * NB + nb, split, S, prow, mvalid, n, I, limit,
                       stride_hp, stride_ps, stride_pp, SMAX, HPERM)
    return ti, done


@triton.jit
def _dec_mma_w13_persist_kernel(
    x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, part_ptr, cnt_ptr, xs_ptr,
    P, I, E, limit, NB,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_hp, stride_ps, stride_pp,
    K: tl.constexpr, SMAX: tl.constexpr, TOPK: tl.constexpr, PB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DEQ: tl.constexpr, ASM: tl.constexpr,
    HPERM: tl.constexpr, XPERM: tl.constexpr, OVH: tl.constexpr, CH: tl.constexpr, XCH: tl.constexpr,
):
    """Grid ``(programs,)`` (one wave: SMs x resident CTAs; issue 20, session 17).
    One program loops over units (tile, column block, split) of :func:`_dec_mma_w13_kernel`'s tiles, without that
    kernel's grid of one program per (pair, column block, split). Every program builds the tile list
    (:func:`_moe_tiles`), picks the K split count ``S`` (1..SMAX) that fits the work into the programs best
    (:func:`_pick_splits`), then loops over the units (:func:`_w13_unit`) from its own index in steps of the grid.
    The same rows, columns and arithmetic as the grid kernel; the bits depend on ``S``, so on how many tiles the
    batch's routing makes (deterministic for a given batch; permuting its tokens changes no bits). The x copy
    (XPERM) covers the unit's groups in XCH-column chunks."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    key, n_tiles = _moe_tiles(ids_ptr, P, E, PB, BLOCK_M, CH)
    S = _pick_splits(n_tiles * NB, nprog, K // 128, SMAX, OVH)
    for w in range(pid, n_tiles * NB * S, nprog):
        _w13_unit(w, S, key, x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, part_ptr, cnt_ptr, xs_ptr, P, I, E, limit, NB,
                  stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_hp, stride_ps, stride_pp,
                  K, SMAX, TOPK, PB, BLOCK_M, BLOCK_N, DEQ, ASM, HPERM, XPERM, XCH)


@triton.jit
def _w2_tile(h_ptr, w_ptr, s_ptr, e, prow, mvalid, n, stride_hp, stride_we, stride_wn, stride_se, stride_sn,
             stride_sk, IK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DEQ: tl.constexpr,
             ASM: tl.constexpr, HPERM: tl.constexpr):
    """y[pair_m, n] = sum_k h[pair_m, k] * dequant(w2[e, n, k]) over the ``IK`` inputs of one w2 tile: fp32
    ``[BLOCK_M, BLOCK_N]`` (fp16 h x exact fp16 nibbles on tensor cores, scale per 128-group)."""
    e64 = e.to(tl.int64)
    c = tl.arange(0, 16)
    w_off = e64 * stride_we + n.to(tl.int64)[None, :] * stride_wn + c[:, None]
    s_off = e64 * stride_se + n.to(tl.int64) * stride_sn
    p64 = prow.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, IK // 128):
        p = tl.load(w_ptr + w_off + g * 16)
        s = tl.load(s_ptr + s_off + g * stride_sk).to(tl.float32)
        z = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if DEQ:
            z = _mma_group_q(z, h_ptr, stride_hp, p64, mvalid, g * 128, p, tl.float16, ASM, HPERM)
        else:
            z = _mma_group(z, h_ptr, stride_hp, p64, mvalid, g * 128, p, tl.float16, BLOCK_M)
        acc += z * s[None, :]
    return acc


@triton.jit
def _topk_sum_block(y_ptr, ids_ptr, tw_ptr, out_ptr, T, E, n, nmask, stride_yp, stride_ot,
                    TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, ACCUM: tl.constexpr):
    """out[t, n] = sum_{j in slot order, valid ids} topk_weights[t, j] * y[t*TOPK + j, n] for every token and the
    columns ``n`` (skipped pairs never read; y read past L1). ACCUM: ``out`` (fp32) += that sum."""
    for t0 in range(0, T, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        tmask = tt < T
        o = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            pr = tt.to(tl.int64) * TOPK + j
            eid = tl.load(ids_ptr + pr, mask=tmask, other=-1)
            ok = tmask & (eid >= 0) & (eid < E)
            yv = tl.load(y_ptr + pr[:, None] * stride_yp + n[None, :], mask=ok[:, None] & nmask[None, :],
                         other=0.0, cache_modifier=".cg")
            wt = tl.load(tw_ptr + pr, mask=ok, other=0.0)
            o += tl.where(ok[:, None], wt[:, None] * yv, 0.0)
        o_ptrs = out_ptr + tt.to(tl.int64)[:, None] * stride_ot + n[None, :]
        if ACCUM:
            o = tl.load(o_ptrs, mask=tmask[:, None] & nmask[None, :], other=0.0) + o
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & nmask[None, :])


@triton.jit
def _dec_mma_fused_kernel(
    x_ptr, w_ptr, s_ptr, w2_ptr, s2_ptr, ids_ptr, tw_ptr, h_ptr, part_ptr, y_ptr, out_ptr, cnt_ptr, cnt2_ptr,
    rdy_ptr, xs_ptr,
    T, P, I, N, E, limit, NB, NB2,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
    stride_w2e, stride_w2n, stride_s2e, stride_s2n, stride_s2k,
    stride_hp, stride_ps, stride_pp, stride_yp, stride_ot,
    K: tl.constexpr, IK: tl.constexpr, SMAX: tl.constexpr, TOPK: tl.constexpr, PB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_T: tl.constexpr,
    DEQ: tl.constexpr, ASM: tl.constexpr, HPERM: tl.constexpr, XPERM: tl.constexpr, ACCUM: tl.constexpr,
    OVH: tl.constexpr, CH: tl.constexpr, XCH: tl.constexpr,
):
    """Grid ``(programs,)``: the whole decode MoE in one launch, every program resident at once (issue 20, session 18).
    One program loops over units, tile-major, from its index in steps of the grid: first the w13 units of
    :func:`_dec_mma_w13_persist_kernel` (:func:`_w13_unit`, the split count by :func:`_pick_splits`), then one w2
    unit per (tile, column block of BLOCK_N2 hidden columns). The program that stores a tile column block's h
    bumps the tile's ready counter ``rdy[tile]`` (release); a w2 unit spins on it (acquire) until all ``NB`` column
    blocks are in, then computes its y tile (:func:`_w2_tile`, the grid w2 kernel's arithmetic) and takes a ticket
    on its column block's counter: the last of the ``tiles`` w2 units of a column block writes its top-k sum
    (:func:`_topk_sum_block`). Deadlock-free: a program only waits for units of lower index, which resident
    programs reach first. Counters: ``rdy[tile]`` and the tile's w2 consumer count ``rdy[P + tile]`` are reset by
    the tile's last w2 unit, the others as in the two-launch rows; all are 0 again when the launch ends."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    key, n_tiles = _moe_tiles(ids_ptr, P, E, PB, BLOCK_M, CH)
    S = _pick_splits(n_tiles * NB, nprog, K // 128, SMAX, OVH)
    u13 = n_tiles * NB * S
    if not ACCUM:
        if n_tiles == 0:   # no valid id: no w2 unit takes a ticket; the top-k sums (zeros) are still written
            for nb2 in range(pid, NB2, nprog):
                n = nb2 * BLOCK_N2 + tl.arange(0, BLOCK_N2)
                _topk_sum_block(y_ptr, ids_ptr, tw_ptr, out_ptr, T, E, n, n < N, stride_yp, stride_ot,
                                TOPK, BLOCK_T, BLOCK_N2, ACCUM)
    for u in range(pid, u13 + n_tiles * NB2, nprog):
        if u < u13:
            ti, done = _w13_unit(u, S, key, x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, part_ptr, cnt_ptr, xs_ptr, P, I, E,
                                 limit, NB, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                                 stride_hp, stride_ps, stride_pp, K, SMAX, TOPK, PB, BLOCK_M, BLOCK_N, DEQ, ASM,
                                 HPERM, XPERM, XCH)
            if done:
                tl.debug_barrier()
                tl.atomic_add(rdy_ptr + ti, 1, sem="release", scope="gpu")
        else:
            v = u - u13
            ti = v // NB2
            nb2 = v % NB2
            pair0 = tl.sum(tl.where(key == ti, tl.arange(0, PB), 0), axis=0)
            _, e, prow, mvalid = _expert_rows_loop(ids_ptr, pair0, P, E, PB, BLOCK_M)
            n = nb2 * BLOCK_N2 + tl.arange(0, BLOCK_N2)
            nmask = n < N
            ready = tl.atomic_add(rdy_ptr + ti, 0, sem="acquire", scope="gpu")
            while ready < NB:
                ready = tl.atomic_add(rdy_ptr + ti, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
            acc = _w2_tile(h_ptr, w2_ptr, s2_ptr, e, prow, mvalid, n, stride_hp, stride_w2e, stride_w2n, stride_s2e,
                           stride_s2n, stride_s2k, IK, BLOCK_M, BLOCK_N2, DEQ, ASM, HPERM)
            tl.store(y_ptr + prow.to(tl.int64)[:, None] * stride_yp + n[None, :], acc,
                     mask=mvalid[:, None] & nmask[None, :])
            tl.debug_barrier()
            ticket = tl.atomic_add(cnt2_ptr + nb2, 1, sem="acq_rel", scope="gpu")
            if ticket == n_tiles - 1:
                _topk_sum_block(y_ptr, ids_ptr, tw_ptr, out_ptr, T, E, n, nmask, stride_yp, stride_ot,
                                TOPK, BLOCK_T, BLOCK_N2, ACCUM)
                tl.atomic_xchg(cnt2_ptr + nb2, 0, sem="relaxed", scope="gpu")
            if tl.atomic_add(rdy_ptr + P + ti, 1, sem="relaxed", scope="gpu") == NB2 - 1:
                tl.atomic_xchg(rdy_ptr + ti, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(rdy_ptr + P + ti, 0, sem="relaxed", scope="gpu")


@triton.jit
def _dec_mma_w2_kernel(
    h_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, y_ptr, out_ptr, cnt_ptr,
    T, P, N, E,
    stride_hp, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_yp, stride_ot,
    IK: tl.constexpr, TOPK: tl.constexpr, PB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    DEQ: tl.constexpr = 0, ASM: tl.constexpr = 0, HPERM: tl.constexpr = 0, ACCUM: tl.constexpr = 0,
    SCAN: tl.constexpr = 0,
):
    """Grid ``(pairs, hidden / BLOCK_N)``.
    One program (a leader, ``_expert_rows``): up to BLOCK_M pairs of one expert x BLOCK_N columns: y[pair_m, n] =
    sum_k h[pair_m, k] * dequant(w2[e, n, k]) on tensor cores (fp16 h x exact fp16 nibbles, fp32
    accumulation, scale per group), stored fp32. Every program (leader or not) then takes a ticket
    on its column block's counter; the last of the ``pairs`` programs writes
    out[t, n] = sum_{j in slot order, valid ids} topk_weights[t, j] * y[t*TOPK + j, n] for every
    token (skipped pairs never read) and resets the counter: the top-k sum without a third launch.
    ACCUM: ``out`` (fp32) += that sum instead."""
    pair0 = tl.program_id(0)
    nb = tl.program_id(1)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    if SCAN:
        lead, e, prow, mvalid = _expert_rows_loop(ids_ptr, pair0, P, E, PB, BLOCK_M)
    else:
        lead, e, prow, mvalid = _expert_rows(ids_ptr, pair0, P, E, TOPK, PB, BLOCK_M)
    if lead:
        acc = _w2_tile(h_ptr, w_ptr, s_ptr, e, prow, mvalid, n, stride_hp, stride_we, stride_wn, stride_se, stride_sn,
                       stride_sk, IK, BLOCK_M, BLOCK_N, DEQ, ASM, HPERM)
        tl.store(y_ptr + prow.to(tl.int64)[:, None] * stride_yp + n[None, :], acc, mask=mvalid[:, None] & nmask[None, :])
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + nb, 1, sem="acq_rel", scope="gpu")
    if ticket == P - 1:
        _topk_sum_block(y_ptr, ids_ptr, tw_ptr, out_ptr, T, E, n, nmask, stride_yp, stride_ot, TOPK, BLOCK_T, BLOCK_N,
                        ACCUM)
        tl.atomic_xchg(cnt_ptr + nb, 0, sem="relaxed", scope="gpu")


# ---- launchers ------------------------------------------------------------------------------------
def _check_weights(name, packed, scale, E, N, K, x):
    check.tensor(f"{name}_packed", packed, torch.int32)  # 8 nibbles per word
    if packed.dim() != 3 or tuple(packed.shape[1:]) != (N, K // PACK) or packed.shape[0] != E:
        raise ValueError(f"{name}_packed: shape {tuple(packed.shape)}, expected ({E}, {N}, {K // PACK})")
    check.last_dim_contiguous(f"{name}_packed", packed)
    check.tensor(f"{name}_scale", scale, (torch.bfloat16, torch.float16, torch.float32))
    if scale.dim() != 3 or tuple(scale.shape) != (E, N, K // GROUP):
        raise ValueError(f"{name}_scale: shape {tuple(scale.shape)}, expected ({E}, {N}, {K // GROUP}) "
                         f"(one scale per {GROUP} K-elements)")
    check.same_device("x", x, **{f"{name}_packed": packed, f"{name}_scale": scale})


def fused_moe_w4a16(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor,
                    w2_packed: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, swiglu_limit: float = 10.0, config: dict | None = None,
                    out: torch.Tensor | None = None, workspace: dict | None = None, accumulate: bool = False):
    """Routed experts of one MoE layer: ``out[t] = sum_j topk_weights[t,j] * FFN_{topk_ids[t,j]}(x[t])``
    (``accumulate``: ``out[t] += ...`` into a float32 ``out``).

    ``FFN_e(x) = W2_e (silu(min(W1_e x, L)) * clamp(W3_e x, -L, L))`` with INT4 weights
    dequantized as ``(nibble - 8) * scale[group]`` and fp32 accumulation.

    Args:
        x: ``(num_tokens, hidden)`` bfloat16, row-contiguous (``stride(1) == 1``).
        w13_packed: ``(num_experts, 2 * inter, hidden / 8)`` int32, compressed-tensors
            pack-quantized (nibble j of word c = element 8c+j, value nibble-8); rows ``[0, inter)``
            are the gate (``w1``), ``[inter, 2*inter)`` the up projection (``w3``).
        w13_scale: ``(num_experts, 2 * inter, hidden / 128)`` bf16/fp16/fp32 group scales.
        w2_packed: ``(num_experts, hidden, inter / 8)`` int32; w2_scale ``(num_experts, hidden, inter / 128)``.
        topk_weights: ``(num_tokens, topk)`` float32 contiguous (from ``sqrtsoftplus_topk``).
        topk_ids: ``(num_tokens, topk)`` int32 contiguous; ids < 0 are skipped (padding tokens,
            invalid hash entries), and so are ids ``>= num_experts`` (checked in-kernel, no host sync).
        swiglu_limit: the clamp ``L`` (DeepSeek-V4: 10.0): a positive normal float32 <= 255 (the
            bound that keeps the prefill path's fp16 ``h`` finite).
        config: a row of ``CONFIGS``; ``config["path"]`` is ``"decode"`` or ``"prefill"``;
            default: decode for ``num_tokens * topk <= DECODE_MAX_PAIRS`` (256) pairs, prefill above.
        out: optional ``(num_tokens, hidden)`` bfloat16 output (overwritten); with ``accumulate``
            required: ``(num_tokens, hidden)`` float32, row-contiguous, holding what the experts add to
            (the model: the shared expert's fp32 down projection).
        accumulate: add into ``out`` instead of overwriting it: the mma decode rows and prefill add
            one fp32 top-k sum per element in their last launch, the older decode variants compute
            their result then add it once (deterministic either way).
        workspace: optional dict of preallocated buffers (tests fill them with NaN to prove that
            padding rows never reach valid rows): decode ``{"part": fp32 (splits, pairs, 2*inter)}``
            (variant "mma" also ``"h"`` fp16 (pairs, inter), ``"y"`` fp32 (pairs, hidden),
            ``"counters"`` zeroed int32, ``"xs"`` bf16 (tokens, hidden) with ``"xperm"``);
            prefill ``{"h": fp16 (>= pairs, inter), "y": fp32 (pairs, hidden)}``.

    Returns:
        ``(num_tokens, hidden)`` bfloat16. Deterministic; each (token, expert) pair is computed
        independently of the other tokens, so permuting the tokens permutes the output rows
        bit-for-bit (same config). A token whose ids are all < 0 gets zeros; an expert no token
        picked is never read. The decode path is CUDA-graph safe (no host sync, fixed grid).

    Raises:
        TypeError / ValueError: dtypes, shapes, strides, devices, ``hidden``/``inter`` not multiples
        of 128, unknown ``config["path"]``.
    """
    check.tensor("x", x, torch.bfloat16)
    if x.dim() != 2:
        raise ValueError(f"x: expected (num_tokens, hidden), got shape {tuple(x.shape)}")
    T, D = x.shape
    check.last_dim_contiguous("x", x)
    if D % GROUP:
        raise ValueError(f"x: hidden={D} is not a multiple of the {GROUP}-element quant group")
    dev = x.device
    check.tensor("w13_packed", w13_packed, torch.int32)
    if w13_packed.dim() != 3:
        raise ValueError(f"w13_packed: expected (num_experts, 2*inter, hidden/8), got {getattr(w13_packed, 'shape', None)}")
    E, N2 = w13_packed.shape[0], w13_packed.shape[1]
    if N2 % 2:
        raise ValueError(f"w13_packed: {N2} rows is not 2*inter")
    I = N2 // 2
    if I % GROUP or I == 0:
        raise ValueError(f"w13_packed: inter={I} is not a positive multiple of {GROUP}")
    _check_weights("w13", w13_packed, w13_scale, E, N2, D, x)
    _check_weights("w2", w2_packed, w2_scale, E, D, I, x)
    check.tensor("topk_ids", topk_ids, torch.int32)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids: expected contiguous ({T}, topk), got shape {tuple(topk_ids.shape)}")
    K_TOP = topk_ids.shape[1]
    check.tensor("topk_weights", topk_weights, torch.float32)
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights: expected contiguous {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    check.same_device("x", x, topk_ids=topk_ids, topk_weights=topk_weights)
    limit = check.fp32_scalar("swiglu_limit", swiglu_limit, positive=True)
    if limit > SWIGLU_LIMIT_MAX:
        raise ValueError(f"swiglu_limit={swiglu_limit!r}: at most {SWIGLU_LIMIT_MAX} (the prefill path keeps "
                         f"h = silu(min(g, L)) * clamp(u, -L, L) in fp16, |h| <= L * silu(L) < 65504)")
    if accumulate:
        if out is None:
            raise ValueError("out: accumulate=True needs the float32 (num_tokens, hidden) tensor to add into")
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
            raise TypeError(f"out: accumulate=True needs a float32 tensor, got {getattr(out, 'dtype', type(out).__name__)}")
        if tuple(out.shape) != (T, D) or (T and out.stride(1) != 1) or out.device != dev:
            raise ValueError(f"out: expected float32 ({T}, {D}) row-contiguous on {dev}, got {tuple(out.shape)} "
                             f"strides {tuple(out.stride())} on {out.device}")
    elif out is None:
        out = torch.empty((T, D), dtype=torch.bfloat16, device=dev)
    elif out.dtype != torch.bfloat16 or out.shape != (T, D) or (T and out.stride(1) != 1) or out.device != dev:
        raise ValueError(f"out: expected bfloat16 ({T}, {D}) row-contiguous on {dev}")
    if T == 0 or K_TOP == 0:
        return out if accumulate else out.zero_()
    cfg = config or pick_config(T * K_TOP, dev)
    path = cfg.get("path")
    if path == "decode":
        _decode(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, limit, cfg,
                out, workspace, accumulate)
    elif path == "prefill":
        _prefill(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, limit, cfg,
                 out, workspace, accumulate)
    else:
        raise ValueError(f"config['path']={path!r}: expected 'decode' or 'prefill'")
    return out


def _decode(x, w13p, w13s, w2p, w2s, tw, ids, limit, cfg, out, workspace, accumulate=False):
    T, D = x.shape
    E, N2 = w13p.shape[:2]
    I = N2 // 2
    K_TOP = ids.shape[1]
    P = T * K_TOP
    if cfg.get("variant") == "mma":
        return _decode_mma(x, w13p, w13s, w2p, w2s, tw, ids, limit, cfg, out, workspace, accumulate)
    if accumulate:   # the older decode variants (table rows, never defaults): their result, then one add
        y = torch.empty((T, D), dtype=torch.float32, device=x.device)
        _decode(x, w13p, w13s, w2p, w2s, tw, ids, limit, cfg, y, workspace)
        return out.add_(y)
    if cfg.get("unpack") == "2d":
        return _decode_h(x, w13p, w13s, w2p, w2s, tw, ids, limit, cfg, out, workspace)
    BK1, BK2 = min(cfg["BLOCK_K"], D), min(cfg["BLOCK_K2"], I)  # small (test) shapes
    if BK1 % GROUP or D % BK1 or BK2 % GROUP or I % BK2:
        raise ValueError(f"config: BLOCK_K={BK1}/BLOCK_K2={BK2} must be multiples of {GROUP} dividing "
                         f"hidden={D}/inter={I}")
    splits = cfg.get("SPLIT_K", 1)
    while splits > 1 and D % (splits * BK1):
        splits //= 2
    part = (workspace or {}).get("part")
    if part is None:
        part = torch.empty((splits, P, N2), dtype=torch.float32, device=x.device)
    elif part.dtype != torch.float32 or tuple(part.shape) != (splits, P, N2) or part.stride(2) != 1:
        raise ValueError(f"workspace['part']: expected float32 ({splits}, {P}, {N2})")
    _decode_w13_kernel[(P, triton.cdiv(N2, cfg["BLOCK_N"]), splits)](
        x, w13p, w13s, ids, part, N2, D, D // splits, E,
        x.stride(0), w13p.stride(0), w13p.stride(1), w13s.stride(0), w13s.stride(1), w13s.stride(2),
        part.stride(0), part.stride(1),
        TOPK=K_TOP, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=BK1, num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 2))
    _decode_w2_kernel[(T, triton.cdiv(D, cfg["BLOCK_N2"]))](
        part, w2p, w2s, ids, tw, out, D, I, splits, E, float(limit),
        part.stride(0), part.stride(1), w2p.stride(0), w2p.stride(1), w2s.stride(0), w2s.stride(1),
        w2s.stride(2), out.stride(0),
        TOPK=K_TOP, BLOCK_N=cfg["BLOCK_N2"], BLOCK_K=BK2, num_warps=cfg["num_warps2"],
        num_stages=cfg.get("num_stages", 2))


def _decode_h(x, w13p, w13s, w2p, w2s, tw, ids, limit, cfg, out, workspace):
    """Decode variant "h" (candidate configs ``*_2d``): gate+up+SwiGLU per row tile over the whole K
    into ``h [pairs, inter]`` fp32, then the down projection reading h (2 launches, no K split)."""
    T, D = x.shape
    E, N2 = w13p.shape[:2]
    I = N2 // 2
    K_TOP = ids.shape[1]
    P = T * K_TOP
    BK1, BK2 = min(cfg["BLOCK_K"], D), min(cfg["BLOCK_K2"], I)  # small (test) shapes
    if BK1 % GROUP or D % BK1 or BK2 % GROUP or I % BK2:
        raise ValueError(f"config: BLOCK_K={BK1}/BLOCK_K2={BK2} must be multiples of {GROUP} dividing "
                         f"hidden={D}/inter={I}")
    h = (workspace or {}).get("h")
    if h is None:
        h = torch.empty((P, I), dtype=torch.float32, device=x.device)
    elif h.dtype != torch.float32 or tuple(h.shape) != (P, I) or h.stride(1) != 1:
        raise ValueError(f"workspace['h']: expected float32 ({P}, {I})")
    _decode_w13_h_kernel[(P, triton.cdiv(I, cfg["BLOCK_N"]))](
        x, w13p, w13s, ids, h, I, D // PACK, E, float(limit),
        x.stride(0), w13p.stride(0), w13p.stride(1), w13s.stride(0), w13s.stride(1), w13s.stride(2),
        h.stride(0),
        TOPK=K_TOP, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=BK1, num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 2))
    _decode_w2_h_kernel[(T, triton.cdiv(D, cfg["BLOCK_N2"]))](
        h, w2p, w2s, ids, tw, out, D, I // PACK, E,
        h.stride(0), w2p.stride(0), w2p.stride(1), w2s.stride(0), w2s.stride(1), w2s.stride(2),
        out.stride(0),
        TOPK=K_TOP, BLOCK_N=cfg["BLOCK_N2"], BLOCK_K=BK2, num_warps=cfg["num_warps2"],
        num_stages=cfg.get("num_stages", 2))
    return out


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


COUNTER_SLOTS = 1 << 16


def _counters(dev, n: int) -> torch.Tensor:
    """Zeroed int32 ticket counters of this module on ``dev`` (:func:`ds4lab_kernels._counters.zeroed_counters`:
    the kernels reset every counter they use before they finish; launches of one device must be stream-ordered)."""
    return zeroed_counters("moe_w4a16", dev, n, COUNTER_SLOTS)


#: programs of a persistent w13 launch in the interpreter (no device to size a wave on): few, so each loops. The
#: fused launch (``"sched": "fused"``) runs one there: the interpreter runs programs one after another, and a w2 unit
#: waits for w13 units of later programs
INTERP_PERSIST_PROGRAMS = 3
_PROPS: dict = {}
REGS_PER_SM = 65536   # sm_89 and sm_90
#: shared memory the driver reserves per CTA (sm_80 on), bytes
SMEM_RESERVED_PER_CTA = 1024


def _props(dev: torch.device):
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _PROPS:
        _PROPS[key] = torch.cuda.get_device_properties(key)
    return _PROPS[key]


def persist_programs(dev: torch.device, cfg: dict, fused: bool = False, compiled=None) -> int:
    """Programs of a ``"sched": "persist"`` or ``"fused"`` launch: the device's SMs x the CTAs an SM holds at once,
    so every program is resident from the start. ``compiled`` (the binary about to run, from :func:`_compiled`; the
    launcher passes it on every eager call, since Triton specialises by T, accumulate and shapes): what its
    registers, shared memory and threads allow (:func:`resident_ctas`), at most ``cfg["CTAS"]`` (default 4).
    CUDA-graph safe: a graph replays the wave its capture computed. Off a GPU or in the interpreter:
    :data:`INTERP_PERSIST_PROGRAMS`, 1 when ``fused``.

    Raises ValueError when a CUDA launch passes no ``compiled``."""
    if dev.type != "cuda" or _interpreting():
        return 1 if fused else INTERP_PERSIST_PROGRAMS
    if compiled is None:
        raise ValueError("compiled: a CUDA persistent launch sizes its wave from the binary about to run")
    props = _props(dev)
    return props.multi_processor_count * _fit(props, cfg, compiled)


def _fit(props, cfg: dict, compiled) -> int:
    smem = getattr(getattr(compiled, "metadata", None), "shared", 0) or 0
    return resident_ctas(compiled.n_regs, 32 * cfg["num_warps"], smem,
                         getattr(props, "shared_memory_per_multiprocessor", 0),
                         getattr(props, "max_threads_per_multi_processor", 0), cfg.get("CTAS", 4))


def resident_ctas(regs: int, threads: int, smem: int, smem_per_sm: int, max_threads: int, ctas: int) -> int:
    """CTAs of a kernel an SM holds at once, at most ``ctas`` and at least 1: ``regs`` registers a thread (allocated
    in units of 8: 256 a warp) x ``threads`` threads a CTA against :data:`REGS_PER_SM`; ``smem`` bytes a CTA plus
    :data:`SMEM_RESERVED_PER_CTA` against ``smem_per_sm``; ``threads`` against ``max_threads`` a SM (0: not known,
    not checked)."""
    fit = REGS_PER_SM // (-(-regs // 8) * 8 * threads)
    if smem and smem_per_sm:
        fit = min(fit, smem_per_sm // (smem + SMEM_RESERVED_PER_CTA))
    if max_threads:
        fit = min(fit, max_threads // threads)
    return max(1, min(ctas, fit))


def _compiled(kernel, args, meta):
    """``kernel`` compiled for ``args`` / ``meta`` without launching it, its registers known (Triton's ``warmup``)."""
    ck = kernel.warmup(*args, grid=(1,), **meta)
    if getattr(ck, "n_regs", None) is None or not ck.n_regs:
        ck._init_handles()
    return ck


def _launch_wave(kernel, args, meta, dev, cfg: dict, fused: bool = False) -> None:
    """Launch a ``"persist"`` / ``"fused"`` kernel as one wave: on a GPU the binary about to run is compiled first
    (:func:`_compiled`) and sizes the grid (:func:`persist_programs`)."""
    ck = _compiled(kernel, args, meta) if dev.type == "cuda" and not _interpreting() else None
    kernel[(persist_programs(dev, cfg, fused=fused, compiled=ck),)](*args, **meta)


def _decode_mma(x, w13p, w13s, w2p, w2s, tw, ids, limit, cfg, out, workspace, accumulate=False):
    """Decode variant "mma" (candidate configs ``mma_*``): pairs grouped by expert in-kernel, int4
    dequantized to bf16/fp16 in registers and multiplied on tensor cores (BLOCK_M 16 pairs of one
    expert per tile); w13 split-K reduced and SwiGLU applied by the last program of each tile
    (tickets), w2 with the weighted top-k sum done by the last program per column block. 2 launches."""
    T, D = x.shape
    E, N2 = w13p.shape[:2]
    I = N2 // 2
    K_TOP = ids.shape[1]
    P = T * K_TOP
    BN, BN2, BM = min(cfg["BLOCK_N"], I), min(cfg["BLOCK_N2"], D), 16
    if I % BN or D % BN2 or BN < 16 or BN2 < 16:
        raise ValueError(f"config: BLOCK_N={BN} / BLOCK_N2={BN2} must be >= 16 and divide inter={I} / hidden={D}")
    sched = cfg.get("sched", "grid")
    if sched not in ("grid", "persist", "fused"):
        raise ValueError(f"config['sched']={sched!r}: expected 'grid', 'persist' or 'fused'")
    splits = cfg.get("SPLIT_K", 1)
    if sched != "grid":   # uneven splits: any count up to one 128-group each
        splits = min(splits, D // GROUP)
    else:
        while splits > 1 and D % (splits * GROUP):
            splits //= 2
    ws = workspace or {}
    dev = x.device

    def buf(name, shape, dtype):
        b = ws.get(name)
        if b is None:
            return torch.empty(shape, dtype=dtype, device=dev)
        if b.dtype != dtype or tuple(b.shape) != tuple(shape) or not b.is_contiguous():
            raise ValueError(f"workspace[{name!r}]: expected contiguous {dtype} {tuple(shape)}")
        return b
    h = buf("h", (P, I), torch.float16)
    y = buf("y", (P, D), torch.float32)
    part = buf("part", (splits, P, N2), torch.float32) if splits > 1 else h
    nb1, nb2 = I // BN, D // BN2
    # w13 split tickets (pair x column block), w2 tickets (column block); "fused": + ready / consumer counts (2 x tile)
    n_cnt = P * nb1 + nb2 + (2 * P if sched == "fused" else 0)
    cnt = ws.get("counters")
    if cnt is None:
        cnt = _counters(dev, n_cnt)
    elif cnt.dtype != torch.int32 or cnt.numel() < n_cnt:
        raise ValueError(f"workspace['counters']: expected zeroed int32 with >= {n_cnt} elements")
    cnt13, cnt2, rdy = cnt, cnt[P * nb1:], cnt[P * nb1 + nb2:]
    # PB: the id vector _expert_rows scans. 128: one specialisation for every decode batch; "pb":
    # "tight" (mmaq_*x): 16 up to 16 pairs (T <= 2: a [16, 16] scan instead of [16, 128], the prologue
    # every program runs before its first weight load), 128 above (2 specialisations)
    PB = 16 if (cfg.get("pb") == "tight" and P <= 16) else max(128, triton.next_power_of_2(P))
    # "deq": "asm" (candidates mmaq_*): packed PTX dequant; the interpreter runs no PTX and takes the
    # same values from the fp32 bit trick (exact either way)
    deq = 1 if cfg.get("deq") == "asm" else 0
    asm = deq and not _interpreting()
    # "hperm": 1: h stored in plane order (_plane_col; the w2 A operand contiguous); needs deq
    hperm = 1 if (deq and cfg.get("hperm")) else 0
    # "xperm": 1: x copied per program into xs in plane order (the w13 A operand contiguous); needs deq
    xperm = 1 if (deq and cfg.get("xperm")) else 0
    xs = buf("xs", (T, D), torch.bfloat16) if xperm else x
    # "scan": "loop" (moe16): each program finds its rows by a short loop (_expert_rows_loop), not the
    # [16, PB] one-hot selection; the same rows, so the same bits
    scan = {"onehot": 0, "loop": 1}.get(cfg.get("scan", "onehot"))
    if scan is None:
        raise ValueError(f"config['scan']={cfg.get('scan')!r}: expected 'onehot' or 'loop'")
    sk = {"SCAN": 1} if scan else {}   # absent when 0: the old rows' kernels compile exactly as before
    if sched == "fused":
        if cfg["num_warps"] != cfg["num_warps2"]:
            raise ValueError(f"config: sched 'fused' runs w13 and w2 in one launch: num_warps={cfg['num_warps']} "
                             f"must equal num_warps2={cfg['num_warps2']}")
        args = (x, w13p, w13s, w2p, w2s, ids, tw, h, part, y, out, cnt13, cnt2, rdy, xs if xperm else x,
                T, P, I, D, E, float(limit), nb1, nb2,
                x.stride(0), w13p.stride(0), w13p.stride(1), w13s.stride(0), w13s.stride(1), w13s.stride(2),
                w2p.stride(0), w2p.stride(1), w2s.stride(0), w2s.stride(1), w2s.stride(2),
                h.stride(0), part.stride(0) if splits > 1 else 0, part.stride(1) if splits > 1 else 0,
                y.stride(0), out.stride(0))
        meta = dict(K=D, IK=I, SMAX=splits, TOPK=K_TOP, PB=PB, BLOCK_M=BM, BLOCK_N=BN, BLOCK_N2=BN2,
                    BLOCK_T=cfg.get("BLOCK_T", 16), DEQ=deq, ASM=asm, HPERM=hperm, XPERM=xperm,
                    ACCUM=1 if accumulate else 0, OVH=cfg.get("OVH", 4), CH=min(PB, 32), XCH=512,
                    num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 2))
        if cfg.get("maxnreg"):   # ptxas's register cap (.maxnreg): the two halves' union would hold fewer CTAs an SM
            meta["maxnreg"] = cfg["maxnreg"]
        # a w2 unit spins until its tile's h is in: every program must be resident, so the binary about to run (its
        # registers and shared memory; specialisations differ by T, accumulate, shapes) sizes the wave on every call
        _launch_wave(_dec_mma_fused_kernel, args, meta, dev, cfg, fused=True)
        return out
    if sched == "persist":
        # one wave of programs looping over (tile, column block, split) units; the split count 1..SPLIT_K is
        # picked in-kernel from the tile count (_dec_mma_w13_persist_kernel)
        args = (x, w13p, w13s, ids, h, part, cnt13, xs, P, I, E, float(limit), nb1,
                x.stride(0), w13p.stride(0), w13p.stride(1), w13s.stride(0), w13s.stride(1), w13s.stride(2),
                h.stride(0), part.stride(0) if splits > 1 else 0, part.stride(1) if splits > 1 else 0)
        meta = dict(K=D, SMAX=splits, TOPK=K_TOP, PB=PB, BLOCK_M=BM, BLOCK_N=BN, DEQ=deq, ASM=asm, HPERM=hperm,
                    XPERM=xperm, OVH=cfg.get("OVH", 4), CH=min(PB, 32), XCH=512,
                    num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 2))
        # no program waits on another here; one wave all the same (_launch_wave)
        _launch_wave(_dec_mma_w13_persist_kernel, args, meta, dev, cfg)
    else:
        _dec_mma_w13_kernel[(P, nb1, splits)](
            x, w13p, w13s, ids, h, part, cnt13, xs, P, I, E, float(limit),
            x.stride(0), w13p.stride(0), w13p.stride(1), w13s.stride(0), w13s.stride(1), w13s.stride(2),
            h.stride(0), part.stride(0) if splits > 1 else 0, part.stride(1) if splits > 1 else 0,
            K=D, SPLIT=splits, TOPK=K_TOP, PB=PB, BLOCK_M=BM, BLOCK_N=BN, DEQ=deq, ASM=asm, HPERM=hperm,
            XPERM=xperm, **sk, num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 2))
    _dec_mma_w2_kernel[(P, nb2)](
        h, w2p, w2s, ids, tw, y, out, cnt2, T, P, D, E,
        h.stride(0), w2p.stride(0), w2p.stride(1), w2s.stride(0), w2s.stride(1), w2s.stride(2),
        y.stride(0), out.stride(0),
        IK=I, TOPK=K_TOP, PB=PB, BLOCK_M=BM, BLOCK_N=BN2, BLOCK_T=cfg.get("BLOCK_T", 16), DEQ=deq, ASM=asm,
        HPERM=hperm, ACCUM=1 if accumulate else 0, **sk,
        num_warps=cfg["num_warps2"], num_stages=cfg.get("num_stages", 2))
    return out


def moe_tile_schedule(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Group (token, slot) pairs by expert into ragged ``block_m`` tiles, on the ids' device with no
    host sync. Returns ``order`` (pairs sorted by expert, stable: within an expert, ascending pair
    index), and per tile ``expert``, ``row0`` (first sorted position) and ``rows`` (0 for the unused
    tail of the fixed-size grid ``cdiv(pairs, block_m) + num_experts``)."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    P = flat.numel()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True).indices.to(torch.int32)
    # scatter_add, not bincount: CUDA bincount reads max() back to the host (a sync)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]
    start = torch.cumsum(counts, 0) - counts
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    n_grid = triton.cdiv(P, block_m) + num_experts
    i = torch.arange(n_grid, device=dev)
    ex = torch.searchsorted(tile_end, i, right=True)
    valid = ex < num_experts
    exc = ex.clamp(max=num_experts - 1)
    local = i - (tile_end[exc] - tiles[exc])
    row0 = start[exc] + local * block_m
    rows = torch.where(valid, (counts[exc] - local * block_m).clamp(0, block_m), torch.zeros_like(i))
    return order, exc.to(torch.int32), row0.to(torch.int32), rows.to(torch.int32)


def _prefill(x, w13p, w13s, w2p, w2s, tw, ids, limit, cfg, out, workspace, accumulate=False):
    T, D = x.shape
    E, N2 = w13p.shape[:2]
    I = N2 // 2
    K_TOP = ids.shape[1]
    P = T * K_TOP
    BM, BK = cfg["BLOCK_M"], cfg["BLOCK_K"]
    if BK > GROUP or GROUP % BK:
        raise ValueError(f"config: BLOCK_K={BK} must divide {GROUP} (one scale per K tile)")
    order, tile_e, tile_r0, tile_n = moe_tile_schedule(ids, E, BM)
    n_grid = tile_n.numel()
    ws = workspace or {}
    h = ws.get("h")
    if h is None:
        h = torch.empty((P, I), dtype=torch.float16, device=x.device)
    elif h.dtype != torch.float16 or h.shape[0] < P or h.shape[1] != I or h.stride(1) != 1:
        raise ValueError(f"workspace['h']: expected float16 (>= {P}, {I})")
    y = ws.get("y")
    if y is None:
        y = torch.empty((P, D), dtype=torch.float32, device=x.device)
    elif y.dtype != torch.float32 or tuple(y.shape) != (P, D) or y.stride(1) != 1:
        raise ValueError(f"workspace['y']: expected float32 ({P}, {D})")
    _prefill_w13_kernel[(n_grid, triton.cdiv(I, cfg["BLOCK_N"]))](
        x, w13p, w13s, order, tile_e, tile_r0, tile_n, h, I, D, float(limit),
        x.stride(0), w13p.stride(0), w13p.stride(1), w13s.stride(0), w13s.stride(1), w13s.stride(2), h.stride(0),
        TOPK=K_TOP, BLOCK_M=BM, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=BK,
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 2))
    _prefill_w2_kernel[(n_grid, triton.cdiv(D, cfg["BLOCK_N2"]))](
        h, w2p, w2s, order, tw, tile_e, tile_r0, tile_n, y, D, I,
        h.stride(0), w2p.stride(0), w2p.stride(1), w2s.stride(0), w2s.stride(1), w2s.stride(2), y.stride(0),
        BLOCK_M=BM, BLOCK_N=cfg["BLOCK_N2"], BLOCK_K=BK,
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 2))
    BT, BN = cfg.get("SUM_T", 4), cfg.get("SUM_N", 512)
    _topk_sum_kernel[(triton.cdiv(T, BT), triton.cdiv(D, BN))](
        y, ids, out, T, D, E, y.stride(0), out.stride(0), TOPK=K_TOP, BLOCK_T=BT, BLOCK_N=BN,
        ACCUM=1 if accumulate else 0, num_warps=4)


# ---- config table ------------------------------------------------------------------------------
# decode: w13 GEMV tiles BLOCK_N rows x BLOCK_K (one int32 = 8 K-elements; BLOCK_K/128 scale groups
#   per step), SPLIT_K programs per row tile so that even T=1 puts ~1-2k programs in flight;
#   w2 GEMV BLOCK_N2 rows x BLOCK_K2. No shared memory (register GEMV).
# prefill: BLOCK_M x BLOCK_N bf16 tl.dot tiles, BLOCK_K = 64/128 (one scale group per K step);
#   shared memory per stage (BM*BK*2 + BK/8*BN*4*2) is small: the B operand is 1/4 the bf16 bytes.
# decode rows: the same values in both tables
# one row per older decode variant (neither is a default since H200 run 5; the rows measured losing at
# every T were removed by moe5: decode_wide, decode_n8, decode_2d, decode_2d_w8, mma_n16s8, mma_n32s1,
# their numbers are in NOTES "W4A16 MoE decode bandwidth (issue 20, moe5)")
_DECODE = {
    # the FMA GEMV variant (the sm_89 default until run 5)
    "decode": {"path": "decode", "BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 4, "num_warps": 4,
               "BLOCK_N2": 16, "BLOCK_K2": 256, "num_warps2": 4},
    # decode variant "h" (unpack 2d: words kept in their 2-D load layout, nibbles via the 2^23 bit
    # trick instead of I2F, gate+up+SwiGLU in one program over the whole K, w2 reads h instead of
    # re-summing split partials per program; the sm_90 default from run 4 to run 5)
    "decode_2d_n8": {"path": "decode", "unpack": "2d", "BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4,
                     "BLOCK_N2": 16, "BLOCK_K2": 512, "num_warps2": 4, "num_stages": 3},
    # candidates (issue 20, H200 run 5): decode variant "mma" (pairs grouped by expert in-kernel,
    # BLOCK_M 16, nibbles -> bf16/fp16 in registers, tl.dot; split-K + SwiGLU by the last program
    # of each tile; w2 + weighted top-k sum by the last program per column block; 2 launches)
    "mma_n32s4": {"path": "decode", "variant": "mma", "BLOCK_N": 32, "SPLIT_K": 4, "num_warps": 4,
                  "BLOCK_N2": 32, "num_warps2": 4, "num_stages": 3},
    "mma_n64s2": {"path": "decode", "variant": "mma", "BLOCK_N": 64, "SPLIT_K": 2, "num_warps": 4,
                  "BLOCK_N2": 64, "num_warps2": 4, "num_stages": 3},
    # candidates (issue 20, moe5; NOTES "W4A16 MoE decode bandwidth (issue 20, moe5)"): the mma variant
    # with the packed PTX dequant ("deq": "asm"); "x" rows add the tight id scan ("pb"), h stored in plane
    # order ("hperm": the w2 A operand contiguous) and x copied in plane order ("xperm": the w13 A operand
    # contiguous), so both A operands are cp.async-pipelined instead of 8 gathers + layout conversions
    "mmaq_n32s4": {"path": "decode", "variant": "mma", "deq": "asm", "BLOCK_N": 32, "SPLIT_K": 4, "num_warps": 4,
                   "BLOCK_N2": 32, "num_warps2": 4, "num_stages": 3},
    "mmaq_n64s2": {"path": "decode", "variant": "mma", "deq": "asm", "BLOCK_N": 64, "SPLIT_K": 2, "num_warps": 4,
                   "BLOCK_N2": 64, "num_warps2": 4, "num_stages": 3},
    "mmaq_n32s4x": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                    "BLOCK_N": 32, "SPLIT_K": 4, "num_warps": 4, "BLOCK_N2": 32, "num_warps2": 4, "num_stages": 3},
    "mmaq_n32s8x": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                    "BLOCK_N": 32, "SPLIT_K": 8, "num_warps": 4, "BLOCK_N2": 32, "num_warps2": 4, "num_stages": 3},
    "mmaq_n64s2x": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                    "BLOCK_N": 64, "SPLIT_K": 2, "num_warps": 4, "BLOCK_N2": 64, "num_warps2": 4, "num_stages": 3},
    "mmaq_n32s2x": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                    "BLOCK_N": 32, "SPLIT_K": 2, "num_warps": 4, "BLOCK_N2": 32, "num_warps2": 4, "num_stages": 3},
    "mma_n32s8w2": {"path": "decode", "variant": "mma", "BLOCK_N": 32, "SPLIT_K": 8, "num_warps": 2,
                    "BLOCK_N2": 32, "num_warps2": 2, "num_stages": 4},
    # session 9 (NOTES "moe9"): the default's loop is latency-bound at T=1 (one warp per scheduler, ~0.9 us
    # per 128-deep group); twice the K splits won at T=1 (22.9 vs 25.1 us, sm_89 build) and lost at T=16
    # (202.2 vs 191.8); 8 warps, 4 stages and 128-wide tiles lost at both (rows removed, numbers in NOTES)
    "mmaq_n64s4x": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                    "BLOCK_N": 64, "SPLIT_K": 4, "num_warps": 4, "BLOCK_N2": 64, "num_warps2": 4, "num_stages": 3},
    # candidate (moe9): the next step of the same trend, 8 splits of 64-wide tiles
    "mmaq_n64s8x": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                    "BLOCK_N": 64, "SPLIT_K": 8, "num_warps": 4, "BLOCK_N2": 64, "num_warps2": 4, "num_stages": 3},
    # candidates (issue 20, moe16: 16-32 tokens = 96-192 pairs; rows for DECODE_ROW_WIDE). At those sizes the
    # default's time is per-program latency and issue, not bytes (sm_89 SASS): every w13 and w2 program first
    # runs the [16, PB] one-hot id scan (~520 instructions before its first weight load at 96 pairs, ~790 at
    # 192; a w2 program's whole K loop is ~920 for 16 KB of weights), each w13 program (128 KB at n64s2) then
    # pays the x copy, its first DRAM trips and the split-K ticket tail. Options, one step each:
    # "l": "scan": "loop" (_expert_rows_loop: the leader's rows by a short loop, ~160 instructions before the
    #   first weight load at any pair count; the same rows, so the same bits as the row without it);
    # "w2n128": 128 w2 columns a program (half the w2 programs, scans and tickets; same bits);
    # "s1": no K split (256 KB a w13 program at n64, h stored by the program: no partials, no ticket; the K
    #   sum in one chain: other bits than s2, checked against the float64 reference);
    # "n32": 32-wide w13 tiles (65 registers instead of 128: 7 CTAs an SM instead of 4; same bits as n64 s1).
    "mmaq_n64s2xl": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                     "scan": "loop", "BLOCK_N": 64, "SPLIT_K": 2, "num_warps": 4, "BLOCK_N2": 64, "num_warps2": 4,
                     "num_stages": 3},
    "mmaq_n64s2xl_w2n128": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                            "scan": "loop", "BLOCK_N": 64, "SPLIT_K": 2, "num_warps": 4, "BLOCK_N2": 128,
                            "num_warps2": 4, "num_stages": 3},
    "mmaq_n64s1xl_w2n128": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                            "scan": "loop", "BLOCK_N": 64, "SPLIT_K": 1, "num_warps": 4, "BLOCK_N2": 128,
                            "num_warps2": 4, "num_stages": 3},
    "mmaq_n32s1xl_w2n128": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                            "scan": "loop", "BLOCK_N": 32, "SPLIT_K": 1, "num_warps": 4, "BLOCK_N2": 128,
                            "num_warps2": 4, "num_stages": 3},
    # the same with 4 stages (3 weight groups in flight a program instead of 2: 12 KB w13, 24 KB w2)
    "mmaq_n32s1xl_w2n128s4": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                              "scan": "loop", "BLOCK_N": 32, "SPLIT_K": 1, "num_warps": 4, "BLOCK_N2": 128,
                              "num_warps2": 4, "num_stages": 4},
    # candidates (issue 20, session 14): 4 K splits with the loop scan. The step's random-weight routing puts 96
    # pairs on ~18.5 experts a layer (11-82; results/issue20/s14/call1), not the bench's 96 distinct ones, so at
    # batch 16 the 2-split rows run ~300 w13 programs (~2 an SM) of 16 serial 128-groups each: twice the splits
    # halve each program's chain. Bit-equal to mmaq_n64s4x (the loop scan and the w2 tile width change no bits).
    "mmaq_n64s4xl": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                     "scan": "loop", "BLOCK_N": 64, "SPLIT_K": 4, "num_warps": 4, "BLOCK_N2": 64, "num_warps2": 4,
                     "num_stages": 3},
    "mmaq_n64s4xl_w2n128": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                            "scan": "loop", "BLOCK_N": 64, "SPLIT_K": 4, "num_warps": 4, "BLOCK_N2": 128,
                            "num_warps2": 4, "num_stages": 3},
    # candidates (issue 20, session 17): the w13 launch as one wave of persistent programs (SMs x CTAS) looping over
    # the tiles' (tile, column block, split) units, with the split count (1..SPLIT_K) picked in-kernel to fill the
    # wave: at batch 16 under the step's routing (~18.5 experts, 148 tile-column blocks) the grid rows run ~592 units
    # of 8 groups on 528 resident CTAs (ncu, results/issue20/s16/call1: SMs busy 38-69 of 78 K cycles: a second
    # round on about half the SMs), and ~2,480 non-leader programs that only scan and exit. Other bits than the grid
    # rows where the picked split count differs from 4 (checked against the float64 reference)
    # (sm_89 AOT at TP4, triton 3.7.1: w13 128 registers, 0 spills, 24 KB shared: 4 CTAs an SM; sm_90 128-164)
    "mmaq_n64p8xl": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                     "scan": "loop", "sched": "persist", "CTAS": 4, "OVH": 4, "BLOCK_N": 64, "SPLIT_K": 8,
                     "num_warps": 4, "BLOCK_N2": 64, "num_warps2": 4, "num_stages": 3},
    "mmaq_n64p8xl_w2n128": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                            "scan": "loop", "sched": "persist", "CTAS": 4, "OVH": 4, "BLOCK_N": 64, "SPLIT_K": 8,
                            "num_warps": 4, "BLOCK_N2": 128, "num_warps2": 4, "num_stages": 3},
    # candidates (issue 20, session 18): the whole decode MoE as ONE launch (_dec_mma_fused_kernel): the persistent
    # rows' w13 units, then one w2 unit per (tile, column block) that waits for its tile's h (a ready counter per
    # tile) instead of a second launch: one launch a layer fewer, and w2 starts on the tiles whose h is in while w13
    # finishes the rest (at batch 16 under the step's routing, w2 ran 592 units in two rounds after w13's two
    # rounds). Every program must be resident (a w2 unit spins): the launcher sizes the wave from the compiled
    # kernel before its first launch. The bits of the persistent rows at the same split count. The union of the two
    # halves compiles to 226-233 registers (sm_89 AOT, triton 3.6.0; w13 alone 128, w2 alone 108): 2 CTAs an SM. Capped
    # at 168 ("maxnreg", 0 spills, 3 CTAs an SM); at 128 (4 CTAs) ptxas spills 12-44 B in the unit loop's prologue
    "mmaq_n64f8xl": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                     "scan": "loop", "sched": "fused", "CTAS": 3, "OVH": 4, "BLOCK_N": 64, "SPLIT_K": 8,
                     "num_warps": 4, "BLOCK_N2": 64, "num_warps2": 4, "num_stages": 3, "maxnreg": 168},
    "mmaq_n64f8xl_w2n128": {"path": "decode", "variant": "mma", "deq": "asm", "pb": "tight", "hperm": 1, "xperm": 1,
                            "scan": "loop", "sched": "fused", "CTAS": 3, "OVH": 4, "BLOCK_N": 64, "SPLIT_K": 8,
                            "num_warps": 4, "BLOCK_N2": 128, "num_warps2": 4, "num_stages": 3, "maxnreg": 168},
    # (session 15, NOTES "Session 15 (lead)": 8 K splits, mmaq_n64s8xl_w2n128, lost in the batch-16 step, +400 us, and
    # in the bench, 77.0 vs 68.4 us at pool19 T=16; the x copy 4 rows a step, "xperm": 4, lost 2x: rows removed)
}
# one table per architecture; each holds its own copies of the decode rows (editing one leaves the other)
CONFIGS = {
    "sm_89": {
        **{k: dict(v) for k, v in _DECODE.items()},
        "prefill": {"path": "prefill", "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "BLOCK_N2": 64,
                    "num_warps": 4, "num_stages": 3},
        "prefill_m16": {"path": "prefill", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "BLOCK_N2": 64,
                        "num_warps": 4, "num_stages": 2},
    },
    "sm_90": {
        **{k: dict(v) for k, v in _DECODE.items()},
        "prefill": {"path": "prefill", "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_N2": 128,
                    "num_warps": 8, "num_stages": 3},
        "prefill_m16": {"path": "prefill", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_N2": 64,
                        "num_warps": 4, "num_stages": 2},
    },
}

# the interpreter runs programs one by one in Python: fewer, larger programs
_INTERP = {
    "decode": {"path": "decode", "BLOCK_N": 256, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4,
               "BLOCK_N2": 256, "BLOCK_K2": 128, "num_warps2": 4},
    "prefill": {"path": "prefill", "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_N2": 128,
                "num_warps": 4, "SUM_T": 16, "SUM_N": 256},
}

#: (token, expert) pairs up to which the decode path runs (prefill above). 256 covers batch 16 with MTP
#: (32 tokens x 6 = 192 pairs): the prefill path measured 1,461.6 us there (H200 sm_89 build, session 5)
#: against 189.8 us for mmaq_n64s2x at 96 pairs; the decode row's own time at 192 pairs is measured by the
#: step's batch-16 MTP row, not yet by the kernel bench (its T=32 shape ran the prefill rows only).
DECODE_MAX_PAIRS = 256

# the rows pick_config can return on a GPU (the rest are benchmark candidates or interpreter sizes);
# the compile report builds these for sm_120, tests/test_arch.py sweeps pick_config against them
#: the decode row on a GPU per table, and the row up to :data:`DECODE_NARROW_MAX_PAIRS` pairs (T <= 2 at
#: top-6: batch 1, plain and MTP); module constants so that ``ds4lab step --ab moe_w4a16.DECODE_ROW_NARROW=...``
#: can time a candidate inside the step. sm_89 (issue 20; session 14, H100 80GB HBM3, sm_89 build,
#: results/issue20/s14/call1): ``mmaq_n64s2xl`` (the loop id scan; bit-equal to ``mmaq_n64s2x``), step ABBA batch 4
#: 8,299 -> 8,060 us, batch 8 8,495 -> 8,188. sm_90 the same from session 15 (H100 80GB HBM3, native build,
#: results/issue20/s15/call1: bit-equal to ``mmaq_n64s2x`` natively; the native step with the sm_89 table's MoE and
#: seam defaults, ABBA, batch 4 8,428 -> 8,205 us, batch 16 10,417 -> 9,371). sm_89 ``mmaq_n64s4xl`` from session 15
#: (4 K splits, bit-equal to ``mmaq_n64s4x``; results/issue20/s15/call2, ABBA): batch 4 8,034 -> 7,949 us, batch 8
#: 8,203 -> 7,682 (the 128-wide-w2 row from 24 pairs instead: 7,980 / 7,715); sm_90 too (native, call3, ABBA):
#: batch 4 8,236 -> 8,199, batch 8 8,336 -> 7,912. The narrow row with the loop scan (``mmaq_n64s4xl``, bit-equal
#: to ``mmaq_n64s4x``; sm_89 build, call3, ABBA): batch 1 4,965 -> 4,931 us, batch-1 MTP 6,174 -> 6,141 (one A/B pair:
#: the run was cut there). The narrow row since session 19: ``mmaq_n64f8xl``, the one-launch MoE (``"sched": "fused"``;
#: H100 80GB HBM3, results/issue20/s19/call5 and call6, ``ds4lab step --ab moe_w4a16.DECODE_ROW_NARROW='mmaq_n64f8xl'
#: --abba``, p50 means of the A and B pairs): sm_89 build batch 1 4,959 -> 4,928 us, batch-1 MTP 6,127 -> 5,979; native
#: 5,646 -> 5,624 and 6,412 -> 6,229; 21.1 -> 20.1 launches a layer. The fused wide row (``mmaq_n64f8xl_w2n128``)
#: stays a candidate: batch 16 8,855 -> 8,774 us but batch-16 MTP (192 pairs) 12,446 -> 14,609 (call2)
DECODE_ROW = {"sm_89": "mmaq_n64s4xl", "sm_90": "mmaq_n64s4xl"}
DECODE_ROW_NARROW = "mmaq_n64f8xl"
DECODE_NARROW_MAX_PAIRS = 12
#: the decode row from :data:`DECODE_WIDE_MIN_PAIRS` pairs up (batch 16 = 96 pairs, batch 16 MTP = 192), per table
#: (None: :data:`DECODE_ROW` serves every size above the narrow bound). Issue 20, moe16; session 13, H100 80GB HBM3,
#: sm_89 build (results/issue20/s13/call1): ``mmaq_n64s2xl_w2n128`` (bit-equal to ``mmaq_n64s2x``: the loop id scan
#: and 128-wide w2 programs) 185.2 us vs 206.0 at T=16 and 342.5 vs 392.4 at T=32 (kernel bench, distinct experts,
#: cold L2); in the batch-16 step (ABBA, ``--ab moe_w4a16.DECODE_ROW=...``) ``moe.experts`` 4,100 -> 3,395 us and the
#: step 10,354 -> 9,703 us. From 96 pairs, the smallest count timed. Session 15 (H100 80GB HBM3, results/issue20/s15/
#: call1): sm_89 ``mmaq_n64s4xl_w2n128`` (4 K splits, bit-equal to ``mmaq_n64s4x``): batch-16 step (ABBA) 9,310 ->
#: 8,801 us, batch-16 MTP 12,489 -> 12,392; kernel bench under the step's routing (pool19, T=16) 70.1 vs 72.1 us, pool49
#: T=32 127.1 vs 128.7; 8 splits lost (step +400 us). sm_90 the same (native, results/issue20/s15/call2, ABBA against
#: ``mmaq_n64s2xl_w2n128``, bit-equal to ``mmaq_n64s4x`` natively): batch 16 9,369 -> 8,983 us, MTP 12,527 -> 12,483.
#: Time another with ``ds4lab step --ab "moe_w4a16.DECODE_ROW_WIDE={'sm_89': 'mmaq_n32s1xl_w2n128', 'sm_90': None}"``
#: (read per call by :func:`pick_config`)
DECODE_ROW_WIDE = {"sm_89": "mmaq_n64s4xl_w2n128", "sm_90": "mmaq_n64s4xl_w2n128"}
DECODE_WIDE_MIN_PAIRS = 96
#: the one-launch wide row (``"sched": "fused"``) from :data:`DECODE_WIDE_MIN_PAIRS` up to
#: :data:`DECODE_FUSED_WIDE_MAX_PAIRS` pairs (batch 16 = 96 pairs; not batch-16 MTP's 192, where the fused wide row lost
#: 12,446 -> 14,609 us in session 19, and 143.0 vs 128.7 us in the kernel bench at T=32 pool49, session 20), per table
#: (None: :data:`DECODE_ROW_WIDE` there). Issue 20, session 20 (H100 80GB HBM3, results/issue20/s20/call1b and call2,
#: step ABBA, ``--ab "moe_w4a16.DECODE_ROW_FUSED_WIDE={...}"``): batch 16, sm_89 build 8,837 -> 8,724 us (moe.experts
#: 2,907 -> 2,815; 22.1 -> 21.1 launches a layer), native 8,961 -> 8,797. Time another row with
#: ``ds4lab step --ab "moe_w4a16.DECODE_ROW_FUSED_WIDE={'sm_89': 'ROW', 'sm_90': None}"``
DECODE_ROW_FUSED_WIDE = {"sm_89": "mmaq_n64f8xl_w2n128", "sm_90": "mmaq_n64f8xl_w2n128"}
DECODE_FUSED_WIDE_MAX_PAIRS = 128
GPU_DEFAULTS = {a: tuple(dict.fromkeys((DECODE_ROW_NARROW, DECODE_ROW[a],
                                        *(r for r in (DECODE_ROW_WIDE[a], DECODE_ROW_FUSED_WIDE[a]) if r),
                                        "prefill")))
                for a in ("sm_89", "sm_90")}


def pick_config(pairs: int, device: torch.device) -> dict:
    """The default row for ``pairs`` (token, expert) pairs on ``device``; ``accumulate`` does not change
    it (every path can add into a float32 ``out``)."""
    path = "decode" if pairs <= DECODE_MAX_PAIRS else "prefill"
    if device.type != "cuda":
        return _INTERP[path]
    arch = arch_of(device)
    if path == "decode":
        # H200 (issue 20, session 5, NOTES "W4A16 MoE decode bandwidth (moe5)"): TP4 cold L2, sm_89 build /
        # native, us: mmaq_n64s2x T=1 25.6 / 25.2, T=4 58.6 / 58.1, T=16 189.8 / 191.8, the fastest row at
        # every T in both builds (was mma_n32s4 32.5 / 32.1 at T=1, mma_n64s2 80.3 / 79.5 at T=4 and 261.3 /
        # 268.9 at T=16); vLLM's Triton W4A16 at its best swept config 85.1 / 238.8 / 738.9 (sm89 build).
        # Session 9 (moe9): up to DECODE_NARROW_MAX_PAIRS pairs, mmaq_n64s4x (T=1 22.9 us vs 25.1, sm89 build)
        if pairs <= DECODE_NARROW_MAX_PAIRS:
            return CONFIGS[arch][DECODE_ROW_NARROW]
        # moe16: the wide row for 16-32 tokens where its table has one (module globals read here, per call)
        wide = DECODE_ROW_WIDE.get(arch)
        if wide and pairs >= DECODE_WIDE_MIN_PAIRS:
            fused = DECODE_ROW_FUSED_WIDE.get(arch)
            return CONFIGS[arch][fused if fused and pairs <= DECODE_FUSED_WIDE_MAX_PAIRS else wide]
        return CONFIGS[arch][DECODE_ROW[arch]]
    return CONFIGS[arch][path]
