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
from ._arch import arch_of, num_sms, require_fp8
from ._fp8 import fp32_pow2_to_ue8m0, quant_rows_e4m3, ue8m0_to_fp32

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
    QUANTIZE: tl.constexpr, SCALE_FMT: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens * num_heads, BLOCK_R),)``.
    One program: BLOCK_R (token, head) rows x HEAD_DIM, walked in GROUP-wide chunks (rotate back, quantize).

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
    for c in tl.static_range(CHUNKS):
        d = c * GROUP + cols
        x = tl.load(in_row + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        if c * GROUP + GROUP > NOPE:
            is_rope = d >= NOPE
            r = tl.maximum(d - NOPE, 0)
            m2 = rmask[:, None] & is_rope[None, :]
            xp = tl.load(in_row + (d ^ 1)[None, :], mask=m2, other=0.0).to(tl.float32)
            ci = (r >> 1)[None, :]
            cs_row = cs_ptr + pos[:, None] * stride_cs
            cosv = tl.load(cs_row + ci, mask=m2, other=1.0)
            sinv = tl.load(cs_row + HALF + ci, mask=m2, other=0.0)
            a = x * cosv
            b = xp * sinv
            rot = tl.where(((r & 1) == 0)[None, :], a + b, a - b)
            x = tl.where(is_rope[None, :], rot, x)
        x = tl.where(bad[:, None], float("nan"), x)
        if QUANTIZE:
            q, s = quant_rows_e4m3(x, eps, SCALE_FMT != 0)
            tl.store(out_row + d[None, :], q, mask=rmask[:, None])
            s_off = s_ptr + t * stride_s_t + h * CHUNKS + c
            if SCALE_FMT == 2:
                tl.store(s_off, fp32_pow2_to_ue8m0(s).to(tl.uint8), mask=rmask)
            else:
                tl.store(s_off, s, mask=rmask)
        else:
            tl.store(out_row + d[None, :], x.to(tl.bfloat16), mask=rmask[:, None])


@triton.jit
def _decode_scale(v, IS_UE8M0: tl.constexpr):
    """fp32 scale, or a UE8M0 byte -> 2^(b-127) (0 -> 0.0, 255 -> NaN; ``_fp8.ue8m0_to_fp32``)."""
    if IS_UE8M0:
        return ue8m0_to_fp32(v)
    else:
        return v


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
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_z = tl.program_id(2)
    g = (pid_z // SPLIT_K).to(tl.int64)
    s = pid_z % SPLIT_K
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < T
    nmask = rn < N
    rm64 = rm.to(tl.int64)
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


# ---- launchers ---------------------------------------------------------------------------------
def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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
        config: a row of ``CONFIGS`` (``BLOCK_R`` (token, head) rows per program, ``num_warps``); default picks by size.

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
        require_fp8("o", o.device, "inv_rope_fp8_quant(quantize=True)")
    if T and check_positions and not _capturing(o.device):
        if P == 0:
            raise ValueError("cos_sin_cache: has no rows (max_positions=0)")
        lo, hi = (int(v) for v in torch.aminmax(positions))
        if lo < 0 or hi >= P:
            raise ValueError(f"positions: values in [{lo}, {hi}] but cos_sin_cache has rows [0, {P}) "
                             f"(missing cos/sin rows)")
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
    grid = (triton.cdiv(T * H, cfg["BLOCK_R"]),)
    _inv_rope_quant_kernel[grid](
        o, positions, cos_sin_cache, q, s,
        T * H, H, P, o.stride(0), o.stride(1), cos_sin_cache.stride(0), G * K,
        s.stride(0) if quantize else 0, eps,
        HEAD_DIM=D, ROPE=R, GROUP=QUANT_GROUP, BLOCK_R=cfg["BLOCK_R"],
        QUANTIZE=bool(quantize), SCALE_FMT=_FMT_CODE[scale_fmt],
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


def o_proj(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, wo_a: torch.Tensor,
           wo_b: torch.Tensor, wo_a_s: torch.Tensor | None = None, wo_b_s: torch.Tensor | None = None,
           heads_per_group: int = 8, scale_fmt: str = "ue8m0", check_positions: bool = True,
           config: dict | None = None) -> torch.Tensor:
    """The whole DeepSeek-V4 o-projection: inverse RoPE -> (FP8 quant) -> grouped ``wo_a`` -> ``wo_b``.

    Semantics: vLLM ``deep_gemm_fp8_o_proj`` (DeepSeek-V4 attention ``_o_proj``). FP8 path (``wo_a_s``
    given): :func:`inv_rope_fp8_quant` -> :func:`fp8_einsum_bhr_hdr_bhd` -> ``z`` bf16 ->
    1x128 quant -> block-scaled ``wo_b``. BF16 path (``wo_a_s`` None, ``wo_a`` bfloat16: the
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
        config: ``{"rope": ..., "einsum": ..., "wo_b": ..., "wo_b_fp8": ...}``: rows of ``CONFIGS``
            for the parts (``wo_b``: bf16 ``wo_b``; ``wo_b_fp8``: a row of ``fp8_gemm.CONFIGS``);
            any may be missing (default picks by size).

    Returns:
        ``(num_tokens, hidden)`` bfloat16.

    Raises:
        TypeError / ValueError: from the parts, plus ``wo_a``/``wo_b`` shapes that do not fit ``o``.
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
    if wo_a.dim() == 2:
        if wo_a.shape[0] % max(G, 1) or wo_a.shape[1] != K:
            raise ValueError(f"wo_a: 2-D shape {tuple(wo_a.shape)} does not fit o with {H} heads "
                             f"({G} groups x R rows, K={K})")
        wo_a = wo_a.view(G, wo_a.shape[0] // G, K)
    if wo_a.dim() != 3 or wo_a.shape[0] != G or wo_a.shape[2] != K:
        raise ValueError(f"wo_a: shape {tuple(wo_a.shape)}, expected ({G}, o_lora_rank, {K}) for o with "
                         f"{H} heads of {D} (wrong head count for this rank?)")
    R = wo_a.shape[1]
    if wo_a_s is not None:
        wo_a_s = check.scale_tensor("wo_a_s", wo_a_s, (torch.float32, torch.uint8))
        if wo_a_s.dim() == 2 and wo_a_s.shape[0] == G * (R // W_BLOCK):
            wo_a_s = wo_a_s.view(G, R // W_BLOCK, wo_a_s.shape[1])
    if wo_b.dim() != 2 or wo_b.shape[1] != G * R:
        raise ValueError(f"wo_b: shape {tuple(wo_b.shape)}, expected (hidden, {G * R})")
    if wo_b_s is not None and wo_b.dtype != torch.float8_e4m3fn:
        raise TypeError(f"wo_b: dtype {wo_b.dtype} with wo_b_s given; expected float8_e4m3fn")
    if wo_b_s is None and wo_b.dtype != torch.bfloat16:
        raise ValueError(f"wo_b: dtype {wo_b.dtype} without wo_b_s; an FP8 wo_b needs its block scales")
    if wo_a_s is None and wo_a.dtype != torch.bfloat16:
        raise ValueError(f"wo_a: dtype {wo_a.dtype} without wo_a_s; an FP8 wo_a needs its block scales")
    cfg = config or {}
    if wo_a_s is not None:
        x, xs = inv_rope_fp8_quant(o, positions, cos_sin_cache, heads_per_group, True, scale_fmt,
                                   check_positions=check_positions, config=cfg.get("rope"))
        z = fp8_einsum_bhr_hdr_bhd(x, xs, wo_a, wo_a_s, config=cfg.get("einsum"))
    else:
        x = inv_rope_fp8_quant(o, positions, cos_sin_cache, heads_per_group, False,
                               check_positions=check_positions, config=cfg.get("rope"))
        z = bf16_einsum_bhr_hdr_bhd(x, wo_a, config=cfg.get("einsum"))
    return _wo_b(z.view(T, G * R), wo_b, wo_b_s, scale_fmt, cfg)


# ---- config tables -----------------------------------------------------------------------------
# inv-RoPE + quant: BLOCK_R (token, head) rows x 512 per program, four 128-wide chunks (one scale each).
# Memory bound, no shared memory beyond reduction scratch.
# Grouped GEMM: "decode" streams wo_a (32 MiB at TP=1) with BLOCK_M=16 rows, 64-row weight tiles and
# split-K chosen so that about 2 programs per SM are in flight; 4 stages of (16x128 + 64x128) fp8 =
# 40 KiB smem. "prefill" is an MMA-bound tile: sm_89 64x128x128 x4 stages = 72 KiB (< 101,376 B), 8 warps,
# sm_90 128x128x128 x4 stages = 128 KiB. The bf16 path halves BLOCK_K (BLOCK_K_BF16=64) so its
# stages stay the same size.
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
_INTERP_ROPE = {"BLOCK_R": 128, "num_warps": 4}
_INTERP_EINSUM = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K_BF16": 128, "SPLIT_K": None, "num_warps": 4, "num_stages": 1}
ROPE_LABELS = ("rope_small", "rope_large")
EINSUM_LABELS = ("decode", "prefill")
DECODE_MAX_T = 64


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
