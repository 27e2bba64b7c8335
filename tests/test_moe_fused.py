"""Issue 20, session 18: the W4A16 MoE decode as one launch (``"sched": "fused"``, rows ``mmaq_n64f8xl*``), on the
interpreter.

The fused kernel runs the persistent rows' w13 units, then one w2 unit per (tile, column block) that spins on its
tile's ready counter. The interpreter runs programs one after another, so the launcher gives it one program (a w2
unit of program 0 would otherwise wait for a w13 unit of program 1 forever): the cross-program waits run on a GPU
only. What is proven here:
- one program picks 1 split, so the bits equal the 1-split grid row's (``mmaq_n64s1xl_w2n128`` at the same w2 tile
  width), both output modes, on ragged experts with two 16-row tiles, padding tokens with NaN x, an
  id == E and NaN-filled workspaces; every counter (tickets, ready and consumer counts) is 0 again after the launch,
  so a second call (a CUDA-graph replay) starts clean;
- 5 groups, repeated and invalid ids against the float64 reference, the same bits under a token permutation; a
  broken output (one pair left out) fails the same check;
- no valid id at all: the output is still written (zeros), and nothing is added in accumulate mode;
- the wave size: :func:`resident_ctas` from registers, shared memory and threads, and bad rows raise naming the
  field.
"""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare
from ds4lab.reference import moe as R
from ds4lab_kernels import moe_w4a16 as K
from test_moe16 import _dev, _ws
from test_moe_persist import _ragged, _uneven_case

pytestmark = pytest.mark.interp

_T = K.CONFIGS["sm_89"]


@pytest.mark.parametrize("label", ["mmaq_n64f8xl", "mmaq_n64f8xl_w2n128"])
def test_fused_bit_equal_to_the_one_split_grid_row(label):
    inp = _dev(_ragged(D=512))
    T, D = inp["x"].shape
    I, P = inp["w13_packed"].shape[1] // 2, inp["topk_ids"].numel()
    cfg = _T[label]
    # the twin at the same w2 tile width (the interpreter's fp32 dots may sum in another order at another width)
    twin = dict(_T["mmaq_n64s1xl_w2n128"], BLOCK_N2=cfg["BLOCK_N2"])
    ws = _ws(dict(cfg, SPLIT_K=D // 128), T, P, D, I)
    got = K.fused_moe_w4a16(**inp, config=cfg, workspace=ws)
    want = K.fused_moe_w4a16(**inp, config=twin)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)) and got.abs().max() > 0
    assert int(ws["counters"].abs().sum()) == 0
    assert torch.all(got[::6] == 0) and not got.isnan().any()
    again = K.fused_moe_w4a16(**inp, config=cfg, workspace=ws)
    assert torch.equal(again.view(torch.int16), got.view(torch.int16))
    out0 = torch.randn(T, D, generator=torch.Generator().manual_seed(1)).float().to(DEVICE)
    acc = K.fused_moe_w4a16(**inp, config=cfg, out=out0.clone(), accumulate=True)
    acc_t = K.fused_moe_w4a16(**inp, config=twin, out=out0.clone(), accumulate=True)
    assert torch.equal(acc.view(torch.int32), acc_t.view(torch.int32))


def test_fused_vs_reference_permutation_and_broken_output():
    inp, E = _uneven_case()
    cfg = _T["mmaq_n64f8xl"]
    dinp = _dev(inp)
    out = K.fused_moe_w4a16(**dinp, config=cfg)
    ids = inp["topk_ids"]
    ids_ref = torch.where(ids >= E, torch.full_like(ids, -1), ids)
    rep = compare(out.cpu(), R.fused_moe_w4a16(**{**inp, "topk_ids": ids_ref}), "bfloat16")
    assert rep, rep.summary()
    perm = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(3))
    pinp = _dev({**inp, "x": inp["x"][perm], "topk_weights": inp["topk_weights"][perm], "topk_ids": ids[perm]})
    assert torch.equal(K.fused_moe_w4a16(**pinp, config=cfg).view(torch.int16), out[perm.to(out.device)].view(torch.int16))
    broken = ids_ref.clone()
    broken[3, 1] = -1
    assert not compare(out.cpu(), R.fused_moe_w4a16(**{**inp, "topk_ids": broken}), "bfloat16")


def test_fused_rejects_mismatched_warps_and_small_counters():
    inp, _ = _uneven_case()
    dinp = _dev(inp)
    with pytest.raises(ValueError, match="num_warps2"):
        K.fused_moe_w4a16(**dinp, config=dict(_T["mmaq_n64f8xl"], num_warps2=8))
    P = inp["topk_ids"].numel()
    need = P * (128 // 64) + 640 // 64 + 2 * P
    small = {"counters": torch.zeros(need - 1, dtype=torch.int32, device=DEVICE)}
    with pytest.raises(ValueError, match=f"counters.*>= {need}"):
        K.fused_moe_w4a16(**dinp, config=_T["mmaq_n64f8xl"], workspace=small)


def test_fused_no_valid_id_writes_zeros():
    inp, E = _uneven_case()
    inp["topk_ids"] = torch.where(torch.arange(inp["topk_ids"].numel()).view_as(inp["topk_ids"]) % 2 == 0,
                                  torch.full_like(inp["topk_ids"], -1), torch.full_like(inp["topk_ids"], E))
    T, D = inp["x"].shape
    dinp = _dev(inp)
    out = torch.full((T, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert torch.all(K.fused_moe_w4a16(**dinp, config=_T["mmaq_n64f8xl"], out=out) == 0)
    out0 = torch.randn(T, D, generator=torch.Generator().manual_seed(2)).float().to(DEVICE)
    acc = K.fused_moe_w4a16(**dinp, config=_T["mmaq_n64f8xl"], out=out0.clone(), accumulate=True)
    assert torch.equal(acc, out0)


def test_wave_size():
    assert K.persist_programs(torch.device("cpu"), _T["mmaq_n64f8xl"], fused=True) == 1
    assert K.persist_programs(torch.device("cpu"), _T["mmaq_n64p8xl"]) == K.INTERP_PERSIST_PROGRAMS
    # sm_89 (1,536 threads, 100 KB an SM): 128 registers x 128 threads -> 4 CTAs by registers; 24,576 B shared -> 4
    assert K.resident_ctas(128, 128, 24576, 102400, 1536, 4) == 4
    # 24,832 B: 4 x (24,832 + 1,024) > 102,400 -> 3
    assert K.resident_ctas(128, 128, 24832, 102400, 1536, 4) == 3
    assert K.resident_ctas(161, 128, 24576, 233472, 2048, 4) == 3      # sm_90: registers bind
    assert K.resident_ctas(100, 128, 0, 0, 0, 8) == 4                  # registers in units of 8: 104 x 128 -> 4, not 5
    assert K.resident_ctas(32, 512, 0, 0, 1536, 8) == 3                # threads bind
    assert K.resident_ctas(255, 256, 0, 0, 0, 4) == 1                  # never below one
    assert K.resident_ctas(64, 128, 0, 0, 0, 4) == 4                   # never above the row's CTAS
