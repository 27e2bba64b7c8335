"""Issue 19 correctness (b) and the CPU path of (c): the kernel model (ds4lab.model.backend_kernel,
real ds4lab Triton kernels on the interpreter) against the reference twin (float64 over the same
quantized weights: ``load_tiny(quantize=True)``), and the cache fill through the writers.

Budgets (derived in ds4lab.model.check): per op on identical inputs, 2 bf16 ulps (index outputs
>= 98% agreement, written cache bytes >= 99.9% equal); per layer from the same input, the layer's
output error <= 5% of its contribution (``check.BUDGET``). A free-running model compounds those
differences (fp8 requantization and top-6 routing flips amplify them from layer to layer), so it is
judged by its greedy tokens and a logits-cosine floor."""
import collections
import os

import pytest
import torch

from ds4lab.checkpoint import tiny
from ds4lab.model import build_rank
from ds4lab.model import check as mc
from ds4lab.model.backend_kernel import KernelBackend

pytestmark = pytest.mark.interp

CFG = tiny.TINY_CONFIG
PROMPT_LEN, STEPS = 4, 2
#: free-running logits: the random tiny checkpoint amplifies the per-op bf16-ulp differences through
#: fp8 requantization and top-6 routing flips layer after layer (measured logits cosine 0.986-0.9965
#: over a 4-token prefill and 2 steps), so the free run is judged by its greedy tokens and this floor;
#: the per-layer budget is judged teacher-forced (each layer from the twin's input)
COS_FLOOR = 0.97


@pytest.fixture(scope="module")
def weights():
    from ds4lab.model.weights import load_tiny
    torch.set_num_threads(1)  # the loaded 2-core box: one thread is faster for these small ops
    return load_tiny(quantize=True)


class _SyncSpy:
    """Counts host-syncing aten ops issued from ds4lab.model code (a decode step must issue none;
    ``indexer_k_cache_insert``'s slot bound check runs for CPU tensors only, see its docstring)."""
    SYNC = ("aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten._unique2", "aten.unique_dim",
            "aten.masked_select", "aten.equal", "aten.is_nonzero")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        spy = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if str(func).startswith(spy.SYNC):
                    spy.hits[spy._caller()] += 1
                return func(*args, **(kwargs or {}))
        self.mode, self.hits = Mode(), collections.Counter()

    @staticmethod
    def _caller():
        import traceback
        for fr in reversed(traceback.extract_stack()):
            f = fr.filename.replace(os.sep, "/")
            if "/ds4lab/" in f or "/ds4lab_kernels/" in f:
                return f"{f.rsplit('/', 2)[-2]}/{f.rsplit('/', 1)[-1]}:{fr.lineno}"
        return "?"


def _pick_prompt(mr, n_cand=12):
    """The candidate prompt whose twin greedy run has the widest top-1/top-2 margins (so the token
    check can judge; the candidates are fixed draws)."""
    best = None
    g = torch.Generator().manual_seed(19)
    for _ in range(n_cand):
        toks = torch.randint(tiny.BYTE_OFFSET, CFG.vocab_size, (PROMPT_LEN,), generator=g)
        C = mr.new_caches(1, 32)
        lg, _ = mr.prefill(toks, C)
        margins = []
        for s in range(STEPS + 1):
            top = lg.topk(2).values
            margins.append(float(top[0] - top[1]))
            if s < STEPS:
                lg = mr.decode(torch.tensor([[int(lg.argmax())]]), torch.tensor([[PROMPT_LEN + s]]), C)[0, 0]
        score = sorted(margins)[len(margins) // 2]
        if best is None or score > best[0]:
            best = (score, toks)
    return best[1]


def test_kernel_model_matches_twin_on_tiny_checkpoint(weights):
    """(b): per-op budgets (the op shadow, over the prefill), then the free-running model: the same greedy tokens over
    a short prefill and STEPS decode steps, logits cosine >= COS_FLOOR; the decode steps issue no
    host sync from the model's code."""
    mk = build_rank(CFG, 1, 0, weights, backend="kernel", max_pos=256, chunk=16)
    mr = build_rank(CFG, 1, 0, weights, backend="reference", max_pos=256, chunk=16)
    toks = _pick_prompt(mr)
    Ck, Cr = mk.new_caches(1, 32), mr.new_caches(1, 32)
    Cs = mr.new_caches(1, 32)   # the op shadow's own caches
    mapping = mc._pairs(weights, weights, {})
    for Lk, Ls in zip(Ck.layers + [Ck.mtp], Cs.layers + [Cs.mtp]):
        for f in ("swa", "comp", "idx", "idx_block_table", "state", "idx_state"):
            if getattr(Lk, f) is not None:
                mapping[id(getattr(Lk, f))] = getattr(Ls, f)
    shadow = mc.OpShadow(mk.ops, mr.ops, mapping).install()
    spy = _SyncSpy()
    report = []
    try:
        for s in range(STEPS + 1):
            mk.hidden, mr.hidden = [], []
            if s == 0:
                lk, _ = mk.prefill(toks, Ck)
                lr, _ = mr.prefill(toks, Cr)
                ids, x0 = toks, weights["embed"][toks]
                shadow.uninstall()   # the shadow's reference ops sync; the decode steps run bare
            else:
                t, p = torch.tensor([[tok]]), torch.tensor([[PROMPT_LEN + s - 1]])
                with spy.mode:
                    lk = mk.decode(t, p, Ck)[0, 0]
                lr = mr.decode(t, p, Cr)[0, 0]
                ids, x0 = t.reshape(-1), weights["embed"][t.reshape(-1)]
            x0 = x0[:, None].expand(-1, CFG.hc_mult, -1)
            for li, (a, b) in enumerate(zip(mk.hidden, mr.hidden)):   # reported, not judged (see doc)
                report.append((s, li, round((a.double() - b.double()).norm().item() / b.double().norm().item(), 4)))
            cos = torch.nn.functional.cosine_similarity(lk.double(), lr.double(), dim=0).item()
            top = lr.topk(2).values
            margin = float(top[0] - top[1])
            report.append((s, "logits cos", round(cos, 5), "twin margin", round(margin, 3)))
            assert cos >= COS_FLOOR, f"step {s}: logits cosine {cos:.5f} < {COS_FLOOR}"
            assert int(lk.argmax()) == int(lr.argmax()), f"step {s}: greedy token differs (twin margin {margin:.3g})"
            tok = int(lk.argmax())
    finally:
        shadow.uninstall()
    print("\n(b) step, layer, rel hidden error, rel budget / logits rows:", *report, sep="\n  ")
    bad = shadow.failures()
    assert not bad, f"ops outside their budget: {bad[:5]}"
    kinds = {r["op"] for r in shadow.rows}
    assert {"sparse_mla", "indexer_topk", "experts", "o_proj", "mhc_post_pre", "q_kv_norm_rope",
            "compressor_insert"} <= kinds
    # the cache entries are written by their producers (their bytes shadowed too), no insert op runs
    assert not kinds & {"mla_cache_write", "indexer_cache_write"}
    assert {r["group"] for r in shadow.rows if r["class"] == "bytes"} >= {
        "attn.q_kv_norm_rope(swa_cache)", "attn.compressor(cache)", "indexer.compressor(cache)"}
    model_syncs = {k: v for k, v in spy.hits.items() if not k.startswith("ds4lab_kernels/indexer.py")}
    assert not model_syncs, f"host syncs in decode: {model_syncs}"


def test_kernel_layers_teacher_forced_within_budget(weights):
    """(b) per layer: every layer of the tiny checkpoint on the kernel backend from the twin's input
    residual (same caches state, prefill of 6 tokens) stays within ``BUDGET`` of the twin's layer
    contribution; the MTP block too."""
    mk = build_rank(CFG, 1, 0, weights, backend="kernel", max_pos=256, chunk=16)
    mr = build_rank(CFG, 1, 0, weights, backend="reference", max_pos=256, chunk=16)
    g = torch.Generator().manual_seed(7)
    toks = torch.randint(tiny.BYTE_OFFSET, CFG.vocab_size, (6,), generator=g)
    pos, req = torch.arange(6), torch.zeros(6, dtype=torch.long)
    Ck, Cr = mk.new_caches(1, 16), mr.new_caches(1, 16)
    mk_maps, mr_maps = mk._maps(pos, req, Ck), mr._maps(pos, req, Cr)
    h = weights["embed"][toks][:, None].expand(-1, CFG.hc_mult, -1).contiguous()
    rows = []
    blocks = [(i, mk.layers[i], Ck.layers[i], Cr.layers[i]) for i in range(CFG.num_hidden_layers)]
    blocks.append((CFG.num_hidden_layers, weights["mtp"], Ck.mtp, Cr.mtp))
    for i, L, lk_, lr_ in blocks:
        ok_, _ = mk._block(i, L, h, toks, pos, req, lk_, mk_maps)
        or_, _ = mr._block(i, L, h, toks, pos, req, lr_, mr_maps)
        rel = ((ok_.double() - or_.double()).norm() / (or_.double() - h.double()).norm()).item()
        rows.append((i, round(rel, 5)))
        assert rel <= mc.BUDGET, f"layer {i}: {rel:.4g} > {mc.BUDGET} (rows {rows})"
        h = or_
    print("\n(b) teacher-forced layer rel L2 of the layer contribution:", rows)


def test_check_layers_cpu_path_tiny():
    """(c)'s CPU path: the same function the GPU run calls, at the tiny config on the interpreter."""
    rows = mc.check_layers(tp=1, layers=(0, 2, 3), device="cpu", batch=1, next_n=2, ctx=255, log=print)
    assert [r["status"] for r in rows] == ["OK"] * 3, rows
    for r in rows:
        assert r["ops"] >= 20 and r["ops_failed"] == 0 and r["route_agree"] == 1.0
        assert r["rel_l2"] < mc.BUDGET
    assert rows[1]["kind"].startswith("C4A") and rows[2]["kind"].startswith("C128A")


def _flip_reference_route(monkeypatch, rel_gap):
    """The reference's router logits of token 0 in the check's full reference run (its 2nd ``moe.gate``
    linear; the 1st is the op shadow's) nudged so that its 7th-best expert beats its 6th by ``rel_gap``
    of the 6th's selection score (``sqrtsoftplus + bias``): ``rel_gap`` ~0 is the near-tie flip that
    fp32-vs-fp64 noise decides on a GPU, larger values a real routing difference. Returns the call log."""
    import math

    from ds4lab.model.backend_ref import ReferenceBackend
    from ds4lab.reference.moe import sqrt_softplus
    orig, calls = ReferenceBackend.linear, []

    def linear(self, x, lin, name, out_dtype=torch.bfloat16):
        y = orig(self, x, lin, name, out_dtype=out_dtype)
        if name == "moe.gate":
            calls.append(name)
            if len(calls) == 2:
                bias = self._flip_bias.double()
                sel = sqrt_softplus(y[0].cpu()) + bias
                order = torch.sort(sel, descending=True).indices
                e6, e7 = order[5].item(), order[6].item()
                s7 = float(sel[e6]) * (1 + rel_gap) - float(bias[e7])
                y = y.clone()
                y[0, e7] = math.log(math.expm1(s7 * s7))
        return y
    monkeypatch.setattr(ReferenceBackend, "linear", linear)
    orig_gr = ReferenceBackend.gate_route

    def gate_route(self, x, gate, bias, *a, **k):
        self._flip_bias = bias.cpu()
        return orig_gr(self, x, gate, bias, *a, **k)
    monkeypatch.setattr(ReferenceBackend, "gate_route", gate_route, raising=False)
    return calls


def test_check_layers_near_tie_routing_flip_is_forced(monkeypatch):
    """H200 session 7: batch 4 x next_n 1, layer 3 (bias-routed) failed at rel_l2 0.193 with every op in
    budget and 2 of 24 routing slots different: a near-tie flip of one token's 6th expert moves its
    output by ~25%. The check teacher-forces the kernel's ids into the reference's MoE: a near-tie flip
    passes (reported as route_flips), a real routing difference still FAILs."""
    calls = _flip_reference_route(monkeypatch, 1e-5)
    (r,) = mc.check_layers(tp=1, layers=(3,), device="cpu", batch=4, next_n=1, ctx=255, log=print,
                           raise_on_fail=False)
    assert len(calls) == 2, calls
    assert r["route_flips"] == 1 and r["route_gap"] <= mc.ROUTE_TIE and r["route_agree"] < 1, r
    assert r["status"] == "OK" and r["rel_l2"] < mc.BUDGET, r


def test_check_layers_fails_a_real_routing_difference(monkeypatch):
    _flip_reference_route(monkeypatch, 0.2)
    (r,) = mc.check_layers(tp=1, layers=(3,), device="cpu", batch=4, next_n=1, ctx=255, log=print,
                           raise_on_fail=False)
    assert r["route_flips"] == 1 and r["route_gap"] > mc.ROUTE_TIE and r["status"] == "FAIL", r


def test_check_layers_catches_an_off_by_one(monkeypatch):
    """A realistic bug (the SWA length one short: the newest token dropped) moves the layer output
    by ~1%, inside the layer budget, but the op shadow names the op."""
    orig = KernelBackend.sparse_mla

    def short(self, q, swa_cache, swa_slots, swa_lens, *a, **k):
        return orig(self, q, swa_cache, swa_slots, (swa_lens - 1).clamp_min(0), *a, **k)
    monkeypatch.setattr(KernelBackend, "sparse_mla", short)
    with pytest.raises(AssertionError, match="outside the budget"):
        mc.check_layers(tp=1, layers=(0,), device="cpu", batch=1, next_n=1, ctx=255, log=print)


def test_fill_caches_kernel_writers_equal_reference_writers(weights):
    """fill_caches through the kernel backend's writers leaves the same bytes as through the
    reference writers (same seed), every layer: the caches hold the writers' layouts."""
    mk = build_rank(CFG, 1, 0, weights, backend="kernel", max_pos=256, chunk=16)
    mr = build_rank(CFG, 1, 0, weights, backend="reference", max_pos=256, chunk=16)
    ctx = 130  # > 128: one C128 entry, 32 C4 entries, the SWA ring partly wrapped (ring 192)
    Ck, Cr = mk.new_caches(1, ctx + 8), mr.new_caches(1, ctx + 8)
    mk.fill_caches(Ck, ctx, seed=3)
    mr.fill_caches(Cr, ctx, seed=3)
    for i, (a, b) in enumerate(zip(Ck.layers + [Ck.mtp], Cr.layers + [Cr.mtp])):
        for f in ("swa", "comp", "idx", "state", "idx_state"):
            x, y = getattr(a, f), getattr(b, f)
            if x is not None:
                assert torch.equal(x, y), f"layer {i} {f}"
        assert a.swa.any()
    with pytest.raises(ValueError, match="ctx"):
        mk.fill_caches(Ck, ctx + 8)
