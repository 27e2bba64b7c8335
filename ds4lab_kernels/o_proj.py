"""DeepSeek-V4 o-projection: fused inverse RoPE + FP8 quant, grouped FP8 einsum, whole ``o_proj``.

Semantics (SPEC.md §2 item 3; vLLM ``deep_gemm_fp8_o_proj`` and ``fused_inv_rope_fp8_quant``):
the attention output ``o[T, H, 512]`` is rotated back by ``-theta`` on the last 64 dims of every
head (GPT-J interleaved pairs ``(2i, 2i+1)``), viewed as ``[T, G, 8*512]`` (one ``wo_a`` group per
8 heads), quantized to e4m3 with one scale per 128 columns, multiplied per group by ``wo_a[g]``
(``[1024, 4096]`` e4m3 with 128x128 block scales; DeepGEMM ``fp8_einsum("bhr,hdr->bhd")``) and the
flattened ``z[T, G*1024]`` goes through ``wo_b`` (dense block-scaled FP8 linear). When ``wo_a`` has
no scales (the BF16 MTP drafter of the community checkpoint) the rotated output stays bf16 and the
einsum runs in bf16 (``torch.bmm`` semantics, fp32 accumulation).

cos/sin cache layout (vLLM ``DeepseekV4ScalingRotaryEmbedding.cos_sin_cache``): float32
``[max_positions, rope_dim]``, row ``p`` = ``cos(p * inv_freq) || sin(p * inv_freq)`` (``rope_dim/2``
cosines then ``rope_dim/2`` sines, mscale already folded in). Pair ``i`` of the rope part uses
``cos[i]``, ``sin[i]``; the inverse rotation is
``y[2i] = x[2i] cos + x[2i+1] sin``, ``y[2i+1] = x[2i+1] cos - x[2i] sin`` (each product rounded
to fp32, then the sum: no FMA contraction, so the result is bit-reproducible against torch).
"""
import torch
import triton
import triton.language as tl

from . import _checks as check
from ._counters import zeroed_counters
from ._arch import arch_of, num_sms, require_fp8
from ._fp8 import fp32_pow2_to_ue8m0, quant_rows_e4m3, quant_rows_e4m3_pow2, ue8m0_to_fp32

SCALE_FMTS = ("fp32", "pow2", "ue8m0")
_FMT_CODE = {"fp32": 0, "pow2": 1, "ue8m0": 2}
QUANT_GROUP = 128   # 1x128 activation groups
W_BLOCK = 128       # 128x128 weight blocks


# ---- kernels -----------------------------------------------------------------------------------
@triton.jit
def _inv_rope_quant_kernel(
    o_ptr, pos_ptr, cs_ptr, out_ptr, s_ptr,
    n_rows, H, n_pos, stride_ot, stride_oh, stride_cs, stride_out_t, stride_s_t,
    eps,
    HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
    QUANTIZE: tl.constexpr, SCALE_FMT: tl.constexpr, CHUNK_GRID: tl.constexpr = False,
):
    """Grid ``(cdiv(num_tokens * num_heads, BLOCK_R), HEAD_DIM / GROUP if CHUNK_GRID else 1)``.
    One program: BLOCK_R (token, head) rows x HEAD_DIM, walked in GROUP-wide chunks (rotate back,
    quantize); ``CHUNK_GRID``: one GROUP-wide chunk of them (axis 1), so a decode call's programs each
    run one load -> (rope) -> quant chain instead of four in a row.

    Row ``r = t*H + h``. Output layout ``[T, H*HEAD_DIM]`` (== ``[T, G, HPG*HEAD_DIM]``), scales
    ``[T, H*HEAD_DIM/GROUP]``. A token whose position is outside ``[0, n_pos)`` gets NaN (never an
    out-of-bounds cache read; the launcher also checks on the host).
    """
    NOPE: tl.constexpr = HEAD_DIM - ROPE
    HALF: tl.constexpr = ROPE // 2
    CHUNKS: tl.constexpr = HEAD_DIM // GROUP
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    t = rows // H
    h = rows - t * H
    pos = tl.load(pos_ptr + t, mask=rmask, other=0).to(tl.int64)
    bad = (pos < 0) | (pos >= n_pos)
    pos = tl.where(bad, 0, pos)
    cols = tl.arange(0, GROUP)
    in_row = o_ptr + (t * stride_ot + h * stride_oh)[:, None]
    out_row = out_ptr + (t * stride_out_t + h * HEAD_DIM)[:, None]
    if CHUNK_GRID:
        _inv_rope_chunk(tl.program_id(1), in_row, out_row, cs_ptr, s_ptr, t, h, pos, bad, rmask, cols,
                        stride_cs, stride_s_t, eps, NOPE, HALF, CHUNKS, GROUP, QUANTIZE, SCALE_FMT)
    else:
        for c in tl.static_range(CHUNKS):
            _inv_rope_chunk(c, in_row, out_row, cs_ptr, s_ptr, t, h, pos, bad, rmask, cols,
                            stride_cs, stride_s_t, eps, NOPE, HALF, CHUNKS, GROUP, QUANTIZE, SCALE_FMT)


@triton.jit
def _inv_rope_chunk(c, in_row, out_row, cs_ptr, s_ptr, t, h, pos, bad, rmask, cols, stride_cs, stride_s_t, eps,
                    NOPE: tl.constexpr, HALF: tl.constexpr, CHUNKS: tl.constexpr, GROUP: tl.constexpr,
                    QUANTIZE: tl.constexpr, SCALE_FMT: tl.constexpr):
    """Chunk ``c`` (GROUP columns of every row of the block) of ``_inv_rope_quant_kernel``: load,
    rotate the rope dims back (only a chunk that holds some: a compile-time branch for a constexpr
    ``c``, a runtime one on the chunk grid), quantize 1x GROUP (``_quant_rows``, the bits of
    ``quant_rows_e4m3``), store."""
    d = c * GROUP + cols
    x = tl.load(in_row + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    if c * GROUP + GROUP > NOPE:
        m2 = rmask[:, None] & (d >= NOPE)[None, :]
        xp = tl.load(in_row + (d ^ 1)[None, :], mask=m2, other=0.0).to(tl.float32)
        x = rope_back_rows(x, xp, d, cs_ptr + pos[:, None] * stride_cs, rmask, NOPE, HALF, False)
    x = tl.where(bad[:, None], float("nan"), x)
    if QUANTIZE:
        quant_store_rows(x, eps, out_row + d[None, :], s_ptr + t * stride_s_t + h * CHUNKS + c, rmask, SCALE_FMT)
    else:
        tl.store(out_row + d[None, :], x.to(tl.bfloat16), mask=rmask[:, None])


@triton.jit
def _mul_once(a, b, EXACT: tl.constexpr):
    """``a * b`` in fp32, rounded once and never contracted into an FMA with the add that follows.
    ``EXACT`` (a GPU kernel compiled with fp fusion ON, e.g. sparse MLA's merge): PTX ``mul.rn.f32``
    in inline asm (ptxas does not contract an instruction with an explicit rounding mode, LLVM cannot
    see through the asm); else the plain product (kernels built with ``enable_fp_fusion=False``, and the
    interpreter, which has no inline asm)."""
    if EXACT:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def rope_back_cos_sin(d, cs_row, mask, NOPE: tl.constexpr, HALF: tl.constexpr):
    """The ``cos, sin`` values the inverse rotation of head dims ``d`` needs: ``cs_row`` pointers (any
    shape broadcasting against ``d``'s) to ``cos || sin`` rows (``HALF`` cosines then ``HALF`` sines),
    ``mask`` the rows to read, and only the rope dims ``d >= NOPE`` are read (1 / 0 elsewhere). Split from
    :func:`rope_back_rows` so a kernel can issue the gather early (sparse MLA's fused merge, before its
    split loop)."""
    is_rope = d >= NOPE
    ci = tl.maximum(d - NOPE, 0) >> 1
    m2 = mask & is_rope
    return tl.load(cs_row + ci, mask=m2, other=1.0), tl.load(cs_row + HALF + ci, mask=m2, other=0.0)


@triton.jit
def rope_back_cs(x, xp, d, cosv, sinv, NOPE: tl.constexpr, EXACT: tl.constexpr):
    """The rotation of :func:`rope_back_rows` with ``cosv, sinv`` given (:func:`rope_back_cos_sin`, broadcasting
    against ``x``)."""
    is_rope = d >= NOPE
    r = tl.maximum(d - NOPE, 0)
    a = _mul_once(x, cosv, EXACT)
    b = _mul_once(xp, sinv, EXACT)
    rot = tl.where(((r & 1) == 0)[None, :], a + b, a - b)
    return tl.where(is_rope[None, :], rot, x)


@triton.jit
def rope_back_rows(x, xp, d, cs_row, rmask, NOPE: tl.constexpr, HALF: tl.constexpr, EXACT: tl.constexpr):
    """The inverse GPT-J rotation (``-theta``) of a ``(rows, cols)`` fp32 block of heads: ``x`` the
    values at head dims ``d (cols,)``, ``xp`` those at ``d ^ 1`` (the pair partners), ``cs_row (rows, 1)``
    pointers to each row's ``cos || sin`` row (``HALF`` cosines then ``HALF`` sines), ``rmask (rows,)``.
    Dims ``d >= NOPE`` become ``y[2i] = x[2i] cos_i + x[2i+1] sin_i``, ``y[2i+1] = x[2i+1] cos_i - x[2i] sin_i``
    (each product rounded to fp32, then the sum: ``_mul_once``); the others are returned as given. The
    one home of the rotation (:func:`rope_back_cos_sin` + :func:`rope_back_cs`): ``inv_rope_fp8_quant``'s
    chunks and sparse MLA's fused merge use it."""
    cosv, sinv = rope_back_cos_sin(d[None, :], cs_row, rmask[:, None], NOPE, HALF)
    return rope_back_cs(x, xp, d, cosv, sinv, NOPE, EXACT)


@triton.jit
def quant_store_rows(x, eps, q_ptrs, s_ptrs, rmask, SCALE_FMT: tl.constexpr):
    """1 x cols e4m3 quant of the fp32 rows ``x`` (``_quant_rows``; ``SCALE_FMT`` 0 fp32, 1 pow2,
    2 ue8m0) stored at ``q_ptrs (rows, cols)`` and the one scale per row at ``s_ptrs (rows,)`` (fp32, or
    the UE8M0 byte), rows under ``rmask``: ``inv_rope_fp8_quant``'s output, also written by sparse MLA's
    fused merge."""
    q, s = _quant_rows(x, eps, SCALE_FMT != 0)
    tl.store(q_ptrs, q, mask=rmask[:, None])
    if SCALE_FMT == 2:
        tl.store(s_ptrs, fp32_pow2_to_ue8m0(s).to(tl.uint8), mask=rmask)
    else:
        tl.store(s_ptrs, s, mask=rmask)


@triton.jit
def _decode_scale(v, IS_UE8M0: tl.constexpr):
    """fp32 scale, or a UE8M0 byte -> 2^(b-127) (0 -> 0.0, 255 -> NaN; ``_fp8.ue8m0_to_fp32``)."""
    if IS_UE8M0:
        return ue8m0_to_fp32(v)
    else:
        return v


@triton.jit
def _tile_coords(T, N, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid ``(n tiles, m tiles, G * SPLIT_K)`` of the grouped kernels -> ``(pid_n, pid_m, g (int64),
    split s, output columns rn, row mask, column mask, rows as int64)`` of this program's tile."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_z = tl.program_id(2)
    g = (pid_z // SPLIT_K).to(tl.int64)
    s = pid_z % SPLIT_K
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid_n, pid_m, g, s, rn, rm < T, rn < N, rm.to(tl.int64)


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr,
    T, N, K_SPLIT,
    stride_xt, stride_xg, stride_xst, stride_xsg, stride_xsk,
    stride_wg, stride_wn, stride_wsg, stride_wsn, stride_wsk,
    stride_ot, stride_og, stride_ps, stride_pt, stride_pg,
    HAS_SCALES: tl.constexpr, XS_UE8M0: tl.constexpr, WS_UE8M0: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(T, BLOCK_M), G * SPLIT_K)``.
    One program: a BLOCK_M x BLOCK_N tile of one group's output over one K split.

    ``out[t, g, n] = sum_k x[t, g, k] xs[t, g, k/128] * w[g, n, k] ws[g, n/128, k/128]``.

    Program ``(n, m, g*SPLIT_K + s)`` covers k in
    ``[s*K_SPLIT, (s+1)*K_SPLIT)``. With scales, BLOCK_K == SCALE_BLOCK and BLOCK_N divides it, so
    each k step has one weight scale and one activation scale per row (DeepGEMM promotion: the fp8
    MMA result of one 128-deep block is scaled in fp32 and added). SPLIT_K > 1 writes fp32 partials
    ``[SPLIT_K, T, G, N]`` for ``_splitk_reduce_kernel``.
    """
    pid_n, pid_m, g, s, rn, mmask, nmask, rm64 = _tile_coords(T, N, SPLIT_K, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_base = x_ptr + g * stride_xg + rm64[:, None] * stride_xt + rk[None, :]
    w_base = w_ptr + g * stride_wg + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    xs_base = xs_ptr + g * stride_xsg + rm64 * stride_xst
    ws_base = ws_ptr + g * stride_wsg + ((pid_n * BLOCK_N) // SCALE_BLOCK) * stride_wsn
    k0 = s * K_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K_SPLIT, BLOCK_K):
        k = k0 + kk
        a = tl.load(x_base + k, mask=mmask[:, None], other=0.0)
        b = tl.load(w_base + k, mask=nmask[:, None], other=0.0)
        if HAS_SCALES:
            kb = k // SCALE_BLOCK
            xs = _decode_scale(tl.load(xs_base + kb * stride_xsk, mask=mmask, other=0), XS_UE8M0)
            ws = _decode_scale(tl.load(ws_base + kb * stride_wsk), WS_UE8M0)
            d = tl.dot(a, tl.trans(b))
            acc += d * (xs[:, None] * ws)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        o = out_ptr + rm64[:, None] * stride_ot + g * stride_og + rn[None, :]
        tl.store(o, acc.to(tl.bfloat16), mask=omask)
    else:
        p = part_ptr + s.to(tl.int64) * stride_ps + rm64[:, None] * stride_pt + g * stride_pg + rn[None, :]
        tl.store(p, acc, mask=omask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, out_ptr, n_elem, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(cdiv(T * G * N, BLOCK),)``.
    One program: BLOCK consecutive output elements, summed over the SPLIT_K partials.

    ``out.flat[i] = bf16(sum_s part[s].flat[i])`` in a fixed order (deterministic)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elem
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * n_elem + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(tl.bfloat16), mask=mask)


@triton.jit
def _quant_rows(x, eps, POW2: tl.constexpr):
    """``_fp8.quant_rows_e4m3`` with the same bits; power-of-two scales take ``_fp8.quant_rows_e4m3_pow2``
    (``x * (1/s)``: one ``div_rn`` per row instead of per element; H200: the 2048 ``div_rn`` of a
    16x128 block cost ~2.8 us per k step in the wo_a prologue)."""
    if POW2:
        return quant_rows_e4m3_pow2(x, eps)
    else:
        return quant_rows_e4m3(x, eps, False)


@triton.jit
def _fused_epilogue(tot, rm64, rn, mmask, omask, g, pid_n, out_ptr, q_ptr, qs_ptr, eps,
                    stride_ot, stride_og, stride_qt, stride_qg, stride_qst, stride_qsg,
                    STORE_OUT: tl.constexpr, QUANT_OUT: tl.constexpr, POW2: tl.constexpr,
                    QS_UE8M0: tl.constexpr):
    """Write a finished fp32 tile: bf16 ``out`` and/or (QUANT_OUT, BLOCK_N == 128) the bf16-rounded
    tile quantized 1x128 (``fp8_quant.per_token_group_quant_fp8`` of the bf16 values, bit for bit)."""
    tb = tot.to(tl.bfloat16)
    if STORE_OUT:
        tl.store(out_ptr + rm64[:, None] * stride_ot + g * stride_og + rn[None, :], tb, mask=omask)
    if QUANT_OUT:
        q, s = _quant_rows(tb.to(tl.float32), eps, POW2)
        tl.store(q_ptr + rm64[:, None] * stride_qt + g * stride_qg + rn[None, :], q, mask=omask)
        s_off = qs_ptr + rm64 * stride_qst + g * stride_qsg + pid_n
        if QS_UE8M0:
            tl.store(s_off, fp32_pow2_to_ue8m0(s).to(tl.uint8), mask=mmask)
        else:
            tl.store(s_off, s, mask=mmask)


@triton.jit
def _fused_gemm_kernel(
    a_ptr, as_ptr, pos_ptr, cs_ptr, w_ptr, ws_ptr, part_ptr, cnt_ptr, out_ptr, q_ptr, qs_ptr,
    T, N, K_SPLIT, n_pos, eps,
    stride_at, stride_ag, stride_ah, stride_ast, stride_asg, stride_ask, stride_cs,
    stride_wg, stride_wn, stride_wsg, stride_wsn, stride_wsk,
    stride_ps, stride_pt, stride_pg,
    stride_ot, stride_og, stride_qt, stride_qg, stride_qst, stride_qsg,
    A_MODE: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, POW2: tl.constexpr,
    XS_UE8M0: tl.constexpr, WS_UE8M0: tl.constexpr, STORE_OUT: tl.constexpr, QUANT_OUT: tl.constexpr,
    QS_UE8M0: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ROPE_SPLIT: tl.constexpr = False, RED_UNROLL: tl.constexpr = 1,
):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(T, BLOCK_M), G * SPLIT_K)``.
    One program: a BLOCK_M x BLOCK_N tile of one group's output over one K split (the tile's last split sums them).

    ``out[t, g, n] = sum_k A[t, g, k] sA[t, g, k/128] * w[g, n, k] sw[g, n/128, k/128]`` with the
    activation block ``A`` made in the prologue of every k step (BLOCK_K == 128 == one scale):
    ``A_MODE`` 0 loads e4m3 + scales; 1 quantizes a bf16 block (``quant_rows_e4m3``); 2 reads the
    attention output ``o[t, g*HPG + k/HEAD_DIM, k%HEAD_DIM]`` (head stride ``stride_ah``), rotates
    the last ROPE dims of the head back by ``-theta`` (same products and sums as
    ``_inv_rope_quant_kernel``) and quantizes it, so the bytes fed to the MMA are those of
    ``inv_rope_fp8_quant`` (``ROPE_SPLIT``: the rope pairs taken as the even/odd halves of the block,
    ``tl.split``, instead of a second, gathered load of the partners). Split-K in the same launch: every split stores its fp32 partial to
    ``part[s, t, g, n]``, then takes a ticket on the tile's counter (acq_rel, after a CTA barrier);
    the split that draws the last ticket sums the partials in split order (deterministic, whoever
    arrives last), runs the epilogue and resets the counter to 0 for the next launch (stream order).
    """
    NOPE: tl.constexpr = HEAD_DIM - ROPE
    HALF: tl.constexpr = ROPE // 2
    pid_n, pid_m, g, s, rn, mmask, nmask, rm64 = _tile_coords(T, N, SPLIT_K, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_row = a_ptr + g * stride_ag + rm64[:, None] * stride_at
    w_base = w_ptr + g * stride_wg + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    ws_base = ws_ptr + g * stride_wsg + ((pid_n * BLOCK_N) // 128) * stride_wsn
    if A_MODE == 2:
        pos = tl.load(pos_ptr + rm64, mask=mmask, other=0).to(tl.int64)
        bad = (pos < 0) | (pos >= n_pos)
        pos = tl.where(bad, 0, pos)
        cs_row = cs_ptr + pos[:, None] * stride_cs
    k0 = s * K_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K_SPLIT, BLOCK_K):
        k = k0 + kk
        b = tl.load(w_base + k, mask=nmask[:, None], other=0.0)
        ws = _decode_scale(tl.load(ws_base + (k // 128) * stride_wsk), WS_UE8M0)
        if A_MODE == 0:
            a = tl.load(a_row + k + rk[None, :], mask=mmask[:, None], other=0.0)
            xs = _decode_scale(tl.load(as_ptr + g * stride_asg + rm64 * stride_ast + (k // 128) * stride_ask,
                                       mask=mmask, other=0), XS_UE8M0)
        else:
            if A_MODE == 2:
                hd = k // HEAD_DIM
                d = (k - hd * HEAD_DIM) + rk
                h_row = a_row + hd * stride_ah
                x = tl.load(h_row + d[None, :], mask=mmask[:, None], other=0.0).to(tl.float32)
                if ROPE_SPLIT and k - hd * HEAD_DIM + BLOCK_K > NOPE:
                    # even/odd halves of the block (no gather): pair p of the head is rope pair p - NOPE/2
                    ev, od = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
                    ri = (k - hd * HEAD_DIM) // 2 + tl.arange(0, BLOCK_K // 2) - NOPE // 2
                    isr = ri >= 0
                    m2 = mmask[:, None] & isr[None, :]
                    ci = tl.maximum(ri, 0)[None, :]
                    cosv = tl.load(cs_row + ci, mask=m2, other=1.0)
                    sinv = tl.load(cs_row + HALF + ci, mask=m2, other=0.0)
                    ne = ev * cosv + od * sinv
                    no = od * cosv - ev * sinv
                    ev = tl.where(isr[None, :], ne, ev)
                    od = tl.where(isr[None, :], no, od)
                    x = tl.reshape(tl.join(ev, od), (BLOCK_M, BLOCK_K))
                elif k - hd * HEAD_DIM + BLOCK_K > NOPE:  # this k step holds rope dims
                    m2 = mmask[:, None] & (d >= NOPE)[None, :]
                    xp = tl.load(h_row + (d ^ 1)[None, :], mask=m2, other=0.0).to(tl.float32)
                    x = rope_back_rows(x, xp, d, cs_row, mmask, NOPE, HALF, False)
                x = tl.where(bad[:, None], float("nan"), x)
            else:
                x = tl.load(a_row + k + rk[None, :], mask=mmask[:, None], other=0.0).to(tl.float32)
            a, xs = _quant_rows(x, eps, POW2)
        dd = tl.dot(a, tl.trans(b))
        acc += dd * (xs[:, None] * ws)
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        _fused_epilogue(acc, rm64, rn, mmask, omask, g, pid_n, out_ptr, q_ptr, qs_ptr, eps,
                        stride_ot, stride_og, stride_qt, stride_qg, stride_qst, stride_qsg,
                        STORE_OUT, QUANT_OUT, POW2, QS_UE8M0)
    else:
        p_off = rm64[:, None] * stride_pt + g * stride_pg + rn[None, :]
        tl.store(part_ptr + s.to(tl.int64) * stride_ps + p_off, acc, mask=omask)
        tl.debug_barrier()  # every thread's partial is written before the ticket releases them
        tile = (pid_m * (tl.num_programs(2) // SPLIT_K) + g) * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            # a loop (SPLIT_K live tiles would spill), RED_UNROLL partials in flight per L2 round trip,
            # added in split order from 0 (the bits of _splitk_reduce_kernel, whoever arrives last)
            for j in range(0, SPLIT_K, RED_UNROLL):
                for u in tl.static_range(RED_UNROLL):
                    tot += tl.load(part_ptr + (j + u) * stride_ps + p_off, mask=omask, other=0.0,
                                   cache_modifier=".cg")
            _fused_epilogue(tot, rm64, rn, mmask, omask, g, pid_n, out_ptr, q_ptr, qs_ptr, eps,
                            stride_ot, stride_og, stride_qt, stride_qg, stride_qst, stride_qsg,
                            STORE_OUT, QUANT_OUT, POW2, QS_UE8M0)
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


# ---- launchers ---------------------------------------------------------------------------------
def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_rope_args(o, positions, cos_sin_cache, heads_per_group, quantize, scale_fmt, eps,
                     check_positions, who):
    """The argument checks of :func:`inv_rope_fp8_quant` (also run by the fused ``o_proj``);
    returns ``(T, H, D, max_positions, rope_dim, eps)``."""
    check.tensor("o", o, torch.bfloat16)
    check.tensor("positions", positions, (torch.int64, torch.int32))
    check.tensor("cos_sin_cache", cos_sin_cache, torch.float32)
    if o.dim() != 3:
        raise ValueError(f"o: expected 3 dims (num_tokens, num_heads, head_dim), got shape {tuple(o.shape)}")
    T, H, D = o.shape
    if not isinstance(heads_per_group, int) or heads_per_group <= 0 or H % heads_per_group:
        raise ValueError(f"o: num_heads={H} is not a multiple of heads_per_group={heads_per_group}")
    if D % QUANT_GROUP:
        raise ValueError(f"o: head_dim={D} is not a multiple of {QUANT_GROUP}")
    if positions.dim() != 1 or positions.shape[0] != T:
        raise ValueError(f"positions: expected shape ({T},) to match o's num_tokens, got {tuple(positions.shape)}")
    if cos_sin_cache.dim() != 2:
        raise ValueError(f"cos_sin_cache: expected 2 dims (max_positions, rope_dim), got {tuple(cos_sin_cache.shape)}")
    P, R = cos_sin_cache.shape
    if R % 2 or R <= 0 or R > QUANT_GROUP or R > D:
        raise ValueError(f"cos_sin_cache: rope_dim={R} must be even, <= {QUANT_GROUP} and <= head_dim={D}")
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt={scale_fmt!r}: expected one of {SCALE_FMTS}")
    eps = check.fp32_scalar("eps", eps, positive=True)
    check.last_dim_contiguous("o", o)
    check.last_dim_contiguous("cos_sin_cache", cos_sin_cache)
    if positions.stride(0) != 1 and T > 1:
        raise ValueError(f"positions: must be contiguous, got stride {positions.stride(0)}")
    check.same_device("o", o, positions=positions, cos_sin_cache=cos_sin_cache)
    if quantize:
        require_fp8("o", o.device, who)
    if T and check_positions and not _capturing(o.device):
        if P == 0:
            raise ValueError("cos_sin_cache: has no rows (max_positions=0)")
        lo, hi = (int(v) for v in torch.aminmax(positions))
        if lo < 0 or hi >= P:
            raise ValueError(f"positions: values in [{lo}, {hi}] but cos_sin_cache has rows [0, {P}) "
                             f"(missing cos/sin rows)")
    return T, H, D, P, R, eps


def inv_rope_fp8_quant(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       heads_per_group: int = 8, quantize: bool = True, scale_fmt: str = "ue8m0",
                       eps: float = 1e-10, check_positions: bool = True, config: dict | None = None):
    """Inverse GPT-J RoPE on the last ``rope_dim`` dims of every head, then 1x128 FP8 quant.

    Semantics: vLLM ``fused_inv_rope_fp8_quant`` (DeepSeek-V4 ``_o_proj``), with the output kept
    token-major.

    Args:
        o: ``(num_tokens, num_heads, head_dim)`` bfloat16 attention output; ``head_dim`` a multiple
            of 128 (512 for DeepSeek-V4), last dim contiguous (token/head strides free).
        positions: ``(num_tokens,)`` int64 or int32 token positions (rows of ``cos_sin_cache``).
        cos_sin_cache: ``(max_positions, rope_dim)`` float32, row = ``cos || sin`` (vLLM
            ``DeepseekV4ScalingRotaryEmbedding.cos_sin_cache``), last dim contiguous; ``rope_dim``
            even and <= 128 (64 for DeepSeek-V4), applied to the LAST ``rope_dim`` dims of a head.
        heads_per_group: heads per ``wo_a`` group (``num_heads / o_groups`` = 8 for DeepSeek-V4).
        quantize: False returns the rotated values as bfloat16 (the BF16 ``wo_a`` path).
        scale_fmt: ``"fp32"`` (``s = max(amax, eps)/448``), ``"pow2"`` (rounded up to a power of
            two; DeepSeek-V4 ``scale_fmt: ue8m0`` math) or ``"ue8m0"`` (that power of two's exponent
            byte, ``s = 2^(b-127)``, uint8).
        eps: amax floor (an all-zero group gets scale ``eps/448`` and zeros); a positive normal
            float32 (it reaches the kernel as an fp32 argument).
        check_positions: check ``0 <= positions < max_positions`` on the host (one device sync;
            skipped automatically while a CUDA graph is being captured). Unchecked out-of-range
            positions never read outside the cache: their tokens come out NaN.
        config: a row of ``CONFIGS`` (``BLOCK_R`` (token, head) rows per program, ``num_warps``, optional
            ``CHUNK_GRID``: one 128-wide chunk per program); default picks by size.

    Returns:
        ``quantize=True``: ``(q, s)`` with ``q`` ``(num_tokens, num_groups, heads_per_group*head_dim)``
        float8_e4m3fn and ``s`` ``(num_tokens, num_groups, heads_per_group*head_dim/128)`` float32
        (fp32/pow2) or uint8 (ue8m0), both contiguous. A NaN group gets a NaN scale (255 in ue8m0).
        ``quantize=False``: the rotated ``(num_tokens, num_groups, heads_per_group*head_dim)`` bfloat16.

    Raises:
        TypeError: wrong dtypes (o not bf16, positions not int32/int64, cos_sin_cache not fp32).
        ValueError: wrong ranks, head count not a multiple of ``heads_per_group``, ``head_dim`` not
            a multiple of 128, cos/sin width, non-contiguous last dims, length mismatch,
            positions outside the cache, unknown ``scale_fmt``, devices that differ, ``eps`` not a
            positive normal float32, ``quantize=True`` on a device without FP8 (compute capability < 8.9).
    """
    T, H, D, P, R, eps = _check_rope_args(o, positions, cos_sin_cache, heads_per_group, quantize,
                                          scale_fmt, eps, check_positions,
                                          "inv_rope_fp8_quant(quantize=True)")
    G, K = H // heads_per_group, heads_per_group * D
    if quantize:
        q = torch.empty((T, G, K), dtype=torch.float8_e4m3fn, device=o.device)
        sdt = torch.uint8 if scale_fmt == "ue8m0" else torch.float32
        s = torch.empty((T, G, K // QUANT_GROUP), dtype=sdt, device=o.device)
    else:
        q = torch.empty((T, G, K), dtype=torch.bfloat16, device=o.device)
        s = q  # unused
    if T == 0:
        return (q, s) if quantize else q
    cfg = config or _pick_rope_config(T * H, o.device)
    chunk_grid = bool(cfg.get("CHUNK_GRID", False))
    grid = (triton.cdiv(T * H, cfg["BLOCK_R"]), D // QUANT_GROUP if chunk_grid else 1)
    _inv_rope_quant_kernel[grid](
        o, positions, cos_sin_cache, q, s,
        T * H, H, P, o.stride(0), o.stride(1), cos_sin_cache.stride(0), G * K,
        s.stride(0) if quantize else 0, eps,
        HEAD_DIM=D, ROPE=R, GROUP=QUANT_GROUP, BLOCK_R=cfg["BLOCK_R"],
        QUANTIZE=bool(quantize), SCALE_FMT=_FMT_CODE[scale_fmt], CHUNK_GRID=chunk_grid,
        num_warps=cfg["num_warps"], num_stages=1, enable_fp_fusion=False)
    return (q, s) if quantize else q


def fp8_einsum_bhr_hdr_bhd(x: torch.Tensor, x_s: torch.Tensor | None, wo_a: torch.Tensor,
                           wo_a_s: torch.Tensor | None, out: torch.Tensor | None = None,
                           config: dict | None = None) -> torch.Tensor:
    """Grouped block-scaled FP8 product ``z[t, g, :] = wo_a[g] @ x[t, g, :]`` (``"bhr,hdr->bhd"``).

    Semantics: DeepGEMM ``fp8_einsum("bhr,hdr->bhd", (x, x_s), (wo_a, wo_a_s), z, recipe=(1,128,128))``
    as called by vLLM ``deep_gemm_fp8_o_proj``: ``z[t,g,n] = sum_k (x[t,g,k] x_s[t,g,k/128])
    (wo_a[g,n,k] wo_a_s[g,n/128,k/128])``, fp32 accumulation, bfloat16 out. With ``x_s`` and
    ``wo_a_s`` both None, ``x`` and ``wo_a`` are bfloat16 and the product is ``torch.bmm``
    semantics (the BF16 MTP drafter path; see :func:`bf16_einsum_bhr_hdr_bhd`).

    Args:
        x: ``(num_tokens, num_groups, K)`` float8_e4m3fn (bfloat16 without scales); last dim
            contiguous, other strides free. ``K`` a multiple of 128.
        x_s: ``(num_tokens, num_groups, K/128)`` float32 or UE8M0 bytes (uint8 / float8_e8m0fnu),
            any strides (e.g. vLLM's MN-major layout), or None for the bf16 path.
        wo_a: ``(num_groups, N, K)`` float8_e4m3fn (bfloat16 without scales), last dim contiguous.
            ``N`` (o_lora_rank, 1024) a multiple of 128 when scaled.
        wo_a_s: ``(num_groups, N/128, K/128)`` float32 or UE8M0 bytes (vLLM ``weight_scale_inv``
            viewed per group), or None for the bf16 path.
        out: optional contiguous ``(num_tokens, num_groups, N)`` bfloat16 output.
        config: a row of ``CONFIGS`` (BLOCK_M/N/K, SPLIT_K or None for auto, warps, stages).

    Returns:
        ``(num_tokens, num_groups, N)`` bfloat16. Rows with a NaN input or NaN scale are NaN.

    Raises:
        TypeError: dtypes (fp8 operands with scales, bf16 without; scale dtypes).
        ValueError: ranks/shapes that disagree, K or N not multiples of 128, only one of the two
            scales given, non-contiguous last dims, a bad ``out``, devices that differ, the fp8 path
            on a device without FP8 (compute capability < 8.9).
    """
    check.tensor("x", x, (torch.float8_e4m3fn, torch.bfloat16))
    check.tensor("wo_a", wo_a, (torch.float8_e4m3fn, torch.bfloat16))
    has_scales = x_s is not None or wo_a_s is not None
    if has_scales and (x_s is None or wo_a_s is None):
        raise ValueError(f"x_s / wo_a_s: give both scales (fp8 path) or neither (bf16 path); "
                         f"got x_s={'None' if x_s is None else 'tensor'}, wo_a_s={'None' if wo_a_s is None else 'tensor'}")
    want = torch.float8_e4m3fn if has_scales else torch.bfloat16
    for n, t in (("x", x), ("wo_a", wo_a)):
        if t.dtype != want:
            raise TypeError(f"{n}: dtype {t.dtype}, expected {want} ({'with' if has_scales else 'without'} scales)")
    if x.dim() != 3:
        raise ValueError(f"x: expected 3 dims (num_tokens, num_groups, K), got shape {tuple(x.shape)}")
    if wo_a.dim() != 3:
        raise ValueError(f"wo_a: expected 3 dims (num_groups, N, K), got shape {tuple(wo_a.shape)}")
    T, G, K = x.shape
    if wo_a.shape[0] != G or wo_a.shape[2] != K:
        raise ValueError(f"wo_a: shape {tuple(wo_a.shape)} does not match x {tuple(x.shape)} "
                         f"(expected ({G}, N, {K}))")
    N = wo_a.shape[1]
    if K % W_BLOCK or K == 0:
        raise ValueError(f"x: K={K} must be a positive multiple of {W_BLOCK}")
    if has_scales and (N % W_BLOCK or N == 0):
        raise ValueError(f"wo_a: N={N} must be a positive multiple of {W_BLOCK}")
    if N == 0:
        raise ValueError("wo_a: N=0")
    check.last_dim_contiguous("x", x)
    if wo_a.stride(2) != 1:
        raise ValueError(f"wo_a: last dim must be contiguous (stride(-1)=1), got strides {tuple(wo_a.stride())}")
    if has_scales:
        x_s = check.scale_tensor("x_s", x_s, (torch.float32, torch.uint8))
        wo_a_s = check.scale_tensor("wo_a_s", wo_a_s, (torch.float32, torch.uint8))
    if out is not None:
        check.tensor("out", out, torch.bfloat16)
    check.same_device("x", x, wo_a=wo_a, x_s=x_s, wo_a_s=wo_a_s, out=out)
    if has_scales:
        require_fp8("x", x.device, "fp8_einsum_bhr_hdr_bhd")
        if tuple(x_s.shape) != (T, G, K // W_BLOCK):
            raise ValueError(f"x_s: shape {tuple(x_s.shape)}, expected ({T}, {G}, {K // W_BLOCK}) (1x128 scales)")
        if tuple(wo_a_s.shape) != (G, N // W_BLOCK, K // W_BLOCK):
            raise ValueError(f"wo_a_s: shape {tuple(wo_a_s.shape)}, expected ({G}, {N // W_BLOCK}, {K // W_BLOCK}) "
                             f"(128x128 block scales)")
    if out is None:
        out = torch.empty((T, G, N), dtype=torch.bfloat16, device=x.device)
    else:
        if tuple(out.shape) != (T, G, N) or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous bfloat16 tensor of shape ({T}, {G}, {N}), got "
                             f"{out.dtype} {tuple(out.shape)} strides {tuple(out.stride())}")
    if T == 0 or G == 0:
        return out
    cfg = dict(config or pick_einsum_config(T, x.device))
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    BK = W_BLOCK if has_scales else cfg.get("BLOCK_K_BF16", 64)
    if has_scales and (W_BLOCK % BN):
        raise ValueError(f"config: BLOCK_N={BN} must divide {W_BLOCK} on the scaled path")
    split = cfg.get("SPLIT_K") or auto_split_k(T, G, N, K, BM, BN, BK, x.device)
    if (K // BK) % split:
        raise ValueError(f"config: SPLIT_K={split} must divide the {K // BK} k-steps")
    grid = (triton.cdiv(N, BN), triton.cdiv(T, BM), G * split)
    if split > 1:
        part = torch.empty((split, T, G, N), dtype=torch.float32, device=x.device)
        pst = (part.stride(0), part.stride(1), part.stride(2))
    else:
        part, pst = out, (0, 0, 0)
    xs_t = x_s if has_scales else x
    ws_t = wo_a_s if has_scales else wo_a
    xss = x_s.stride() if has_scales else (0, 0, 0)
    wss = wo_a_s.stride() if has_scales else (0, 0, 0)
    _grouped_gemm_kernel[grid](
        x, xs_t, wo_a, ws_t, out, part,
        T, N, K // split,
        x.stride(0), x.stride(1), xss[0], xss[1], xss[2],
        wo_a.stride(0), wo_a.stride(1), wss[0], wss[1], wss[2],
        out.stride(0), out.stride(1), *pst,
        HAS_SCALES=has_scales,
        XS_UE8M0=has_scales and x_s.dtype == torch.uint8,
        WS_UE8M0=has_scales and wo_a_s.dtype == torch.uint8,
        SPLIT_K=split, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, SCALE_BLOCK=W_BLOCK,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split > 1:
        n = T * G * N
        RB = 1024
        _splitk_reduce_kernel[(triton.cdiv(n, RB),)](part, out, n, SPLIT_K=split, BLOCK=RB, num_warps=4)
    return out


def bf16_einsum_bhr_hdr_bhd(x: torch.Tensor, wo_a: torch.Tensor, out: torch.Tensor | None = None,
                            config: dict | None = None) -> torch.Tensor:
    """BF16 grouped product ``z[t, g, :] = wo_a[g] @ x[t, g, :]`` (the BF16 MTP drafter's ``wo_a``).

    Semantics: vLLM ``deep_gemm_fp8_o_proj``'s unquantized branch, ``torch.bmm(x.transpose(0, 1),
    wo_a.transpose(1, 2))``: fp32 accumulation, bfloat16 out.

    Args:
        x: ``(num_tokens, num_groups, K)`` bfloat16, last dim contiguous; ``K`` a multiple of 128.
        wo_a: ``(num_groups, N, K)`` bfloat16, last dim contiguous.
        out / config: as :func:`fp8_einsum_bhr_hdr_bhd`.

    Returns:
        ``(num_tokens, num_groups, N)`` bfloat16.

    Raises:
        TypeError / ValueError: as :func:`fp8_einsum_bhr_hdr_bhd`.
    """
    return fp8_einsum_bhr_hdr_bhd(x, None, wo_a, None, out=out, config=config)


def _wo_b(z: torch.Tensor, wo_b: torch.Tensor, wo_b_s, scale_fmt: str, config) -> torch.Tensor:
    """``z[T, Kb] @ wo_b[N, Kb]^T``: block-scaled FP8 (z quantized 1x128, then ``fp8_gemm_nt``) or
    plain bf16 (this file's grouped kernel with one group)."""
    T, Kb = z.shape
    N = wo_b.shape[0]
    cfg = config or {}
    if wo_b_s is None:
        return fp8_einsum_bhr_hdr_bhd(z.view(T, 1, Kb), None, wo_b.view(1, N, Kb), None,
                                      config=cfg.get("wo_b")).view(T, N)
    from .fp8_quant import per_token_group_quant_fp8
    zq, zs = per_token_group_quant_fp8(z, QUANT_GROUP, scale_fmt=scale_fmt)
    try:
        from .fp8_gemm import fp8_gemm_nt
    except ImportError:  # kernels/ lifted without fp8_gemm.py: the grouped kernel with G=1 is the same op
        return fp8_einsum_bhr_hdr_bhd(zq.view(T, 1, Kb), zs.view(T, 1, Kb // W_BLOCK), wo_b.view(1, N, Kb),
                                      wo_b_s.view(1, N // W_BLOCK, Kb // W_BLOCK),
                                      config=cfg.get("wo_b")).view(T, N)
    return fp8_gemm_nt(zq, zs, wo_b, wo_b_s, config=cfg.get("wo_b_fp8"))


# ---- fused o_proj (2 launches) ------------------------------------------------------------------
#: int32 tile counters of the in-launch split-K reduction, one buffer per device, zeroed once; every
#: launch leaves them at 0 again (the last split of a tile resets its counter). Launches that share
#: the buffer must be stream-ordered (one stream per device, as the decode step and its CUDA graph).
COUNTER_SLOTS = 4096
FUSED_MAX_T = 64        # the fused path is a decode path: above this many tokens o_proj runs the parts
_QUANT_Z = ("wo_a", "wo_b")


def _counters(device, n: int) -> torch.Tensor:
    """The device's counter buffer, at least ``n`` slots (:func:`ds4lab_kernels._counters.zeroed_counters`)."""
    return zeroed_counters("o_proj", device, n, COUNTER_SLOTS)


def _fused_split(cfg: dict, tiles: int, steps: int, T: int, N: int, K: int, device) -> int:
    """``SPLIT_K`` of a fused launch: the config's int (lowered to the largest divisor of the
    128-deep k steps), or (None) a power of two that brings the programs to ~2 per SM with at least
    2 k steps each and the fp32 partials under 1/8 of the weight bytes (as ``auto_split_k``)."""
    split = cfg.get("SPLIT_K")
    if split is None:
        split = 1
        while (tiles * split < 2 * num_sms(device) and steps % (2 * split) == 0 and steps // (2 * split) >= 2
               and 2 * split * T * N * 4 <= N * K // 8):
            split *= 2
    if not isinstance(split, int) or split < 1:
        raise ValueError(f"config: SPLIT_K={split!r} must be a positive int or None")
    split = min(split, steps)
    while steps % split:  # a short K (tests, small models): the largest split that divides it
        split -= 1
    return split


def _fused_gemm(mode, a, a_s, w, w_s, T, G, N, K, cfg, *, out=None, q=None, qs=None, positions=None,
                cos_sin=None, head_stride=0, head_dim=QUANT_GROUP, rope=0, pow2=True, eps=1e-10,
                counter_base=0):
    """One launch of ``_fused_gemm_kernel`` (A_MODE ``mode``) over ``G`` groups: ``a`` is
    ``[T, G, K]``-addressable (token stride ``a.stride(0)``, group stride ``a.stride(1)``; mode 2 reads
    heads of ``head_dim`` at ``head_stride``), ``w [G, N, K]`` e4m3 with ``w_s [G, N/128, K/128]``."""
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if W_BLOCK % BN and BN % W_BLOCK:
        raise ValueError(f"config: BLOCK_N={BN} must divide {W_BLOCK} (or equal it)")
    if q is not None and BN != W_BLOCK:
        raise ValueError(f"config: quantizing the output needs BLOCK_N={W_BLOCK}, got {BN}")
    n_tiles, m_tiles = triton.cdiv(N, BN), triton.cdiv(T, BM)
    steps = K // W_BLOCK
    split = _fused_split(cfg, n_tiles * m_tiles * G, steps, T, N, K, a.device)
    dev = a.device
    if split > 1:
        part = torch.empty((split, T, G, N), dtype=torch.float32, device=dev)
        pst = part.stride()[:3]
        cnt = _counters(dev, counter_base + n_tiles * m_tiles * G)[counter_base:]
    else:
        part, pst, cnt = w, (0, 0, 0), w
    ast = a_s.stride() if a_s is not None else (0, 0, 0)
    ost = (out.stride(0), out.stride(1)) if out is not None else (0, 0)
    qst = (q.stride(0), q.stride(1), qs.stride(0), qs.stride(1)) if q is not None else (0, 0, 0, 0)
    _fused_gemm_kernel[(n_tiles, m_tiles, G * split)](
        a, a if a_s is None else a_s, a if positions is None else positions,
        a if cos_sin is None else cos_sin, w, w_s, part, cnt,
        w if out is None else out, w if q is None else q, w if qs is None else qs,
        T, N, K // split, 0 if cos_sin is None else cos_sin.shape[0], eps,
        a.stride(0), a.stride(1), head_stride, *ast, 0 if cos_sin is None else cos_sin.stride(0),
        w.stride(0), w.stride(1), *w_s.stride(), *pst, *ost, *qst,
        A_MODE=mode, HEAD_DIM=head_dim, ROPE=rope, POW2=pow2,
        XS_UE8M0=a_s is not None and a_s.dtype == torch.uint8, WS_UE8M0=w_s.dtype == torch.uint8,
        STORE_OUT=out is not None, QUANT_OUT=q is not None,
        QS_UE8M0=qs is not None and qs.dtype == torch.uint8, SPLIT_K=split,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=W_BLOCK, ROPE_SPLIT=bool(cfg.get("ROPE_SPLIT", False)),
        RED_UNROLL=next(u for u in (4, 2, 1) if split % u == 0),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=False)


def _check_fp8_weights(o, G, K, wo_a, wo_a_s, wo_b, wo_b_s, path, name="o"):
    """The FP8 ``wo_a [G, R, K]`` / ``wo_b [N, G*R]`` checks of the paths that launch their own GEMM
    over them (R a multiple of 128, block-scale shapes, unit last strides, one device); returns the
    scales (e8m0 views as uint8)."""
    R, N = wo_a.shape[1], wo_b.shape[0]
    if R % W_BLOCK:
        raise ValueError(f"wo_a: o_lora_rank={R} must be a multiple of {W_BLOCK} on the {path} FP8 path")
    wo_a_s = check.scale_tensor("wo_a_s", wo_a_s, (torch.float32, torch.uint8))
    wo_b_s = check.scale_tensor("wo_b_s", wo_b_s, (torch.float32, torch.uint8))
    if tuple(wo_a_s.shape) != (G, R // W_BLOCK, K // W_BLOCK):
        raise ValueError(f"wo_a_s: shape {tuple(wo_a_s.shape)}, expected ({G}, {R // W_BLOCK}, {K // W_BLOCK})")
    if tuple(wo_b_s.shape) != (triton.cdiv(N, W_BLOCK), G * R // W_BLOCK):
        raise ValueError(f"wo_b_s: shape {tuple(wo_b_s.shape)}, expected "
                         f"({triton.cdiv(N, W_BLOCK)}, {G * R // W_BLOCK})")
    if wo_a.stride(2) != 1 or wo_b.stride(1) != 1:
        raise ValueError("wo_a / wo_b: last dim must be contiguous")
    check.same_device(name, o, wo_a=wo_a, wo_b=wo_b, wo_a_s=wo_a_s, wo_b_s=wo_b_s)
    return wo_a_s, wo_b_s


def _grouped_wo_a(wo_a, wo_a_s, wo_b, G, K, fits, of):
    """``wo_a`` (3-D, or the checkpoint's 2-D ``(G*R, K)``) and its scales viewed ``(G, R, K)`` /
    ``(G, R/128, K/128)``, and ``wo_b``'s width checked against ``G*R``; ``fits`` / ``of`` name the input
    in the errors (e.g. ``"o with 16 heads"``)."""
    if wo_a.dim() == 2:
        if wo_a.shape[0] % max(G, 1) or wo_a.shape[1] != K:
            raise ValueError(f"wo_a: 2-D shape {tuple(wo_a.shape)} does not fit {fits} "
                             f"({G} groups x R rows, K={K})")
        wo_a = wo_a.view(G, wo_a.shape[0] // G, K)
    if wo_a.dim() != 3 or wo_a.shape[0] != G or wo_a.shape[2] != K:
        raise ValueError(f"wo_a: shape {tuple(wo_a.shape)}, expected ({G}, o_lora_rank, {K}) for {of} "
                         f"(wrong head count for this rank?)")
    R = wo_a.shape[1]
    if wo_a_s is not None:
        wo_a_s = check.scale_tensor("wo_a_s", wo_a_s, (torch.float32, torch.uint8))
        if wo_a_s.dim() == 2 and wo_a_s.shape[0] == G * (R // W_BLOCK):
            wo_a_s = wo_a_s.view(G, R // W_BLOCK, wo_a_s.shape[1])
    if wo_b.dim() != 2 or wo_b.shape[1] != G * R:
        raise ValueError(f"wo_b: shape {tuple(wo_b.shape)}, expected (hidden, {G * R})")
    return wo_a, wo_a_s


def _o_proj_3(o, positions, cos_sin_cache, wo_a, wo_a_s, wo_b, wo_b_s, heads_per_group, scale_fmt,
              check_positions, cfg):
    """FP8 ``o_proj`` in three launches (see :func:`o_proj`, ``path="unfused3"``): inverse RoPE + quant,
    the grouped ``wo_a`` product with its split-K summed in the launch (A_MODE 0 of
    ``_fused_gemm_kernel``) and z quantized 1x128 in that epilogue (quant_z "wo_a") or kept bf16
    (quant_z "wo_b"), then ``wo_b``: ``fp8_gemm_nt`` on the fp8 z, or ``w8a8_block_fp8_linear`` (its
    quant in the GEMM prologue; UE8M0 power-of-two scales, so scale_fmt ``fp32`` quantizes z in the
    epilogue instead). Each GEMM sums its split-K partials in its own launch."""
    x, xs = inv_rope_fp8_quant(o, positions, cos_sin_cache, heads_per_group, True, scale_fmt,
                               check_positions=check_positions, config=cfg.get("rope"))
    return _wo_a_wo_b(x, xs, wo_a, wo_a_s, wo_b, wo_b_s, scale_fmt, cfg, "o")


#: up to this many tokens, o_proj's wo_b launch takes fp8_gemm's own pick by token count (the GEMV rows on
#: sm_89) instead of its row's ``wo_b_fp8``; a row pins its own bound with ``"wo_b_pick_max_t"`` (0: always
#: its ``wo_b_fp8``). H200 session 5 sweep (results/issue20/s5/gemm_decode_m2.csv), wo_b 4096 x 2048 at TP=4,
#: sm_89 build, fp8 z, us: M=1 gemv_w8 4.90 vs decode_16x64 7.52, M=2 gemv 6.49 vs 7.43 (NOTES "gemv9");
#: ``ds4lab step --ab o_proj.WO_B_PICK_MAX_T=0`` times the row alone.
WO_B_PICK_MAX_T = 2


def _wo_b_row(cfg: dict, T: int, device) -> dict | None:
    """wo_b's launch row for ``T`` tokens: None (fp8_gemm's own pick) up to the row's bound
    (:data:`WO_B_PICK_MAX_T` unless the row pins one) on a GPU, else the row's ``wo_b_fp8``."""
    if device.type == "cuda" and T <= cfg.get("wo_b_pick_max_t", WO_B_PICK_MAX_T):
        return None
    return cfg.get("wo_b_fp8")


def _wo_a_wo_b(x, xs, wo_a, wo_a_s, wo_b, wo_b_s, scale_fmt, cfg, name):
    """The last two launches of ``path="unfused3"`` on the quantized ``x (T, G, K)`` e4m3 + scales
    ``xs (T, G, K/128)``: the grouped ``wo_a`` product (split-K summed in the launch, z quantized in its
    epilogue or kept bf16: ``quant_z``), then ``wo_b``. ``name``: the input the device errors name."""
    T, G, K = x.shape
    R, N = wo_a.shape[1], wo_b.shape[0]
    wo_a_s, wo_b_s = _check_fp8_weights(x, G, K, wo_a, wo_a_s, wo_b, wo_b_s, "unfused3", name)
    quant_z = cfg.get("quant_z", "wo_a")
    if quant_z not in _QUANT_Z:
        raise ValueError(f"config: quant_z={quant_z!r}, expected one of {_QUANT_Z}")
    if T == 0:
        return torch.empty((T, N), dtype=torch.bfloat16, device=x.device)
    ca = cfg.get("wo_a") or {}
    pow2 = scale_fmt != "fp32"
    from .fp8_gemm import fp8_gemm_nt, w8a8_block_fp8_linear
    if quant_z == "wo_b" and pow2:
        z = torch.empty((T, G, R), dtype=torch.bfloat16, device=x.device)
        _fused_gemm(0, x, xs, wo_a, wo_a_s, T, G, R, K, ca, out=z, pow2=pow2)
        return w8a8_block_fp8_linear(z.view(T, G * R), wo_b, wo_b_s, config=_wo_b_row(cfg, T, x.device))
    zq = torch.empty((T, G, R), dtype=torch.float8_e4m3fn, device=x.device)
    zs = torch.empty((T, G, R // W_BLOCK), dtype=torch.uint8 if scale_fmt == "ue8m0" else torch.float32,
                     device=x.device)
    _fused_gemm(0, x, xs, wo_a, wo_a_s, T, G, R, K, ca, q=zq, qs=zs, pow2=pow2)
    return fp8_gemm_nt(zq.view(T, G * R), zs.view(T, G * R // W_BLOCK), wo_b, wo_b_s,
                       config=_wo_b_row(cfg, T, x.device))


def _o_proj_fused(o, positions, cos_sin_cache, wo_a, wo_a_s, wo_b, wo_b_s, heads_per_group, scale_fmt,
                  check_positions, cfg):
    """FP8 ``o_proj`` in two launches (see :func:`o_proj`, ``path="fused"``)."""
    T, H, D, P, Rd, eps = _check_rope_args(o, positions, cos_sin_cache, heads_per_group, True, scale_fmt,
                                           1e-10, check_positions, "o_proj")
    G, K = H // heads_per_group, heads_per_group * D
    R, N = wo_a.shape[1], wo_b.shape[0]
    wo_a_s, wo_b_s = _check_fp8_weights(o, G, K, wo_a, wo_a_s, wo_b, wo_b_s, "fused")
    out = torch.empty((T, N), dtype=torch.bfloat16, device=o.device)
    if T == 0:
        return out
    ca, cb = cfg.get("wo_a") or {}, cfg.get("wo_b") or {}
    quant_z = cfg.get("quant_z", "wo_a")
    if quant_z not in _QUANT_Z:
        raise ValueError(f"config: quant_z={quant_z!r}, expected one of {_QUANT_Z}")
    pow2 = scale_fmt != "fp32"
    common = dict(pow2=pow2, eps=eps)
    rope = dict(positions=positions, cos_sin=cos_sin_cache, head_stride=o.stride(1), head_dim=D, rope=Rd)
    # view o as [T, G, K]: token stride, group stride = heads_per_group heads
    o_g = o.as_strided((T, G, K), (o.stride(0), heads_per_group * o.stride(1), 1))
    if quant_z == "wo_a":
        zq = torch.empty((T, G, R), dtype=torch.float8_e4m3fn, device=o.device)
        zs = torch.empty((T, G, R // W_BLOCK), dtype=torch.uint8 if scale_fmt == "ue8m0" else torch.float32,
                         device=o.device)
        _fused_gemm(2, o_g, None, wo_a, wo_a_s, T, G, R, K, ca, q=zq, qs=zs, **rope, **common)
        a2, a2_s, mode2 = zq.view(T, 1, G * R), zs.view(T, 1, G * R // W_BLOCK), 0
    else:
        z = torch.empty((T, G, R), dtype=torch.bfloat16, device=o.device)
        _fused_gemm(2, o_g, None, wo_a, wo_a_s, T, G, R, K, ca, out=z, **rope, **common)
        a2, a2_s, mode2 = z.view(T, 1, G * R), None, 1
    n1 = triton.cdiv(R, ca["BLOCK_N"]) * triton.cdiv(T, ca["BLOCK_M"]) * G
    _fused_gemm(mode2, a2, a2_s, wo_b.view(1, N, G * R), wo_b_s.view(1, *wo_b_s.shape), T, 1, N, G * R, cb,
                out=out.view(T, 1, N), counter_base=n1, **common)
    return out


def o_proj(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, wo_a: torch.Tensor,
           wo_b: torch.Tensor, wo_a_s: torch.Tensor | None = None, wo_b_s: torch.Tensor | None = None,
           heads_per_group: int = 8, scale_fmt: str = "ue8m0", check_positions: bool = True,
           config: dict | None = None) -> torch.Tensor:
    """The whole DeepSeek-V4 o-projection: inverse RoPE -> (FP8 quant) -> grouped ``wo_a`` -> ``wo_b``.

    Semantics: vLLM ``deep_gemm_fp8_o_proj`` (DeepSeek-V4 attention ``_o_proj``). FP8 path (``wo_a_s``
    given): :func:`inv_rope_fp8_quant` -> :func:`fp8_einsum_bhr_hdr_bhd` -> ``z`` bf16 ->
    1x128 quant -> block-scaled ``wo_b``. With FP8 ``wo_a`` and ``wo_b`` and ``path="fused"`` (the
    default for ``num_tokens <= FUSED_MAX_T``) the same rounding points run as 2 launches of
    ``_fused_gemm_kernel`` (inverse RoPE + quant in the wo_a prologue, split-K summed in-launch, z
    quantized in the epilogue or in the wo_b prologue); ``path="unfused"`` runs the parts.
    BF16 path (``wo_a_s`` None, ``wo_a`` bfloat16: the
    community checkpoint's MTP drafter): rotated bf16 -> :func:`bf16_einsum_bhr_hdr_bhd` ->
    ``wo_b`` (bf16 when ``wo_b_s`` is None, else block-scaled FP8). The FP8 ``wo_b`` step is
    ``fp8_quant.per_token_group_quant_fp8`` + ``fp8_gemm.fp8_gemm_nt`` (DeepGEMM semantics).

    Args:
        o: ``(num_tokens, num_heads, head_dim)`` bfloat16 attention output (per-rank heads).
        positions: ``(num_tokens,)`` int64/int32.
        cos_sin_cache: ``(max_positions, rope_dim)`` float32, ``cos || sin`` (see module doc).
        wo_a: ``(num_groups, o_lora_rank, heads_per_group*head_dim)`` or the checkpoint's 2-D
            ``(num_groups*o_lora_rank, heads_per_group*head_dim)``; float8_e4m3fn with ``wo_a_s``,
            bfloat16 without.
        wo_b: ``(hidden, num_groups*o_lora_rank)`` float8_e4m3fn with ``wo_b_s``, bfloat16 without.
        wo_a_s: ``(num_groups, o_lora_rank/128, K/128)`` (or 2-D ``(num_groups*o_lora_rank/128, K/128)``)
            float32 or UE8M0 bytes; None selects the BF16 path.
        wo_b_s: ``(hidden/128, num_groups*o_lora_rank/128)`` float32 or UE8M0 bytes, or None (bf16 ``wo_b``).
        heads_per_group: 8 for DeepSeek-V4 at every TP.
        scale_fmt: activation scale encoding of both quant steps (``fp32``, ``pow2``, ``ue8m0``).
        check_positions: see :func:`inv_rope_fp8_quant`.
        config: ``{"path": "unfused", "rope": ..., "einsum": ..., "wo_b": ..., "wo_b_fp8": ...}``: rows
            of ``CONFIGS`` for the parts (``wo_b``: bf16 ``wo_b``; ``wo_b_fp8``: a row of
            ``fp8_gemm.CONFIGS``), or ``{"path": "fused", "quant_z": "wo_a"|"wo_b", "wo_a": {...},
            "wo_b": {...}}`` (launch rows: ``BLOCK_M``, ``BLOCK_N``, ``SPLIT_K`` int or None,
            ``num_warps``, ``num_stages``; e.g. ``CONFIGS[arch]["fused"]``). Any key may be missing
            (``pick_o_proj_config`` / ``fused_config`` fill it in).

    Returns:
        ``(num_tokens, hidden)`` bfloat16.

    Raises:
        TypeError / ValueError: from the parts, plus ``wo_a``/``wo_b`` shapes that do not fit ``o``,
            an unknown ``path`` / ``quant_z``, a fused ``BLOCK_N`` that does not divide 128 (or is
            not 128 where the z quant runs in launch 1's epilogue), a ``SPLIT_K`` < 1.
    """
    check.tensor("o", o, torch.bfloat16)
    check.tensor("wo_a", wo_a, (torch.float8_e4m3fn, torch.bfloat16))
    check.tensor("wo_b", wo_b, (torch.float8_e4m3fn, torch.bfloat16))
    if o.dim() != 3:
        raise ValueError(f"o: expected 3 dims (num_tokens, num_heads, head_dim), got shape {tuple(o.shape)}")
    T, H, D = o.shape
    if not isinstance(heads_per_group, int) or heads_per_group <= 0 or H % heads_per_group:
        raise ValueError(f"o: num_heads={H} is not a multiple of heads_per_group={heads_per_group}")
    G, K = H // heads_per_group, heads_per_group * D
    wo_a, wo_a_s = _grouped_wo_a(wo_a, wo_a_s, wo_b, G, K, f"o with {H} heads", f"o with {H} heads of {D}")
    R = wo_a.shape[1]
    if wo_b_s is not None and wo_b.dtype != torch.float8_e4m3fn:
        raise TypeError(f"wo_b: dtype {wo_b.dtype} with wo_b_s given; expected float8_e4m3fn")
    if wo_b_s is None and wo_b.dtype != torch.bfloat16:
        raise ValueError(f"wo_b: dtype {wo_b.dtype} without wo_b_s; an FP8 wo_b needs its block scales")
    if wo_a_s is None and wo_a.dtype != torch.bfloat16:
        raise ValueError(f"wo_a: dtype {wo_a.dtype} without wo_a_s; an FP8 wo_a needs its block scales")
    cfg = dict(config or {})
    if wo_a_s is not None and wo_b_s is not None:
        path = cfg.get("path") or pick_o_proj_config(T, o.device)["path"]
        if path not in PATHS:
            raise ValueError(f"config: path={path!r}, expected one of {PATHS}")
        if path == "fused":
            return _o_proj_fused(o, positions, cos_sin_cache, wo_a, wo_a_s, wo_b, wo_b_s, heads_per_group,
                                 scale_fmt, check_positions, {**fused_config(o.device), **cfg})
        if path == "unfused3":
            return _o_proj_3(o, positions, cos_sin_cache, wo_a, wo_a_s, wo_b, wo_b_s, heads_per_group,
                             scale_fmt, check_positions, {**unfused3_config(o.device), **cfg})
    if wo_a_s is not None:
        x, xs = inv_rope_fp8_quant(o, positions, cos_sin_cache, heads_per_group, True, scale_fmt,
                                   check_positions=check_positions, config=cfg.get("rope"))
        z = fp8_einsum_bhr_hdr_bhd(x, xs, wo_a, wo_a_s, config=cfg.get("einsum"))
    else:
        x = inv_rope_fp8_quant(o, positions, cos_sin_cache, heads_per_group, False,
                               check_positions=check_positions, config=cfg.get("rope"))
        z = bf16_einsum_bhr_hdr_bhd(x, wo_a, config=cfg.get("einsum"))
    return _wo_b(z.view(T, G * R), wo_b, wo_b_s, scale_fmt, cfg)


def o_proj_fp8_input(x: torch.Tensor, x_s: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor,
                     wo_a_s: torch.Tensor, wo_b_s: torch.Tensor, scale_fmt: str = "ue8m0",
                     config: dict | None = None) -> torch.Tensor:
    """The FP8 o-projection from its already rotated and quantized input: the last two launches of
    ``o_proj(path="unfused3")`` (the grouped ``wo_a`` product with its split-K summed in the launch and z
    quantized 1x128 in that epilogue, then ``wo_b``; the same code), for a producer that wrote
    :func:`inv_rope_fp8_quant`'s output itself (``sparse_mla_decode(o_fp8=True)``: issue 20, ``ofuse``).
    ``o_proj_fp8_input(*inv_rope_fp8_quant(o, ...), ...)`` equals ``o_proj(o, ..., config=<unfused3 row>)``
    bit for bit.

    Args:
        x: ``(num_tokens, num_groups, K)`` float8_e4m3fn (``K = heads_per_group * head_dim``, a multiple
            of 128), last dim contiguous: :func:`inv_rope_fp8_quant`'s ``q``.
        x_s: ``(num_tokens, num_groups, K/128)`` scales, any strides: uint8 UE8M0 bytes (or
            float8_e8m0fnu) with ``scale_fmt="ue8m0"``, float32 with ``"fp32"`` / ``"pow2"``.
        wo_a / wo_b / wo_a_s / wo_b_s: as :func:`o_proj`, FP8 with block scales (all four required).
        scale_fmt: the encoding of ``x_s`` and of the z quant (``fp32``, ``pow2``, ``ue8m0``).
        config: a ``path="unfused3"`` row of ``CONFIGS`` (its ``quant_z``, ``wo_a``, ``wo_b_fp8``; a
            ``rope`` entry is ignored); default ``unfused3_config``.

    Returns:
        ``(num_tokens, hidden)`` bfloat16.

    Raises:
        TypeError: dtypes of ``x`` / ``x_s`` (including a scale dtype that does not match ``scale_fmt``),
            of the weights. ValueError: shapes of ``x`` / ``x_s`` / weights that disagree, missing
            weight scales, an unknown ``scale_fmt``, a config with another ``path``, devices that differ,
            a device without FP8.
    """
    check.tensor("x", x, torch.float8_e4m3fn, ndim=3)
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt={scale_fmt!r}: expected one of {SCALE_FMTS}")
    x_s = check.scale_tensor("x_s", x_s, (torch.float32, torch.uint8))
    want_s = torch.uint8 if scale_fmt == "ue8m0" else torch.float32
    if x_s.dtype != want_s:
        raise TypeError(f"x_s: dtype {x_s.dtype} does not match scale_fmt={scale_fmt!r} (expected {want_s})")
    T, G, K = x.shape
    if K % QUANT_GROUP or K == 0:
        raise ValueError(f"x: K={K} (last dim) must be a positive multiple of {QUANT_GROUP}")
    if tuple(x_s.shape) != (T, G, K // QUANT_GROUP):
        raise ValueError(f"x_s: shape {tuple(x_s.shape)}, expected ({T}, {G}, {K // QUANT_GROUP}) "
                         f"(one scale per 128 columns of x {tuple(x.shape)})")
    check.last_dim_contiguous("x", x)
    for n, t in (("wo_a_s", wo_a_s), ("wo_b_s", wo_b_s)):
        if t is None:
            raise ValueError(f"{n}: required (o_proj_fp8_input is the FP8 path; the BF16 wo_a runs o_proj)")
    check.tensor("wo_a", wo_a, torch.float8_e4m3fn)
    check.tensor("wo_b", wo_b, torch.float8_e4m3fn)
    check.same_device("x", x, x_s=x_s)
    require_fp8("x", x.device, "o_proj_fp8_input")
    wo_a, wo_a_s = _grouped_wo_a(wo_a, wo_a_s, wo_b, G, K, f"x with {G} groups", f"x with {G} groups of {K}")
    cfg = dict(config or {})
    if cfg.get("path", "unfused3") != "unfused3":
        raise ValueError(f"config: path={cfg['path']!r}; o_proj_fp8_input runs the 'unfused3' launches only")
    return _wo_a_wo_b(x, x_s, wo_a, wo_a_s, wo_b, wo_b_s, scale_fmt, {**unfused3_config(x.device), **cfg}, "x")


# ---- config tables -----------------------------------------------------------------------------
# inv-RoPE + quant: BLOCK_R (token, head) rows x 512 per program, four 128-wide chunks (one scale each).
# Memory bound, no shared memory beyond reduction scratch.
# Grouped GEMM: "decode" streams wo_a (32 MiB at TP=1) with BLOCK_M=16 rows, 64-row weight tiles and
# split-K chosen so that about 2 programs per SM are in flight; 4 stages of (16x128 + 64x128) fp8 =
# 40 KiB smem. "prefill" is an MMA-bound tile: sm_89 64x128x128 x4 stages = 72 KiB (< 101,376 B), 8 warps,
# sm_90 128x128x128 x4 stages = 128 KiB. The bf16 path halves BLOCK_K (BLOCK_K_BF16=64) so its
# stages stay the same size.
def _fp8_gemm_row(arch: str, label: str) -> dict | None:
    """A copy of ``fp8_gemm.CONFIGS[arch][label]`` (wo_b's launch row), or None (fp8_gemm's own pick)
    where fp8_gemm.py is not beside this file."""
    try:
        from .fp8_gemm import CONFIGS as gemm_configs
    except ImportError:
        return None
    row = gemm_configs.get(arch, {}).get(label)
    return dict(row) if row else None


CONFIGS = {
    "sm_89": {
        "rope_small": {"BLOCK_R": 2, "num_warps": 2},
        "rope_large": {"BLOCK_R": 16, "num_warps": 4},
        "decode": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K_BF16": 64, "SPLIT_K": None, "num_warps": 4, "num_stages": 4},
        "prefill": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K_BF16": 64, "SPLIT_K": None, "num_warps": 8, "num_stages": 4},
    },
    "sm_90": {
        "rope_small": {"BLOCK_R": 2, "num_warps": 2},
        "rope_large": {"BLOCK_R": 16, "num_warps": 4},
        "decode": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K_BF16": 64, "SPLIT_K": None, "num_warps": 4, "num_stages": 5},
        "prefill": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K_BF16": 64, "SPLIT_K": None, "num_warps": 8, "num_stages": 4},
    },
}
# Whole o_proj (FP8 wo_a and wo_b), one row per candidate of the o_proj bench. "unfused": today's
# parts (inv-RoPE+quant, einsum + its split-K reduce kernel, z quant, fp8_gemm_nt with in-launch
# split-K: 5 launches). "unfused3*" (issue 20, oproj5): 3 launches. Launch 1 = inv-RoPE + quant
# ("rope_chunk": one 128-wide chunk per 1-warp program, 64 programs at T=1 instead of 8 walking 4
# chunks each). Launch 2 = the grouped wo_a product on the quantized x (_fused_gemm_kernel A_MODE 0),
# its split-K summed by each tile's last split in the same launch and, quant_z "wo_a" (BLOCK_N 128 =
# one z quant group per tile), z rounded to bf16 and quantized 1x128 in that epilogue (the bits of
# per_token_group_quant_fp8). Launch 3 = wo_b: fp8_gemm_nt on fp8 z (its own in-launch split-K), or
# quant_z "wo_b": z stays bf16 and w8a8_block_fp8_linear quantizes it in its GEMM prologue. TP=4: wo_a
# 2 x 1024 x 4096 (8 MiB), 16 tiles of 16x128 x split 16 (2 k steps each) = 256 programs, both steps'
# loads in flight (3 stages = 2 buffers of 16 KiB weight + 2 KiB x); "unfused3_s8": split 8 = 128
# programs of 4 k steps (4 stages), half the partials for the last split to sum. wo_b (4096 x 2048, 8 MiB) takes fp8_gemm's "decode_16x64" row
# (H200 M=1: 7.56 us plain / 7.88 fused-quant vs "decode" 9.02 / 8.63; results/issue20/final), and fp8_gemm's
# own pick up to WO_B_PICK_MAX_T tokens (its GEMV rows, timed after that row was chosen).
# "fused": the 2-launch path (inverse RoPE + quant in the wo_a prologue of every k step), kept as
# the 2-launch reference of the launch target; it measured 37-40 us (run 1) and its best
# variant 31.5 us (fused_s8, round 2) vs the parts' 23.7: its other rows (fused_s8, fused_zbf16,
# fused_rsplit, fused_auto) lost twice and were removed (numbers in NOTES.md).
_FUSED_ROWS = {
    "fused": {"path": "fused", "quant_z": "wo_a",
              "wo_a": {"BLOCK_M": 16, "BLOCK_N": 128, "SPLIT_K": 16, "num_warps": 8, "num_stages": 2},
              "wo_b": {"BLOCK_M": 16, "BLOCK_N": 32, "SPLIT_K": 2, "num_warps": 4, "num_stages": 4}},
}
_ROPE_CHUNK = {"BLOCK_R": 1, "CHUNK_GRID": True, "num_warps": 1}
_WO_A_3 = {"BLOCK_M": 16, "BLOCK_N": 128, "SPLIT_K": 16, "num_warps": 4, "num_stages": 3}
_WO_A_3_S8 = {"BLOCK_M": 16, "BLOCK_N": 128, "SPLIT_K": 8, "num_warps": 4, "num_stages": 4}
for _arch_name, _t in CONFIGS.items():
    _t.update({k: {**v, "wo_a": dict(v["wo_a"]), "wo_b": dict(v["wo_b"])} for k, v in _FUSED_ROWS.items()})
    _t["rope_chunk"] = dict(_ROPE_CHUNK)
    _t["unfused"] = {"path": "unfused", "rope": _t["rope_small"], "einsum": _t["decode"], "wo_b": _t["decode"]}
    _wo_b_fp8 = _fp8_gemm_row(_arch_name, "decode_16x64")
    _t["unfused3"] = {"path": "unfused3", "quant_z": "wo_a", "rope": _t["rope_chunk"], "wo_a": dict(_WO_A_3),
                      "wo_b_fp8": _wo_b_fp8}
    _t["unfused3_s8"] = {"path": "unfused3", "quant_z": "wo_a", "rope": _t["rope_chunk"], "wo_a": dict(_WO_A_3_S8),
                         "wo_b_fp8": _wo_b_fp8}
    _t["unfused3_zbf16"] = {"path": "unfused3", "quant_z": "wo_b", "rope": _t["rope_chunk"], "wo_a": dict(_WO_A_3),
                            "wo_b_fp8": _wo_b_fp8}
PATHS = ("fused", "unfused", "unfused3")
FUSED_LABELS = tuple(_FUSED_ROWS)
UNFUSED3_LABELS = ("unfused3", "unfused3_s8", "unfused3_zbf16")
OPROJ_LABELS = FUSED_LABELS + UNFUSED3_LABELS + ("unfused",)
#: the o_proj row used for T <= FUSED_MAX_T on a GPU (the H200 run of scripts/gpu/oproj.sh picks it;
#: "unfused" restores the parts). Above FUSED_MAX_T o_proj runs the parts.
#: H200 (issue 20, first run): TP4 cold L2, T=1..16, the fused 2-launch path 37-40 us (sm_89 build and
#: native), the parts 24.4-25.5 us: the parts stay the default until a fused row beats them.
#: Rule for the 3-launch rows (NOTES.md "o_proj in 3 launches"): the unfused3* row with the lowest p50
#: summed over T = 1, 2, 8 of its own build, if oproj_check passes it and it beats "unfused" there.
#: H200 (issue 20, session 5; results/issue20/s5/oproj_*): unfused3_s8 (3 launches) T=1/2/8 18.36 / 18.75 /
#: 19.33 us on the sm_89 build, 18.31 / 18.47 / 19.32 native, vs unfused (5 launches) 23.82 / 23.68 / 23.83
#: and 23.55 / 23.63 / 23.75; unfused3 19.3 / 19.2 / 20.5, unfused3_zbf16 18.5 / 21.3 / 22.6, fused 36-38.
#: T=16 / 32 (sm_89 build): unfused3_s8 20.56 / 24.44 us vs unfused 22.33 / 27.23 (results/issue20/s5/
#: oproj_bench_t16_32.csv); above DECODE_DEFAULT_MAX_T (untimed) the parts run.
DECODE_DEFAULT = {"sm_89": "unfused3_s8", "sm_90": "unfused3_s8"}
DECODE_DEFAULT_MAX_T = 32
# the interpreter runs programs one by one in Python: one m tile, wide n tiles, split 2 (so the
# in-launch split-K reduction is exercised by every CPU test)
_INTERP_FUSED = {"path": "fused", "quant_z": "wo_a",
                 "wo_a": {"BLOCK_M": 64, "BLOCK_N": 128, "SPLIT_K": 2, "num_warps": 4, "num_stages": 1},
                 "wo_b": {"BLOCK_M": 64, "BLOCK_N": 128, "SPLIT_K": 2, "num_warps": 4, "num_stages": 1}}
_INTERP_UNFUSED3 = {"path": "unfused3", "quant_z": "wo_a", "rope": _ROPE_CHUNK,
                    "wo_a": {"BLOCK_M": 64, "BLOCK_N": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 1}}
_INTERP_ROPE = {"BLOCK_R": 128, "num_warps": 4}
_INTERP_EINSUM = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K_BF16": 128, "SPLIT_K": None, "num_warps": 4, "num_stages": 1}
ROPE_LABELS = ("rope_small", "rope_large")
EINSUM_LABELS = ("decode", "prefill")
DECODE_MAX_T = 64


# the rows the pickers can return on a GPU (the compile report builds only these for sm_120): the rope
# and einsum rows by size, the o_proj decode default and the parts
GPU_DEFAULTS = {a: tuple(dict.fromkeys(("rope_small", "rope_large", "decode", "prefill", "unfused", DECODE_DEFAULT[a])))
                for a in CONFIGS}


def auto_split_k(T, G, N, K, BM, BN, BK, device) -> int:
    """Power-of-two split of the k-steps so that about 2 programs per SM stream the weight, keeping
    at least 2 k-steps per program and the fp32 partials under 1/8 of the weight bytes."""
    tiles = G * triton.cdiv(N, BN) * triton.cdiv(T, BM)
    steps = K // BK
    target = 2 * num_sms(device)
    split = 1
    while (tiles * split < target and steps % (2 * split) == 0 and steps // (2 * split) >= 2
           and 2 * split * T * N * 4 <= N * K // 8):
        split *= 2
    return split


def _pick_rope_config(n_rows: int, device) -> dict:
    if device.type != "cuda":  # interpreter: each program costs Python time, use few big ones
        return _INTERP_ROPE
    return CONFIGS[arch_of(device)]["rope_small" if n_rows <= 1024 else "rope_large"]


def pick_einsum_config(T: int, device) -> dict:
    if device.type != "cuda":  # interpreter: fewest k-iterations in total
        return _INTERP_EINSUM
    return CONFIGS[arch_of(device)]["decode" if T <= DECODE_MAX_T else "prefill"]


def fused_config(device) -> dict:
    """The fused-path row filled in when a config names ``path="fused"`` without its launch rows."""
    if device.type != "cuda":
        return _INTERP_FUSED
    table = CONFIGS[arch_of(device)]
    row = table[DECODE_DEFAULT[arch_of(device)]]
    return row if row["path"] == "fused" else table["fused"]


def unfused3_config(device) -> dict:
    """The 3-launch row filled in when a config names ``path="unfused3"`` without its launch rows."""
    if device.type != "cuda":
        return _INTERP_UNFUSED3
    table = CONFIGS[arch_of(device)]
    row = table[DECODE_DEFAULT[arch_of(device)]]
    return row if row["path"] == "unfused3" else table["unfused3"]


def pick_o_proj_config(T: int, device) -> dict:
    """Default o_proj row: the fused path for decode (T <= FUSED_MAX_T; ``DECODE_DEFAULT`` on a GPU,
    ``_INTERP_FUSED`` on the interpreter), the parts above."""
    if T > FUSED_MAX_T:
        return {"path": "unfused"}
    if device.type != "cuda":
        return _INTERP_FUSED
    if T > DECODE_DEFAULT_MAX_T:
        return {"path": "unfused"}
    return CONFIGS[arch_of(device)][DECODE_DEFAULT[arch_of(device)]]
