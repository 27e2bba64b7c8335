"""Fused router gate (``moe_gate.gate_sqrtsoftplus_topk``) beyond the registry sweep: logits against the
torch path it replaces, exact ties, NaN / inf hidden states, hash layers, the arrival counter
(reset by the kernel, split-K and single-program paths agree), near-ties judged on the kernel's own
logits, the check failing on planted errors, bad inputs; and the backend's gate_route."""
import pytest
import torch

from conftest import DEVICE, op_kinds
from ds4lab.harness.specs import moe_gate as SG
from ds4lab.reference import moe as R
from ds4lab_kernels import _counters
from ds4lab_kernels._counters import left_nonzero
from ds4lab_kernels import moe_gate as K
from ds4lab_kernels.moe_routing import sqrtsoftplus_topk

pytestmark = pytest.mark.interp
SPLIT = {"BLOCK_T": 16, "BLOCK_E": 16, "BLOCK_K": 64, "SPLIT_K": 3, "TAIL_T": 4, "num_warps": 4, "num_stages": 1}
ONE = K.CONFIGS["sm_89"]["interp"]


def _inputs(T=5, E=64, D=320, case="random", seed=0):
    return SG.make_gate_inputs({"T": T, "E": E, "D": D, "topk": 6}, case, seed, DEVICE)


@pytest.mark.parametrize("cfg", [ONE, SPLIT], ids=["one_program", "split_k3"])
def test_logits_match_torch_path_and_route_as_old_glue(cfg):
    inp = _inputs(T=18)   # two token blocks of 16
    x, W = inp["hidden_states"], inp["gate_weight"]
    w, ids, lg = K.gate_sqrtsoftplus_topk(**inp, config=cfg)
    old = torch.nn.functional.linear(x.float(), W.float())
    mag = x.double().abs() @ W.double().abs().T
    assert ((lg.double() - old.double()).abs() <= SG.LOGIT_RTOL * mag).all()
    # routing is exactly the router kernel's on the fused kernel's logits
    w2, ids2 = sqrtsoftplus_topk(lg, inp["e_score_correction_bias"], 6, 1.5)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)
    assert left_nonzero("moe_gate") == 0


def test_split_and_single_program_agree_and_counter_resets():
    inp = _inputs(T=3, E=64, D=256)
    a = K.gate_sqrtsoftplus_topk(**inp, config=ONE)
    # one counter per (token block, expert block) + one per token block: 1 x (64 / 16 + 1)
    with pytest.raises(ValueError, match="arrivals: needs >= 5"):
        K.gate_sqrtsoftplus_topk(**inp, arrivals=torch.zeros(4, dtype=torch.int32, device=DEVICE), config=SPLIT)
    cnt = torch.zeros(5, dtype=torch.int32, device=DEVICE)
    for _ in range(2):   # a second call finds the counters zeroed by the first
        b = K.gate_sqrtsoftplus_topk(**inp, arrivals=cnt, config=SPLIT)
        assert int(cnt.abs().sum()) == 0
        assert torch.equal(a[1], b[1])
        assert torch.allclose(a[2], b[2], rtol=0, atol=1e-5)


def test_exact_ties_pick_lowest_ids():
    inp = _inputs(T=4, E=32, D=128)
    inp["gate_weight"] = torch.zeros_like(inp["gate_weight"])    # every logit 0: all scores equal
    inp["e_score_correction_bias"] = torch.zeros(32, device=DEVICE)
    w, ids, _ = K.gate_sqrtsoftplus_topk(**inp, config=SPLIT)
    assert ids.cpu().tolist() == [list(range(6))] * 4
    assert torch.allclose(w.cpu(), torch.full((4, 6), 0.25))


def test_nonfinite_hidden_states():
    inp = _inputs(T=8, E=64, D=256, case="nonfinite")
    w, ids, lg = K.gate_sqrtsoftplus_topk(**inp, config=SPLIT)
    lg, ids, w = lg.cpu(), ids.cpu(), w.cpu()
    assert lg[1].isnan().all() and ids[1].tolist() == list(range(6)) and w[1].isnan().all()
    assert lg[2].isinf().any()                                 # one inf element: +-inf logits
    for row in ids.tolist():
        assert len(set(row)) == 6 and all(0 <= i < 64 for i in row)
    assert not w[3].isnan().any()                              # zeros: equal scores, bias decides


def test_hash_layer_ids_and_weights():
    inp = _inputs(T=6, E=64, D=256, case="hash")
    w, ids, lg = K.gate_sqrtsoftplus_topk(**inp, config=SPLIT)
    rw, rids = R.sqrtsoftplus_topk(lg.cpu(), None, 6, 1.5, inp["input_ids"].cpu(), inp["tid2eid"].cpu())
    assert torch.equal(ids.cpu(), rids)
    assert ids[0, 0] == -1 and w[0, 0] == 0 and (ids[1] == -1).all() and (w[1] == 0).all()
    assert torch.allclose(w.cpu(), rw, rtol=1e-6, atol=0)


def test_check_fails_on_planted_errors():
    inp = _inputs(T=4, E=64, D=256)
    out = K.gate_sqrtsoftplus_topk(**inp, config=SPLIT)
    ref = R.gate_sqrtsoftplus_topk(**inp)
    assert all(SG.check_gate(out, ref, inp))
    w, ids, lg = (t.clone() for t in out)
    lg[1, 3] += 1e-3 * lg[1].abs().max()                      # one wrong logit
    assert not all(SG.check_gate((w, ids, lg), ref, inp))
    w, ids, lg = (t.clone() for t in out)
    ids[0, [0, 1]] = ids[0, [1, 0]]                          # selection order broken: weights mismatch
    ids[2, 5] = ids[2, 0]                                     # a duplicate
    assert not all(SG.check_gate((w, ids, lg), ref, inp))


def test_near_ties_are_judged_on_the_kernels_logits():
    # two experts whose logits differ by ~1 fp32 ulp: either may win, the check must accept the
    # kernel's choice when it follows from its own logits
    inp = _inputs(T=2, E=64, D=256)
    W = inp["gate_weight"].clone()
    W[9] = W[4]
    W[9, 0] = torch.nextafter(W[4, 0].float(), torch.tensor(float("inf"))).bfloat16()
    inp["gate_weight"] = W
    inp["e_score_correction_bias"] = torch.zeros(64, device=DEVICE)
    out = K.gate_sqrtsoftplus_topk(**inp, config=SPLIT)
    assert all(SG.check_gate(out, R.gate_sqrtsoftplus_topk(**inp), inp))


def test_bad_inputs():
    inp = _inputs(T=2, E=16, D=64)
    x, W = inp["hidden_states"], inp["gate_weight"]
    with pytest.raises(TypeError, match="hidden_states"):
        K.gate_sqrtsoftplus_topk(x.float(), W)
    with pytest.raises(TypeError, match="gate_weight"):
        K.gate_sqrtsoftplus_topk(x, W.float())
    with pytest.raises(ValueError, match="gate_weight"):
        K.gate_sqrtsoftplus_topk(x, W[:, :32])
    with pytest.raises(ValueError, match="hidden_states"):
        K.gate_sqrtsoftplus_topk(x.t(), W[:, :2].contiguous())
    with pytest.raises(ValueError, match="topk"):
        K.gate_sqrtsoftplus_topk(x, W, topk=17)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        K.gate_sqrtsoftplus_topk(x, W, torch.zeros(15, device=DEVICE))
    with pytest.raises(ValueError, match="tid2eid"):
        K.gate_sqrtsoftplus_topk(x, W, input_ids=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        K.gate_sqrtsoftplus_topk(x, W, routed_scaling_factor=float("nan"))
    with pytest.raises(ValueError, match="arrivals"):
        K.gate_sqrtsoftplus_topk(x, W, arrivals=torch.zeros(0, dtype=torch.int32, device=DEVICE), config=SPLIT)


def test_backend_gate_route_matches_the_unfused_pair():
    """KernelBackend.gate_route (one launch) == the Backend default (linear fp32 + route) on ids,
    and its op group names the fused kernel."""
    from ds4lab.model.backend_kernel import KernelBackend
    from ds4lab.model.ops import Backend, Linear
    kb = KernelBackend()
    inp = _inputs(T=3, E=64, D=256)
    lin = Linear(inp["gate_weight"])
    (w, e), seen = op_kinds(kb.gate_route, inp["hidden_states"], lin, inp["e_score_correction_bias"], 6, 1.5, None, None)
    assert seen == [("moe.gate_route", "kernel:moe_gate.gate_sqrtsoftplus_topk")]
    w2, e2 = Backend.gate_route(kb, inp["hidden_states"], lin, inp["e_score_correction_bias"], 6, 1.5, None, None)
    assert torch.equal(e, e2) and torch.allclose(w, w2, rtol=1e-5, atol=0)


SPLIT1 = {**SPLIT, "SPLIT_K": 1}   # no split, 4 expert blocks: the level-2 counter only


@pytest.mark.parametrize("cfg", [ONE, SPLIT, SPLIT1], ids=["one_program", "split_k3", "split_k1"])
def test_packed_key_selection_equals_route_tile_on_adversarial_logits(cfg):
    """The fused tail's one-reduction-per-pick selection (int64 score|id keys) against the router
    kernel's four-reduction one (``route_tile``) on planted logits: exact ties among many values,
    scores of exactly 0 (logit -3e38: every expert ties), huge logits, ties broken by a bias that
    itself ties. The identity gate weight makes the logits the hidden state's bf16 values."""
    E = 64
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-2, 3, (7, E), generator=g).float()        # 5 values over 64 experts: ties
    x[1] = -3.0e38                                             # every score 0: ids 0..5
    x[2, ::3] = 3.0e38                                          # finite huge scores, tied
    x[3] = 0.0
    x[4, 10:] = -3.0e38
    W = torch.eye(E, dtype=torch.bfloat16, device=DEVICE)
    bias = (torch.arange(E) % 3 * 0.25 - 0.25).to(DEVICE)        # ties in the bias too
    for b in (None, bias):
        w, ids, lg = K.gate_sqrtsoftplus_topk(x.to(torch.bfloat16).to(DEVICE), W, b, 6, 1.5, config=cfg)
        assert torch.equal(lg.cpu(), x.bfloat16().float())
        w2, ids2 = sqrtsoftplus_topk(lg, b, 6, 1.5)
        assert torch.equal(ids, ids2), (ids.cpu(), ids2.cpu())
        assert torch.equal(w, w2)
        if b is None:
            assert ids.cpu()[1].tolist() == list(range(6))


# ---- the rows path (gate5): full gate rows per program, one arrival level -------------------------
ROWS = {**K.CONFIGS["sm_89"]["r2w4"], "BLOCK_K": 128}   # 2 experts per program, a K loop of 128 (D=320: 3 steps)
ROWS1 = {**K.CONFIGS["sm_89"]["r1w1"], "BLOCK_K": 512}  # 1 expert per program, one K step


@pytest.mark.parametrize("T,case", [(t, c) for t in (1, 2) for c in SG.GATE_CASES] + [(5, "random"), (5, "hash")])
def test_rows_path_routes_exactly_as_the_router_kernel(T, case):
    """ids and weights bit-equal (NaN where NaN) to ``sqrtsoftplus_topk`` on the kernel's own logits,
    logits within the budget of the float64 product, the registry check passing, counters zeroed."""
    inp = _inputs(T=T, E=32, D=320, case=case, seed=T)   # T=5: two token blocks of 4
    out = K.gate_sqrtsoftplus_topk(**inp, config=ROWS)
    assert all(SG.check_gate(out, R.gate_sqrtsoftplus_topk(**inp), inp))
    w, ids, lg = out
    kw = {k: inp[k] for k in ("input_ids", "tid2eid") if k in inp}
    w2, ids2 = sqrtsoftplus_topk(lg, inp["e_score_correction_bias"], 6, 1.5, **kw)
    assert torch.equal(ids, ids2)
    assert torch.equal(w.nan_to_num(-1.0), w2.nan_to_num(-1.0))
    assert any(k[0] == "moe_gate" for k in _counters._BUFFERS) and left_nonzero("moe_gate") == 0


def test_rows_path_logits_match_split_path_and_torch():
    inp = _inputs(T=2, E=32, D=320)
    x, W = inp["hidden_states"], inp["gate_weight"]
    mag = x.double().abs() @ W.double().abs().T
    old = torch.nn.functional.linear(x.float(), W.float())
    for cfg in (ROWS, ROWS1):
        w, ids, lg = K.gate_sqrtsoftplus_topk(**inp, config=cfg)
        assert ((lg.double() - old.double()).abs() <= SG.LOGIT_RTOL * mag).all()
        a = K.gate_sqrtsoftplus_topk(**inp, config=cfg)
        assert all(torch.equal(p, q) for p, q in zip((w, ids, lg), a))   # deterministic bits
    b = K.gate_sqrtsoftplus_topk(**inp, config=SPLIT)
    assert torch.equal(b[1], ids)


def test_rows_path_arrivals_buffer():
    inp = _inputs(T=5, E=32, D=128)
    # one counter per token block of 4: 2
    with pytest.raises(ValueError, match="arrivals: needs >= 2"):
        K.gate_sqrtsoftplus_topk(**inp, arrivals=torch.zeros(1, dtype=torch.int32, device=DEVICE), config=ROWS)
    cnt = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    a = K.gate_sqrtsoftplus_topk(**inp, config=ROWS)
    for _ in range(2):
        b = K.gate_sqrtsoftplus_topk(**inp, arrivals=cnt, config=ROWS)
        assert int(cnt.abs().sum()) == 0 and torch.equal(a[1], b[1])


def test_rows_payload_selection_equals_route_tile_on_adversarial_logits():
    """The rows path's pick (int64 key + the score as payload) on the planted logits of
    test_packed_key_selection_equals_route_tile_on_adversarial_logits (ties, all-zero scores, huge
    logits, tied bias), T=2 per launch (the decode tile)."""
    E = 64
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-2, 3, (6, E), generator=g).float()
    x[1] = -3.0e38
    x[2, ::3] = 3.0e38
    x[3] = 0.0
    x[4, 10:] = -3.0e38
    W = torch.eye(E, dtype=torch.bfloat16, device=DEVICE)
    bias = (torch.arange(E) % 3 * 0.25 - 0.25).to(DEVICE)
    for b in (None, bias):
        for r0 in range(0, 6, 2):
            xs = x[r0:r0 + 2].to(torch.bfloat16).to(DEVICE)
            w, ids, lg = K.gate_sqrtsoftplus_topk(xs, W, b, 6, 1.5, config=ROWS)
            assert torch.equal(lg.cpu(), x[r0:r0 + 2].bfloat16().float())
            w2, ids2 = sqrtsoftplus_topk(lg, b, 6, 1.5)
            assert torch.equal(ids, ids2), (r0, ids.cpu(), ids2.cpu())
            assert torch.equal(w, w2)
            if b is None and r0 == 0:
                assert ids.cpu()[1].tolist() == list(range(6))


def test_rows_exact_ties_pick_lowest_ids():
    inp = _inputs(T=2, E=32, D=64)
    inp["gate_weight"] = torch.zeros_like(inp["gate_weight"])    # every logit 0: all scores equal
    inp["e_score_correction_bias"] = torch.zeros(32, device=DEVICE)
    w, ids, _ = K.gate_sqrtsoftplus_topk(**inp, config=ROWS)
    assert ids.cpu().tolist() == [list(range(6))] * 2
    assert torch.allclose(w.cpu(), torch.full((2, 6), 0.25))


def test_pick_config_decode_rows(monkeypatch):
    from ds4lab_kernels import _arch
    monkeypatch.setattr(_arch, "target", lambda device: None if device.type != "cuda" else (89, _arch.SMEM_LIMIT["sm_89"]))
    dev = torch.device("cuda", 0)
    table = K.CONFIGS["sm_89"]
    assert [next(lb for lb, c in table.items() if c is K.pick_config(t, dev)) for t in (1, 2, 4, 5, 16, 17)] == \
        ["r2w4"] * 2 + ["r4w8t2"] * 3 + ["t32e32k8"]   # session 7's H200 rows (DECODE_DEFAULTS)
    assert set(K.ROWS_CANDIDATES) <= set(K.DECODE_CANDIDATES)
    assert not {"e64k32", "e16k16"} & set(table)   # measured losing (NOTES.md gate4b/gate5)


AOT_PROBE = r"""
import json
from ds4lab.harness import aot
from ds4lab.harness.registry import get
from ds4lab_kernels.moe_gate import ROWS_CANDIDATES
spec = get("gate_sqrtsoftplus_topk")
print(json.dumps({lb: [r.to_dict() for r in aot.compile_spec(spec, "sm_89", lb, {"T": 1, "E": 256, "D": 4096, "topk": 6})]
                  for lb in ROWS_CANDIDATES}))
"""


def test_rows_candidates_compile_for_sm89_at_one_token():
    """The rows path at BLOCK_T=1 (the compile report builds BLOCK_T=4, its T=4 AOT shape): every
    candidate assembles for sm_89 (ptxas, no interpreter) with 0 spills within 101,376 B."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", AOT_PROBE], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(out) == set(K.ROWS_CANDIDATES)
    for lb, rows in out.items():
        assert rows and all(r["ok"] for r in rows), (lb, [r["why"] for r in rows])
        assert all(r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["shared"] <= 101_376 for r in rows), (lb, rows)
