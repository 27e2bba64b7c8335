"""Shared FP8 device helpers: exact fp32 -> e4m3 rounding, power-of-two scales, the UE8M0 decoder.

Why pre-round: Triton's own fp32 -> e4m3 cast rounds through fp16 on sm_89 (double rounding, ~0.35%
of values one step off) and the CPU interpreter's cast neither rounds to nearest even nor saturates.
``to_e4m3`` first rounds to the e4m3 grid in fp32 (RTNE, saturating to ±448, NaN kept), so the
final cast only ever converts exactly representable values and is exact on every backend.
"""
import triton
import triton.language as tl

E4M3_MAX = 448.0


#: the activation quant's amax floor (vLLM ``per_token_group_quant_fp8``'s ``eps``): the default of
#: ``fp8_quant.per_token_group_quant_fp8``, ``fp8_gemm.w8a8_block_fp8_linear`` and the producers that write
#: a linear's FP8 operand (``norm_rope.q_kv_rmsnorm_rope(q_fp8=True)``)
ACT_QUANT_EPS = 1e-10


@triton.jit
def round_to_e4m3_grid(x):
    """fp32 -> fp32 on the e4m3 grid: clamp to ±448 (NaN propagates), round to nearest even."""
    x = tl.minimum(tl.maximum(x, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                   propagate_nan=tl.PropagateNan.ALL)
    ax = tl.abs(x)
    # normal e4m3 (|x| >= 2^-6): keep 3 mantissa bits, RTNE on the fp32 bit pattern (carry into
    # the exponent is the correct rounding up to the next binade)
    bits = x.to(tl.int32, bitcast=True)
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == ~0xFFFFF
    normal = tl.where(x != x, x, rb.to(tl.float32, bitcast=True))  # NaN payloads must not wrap
    # subnormal e4m3 (|x| < 2^-6): multiples of 2^-9; 2^23 + v rounds v to an integer (RTNE)
    sub = ((ax * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
    # copy the sign bit (``-sub`` is lowered as ``0 - sub`` and would turn -0.0 into +0.0)
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(ax < 0.015625, sub, normal)


@triton.jit
def to_e4m3(x):
    """fp32 -> float8e4nv, RTNE with saturation (``cvt.rn.satfinite`` semantics) on every backend."""
    return round_to_e4m3_grid(x).to(tl.float8e4nv)


@triton.jit
def ceil_pow2(y):
    """Smallest power of two >= y for positive normal fp32 y (bit arithmetic; no libdevice)."""
    bits = y.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    e = e + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def ue8m0_to_fp32(b):
    """UE8M0 exponent byte (uint8, or int32 holding 0..255) -> fp32 scale ``2^(b-127)``.

    The one UE8M0 decoder of the package. ``b=255`` -> NaN (OCP MX spec v1.0, E8M0: 0xFF is NaN;
    also ``torch.float8_e8m0fnu``); ``b=0`` -> 0.0, not 2^-127 (a float32 subnormal that GPU math
    flushes to zero anyway; DeepGEMM's ``b << 23`` decode and ds4lab.reference.quant.decode_ue8m0 agree);
    1..254 exact."""
    bi = b.to(tl.int32)
    return tl.where(bi == 255, float("nan"), (bi << 23).to(tl.float32, bitcast=True))


@triton.jit
def fp32_pow2_to_ue8m0(s):
    """fp32 power of two -> its UE8M0 exponent byte (as int32)."""
    return (s.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def quant_rows_e4m3(x, eps, POW2: tl.constexpr):
    """One e4m3 scale per row of ``x`` (fp32 ``[R, G]``): ``s = max(amax, eps) / 448`` (``POW2``:
    rounded up to a power of two), ``q = to_e4m3(x / s)`` with correctly rounded division. A row
    holding NaN gets a NaN scale (its UE8M0 byte is then 255). Returns ``(q [R, G], s [R])``."""
    has_nan = tl.sum((x != x).to(tl.int32), axis=1) > 0  # tl.max may drop NaN on some backends
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), eps)
    s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    if POW2:
        s = ceil_pow2(s)
    s = tl.where(has_nan, float("nan"), s)
    return to_e4m3(tl.math.div_rn(x, s[:, None])), s


@triton.jit
def quant_rows_e4m3_pow2(x, eps, CVT: tl.constexpr = False):
    """``quant_rows_e4m3(x, eps, POW2=True)``, bit for bit, in fewer instructions (the GEMM prologue's
    quant, ``fp8_gemm.w8a8_block_fp8_linear``): one integer max over the ``|x|`` bit patterns gives
    the amax and the NaN flag together (every NaN pattern is above inf's ``0x7F800000``; for the rest
    the int order of non-negative floats is their float order), and ``x / s`` becomes ``x * (1 / s)``:
    ``s`` is a power of two (or inf / NaN), so ``1 / s`` is exact and both are the correctly rounded
    value of the same real number (inf -> 0, NaN -> NaN, as the division). Returns ``(q, s)``.

    ``CVT``: the final rounding is the hardware cast (``cvt.rn.satfinite.e4m3x2``, on sm_89 after a
    ``cvt.rz.f16.f32``) instead of :func:`to_e4m3`'s ~15 integer ops per element. Bit-identical when
    every ``x`` has at most 11 significant bits (bf16 / fp16 activations, the bf16-rounded SwiGLU):
    ``x * (1 / s)`` is then exact with the same few bits, so every such value of at least 2^-14 is an
    fp16 normal (the f16 step is exact) and anything smaller is below half the least e4m3 subnormal
    (a signed zero either way); both casts saturate to ±448 and keep NaN. fp32 inputs must not set it."""
    abits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax_bits = tl.max(abits, axis=1)
    amax = tl.maximum(amax_bits.to(tl.float32, bitcast=True), eps)
    s = ceil_pow2(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
    s = tl.where(amax_bits > 0x7F800000, float("nan"), s)
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    if CVT:
        q = (x * inv[:, None]).to(tl.float8e4nv)
    else:
        q = to_e4m3(x * inv[:, None])
    return q, s
