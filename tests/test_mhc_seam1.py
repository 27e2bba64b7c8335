"""The one-level mHC decode seam (`_mhc_seam1_kernel`, rows `seam1_*`, issue 20): numerics against the
float64 reference on the adversarial cases of the seam tests (interpreter: its two-launch phases),
bit-equality of the new residual with the two-pass kernels and of the x2 addend with the separate add,
determinism, the launch plan and the fallback above 4 tokens, the reset-free counter sync (the real
jit helper, across the int32 wrap), and the sm_89 compile of the 4-token block (0 spills)."""
import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from conftest import assert_reports as _assert_all
from conftest import fused_seam_inputs as _inputs
from ds4lab.harness.numerics import compare
from ds4lab.harness.specs import mhc as S
from ds4lab.reference import mhc as R
from ds4lab_kernels import mhc as K

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEAM1 = list(K.SEAM1_ROWS)


@pytest.mark.interp
@pytest.mark.parametrize("label,T,case", [("seam1_d64", 1, "sharp_comb"), ("seam1_d64", 2, "x2_cancel"),
                                          ("seam1_d64", 3, "large_rows"), ("seam1_d64", 4, "zero_rows"),
                                          ("seam1_d32", 1, "x2"), ("seam1_d32", 4, "sharp_comb"),
                                          ("seam1x2_d64", 2, "random")])
def test_seam1_matches_reference(label, T, case):
    """Every seam1 row, 1-4 token blocks (T=3: a masked token), vs the fp64 reference; D=320 leaves a
    partial last column block for 64-column rows."""
    inp, seed = _inputs(T, D=320, case=case)
    _assert_all(S.check_fused(K.mhc_fused_post_pre(**inp, config=K.CONFIGS["sm_89"][label]),
                              R.mhc_fused_post_pre(**inp), inp), seed)


@pytest.mark.interp
def test_seam1_equals_the_other_kernels():
    """Same residual bits as the two-pass `decode` row and the `seam_d64` kernel; gates within fp32 noise,
    the layer input within one bf16 step of `decode` and bit-equal in its norm's formula to `seam_d64`
    up to the mixes' summation order."""
    inp, seed = _inputs(3, D=384, case="x2")
    cur, post, comb, out = K.mhc_fused_post_pre(**inp, config=K.CONFIGS["sm_89"]["decode"])
    s1 = K.mhc_fused_post_pre(**inp, config=K.CONFIGS["sm_89"]["seam1_d64"])
    s0 = K.mhc_fused_post_pre(**inp, config=K.CONFIGS["sm_89"]["seam_d64"])
    assert torch.equal(s1[0], cur) and torch.equal(s1[0], s0[0]), f"seed={seed}: new residual differs"
    _assert_all([compare(s1[1], post, S._TOL_FP32, "post"), compare(s1[2], comb, S._TOL_FP32, "comb"),
                 compare(s1[3], out, "bfloat16", "layer_input vs decode"),
                 compare(s1[3], s0[3], "bfloat16", "layer_input vs seam_d64")], seed)


@pytest.mark.interp
def test_seam1_x2_is_the_separate_add_and_deterministic():
    """post(x, x2) == post(bf16(x.float() + x2.float())) bit for bit; two runs give the same bits."""
    inp, seed = _inputs(2, D=128, case="x2")
    summed = dict(inp, x=(inp["x"].float() + inp["x2"].float()).to(torch.bfloat16))
    del summed["x2"]
    cfg = K.CONFIGS["sm_89"]["seam1_d32"]
    got, again, want = (K.mhc_fused_post_pre(**inp, config=cfg), K.mhc_fused_post_pre(**inp, config=cfg),
                        K.mhc_fused_post_pre(**summed, config=cfg))
    assert all(torch.equal(a, b) for a, b in zip(got, want)), f"seed={seed}"
    assert all(torch.equal(a, b) for a, b in zip(got, again)), f"seed={seed}"


@pytest.mark.interp
def test_seam1_above_four_tokens_is_decode():
    """A seam1 row at 5 tokens runs the two-pass `decode` kernels: the same bits."""
    inp, seed = _inputs(5, D=128)
    a = K.mhc_fused_post_pre(**inp, config=K.CONFIGS["sm_89"]["seam1_d64"])
    b = K.mhc_fused_post_pre(**inp, config=K.CONFIGS["sm_89"]["decode"])
    assert all(torch.equal(x, y) for x, y in zip(a, b)), f"seed={seed}"


def test_seam1_plan(monkeypatch):
    """One launch where every column program is resident (grid <= SMs), never on the interpreter; token
    blocks 1/2/4; 5+ tokens refused (the launcher sends them to `decode`)."""
    cfg, dev = K.CONFIGS["sm_89"]["seam1_d64"], torch.device("cpu")
    assert K.seam1_plan(1, 4096, dev, cfg)["launches"] == 2          # the interpreter runs programs in turn
    monkeypatch.setattr(K, "_interpreting", lambda: False)
    p = K.seam1_plan(1, 4096, dev, cfg)                              # 128 SMs on the CPU (an RTX 4090)
    assert (p["BLOCK_M"], p["BLOCK_D"], p["S"], p["launches"], p["BLOCK_S"]) == (1, 64, 64, 1, 64)
    p = K.seam1_plan(3, 4096, dev, K.CONFIGS["sm_89"]["seam1_d32"])
    assert (p["BLOCK_M"], p["S"], p["launches"], p["BLOCK_S"]) == (4, 128, 1, 16)  # 128 programs on 128 SMs
    assert p["BLOCK_S"] * p["BLOCK_M"] * 16 <= cfg["SEAM1_PART_ELEMS"]
    assert K.seam1_plan(1, 8192, dev, K.CONFIGS["sm_89"]["seam1_d32"])["launches"] == 2   # 256 > 128 SMs
    assert K.seam1_plan(2, 4096, dev, K.CONFIGS["sm_89"]["seam1x2_d64"])["launches"] == 2
    with pytest.raises(ValueError, match="num_tokens=5"):
        K.seam1_plan(5, 4096, dev, cfg)


@triton.jit
def _sync_probe(cnt_ptr, out_ptr, pid_s, n_programs, STEP: tl.constexpr):
    tl.store(out_ptr, K._count_sync(cnt_ptr, pid_s, n_programs, STEP).to(tl.int32))


@pytest.mark.interp
@pytest.mark.parametrize("start", [0, 2**31 - 1024, -1024])
def test_count_sync_last_arriver_and_wrap(start):
    """The real `_count_sync`: a launch moves the counter by exactly STEP (so no reset is needed), the
    program whose add completes the multiple of STEP is the last (returns at once, never spins), also
    across the int32 wrap. The interpreter runs one program at a time, so each probe is the last arriver
    of a launch whose other programs already added their share."""
    step, n = K.SEAM1_STEP, 64
    cnt = torch.tensor([start], dtype=torch.int32, device=DEVICE)
    out = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    # program 0 last: programs 1..63 added 1 each
    cnt += n - 1
    _sync_probe[(1,)](cnt, out, 0, n, STEP=step)
    assert out.item() == 1 and cnt.item() == torch.tensor([start + step], dtype=torch.int64).to(torch.int32).item()
    # next launch, program 5 last: program 0 added step - 63, the other 62 added 1
    before = cnt.clone()
    cnt += step - (n - 1) + (n - 2)
    _sync_probe[(1,)](cnt, out, 5, n, STEP=step)
    assert out.item() == 1 and (cnt.long() - before.long()).item() % 2**32 == step
    # a single-program launch: its own add is the whole step
    _sync_probe[(1,)](cnt, out, 0, 1, STEP=step)
    assert out.item() == 1 and (cnt.long() - before.long()).item() % 2**32 == 2 * step


def test_seam1_compiles_for_sm89_at_four_tokens():
    """The 4-token block (the most registers: 168 at 64 columns) with the x2 addend builds for sm_89 with
    no spills and within Ada's shared memory, one-launch rows and both kernels of the two-launch row (the
    compile report builds the 1-token block)."""
    code = ("import json, sys; from ds4lab.harness.aot import compile_spec; from ds4lab.harness.registry import "
            "all_specs; spec = [s for s in all_specs() if s.name == 'mhc_fused_post_pre'][0]; "
            "rows = [r.to_dict() for lb in ('seam1_d64', 'seam1_d32', 'seam1x2_d64') for r in compile_spec(spec, 'sm_89', lb, "
            "{'T': 4, 'D': 4096, 'hc': 4, 'N': 24, 'aot': 'seam', 'x2': 1})]; print(json.dumps(rows))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(rows) == 4 and all(r["triton_fn"] == "_mhc_seam1_kernel" for r in rows), rows
    for r in rows:
        assert r["ok"] and r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["local"] == 0, r
        assert r["shared"] <= 101_376, r
