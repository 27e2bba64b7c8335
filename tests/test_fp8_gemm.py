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
        ("out dtype", lambda d: {**d, "out": torch.empty(4, 130, dtype=torch.float16)}, TypeError,
         "out: expected a bfloat16 or float32"),
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


# ---- w8a8_block_fp8_linear: the activation quant fused into the GEMM (issue 20) -------------------
from ds4lab_kernels import fp8_gemm as G  # noqa: E402


class _Count:
    """Wraps a Triton kernel object and counts its launches (``kernel[grid](...)``)."""

    def __init__(self, k):
        self.k, self.n = k, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.k[grid]

    def __getattr__(self, name):
        return getattr(self.k, name)


def _adversarial_x(M, K, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(_seed())
    x = torch.randn(M, K, generator=g) * torch.exp(torch.empty(M, 1).uniform_(-3, 3, generator=g))
    x.view(M, -1, 128)[0, 0] = 0.0                       # all-zero group -> eps-floored scale, zeros
    if M > 1:
        x.view(M, -1, 128)[1, 1] = 1e-30 * torch.randn(128, generator=g)  # tiny: below the eps floor
        x.view(M, -1, 128)[1, 2] = 2.0 ** -133          # bf16 subnormals
    if M > 2:
        x[2, 5] = float("nan")
    if M > 3:
        x[3, 130] = float("inf")
    if M > 4:
        x[4, K - 1] = float("-inf")
        x[4, 0] = 448.0 * 2.0 ** 100                   # huge but finite
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("M", [1, 6])
def test_fused_quant_is_bit_identical_to_quant_then_gemm(M, split):
    """fp8_quant.per_token_group_quant_fp8(x, 128, "ue8m0") + fp8_gemm_nt == the fused launch, bit for
    bit (same config), on adversarial groups: zeros, 1e-30, bf16 subnormals, NaN, ±inf, 2^108."""
    N, K = 77, 512
    x = _adversarial_x(M, K)
    _, _, b, sb = _operands(M, N, K, b_fmt="ue8m0")
    cfg = {**CONFIGS["sm_89"]["decode"], "SPLIT_K": split}
    q, s = fp8_quant.per_token_group_quant_fp8(x, 128, scale_fmt="ue8m0")
    two = fp8_gemm_nt(q, s, b, sb, config=cfg)
    fused = G.w8a8_block_fp8_linear(x, b, sb, config=cfg)
    assert compare_exact(fused, two, "fused vs quant+gemm")
    assert compare_exact(G.w8a8_block_fp8_linear(x, b, sb, config=cfg, fused=False), two, "two-launch path")
    if M > 4:
        assert fused[2:5].isnan().all() and not fused[[0, 1, 5]].isnan().any()
    _check(two, q, s, b, sb)


def test_fused_quant_fp32_input_and_eps_match_the_quant_kernel():
    M, N, K = 3, 64, 384
    x = _adversarial_x(M, K, torch.float32)
    _, _, b, sb = _operands(M, N, K, b_fmt="ue8m0_packed")
    cfg = CONFIGS["sm_89"]["decode_16x64"]
    q, s = fp8_quant.per_token_group_quant_fp8(x, 128, scale_fmt="ue8m0", eps=1e-4)
    assert compare_exact(G.w8a8_block_fp8_linear(x, b, sb, config=cfg, eps=1e-4),
                         fp8_gemm_nt(q, s, b, sb, config=cfg), "fp32 x, eps=1e-4")


def test_fused_is_one_launch_and_large_m_falls_back_to_two(monkeypatch):
    gemm = _Count(G._fp8_gemm_nt_kernel)
    quant = _Count(fp8_quant._per_token_group_quant_fp8_kernel)
    monkeypatch.setattr(G, "_fp8_gemm_nt_kernel", gemm)
    monkeypatch.setattr(fp8_quant, "_per_token_group_quant_fp8_kernel", quant)
    _, _, b, sb = _operands(1, 32, 512, b_fmt="ue8m0")
    x = (torch.randn(G.FUSED_MAX_M, 512)).bfloat16().to(DEVICE)
    cfg = {**CONFIGS["sm_89"]["decode_32x32"], "SPLIT_K": 2}   # split-K too: still one launch
    G.w8a8_block_fp8_linear(x, b, sb, config=cfg)
    assert (gemm.n, quant.n) == (1, 0)
    G.w8a8_block_fp8_linear(torch.cat([x, x[:1]]), b, sb, config=cfg)  # M = FUSED_MAX_M + 1
    assert (gemm.n, quant.n) == (2, 1)


def test_split_k_single_launch_resets_counters_and_is_deterministic():
    """Split-K in one launch: the last program of each tile reduces the slots in split order, so
    repeated calls are bitwise equal and every tile counter is back to 0 afterwards."""
    M, N, K = 5, 64, 1024
    a, sa, b, sb = _operands(M, N, K, "ue8m0_packed", "ue8m0")
    cfg = {**CONFIGS["sm_89"]["decode_16x64"], "SPLIT_K": 8}
    outs = [fp8_gemm_nt(a, sa, b, sb, config=cfg) for _ in range(2)]
    for o in outs[1:]:
        assert compare_exact(o, outs[0], "split-K repeat")
    cnt = G.splitk_counters(torch.device(DEVICE), 1)
    assert cnt.numel() >= G._MIN_COUNTERS and int(cnt.abs().sum()) == 0
    _check(outs[0], a, sa, b, sb)
    assert not hasattr(G, "_splitk_reduce_kernel")


@pytest.mark.parametrize("name,kw,exc,match", [
    ("x int", {"x": torch.zeros(2, 256, dtype=torch.int32)}, TypeError, "x: dtype"),
    ("x K", {"x": torch.zeros(2, 128, dtype=torch.bfloat16)}, ValueError, "weight: shape"),
    ("x 1d", {"x": torch.zeros(256, dtype=torch.bfloat16)}, ValueError, "x: expected 2 dims"),
    ("weight bf16", {"weight": torch.zeros(64, 256, dtype=torch.bfloat16)}, TypeError, "weight: dtype"),
    ("scale shape", {"weight_scale": torch.zeros(1, 3, dtype=torch.uint8)}, ValueError, "weight_scale: uint8"),
    ("eps", {"eps": 0.0}, ValueError, "eps"),
    ("out", {"out": torch.empty(2, 63, dtype=torch.bfloat16)}, ValueError, "out: expected shape"),
])
def test_linear_bad_inputs_name_the_argument(name, kw, exc, match):
    _, _, b, sb = _operands(2, 64, 256, b_fmt="ue8m0", seed=0)
    args = {"x": torch.zeros(2, 256, dtype=torch.bfloat16), "weight": b.cpu(), "weight_scale": sb.cpu(), **kw}
    args = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    with pytest.raises(exc, match=match):
        G.w8a8_block_fp8_linear(**args)


# ---- the peer in the benchmark: vLLM's Triton block-FP8 GEMM, launched as vLLM launches it --------
@pytest.mark.parametrize("label", ["default", "16x64_w2_s3"])
def test_vllm_peer_launch_matches_reference(label):
    """The installed vLLM's ``_w8a8_triton_block_scaled_mm``, fed our UE8M0 operands decoded to fp32
    (specs.fp8_gemm.peer_operands) with vLLM 0.32's grid/strides, passes the same numerics check."""
    from ds4lab.harness.specs import fp8_gemm as S
    inp = S.make_inputs({"M": 3, "N": 200, "K": 384, "a_fmt": "ue8m0_packed", "b_fmt": "ue8m0"},
                        "zero_groups", _seed(), DEVICE)
    out = S.peer_call(S.peer_kernel().fn, S.peer_operands(inp), S.PEER_CONFIGS[label])()
    reps = S.check(out, R.fp8_gemm_nt(**inp), inp)
    assert all(reps), [r.summary() for r in reps]


def test_fused_refuses_wide_row_tiles_and_auto_falls_back(monkeypatch):
    """BLOCK_M > 32 with a bf16 A tile does not fit sm_89 (mid: 106,496 B, prefill: 163,840 B in
    the compile report): fused=None runs the two launches, fused=True names the config."""
    quant = _Count(fp8_quant._per_token_group_quant_fp8_kernel)
    monkeypatch.setattr(fp8_quant, "_per_token_group_quant_fp8_kernel", quant)
    _, _, b, sb = _operands(2, 64, 256, b_fmt="ue8m0", seed=0)
    x = torch.randn(2, 256).bfloat16().to(DEVICE)
    G.w8a8_block_fp8_linear(x, b, sb, config=CONFIGS["sm_89"]["prefill"])
    assert quant.n == 1
    with pytest.raises(ValueError, match="config=.*BLOCK_M <= 32"):
        G.w8a8_block_fp8_linear(x, b, sb, config=CONFIGS["sm_89"]["mid"], fused=True)


def test_default_config_is_fused_up_to_32_tokens(monkeypatch):
    """17..32 tokens: the default is the decode row, fused (pick_config's 64-row "small" row would
    need the two launches)."""
    quant = _Count(fp8_quant._per_token_group_quant_fp8_kernel)
    monkeypatch.setattr(fp8_quant, "_per_token_group_quant_fp8_kernel", quant)
    _, _, b, sb = _operands(1, 32, 256, b_fmt="ue8m0", seed=0)
    x = torch.randn(20, 256).bfloat16().to(DEVICE)
    got = G.w8a8_block_fp8_linear(x, b, sb)
    assert quant.n == 0
    q, s = fp8_quant.per_token_group_quant_fp8(x, 128, scale_fmt="ue8m0")
    _check(got, q, s, b, sb)


@pytest.mark.parametrize("split", [1, 2])
def test_fused_single_row_path_is_bit_identical_on_adversarial_groups(split):
    """M=1 loads and quantizes one row per k-block (prefetched a k-block ahead, ``_a_rows``): still
    bit-identical to quant + GEMM with NaN, ±inf, 2^108, zero, 1e-30 and subnormal groups in that
    row, an odd k-block count and a split boundary (5 k-blocks, split 2: 3 + 2)."""
    N, K = 96, 640
    g = torch.Generator().manual_seed(_seed())
    x = torch.randn(1, K, generator=g) * 3
    x[0, 0:128] = 0.0
    x[0, 128:256] = 1e-30 * torch.randn(128, generator=g)
    x[0, 256:384] = 2.0 ** -133
    x[0, 400] = 448.0 * 2.0 ** 100
    _, _, b, sb = _operands(1, N, K, b_fmt="ue8m0")
    cfg = {**CONFIGS["sm_89"]["decode"], "SPLIT_K": split}
    for bad in (None, float("nan"), float("inf")):
        xb = x.clone()
        if bad is not None:
            xb[0, 600] = bad
        xb = xb.bfloat16().to(DEVICE)
        assert G._a_rows(xb, 16) == 1
        q, s = fp8_quant.per_token_group_quant_fp8(xb, 128, scale_fmt="ue8m0")
        two = fp8_gemm_nt(q, s, b, sb, config=cfg)
        assert compare_exact(G.w8a8_block_fp8_linear(xb, b, sb, config=cfg), two, f"M=1 fused, {bad}")
        assert two.isnan().all() if bad is not None else not two.isnan().any()
