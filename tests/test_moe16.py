"""moe16 (issue 20): the W4A16 MoE decode rows for 16-32 tokens (``DECODE_ROW_WIDE``), on the interpreter.

The candidate rows are the ``mmaq`` kernels with other tiles: ``"s1"`` (SPLIT_K 1: h stored by the w13
program itself, no partials, no ticket) and wider w2 column tiles (``w2n128``). What is proven here:
- a wider w2 tile changes only which program computes a column: bit-equal to the row with the same w13
  tiles (both output modes), on ragged experts (33 / 5 / 0 tokens, more than one 16-row leader tile),
  padding tokens with NaN x, NaN-filled workspaces; every ticket counter back to 0;
- SPLIT_K 1 against the float64 reference on the bf16 budget (the repeated-expert / id >= E / -1 slot /
  clamp-hitting token bit-equal to the 64-wide split-1 row), a NaN x element kept in its row; a broken
  output (one pair's term left out) fails;
- ``pick_config`` returns ``DECODE_ROW_WIDE`` only from ``DECODE_WIDE_MIN_PAIRS`` pairs up, read per call.
The table rows themselves run at the test shape (D=256, I=128: the launcher narrows the tiles to the shape).
"""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare
from ds4lab.reference import moe as R
from ds4lab_kernels import moe_w4a16 as K

pytestmark = pytest.mark.interp

ROWS = ("mmaq_n64s2x_w2n128", "mmaq_n64s1x", "mmaq_n64s1x_w2n128", "mmaq_n32s1x_w2n128")
# the twin of each row: the same SPLIT_K and w13 tiles with 64-wide w2 tiles (D=512 here: the 128-wide w2
# tile covers 2 of the 8 64-column blocks, 4 programs per pair instead of 8)
TWIN = {"mmaq_n64s2x_w2n128": "mmaq_n64s2x", "mmaq_n64s1x_w2n128": "mmaq_n64s1x",
        "mmaq_n32s1x_w2n128": dict(K.CONFIGS["sm_89"]["mmaq_n32s1x_w2n128"], BLOCK_N2=64)}


def _cfg(label):
    return label if isinstance(label, dict) else K.CONFIGS["sm_89"][label]


def _weights(E, D, I, seed):
    g = torch.Generator().manual_seed(seed)
    q13 = torch.randint(-8, 8, (E, 2 * I, D), generator=g)
    q2 = torch.randint(-8, 8, (E, D, I), generator=g)
    s13 = (torch.rand(E, 2 * I, D // 128, generator=g) + 0.5) / (4.6 * D ** 0.5)
    s2 = (torch.rand(E, D, I // 128, generator=g) + 0.5) / (4.6 * I ** 0.5)
    return {"w13_packed": R.pack_int4(q13), "w13_scale": s13.bfloat16(),
            "w2_packed": R.pack_int4(q2), "w2_scale": s2.bfloat16()}


def _ragged(D=512, I=128, seed=5):
    """38 tokens x top-2 = 76 pairs (PB 128, the wide scan): expert 2 has 33 tokens (3 leader tiles),
    expert 0 five, expert 1 none, expert 3 every token; every 4th token a padding token (ids -1, NaN x)."""
    g = torch.Generator().manual_seed(seed)
    T = 38
    ids = torch.empty(T, 2, dtype=torch.int32)
    ids[:33, 0] = 2
    ids[33:, 0] = 0
    ids[:, 1] = 3
    ids[::4] = -1
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
    inp = _dev(_ragged())
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
    ref = R.fused_moe_w4a16(**{k: v.cpu() for k, v in inp.items()})
    rep = compare(got.cpu(), ref, "bfloat16")
    assert rep, rep.summary()


def test_split1_row_vs_reference_and_broken_output_fails():
    """``mmaq_n32s1x_w2n128`` (w13 32-wide, no split): a repeated expert in a token, id == E and a -1 slot
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
    cfg = _cfg("mmaq_n32s1x_w2n128")
    out = K.fused_moe_w4a16(**inp, config=cfg)
    again = K.fused_moe_w4a16(**inp, config=cfg)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))
    ids_ref = torch.where(ids >= E, torch.full_like(ids, -1), ids)
    ref = R.fused_moe_w4a16(**{**{kk: v.cpu() for kk, v in inp.items()}, "topk_ids": ids_ref})
    rep = compare(out[:5].cpu(), ref[:5], "bfloat16")
    assert rep, rep.summary()
    # the same arithmetic as the 64-wide split-1 row (w13 tiles only change which program owns a column)
    assert torch.equal(out.view(torch.int16), K.fused_moe_w4a16(**inp, config=_cfg("mmaq_n64s1x")).view(torch.int16))
    broken = ids_ref.clone()
    broken[3, 1] = -1
    bad = R.fused_moe_w4a16(**{**{kk: v.cpu() for kk, v in inp.items()}, "topk_ids": broken})
    assert not compare(bad[:5], ref[:5], "bfloat16")
    assert not compare(out[:5].cpu(), bad[:5], "bfloat16")
    xn = inp["x"].clone()
    xn[4, 7] = float("nan")
    o2 = K.fused_moe_w4a16(**{**inp, "x": xn}, config=cfg)
    assert o2[4].isnan().all() and torch.equal(o2[:4].view(torch.int16), out[:4].view(torch.int16))


def test_pick_config_wide_row_is_off_by_default_and_read_per_call(monkeypatch):
    class Dev:
        type = "cuda"
    monkeypatch.setattr(K, "arch_of", lambda d: "sm_89")
    assert K.DECODE_ROW_WIDE is None
    t = K.CONFIGS["sm_89"]
    assert K.pick_config(96, Dev()) is t[K.DECODE_ROW] and K.pick_config(192, Dev()) is t[K.DECODE_ROW]
    monkeypatch.setattr(K, "DECODE_ROW_WIDE", "mmaq_n32s1x_w2n128")
    assert K.pick_config(K.DECODE_WIDE_MIN_PAIRS, Dev()) is t["mmaq_n32s1x_w2n128"]
    assert K.pick_config(192, Dev()) is t["mmaq_n32s1x_w2n128"]
    assert K.pick_config(K.DECODE_WIDE_MIN_PAIRS - 1, Dev()) is t[K.DECODE_ROW]
    assert K.pick_config(6, Dev()) is t[K.DECODE_ROW_NARROW]
    assert K.pick_config(K.DECODE_MAX_PAIRS + 1, Dev()) is t["prefill"]
    for label in ROWS:
        assert t[label]["path"] == "decode" and K.CONFIGS["sm_90"][label] == t[label]
