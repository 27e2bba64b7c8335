"""``mhc_fused_post_pre(quant_out=True)`` (issue 20, pq-mhc): the layer input's FP8 copy written by the seam.

Proves, on the interpreter: for every token count the decode step runs up to 32 (the row it picks on a GPU,
``mhc.SEAM_DEFAULTS`` then ``decode``) and for every other row forced by config, the e4m3 bytes and UE8M0
scale bytes equal ``per_token_group_quant_fp8(layer_input, 128, "ue8m0", eps=1e-10)`` of the bf16 layer input
returned, on adversarial inputs (a 128-column group all zeros, values ~1e4, a NaN token, values at the e4m3
rounding midpoints), and the four other outputs equal the ``quant_out=False`` call bit for bit; the decode
defaults fuse the quant (no second launch); bad ``quant_out`` arguments raise naming it; the compile
report builds the flag-on variant of the step's rows only."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare_exact
from ds4lab.harness.specs import mhc as S
from ds4lab_kernels import mhc as K
from ds4lab_kernels.fp8_quant import per_token_group_quant_fp8

TABLE = K.CONFIGS["sm_89"]
STEP_T = (1, 2, 3, 4, 5, 8, 16, 32)
# every other row, forced by config, where it runs its own kernel (seam1 rows above 4 tokens and seamr rows
# above their limit are the two-pass kernels again): masked tokens (T=3), 4-token blocks, 32 / 128-column
# programs, the two-launch seam1, the seam_* rows (their quant is a second launch), the prefill apply row
FORCED = [("seamr_d64", 3), ("seamr_d64", 16), ("seamr_d32", 4), ("seamr_d128w8", 2), ("seam1_d64", 1),
          ("seam1_d32", 3), ("seam1x2_d64", 4), ("seam_d64", 2), ("seam_d32", 5), ("decode", 1), ("prefill", 8)]
OUT_NAMES = ("residual_cur", "post_mix", "comb_mix", "layer_input")


def _adversarial(T, D=256, seed=0, norm=True):
    """Fused inputs (x2 addend) with: token 0's second 128-column group all zeros (its residual, x, x2), the
    first group's norm weight x1e4 (layer-input values ~1e4), a NaN in x of the last token when T >= 3 (a NaN
    layer-input row: scale bytes 255). ``norm=False``: no norm weight, magnitudes up to ~1e5 (large_rows)."""
    inp = S.make_inputs({"T": T, "D": D}, "x2" if norm else "large_rows", seed, "cpu", kind="fused")
    x, r = inp["x"].clone(), inp["residual"].clone()
    x2 = inp["x2"].clone() if "x2" in inp else None
    if T:
        r[0, :, 128:256] = 0
        x[0, 128:256] = 0
        if x2 is not None:
            x2[0, 128:256] = 0
    if T >= 3:
        x[T - 1, 5] = float("nan")
    inp.update(x=x, residual=r)
    if x2 is not None:
        inp["x2"] = x2
    if norm:
        w = inp["norm_weight"].clone()
        w[:128] *= 1e4
        inp["norm_weight"] = w
    else:
        inp["norm_weight"] = None
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}


def _check(inp, cfg, what):
    plain = K.mhc_fused_post_pre(**inp, config=cfg)
    outs = K.mhc_fused_post_pre(**inp, config=cfg, quant_out=True)
    assert isinstance(outs, tuple) and len(outs) == 5, what
    for name, a, b in zip(OUT_NAMES, plain, outs[:4]):
        rep = compare_exact(b, a, name)
        assert rep, f"{what}: {name} differs from quant_out=False: {rep.summary()}"
    li = outs[3]
    q, s = outs[4]
    T, D = li.shape
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (T, D) and q.is_contiguous(), what
    assert s.dtype == torch.uint8 and tuple(s.shape) == (T, D // 128) and s.is_contiguous(), what
    rq, rs = per_token_group_quant_fp8(li, 128, scale_fmt="ue8m0", eps=1e-10)
    assert torch.equal(s.cpu(), rs.cpu()), f"{what}: scale bytes differ at {(s != rs).nonzero()[:4].tolist()}"
    # e4m3 bytes: equal everywhere; a NaN equals a NaN (its sign bit is the interpreter's float noise: numpy
    # keeps an operand's NaN sign, GPUs write the canonical NaN; compare_exact, ds4lab.harness.numerics)
    qb, rb = q.view(torch.uint8).cpu(), rq.view(torch.uint8).cpu()
    nan = (rb & 0x7F) == 0x7F
    assert torch.equal(nan, (qb & 0x7F) == 0x7F), f"{what}: NaN positions differ"
    bad = (qb != rb) & ~nan
    assert not bad.any(), f"{what}: e4m3 bytes differ at {bad.nonzero()[:4].tolist()}"
    return outs


def _probe(outs, T):
    """The adversarial cases actually happened: a zero group (eps scale), ~1e4 values, NaN rows -> byte 255."""
    li, (q, s) = outs[3].float().cpu(), outs[4]
    s = s.cpu()
    assert (li[0, 128:256] == 0).all() and int(s[0, 1]) == (int(torch.tensor(1e-10 / 448).log2().ceil()) + 127)
    assert li[:, :128].abs().nan_to_num(0).amax() > 1e3
    if T >= 3:
        assert li[T - 1].isnan().all() and (s[T - 1] == 255).all()


@pytest.mark.interp
@pytest.mark.parametrize("T", STEP_T)
def test_step_rows_quant_equals_standalone(T):
    """The row the decode step picks at T tokens (GPU pick_config): fused, bit-identical to the standalone quant."""
    label = S.step_row(T)
    cfg = TABLE[label]
    assert K.quant_out_path(T, cfg) == "fused"
    _probe(_check(_adversarial(T), cfg, f"{label} T={T}"), T)


@pytest.mark.interp
@pytest.mark.parametrize("label,T", FORCED)
def test_forced_rows_quant_equals_standalone(label, T):
    _probe(_check(_adversarial(T, seed=T + 7), TABLE[label], f"{label} T={T}"), T)


@pytest.mark.interp
@pytest.mark.parametrize("label,T", [("seamr_d64", 1), ("seam1_d64", 4), ("decode", 8)])
def test_no_norm_large_rows(label, T):
    """Without the norm weight the layer input keeps the residual's magnitudes (1e-2 .. 1e5 per token)."""
    _check(_adversarial(T, seed=3, norm=False), TABLE[label], f"{label} T={T} no norm")


def _midpoint_inputs(T, D=256):
    """Inputs whose layer input is residual stream 0 exactly (post 0, comb the identity, pre gate 1 from a
    zero fn row and a +100 bias, pre eps 0, no norm) and stream 0 holds, per 128-column group, the e4m3
    maximum 448 and the 126 midpoints between consecutive e4m3 values (signs mixed), times ``2^(t + 2g - 3)``:
    the group's scale is that power of two, every other value lands exactly on a rounding midpoint."""
    inp = S.make_inputs({"T": T, "D": D}, "random", 1, "cpu", kind="fused")
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()   # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2                                                     # 126 midpoints
    g = torch.Generator().manual_seed(5)
    r = torch.zeros(T, 4, D)
    for t in range(T):
        for grp in range(D // 128):
            v = torch.cat([torch.tensor([448.0]), mids, torch.tensor([-mids[40].item()])])
            v = v * torch.where(torch.rand(128, generator=g) < 0.5, -1.0, 1.0)
            r[t, 0, grp * 128:(grp + 1) * 128] = v[torch.randperm(128, generator=g)] * 2.0 ** (t + 2 * grp - 3)
    fn = inp["fn"].clone()
    fn[:4] = 0
    base = inp["hc_base"].clone()
    base[:4] = torch.tensor([100.0, -100.0, -100.0, -100.0])
    inp.update(residual=r.to(torch.bfloat16), post_mix=torch.zeros(T, 4, 1), x=torch.zeros(T, D).to(torch.bfloat16),
               comb_mix=torch.eye(4).expand(T, 4, 4).contiguous(), fn=fn, hc_base=base, hc_pre_eps=0.0,
               norm_weight=None)
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}, r


@pytest.mark.interp
@pytest.mark.parametrize("label,T", [("seamr_d64", 1), ("seam1_d64", 3), ("decode", 8), ("seam_d64", 2)])
def test_rounding_midpoints(label, T):
    """Values exactly halfway between e4m3 neighbours round to even, as the standalone quant and torch's cast."""
    inp, r = _midpoint_inputs(T)
    outs = _check(inp, TABLE[label], f"{label} T={T} midpoints")
    li = outs[3].float().cpu()
    assert torch.equal(li, r[:, 0]), "precondition: the layer input is stream 0"
    q, s = outs[4]
    scale = torch.pow(2.0, (s.cpu().to(torch.int32) - 127).to(torch.float32))           # [T, G]
    want = (li / scale.repeat_interleave(128, dim=1)).to(torch.float8_e4m3fn)           # torch: RTNE
    assert torch.equal(q.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.interp
def test_zero_tokens():
    inp = S.make_inputs({"T": 0, "D": 128}, "random", 0, DEVICE, kind="fused")
    outs = K.mhc_fused_post_pre(**inp, quant_out=True)
    assert tuple(outs[4][0].shape) == (0, 128) and tuple(outs[4][1].shape) == (0, 1)


@pytest.mark.interp
def test_bad_quant_out_arguments():
    inp = S.make_inputs({"T": 1, "D": 128}, "random", 0, DEVICE, kind="fused")
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="quant_out"):
            K.mhc_fused_post_pre(**inp, quant_out=bad)
    odd = S.make_inputs({"T": 1, "D": 192}, "random", 0, DEVICE, kind="fused")   # hidden % 128 != 0
    with pytest.raises(ValueError, match="quant_out"):
        K.mhc_fused_post_pre(**odd, quant_out=True)


def test_decode_defaults_fuse_the_quant():
    """Every token count up to 32 on both GPU tables: the step's row writes the FP8 copy itself (no second
    launch); every seamr / seam1 row's column block divides 128 (so they fuse too); only seam_* rows do not."""
    for arch in ("sm_89", "sm_90"):
        table = K.CONFIGS[arch]
        for T in range(1, 33):
            assert K.quant_out_path(T, table[S.step_row(T, arch)]) == "fused", (arch, T)
        for label, row in table.items():
            for T in (1, 4, 16):
                want = "separate" if K.seam_path(T, row) == "seam" else "fused"
                assert K.quant_out_path(T, row) == want, (arch, label, T)


def test_compile_report_rows():
    """The flag-on compile rows: only the step's row at T = 1 (seamr_d64), 4 (seam1_d64), 8 and 32 (seamt_d32; on
    sm_90 too from session 15), 64 (decode)."""
    cfg_for = S._config_for_kernel("mhc_fused_post_pre")
    got = [(sh["T"], cfg_for("sm_89", sh)) for sh in S.AOT_SHAPES_QUANT]
    assert got == [(1, ["seamr_d64"]), (4, ["seam1_d64"]), (8, ["seamt_d32"]), (32, ["seamt_d32"]), (64, ["decode"])]
    got = [(sh["T"], cfg_for("sm_90", sh)) for sh in S.AOT_SHAPES_QUANT]
    assert got == [(1, ["seamr_d64"]), (4, ["seam1_d64"]), (8, ["seamt_d32"]), (32, ["seamt_d32"]), (64, ["decode"])]
    assert all(S.make_inputs(sh, "random", 0, "cpu", kind="fused")["quant_out"] is True
               for sh in S.AOT_SHAPES_QUANT[:1])


def test_reference_quant_out():
    """The float64 reference takes the same flag: its 5th output is the reference quant of its layer input."""
    from ds4lab.reference import mhc as R
    from ds4lab.reference.quant import per_token_group_quant_fp8 as ref_quant
    inp = S.make_inputs({"T": 2, "D": 256}, "x2", 0, "cpu", kind="fused")
    outs = R.mhc_fused_post_pre(**inp, quant_out=True)
    q, s = ref_quant(outs[3], 128, scale_fmt="ue8m0", eps=1e-10)
    assert len(outs) == 5 and torch.equal(outs[4][0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(outs[4][1], s) and len(R.mhc_fused_post_pre(**inp)) == 4
