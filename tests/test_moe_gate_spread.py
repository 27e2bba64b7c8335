"""The router gate's token-spread rows path (issue 20 / m16: ``r4w8t2``; a candidate at 3..16
tokens until timed): ``cdiv(T, BLOCK_T)`` token blocks side by side on the grid, each routed by its own last arriver.
ids and weights bit-equal to ``sqrtsoftplus_topk`` on the kernel's own logits at 8..16 tokens (T not a
multiple of the token block, every registry case incl. hash layers and NaN / inf hidden states), logits
within budget of the float64 product and equal to the one-token-block rows path, exact ties, huge logits,
the arrival buffer (one counter per token block, left zeroed), the backend taking the fused launch up to
GATE_FUSED_MAX_T, and the compile at T = 8 / 16 on sm_89, sm_90a and sm_120 without spills."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.specs import moe_gate as SG
from ds4lab.reference import moe as R
from ds4lab_kernels._counters import left_nonzero
from ds4lab_kernels import moe_gate as K
from ds4lab_kernels.moe_routing import sqrtsoftplus_topk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the spread rows with a K loop of 128 (D=320: 3 steps) so the interpreter runs them in seconds
SPREAD = {lb: {**K.CONFIGS["sm_89"][lb], "BLOCK_K": 128} for lb in K.SPREAD_CANDIDATES}


def _inputs(T, E=32, D=320, case="random", seed=0):
    return SG.make_gate_inputs({"T": T, "E": E, "D": D, "topk": 6}, case, seed, DEVICE)


def _counters_zero():
    return left_nonzero("moe_gate") == 0


@pytest.mark.interp
@pytest.mark.parametrize("label,T,case", [("r4w8t2", t, c) for t in (8, 13) for c in SG.GATE_CASES]
                         + [("r4w8t2", 16, "random"), ("r4w8t2", 9, "hash"), ("r4w8", 16, "nonfinite")])
def test_spread_rows_route_exactly_as_the_router_kernel(label, T, case):
    inp = _inputs(T, case=case, seed=T)
    out = K.gate_sqrtsoftplus_topk(**inp, config=SPREAD[label])
    assert all(SG.check_gate(out, R.gate_sqrtsoftplus_topk(**inp), inp))
    w, ids, lg = out
    kw = {k: inp[k] for k in ("input_ids", "tid2eid") if k in inp}
    w2, ids2 = sqrtsoftplus_topk(lg, inp["e_score_correction_bias"], 6, 1.5, **kw)
    assert torch.equal(ids, ids2)
    assert torch.equal(w.nan_to_num(-1.0), w2.nan_to_num(-1.0))
    assert _counters_zero()


@pytest.mark.interp
def test_spread_rows_logits_equal_one_block_rows_and_torch():
    """Spreading tokens over programs changes which program sums a token, not the sum: the same logit bits
    as the 4-token-block rows path (r4w8 at BLOCK_T 4 vs 2, the same EPP and K steps), within the fp32
    budget of F.linear; two calls give the same bits."""
    inp = _inputs(12, seed=4)
    x, W = inp["hidden_states"], inp["gate_weight"]
    mag = x.double().abs() @ W.double().abs().T
    a = K.gate_sqrtsoftplus_topk(**inp, config=SPREAD["r4w8t2"])
    b = K.gate_sqrtsoftplus_topk(**inp, config={**SPREAD["r4w8t2"], "BLOCK_T": 4})
    c = K.gate_sqrtsoftplus_topk(**inp, config=SPREAD["r4w8t2"])
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and all(torch.equal(p, q) for p, q in zip(a, c))
    old = torch.nn.functional.linear(x.float(), W.float())
    assert ((a[2].double() - old.double()).abs() <= SG.LOGIT_RTOL * mag).all()


@pytest.mark.interp
def test_spread_rows_ties_and_huge_logits():
    """Every logit 0 (all scores tied): ids 0..5 and weights 1/6 * 1.5 in every token block; identity gate
    rows with +-3e38 logits: the router kernel's picks on the same logits."""
    inp = _inputs(10, D=64)
    inp["gate_weight"] = torch.zeros_like(inp["gate_weight"])
    inp["e_score_correction_bias"] = torch.zeros(32, device=DEVICE)
    w, ids, _ = K.gate_sqrtsoftplus_topk(**inp, config=SPREAD["r4w8t2"])
    assert ids.cpu().tolist() == [list(range(6))] * 10
    assert torch.allclose(w.cpu(), torch.full((10, 6), 0.25))
    E = 64
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-2, 3, (9, E), generator=g).float()
    x[1] = -3.0e38
    x[2, ::3] = 3.0e38
    x[3] = 0.0
    x[8, 10:] = -3.0e38
    W = torch.eye(E, dtype=torch.bfloat16, device=DEVICE)
    w, ids, lg = K.gate_sqrtsoftplus_topk(x.bfloat16().to(DEVICE), W, None, 6, 1.5, config=SPREAD["r4w8t2"])
    assert torch.equal(lg.cpu(), x.bfloat16().float())
    w2, ids2 = sqrtsoftplus_topk(lg, None, 6, 1.5)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)


@pytest.mark.interp
def test_spread_rows_arrivals_buffer():
    inp = _inputs(9, D=128)       # 5 token blocks of 2
    with pytest.raises(ValueError, match="arrivals: needs >= 5"):
        K.gate_sqrtsoftplus_topk(**inp, arrivals=torch.zeros(4, dtype=torch.int32, device=DEVICE),
                                 config=SPREAD["r4w8t2"])
    cnt = torch.zeros(5, dtype=torch.int32, device=DEVICE)
    a = K.gate_sqrtsoftplus_topk(**inp, config=SPREAD["r4w8t2"])
    for _ in range(2):
        b = K.gate_sqrtsoftplus_topk(**inp, arrivals=cnt, config=SPREAD["r4w8t2"])
        assert int(cnt.abs().sum()) == 0 and torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


def test_spread_defaults_and_candidates():
    """The spread candidates are rows candidates present in both tables and swept at 8 / 16 tokens; timed on
    the H200 in session 7, r4w8t2 is the sm_89 decode row at 3..16 tokens (sm_120-clean) and the backend
    fuses the gate up to the last decode row's 16 tokens (NOTES.md "m16")."""
    from ds4lab.model import backend_kernel as BK
    assert BK.GATE_FUSED_MAX_T == K.DECODE_DEFAULTS["sm_89"][-1][0] == 16
    assert K.DECODE_DEFAULTS["sm_89"][-1][1] == "r4w8t2"
    for arch in ("sm_89", "sm_90"):
        assert K.DECODE_DEFAULTS[arch][-1][0] == 16
        assert set(K.SPREAD_CANDIDATES) <= set(K.ROWS_CANDIDATES) and "r4w8t2" in K.CONFIGS[arch]
    assert not {"r4w4t2", "r2w4t2"} & (set(K.CONFIGS["sm_89"]) | set(K.CONFIGS["sm_90"]))   # they spill (NOTES.md m16)
    assert [SG._config_for("sm_89", {"T": t, "E": 256, "D": 4096, "topk": 6})[:len(K.SPREAD_CANDIDATES)] for t in (8, 16)] == \
        [list(K.SPREAD_CANDIDATES)] * 2


@pytest.mark.aot
def test_spread_rows_compile_without_spills_on_every_arch():
    code = r'''
import json, torch
from ds4lab.harness import aot
from ds4lab_kernels import moe_gate as K
from ds4lab_kernels._arch import SMEM_LIMIT
rows = []
for arch in ("sm_89", "sm_90", "sm_120"):
    table = K.CONFIGS[aot.table_of(arch)]
    for lb in [lb for lb in K.SPREAD_CANDIDATES if lb in table]:
        for T in (8, 16):
            for hashed in (False, True):
                x = torch.zeros(T, 4096, dtype=torch.bfloat16); W = torch.zeros(256, 4096, dtype=torch.bfloat16)
                kw = dict(input_ids=torch.zeros(T, dtype=torch.int64), tid2eid=torch.zeros(64, 6, dtype=torch.int32)) if hashed else {}
                with aot.capture_compiles(arch) as cap:
                    K.gate_sqrtsoftplus_topk(x, W, None if hashed else torch.zeros(256), 6, 1.5, config=table[lb], **kw)
                for f, c in cap:
                    rows.append({"arch": arch, "label": lb, "T": T, "hash": hashed, "limit": SMEM_LIMIT[arch], **aot._inspect(c, arch)})
print(json.dumps(rows))
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    n = sum(lb in K.CONFIGS[t] for t in ("sm_89", "sm_90", "sm_89") for lb in K.SPREAD_CANDIDATES)
    assert len(rows) == 4 * n, len(rows)
    defaults = {lb for _, lb in K.DECODE_DEFAULTS["sm_89"]}
    for r in rows:
        if r["arch"] == "sm_120" and r["label"] not in defaults:
            continue   # sm_120 reads the sm_89 table; only its defaults must build clean there (r4w8 spills 4 B)
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["local"] == 0, r
        assert r["shared"] <= r["limit"], r
    print([(r["arch"], r["label"], r["T"], r["hash"], r["registers"], r["shared"], r["spill_stores"]) for r in rows])
