"""Block-scaled FP8 GEMM ``D = (A, sA) @ (B, sB)^T`` (DeepSeek-V4 dense linears, DeepGEMM ``fp8_gemm_nt``).

``A`` ``(M, K)`` e4m3 activations with one scale per row and 128-wide k-block (dynamic 1x128
groups), ``B`` ``(N, K)`` e4m3 weights with one scale per 128x128 block, bf16 ``D`` ``(M, N)``:

    D[m, n] = sum_kb  dot(A[m, kb], B[n, kb]) * sA[m, kb] * sB[n // 128, kb]

The K loop walks 128-wide k-blocks so each scale is applied once per block to an fp32 partial of a
native fp8 ``tl.dot`` (``mma.sync m16n8k32 e4m3`` = SASS QMMA on sm_89, wgmma on sm_90 for the
large tiles). Scale encodings are chosen by dtype and decoded in-kernel (constexpr flags; no host
conversion pass): float32 (plain or power-of-two), uint8 UE8M0 bytes, int32 with four UE8M0 bytes
per word (DeepGEMM's packed layout). Any scale strides are accepted (row-major or DeepGEMM's
MN-major / TMA-aligned layout).

Small M (decode) is weight-streaming: narrow tiles (16 x 32) and, when the tiles cannot fill the
GPU, split-K in the same launch: every split stores its fp32 partial tile to a workspace slot and
bumps the tile's arrival counter; the last to arrive sums the slots in split order (bitwise
deterministic, independent of arrival order), writes bf16 D and resets the counter (no second
kernel, no host sync, counters reused by every CUDA-graph replay). Large M uses 128 x 128 tiles,
grouped tile order for L2.

``w8a8_block_fp8_linear`` takes bf16 activations and, at decode sizes, quantizes them per 1x128
group (UE8M0) in the GEMM's K loop: one launch per linear instead of quant + GEMM.
"""
import torch
import triton
import triton.language as tl

from . import _checks as check
from ._counters import zeroed_counters
from ._arch import arch_of, num_sms, require_fp8
from ._fp8 import ACT_QUANT_EPS, fp32_pow2_to_ue8m0, quant_rows_e4m3_pow2, ue8m0_to_fp32

BLOCK_K = 128


@triton.jit
def _scale_ptr(row_ptr, kb, stride_k, FMT: tl.constexpr):
    """Address of k-block ``kb``'s scale (FMT 2: the int32 word holding it) in the row(s) ``row_ptr``."""
    if FMT == 2:
        return row_ptr + (kb // 4) * stride_k
    else:
        return row_ptr + kb * stride_k


@triton.jit
def _decode_scale(raw, kb, FMT: tl.constexpr):
    """fp32 scale(s) of k-block(s) ``kb`` from the loaded value(s) ``raw`` (see ``_load_scale``)."""
    if FMT == 0:
        s = raw
    elif FMT == 1:
        s = ue8m0_to_fp32(raw)
    else:
        s = ue8m0_to_fp32((raw >> ((kb % 4) * 8)) & 0xFF)
    return s


@triton.jit
def _load_scale(ptr, kb, FMT: tl.constexpr):
    """Scale(s) of k-block ``kb``; ``ptr`` already points at column 0 of the row(s).
    FMT 0: float32 (column kb), 1: uint8 UE8M0 (column kb), 2: int32 packed (byte kb%4 of word kb//4).
    The column stride is folded into ``ptr`` by the caller through ``stride_k``."""
    if FMT == 0:
        s = tl.load(ptr)
    elif FMT == 1:
        s = ue8m0_to_fp32(tl.load(ptr))
    else:
        w = tl.load(ptr)
        s = ue8m0_to_fp32((w >> ((kb % 4) * 8)) & 0xFF)
    return s


@triton.jit
def _act_load(ptrs, mask, up_off, limit, ACT: tl.constexpr, MASKED: tl.constexpr):
    """bf16/fp16/fp32 activations at ``ptrs`` as fp32 (``MASKED``: masked, 0 outside). ``ACT`` 1: ``ptrs`` point into the gate half of
    a fused gate/up row and ``up_off`` elements further is its up half; returns
    ``bf16(silu(min(g, limit)) * clamp(u, -limit, limit))`` as fp32, the op sequence of
    ``norm_rope._swiglu_clamp_kernel`` (so the fused prologue is bit-identical to that kernel's output)."""
    if ACT == 1:
        if MASKED:
            g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(ptrs + up_off, mask=mask, other=0.0).to(tl.float32)
        else:
            g = tl.load(ptrs).to(tl.float32)
            u = tl.load(ptrs + up_off).to(tl.float32)
        g = tl.where(g > limit, limit, g)
        u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
        x = (g * tl.sigmoid(g) * u).to(tl.bfloat16).to(tl.float32)
    elif MASKED:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(ptrs).to(tl.float32)
    return x


@triton.jit
def _store_tile(acc, d_ptr, offs_m, offs_n, M, N, stride_dm, ws_ptr, cnt_ptr, tile_id, pid_k,
                BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """Store of the fp32 ``acc [BM, BN]`` in D's dtype (bf16, or fp32 unrounded; rows ``offs_m``, cols
    ``offs_n``, masked to M x N).
    ``SPLIT``: split-K in one launch. The program stores its partial to slot ``ws[tile_id, pid_k]``,
    then bumps the tile's arrival counter (acq_rel, gpu scope); the program that arrives last sums
    the ``num_programs(1)`` slots in split order (bitwise deterministic), writes bf16 D and resets
    the counter to 0 for the next launch (no second kernel, no host sync)."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    d_ptrs = d_ptr + offs_m.to(tl.int64)[:, None] * stride_dm + offs_n[None, :]
    if SPLIT:
        n_split = tl.num_programs(1)
        tile = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        slot0 = ws_ptr + tile_id.to(tl.int64) * n_split * (BM * BN)
        tl.store(slot0 + pid_k * (BM * BN) + tile, acc, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's partial is written before the arrival is published
        arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if arrived == n_split - 1:
            tot = tl.zeros((BM, BN), dtype=tl.float32)
            for s in range(0, n_split):
                tot += tl.load(slot0 + s * (BM * BN) + tile, cache_modifier=".cg")
            tl.store(d_ptrs, tot.to(d_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(d_ptrs, acc.to(d_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_nt_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, d_ptr, ws_ptr, cnt_ptr,
    M, N, K,
    stride_am, stride_bn, stride_dm,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    kb_per_split, eps, limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_FMT: tl.constexpr, B_FMT: tl.constexpr, A_BF16: tl.constexpr, SPLIT: tl.constexpr,
    A_ROWS: tl.constexpr, ACT: tl.constexpr = 0, SCALE_PF: tl.constexpr = 0, Q_CVT: tl.constexpr = 0,
):
    """Grid ``(cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), split)``: output tiles in GROUP_M order x k splits.
    One program: a BLOCK_M x BLOCK_N tile of D over its split's k-blocks.

    ``A_BF16``: ``a_ptr`` holds bf16 activations, quantized here per (row, k-block) exactly as
    ``per_token_group_quant_fp8(x, 128, scale_fmt="ue8m0")`` does (``sa_ptr`` unused).
    ``SPLIT`` (split-K in one launch): each program stores its fp32 partial tile to its slot
    ``ws[tile, pid_k]``, then bumps the tile's arrival counter (acq_rel, gpu scope); the program that
    arrives last sums the ``split`` slots in split order (bitwise deterministic), writes bf16 D and
    resets the counter to 0 for the next launch (no second kernel, no host sync).
    ``ACT`` 1 (with ``A_BF16``): ``a_ptr`` is the shared expert's gate/up output ``(M, 2K)`` and A is
    its clamped SwiGLU (``_act_load``), quantized as above. ``SCALE_PF``: each k-block's scales are
    loaded one iteration ahead (off the critical path; the loads are 1-4 B, below cp.async's 4 B
    granule for uint8, so the pipeliner leaves them synchronous in the loop)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped tile order: GROUP_M row-tiles share each streamed column of B tiles (L2 reuse)
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_size
    pid_n = (pid % num_in_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # out-of-range rows/cols read row M-1 / N-1 (always valid) and are masked at the store
    rows_a = tl.minimum(offs_m, M - 1).to(tl.int64)
    rows_b = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    n_kb = K // BLOCK_K
    kb_lo = pid_k * kb_per_split
    kb_hi = tl.minimum(kb_lo + kb_per_split, n_kb)

    if A_ROWS == 1:
        # one real row (M=1); its next k-block is prefetched into registers one iteration ahead
        # (1 bf16 per thread is too narrow for the pipeliner's cp.async)
        a_ptrs = a_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_am + (kb_lo * BLOCK_K + offs_k)[None, :]
        x_next = _act_load(a_ptrs, (kb_lo < kb_hi), K, limit, ACT, True)
    else:
        a_ptrs = a_ptr + rows_a[:, None] * stride_am + (kb_lo * BLOCK_K + offs_k)[None, :]
    b_ptrs = b_ptr + rows_b[:, None] * stride_bn + (kb_lo * BLOCK_K + offs_k)[None, :]
    sa_row = sa_ptr + rows_a * stride_sam
    if BLOCK_N <= 128:
        # BLOCK_N divides 128: the whole tile lies in one 128-row block of B -> one scalar scale
        sb_row = sb_ptr + ((pid_n * BLOCK_N) // 128) * stride_sbn
    else:
        sb_row = sb_ptr + (rows_b // 128) * stride_sbn

    if SCALE_PF:
        sb_next = tl.load(_scale_ptr(sb_row, kb_lo, stride_sbk, B_FMT), mask=(kb_lo < kb_hi), other=0)
        if not A_BF16:
            sa_next = tl.load(_scale_ptr(sa_row, kb_lo, stride_sak, A_FMT), mask=(kb_lo < kb_hi), other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        b = tl.load(b_ptrs)
        if A_BF16:
            # the 1x128 group quant of fp8_quant (bit-identical helper), scale through its UE8M0
            # byte and back
            if A_ROWS == 1:
                xr = x_next
                x_next = _act_load(a_ptrs + BLOCK_K, (kb + 1 < kb_hi), K, limit, ACT, True)
                a, sa = quant_rows_e4m3_pow2(xr, eps, Q_CVT)  # one row, not BLOCK_M copies of it
                a = tl.broadcast_to(a, (BLOCK_M, BLOCK_K))
                sa = tl.broadcast_to(sa, (BLOCK_M,))
            else:
                a, sa = quant_rows_e4m3_pow2(_act_load(a_ptrs, None, K, limit, ACT, False), eps, Q_CVT)
            sa = ue8m0_to_fp32(fp32_pow2_to_ue8m0(sa))
        else:
            a = tl.load(a_ptrs)
            if SCALE_PF:
                sa = _decode_scale(sa_next, kb, A_FMT)
                sa_next = tl.load(_scale_ptr(sa_row, kb + 1, stride_sak, A_FMT), mask=(kb + 1 < kb_hi), other=0)
            elif A_FMT == 2:
                sa = _load_scale(sa_row + (kb // 4) * stride_sak, kb, A_FMT)
            else:
                sa = _load_scale(sa_row + kb * stride_sak, kb, A_FMT)
        if SCALE_PF:
            sb = _decode_scale(sb_next, kb, B_FMT)
            sb_next = tl.load(_scale_ptr(sb_row, kb + 1, stride_sbk, B_FMT), mask=(kb + 1 < kb_hi), other=0)
        elif B_FMT == 2:
            sb = _load_scale(sb_row + (kb // 4) * stride_sbk, kb, B_FMT)
        else:
            sb = _load_scale(sb_row + kb * stride_sbk, kb, B_FMT)
        part = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
        if BLOCK_N <= 128:
            acc += part * (sa * sb)[:, None]
        else:
            acc += part * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    _store_tile(acc, d_ptr, offs_m, offs_n, M, N, stride_dm, ws_ptr, cnt_ptr, pid, pid_k, BLOCK_M, BLOCK_N, SPLIT)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, d_ptr, ws_ptr, cnt_ptr,
    M, N, K,
    stride_am, stride_bn, stride_dm,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    kb_per_split, eps, limit,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, KTILE: tl.constexpr,
    A_FMT: tl.constexpr, B_FMT: tl.constexpr, A_BF16: tl.constexpr, SPLIT: tl.constexpr,
    ACT: tl.constexpr = 0, Q_CVT: tl.constexpr = 0,
):
    """Decode GEMV (M <= 4): grid ``(cdiv(M, ROWS) * cdiv(N, BLOCK_N), split)``. One program: ``ROWS``
    rows x ``BLOCK_N`` columns of D over its split's k-blocks, in chunks of ``KTILE`` columns (one
    chunk when the split fits: the launcher sizes ``KTILE``).

    No tensor cores, no shared-memory staging: each chunk of the weight, ``[BLOCK_N, KTILE]`` e4m3,
    is ONE register load (16 B per thread per instruction, every byte of the chunk in flight at
    once), and so are its scales (a vector load per chunk, not a scalar per k-block) and the
    activation row. Per 128-group the two scales are folded into the activation
    (``a_eff = q * (sA * sB)``, ``BLOCK_N`` divides 128 so one weight block row), and
    ``D[m, n] = sum_k a_eff[m, k] * B[n, k]`` accumulates in fp32 on CUDA cores (every fp8 product is
    exact in fp32; a different summation order than the MMA path, within the same numerics budget).
    ``A_BF16`` / ``ACT``: the activation row is quantized here per 1x128 group (UE8M0), bit for bit
    as ``per_token_group_quant_fp8`` / after the clamped SwiGLU (``_act_load``). ``SPLIT``: split-K
    in the same launch (``_store_tile``)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    G_T: tl.constexpr = KTILE // 128
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_b = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_r = pid_m * ROWS + tl.arange(0, ROWS)
    n_kb = K // 128
    kb_lo = pid_k * kb_per_split
    kb_hi = tl.minimum(kb_lo + kb_per_split, n_kb)
    sb_row = sb_ptr + ((pid_n * BLOCK_N) // 128) * stride_sbn
    kcol = tl.arange(0, KTILE)
    kg = tl.arange(0, G_T)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(kb_lo * 128, kb_hi * 128, KTILE):
        cols = k0 + kcol
        cmask = cols < kb_hi * 128
        kbs = k0 // 128 + kg
        gmask = kbs < kb_hi
        w = tl.load(b_ptr + rows_b[:, None] * stride_bn + cols[None, :], mask=cmask[None, :], other=0.0)
        sb = _decode_scale(tl.load(_scale_ptr(sb_row, kbs, stride_sbk, B_FMT), mask=gmask, other=0), kbs, B_FMT)
        sb = tl.where(gmask, sb, 0.0)
        wf = w.to(tl.float32)
        for r in tl.static_range(ROWS):
            m = tl.minimum(pid_m * ROWS + r, M - 1).to(tl.int64)
            if A_BF16:
                x = _act_load(a_ptr + m * stride_am + cols, cmask, K, limit, ACT, True)
                q, sa = quant_rows_e4m3_pow2(tl.reshape(x, (G_T, 128)), eps, Q_CVT)
                sa = ue8m0_to_fp32(fp32_pow2_to_ue8m0(sa))
            else:
                q = tl.reshape(tl.load(a_ptr + m * stride_am + cols, mask=cmask, other=0.0), (G_T, 128))
                sa = _decode_scale(tl.load(_scale_ptr(sa_ptr + m * stride_sam, kbs, stride_sak, A_FMT),
                                           mask=gmask, other=0), kbs, A_FMT)
            a_eff = tl.reshape(q.to(tl.float32) * (sa * sb)[:, None], (KTILE,))
            part = tl.sum(wf * a_eff[None, :], axis=1)
            acc = tl.where((tl.arange(0, ROWS) == r)[:, None], acc + part[None, :], acc)
    _store_tile(acc, d_ptr, offs_r, offs_n, M, N, stride_dm, ws_ptr, cnt_ptr, pid, pid_k, ROWS, BLOCK_N, SPLIT)


# ---- launcher ----------------------------------------------------------------------------------

_FMT_OF = {torch.float32: 0, torch.uint8: 1, torch.int32: 2}
_FMT_NAME = {0: "float32", 1: "uint8 UE8M0", 2: "int32 packed UE8M0"}


def _check_scale(name: str, s, rows: int, groups: int, a: torch.Tensor) -> tuple[torch.Tensor, int]:
    s = check.scale_tensor(name, s, tuple(_FMT_OF))
    fmt = _FMT_OF[s.dtype]
    cols = groups if fmt != 2 else -(-groups // 4)
    if s.dim() != 2 or tuple(s.shape) != (rows, cols):
        raise ValueError(f"{name}: {_FMT_NAME[fmt]} scales must have shape ({rows}, {cols}), "
                         f"got {tuple(s.shape)}")
    check.same_device("a", a, **{name: s})
    if any(st < 0 for st in s.stride()):
        raise ValueError(f"{name}: negative strides {tuple(s.stride())} are not supported")
    return s, fmt


def fp8_gemm_nt(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Block-scaled FP8 GEMM, ``D = (a * a_scale) @ (b * b_scale)^T`` in bf16.

    Semantics: DeepGEMM ``fp8_gemm_nt`` (1x128 activation scales, 128x128 weight scales), the op
    behind vLLM's ``W8A8BlockFp8LinearOp`` / ``w8a8_triton_block_scaled_mm`` with
    ``block_size=[128, 128]``: ``D[m, n] = sum_kb dot(a[m, kb], b[n, kb]) * a_scale[m, kb] *
    b_scale[n // 128, kb]``, fp32 accumulation, rounded once to bf16.

    Args:
        a: ``(num_tokens, K)`` float8_e4m3fn activations, ``a.stride(1) == 1``.
        a_scale: per (token, 128-wide k-block) scales: ``(num_tokens, K/128)`` float32 (plain or
            power-of-two) or uint8 / float8_e8m0fnu UE8M0 bytes (``2^(b-127)``; 0 -> 0, 255 -> NaN),
            or ``(num_tokens, ceil(K/512))`` int32 with four UE8M0 bytes per word (little-endian
            along k-blocks; DeepGEMM packing). Any non-negative strides (row- or MN-major).
        b: ``(N, K)`` float8_e4m3fn weight (``nn.Linear`` layout, NT GEMM), ``b.stride(1) == 1``.
        b_scale: per 128x128 block: ``(ceil(N/128), K/128)`` float32 / uint8 / float8_e8m0fnu, or
            ``(ceil(N/128), ceil(K/512))`` int32 packed. ``N`` need not be a multiple of 128.
        out: optional ``(num_tokens, N)`` bfloat16 (or float32: D unrounded) output with ``out.stride(1) == 1``.
        config: a row of ``CONFIGS[arch]`` (``BLOCK_M``, ``BLOCK_N``, ``GROUP_M``, ``SPLIT_K`` int
            or ``"auto"``, optional ``SPLIT_PER_SM`` (auto split target, default 2), ``num_warps``,
            ``num_stages``); default picks by ``num_tokens``.

    Returns:
        ``(num_tokens, N)`` bfloat16 (``out``'s dtype when given). NaN in a scale or value propagates to the
        affected outputs.

    Raises:
        TypeError: a non-tensor argument, ``a``/``b`` not float8_e4m3fn, scale dtype not
            float32/uint8/float8_e8m0fnu/int32, ``out`` not bfloat16/float32.
        ValueError: wrong ranks or shapes, ``K`` not a positive multiple of 128 (the scale block),
            a non-unit last stride, tensors on different devices, a malformed ``config``, a device
            without FP8 tensor cores (compute capability < 8.9, ``_arch.require_fp8``).

    Split-K (decode, when the tiles cannot fill the GPU) runs in the one launch: fp32 partial tiles
    in a workspace of ``tiles * split * BLOCK_M * BLOCK_N * 4`` bytes, reduced in split order by the
    last program of each tile (bitwise deterministic; :func:`splitk_counters`); no host sync, so
    the call is CUDA-graph safe.
    """
    M, N, K = _check_operands("a", a, torch.float8_e4m3fn, "b", b)
    G = K // BLOCK_K
    a_scale, a_fmt = _check_scale("a_scale", a_scale, M, G, a)
    b_scale, b_fmt = _check_scale("b_scale", b_scale, triton.cdiv(N, 128), G, a)
    require_fp8("a", a.device, "fp8_gemm_nt")
    out = _check_out(out, M, N, a.device)
    if M == 0 or N == 0:
        return out
    _launch(a, a_scale, a_fmt, b, b_scale, b_fmt, out, config or pick_config(M, a.device), False, 1e-10)
    return out


OUT_DTYPES = (torch.bfloat16, torch.float32)


def _check_out(out, M: int, N: int, device, out_dtype=torch.bfloat16) -> torch.Tensor:
    if out is None:
        if out_dtype not in OUT_DTYPES:
            raise TypeError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype!r}")
        return torch.empty((M, N), dtype=out_dtype, device=device)
    if not isinstance(out, torch.Tensor) or out.dtype not in OUT_DTYPES:
        raise TypeError(f"out: expected a bfloat16 or float32 tensor, got {getattr(out, 'dtype', type(out).__name__)}")
    if tuple(out.shape) != (M, N) or (M and N and out.stride(1) != 1) or out.device != device:
        raise ValueError(f"out: expected shape ({M}, {N}) on {device} with stride(1)=1, got "
                         f"{tuple(out.shape)} strides {tuple(out.stride())} on {out.device}")
    return out


# split-K arrival counters, one int32 per output tile, zero between launches (the last program of
# each tile resets its own); one buffer per device, grown outside CUDA-graph capture only
_MIN_COUNTERS = 4096


def splitk_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The zeroed ``int32`` arrival counters split-K uses on ``device`` (at least ``tiles``).

    Allocated once per device (4,096 counters, or more for a larger grid) and left zero by every
    launch, so CUDA-graph replays reuse it. Launches that split must not run concurrently on two
    streams of one device (they share the counters).

    Raises:
        RuntimeError: the buffer would have to grow while a CUDA graph is being captured (run the
            same call once before capturing)."""
    return zeroed_counters("fp8_gemm", device, tiles, _MIN_COUNTERS)


def _launch(a, a_scale, a_fmt, b, b_scale, b_fmt, out, cfg, a_bf16: bool, eps: float, act: int = 0,
            limit: float = 0.0) -> None:
    M = a.shape[0]
    N, K = b.shape  # ``a`` is (M, 2K) with act=1 (gate | up)
    G = K // BLOCK_K
    BM, BN = _check_config(cfg)
    gemv = cfg.get("KIND") == "gemv"
    if gemv:
        BN = gemv_block_n(cfg, M, N, a.device)
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    split = _split_k(cfg, tiles, G, a.device)
    kb_per = triton.cdiv(G, split)
    split = triton.cdiv(G, kb_per)  # no empty splits
    if split > 1:
        ws = torch.empty((tiles, split, BM * BN), dtype=torch.float32, device=a.device)
        cnt = splitk_counters(a.device, tiles)
    else:
        ws = cnt = out  # unused
    # a row with Q_CVT=1 (the m16 rows) rounds the fused quant with the hardware cast where that is exact:
    # bf16 / fp16 activations (and the bf16-rounded SwiGLU); fp32 ones keep to_e4m3 (_fp8.quant_rows_e4m3_pow2,
    # CVT). Rows without the key keep to_e4m3: the same bits, but their H200 times were measured with it and the
    # cast's speed-up is untimed (session 6: no device time; NOTES.md "m16").
    q_cvt = int(a_bf16 and (act or a.dtype != torch.float32) and bool(cfg.get("Q_CVT", 0)))
    sa = a if a_scale is None else a_scale
    sa_strides = (0, 0) if a_scale is None else (a_scale.stride(0), a_scale.stride(1))
    args = (a, b, sa, b_scale, out, ws, cnt, M, N, K, a.stride(0), b.stride(0), out.stride(0),
            *sa_strides, b_scale.stride(0), b_scale.stride(1), kb_per, eps, float(limit))
    if gemv:
        _fp8_gemv_kernel[(tiles, split)](
            *args, ROWS=BM, BLOCK_N=BN, KTILE=gemv_ktile(cfg, BN, kb_per), A_FMT=a_fmt, B_FMT=b_fmt,
            A_BF16=a_bf16, SPLIT=split > 1, ACT=act, Q_CVT=q_cvt, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
        return
    _fp8_gemm_nt_kernel[(tiles, split)](
        *args, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BLOCK_K, GROUP_M=cfg.get("GROUP_M", 1), A_FMT=a_fmt, B_FMT=b_fmt,
        A_BF16=a_bf16, SPLIT=split > 1, A_ROWS=_a_rows(a, BM) if a_bf16 else BM, ACT=act,
        SCALE_PF=int(cfg.get("SCALE_PREFETCH", 0)), Q_CVT=q_cvt, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def gemv_block_n(cfg: dict, M: int, N: int, device) -> int:
    """A GEMV config's ``BLOCK_N``: its int, or for ``"auto"`` the widest power of two in [4, 32]
    that still gives ``PROGS_PER_SM`` (default 4) programs per SM; at least 4 (a 16-B vector of each
    of 4 rows per thread pair)."""
    bn = cfg["BLOCK_N"]
    if bn != "auto":
        return int(bn)
    want = int(cfg.get("PROGS_PER_SM", 4)) * num_sms(device)
    bn = 32
    while bn > 4 and triton.cdiv(M, int(cfg["BLOCK_M"])) * triton.cdiv(N, bn) < want:
        bn //= 2
    return bn


def gemv_ktile(cfg: dict, BN: int, kb_per: int) -> int:
    """A GEMV program's chunk width: its whole split (``kb_per`` k-blocks, rounded up to a power of
    two, masked) when ``BLOCK_N x KTILE`` fp8 fits ``TILE_BYTES`` (default 16 KiB: 128 B per thread
    at 4 warps, all in flight at once), else the widest power of two that does (>= 128)."""
    cap = max(128, 1 << (int(cfg.get("TILE_BYTES", 16384)) // BN).bit_length() - 1)
    return min(triton.next_power_of_2(kb_per * BLOCK_K), cap)


def _a_rows(x: torch.Tensor, BM: int) -> int:
    """1 when a fused-quant program can load and quantize one bf16 row per k-block instead of
    ``BLOCK_M`` copies of it (M=1: the row's next k-block is prefetched into registers); else
    ``BLOCK_M``. Sub-tiles of 2..BLOCK_M/2 rows were tried: the broadcast
    back to the MMA operand made Triton's layout pass run the quant in the operand layout (2x the
    instructions of the full tile in the sm_89 PTX), and 1 bf16 per thread is a plain ld.global."""
    return 1 if x.shape[0] == 1 else BM


# decode sizes at which w8a8_block_fp8_linear quantizes A inside the GEMM (each program re-quantizes
# its rows, once per N tile: cheap at M <= 32); above, the standalone quant kernel runs first
FUSED_MAX_M = 32


ACTS = (None, "swiglu_clamp")


def w8a8_block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          out: torch.Tensor | None = None, config: dict | None = None,
                          eps: float = ACT_QUANT_EPS, fused: bool | None = None, act: str | None = None,
                          act_limit: float | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Block-FP8 linear from bf16 activations: ``per_token_group_quant_fp8(x, 128, "ue8m0")`` then
    :func:`fp8_gemm_nt`, with the activation quant fused into the GEMM's prologue for decode.

    Semantics: vLLM ``W8A8BlockFp8LinearOp.apply`` / ``apply_w8a8_block_fp8_linear`` with
    ``block_size=[128, 128]`` and UE8M0 activation scales (DeepSeek-V4, DeepGEMM
    ``per_token_cast_to_fp8(use_ue8m0=True)``): per row and 128-wide k-block
    ``s = ceil_pow2(max(amax, eps) / 448)``, ``q = rne_e4m3(clamp(x / s))``, then
    ``D = sum_kb dot(q, W) * s * weight_scale``. The fused path (``num_tokens <= FUSED_MAX_M``, one
    launch) gives D bit-identical to the two-launch path at the same ``config``.
    ``act="swiglu_clamp"``: ``x`` is the shared expert's fused gate/up output and the linear's input
    is its clamped SwiGLU, ``bf16(silu(min(g, L)) * clamp(u, -L, L))`` (``norm_rope.swiglu_clamp``,
    vLLM 0.32 DeepSeek-V4 ``swiglu_limit``), computed in the fused prologue (one launch for
    activation + quant + GEMM) or by ``swiglu_clamp`` first on the two-launch path; bit-identical.

    Args:
        x: ``(num_tokens, K)`` bfloat16 (or float16 / float32, as the quant takes) activations,
            ``x.stride(1) == 1``; ``K`` a multiple of 128. With ``act``: ``(num_tokens, 2K)``
            bfloat16, gate ``[:, :K]`` then up ``[:, K:]``.
        weight: ``(N, K)`` float8_e4m3fn, ``weight.stride(1) == 1``.
        weight_scale: per 128x128 block, any encoding :func:`fp8_gemm_nt` takes for ``b_scale``.
        out: optional ``(num_tokens, N)`` bfloat16 or float32 output with ``out.stride(1) == 1``.
        out_dtype: the dtype of the output made when ``out`` is None: bfloat16 (default) or float32 (D
            stored unrounded from the fp32 accumulator, every path and config: the model's shared-expert
            down projection, which the routed experts then add into).
        config: a row of ``CONFIGS[arch]`` (an MMA row, or a ``KIND="gemv"`` row); default: on the
            fused path :func:`pick_fused_config`, else :func:`pick_config`, by ``num_tokens``.
        eps: the quant's amax floor (a positive normal float32), as in ``per_token_group_quant_fp8``.
        fused: force the fused (True) or two-launch (False) path; None: fused iff
            ``num_tokens <= FUSED_MAX_M`` and the config's ``BLOCK_M <= FUSED_MAX_M`` (the small /
            mid / prefill tiles with a bf16 A tile exceed sm_89's shared memory or spill).
        act: None, or ``"swiglu_clamp"`` (needs ``act_limit``, a positive float: ``swiglu_limit``).

    Returns:
        ``(num_tokens, N)`` ``out_dtype`` (``out``'s dtype when given). A row group holding NaN or ±inf gets a NaN scale (its UE8M0
        byte is 255), so that row of D is NaN, as in the two-launch path.

    Raises:
        TypeError / ValueError: as :func:`fp8_gemm_nt` (naming ``x``, ``weight``, ``weight_scale``,
        ``out``, ``config``) and ``per_token_group_quant_fp8`` (``eps``); ``fused=True`` with a
        config whose ``BLOCK_M > FUSED_MAX_M`` (ValueError naming ``config``); an unknown ``act``, a
        missing or non-positive ``act_limit``, or ``x`` not ``(num_tokens, 2K)`` bf16 with ``act``.
    """
    if act not in ACTS:
        raise ValueError(f"act={act!r}: expected one of {ACTS}")
    if act is not None:
        check.tensor("x", x, (torch.bfloat16,), 2)
        if x.shape[1] % 2:
            raise ValueError(f"x: act={act!r} needs (num_tokens, 2K) gate | up, got shape {tuple(x.shape)}")
        if act_limit is None:
            raise ValueError(f"act_limit: act={act!r} needs the clamp limit (swiglu_limit)")
        act_limit = check.fp32_scalar("act_limit", act_limit, positive=True)
        xg = x[:, : x.shape[1] // 2]   # the gate half: the GEMM operand's shape for the checks
    else:
        xg = x
    M, N, K = _check_operands("x", xg, (torch.bfloat16, torch.float16, torch.float32), "weight", weight)
    weight_scale, b_fmt = _check_scale("weight_scale", weight_scale, triton.cdiv(N, 128), K // BLOCK_K, x)
    eps = check.fp32_scalar("eps", eps, positive=True)
    require_fp8("x", x.device, "w8a8_block_fp8_linear")
    out = _check_out(out, M, N, x.device, out_dtype)
    if M == 0 or N == 0:
        return out
    cfg = config if config is not None else linear_config(M, x.device, fused)
    BM, _ = _check_config(cfg)
    if fused is None:
        fused = M <= FUSED_MAX_M and BM <= FUSED_MAX_M
    elif fused and BM > FUSED_MAX_M:
        raise ValueError(f"config={cfg!r}: the fused quant needs BLOCK_M <= {FUSED_MAX_M} (a bf16 A tile of "
                         f"BLOCK_M x 128 per stage next to the fp8 one); pass fused=None or a decode config")
    if fused:
        _launch(x, None, 0, weight, weight_scale, b_fmt, out, cfg, True, eps, act=1 if act else 0,
                limit=act_limit or 0.0)
        return out
    if act is not None:
        from .norm_rope import swiglu_clamp
        x = swiglu_clamp(x, act_limit)
    from .fp8_quant import per_token_group_quant_fp8
    q, s = per_token_group_quant_fp8(x, BLOCK_K, scale_fmt="ue8m0", eps=eps)
    _launch(q, s, 1, weight, weight_scale, b_fmt, out, cfg, False, eps)
    return out


def _check_operands(a_name: str, a: torch.Tensor, a_dtypes, b_name: str, b: torch.Tensor) -> tuple[int, int, int]:
    """The GEMM operands of both launchers: 2-D ``a (M, K)`` of ``a_dtypes`` and e4m3 ``b (N, K)``
    on one device, unit last strides, ``K`` a positive multiple of the scale block. Returns
    ``(M, N, K)``; raises naming ``a_name`` / ``b_name``."""
    check.tensor(a_name, a, a_dtypes, 2)
    check.tensor(b_name, b, torch.float8_e4m3fn, 2)
    M, K = a.shape
    N, Kb = b.shape
    if Kb != K:
        raise ValueError(f"{b_name}: shape {tuple(b.shape)} has K={Kb}, {a_name} has K={K}")
    if K <= 0 or K % BLOCK_K:
        raise ValueError(f"{a_name}: K={K} must be a positive multiple of {BLOCK_K} (the scale block)")
    check.same_device(a_name, a, **{b_name: b})
    check.last_dim_contiguous(a_name, a)
    check.last_dim_contiguous(b_name, b)
    return M, N, K


def _check_config(cfg: dict) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of a config row (a GEMV row's ``BLOCK_N`` may be ``"auto"``: returned as
    4, resolved per shape by :func:`gemv_block_n`); ValueError naming ``config`` otherwise."""
    if not isinstance(cfg, dict):
        raise ValueError(f"config={cfg!r}: expected a dict (a row of CONFIGS)")
    gemv = cfg.get("KIND", "mma") == "gemv"
    if cfg.get("KIND", "mma") not in ("mma", "gemv"):
        raise ValueError(f"config={cfg!r}: KIND must be 'mma' or 'gemv'")
    try:
        BM = int(cfg["BLOCK_M"])
        BN = 4 if gemv and cfg["BLOCK_N"] == "auto" else int(cfg["BLOCK_N"])
        int(cfg["num_warps"]), int(cfg["num_stages"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"config={cfg!r}: needs integer BLOCK_M, BLOCK_N, num_warps, num_stages ({e})") from None
    pow2 = lambda v, lo: v >= lo and v & (v - 1) == 0
    if gemv:
        if not (BM in (1, 2, 4) and pow2(BN, 4) and BN <= 128):
            raise ValueError(f"config={cfg!r}: a GEMV row needs BLOCK_M (rows per program) 1, 2 or 4 and "
                             f"BLOCK_N a power of two in [4, 128] (or 'auto')")
        tb = cfg.get("TILE_BYTES", 16384)
        if not isinstance(tb, int) or tb < 512:
            raise ValueError(f"config={cfg!r}: TILE_BYTES must be an int >= 512")
    elif not (pow2(BM, 16) and pow2(BN, 16)) or BN > 256:
        raise ValueError(f"config={cfg!r}: BLOCK_M and BLOCK_N must be powers of two >= 16 (BLOCK_N <= 256)")
    if cfg.get("BLOCK_K", BLOCK_K) != BLOCK_K:
        raise ValueError(f"config={cfg!r}: BLOCK_K must be {BLOCK_K} (one scale per k-block)")
    s = cfg.get("SPLIT_K", "auto")
    if s != "auto" and (not isinstance(s, int) or s < 1):
        raise ValueError(f"config={cfg!r}: SPLIT_K must be 'auto' or a positive int")
    sb = cfg.get("SPLIT_BELOW", 1.0)
    if isinstance(sb, bool) or not isinstance(sb, (int, float)) or not sb > 0:
        raise ValueError(f"config={cfg!r}: SPLIT_BELOW must be a positive number (waves of SMs)")
    if cfg.get("Q_CVT", 0) not in (0, 1):
        raise ValueError(f"config={cfg!r}: Q_CVT must be 0 or 1")
    return BM, BN


def _split_k(cfg: dict, tiles: int, kblocks: int, device: torch.device) -> int:
    """``SPLIT_K='auto'``: split only when the output tiles cannot fill ``SPLIT_BELOW`` (default 1.0)
    waves of SMs (0.5: a grid of at least one program per two SMs runs unsplit); aim at
    ``SPLIT_PER_SM`` (default 2) programs per SM, keeping at least ``SPLIT_MIN_KB`` (default 2)
    k-blocks per split (so the pipeline has work and the split-K tail is paid for)."""
    s = cfg.get("SPLIT_K", "auto")
    if s != "auto":
        return max(1, min(int(s), kblocks))
    sms = num_sms(device)
    if tiles >= float(cfg.get("SPLIT_BELOW", 1.0)) * sms:
        return 1
    min_kb = int(cfg.get("SPLIT_MIN_KB", 2))
    return max(1, min(triton.cdiv(int(cfg.get("SPLIT_PER_SM", 2)) * sms, tiles), kblocks // min_kb))


# ---- config table ------------------------------------------------------------------------------
# Stage bytes = (BLOCK_M + BLOCK_N) * 128 (fp8 A) or (2 * BLOCK_M + BLOCK_N) * 128 (bf16 A, fused
# quant). sm_89: <= 101,376 B per block, i.e. 3 stages of 128x128 (96 KiB) at most.
# decode: 16x32 tiles stream the weight from every SM (N/32 programs; split-K when that is < #SMs);
# small: 64x64; mid: 64x128; prefill: 128x128 with GROUP_M=8.
# decode_*: decode candidates (issue 20) timed by scripts/gpu/gemm.sh at the TP=4 shapes, M <= 32;
# pick_config does not return them until a timed run of their own build says so (DECODE_CANDIDATES;
# NOTES.md "FP8 GEMM decode (issue 20, gemm5)"). decode_16x64 / 16x128 / 32x32: wider tiles (won
# wo_b/wq_b at M <= 4, the fused M=32 rows, the plain M=32 rows). gemm5 candidates, sm_89 table only:
# gemv*: the CUDA-core GEMV (M <= 4; every byte of a program's weight chunk in flight at once, vector
# scale loads, no split at the TP=4 shapes); decode_pf / decode_64pf / decode_32x32_pf: the MMA
# kernel with the scales prefetched one k-block ahead, deeper pipelines (the peer's 16x32 / 16x64
# winners at 4+ stages) and no split below 4 k-blocks per split (shared_down: the split-K tail
# cost more than the second program per SM bought). Removed after the session-4 H200 runs (losing
# everywhere; numbers in NOTES.md): decode_16x32_w2, decode_16x32_k4, decode_32x64.
def _d(bm, bn, w, s, **kw):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 1, "SPLIT_K": "auto", "num_warps": w, "num_stages": s, **kw}


def _gemv(rows, bn="auto", w=4, **kw):
    return {"KIND": "gemv", "BLOCK_M": rows, "BLOCK_N": bn, "SPLIT_K": "auto", "num_warps": w, "num_stages": 1, **kw}


CONFIGS = {
    "sm_89": {
        "decode": _d(16, 32, 4, 4),
        "small": {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 1, "SPLIT_K": "auto", "num_warps": 4, "num_stages": 4},
        "mid": {"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "SPLIT_K": "auto", "num_warps": 4, "num_stages": 4},
        "prefill": {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "SPLIT_K": "auto", "num_warps": 8, "num_stages": 4},
        "decode_16x64": _d(16, 64, 4, 4),
        "decode_16x128": _d(16, 128, 4, 3),
        "decode_32x32": _d(32, 32, 4, 4),
        "decode_pf": _d(16, 32, 4, 6, SCALE_PREFETCH=1, SPLIT_MIN_KB=4),
        "decode_64pf": _d(16, 64, 4, 5, SCALE_PREFETCH=1, SPLIT_MIN_KB=4),
        "decode_32x32_pf": _d(32, 32, 4, 5, SCALE_PREFETCH=1, SPLIT_MIN_KB=4),
        "gemv": _gemv(1, PROGS_PER_SM=4),
        "gemv_p8": _gemv(1, PROGS_PER_SM=8, TILE_BYTES=8192),
        "gemv_r4": _gemv(4, PROGS_PER_SM=4, TILE_BYTES=8192),
        "gemv_w8": _gemv(1, w=8, PROGS_PER_SM=2, TILE_BYTES=32768),
        "fq_16x32": _d(16, 32, 4, 4, SCALE_PREFETCH=1, SPLIT_MIN_KB=4, Q_CVT=1),
        "fq_16x64": _d(16, 64, 4, 4, SCALE_PREFETCH=1, SPLIT_MIN_KB=4, SPLIT_BELOW=0.5, Q_CVT=1),
    },
    "sm_90": {
        "decode": _d(16, 32, 4, 6),
        "small": {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 1, "SPLIT_K": "auto", "num_warps": 4, "num_stages": 5},
        "mid": {"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "SPLIT_K": "auto", "num_warps": 4, "num_stages": 5},
        "prefill": {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "SPLIT_K": "auto", "num_warps": 8, "num_stages": 4},
        "decode_16x64": _d(16, 64, 4, 5),
        "decode_16x128": _d(16, 128, 4, 4),
        "decode_32x32": _d(32, 32, 4, 5),
        "fq_16x32": _d(16, 32, 4, 4, SCALE_PREFETCH=1, SPLIT_MIN_KB=4, Q_CVT=1),
        "fq_16x64": _d(16, 64, 4, 4, SCALE_PREFETCH=1, SPLIT_MIN_KB=4, SPLIT_BELOW=0.5, Q_CVT=1),
    },
}

# the decode labels a benchmark times at num_tokens <= 4, <= 16 and <= 32 (rows missing from an
# architecture's table are skipped there)
DECODE_CANDIDATES = {4: ("decode", "decode_16x64", "decode_pf", "decode_64pf", "gemv", "gemv_p8", "gemv_r4", "gemv_w8",
                         "fq_16x32", "fq_16x64"),
                     16: ("decode", "decode_16x64", "decode_16x128", "decode_pf", "decode_64pf", "fq_16x32", "fq_16x64"),
                     32: ("decode", "decode_16x64", "decode_16x128", "decode_32x32", "decode_32x32_pf", "fq_16x32",
                          "fq_16x64")}
# the rows pick_config can return on a GPU (the compile report builds these for sm_120)
GPU_DEFAULTS = {"sm_89": ("gemv_w8", "gemv", "decode_16x64", "fq_16x64", "decode", "small", "mid", "prefill"),
                "sm_90": ("decode_16x64", "fq_16x64", "decode", "small", "mid", "prefill")}


def decode_candidates(M: int, arch: str | None = None) -> tuple[str, ...]:
    """Config labels worth timing at ``num_tokens = M`` (decode, M <= 32; () above); with ``arch``
    only those in ``CONFIGS[arch]``."""
    for hi, labels in DECODE_CANDIDATES.items():
        if M <= hi:
            return tuple(lb for lb in labels if arch is None or lb in CONFIGS[arch])
    return ()


# num_tokens upper bound -> config label (first match), per config table.
# sm_89 M=1: gemv_w8 (H200 sm_89 build, session 5, results/issue20/s5/gemm_decode.csv, TP=4 shapes wq_a_wkv /
# wq_b / wo_b / shared_gate_up / shared_down, us): plain 4.42 / 4.96 / 4.94 / 3.76 / 3.08, fused quant 6.90 /
# 6.36 / 6.72 / 4.95 / 3.43, vs the MMA rows' best plain 7.20-8.35 / fused 7.73-8.13 and vLLM's Triton block-FP8
# at its best swept config 13.1 / 7.68 / 9.65 / 12.5 / 4.51. At M=4 the GEMV rows lose (gemv 38.3 us summed over
# the five shapes vs decode_64pf 32.8); sm_90 has no GEMV row.
# The CPU interpreter keeps the MMA rows at M=1 (its tests run the GEMV rows by name).
# M=2 (the MTP verify step, where the step runs the fused-quant launcher; results/issue20/s5/gemm_decode_m2.csv),
# fused quant summed over the five shapes: sm_89 decode_16x64 43.4 us (gemv_p8 42.8 but 12.0 on wo_b), sm_90
# decode_16x64 43.5, vs the "decode" row 52.4 (sm_90) and quant + GEMM 45.3 / 44.9; sm_90 M=1 decode_16x64 37.2
# vs decode 38.0 (fused), 35.0 vs 36.1 (plain).
# Session 9 (NOTES "gemv9"): at M=2 the plain rows above favour the GEMV (summed over the five shapes, sm_89 build:
# gemv 27.4 us vs decode_16x64 34.9), so the plain table takes gemv at M=2; the fused rows are a wash there
# (gemv 44.3 vs 43.4): it wins with the SwiGLU prologue (shared_down 4.55 vs 6.70, every layer's shared_w2) and
# loses at wq_a_wkv (11.32 vs 9.81: wqkv_a of layer 0 and of the MTP block, whose mhc_pre writes no FP8 copy),
# the step's fused M=2 linears; FUSED_M2_LABEL is gemv (the step at batch 1 MTP: -150 us against decode_16x64).
_PICK = {"sm_89": ((1, "gemv_w8"), (2, "gemv"), (16, "decode"), (64, "small"), (256, "mid"), (None, "prefill")),
         "sm_90": ((2, "decode_16x64"), (16, "decode"), (64, "small"), (256, "mid"), (None, "prefill")),
         "interp": ((16, "decode"), (64, "small"), (256, "mid"), (None, "prefill"))}


def config_label(M: int, arch: str = "sm_89") -> str:
    """The default config label of ``arch``'s table (``"sm_89"``, ``"sm_90"``, ``"interp"``) at ``num_tokens = M``."""
    for hi, label in _PICK[arch]:
        if hi is None or M <= hi:
            return label
    raise AssertionError


def pick_config(M: int, device: torch.device) -> dict:
    arch = arch_of(device)
    return CONFIGS[arch][config_label(M, arch if device.type == "cuda" else "interp")]


# the fused-quant launch (w8a8_block_fp8_linear, num_tokens <= FUSED_MAX_M) by num_tokens: M <= 2 as _PICK;
# 3..32 tokens fq_16x64 (issue 20, m16; a prediction until the H200 sweep times it, NOTES.md "m16"): with
# the hardware-cast quant (Q_CVT) each program's 16 x 128 quant is ~140 PTX instructions a k-block (was ~400)
# and the 16x64 tiles halve the programs that repeat it; wq_b's 128 tiles run unsplit (SPLIT_BELOW 0.5), the
# N <= 1536 shapes split in-launch, shared_down (4 k-blocks) never.
#: sm_89's fused-quant label at M=2, a module constant so that ``ds4lab step --ab fp8_gemm.FUSED_M2_LABEL=...``
#: can time another row there. gemv since session 9 (NOTES "gemv9"): fused + SwiGLU prologue at shared_down M=2
#: 4.55 us vs decode_16x64's 6.70 (session 5 sweep); the step at batch 1 MTP (sm_89 build, H200) 6,274 us vs
#: 6,424 with decode_16x64
FUSED_M2_LABEL = "gemv"
_PICK_FUSED = {"sm_89": ((1, "gemv_w8"), (2, None), (None, "fq_16x64")),
               "sm_90": ((2, "decode_16x64"), (None, "fq_16x64")),
               "interp": ((None, "decode"),)}


def fused_config_label(M: int, arch: str = "sm_89") -> str:
    """The fused-quant launch's default label of ``arch``'s table (``"sm_89"``, ``"sm_90"``, ``"interp"``)
    at ``num_tokens = M <= FUSED_MAX_M``."""
    for hi, label in _PICK_FUSED[arch]:
        if hi is None or M <= hi:
            return label or FUSED_M2_LABEL
    raise AssertionError


def pick_fused_config(M: int, device: torch.device) -> dict:
    arch = arch_of(device)
    return CONFIGS[arch][fused_config_label(M, arch if device.type == "cuda" else "interp")]


#: a linear whose producer already wrote its FP8 input (the model's ``PRODUCER_QUANT`` / ``SEAM_QUANT``) runs
#: ``fp8_gemm_nt`` alone: up to this many tokens at :func:`pick_config`'s plain row, above it at the fused
#: launch's tiles (:func:`linear_config` with ``a_quantized``). 2: the GEMV rows at M <= 2 on sm_89 (session 9,
#: NOTES "gemv9"); ``ds4lab step --ab fp8_gemm.PLAIN_PICK_MAX_M=...`` times another bound.
PLAIN_PICK_MAX_M = 2


def linear_config(M: int, device: torch.device, fused: bool | None = None, a_quantized: bool = False) -> dict:
    """The default tiles of a block-FP8 linear of ``M`` tokens: the fused-quant launch's own rows
    (:func:`pick_fused_config`; ``pick_config``'s "small" cannot fuse) up to ``FUSED_MAX_M`` unless
    ``fused`` is False, else :func:`pick_config`. ``a_quantized``: the GEMM runs on an input its producer
    quantized (no quant in the launch): :func:`pick_config`'s plain row up to :data:`PLAIN_PICK_MAX_M`
    tokens, the fused launch's tiles above (so moving the quant changes nothing else there)."""
    if a_quantized and M <= PLAIN_PICK_MAX_M:
        return pick_config(M, device)
    if fused is not False and M <= FUSED_MAX_M:
        return pick_fused_config(M, device)
    return pick_config(M, device)
