"""Paged indexer logits + top-k in one launch (``indexer.fp8_paged_mqa_topk``): the same indices, in
the same order, as the two-launch path (``fp8_paged_mqa_logits`` then ``topk.topk_indices``) and the
torch reference; several programs per request (block 64, N = 300..1100) so the ticket decides who
selects; the arrival counters are zero after every call; bad arguments name themselves."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare_topk
from ds4lab.harness.specs.indexer import BLOCK_BYTES, make_paged_inputs
from ds4lab.reference import indexer as ref
from ds4lab.reference.topk import topk_indices as rtopk
from ds4lab_kernels._counters import left_nonzero
from ds4lab_kernels import indexer as K
from ds4lab_kernels.topk import topk_indices

pytestmark = pytest.mark.interp
D, BS = 128, 64
# one block per program on the interpreter (TILES 1: N=1100 is 18 programs per request), and two
T1 = {"TILES": 1, "SEL_BLOCK": 1024, "num_warps": 4, "num_stages": 3}
T2 = {"TILES": 2, "SEL_BLOCK": 256, "num_warps": 4, "num_stages": 3}


def _offsets(B, nn, ctx, device=DEVICE):
    return ((torch.arange(B * nn, dtype=torch.int32) // nn) * ctx + 5).to(device)


def _two_launch(inp, k, offsets):
    """The decode step's path before the fused kernel (backend_kernel.indexer_topk): logits, then
    top-k over each row's limit (``context_lens`` unclamped, as the step passes them)."""
    lg = K.fp8_paged_mqa_logits(**inp)
    nn = inp["q"].shape[1]
    lim = ref.paged_row_limits(inp["context_lens"].cpu(), nn).to(torch.int32).to(lg.device)
    return topk_indices(lg, k, lengths=lim, offsets=offsets), lg


def _arrivals_left():
    return left_nonzero("indexer.paged_topk")


@pytest.mark.parametrize("B,nn,ctx,k,cfg", [
    (1, 1, 300, 64, T1), (2, 2, 1100, 512, T1), (3, 1, 700, 256, T2), (4, 1, 520, 512, T1), (1, 2, 900, 100, T2),
])
def test_matches_two_launch_path_and_reference(B, nn, ctx, k, cfg):
    inp = make_paged_inputs({"B": B, "next_n": nn, "ctx": ctx}, "decode", 3, DEVICE)
    off = _offsets(B, nn, ctx)
    want, lg = _two_launch(inp, k, off)
    ws = torch.full_like(lg, 7.0)
    got = K.fp8_paged_mqa_topk(**inp, k=k, offsets=off, logits=ws, config=cfg)
    assert torch.equal(got.cpu(), want.cpu())
    assert torch.equal(ws.cpu(), lg.cpu())                 # the workspace holds the paged logits' bits
    assert _arrivals_left() == 0
    again = K.fp8_paged_mqa_topk(**inp, k=k, offsets=off, config=cfg)   # the counter started clean
    assert torch.equal(again.cpu(), want.cpu())
    # the torch reference on the kernel's own logits (fp32 accumulation vs fp64: the index set is
    # the reference's wherever no two logits are within rounding of each other at the k-th place)
    r = ref.fp8_paged_mqa_topk(**inp, k=k, offsets=off.cpu())
    lim = ref.paged_row_limits(inp["context_lens"].cpu(), nn).clamp(0, ctx)
    loc = torch.where(got.cpu() >= 0, got.cpu() - off.cpu()[:, None], got.cpu())
    assert compare_topk(loc, ref.fp8_paged_mqa_logits(**inp), k, lim)
    assert (got.cpu() >= 0).sum() == (r >= 0).sum()


def _exact_inputs(B, nn, ctx, case, seed=0):
    """Inputs whose logits are exact in fp32 (small-integer q and k, power-of-two weights and
    scales), so kernel, two-launch path and fp64 reference must agree index for index."""
    inp = make_paged_inputs({"B": B, "next_n": nn, "ctx": ctx}, "decode", seed, DEVICE)
    g = torch.Generator().manual_seed(seed)
    H = inp["q"].shape[2]
    q = torch.randint(0, 3, (B, nn, H, D), generator=g).float()
    inp["q"] = q.to(torch.float8_e4m3fn).to(DEVICE)
    inp["weights"] = torch.full((B * nn, H), 2.0 ** -6, device=DEVICE)
    cache = inp["kv_cache"]
    nb = cache.shape[0]
    store = torch.as_strided(cache, (nb, BLOCK_BYTES), (BLOCK_BYTES, 1))
    if case == "all_equal":            # every key the same: every logit ties
        vals = torch.ones(nb, BS * D)
    else:                              # few distinct values: massive ties at the k-th place
        vals = torch.randint(0, 3, (nb, BS * D), generator=g).float()
    store[:, :BS * D] = vals.to(torch.float8_e4m3fn).view(torch.uint8).to(store.device)
    store[:, BS * D:BS * (D + 4)] = torch.full((nb, BS), 2.0 ** -3).view(torch.uint8).reshape(nb, -1).to(store.device)
    return inp


@pytest.mark.parametrize("case", ["all_equal", "integer_ties"])
@pytest.mark.parametrize("B,nn,ctx,k", [(2, 1, 1100, 512), (2, 2, 640, 300), (3, 1, 333, 64)])
def test_ties_lower_index_wins_exactly_as_reference(case, B, nn, ctx, k):
    inp = _exact_inputs(B, nn, ctx, case)
    off = _offsets(B, nn, ctx)
    got = K.fp8_paged_mqa_topk(**inp, k=k, offsets=off, config=T1)
    want, lg = _two_launch(inp, k, off)
    r = ref.fp8_paged_mqa_topk(**inp, k=k, offsets=off.cpu())
    assert torch.equal(lg.cpu(), ref.fp8_paged_mqa_logits(**inp))      # exact logits: exact indices
    assert torch.equal(got.cpu(), want.cpu()) and torch.equal(got.cpu(), r)
    if case == "all_equal":            # all tie: the lowest k indices of each row's valid range
        lim = ref.paged_row_limits(inp["context_lens"].cpu(), nn)
        for row in range(B * nn):
            n = min(k, int(lim[row]))
            assert torch.equal(got[row, :n].cpu(), torch.arange(n, dtype=torch.int32) + off[row].cpu())
            assert (got[row, n:] == -1).all()
    assert _arrivals_left() == 0


def test_short_rows_zero_rows_limits_shorter_than_table_and_past_it():
    """N < k (every valid entry, then -1), rows with limit 0 (all -1), a limit shorter than the
    block table, a limit past what the table can address (clamped, as the pair's -inf logits do),
    negative limits; the 1-D DeepGEMM context_lens convention."""
    B, nn, ctx, k = 4, 2, 700, 512
    inp = make_paged_inputs({"B": B, "next_n": nn, "ctx": ctx}, "decode", 5, DEVICE)
    cl = torch.tensor([[0, 1], [130, 131], [-3, 0], [700, 700]], dtype=torch.int32)
    inp["context_lens"] = cl.to(DEVICE)
    bt = inp["block_table"].clone()
    inp["block_table"] = bt[:, :10].contiguous()          # 10 blocks = 640 < 700: row limits past it
    off = _offsets(B, nn, ctx)
    want, _ = _two_launch(inp, k, off)
    got = K.fp8_paged_mqa_topk(**inp, k=k, offsets=off, config=T1)
    assert torch.equal(got.cpu(), want.cpu())
    assert (got[0, :].cpu() == -1).all() and got[1, 0] == off[1] and (got[1, 1:].cpu() == -1).all()
    assert (got[4:6].cpu() == -1).all()
    assert (got[2, 130:].cpu() == -1).all() and (got[2, :130].cpu() >= 0).all()
    assert int((got[6] >= 0).sum()) == 512 and int(got[6].max()) < 640 + int(off[6])
    # no offsets: local indices
    loc = K.fp8_paged_mqa_topk(**inp, k=k, config=T2)
    assert torch.equal(loc.cpu(), torch.where(want.cpu() >= 0, want.cpu() - off.cpu()[:, None], want.cpu()))
    inp1 = dict(inp, context_lens=inp["context_lens"][:, 1].contiguous())   # 1-D: row i sees ctx - 1 + i
    w1, _ = _two_launch(inp1, k, off)
    assert torch.equal(K.fp8_paged_mqa_topk(**inp1, k=k, offsets=off, config=T1).cpu(), w1.cpu())
    assert _arrivals_left() == 0


def test_nan_and_inf_logits_follow_the_reference_policy():
    """A bad block id gives NaN logits (never selected, as NaN counts as -inf); +inf logits (fp32
    overflow of huge scales) are selectable and rank first."""
    B, nn, ctx, k = 2, 1, 400, 256
    inp = make_paged_inputs({"B": B, "next_n": nn, "ctx": ctx}, "decode", 9, DEVICE)
    inp["context_lens"] = torch.tensor([[400], [400]], dtype=torch.int32, device=DEVICE)
    inp["block_table"][0, 2] = 10_000                       # entries 128..191 of request 0: NaN
    cache = inp["kv_cache"]
    store = torch.as_strided(cache, (cache.shape[0], BLOCK_BYTES), (BLOCK_BYTES, 1))
    blk = int(inp["block_table"][1, 1])
    sc = torch.full((BS,), 2.0 ** -6)
    sc[::5] = 3.0e38                                         # overflow to +-inf (or a NaN from 0 * inf)
    store[blk, BS * D:BS * (D + 4)] = sc.view(torch.uint8).to(store.device)
    off = _offsets(B, nn, ctx)
    want, lg = _two_launch(inp, k, off)
    assert torch.isnan(lg[0, 128:192]).all() and torch.isinf(lg[1]).any()
    got = K.fp8_paged_mqa_topk(**inp, k=k, offsets=off, config=T1)
    assert torch.equal(got.cpu(), want.cpu())
    lr = rtopk(lg.cpu(), k, torch.tensor([400, 400], dtype=torch.int32))
    assert torch.equal(torch.where(got.cpu() >= 0, got.cpu() - off.cpu()[:, None], got.cpu()), lr)
    sel0 = got[0][got[0] >= 0].cpu() - off[0].cpu()
    assert not ((sel0 >= 128) & (sel0 < 192)).any()


def test_empty_batch_and_zero_width():
    inp = make_paged_inputs({"B": 2, "next_n": 1, "ctx": 100}, "decode", 1, DEVICE)
    out = K.fp8_paged_mqa_topk(**dict(inp, max_context_len=0), k=16)     # N = 0: every slot -1
    assert out.shape == (2, 16) and (out.cpu() == -1).all()
    e = K.fp8_paged_mqa_topk(inp["q"][:0], inp["kv_cache"], inp["weights"][:0], inp["context_lens"][:0],
                             inp["block_table"][:0], 100, k=16)
    assert e.shape == (0, 16)
    assert _arrivals_left() == 0


def test_own_arrivals_buffer_left_zero_and_out_buffer_used():
    inp = make_paged_inputs({"B": 2, "next_n": 2, "ctx": 500}, "decode", 2, DEVICE)
    arr = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    out = torch.full((4, 128), -7, dtype=torch.int32, device=DEVICE)
    got = K.fp8_paged_mqa_topk(**inp, k=128, out=out, arrivals=arr, config=T1)
    assert got.data_ptr() == out.data_ptr() and (arr.cpu() == 0).all()
    assert torch.equal(got.cpu(), _two_launch(inp, 128, None)[0].cpu())


def _args():
    inp = make_paged_inputs({"B": 2, "next_n": 1, "ctx": 100}, "decode", 0, "cpu")
    return dict(inp, k=16)


@pytest.mark.parametrize("patch,exc,match", [
    ({"k": 0}, ValueError, "k=0"),
    ({"k": 5000}, ValueError, "k=5000"),
    ({"offsets": torch.zeros(2, dtype=torch.int64)}, TypeError, "offsets"),
    ({"offsets": torch.zeros(3, dtype=torch.int32)}, ValueError, "offsets: shape"),
    ({"out": torch.zeros(2, 8, dtype=torch.int32)}, ValueError, "out: expected int32"),
    ({"logits": torch.zeros(2, 99)}, ValueError, "logits: expected float32"),
    ({"arrivals": torch.zeros(1, dtype=torch.int32)}, ValueError, "arrivals"),
    ({"arrivals": torch.zeros(4, dtype=torch.int64)}, TypeError, "arrivals"),
    ({"max_context_len": -1}, ValueError, "max_context_len"),
    ({"weights": torch.zeros(3, 64)}, ValueError, "weights: shape"),
    ({"context_lens": torch.zeros(2, 2, dtype=torch.int32)}, ValueError, "context_lens"),
    ({"block_table": torch.zeros(2, 2, dtype=torch.int64)}, TypeError, "block_table"),
    ({"q": torch.zeros(2, 3, 64, D).to(torch.float8_e4m3fn)}, ValueError, "next_n=3"),
])
def test_bad_inputs(patch, exc, match):
    with pytest.raises(exc, match=match):
        K.fp8_paged_mqa_topk(**{**_args(), **patch})


def test_backend_decode_uses_one_launch_up_to_the_bound(monkeypatch):
    """KernelBackend.indexer_topk: decode (next_n given) up to INDEXER_FUSED_MAX_N (GPU; _INTERP on the
    interpreter) compressed positions runs fp8_paged_mqa_topk (kind K_INDEXER_TOPK_FUSED), the same slots as the pair."""
    from ds4lab.model import backend_kernel as BK
    be = BK.KernelBackend()
    calls = []

    class Mod:
        def __init__(self, mod):
            self._m = mod

        def __getattr__(self, n):
            f = getattr(self._m, n)
            if n in ("fp8_paged_mqa_topk", "fp8_paged_mqa_logits"):
                return lambda *a, **kw: calls.append(n) or f(*a, **kw)
            return f
    be.k["idx"] = Mod(K)
    B, nn, ctx = 2, 2, 300
    inp = make_paged_inputs({"B": B, "next_n": nn, "ctx": ctx}, "decode", 4, DEVICE)
    q = inp["q"].reshape(B * nn, 64, D)
    req = torch.arange(B).repeat_interleave(nn).to(DEVICE)
    lim = inp["context_lens"].reshape(-1)
    base = (req * ctx).to(torch.int32)
    key = "INDEXER_FUSED_MAX_N" if q.is_cuda else "INDEXER_FUSED_MAX_N_INTERP"
    monkeypatch.setattr(BK, key, 8192)                         # ctx 32k (N = 8,192) takes the one launch
    a = be.indexer_topk(q, inp["weights"], inp["kv_cache"], inp["block_table"], req, lim, ctx, 128, "t",
                        next_n=nn, slot_base=base)
    monkeypatch.setattr(BK, key, ctx - 1)
    b = be.indexer_topk(q, inp["weights"], inp["kv_cache"], inp["block_table"], req, lim, ctx, 128, "t",
                        next_n=nn, slot_base=base)
    assert calls == ["fp8_paged_mqa_topk", "fp8_paged_mqa_logits"], calls
    assert torch.equal(a.cpu(), b.cpu())
    assert BK.K_INDEXER_TOPK_FUSED == "kernel:indexer.fp8_paged_mqa_topk"
