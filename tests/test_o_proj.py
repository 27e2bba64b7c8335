"""o-projection: specifics beyond the registry sweep (issue 5): odd T, per-rank head counts for
TP 1/2/4/8, positions at the end of the cos/sin cache, zero rows, scale encodings, the BF16 drafter
path, split-K, the 2-D checkpoint layout, and bad inputs that must raise naming the argument."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.geometry import DEFAULT_CONFIG, op_shapes
from ds4lab.harness.specs import o_proj as spec
from ds4lab.harness.numerics import compare, compare_exact
from ds4lab.reference import o_proj as ref
from ds4lab.reference.quant import decode_ue8m0
from ds4lab_kernels import o_proj as K

pytestmark = pytest.mark.interp


def _seed():
    return int(torch.randint(0, 2**31, (1,)))


def _rope(T, H, case="random", **kw):
    return spec.rope_inputs({"T": T, "H": H, **kw}, case, _seed(), DEVICE)


@pytest.mark.parametrize("tp,T", [(1, 1), (2, 7), (4, 33), (8, 33)])
def test_inv_rope_odd_T_every_tp_and_encodings(tp, T):
    """Per-rank heads for TP 1,2,4,8 (64/32/16/8 heads, 8 per group) at odd T: all three scale
    encodings agree byte for byte with the reference and with each other."""
    H = op_shapes(DEFAULT_CONFIG, tp)["o_proj"].dims["H"]
    inp = _rope(T, H)
    outs = {}
    for fmt in ("fp32", "pow2", "ue8m0"):
        q, s = K.inv_rope_fp8_quant(**{**inp, "scale_fmt": fmt})
        rq, rs = ref.inv_rope_fp8_quant(**{**inp, "scale_fmt": fmt})
        assert q.shape == (T, H // 8, 4096) and s.shape == (T, H // 8, 32)
        assert compare_exact(q, rq, fmt) and compare_exact(s, rs, fmt)
        outs[fmt] = (q, s)
    assert torch.equal(outs["pow2"][0].view(torch.uint8), outs["ue8m0"][0].view(torch.uint8))
    assert torch.equal(decode_ue8m0(outs["ue8m0"][1].cpu()), outs["pow2"][1].cpu())


def test_inverse_rope_undoes_forward_rope():
    """Rotating by +theta (vLLM forward GPT-J RoPE) then through the kernel's bf16 path gives back
    the input (to bf16 rounding); the NoPE part is untouched bit for bit."""
    T, H, P = 5, 8, 64
    inp = _rope(T, H, quantize=False)
    x = inp["o"].float()
    cs = inp["cos_sin_cache"][inp["positions"]]
    cos, sin = cs[:, None, :32], cs[:, None, 32:]
    fwd = x.clone()
    ev, od = x[..., 448::2], x[..., 449::2]
    fwd[..., 448::2] = ev * cos - od * sin
    fwd[..., 449::2] = od * cos + ev * sin
    back = K.inv_rope_fp8_quant(fwd.to(torch.bfloat16), inp["positions"], inp["cos_sin_cache"], 8, quantize=False)
    back = back.view(T, H, 512)
    assert torch.equal(back[..., :448], inp["o"][..., :448])
    # tight, and it holds: fwd's bf16 rounding (half an ulp per component) rotated back, then the
    # kernel's own rounding to the bf16 grid x lives on, leave x at most one bf16 ulp of the row
    # max's binade away = 2^-7 * scale at a power-of-two max, less otherwise (2000 draws: worst
    # 0.955 of this bound, no draw above it)
    err = (back[..., 448:].float() - x[..., 448:]).abs().amax(dim=(1, 2))
    scale = x[..., 448:].abs().amax(dim=(1, 2))
    assert torch.all(err <= 2.0 ** -7 * scale), (err, scale)


def test_positions_at_end_of_cache_and_int32():
    inp = _rope(6, 16, "cache_end")
    P = inp["cos_sin_cache"].shape[0]
    assert int(inp["positions"].max()) == P - 1
    q, s = K.inv_rope_fp8_quant(**inp)
    q32, s32 = K.inv_rope_fp8_quant(**{**inp, "positions": inp["positions"].to(torch.int32)})
    rq, rs = ref.inv_rope_fp8_quant(**inp)
    assert compare_exact(q, rq) and compare_exact(s, rs)
    assert torch.equal(q.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(s, s32)


def test_zero_rows_and_strided_o():
    inp = _rope(4, 8, "zero_rows")
    big = torch.zeros(4, 12, 512, dtype=torch.bfloat16, device=DEVICE)
    big[:, 2:10] = inp["o"]
    view = big[:, 2:10]  # head stride 512, token stride 12*512: not contiguous over heads/tokens
    q, s = K.inv_rope_fp8_quant(**{**inp, "o": view})
    rq, rs = ref.inv_rope_fp8_quant(**inp)
    assert compare_exact(q, rq) and compare_exact(s, rs)
    assert torch.all(q[0].float() == 0) and not torch.isnan(q.float()).any()


def test_unchecked_out_of_range_position_gives_nan_not_garbage():
    inp = _rope(3, 8)
    pos = inp["positions"].clone()
    pos[1] = inp["cos_sin_cache"].shape[0] + 5
    q, s = K.inv_rope_fp8_quant(**{**inp, "positions": pos, "scale_fmt": "fp32"}, check_positions=False)
    assert torch.isnan(s[1]).all() and not torch.isnan(s[0]).any() and not torch.isnan(s[2]).any()


def _einsum(T, G, N, Kd, case="random", **kw):
    return spec.einsum_inputs({"T": T, "G": G, "N": N, "K": Kd, **kw}, case, _seed(), DEVICE)


@pytest.mark.parametrize("split", [1, 2, 4])
def test_einsum_split_k_agrees(split):
    inp = _einsum(5, 2, 128, 512)
    cfg = {**K.CONFIGS["sm_89"]["decode"], "SPLIT_K": split}
    out = K.fp8_einsum_bhr_hdr_bhd(**inp, config=cfg)
    assert compare(out, ref.fp8_einsum_bhr_hdr_bhd(**inp), "bfloat16")


def test_einsum_scale_encodings_and_e8m0_dtype():
    inp = _einsum(3, 1, 128, 256, x_fmt="ue8m0", w_fmt="ue8m0")
    want = ref.fp8_einsum_bhr_hdr_bhd(**inp)
    a = K.fp8_einsum_bhr_hdr_bhd(**inp)
    f32 = {**inp, "x_s": decode_ue8m0(inp["x_s"]), "wo_a_s": decode_ue8m0(inp["wo_a_s"])}
    b = K.fp8_einsum_bhr_hdr_bhd(**f32)
    assert compare(a, want, "bfloat16") and torch.equal(a, b)
    if hasattr(torch, "float8_e8m0fnu"):
        c = K.fp8_einsum_bhr_hdr_bhd(inp["x"], inp["x_s"].view(torch.float8_e8m0fnu), inp["wo_a"],
                                     inp["wo_a_s"].view(torch.float8_e8m0fnu))
        assert torch.equal(a, c)


def test_einsum_out_and_empty():
    inp = _einsum(2, 1, 128, 128)
    out = torch.empty(2, 1, 128, dtype=torch.bfloat16, device=DEVICE)
    r = K.fp8_einsum_bhr_hdr_bhd(**inp, out=out)
    assert r.data_ptr() == out.data_ptr()
    e = _einsum(0, 2, 128, 256)
    assert K.fp8_einsum_bhr_hdr_bhd(**e).shape == (0, 2, 128)


def _oproj(T, H, path="fp8", case="random", **kw):
    return spec.o_proj_inputs({"T": T, "H": H, "R": 128, "N": 128, "path": path, **kw}, case, _seed(), DEVICE)


def test_einsum_eight_groups_tp1():
    """TP=1 has 8 wo_a groups; a short K keeps the interpreter fast (the o_proj tests use K=4096)."""
    inp = _einsum(3, 8, 128, 256)
    assert compare(K.fp8_einsum_bhr_hdr_bhd(**inp), ref.fp8_einsum_bhr_hdr_bhd(**inp), "bfloat16")


@pytest.mark.parametrize("tp", [4, 8])
def test_o_proj_heads_per_rank(tp):
    """The per-rank head counts of TP 4/8 (G = 2/1 groups of 8 heads, K = 4096); small R/N. TP 1/2
    head counts are covered per part (inv-RoPE above, 8-group einsum) to keep the interpreter fast."""
    H = op_shapes(DEFAULT_CONFIG, tp)["o_proj"].dims["H"]
    inp = _oproj(1 if tp <= 2 else 3, H)
    out = K.o_proj(**inp)
    assert out.shape == (inp["o"].shape[0], 128) and out.dtype == torch.bfloat16
    assert compare(out, ref.o_proj(**inp), "bfloat16")


def test_o_proj_bf16_drafter_path_and_2d_checkpoint_layout():
    """wo_a without scales (community MTP drafter): bf16 path; wo_a given as the checkpoint's 2-D
    ``[G*R, K]`` gives the same result; an FP8 wo_b after a BF16 wo_a also works."""
    inp = _oproj(7, 8, "bf16", "zero_rows")
    out = K.o_proj(**inp)
    assert compare(out, ref.o_proj(**inp), "bfloat16")
    two_d = K.o_proj(**{**inp, "wo_a": inp["wo_a"].reshape(-1, 4096)})
    assert torch.equal(out, two_d)
    qb, sb = spec.block_quant_weight(inp["wo_b"][None].float(), "ue8m0")
    mixed = {**inp, "wo_b": qb[0], "wo_b_s": sb[0]}
    assert compare(K.o_proj(**mixed), ref.o_proj(**mixed), "bfloat16")


def test_o_proj_fp8_2d_scales_and_cache_end():
    inp = _oproj(2, 8, "fp8", "cache_end", scale_fmt="fp32")
    out = K.o_proj(**inp)
    two_d = K.o_proj(**{**inp, "wo_a": inp["wo_a"].reshape(-1, 4096), "wo_a_s": inp["wo_a_s"].reshape(-1, 32)})
    assert torch.equal(out, two_d)
    assert compare(out, ref.o_proj(**inp), "bfloat16")


# ---- bad inputs ----------------------------------------------------------------------------------
def _rope_bad():
    return _rope(2, 8)


@pytest.mark.parametrize("mut,exc,match", [
    (lambda d: {**d, "o": d["o"][:, :7]}, ValueError, "num_heads=7"),                    # wrong head count
    (lambda d: {**d, "o": d["o"].float()}, TypeError, "o: dtype"),
    (lambda d: {**d, "o": d["o"].transpose(1, 2).contiguous().transpose(1, 2)}, ValueError, "o: last dim"),
    (lambda d: {**d, "positions": d["positions"] + 1000}, ValueError, "missing cos/sin rows"),
    (lambda d: {**d, "positions": d["positions"] - 1000}, ValueError, "missing cos/sin rows"),
    (lambda d: {**d, "positions": d["positions"][:1]}, ValueError, "positions: expected shape"),
    (lambda d: {**d, "positions": d["positions"].float()}, TypeError, "positions: dtype"),
    (lambda d: {**d, "cos_sin_cache": d["cos_sin_cache"][:, :63]}, ValueError, "rope_dim=63"),
    (lambda d: {**d, "cos_sin_cache": d["cos_sin_cache"][:0]}, ValueError, "no rows"),
    (lambda d: {**d, "o": d["o"][..., :500]}, ValueError, "head_dim=500"),
    (lambda d: {**d, "cos_sin_cache": d["cos_sin_cache"].half()}, TypeError, "cos_sin_cache: dtype"),
    (lambda d: {**d, "cos_sin_cache": d["cos_sin_cache"].t().contiguous().t()}, ValueError, "cos_sin_cache: last dim"),
    (lambda d: {**d, "scale_fmt": "e8m0"}, ValueError, "scale_fmt"),
    (lambda d: {**d, "heads_per_group": 3}, ValueError, "heads_per_group=3"),
])
def test_inv_rope_bad_inputs(mut, exc, match):
    with pytest.raises(exc, match=match):
        K.inv_rope_fp8_quant(**mut(_rope_bad()))


def test_narrow_cos_sin_is_applied_to_last_dims_only():
    """A 32-wide cos/sin cache is a legal (smaller) rope_dim, not an error: it rotates the last 32."""
    d = _rope(2, 8, quantize=False)
    d["cos_sin_cache"] = d["cos_sin_cache"][:, :32].contiguous()
    assert compare_exact(K.inv_rope_fp8_quant(**d), ref.inv_rope_fp8_quant(**d))


@pytest.mark.parametrize("mut,exc,match", [
    (lambda d: {**d, "x": d["x"].float()}, TypeError, "x: dtype"),
    (lambda d: {**d, "wo_a_s": None}, ValueError, "give both scales"),
    (lambda d: {**d, "wo_a": d["wo_a"][:, :, :128]}, ValueError, "wo_a: shape"),
    (lambda d: {**d, "x_s": d["x_s"][:, :, :1]}, ValueError, "x_s: shape"),
    (lambda d: {**d, "wo_a_s": d["wo_a_s"][:, :, :1]}, ValueError, "wo_a_s: shape"),
    (lambda d: {**d, "x_s": d["x_s"].to(torch.float16)}, TypeError, "x_s: dtype"),
    (lambda d: {**d, "wo_a": d["wo_a"].transpose(1, 2).contiguous().transpose(1, 2)}, ValueError, "wo_a: last dim"),
    (lambda d: {**d, "x": d["x"].transpose(0, 2).contiguous().transpose(0, 2)}, ValueError, "x: last dim"),
])
def test_einsum_bad_inputs(mut, exc, match):
    with pytest.raises(exc, match=match):
        K.fp8_einsum_bhr_hdr_bhd(**mut(_einsum(2, 2, 128, 256)))


@pytest.mark.parametrize("mut,exc,match", [
    (lambda d: {**d, "o": d["o"][:, :12]}, ValueError, "num_heads=12"),
    (lambda d: {**d, "wo_a": d["wo_a"][:1]}, ValueError, "wrong head count"),
    (lambda d: {**d, "wo_b": d["wo_b"][:, :128]}, ValueError, "wo_b: shape"),
    (lambda d: {**d, "wo_a_s": None}, ValueError, "FP8 wo_a needs its block scales"),
    (lambda d: {**d, "wo_b_s": None}, ValueError, "FP8 wo_b needs its block scales"),
    (lambda d: {**d, "positions": d["positions"] + 10_000}, ValueError, "missing cos/sin rows"),
])
def test_o_proj_bad_inputs(mut, exc, match):
    with pytest.raises(exc, match=match):
        K.o_proj(**mut(_oproj(2, 16)))


# ---- fused 2-launch path (issue 20) -----------------------------------------------------------------
def _wo_a_small(G, R=128, seed=0, fmt="fp32"):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return spec.block_quant_weight(torch.randn(G, R, 4096, generator=g, device=DEVICE) / 64.0, fmt)


_A1 = {"BLOCK_M": 64, "BLOCK_N": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize("case,fmt,H,rsplit", [("nan_rows", "fp32", 8, False), ("outliers", "pow2", 8, True),
                                               ("cache_end", "ue8m0", 16, False), ("nan_rows", "ue8m0", 8, True)])
def test_fused_prologue_feeds_the_bytes_of_inv_rope_fp8_quant(case, fmt, H, rsplit):
    """Launch 1's prologue (inverse RoPE + 1x128 quant per k step) gives the MMA exactly the bytes and
    scales of ``inv_rope_fp8_quant``: with the same split the wo_a product is bit-identical to the
    same kernel fed the quantized tensors, and its z quant epilogue is bit-identical to
    ``per_token_group_quant_fp8`` of its own bf16 z (today's quant step)."""
    from ds4lab_kernels.fp8_quant import per_token_group_quant_fp8
    inp = _rope(5, H, case, scale_fmt=fmt)
    T, G = 5, H // 8
    w, ws = _wo_a_small(G, fmt="ue8m0" if fmt == "ue8m0" else "fp32")
    x, xs = K.inv_rope_fp8_quant(**inp)
    sdt = torch.uint8 if fmt == "ue8m0" else torch.float32
    pow2 = fmt != "fp32"
    z_ref = torch.empty(T, G, 128, dtype=torch.bfloat16, device=DEVICE)
    K._fused_gemm(0, x, xs, w, ws, T, G, 128, 4096, _A1, out=z_ref, pow2=pow2)
    o = inp["o"]
    o_g = o.as_strided((T, G, 4096), (o.stride(0), 8 * o.stride(1), 1))
    z = torch.empty_like(z_ref)
    zq = torch.empty(T, G, 128, dtype=torch.float8_e4m3fn, device=DEVICE)
    zs = torch.empty(T, G, 1, dtype=sdt, device=DEVICE)
    K._fused_gemm(2, o_g, None, w, ws, T, G, 128, 4096, {**_A1, "ROPE_SPLIT": rsplit}, out=z, q=zq, qs=zs,
                  positions=inp["positions"],
                  cos_sin=inp["cos_sin_cache"], head_stride=o.stride(1), head_dim=512, rope=64, pow2=pow2)
    assert compare_exact(z, z_ref, "z (rope prologue vs quantized input)")
    rq, rs = per_token_group_quant_fp8(z.view(T, G * 128), 128, scale_fmt=fmt)
    assert compare_exact(zq.view(T, -1), rq, "z fp8 bytes") and compare_exact(zs.view(T, -1), rs, "z scales")
    if case != "nan_rows":
        assert compare(z_ref, ref.fp8_einsum_bhr_hdr_bhd(x, xs, w, ws), "bfloat16")
    assert int(K._counters(torch.device(DEVICE), 1).abs().sum()) == 0  # every tile reset its counter


def test_fused_wo_b_prologue_quant_is_per_token_group_quant():
    """Launch 2 with a bf16 A (quant_z="wo_b") quantizes in its prologue exactly as
    ``per_token_group_quant_fp8`` does: same output as the fp8 A path bit for bit, any split."""
    from ds4lab_kernels.fp8_quant import per_token_group_quant_fp8
    T, Kb, N = 3, 512, 256
    g = torch.Generator(device=DEVICE).manual_seed(1)
    z = (torch.randn(T, Kb, generator=g, device=DEVICE) * 3).to(torch.bfloat16)
    z[1, 128:256] = 0.0
    w, ws = spec.block_quant_weight(torch.randn(1, N, Kb, generator=g, device=DEVICE) / 16, "ue8m0")
    zq, zs = per_token_group_quant_fp8(z, 128, scale_fmt="ue8m0")
    outs = []
    for mode, a, a_s in ((0, zq.view(T, 1, Kb), zs.view(T, 1, -1)), (1, z.view(T, 1, Kb), None)):
        for split in (1, 4):
            out = torch.empty(T, 1, N, dtype=torch.bfloat16, device=DEVICE)
            K._fused_gemm(mode, a, a_s, w, ws, T, 1, N, Kb, {**_A1, "SPLIT_K": split}, out=out, pow2=True)
            outs.append((split, out))
    assert compare_exact(outs[2][1], outs[0][1]) and compare_exact(outs[3][1], outs[1][1])
    want = ref.fp8_einsum_bhr_hdr_bhd(zq.view(T, 1, Kb), zs.view(T, 1, -1), w, ws)
    assert all(compare(o, want, "bfloat16") for _, o in outs)


@pytest.mark.parametrize("label", ["fused", "unfused"])
def test_o_proj_candidates_agree(label):
    """The candidates of the o_proj bench (interpreter-sized tiles, their own quant_z / path) against
    the reference (the unfused3 rows: tests/test_o_proj_3.py)."""
    inp = _oproj(3, 16, "fp8", "outlier_head", scale_fmt="ue8m0")
    cfg = {**K.CONFIGS["sm_89"][label]}
    if cfg["path"] == "fused":
        cfg = {**cfg, "wo_a": dict(_A1), "wo_b": {**_A1, "SPLIT_K": 1}}
    assert compare(K.o_proj(**inp, config=cfg), ref.o_proj(**inp), "bfloat16")


def test_fused_unchecked_bad_position_is_nan_strided_o_and_defaults():
    """An unchecked out-of-range position makes its token NaN and changes no bit of the others (rows
    are independent through both launches); a strided ``o`` view gives the same bits."""
    inp = _oproj(3, 8)
    pos = inp["positions"].clone()
    pos[1] = inp["cos_sin_cache"].shape[0] + 7
    out = K.o_proj(**{**inp, "positions": pos}, check_positions=False)
    big = torch.zeros(3, 12, 512, dtype=torch.bfloat16, device=DEVICE)
    big[:, 2:10] = inp["o"]  # token stride 12 heads, storage offset 2 heads: the prologue's strides
    good = K.o_proj(**{**inp, "o": big[:, 2:10]})
    assert compare(good, ref.o_proj(**inp), "bfloat16")
    assert torch.isnan(out[1]).all() and not torch.isnan(good).any()
    assert torch.equal(out[0], good[0]) and torch.equal(out[2], good[2])
    assert K.o_proj(**{**inp, "o": inp["o"][:0], "positions": pos[:0]}).shape == (0, 128)
    dev = torch.device(DEVICE)
    assert K.pick_o_proj_config(K.FUSED_MAX_T, dev)["path"] == "fused"
    assert K.pick_o_proj_config(K.FUSED_MAX_T + 1, dev)["path"] == "unfused"
    assert set(K.DECODE_DEFAULT.values()) <= set(K.OPROJ_LABELS)


@pytest.mark.parametrize("cfg,match", [
    ({"path": "bogus"}, "path='bogus'"),
    ({"path": "fused", "quant_z": "z"}, "quant_z='z'"),
    ({"path": "fused", "wo_a": {**_A1, "BLOCK_N": 64}}, "BLOCK_N=128"),
    ({"path": "fused", "wo_a": {**_A1, "SPLIT_K": 0}}, "SPLIT_K=0"),
])
def test_fused_bad_configs(cfg, match):
    with pytest.raises(ValueError, match=match):
        K.o_proj(**_oproj(2, 8), config=cfg)
