"""Per-token-group FP8 activation quantization (DeepSeek-V4 dynamic 1x128 activations).

Semantics: vLLM ``per_token_group_quant_fp8`` / DeepGEMM ``per_token_cast_to_fp8``:
for each row ``m`` and group ``g`` of ``group_size`` contiguous columns,
``s = max(amax(|x[m, g]|), eps) / 448`` (``pow2``/``ue8m0``: rounded up to a power of two),
``q = round_to_nearest_even(clamp(x / s, -448, 448))`` as float8_e4m3fn.
"""
import torch
import triton
import triton.language as tl

from . import _checks as check
from ._arch import arch_of, require_fp8
from ._fp8 import ACT_QUANT_EPS, fp32_pow2_to_ue8m0, quant_rows_e4m3

SCALE_FMTS = ("fp32", "pow2", "ue8m0", "ue8m0_packed")
_FMT_CODE = {"fp32": 0, "pow2": 1, "ue8m0": 2, "ue8m0_packed": 2}


@triton.jit
def _per_token_group_quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr,
    n_groups, groups_per_row, stride_xm, stride_qm, stride_sm,
    eps,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, SCALE_FMT: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens * groups_per_row, BLOCK_G),)``.
    One program: BLOCK_G consecutive (token, group) pairs in flat order: their e4m3 values and scales."""
    pid = tl.program_id(0)
    gid = pid * BLOCK_G + tl.arange(0, BLOCK_G)            # flat group ids [BLOCK_G]
    gmask = gid < n_groups
    m = gid // groups_per_row
    g = gid - m * groups_per_row
    cols = tl.arange(0, GROUP)
    x_off = m.to(tl.int64)[:, None] * stride_xm + (g * GROUP)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=gmask[:, None], other=0.0).to(tl.float32)
    q, s = quant_rows_e4m3(x, eps, SCALE_FMT != 0)
    q_off = m.to(tl.int64)[:, None] * stride_qm + (g * GROUP)[:, None] + cols[None, :]
    tl.store(q_ptr + q_off, q, mask=gmask[:, None])
    s_off = m.to(tl.int64) * stride_sm + g
    if SCALE_FMT == 2:
        tl.store(s_ptr + s_off, fp32_pow2_to_ue8m0(s).to(tl.uint8), mask=gmask)
    else:
        tl.store(s_ptr + s_off, s, mask=gmask)


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = 128, scale_fmt: str = "fp32",
                              eps: float = ACT_QUANT_EPS, config: dict | None = None):
    """Quantize activations to float8_e4m3fn with one scale per ``group_size`` columns.

    Args:
        x: ``(num_tokens, hidden)`` bfloat16, float16 or float32, last dim contiguous
            (``x.stride(1) == 1``); ``hidden`` a multiple of ``group_size``.
        group_size: columns per scale; 128 for DeepSeek-V4 (1x128 activation groups).
        scale_fmt: ``"fp32"`` (``s = max(amax, eps)/448``), ``"pow2"`` (fp32 rounded up to a power
            of two, DeepGEMM ``scale_fmt: ue8m0`` math), ``"ue8m0"`` (the pow2 scale's exponent
            byte, ``scale = 2^(b-127)``, uint8), ``"ue8m0_packed"`` (four exponent bytes per int32,
            little-endian along the group axis, groups zero-padded to a multiple of 4).
        eps: amax floor: an all-zero group gets scale ``eps/448`` and zeros, never NaN. A positive
            normal float32 (``2^-126 <= eps <= 3.4e38``; it reaches the kernel as an fp32 argument).
        config: a row of ``CONFIGS`` to force (benchmarks); default picks by size.

    Returns:
        ``(q, s)``: ``q`` ``(num_tokens, hidden)`` float8_e4m3fn; ``s`` ``(num_tokens, hidden/group_size)``
        float32 (fp32/pow2) or uint8 (ue8m0), or ``(num_tokens, ceil(groups/4))`` int32 (packed).
        A group containing NaN gets a NaN scale (0xFF in ue8m0) and NaN values; a group
        containing ±inf gets an inf scale, its inf entries become NaN and the rest 0 (as ``x/s``
        does in the reference). Finite inputs never produce NaN.

    Raises:
        TypeError: ``x`` dtype not bf16/fp16/fp32.
        ValueError: wrong rank, non-unit last stride, ``hidden % group_size``, unknown ``scale_fmt``,
            ``eps`` not a positive normal float32 (NaN, inf, <= 0, subnormal), a device without FP8
            (compute capability < 8.9).
    """
    check.tensor("x", x, (torch.bfloat16, torch.float16, torch.float32))
    if x.dim() != 2:
        raise ValueError(f"x: expected 2 dims (num_tokens, hidden), got shape {tuple(x.shape)}")
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt={scale_fmt!r}: expected one of {SCALE_FMTS}")
    if group_size not in (32, 64, 128, 256):
        raise ValueError(f"group_size={group_size}: supported 32, 64, 128, 256")
    M, K = x.shape
    if K % group_size:
        raise ValueError(f"x: hidden={K} is not a multiple of group_size={group_size}")
    check.last_dim_contiguous("x", x)
    # the amax floor that keeps zero groups finite: > 0, and a normal float32 (the kernel's type)
    eps = check.fp32_scalar("eps", eps, positive=True)
    require_fp8("x", x.device, "per_token_group_quant_fp8")
    G = K // group_size
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    if scale_fmt in ("fp32", "pow2"):
        s = torch.empty((M, G), dtype=torch.float32, device=x.device)
        s_buf = s
    else:
        width = G if scale_fmt == "ue8m0" else 4 * triton.cdiv(G, 4)
        # every byte of a ue8m0 row is written by the kernel: torch.empty (torch.zeros was a third
        # launch per linear, a fill kernel, in the decode step); only packed padding needs zeros
        alloc = torch.zeros if width > G else torch.empty
        s_buf = alloc((M, width), dtype=torch.uint8, device=x.device)
        s = s_buf if scale_fmt == "ue8m0" else s_buf.view(torch.int32)
    n_groups = M * G
    if n_groups == 0:
        return q, s
    cfg = config or pick_config(n_groups, x.device)
    grid = (triton.cdiv(n_groups, cfg["BLOCK_G"]),)
    _per_token_group_quant_fp8_kernel[grid](
        x, q, s_buf, n_groups, G, x.stride(0), q.stride(0), s_buf.stride(0), eps,
        GROUP=group_size, BLOCK_G=cfg["BLOCK_G"], SCALE_FMT=_FMT_CODE[scale_fmt],
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1))
    return q, s


# ---- config table ------------------------------------------------------------------------------
# BLOCK_G groups of 128 per program. Memory bound: small M wants many small programs so every SM
# streams; large M wants fatter programs to amortise index math. Both tables fit sm_89 smem (no
# shared memory is used beyond the reduction scratch).
CONFIGS = {
    "sm_89": {"small": {"BLOCK_G": 1, "num_warps": 1}, "mid": {"BLOCK_G": 4, "num_warps": 4},
              "large": {"BLOCK_G": 8, "num_warps": 4}, "xlarge": {"BLOCK_G": 32, "num_warps": 8}},
    "sm_90": {"small": {"BLOCK_G": 1, "num_warps": 1}, "mid": {"BLOCK_G": 4, "num_warps": 4},
              "large": {"BLOCK_G": 16, "num_warps": 4}, "xlarge": {"BLOCK_G": 32, "num_warps": 8}},
}


# the rows pick_config can return on a GPU (the rest are benchmark candidates or interpreter sizes);
# the compile report builds these for sm_120, tests/test_arch.py sweeps pick_config against them
GPU_DEFAULTS = {"sm_89": ("small", "mid", "large"), "sm_90": ("small", "mid", "large")}


def pick_config(n_groups: int, device: torch.device) -> dict:
    # H200 run 1 (NOTES.md): BLOCK_G=1 wins below ~1k groups, is 2.8x slower than 8 at 131k groups
    table = CONFIGS[arch_of(device)]
    if device.type != "cuda":  # CPU interpreter: programs run one by one in Python, fewest is fastest
        return table["xlarge"]
    if n_groups <= 1024:
        return table["small"]
    return table["mid"] if n_groups <= 16384 else table["large"]
