"""The row-tile mHC decode seam (`_mhc_seam_rows_kernel`, rows `seamr_*`, issue 20 / mhc6): numerics against
the float64 reference on the adversarial cases (interpreter: its two-launch phases), 16 distinct tokens
equal to 16 one-token calls, near-degenerate comb logits, the new residual bit-equal to the two-pass
kernels and the x2 addend to the separate add, determinism, a broken output failing the check, the
launch plan (one launch while the grid fits the resident programs), and the sm_89 compile of the
4-token block (0 spills, 2 programs a SM)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE
from conftest import assert_reports as _assert_all
from conftest import fused_seam_inputs as _inputs
from ds4lab.harness.numerics import compare
from ds4lab.harness.specs import mhc as S
from ds4lab.reference import mhc as R
from ds4lab_kernels import mhc as K

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = K.CONFIGS["sm_89"]


@pytest.mark.interp
@pytest.mark.parametrize("label,T,case", [("seamr_d64", 1, "sharp_comb"), ("seamr_d64", 2, "x2_cancel"),
                                          ("seamr_d64", 3, "large_rows"), ("seamr_d64", 16, "x2"),
                                          ("seamr_d32", 4, "zero_rows"), ("seamr_d32", 7, "large_rows"),
                                          ("seamr_d128w8", 1, "x2"), ("seamr_d128w8", 16, "sharp_comb")])
def test_seamr_matches_reference(label, T, case):
    """Every seamr row, 1-16 tokens (T=3 and 9: masked tokens in the last block), vs the fp64 reference;
    D=320 leaves a partial last column block for 64- and 128-column rows."""
    inp, seed = _inputs(T, D=320, case=case)
    _assert_all(S.check_fused(K.mhc_fused_post_pre(**inp, config=TABLE[label]), R.mhc_fused_post_pre(**inp), inp),
                seed)


@pytest.mark.interp
def test_seamr_degenerate_comb_logits():
    """Comb logits spread +-30 (softmax rows one-hot to fp32: Sinkhorn moves only the eps terms) and gate
    logits at +-40 (saturated sigmoids), on large-magnitude rows: still the fp64 reference."""
    inp, seed = _inputs(5, D=192, case="large_rows")
    g = torch.Generator().manual_seed(seed)
    base = inp["hc_base"].cpu().clone()
    base[8:] = 30.0 * torch.randn(16, generator=g)
    base[:8] = torch.tensor([-40.0, 40.0, 0.5, -3.0, 40.0, -40.0, 1.0, 0.0])
    inp["hc_base"] = base.to(DEVICE)
    _assert_all(S.check_fused(K.mhc_fused_post_pre(**inp, config=TABLE["seamr_d64"]), R.mhc_fused_post_pre(**inp),
                              inp), seed)


@pytest.mark.interp
def test_seamr_sixteen_tokens_are_sixteen_calls():
    """16 distinct tokens (4 token blocks, each with its own counter and partial rows) give each token what
    a one-token call gives: the residual bit for bit, gates and layer input within fp32 / one bf16 step."""
    inp, seed = _inputs(16, D=128, case="x2")
    cfg = TABLE["seamr_d64"]
    cur, post, comb, out = K.mhc_fused_post_pre(**inp, config=cfg)
    for t in (0, 5, 11, 15):
        one = {k: (v[t:t + 1] if isinstance(v, torch.Tensor) and k in ("x", "x2", "residual", "post_mix", "comb_mix")
                   else v) for k, v in inp.items()}
        c1, p1, k1, o1 = K.mhc_fused_post_pre(**one, config=cfg)
        assert torch.equal(c1, cur[t:t + 1]), f"seed={seed} token {t}: residual differs"
        _assert_all([compare(p1, post[t:t + 1], S._TOL_FP32, f"post t={t}"),
                     compare(k1, comb[t:t + 1], S._TOL_FP32, f"comb t={t}"),
                     compare(o1, out[t:t + 1], "bfloat16", f"layer_input t={t}")], seed)


@pytest.mark.interp
def test_seamr_equals_two_pass_and_x2_is_the_separate_add():
    """The same residual bits as the two-pass `decode` row; post(x, x2) == post(bf16(x + x2)) bit for bit;
    two runs give the same bits (partial sums over s in a fixed order)."""
    inp, seed = _inputs(6, D=192, case="x2")
    cfg = TABLE["seamr_d32"]
    got, again = K.mhc_fused_post_pre(**inp, config=cfg), K.mhc_fused_post_pre(**inp, config=cfg)
    ref = K.mhc_fused_post_pre(**inp, config=TABLE["decode"])
    summed = dict(inp, x=(inp["x"].float() + inp["x2"].float()).to(torch.bfloat16))
    del summed["x2"]
    want = K.mhc_fused_post_pre(**summed, config=cfg)
    assert torch.equal(got[0], ref[0]), f"seed={seed}: residual differs from decode"
    assert all(torch.equal(a, b) for a, b in zip(got, want)), f"seed={seed}: x2 differs from the separate add"
    assert all(torch.equal(a, b) for a, b in zip(got, again)), f"seed={seed}: not deterministic"


@pytest.mark.interp
def test_seamr_broken_output_fails_the_check():
    """The budgets catch a real error: two tokens' comb swapped, or one token's layer input scaled by 1.05."""
    inp, seed = _inputs(2, D=128, case="random")
    cur, post, comb, out = K.mhc_fused_post_pre(**inp, config=TABLE["seamr_d64"])
    ref = R.mhc_fused_post_pre(**inp)
    assert all(S.check_fused((cur, post, comb, out), ref, inp)), f"seed={seed}"
    bad_out = out.clone()
    bad_out[1] = (bad_out[1].float() * 1.05).to(torch.bfloat16)
    assert not all(S.check_fused((cur, post, comb, bad_out), ref, inp)), f"seed={seed}"
    assert not all(S.check_fused((cur, post, comb.flip(0), out), ref, inp)), f"seed={seed}"


def test_seamr_plan(monkeypatch):
    """Token blocks of min(next_pow2(T), SEAMR_BLOCK_M); one launch while the grid fits 2 programs a SM at
    4 warps (1 at 8), never on the interpreter; 17+ tokens refused (the launcher sends them to `decode`)."""
    dev = torch.device("cpu")
    assert K.seamr_plan(1, 4096, dev, TABLE["seamr_d64"])["launches"] == 2     # the interpreter
    monkeypatch.setattr(K, "_interpreting", lambda: False)                    # 128 SMs on the CPU (RTX 4090)
    p = K.seamr_plan(1, 4096, dev, TABLE["seamr_d64"])
    assert (p["BLOCK_M"], p["BLOCK_D"], p["S"], p["m_tiles"], p["launches"], p["BLOCK_S"]) == (1, 64, 64, 1, 1, 64)
    p = K.seamr_plan(16, 4096, dev, TABLE["seamr_d64"])
    assert (p["BLOCK_M"], p["m_tiles"], p["launches"]) == (4, 4, 1)          # 256 programs, 2 a SM
    p = K.seamr_plan(3, 4096, dev, TABLE["seamr_d32"])
    assert (p["BLOCK_M"], p["S"], p["launches"], p["BLOCK_S"]) == (4, 128, 1, 128)
    assert K.seamr_plan(8, 4096, dev, TABLE["seamr_d32"])["launches"] == 1    # 256 = 2 a SM
    assert K.seamr_plan(16, 4096, dev, {**TABLE["seamr_d32"], "SEAMR_MAX_T": 16})["launches"] == 2  # 512
    with pytest.raises(ValueError, match="num_tokens=9"):
        K.seamr_plan(9, 4096, dev, TABLE["seamr_d32"])                         # the row serves 1..8
    p = K.seamr_plan(16, 4096, dev, TABLE["seamr_d128w8"])
    assert (p["S"], p["m_tiles"], p["launches"]) == (32, 4, 1)                # 128 programs of 8 warps
    assert K.seamr_plan(2, 4096, dev, {**TABLE["seamr_d64"], "SEAMR_LAUNCHES": 2})["launches"] == 2
    assert K.resident_per_sm(4) == 2 and K.resident_per_sm(8) == 1
    with pytest.raises(ValueError, match="num_tokens=17"):
        K.seamr_plan(17, 4096, dev, TABLE["seamr_d64"])


@pytest.mark.interp
def test_seamr_above_sixteen_tokens_is_decode():
    inp, seed = _inputs(17, D=64)
    a = K.mhc_fused_post_pre(**inp, config=TABLE["seamr_d64"])
    b = K.mhc_fused_post_pre(**inp, config=TABLE["decode"])
    assert all(torch.equal(x, y) for x, y in zip(a, b)), f"seed={seed}"


def test_seamr_compiles_for_sm89_at_sixteen_tokens():
    """The 4-token block (the most registers) with the x2 addend builds for sm_89 with no spills at 16
    tokens (seamr_d32, which serves up to 8: at 8), within
    the registers that keep resident_per_sm programs on one SM (the one-launch rule of seamr_plan)."""
    code = ("import json; from ds4lab.harness.aot import compile_spec; from ds4lab.harness.registry import "
            "all_specs; spec = [s for s in all_specs() if s.name == 'mhc_fused_post_pre'][0]; "
            "rows = [r.to_dict() for lb, T in (('seamr_d64', 16), ('seamr_d32', 8), ('seamr_d128w8', 16)) for r in "
            "compile_spec(spec, 'sm_89', lb, {'T': T, 'D': 4096, 'hc': 4, 'N': 24, 'aot': 'seam', 'x2': 1})]; "
            "print(json.dumps(rows))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(rows) == 3 and all(r["triton_fn"] == "_mhc_seam_rows_kernel" for r in rows), rows
    for r in rows:
        assert r["ok"] and r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["local"] == 0, r
        regs = -(-r["registers"] // 8) * 8                      # allocated per thread in units of 8
        assert regs * 32 * r["num_warps"] * K.resident_per_sm(r["num_warps"]) <= 65536, r
