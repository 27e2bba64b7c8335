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
GPU, split-K into an fp32 workspace ``(split, M, N)`` followed by a reduce kernel (deterministic, no
atomics, no host sync: CUDA-graph safe). Large M uses 128 x 128 tiles, grouped tile order for L2.
"""
import torch
import triton
import triton.language as tl

from . import _checks as check
from ._arch import arch_of, num_sms, require_fp8
from ._fp8 import ue8m0_to_fp32

BLOCK_K = 128


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
def _fp8_gemm_nt_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, d_ptr,
    M, N, K,
    stride_am, stride_bn, stride_dm, stride_ds,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    kb_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_FMT: tl.constexpr, B_FMT: tl.constexpr, OUT_FP32: tl.constexpr,
):
    """Grid ``(cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), split)``: output tiles in GROUP_M order x k splits.
    One program: a BLOCK_M x BLOCK_N tile of D over its split's k-blocks (fp32 to ``ws[pid_k]`` if split)."""
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

    a_ptrs = a_ptr + rows_a[:, None] * stride_am + (kb_lo * BLOCK_K + offs_k)[None, :]
    b_ptrs = b_ptr + rows_b[:, None] * stride_bn + (kb_lo * BLOCK_K + offs_k)[None, :]
    sa_row = sa_ptr + rows_a * stride_sam
    if BLOCK_N <= 128:
        # BLOCK_N divides 128: the whole tile lies in one 128-row block of B -> one scalar scale
        sb_row = sb_ptr + ((pid_n * BLOCK_N) // 128) * stride_sbn
    else:
        sb_row = sb_ptr + (rows_b // 128) * stride_sbn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        if A_FMT == 2:
            sa = _load_scale(sa_row + (kb // 4) * stride_sak, kb, A_FMT)
        else:
            sa = _load_scale(sa_row + kb * stride_sak, kb, A_FMT)
        if B_FMT == 2:
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

    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    d_off = pid_k.to(tl.int64) * stride_ds + offs_m.to(tl.int64)[:, None] * stride_dm + offs_n[None, :]
    if OUT_FP32:
        tl.store(d_ptr + d_off, acc, mask=mask)
    else:
        tl.store(d_ptr + d_off, acc.to(tl.bfloat16), mask=mask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, d_ptr, M, N, stride_ws, stride_wm, stride_dm,
                          SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK), M)``.
    One program: BLOCK columns of one output row, summed over the SPLIT partials.

    ``D[m, n] = bf16(sum_s ws[s, m, n])`` in a fixed order (deterministic)."""
    pid = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs_n < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(ws_ptr + s * stride_ws + m * stride_wm + offs_n, mask=mask, other=0.0)
    tl.store(d_ptr + m * stride_dm + offs_n, acc.to(tl.bfloat16), mask=mask)


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
        out: optional ``(num_tokens, N)`` bfloat16 output with ``out.stride(1) == 1``.
        config: a row of ``CONFIGS[arch]`` (``BLOCK_M``, ``BLOCK_N``, ``GROUP_M``, ``SPLIT_K`` int
            or ``"auto"``, ``num_warps``, ``num_stages``); default picks by ``num_tokens``.

    Returns:
        ``(num_tokens, N)`` bfloat16. NaN in a scale or value propagates to the affected outputs.

    Raises:
        TypeError: a non-tensor argument, ``a``/``b`` not float8_e4m3fn, scale dtype not
            float32/uint8/float8_e8m0fnu/int32, ``out`` not bfloat16.
        ValueError: wrong ranks or shapes, ``K`` not a positive multiple of 128 (the scale block),
            a non-unit last stride, tensors on different devices, a malformed ``config``, a device
            without FP8 tensor cores (compute capability < 8.9, ``_arch.require_fp8``).

    Split-K (decode, when the tiles cannot fill the GPU) writes fp32 partials to a workspace of
    ``split * num_tokens * N * 4`` bytes and reduces them in a second kernel; no host sync, so the
    call is CUDA-graph safe.
    """
    check.tensor("a", a, torch.float8_e4m3fn, 2)
    check.tensor("b", b, torch.float8_e4m3fn, 2)
    M, K = a.shape
    N, Kb = b.shape
    if Kb != K:
        raise ValueError(f"b: shape {tuple(b.shape)} has K={Kb}, a has K={K}")
    if K <= 0 or K % BLOCK_K:
        raise ValueError(f"a: K={K} must be a positive multiple of {BLOCK_K} (the scale block)")
    check.same_device("a", a, b=b)
    check.last_dim_contiguous("a", a)
    check.last_dim_contiguous("b", b)
    G = K // BLOCK_K
    a_scale, a_fmt = _check_scale("a_scale", a_scale, M, G, a)
    b_scale, b_fmt = _check_scale("b_scale", b_scale, triton.cdiv(N, 128), G, a)
    require_fp8("a", a.device, "fp8_gemm_nt")
    if out is None:
        out = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    else:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16:
            raise TypeError(f"out: expected a bfloat16 tensor, got {getattr(out, 'dtype', type(out).__name__)}")
        if tuple(out.shape) != (M, N) or (M and N and out.stride(1) != 1) or out.device != a.device:
            raise ValueError(f"out: expected shape ({M}, {N}) on {a.device} with stride(1)=1, got "
                             f"{tuple(out.shape)} strides {tuple(out.stride())} on {out.device}")
    if M == 0 or N == 0:
        return out
    cfg = config or pick_config(M, a.device)
    BM, BN = _check_config(cfg)
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    split = _split_k(cfg, tiles, G, a.device)
    kb_per = triton.cdiv(G, split)
    split = triton.cdiv(G, kb_per)  # no empty splits
    meta = dict(BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BLOCK_K, GROUP_M=cfg.get("GROUP_M", 1),
                A_FMT=a_fmt, B_FMT=b_fmt, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    args = (M, N, K, a.stride(0), b.stride(0))
    sargs = (a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1), kb_per)
    if split == 1:
        _fp8_gemm_nt_kernel[(tiles, 1)](a, b, a_scale, b_scale, out, *args, out.stride(0), 0, *sargs,
                                        OUT_FP32=False, **meta)
        return out
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device)
    _fp8_gemm_nt_kernel[(tiles, split)](a, b, a_scale, b_scale, ws, *args, ws.stride(1), ws.stride(0), *sargs,
                                        OUT_FP32=True, **meta)
    RB = cfg.get("REDUCE_BLOCK", 1024)
    _splitk_reduce_kernel[(triton.cdiv(N, RB), M)](ws, out, M, N, ws.stride(0), ws.stride(1), out.stride(0),
                                                   SPLIT=split, BLOCK=RB, num_warps=4)
    return out


def _check_config(cfg: dict) -> tuple[int, int]:
    try:
        BM, BN = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"])
        int(cfg["num_warps"]), int(cfg["num_stages"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"config={cfg!r}: needs integer BLOCK_M, BLOCK_N, num_warps, num_stages ({e})") from None
    pow2 = lambda v: v >= 16 and v & (v - 1) == 0
    if not (pow2(BM) and pow2(BN)) or BN > 256:
        raise ValueError(f"config={cfg!r}: BLOCK_M and BLOCK_N must be powers of two >= 16 (BLOCK_N <= 256)")
    if cfg.get("BLOCK_K", BLOCK_K) != BLOCK_K:
        raise ValueError(f"config={cfg!r}: BLOCK_K must be {BLOCK_K} (one scale per k-block)")
    s = cfg.get("SPLIT_K", "auto")
    if s != "auto" and (not isinstance(s, int) or s < 1):
        raise ValueError(f"config={cfg!r}: SPLIT_K must be 'auto' or a positive int")
    return BM, BN


def _split_k(cfg: dict, tiles: int, kblocks: int, device: torch.device) -> int:
    """``SPLIT_K='auto'``: split only when the output tiles cannot fill one wave of SMs; aim at
    ~2 programs per SM, keeping at least 2 k-blocks per split (so the pipeline has work)."""
    s = cfg.get("SPLIT_K", "auto")
    if s != "auto":
        return max(1, min(int(s), kblocks))
    sms = num_sms(device)
    if tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, tiles), kblocks // 2))


# ---- config table ------------------------------------------------------------------------------
# Stage bytes = (BLOCK_M + BLOCK_N) * 128 (fp8). sm_89: <= 101,376 B per block, i.e. 3 stages of
# 128x128 (96 KiB) at most. decode: 16x32 tiles stream the weight from every SM (N/32 programs;
# split-K when that is < #SMs); small: 64x64; mid: 64x128; prefill: 128x128 with GROUP_M=8.
CONFIGS = {
    "sm_89": {
        "decode": {"BLOCK_M": 16, "BLOCK_N": 32, "GROUP_M": 1, "SPLIT_K": "auto", "num_warps": 4, "num_stages": 4},
        "small": {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 1, "SPLIT_K": "auto", "num_warps": 4, "num_stages": 4},
        "mid": {"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "SPLIT_K": "auto", "num_warps": 4, "num_stages": 4},
        "prefill": {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "SPLIT_K": "auto", "num_warps": 8, "num_stages": 4},
    },
    "sm_90": {
        "decode": {"BLOCK_M": 16, "BLOCK_N": 32, "GROUP_M": 1, "SPLIT_K": "auto", "num_warps": 4, "num_stages": 6},
        "small": {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 1, "SPLIT_K": "auto", "num_warps": 4, "num_stages": 5},
        "mid": {"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "SPLIT_K": "auto", "num_warps": 4, "num_stages": 5},
        "prefill": {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "SPLIT_K": "auto", "num_warps": 8, "num_stages": 4},
    },
}

# num_tokens upper bound -> config label (first match)
_PICK = ((16, "decode"), (64, "small"), (256, "mid"), (None, "prefill"))


def config_label(M: int) -> str:
    for hi, label in _PICK:
        if hi is None or M <= hi:
            return label
    raise AssertionError


def pick_config(M: int, device: torch.device) -> dict:
    return CONFIGS[arch_of(device)][config_label(M)]
