"""moe16 (issue 20): the W4A16 MoE decode rows for 16-32 tokens (``DECODE_ROW_WIDE``), on the interpreter.

The candidate rows are the ``mmaq`` kernels with the loop id scan (``"scan": "loop"``), wider w2 column tiles
(``w2n128``), no K split (``s1``: h stored by the w13 program, no partials, no ticket) and 32-wide w13 tiles.
What is proven here:
- the loop scan and a wider w2 tile change only how a program finds its rows / which program computes a
  column: bit-equal to the twin row (both output modes) on ragged experts (19 and 20 tokens on one expert:
  two 16-row leader tiles; 3 / 0 tokens), padding tokens (ids -1, NaN x), an id == E, NaN-filled
  workspaces; every ticket counter back to 0; also at 1 token (the 16-id tight scan);
- split 1 against the float64 reference on the bf16 budget (an expert twice in a token, id == E, a -1
  slot), a clamp-hitting token bit-equal to the 64-wide split-1 row, a NaN x element kept in its row; a
  broken output (one pair's term left out) fails; an unknown ``scan`` raises naming it;
- ``pick_config`` returns ``DECODE_ROW_WIDE`` only from ``DECODE_WIDE_MIN_PAIRS`` pairs up, read per call.
The table rows run at the test shape (D=256, I=128: the launcher narrows the tiles to the shape).
"""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare
from ds4lab.reference import moe as R
from ds4lab_kernels import moe_w4a16 as K
from test_moe import _weights

pytestmark = pytest.mark.interp

ROWS = ("mmaq_n64s2xl", "mmaq_n64s2xl_w2n128", "mmaq_n64s1xl_w2n128", "mmaq_n32s1xl_w2n128",
        "mmaq_n32s1xl_w2n128s4", "mmaq_n64s4xl", "mmaq_n64s4xl_w2n128")
_T = K.CONFIGS["sm_89"]
# the twin of each row: the same arithmetic with the one-hot id scan, at the row's own w2 tile width. On a GPU the
# w2 tile width changes no bits either (each 16 x 8 mma block sums the same K in the same order; the kernel bench's
# bit checks, scripts/gpu/moe.sh MOE_BITEQ); the interpreter's numpy dots may sum a [16, 16] x [16, N] product in
# another order for another N, depending on the CPU's BLAS kernel (seen on an AMD EPYC, session 18), so the
# interpreter twins keep the width
TWIN = {"mmaq_n64s2xl": "mmaq_n64s2x",
        "mmaq_n64s2xl_w2n128": dict(_T["mmaq_n64s2xl_w2n128"], scan="onehot"),
        "mmaq_n32s1xl_w2n128": dict(_T["mmaq_n32s1xl_w2n128"], scan="onehot"),
        # session 14: 4 K splits with the loop scan (D=512 below: 4 splits of 128, not narrowed to 2)
        "mmaq_n64s4xl": "mmaq_n64s4x", "mmaq_n64s4xl_w2n128": dict(_T["mmaq_n64s4x"], BLOCK_N2=128)}


def _cfg(label):
    return label if isinstance(label, dict) else K.CONFIGS["sm_89"][label]


def _ragged(D=256, I=128, seed=5):
    """22 tokens x top-2 = 44 pairs (PB 128, the wide scan): expert 2 has 19 tokens, expert 3 every token
    but the padding ones (two 16-row leader tiles each), expert 0 three, expert 1 none, one id == E (skipped);
    every 4th token a padding token (ids -1, NaN x)."""
    g = torch.Generator().manual_seed(seed)
    T = 22
    ids = torch.empty(T, 2, dtype=torch.int32)
    ids[:19, 0] = 2
    ids[19:, 0] = 0
    ids[:, 1] = 3
    ids[::4] = -1
    ids[5, 1] = 4
    x = torch.randn(T, D, generator=g).bfloat16()
    x[::4] = float("nan")
    tw = ((lambda w: w / w.sum(1, keepdim=True) * 1.5)(torch.rand(T, 2, generator=g) + 0.1)).float()
    return {"x": x, **_weights(4, D, I, seed), "topk_weights": tw, "topk_ids": ids}


def _ws(cfg, T, P, D, I, fill=float("nan")):
    splits = cfg["SPLIT_K"]
    return {"h": torch.full((P, I), fill, dtype=torch.float16, device=DEVICE),
            "y": torch.full((P, D), fill, device=DEVICE),
            "part": torch.full((max(splits, 1), P, 2 * I), fill, device=DEVICE),
            "xs": torch.full((T, D), fill, dtype=torch.bfloat16, device=DEVICE),
            "counters": torch.zeros(4096, dtype=torch.int32, device=DEVICE)}


def _dev(d):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


@pytest.mark.parametrize("label", sorted(TWIN))
def test_wide_w2_tiles_bit_equal_to_twin(label):
    inp = _dev(_ragged(D=128 * _cfg(label)["SPLIT_K"]) if _cfg(label)["SPLIT_K"] >= 4 else _ragged())
    T, D = inp["x"].shape
    I, P = inp["w13_packed"].shape[1] // 2, inp["topk_ids"].numel()
    cfg, twin = _cfg(label), _cfg(TWIN[label])
    out0 = torch.randn(T, D, generator=torch.Generator().manual_seed(1)).float().to(DEVICE)
    ws = _ws(cfg, T, P, D, I)
    if cfg["SPLIT_K"] == 1:
        ws.pop("part")   # split 1: h is the partial buffer (the launcher passes h), no part workspace
    got = K.fused_moe_w4a16(**inp, config=cfg, workspace=ws)
    want = K.fused_moe_w4a16(**inp, config=twin)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert int(ws["counters"].abs().sum()) == 0
    assert torch.all(got[::4] == 0) and not got.isnan().any()
    acc = K.fused_moe_w4a16(**inp, config=cfg, out=out0.clone(), accumulate=True)
    acc_t = K.fused_moe_w4a16(**inp, config=twin, out=out0.clone(), accumulate=True)
    assert torch.equal(acc.view(torch.int32), acc_t.view(torch.int32))
    assert torch.equal(acc[::4], out0[::4])
    ids = inp["topk_ids"].cpu()
    ref = R.fused_moe_w4a16(**{**{k: v.cpu() for k, v in inp.items()},
                               "topk_ids": torch.where(ids >= 4, torch.full_like(ids, -1), ids)})
    rep = compare(got.cpu(), ref, "bfloat16")
    assert rep, rep.summary()


@pytest.mark.parametrize("T", [1])
def test_loop_scan_narrow_bit_equal(T):
    """The narrow row with the loop scan (16-id tight scan at <= 16 pairs) == ``mmaq_n64s4x``
    at 1 token x top-6 (the 2-token case runs on the H200: moe.sh T=1,4,...): an expert twice in a token, a -1 slot, both output modes."""
    E, D, I, k = 8, 256, 128, 6
    g = torch.Generator().manual_seed(21 + T)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    ids[0, 3] = ids[0, 1]
    ids[T - 1, 5] = -1
    inp = _dev({"x": torch.randn(T, D, generator=g).bfloat16(), **_weights(E, D, I, T),
                "topk_weights": (torch.rand(T, k, generator=g) + 0.1).float(), "topk_ids": ids})
    a = K.fused_moe_w4a16(**inp, config=dict(_cfg("mmaq_n64s4x"), scan="loop"))
    b = K.fused_moe_w4a16(**inp, config=_cfg("mmaq_n64s4x"))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)) and a.abs().max() > 0
    out0 = torch.randn(T, D, generator=g).float().to(DEVICE)
    a = K.fused_moe_w4a16(**inp, config=dict(_cfg("mmaq_n64s4x"), scan="loop"), out=out0.clone(), accumulate=True)
    b = K.fused_moe_w4a16(**inp, config=_cfg("mmaq_n64s4x"), out=out0.clone(), accumulate=True)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    with pytest.raises(ValueError, match="scan"):
        K.fused_moe_w4a16(**inp, config=dict(dict(_cfg("mmaq_n64s4x"), scan="loop"), scan="nope"))


def test_split1_row_vs_reference_and_broken_output_fails():
    """``mmaq_n32s1xl_w2n128`` (w13 32-wide, no split, loop scan): a repeated expert in a token, id == E and a -1 slot
    (skipped), one clamp-hitting token (x 8), a NaN x element kept in its token's row; a second call gives the same
    bits (no counter left set); dropping one pair's term fails the same check."""
    E, D, I, T, k = 8, 256, 128, 6, 3
    g = torch.Generator().manual_seed(9)
    x = torch.randn(T, D, generator=g)
    x[5] *= 8    # clamp-hitting token (its output: a small sum of large terms, checked bit-equal below)
    x = x.bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    ids[0, 1] = ids[0, 0]
    ids[1, 2] = E
    ids[2, 0] = -1
    tw = (torch.rand(T, k, generator=g) + 0.1).float()
    inp = _dev({"x": x, **_weights(E, D, I, 9), "topk_weights": tw, "topk_ids": ids})
    cfg = _cfg("mmaq_n32s1xl_w2n128")
    out = K.fused_moe_w4a16(**inp, config=cfg)
    again = K.fused_moe_w4a16(**inp, config=cfg)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))
    ids_ref = torch.where(ids >= E, torch.full_like(ids, -1), ids)
    ref = R.fused_moe_w4a16(**{**{kk: v.cpu() for kk, v in inp.items()}, "topk_ids": ids_ref})
    rep = compare(out[:5].cpu(), ref[:5], "bfloat16")
    assert rep, rep.summary()
    # the same arithmetic as the 64-wide split-1 row (w13 tiles only change which program owns a column)
    assert torch.equal(out.view(torch.int16), K.fused_moe_w4a16(**inp, config=_cfg("mmaq_n64s1xl_w2n128")).view(torch.int16))
    broken = ids_ref.clone()
    broken[3, 1] = -1
    bad = R.fused_moe_w4a16(**{**{kk: v.cpu() for kk, v in inp.items()}, "topk_ids": broken})
    assert not compare(bad[:5], ref[:5], "bfloat16")
    assert not compare(out[:5].cpu(), bad[:5], "bfloat16")
    xn = inp["x"].clone()
    xn[4, 7] = float("nan")
    o2 = K.fused_moe_w4a16(**{**inp, "x": xn}, config=cfg)
    assert o2[4].isnan().all() and torch.equal(o2[:4].view(torch.int16), out[:4].view(torch.int16))


def test_pick_config_wide_row_per_table_and_read_per_call(monkeypatch):
    class Dev:
        type = "cuda"
    t = K.CONFIGS["sm_89"]
    monkeypatch.setattr(K, "arch_of", lambda d: "sm_89")
    # shipped, both tables: the one-launch row up to 12 pairs (narrow, session 19), the 4-split loop-scan row up to
    # 95 (DECODE_ROW, session 15), the wide row (128-wide w2 tiles) from 96
    assert K.DECODE_ROW_WIDE == {"sm_89": "mmaq_n64s4xl_w2n128", "sm_90": "mmaq_n64s4xl_w2n128"}
    assert K.DECODE_WIDE_MIN_PAIRS == 96
    # session 20: the one-launch wide row from 96 up to 128 pairs (batch 16), the grid wide row above (batch-16 MTP)
    assert K.DECODE_ROW_FUSED_WIDE == {"sm_89": "mmaq_n64f8xl_w2n128", "sm_90": "mmaq_n64f8xl_w2n128"}
    assert K.DECODE_FUSED_WIDE_MAX_PAIRS == 128
    assert K.pick_config(96, Dev()) is t["mmaq_n64f8xl_w2n128"] and K.pick_config(128, Dev()) is t["mmaq_n64f8xl_w2n128"]
    assert K.pick_config(129, Dev()) is t["mmaq_n64s4xl_w2n128"] and K.pick_config(192, Dev()) is t["mmaq_n64s4xl_w2n128"]
    assert K.pick_config(95, Dev()) is t["mmaq_n64s4xl"] and K.pick_config(13, Dev()) is t["mmaq_n64s4xl"]
    monkeypatch.setattr(K, "arch_of", lambda d: "sm_90")
    t90 = K.CONFIGS["sm_90"]
    assert K.pick_config(96, Dev()) is t90["mmaq_n64f8xl_w2n128"] and K.pick_config(95, Dev()) is t90["mmaq_n64s4xl"]
    assert K.pick_config(192, Dev()) is t90["mmaq_n64s4xl_w2n128"]
    assert K.DECODE_ROW == {"sm_89": "mmaq_n64s4xl", "sm_90": "mmaq_n64s4xl"} and K.DECODE_ROW_NARROW == "mmaq_n64f8xl"
    assert K.pick_config(12, Dev()) is t90["mmaq_n64f8xl"] and K.pick_config(6, Dev()) is t90["mmaq_n64f8xl"]
    monkeypatch.setattr(K, "arch_of", lambda d: "sm_89")
    monkeypatch.setattr(K, "DECODE_ROW_FUSED_WIDE", {"sm_89": None, "sm_90": None})   # DECODE_ROW_WIDE alone
    monkeypatch.setattr(K, "DECODE_ROW_WIDE", {"sm_89": "mmaq_n32s1xl_w2n128", "sm_90": None})
    assert K.pick_config(K.DECODE_WIDE_MIN_PAIRS, Dev()) is t["mmaq_n32s1xl_w2n128"]
    assert K.pick_config(192, Dev()) is t["mmaq_n32s1xl_w2n128"]
    assert K.pick_config(K.DECODE_WIDE_MIN_PAIRS - 1, Dev()) is t[K.DECODE_ROW["sm_89"]]
    assert K.pick_config(6, Dev()) is t[K.DECODE_ROW_NARROW]
    assert K.pick_config(K.DECODE_MAX_PAIRS + 1, Dev()) is t["prefill"]
    # the one-launch wide row, when a table names one: from the wide bound up to DECODE_FUSED_WIDE_MAX_PAIRS only
    monkeypatch.setattr(K, "DECODE_ROW_FUSED_WIDE", {"sm_89": "mmaq_n64f8xl_w2n128", "sm_90": None})
    assert K.pick_config(K.DECODE_WIDE_MIN_PAIRS, Dev()) is t["mmaq_n64f8xl_w2n128"]
    assert K.pick_config(K.DECODE_FUSED_WIDE_MAX_PAIRS, Dev()) is t["mmaq_n64f8xl_w2n128"]
    assert K.pick_config(K.DECODE_FUSED_WIDE_MAX_PAIRS + 1, Dev()) is t["mmaq_n32s1xl_w2n128"]
    assert K.pick_config(K.DECODE_WIDE_MIN_PAIRS - 1, Dev()) is t[K.DECODE_ROW["sm_89"]]
    monkeypatch.setattr(K, "DECODE_ROW_FUSED_WIDE", {"sm_89": None, "sm_90": None})
    monkeypatch.setattr(K, "DECODE_ROW_WIDE", {"sm_89": None, "sm_90": None})
    assert K.pick_config(192, Dev()) is t[K.DECODE_ROW["sm_89"]]
    for label in ROWS:
        assert t[label]["path"] == "decode" and K.CONFIGS["sm_90"][label] == t[label]
