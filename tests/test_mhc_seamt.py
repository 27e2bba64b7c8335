"""The token-parallel mHC decode seam (`_mhc_seam_tok_kernel`, rows `seamt_*`, issue 20 / mhc16): numerics against
the float64 reference on the adversarial cases (interpreter: its two-launch phases), a program running several
phase-B tasks, near-degenerate comb / gate logits, 16 distinct tokens equal to one-token calls, the new residual
bit-equal to the two-pass kernels, x2 bit-equal to the separate add, determinism, the fused FP8 copy, a broken
output failing the check, the launch plan, and `pick_config` reading `SEAM_DEFAULTS` per call (the step's --ab)."""
import pytest
import torch

from conftest import DEVICE
from conftest import assert_reports as _assert_all
from conftest import fused_seam_inputs as _inputs
from ds4lab.harness.numerics import compare
from ds4lab.harness.specs import mhc as S
from ds4lab.reference import mhc as R
from ds4lab_kernels import mhc as K

TABLE = K.CONFIGS["sm_89"]


@pytest.mark.interp
@pytest.mark.parametrize("label,T,D,case,quant", [
    ("seamt_d32", 1, 256, "sharp_comb", True), ("seamt_d32", 2, 320, "x2_cancel", False),
    ("seamt_d32", 5, 384, "large_rows", True), ("seamt_d32", 20, 384, "x2", True),
    ("seamt_d32", 3, 256, "zero_rows", True), ("seamt_d32", 32, 128, "sharp_comb", True),
    ("seamt_d32", 17, 320, "nan_row", False)])
def test_seamt_matches_reference(label, T, D, case, quant):
    """1-32 tokens (17, 20: two token blocks, the second masked; T=20 at D=384 is 20 tasks on 12 programs, so
    programs run several phase-B tasks) vs the fp64 reference; D=320 leaves a partial last column block and a
    partial phase-B chunk; with quant_out the FP8 copy is the standalone quant of the layer input, bit for bit."""
    inp, seed = _inputs(T, D=D, case=case)
    if quant:
        inp["quant_out"] = True
    out = K.mhc_fused_post_pre(**inp, config=TABLE[label])
    ref = R.mhc_fused_post_pre(**{k: v for k, v in inp.items() if k != "quant_out"})
    _assert_all(S.check_fused(out, ref, inp), seed)


@pytest.mark.interp
def test_seamt_degenerate_logits_and_no_norm():
    """Comb logits spread +-30 and gate logits at +-40 on large-magnitude rows; and without a norm weight."""
    inp, seed = _inputs(6, D=192, case="large_rows")
    g = torch.Generator().manual_seed(seed)
    base = inp["hc_base"].cpu().clone()
    base[8:] = 30.0 * torch.randn(16, generator=g)
    base[:8] = torch.tensor([-40.0, 40.0, 0.5, -3.0, 40.0, -40.0, 1.0, 0.0])
    inp["hc_base"] = base.to(DEVICE)
    _assert_all(S.check_fused(K.mhc_fused_post_pre(**inp, config=TABLE["seamt_d32"]), R.mhc_fused_post_pre(**inp),
                              inp), seed)
    inp["norm_weight"] = None
    _assert_all(S.check_fused(K.mhc_fused_post_pre(**inp, config=TABLE["seamt_d32"]), R.mhc_fused_post_pre(**inp),
                              inp), seed)


@pytest.mark.interp
def test_seamt_tokens_are_one_token_calls_and_match_two_pass():
    """16 distinct tokens give each token what a one-token call gives (residual bit for bit, gates / layer input
    within fp32 / one bf16 step); the residual equals the two-pass `decode` row's bits; x2 == the separate add
    bit for bit; two runs give the same bits."""
    inp, seed = _inputs(16, D=128, case="x2")
    cfg = TABLE["seamt_d32"]
    cur, post, comb, out = got = K.mhc_fused_post_pre(**inp, config=cfg)
    for t in (0, 7, 15):
        one = {k: (v[t:t + 1] if isinstance(v, torch.Tensor) and k in ("x", "x2", "residual", "post_mix", "comb_mix")
                   else v) for k, v in inp.items()}
        c1, p1, k1, o1 = K.mhc_fused_post_pre(**one, config=cfg)
        assert torch.equal(c1, cur[t:t + 1]), f"seed={seed} token {t}: residual differs"
        _assert_all([compare(p1, post[t:t + 1], S._TOL_FP32, f"post t={t}"),
                     compare(k1, comb[t:t + 1], S._TOL_FP32, f"comb t={t}"),
                     compare(o1, out[t:t + 1], "bfloat16", f"layer_input t={t}")], seed)
    ref = K.mhc_fused_post_pre(**inp, config=TABLE["decode"])
    assert torch.equal(cur, ref[0]), f"seed={seed}: residual differs from decode"
    summed = dict(inp, x=(inp["x"].float() + inp["x2"].float()).to(torch.bfloat16))
    del summed["x2"]
    want = K.mhc_fused_post_pre(**summed, config=cfg)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), f"seed={seed}: x2 differs from the separate add"
    again = K.mhc_fused_post_pre(**inp, config=cfg)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), f"seed={seed}: not deterministic"


@pytest.mark.interp
def test_seamt_broken_output_fails_the_check():
    """The budgets catch a real error: two tokens' comb swapped, one token's layer input scaled by 1.05."""
    inp, seed = _inputs(4, D=128, case="random")
    cur, post, comb, out = K.mhc_fused_post_pre(**inp, config=TABLE["seamt_d32"])
    ref = R.mhc_fused_post_pre(**inp)
    assert all(S.check_fused((cur, post, comb, out), ref, inp)), f"seed={seed}"
    bad_out = out.clone()
    bad_out[2] = (bad_out[2].float() * 1.05).to(torch.bfloat16)
    assert not all(S.check_fused((cur, post, comb, bad_out), ref, inp)), f"seed={seed}"
    assert not all(S.check_fused((cur, post, comb.flip(0), out), ref, inp)), f"seed={seed}"


def test_seamt_plan(monkeypatch):
    """16-token blocks x SEAMT_BLOCK_D columns; phase-B chunks the smallest power of two >= 128 giving at most one
    task a program; one launch while the grid fits 2 programs a SM (4 warps), never on the interpreter."""
    dev = torch.device("cpu")
    assert K.seamt_plan(2, 4096, dev, TABLE["seamt_d32"])["launches"] == 2     # the interpreter
    monkeypatch.setattr(K, "_interpreting", lambda: False)                    # 128 SMs on the CPU (RTX 4090)
    want = {1: (128, 128, 32), 2: (128, 128, 64), 4: (128, 128, 128), 8: (128, 256, 128), 16: (128, 512, 128),
            32: (256, 512, 256)}
    for T, (P, chunk, tasks) in want.items():
        p = K.seamt_plan(T, 4096, dev, TABLE["seamt_d32"])
        assert (p["programs"], p["CHUNK"], p["n_tasks"], p["launches"], p["BLOCK_S"], p["PART_ROWS"]) == (
            P, chunk, tasks, 1, 128, 64), T
    p = K.seamt_plan(32, 4096, dev, {**TABLE["seamt_d32"], "SEAMT_BLOCK_D": 64})
    assert (p["programs"], p["CHUNK"], p["n_tasks"]) == (128, 1024, 128)
    assert K.seamt_plan(2, 4096, dev, {**TABLE["seamt_d32"], "SEAMT_LAUNCHES": 2})["launches"] == 2
    assert K.seamt_plan(64, 4096, dev, {**TABLE["seamt_d32"], "SEAMT_MAX_T": 64})["launches"] == 2   # 512 programs
    with pytest.raises(ValueError, match="num_tokens=33"):
        K.seamt_plan(33, 4096, dev, TABLE["seamt_d32"])
    assert K.seam_path(32, TABLE["seamt_d32"]) == "seamt" and K.seam_path(33, TABLE["seamt_d32"]) == "two_pass"
    assert K.quant_out_path(8, TABLE["seamt_d32"]) == "fused" and not K.prefetch_issued(2, TABLE["seamt_d32"])


def test_pick_config_reads_seam_defaults_per_call(monkeypatch):
    """`ds4lab step --ab "mhc.SEAM_DEFAULTS={'sm_89': ((1,'seamr_d64'),(32,'seamt_d32')), ...}"` rebinds the module
    global: the next pick_config sees it (the bound is not frozen at import)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(K, "arch_of", lambda d: "sm_89")
    monkeypatch.setattr(K, "SEAM_DEFAULTS", {**K.SEAM_DEFAULTS, "sm_89": ((1, "seamr_d64"), (32, "seamt_d32"))})
    assert K.pick_config(1, cuda, fused=True) is TABLE["seamr_d64"]
    assert K.pick_config(2, cuda, fused=True) is TABLE["seamt_d32"]
    assert K.pick_config(32, cuda, fused=True) is TABLE["seamt_d32"]
    assert K.pick_config(33, cuda, fused=True) is TABLE["decode"]
    monkeypatch.setattr(K, "SEAM_DEFAULTS", {**K.SEAM_DEFAULTS, "sm_89": ((1, "seamr_d64"),)})
    assert K.pick_config(2, cuda, fused=True) is TABLE["decode"]


def test_shipped_seam_defaults(monkeypatch):
    """The timed split (sessions 13-14, sm_89 build): seamr_d64 at 1 token, seam1_d64 at 2-4, seamt_d32 at 5-32, the
    two-pass ``decode`` from 33; the sm_90 table the same from session 15 (its native step timed with them)."""
    cuda = torch.device("cuda")
    for arch, want in (("sm_89", {1: "seamr_d64", 2: "seam1_d64", 4: "seam1_d64", 5: "seamt_d32", 16: "seamt_d32",
                                  17: "seamt_d32", 32: "seamt_d32", 33: "decode"}),
                       ("sm_90", {1: "seamr_d64", 4: "seam1_d64", 5: "seamt_d32", 32: "seamt_d32", 33: "decode"})):
        monkeypatch.setattr(K, "arch_of", lambda d, a=arch: a)
        table = K.CONFIGS[arch]
        got = {T: next(lb for lb, c in table.items() if c is K.pick_config(T, cuda, fused=True)) for T in want}
        assert got == want, arch
