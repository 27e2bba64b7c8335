"""Issue 20, session 17: the persistent w13 launch of the W4A16 MoE decode (``"sched": "persist"``, rows
``mmaq_n64p8xl*``), on the interpreter.

One wave of programs (``persist_programs``: SMs x the CTAs of the binary about to run an SM holds, on a GPU; ``INTERP_PERSIST_PROGRAMS`` here) builds the tile
list in-kernel, picks the K split count from it and loops over (tile, column block, split) units. What is proven:
- where the picked split count equals a grid row's (1 or 4 at the shapes below), the bits equal that row's (both
  output modes; ragged experts with two 16-row tiles, padding tokens with NaN x, an id == E, NaN-filled
  workspaces, every ticket counter back to 0), with fewer programs than units (each loops) and with more;
- an uneven split (3 splits of 5 groups: 1 + 2 + 2) against the float64 reference on the bf16 budget, the same
  bits twice and under a token permutation; a broken output (one pair left out) fails the same check;
- the split count the kernel picks is the documented cost minimum (checked through the bits it produces: a
  different count gives other bits at these shapes);
- an unknown ``sched`` raises naming it.
"""
import math

import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare
from ds4lab.reference import moe as R
from ds4lab_kernels import moe_w4a16 as K
from test_moe import _weights
from test_moe16 import _dev, _ws

pytestmark = pytest.mark.interp

_T = K.CONFIGS["sm_89"]


def _picked(n_tiles, nb, programs, groups, smax, ovh):
    """The split count the persistent kernel documents: the S in 1..smax minimising
    ceil(n_tiles * nb * S / programs) * (ceil(groups / S) + ovh), ties to fewer splits."""
    cost = {s: math.ceil(n_tiles * nb * s / programs) * (math.ceil(groups / s) + ovh) for s in range(1, smax + 1)}
    return min(cost, key=lambda s: (cost[s], s))


def _ragged(T=36, D=512, I=128, seed=5):
    """36 tokens x top-2 on 4 experts (PB 128, the wide scan): expert 2 has 25 valid tokens and expert 3 has 29 (two
    16-row tiles each), expert 0 five, expert 1 none, one id == E (skipped); every 6th token a padding token (ids -1,
    NaN x): 5 tiles."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(T, 2, dtype=torch.int32)
    ids[:30, 0] = 2
    ids[30:, 0] = 0
    ids[:, 1] = 3
    ids[::6] = -1
    ids[5, 1] = 4
    x = torch.randn(T, D, generator=g).bfloat16()
    x[::6] = float("nan")
    tw = ((lambda w: w / w.sum(1, keepdim=True) * 1.5)(torch.rand(T, 2, generator=g) + 0.1)).float()
    return {"x": x, **_weights(4, D, I, seed), "topk_weights": tw, "topk_ids": ids}


def _tiles(ids, E, bm=16):
    v = ids[(ids >= 0) & (ids < E)]
    return sum(math.ceil(int((v == e).sum()) / bm) for e in v.unique())


# the twins at the persistent row's w2 tile width (128): see test_moe16.TWIN on widths in the interpreter
@pytest.mark.parametrize("programs,smax,twin", [(3, 8, "mmaq_n64s1xl_w2n128"), (64, 4, "mmaq_n64s4x")])
def test_persist_bit_equal_to_grid_row_at_the_same_split(monkeypatch, programs, smax, twin):
    monkeypatch.setattr(K, "INTERP_PERSIST_PROGRAMS", programs)
    inp = _dev(_ragged(D=512))
    T, D = inp["x"].shape
    I, P = inp["w13_packed"].shape[1] // 2, inp["topk_ids"].numel()
    cfg = dict(_T["mmaq_n64p8xl_w2n128"], SPLIT_K=smax)
    n_tiles = _tiles(inp["topk_ids"].cpu(), 4)
    assert n_tiles == 5
    want_s = _picked(n_tiles, I // 64, programs, D // 128, smax, cfg["OVH"])
    twin = dict(_T[twin], BLOCK_N2=128)
    assert want_s == twin["SPLIT_K"] and n_tiles * (I // 64) * want_s != programs
    ws = _ws(dict(cfg, SPLIT_K=min(smax, D // 128)), T, P, D, I)   # the launcher caps the splits at the groups
    got = K.fused_moe_w4a16(**inp, config=cfg, workspace=ws)
    want = K.fused_moe_w4a16(**inp, config=twin)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)) and got.abs().max() > 0
    assert int(ws["counters"].abs().sum()) == 0
    assert torch.all(got[::6] == 0) and not got.isnan().any()
    out0 = torch.randn(T, D, generator=torch.Generator().manual_seed(1)).float().to(DEVICE)
    acc = K.fused_moe_w4a16(**inp, config=cfg, out=out0.clone(), accumulate=True)
    acc_t = K.fused_moe_w4a16(**inp, config=twin, out=out0.clone(), accumulate=True)
    assert torch.equal(acc.view(torch.int32), acc_t.view(torch.int32))


def _uneven_case(seed=11):
    """D = 640 (5 groups), 12 tokens x top-3 on 8 experts; an expert twice in a token, an id == E, a -1 slot."""
    E, D, I, T, k = 8, 640, 128, 12, 3
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    ids[0, 1] = ids[0, 0]
    ids[1, 2] = E
    ids[2, 0] = -1
    inp = {"x": torch.randn(T, D, generator=g).bfloat16(), **_weights(E, D, I, seed),
           "topk_weights": (torch.rand(T, k, generator=g) + 0.1).float(), "topk_ids": ids}
    return inp, E


def test_persist_uneven_split_vs_reference_permutation_and_broken_output(monkeypatch):
    inp, E = _uneven_case()
    n_tiles = _tiles(inp["topk_ids"], E)
    cfg = _T["mmaq_n64p8xl"]
    # programs so that 3 splits of the 5 groups (1 + 2 + 2) fill one wave exactly
    programs = n_tiles * 2 * 3
    monkeypatch.setattr(K, "INTERP_PERSIST_PROGRAMS", programs)
    assert _picked(n_tiles, 2, programs, 5, 8, cfg["OVH"]) == 3
    dinp = _dev(inp)
    out = K.fused_moe_w4a16(**dinp, config=cfg)
    assert torch.equal(out.view(torch.int16), K.fused_moe_w4a16(**dinp, config=cfg).view(torch.int16))
    ids = inp["topk_ids"]
    ids_ref = torch.where(ids >= E, torch.full_like(ids, -1), ids)
    ref = R.fused_moe_w4a16(**{**inp, "topk_ids": ids_ref})
    rep = compare(out.cpu(), ref, "bfloat16")
    assert rep, rep.summary()
    # a different split count (the 1-split grid row; without the x copy, whose one-chunk arange needs a power of 2)
    # gives other bits here
    # (the fp32 output of accumulate: the split sums differ in h's fp16 rounding, often hidden by the bf16 output)
    z = torch.zeros(inp["x"].shape, dtype=torch.float32, device=DEVICE)
    mine = K.fused_moe_w4a16(**dinp, config=cfg, out=z.clone(), accumulate=True)
    other = K.fused_moe_w4a16(**dinp, config=dict(_T["mmaq_n64s1xl_w2n128"], xperm=0), out=z.clone(), accumulate=True)
    assert not torch.equal(mine, other)
    perm = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(3))
    pinp = _dev({**inp, "x": inp["x"][perm], "topk_weights": inp["topk_weights"][perm], "topk_ids": ids[perm]})
    assert torch.equal(K.fused_moe_w4a16(**pinp, config=cfg).view(torch.int16), out[perm.to(out.device)].view(torch.int16))
    broken = ids_ref.clone()
    broken[3, 1] = -1
    bad = R.fused_moe_w4a16(**{**inp, "topk_ids": broken})
    assert not compare(out.cpu(), bad, "bfloat16")


def test_unknown_sched_raises():
    inp, _ = _uneven_case()
    with pytest.raises(ValueError, match="sched"):
        K.fused_moe_w4a16(**_dev(inp), config=dict(_T["mmaq_n64p8xl"], sched="stream"))
