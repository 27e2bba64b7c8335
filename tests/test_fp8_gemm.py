"""Block-scaled FP8 GEMM (fp8_gemm_nt): specifics beyond the registry sweep: exact constant fills,
scale encodings and layouts agreeing bit for bit, tiny scales, split-K, end to end from the
activation-quant kernel, and bad inputs raising errors that name the argument."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare, compare_exact
from ds4lab.reference import fp8_gemm as R
from ds4lab.reference.quant import per_token_group_quant_fp8 as ref_quant
from ds4lab_kernels import fp8_quant
from ds4lab_kernels.fp8_gemm import CONFIGS, fp8_gemm_nt

pytestmark = pytest.mark.interp

FMTS = ("fp32", "pow2", "ue8m0", "ue8m0_packed")


def _seed():
    return int(torch.randint(0, 2**31, (1,)))  # from the per-test seed (conftest; DS4LAB_TEST_SEED=random draws fresh ones)


def _operands(M, N, K, a_fmt="pow2", b_fmt="pow2", seed=None):
    g = torch.Generator().manual_seed(_seed() if seed is None else seed)
    x = (torch.randn(M, K, generator=g) * 2).bfloat16().to(DEVICE)
    w = (torch.randn(N, K, generator=g) * 0.05).to(DEVICE)
    a, sa = ref_quant(x, 128, a_fmt)  # bit-identical to the kernel (tests/test_fp8_quant.py)
    b, sb = R.per_block_quant_fp8(w, b_fmt)
    return a, sa, b, sb


def _check(out, a, sa, b, sb):
    ref = R.fp8_gemm_nt(a, sa, b, sb)
    rep = compare(out, ref, "bfloat16", name="D")
    assert rep, rep.summary()


@pytest.mark.parametrize("fmt", FMTS)
def test_constant_fill_is_exact(fmt):
    # A = 1.5, B = 0.25 everywhere: D = K * 0.375 exactly (pow2 scales are exact; fp32 scales
    # leave ~1e-7 relative error that the bf16 rounding removes)
    M, N, K = 5, 150, 512
    a, sa = ref_quant(torch.full((M, K), 1.5, dtype=torch.bfloat16, device=DEVICE), 128, fmt)
    b, sb = R.per_block_quant_fp8(torch.full((N, K), 0.25, device=DEVICE), fmt)
    out = fp8_gemm_nt(a, sa, b, sb)
    want = torch.full((M, N), K * 0.375, dtype=torch.bfloat16)
    assert compare_exact(out.cpu(), want, "constant D")


def test_three_weight_encodings_agree_bitwise():
    M, N, K = 7, 133, 512
    g = torch.Generator().manual_seed(_seed())
    w = (torch.randn(N, K, generator=g) * 0.03).to(DEVICE)
    a, sa, _, _ = _operands(M, N, K, "ue8m0_packed")
    b, s_pow2 = R.per_block_quant_fp8(w, "pow2")
    b2, s_b = R.per_block_quant_fp8(w, "ue8m0")
    b3, s_p = R.per_block_quant_fp8(w, "ue8m0_packed")
    assert torch.equal(b.view(torch.uint8), b2.view(torch.uint8)) and torch.equal(b.view(torch.uint8), b3.view(torch.uint8))
    outs = [fp8_gemm_nt(a, sa, b, s) for s in (s_pow2, s_b, s_p)]
    if hasattr(torch, "float8_e8m0fnu"):
        outs.append(fp8_gemm_nt(a, sa, b, s_b.view(torch.float8_e8m0fnu)))
    for o in outs[1:]:
        assert compare_exact(o, outs[0], "D (encodings)")
    _check(outs[0], a, sa, b, s_pow2)


def test_activation_encodings_and_mn_major_layout_agree_bitwise():
    M, N, K = 9, 70, 640
    x = (torch.randn(M, K) * 3).bfloat16().to(DEVICE)
    _, _, b, sb = _operands(M, N, K, b_fmt="ue8m0")
    outs = []
    for fmt in ("pow2", "ue8m0", "ue8m0_packed"):
        a, sa = ref_quant(x, 128, fmt)
        outs.append(fp8_gemm_nt(a, sa, b, sb))
        # DeepGEMM's MN-major (column-major) scale layout: same values, transposed storage
        sa_mn = sa.t().contiguous().t()
        assert sa_mn.stride(0) == 1 or M == 1
        outs.append(fp8_gemm_nt(a, sa_mn, b, sb))
    for o in outs[1:]:
        assert compare_exact(o, outs[0], "D (A encodings / layouts)")


def test_zero_and_tiny_groups_give_zeros_not_nan():
    M, N, K = 4, 96, 384
    x = torch.zeros(M, K, dtype=torch.bfloat16, device=DEVICE)
    x[1, 128:256] = 1e-30
    x[2] = 1.0
    a, sa = ref_quant(x, 128, "ue8m0_packed")
    _, _, b, sb = _operands(M, N, K, b_fmt="ue8m0")
    out = fp8_gemm_nt(a, sa, b, sb)
    assert not out.isnan().any()
    assert torch.all(out[[0, 1, 3]] == 0)
    _check(out, a, sa, b, sb)


@pytest.mark.parametrize("fmt", ("fp32", "pow2", "ue8m0"))
def test_weight_block_scales_1e_23(fmt):
    M, N, K = 6, 200, 256
    a, sa, b, _ = _operands(M, N, K)
    s = torch.full((2, 2), 1e-23, device=DEVICE)
    sb = R.encode_scales(s, fmt)
    out = fp8_gemm_nt(a, sa, b, sb).float()
    ref = R.fp8_gemm_nt(a, sa, b, sb)
    assert ref.abs().max() < 1e-17 and (out != 0).float().mean() > 0.9
    # relative to the output's own size (an absolute budget would pass anything this small)
    rep = compare(out / ref.abs().max(), ref / ref.abs().max(), "bfloat16", name="D/max")
    assert rep, rep.summary()


def test_ue8m0_byte_255_is_nan_and_0_is_zero():
    M, N, K = 3, 40, 256
    a, sa, b, sb = _operands(M, N, K, "ue8m0", "ue8m0")
    sa = sa.clone()
    sa[1, 0] = 255   # NaN scale: the whole row is NaN
    sa[2, :] = 0     # 2^-127 encoded as 0 decodes to 0.0: the row is zero
    out = fp8_gemm_nt(a, sa, b, sb)
    assert out[1].isnan().all() and not out[0].isnan().any()
    assert torch.all(out[2] == 0)
    _check(out, a, sa, b, sb)


@pytest.mark.parametrize("M", [1, 7, 64, 300])
def test_end_to_end_from_activation_quant_odd_n(M):
    """bf16 x -> per_token_group_quant_fp8 kernel (packed UE8M0) -> fp8_gemm_nt with odd N and the
    default config for M, against the reference."""
    N, K = 65, 256
    x = (torch.randn(M, K) * 2).bfloat16().to(DEVICE)
    a, sa = fp8_quant.per_token_group_quant_fp8(x, 128, "ue8m0_packed",
                                                config=fp8_quant.CONFIGS["sm_89"]["large"])
    _, _, b, sb = _operands(M, N, K, b_fmt="ue8m0")
    out = fp8_gemm_nt(a, sa, b, sb)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    _check(out, a, sa, b, sb)


@pytest.mark.parametrize("split", [2, 3, 8])
def test_explicit_split_k(split):
    M, N, K = 5, 48, 1024   # 8 k-blocks: splits of 4/4, 3/3/2, 1 x 8
    a, sa, b, sb = _operands(M, N, K, "fp32", "fp32")
    cfg = {**CONFIGS["sm_89"]["decode"], "SPLIT_K": split}
    _check(fp8_gemm_nt(a, sa, b, sb, config=cfg), a, sa, b, sb)


def test_strided_rows_out_and_empty():
    M, N, K = 6, 50, 256
    a, sa, b, sb = _operands(M, N, K)
    big = torch.zeros(M, K + 128, dtype=torch.float8_e4m3fn, device=DEVICE)
    big[:, 64:64 + K] = a
    view = big[:, 64:64 + K]                        # row stride K + 128
    out = torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)
    got = fp8_gemm_nt(view, sa, b, sb, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert compare_exact(got, fp8_gemm_nt(a, sa, b, sb), "strided A")
    e = fp8_gemm_nt(a[:0], sa[:0], b, sb)
    assert e.shape == (0, N)


def _good(M=4, N=130, K=256):
    return dict(zip(("a", "a_scale", "b", "b_scale"), _operands(M, N, K, "fp32", "ue8m0", seed=0)))


def _bad_cases():
    f8 = torch.float8_e4m3fn
    return [
        ("a e5m2", lambda d: {**d, "a": d["a"].to(torch.float8_e5m2)}, TypeError, "a: dtype"),
        ("b bf16", lambda d: {**d, "b": d["b"].bfloat16()}, TypeError, "b: dtype"),
        ("K mismatch", lambda d: {**d, "b": d["b"][:, :128]}, ValueError, "b: shape"),
        ("K not 128", lambda d: {**d, "a": torch.zeros(4, 200, dtype=f8), "b": torch.zeros(130, 200, dtype=f8)},
         ValueError, "multiple of 128"),
        ("a 3d", lambda d: {**d, "a": d["a"][None]}, ValueError, "a: expected 2 dims"),
        ("a transposed", lambda d: {**d, "a": torch.zeros(256, 4, dtype=f8).t()}, ValueError, "a: last dim"),
        ("b transposed", lambda d: {**d, "b": torch.zeros(256, 130, dtype=f8).t()}, ValueError, "b: last dim"),
        ("sa fp16", lambda d: {**d, "a_scale": d["a_scale"].half()}, TypeError, "a_scale: dtype"),
        ("sa shape", lambda d: {**d, "a_scale": torch.ones(4, 3)}, ValueError, r"a_scale: float32 scales must have shape \(4, 2\)"),
        ("sa packed shape", lambda d: {**d, "a_scale": torch.zeros(4, 2, dtype=torch.int32)}, ValueError, r"a_scale: int32 packed"),
        ("sb floor rows", lambda d: {**d, "b_scale": d["b_scale"][:1]}, ValueError, r"b_scale: uint8 UE8M0 scales must have shape \(2, 2\)"),
        ("sb not tensor", lambda d: {**d, "b_scale": 1.0}, TypeError, "b_scale: expected a torch.Tensor"),
        ("out dtype", lambda d: {**d, "out": torch.empty(4, 130)}, TypeError, "out: expected a bfloat16"),
        ("out shape", lambda d: {**d, "out": torch.empty(4, 129, dtype=torch.bfloat16)}, ValueError, "out: expected shape"),
        ("config BLOCK_K", lambda d: {**d, "config": {**CONFIGS["sm_89"]["decode"], "BLOCK_K": 64}}, ValueError, "BLOCK_K"),
        ("config BLOCK_N", lambda d: {**d, "config": {**CONFIGS["sm_89"]["decode"], "BLOCK_N": 48}}, ValueError, "powers of two"),
        ("config split", lambda d: {**d, "config": {**CONFIGS["sm_89"]["decode"], "SPLIT_K": 0}}, ValueError, "SPLIT_K"),
    ]


@pytest.mark.parametrize("name,mut,exc,match", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_inputs_raise_naming_the_argument(name, mut, exc, match):
    kw = mut(_good())
    kw = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with pytest.raises(exc, match=match):
        fp8_gemm_nt(**kw)
