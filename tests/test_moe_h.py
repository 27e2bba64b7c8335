"""W4A16 MoE decode, ``"h": "w2"`` (issue 20, moeh): the w13 launch stores its split-K partials only (no
ticket tail) and each w2 leader forms h from them before its K loop. Same arithmetic in the same order as
the w13 ticket tail, so every output is bit-equal to the row of the same tiles without ``"h"`` (the GPU's
check: scripts/gpu/moe.sh with ``MOE_BITEQ``); on the interpreter here, on the adversarial cases: padding
rows with NaN x, ids -1 and >= E, an expert twice in one token, a NaN/inf x row kept in its row, values
that hit the SwiGLU clamp, T = 1, 2, 4 and 38 (many pairs of one expert in one tile: the per-row loop),
2, 4 and 8 K splits, w2 tiles of 64 and 128 columns, accumulate on and off, NaN-filled workspaces, the
ticket counters left zero."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.reference import moe as R
from ds4lab_kernels import moe_w4a16 as K
from test_moe import MMAQ, _dev, _ragged, _weights

pytestmark = pytest.mark.interp

# the tiles of the interpreter-sized mmaq row (D=256: 2 splits), with and without the tail-less hand-off
BASE = dict(MMAQ)
HW2 = dict(MMAQ, h="w2")


def _inputs(T, E=8, k=6, D=256, seed=0, case="random"):
    w = _weights(E=E, D=D, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    tw = (torch.rand(T, k, generator=g) + 0.1).float()
    if case == "adversarial":
        ids[0, 1] = ids[0, 0]                   # one expert twice in a token
        if T > 1:
            ids[1, 2] = E                       # id == E: skipped
            ids[1, 4] = E + 7
        ids[-1, 0] = -1                         # padding slot
        x[0, 3] = float("nan")                  # a NaN row stays in its row
        if T > 2:
            ids[2] = -1                         # a padding token (all ids -1) with a NaN x row
            x[2] = float("nan")
        if T > 3:
            x[3] *= 8                           # pre-activations past the clamp at 10
    return {"x": x, **w, "topk_weights": tw, "topk_ids": ids}


def _ws(cfg, T, k, D, I, fill=float("nan")):
    P = T * k
    splits = cfg["SPLIT_K"]
    while splits > 1 and D % (splits * 128):
        splits //= 2
    nb1, nb2 = I // min(cfg["BLOCK_N"], I), D // min(cfg["BLOCK_N2"], D)
    return {"h": torch.full((P, I), fill, dtype=torch.float16, device=DEVICE),
            "y": torch.full((P, D), fill, device=DEVICE),
            "part": torch.full((splits, P, 2 * I), fill, device=DEVICE),
            "xs": torch.full((T, D), fill, dtype=torch.bfloat16, device=DEVICE),
            "counters": torch.zeros(P * nb1 + nb2, dtype=torch.int32, device=DEVICE)}


def _run(inp, cfg, accumulate=False, out0=None, ws=None):
    out = out0.clone() if accumulate else None
    return K.fused_moe_w4a16(**inp, config=cfg, out=out, accumulate=accumulate, workspace=ws)


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("T,k,accumulate", [(1, 6, True), (2, 6, False), (4, 5, True)])
def test_h_in_w2_is_bit_equal_to_the_ticket_tail(T, k, accumulate):
    """T x top-k pairs over 8 experts (T=2: the 12 pairs of batch-1 MTP; T=4: 20 pairs, the 128-id scan,
    experts repeated across tokens: several rows per leader tile, the per-row h loop), the adversarial
    ids and x rows, NaN workspaces; the counters stay zero; the h the w2 launch formed equals the h the
    ticket tail stored (plane order), row for row of the valid pairs."""
    inp = _dev(_inputs(T, k=k, case="adversarial"))
    g = torch.Generator().manual_seed(T)
    out0 = torch.randn(T, 256, generator=g).float().to(DEVICE) if accumulate else None
    ws_a = _ws(BASE, T, k, 256, 128)
    a = _run(inp, BASE, accumulate, out0, ws_a)
    cfg = dict(HW2, HB=64) if T == 2 else HW2      # HB 64: h formed in 2 steps of 64 columns
    ws = _ws(cfg, T, k, 256, 128)
    b = _run(inp, cfg, accumulate, out0, ws)
    assert torch.equal(_bits(a), _bits(b))
    assert int(ws["counters"].abs().sum()) == 0
    assert b[0].isnan().all()                              # the NaN x row stays in its row
    assert T == 1 or b[1].isfinite().all()
    if T > 2:                                              # the padding token adds nothing
        want = out0[2] if accumulate else torch.zeros_like(b[2])
        assert torch.equal(_bits(b[2]), _bits(want))
    ids = inp["topk_ids"].reshape(-1)
    valid = (ids >= 0) & (ids < 8)
    assert torch.equal(_bits(ws["h"][valid]), _bits(ws_a["h"][valid]))
    assert ws["h"][~valid].isnan().all()                   # skipped pairs: h never written


@pytest.mark.parametrize("D,split,bn2,T,k", [(512, 4, 64, 1, 6), (1024, 8, 128, 1, 3)])
def test_h_in_w2_more_splits_and_wide_w2_tiles(D, split, bn2, T, k):
    """4 and 8 K splits really run (the rows mmaq_n64s4xh / n64s8xh at test size) and w2 tiles of 128
    columns (mmaq_n64s4xh_w2n128), clamp-hitting x, accumulate; a second call on the same workspace (a
    graph replay: counters zero, stale partials and h overwritten) gives the same bits."""
    base = dict(BASE, SPLIT_K=split, BLOCK_N=64, BLOCK_N2=bn2)
    cfg = dict(base, h="w2")
    inp = _inputs(T, k=k, D=D, seed=5, case="adversarial")
    inp["x"][-1] *= 8
    inp = _dev(inp)
    out0 = torch.randn(T, D).float().to(DEVICE)
    a = _run(inp, base, True, out0)
    ws = _ws(cfg, T, k, D, 128)
    assert ws["part"].shape[0] == split
    b = _run(inp, cfg, True, out0, ws)
    c = _run(inp, cfg, True, out0, ws)
    assert torch.equal(_bits(a), _bits(b)) and torch.equal(_bits(b), _bits(c))
    assert int(ws["counters"].abs().sum()) == 0


def test_table_rows_are_the_tail_rows_plus_h():
    """The moeh rows differ from a ticket-tail row only by ``"h": "w2"`` (and the w2 tile width)."""
    t = K.CONFIGS["sm_89"]
    for new, old, diff in (("mmaq_n64s4xh", "mmaq_n64s4x", {}), ("mmaq_n64s8xh", "mmaq_n64s8x", {}),
                           ("mmaq_n64s4xh_w2n128", "mmaq_n64s4x", {"BLOCK_N2": 128})):
        assert t[new] == {**t[old], "h": "w2", **diff}, new
