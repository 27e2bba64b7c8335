"""A C4A layer's two q preparations in one launch (``norm_rope.q_norm_rope_indexer_q``, issue 20 "qidx")
beyond the registry sweep: bit for bit the two launches it replaces (``rmsnorm_rope`` of the attention q
heads, ``indexer_q_rope_quant`` of the indexer q) on the model's layout (q and iq column slices of the fused
``wq_b`` GEMM output, the head weights a column slice of ``x_proj``'s) at T = 1, 2, 5, positions 0 and the
table's last, every config row, adversarial rows (each job's NaN / inf rules), out-of-table positions, bad
inputs named; the kernel backend's switch (``FUSE_Q_INDEXER_Q``): one launch, the same bits; the tiny model's
decode logits with the switch on equal the switch off bit for bit."""
import re

import pytest
import torch

from conftest import DEVICE, op_kinds
from ds4lab.harness.numerics import compare_exact
from ds4lab.harness.specs import q_indexer as SQI
from ds4lab_kernels import norm_rope as NR
from ds4lab_kernels.norm_rope import q_norm_rope_indexer_q

pytestmark = pytest.mark.interp
MAX_POS = 4096
SHAPE = {"H": 4, "D": 512, "IH": 8, "ID": 128, "max_pos": MAX_POS}


def _inputs(T, case="random", seed=0, positions=None):
    inp = SQI.make_qi_inputs({"T": T, **SHAPE}, case, seed, DEVICE)
    if positions is not None:
        inp["positions"] = torch.tensor(positions, dtype=torch.int32, device=DEVICE)
    return inp


def _same(a, b):
    assert len(a) == len(b) == 3
    bad = [r.summary() for r in (compare_exact(a[0], b[0], "q_normed"), compare_exact(a[1], b[1], "q_fp8"),
                                 compare_exact(a[2], b[2], "w")) if not r]
    assert not bad, bad
    assert a[0].is_contiguous() and a[1].is_contiguous() and a[2].is_contiguous()


@pytest.mark.parametrize("T, positions", [(1, [0]), (1, [MAX_POS - 1]), (2, [0, MAX_POS - 1]),
                                          (5, [MAX_POS - 1, 0, 1, 2047, 77])])
def test_bit_identical_to_the_two_launches(T, positions):
    inp = _inputs(T, "random", T, positions)
    if T > 1:                               # column slices, as the model's (T=1: any token stride is legal)
        assert inp["q"].stride(0) > inp["q"].shape[1] * inp["q"].shape[2]
        assert inp["iq"].stride(0) > inp["iq"].shape[1] * inp["iq"].shape[2] and not inp["weights"].is_contiguous()
    out = q_norm_rope_indexer_q(**inp)
    _same(out, SQI.two_launches(**inp))
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()


@pytest.mark.parametrize("label", list(NR.CONFIGS["q_norm_rope_indexer_q"]["sm_89"]) + ["interp"])
def test_every_config_row(label):
    """Rows per program of either job do not change a bit (T=5: 20 q rows, 40 indexer rows, ragged tails)."""
    cfg = NR.pick_config("q_norm_rope_indexer_q", 0, torch.device("cpu")) if label == "interp" else \
        NR.CONFIGS["q_norm_rope_indexer_q"]["sm_89"][label]
    inp = _inputs(5, "random", 11, [3, 0, MAX_POS - 1, 5, 900])
    _same(q_norm_rope_indexer_q(**inp, config=cfg), SQI.two_launches(**inp))


@pytest.mark.parametrize("case", ["zeros", "huge", "nonfinite", "pos_edges"])
def test_adversarial_rows_follow_each_jobs_rules(case):
    inp = _inputs(3, case, 5)
    out = q_norm_rope_indexer_q(**inp)
    _same(out, SQI.two_launches(**inp))
    if case == "nonfinite":
        # q: a NaN row stays NaN, an inf element makes its row's rstd 0 (inf * 0 = NaN there, 0 elsewhere);
        # indexer: NaN / inf elements and a NaN head weight give NaN / inf weights for those heads only
        assert out[0].cpu()[0, 0].isnan().all() and not out[0].cpu()[0, 1:].isnan().any()
        assert out[0].cpu()[-1, -1, 3].isnan() and (out[0].cpu()[-1, -1, :3] == 0).all()
        w = out[2].cpu()
        assert w[0, 1].isnan() and w[0, 3].isnan() and w[-1, 2].isinf()
        assert torch.isfinite(w).sum() == w.numel() - 3


def test_out_of_table_position_nan_for_that_token_only():
    inp = _inputs(3, "random", 6, [5, MAX_POS, 7])
    out = q_norm_rope_indexer_q(**inp)
    _same(out, SQI.two_launches(**inp))
    q, w = out[0].cpu(), out[2].cpu()
    assert q[1, :, -64:].isnan().all() and not q[1, :, :-64].isnan().any() and not q[[0, 2]].isnan().any()
    assert w[1].isnan().all() and not w[[0, 2]].isnan().any()


def test_fp32_weights_and_contiguous_inputs():
    inp = _inputs(2, "random", 8)
    inp = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    inp["weights"] = inp["weights"].float()
    _same(q_norm_rope_indexer_q(**inp), SQI.two_launches(**inp))


def test_bad_inputs_are_named():
    inp = _inputs(2, "random", 9)
    q, iq, p, cs, w = (inp[k] for k in ("q", "iq", "positions", "cos_sin", "weights"))

    def call(**kw):
        return q_norm_rope_indexer_q(**{**inp, **kw})
    bad = [
        (dict(q=q.float()), TypeError, "q"),
        (dict(q=q.reshape(2, -1)), ValueError, "q"),
        (dict(q=q.transpose(1, 2)), ValueError, "q: rows must be contiguous"),
        (dict(iq=iq.float()), TypeError, "iq"),
        (dict(iq=iq[:1]), ValueError, "iq: 1 tokens"),
        (dict(iq=iq[..., :96]), ValueError, "iq: head_dim=96"),
        (dict(iq=iq.transpose(1, 2)), ValueError, "iq"),
        (dict(positions=p[:1]), ValueError, "positions"),
        (dict(positions=p.float()), TypeError, "positions"),
        (dict(cos_sin=cs.double()), TypeError, "cos_sin"),
        (dict(cos_sin=cs[:, :48].contiguous()), ValueError, "cos_sin"),
        (dict(weights=w[:, :4]), ValueError, "weights"),
        (dict(weights=w.half()), TypeError, "weights"),
        (dict(eps=-1.0), ValueError, "eps"),
    ]
    for kw, exc, match in bad:
        with pytest.raises(exc, match=match):
            call(**kw)
    # R wider than the indexer head (iq 32 wide, the table 64): named
    with pytest.raises(ValueError, match="cos_sin"):
        call(iq=torch.zeros(2, 8, 32, dtype=torch.bfloat16, device=DEVICE))


def test_empty_batch():
    inp = _inputs(2, "random", 10)
    inp = {k: (v[:0] if isinstance(v, torch.Tensor) and k != "cos_sin" else v) for k, v in inp.items()}
    qo, q8, w = q_norm_rope_indexer_q(**inp)
    assert qo.shape == (0, 4, 512) and q8.shape == (0, 8, 128) and w.shape == (0, 8)


def _kinds_and_launches(fn, *a):
    from ds4lab.model.launches import count_launches
    _, seen = op_kinds(fn, *a)
    out, n = count_launches(fn, *a)
    return out, dict(seen), n


def test_backend_switch_one_launch_same_bits(monkeypatch):
    import ds4lab.model.backend_kernel as bk
    from ds4lab.model.backend_ref import ReferenceBackend
    inp = SQI.make_qi_inputs({"T": 2, "H": 4, "D": 512, "IH": 64, "ID": 128, "max_pos": 256}, "random", 3, DEVICE)
    args = (inp["q"], inp["iq"], inp["positions"], inp["cos_sin"], inp["weights"], inp["eps"])
    kb = bk.KernelBackend()
    monkeypatch.setattr(bk, "FUSE_Q_INDEXER_Q", False)
    off, kinds_off, n_off = _kinds_and_launches(kb.q_norm_rope_indexer_q, *args)
    assert kinds_off == {"attn.q_norm_rope": bk.K_NORM_ROPE, "indexer.q_quant": "kernel:indexer.indexer_q_rope_quant"}
    monkeypatch.setattr(bk, "FUSE_Q_INDEXER_Q", True)
    on, kinds_on, n_on = _kinds_and_launches(kb.q_norm_rope_indexer_q, *args)
    assert kinds_on == {"attn.q_norm_rope+indexer.q_quant": bk.K_Q_NORM_ROPE_INDEXER_Q}
    _same(on, off)
    if DEVICE == "cpu":      # count_launches sees Triton launches on the interpreter
        assert n_on["attn.q_norm_rope+indexer.q_quant"] == 1
        assert n_off["attn.q_norm_rope"] == n_off["indexer.q_quant"] == 1
    # the reference backend's default composes its two ops (unchanged)
    r = ReferenceBackend().q_norm_rope_indexer_q(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    assert r[0].shape == on[0].shape and r[1].shape == on[1].shape and r[2].shape == on[2].shape


def test_tiny_model_logits_switch_on_equal_off(monkeypatch):
    """The tiny config cut to one C4A layer (+ its C128A neighbour's absence: the MTP layer is not run),
    kernel backend, a batch-2 decode at a C4 boundary (pos 11) after a short fill: logits bit-identical with
    FUSE_Q_INDEXER_Q on and off; one launch fewer in the step, the fused group once."""
    import dataclasses

    import ds4lab.model.backend_kernel as bk
    from ds4lab.checkpoint.tiny import TINY_CONFIG as CFG
    from ds4lab.model import build_rank
    from ds4lab.model.launches import count_launches
    from ds4lab.model.weights import random_weights
    cfg = dataclasses.replace(CFG, num_hidden_layers=1, compress_ratios=(4, 0), num_hash_layers=1)
    W = random_weights(cfg, 1, device="cpu", seed=5)
    m = build_rank(cfg, 1, 0, W, backend="kernel", max_pos=512, chunk=16)
    ids = torch.randint(0, CFG.vocab_size, (2, 1), generator=torch.Generator().manual_seed(1))
    pos = torch.full((2, 1), 11)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(bk, "FUSE_Q_INDEXER_Q", on)
        C = m.new_caches(2, 16)
        g = torch.Generator().manual_seed(0)
        for L in C.layers:           # a non-zero indexer K cache: the top-k reads the q / w of the launch
            if L.idx is not None:
                L.idx.copy_(torch.randint(0, 120, L.idx.shape, dtype=torch.uint8, generator=g))
        runs[on] = count_launches(m.decode, ids, pos, C)
    (lg0, n0), (lg1, n1) = runs[False], runs[True]
    assert torch.isfinite(lg0).all() and torch.equal(lg0, lg1)
    fused = "attn.q_norm_rope+indexer.q_quant"
    assert fused not in n0.calls and n0.calls["attn.q_norm_rope"] == n0.calls["indexer.q_quant"] == 1
    assert n1.calls[fused] == 1 and "attn.q_norm_rope" not in n1.calls and "indexer.q_quant" not in n1.calls
    if DEVICE == "cpu":              # Triton launches are seen on the interpreter
        assert n1[fused] == 1 and n0["attn.q_norm_rope"] == n0["indexer.q_quant"] == 1
        # every other group the same, but for the buffers the first step allocates and zeroes (o_proj's split-K
        # counters, the top-k's arrival counters; the off run is the model's first)
        other = {g for g in set(n0) | set(n1) if n0[g] != n1[g]} - {fused, "attn.q_norm_rope", "indexer.q_quant"}
        assert other <= {"attn.o_proj", "indexer.logits_topk"}, (n0, n1)
        assert all(n0[g] == n1[g] + 1 for g in other), (n0, n1)


_AOT = r"""
import json, re
from ds4lab.harness import aot
from ds4lab.harness.specs import q_indexer as SQI
from ds4lab_kernels.indexer import indexer_q_rope_quant
from ds4lab_kernels.norm_rope import CONFIGS, q_norm_rope_indexer_q, rmsnorm_rope
inp = SQI.make_qi_inputs({"T": 4, "H": 16, "D": 512, "IH": 64, "ID": 128}, "random", 0, "cpu")
with aot.capture_compiles("sm_89") as cap:
    rmsnorm_rope(inp["q"], None, 1e-6, inp["positions"], inp["cos_sin"], config={"ROWS": 1, "num_warps": 4})
    indexer_q_rope_quant(inp["iq"], inp["positions"], inp["cos_sin"], inp["weights"],
                         config={"ROWS": 4, "num_warps": 4})
    q_norm_rope_indexer_q(**inp, config=CONFIGS["q_norm_rope_indexer_q"]["sm_89"]["q1i4"])
out = {}
for fn, c in cap:
    ptx = c.asm["ptx"]
    ops = re.findall(r"^\s*((?:fma|mul|add|sub|div|rsqrt|sqrt|cvt)\.[\w.]*f32[\w.]*)", ptx, re.M)
    fmas = re.findall(r"^\s*fma\.rn\.f32\s+[^,]+,\s*([^;]+);", ptx, re.M)
    out[fn.__name__] = {"ops": ops, "fmas": fmas, "mul_rn": len(re.findall(r"\bmul\.rn\.f32", ptx)),
                        **aot._inspect(c, "sm_89")}
print("JSON" + json.dumps(out))
"""


@pytest.mark.aot
def test_sm89_ptx_rounds_as_the_two_launches():
    """sm_89 PTX of the fused launch (fp fusion on) against the two it replaces: the q job's float
    instructions are ``rmsnorm_rope``'s, in order (same contractions: its sum of squares and rotation FMAs);
    in the indexer job, built without fusion on its own, the only FMAs are ``to_e4m3``'s
    ``|x| * 512 + 2^23`` (an exact product: the same value as the separate multiply and add), and the
    rotation's products are ``mul.rn.f32`` (never contracted). No spills."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", _AOT], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    got = json.loads(p.stdout.split("JSON", 1)[1])
    rms, idx, fused = got["_rmsnorm_rope_kernel"], got["_indexer_q_kernel"], got["_q_norm_rope_indexer_q_kernel"]
    n = len(rms["ops"])
    assert fused["ops"][:n] == rms["ops"]
    assert not idx["fmas"] and rms["fmas"]           # the q job's FMAs: the first ones (its ops are rmsnorm's)
    extra = fused["fmas"][len(rms["fmas"]):]
    assert extra and all(re.sub(r"\s", "", f).endswith(",0f44000000,0f4B000000") for f in extra), extra
    assert fused["mul_rn"] >= 4 and "mul.rn.f32" in fused["ops"][n:]
    assert fused["spill_stores"] == fused["spill_loads"] == fused["local"] == 0
