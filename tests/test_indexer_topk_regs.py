"""The top-k select on registers (NOTES.md "idx10", "idx10c", "idx10w"): ``topk.select_topk_regs_loop`` (the
radix levels one runtime loop) behind the one-launch indexer rows ``CONFIGS["paged_topk"]`` with ``SEL_ROW``
(the sm_89 default ``p2r2048h11b6cw``: the first radix level from the logits programs' histograms,
``H0_BITS``, and ``SEL_WARM``: one extra program runs the select's one call site at launch on throw-away data,
a code warmer) and behind ``topk_indices``' ``ROW`` row. Every row returns the two-launch path's indices
(``fp8_paged_mqa_logits`` + the streaming ``topk_indices``) element for element, and the fp64 reference's
where the logits are exact: ties (the lower index wins), all-equal rows, NaN / +-inf, fewer valid entries
than k, limit 0, next_n 2, rows longer than ``SEL_ROW`` (the streaming fallback in the same launch);
counters, histograms and the warmer's scratch are zero after every call and a second call is equal. The
warmer alone touches neither the outputs nor the real histograms, leaves its scratch zero, survives a
garbage scratch histogram, and a short arrivals buffer is refused by name. (The unrolled and non-warm loop
rows were removed after idx10w was measured; their tests went with them: git history.)"""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.specs import topk as topk_spec
from ds4lab.harness.specs.indexer import make_paged_inputs
from ds4lab.reference import indexer as ref
from ds4lab.reference.topk import topk_indices as rtopk
from ds4lab_kernels import indexer as K
from ds4lab_kernels import topk as TK
from ds4lab_kernels.topk import topk_indices
from test_indexer_topk import _arrivals_left, _exact_inputs, _offsets, _two_launch

pytestmark = pytest.mark.interp
ROWS = {lb: c for lb, c in K.CONFIGS["paged_topk"]["sm_89"].items() if c.get("SEL_ROW")}
# the table rows as they are (2,048 entries on registers: every test row takes the register path), and
# shrunk to 256 entries with 2 blocks per program (the rows longer than that take the streaming select)
CASES = [(lb, c) for lb, c in ROWS.items()] + [(lb + "-row256", dict(c, SEL_ROW=256, TILES=2)) for lb, c in ROWS.items()]
IDS = [lb for lb, _ in CASES]
WARM = {lb: c for lb, c in ROWS.items() if c.get("SEL_WARM")}


def test_the_table_register_rows_are_the_warm_loop_select_with_the_logits_histogram():
    assert ROWS and WARM == ROWS
    for c in ROWS.values():
        assert c["num_warps"] == 4 and c["SEL_ROW"] == 2048   # the logits' bits need the paged rows' 4 warps
        assert c.get("SEL_LOOP") and c.get("H0_BITS") and c.get("SEL_WARM")
        assert {k: c[k] for k in ("SEL_ROW", "SEL_BITS")} == {"SEL_ROW": REG_TOPK["ROW"], "SEL_BITS": REG_TOPK["BITS"]}
    assert K.PAGED_TOPK_DEFAULT["sm_89"] in ROWS


@pytest.mark.parametrize("lb,cfg", CASES, ids=IDS)
@pytest.mark.parametrize("B,nn,ctx,k", [(1, 1, 300, 64), (2, 2, 1100, 512), (3, 1, 700, 256), (1, 2, 900, 100)])
def test_matches_two_launch_path(lb, cfg, B, nn, ctx, k):
    inp = make_paged_inputs({"B": B, "next_n": nn, "ctx": ctx}, "decode", 3, DEVICE)
    off = _offsets(B, nn, ctx)
    want, lg = _two_launch(inp, k, off)
    ws = torch.full_like(lg, 7.0)
    got = K.fp8_paged_mqa_topk(**inp, k=k, offsets=off, logits=ws, config=cfg)
    assert torch.equal(got.cpu(), want.cpu())
    assert torch.equal(ws.cpu(), lg.cpu())                 # the logits keep their bits
    assert _arrivals_left() == 0                            # counters and histograms re-zeroed
    again = K.fp8_paged_mqa_topk(**inp, k=k, offsets=off, config=cfg)
    assert torch.equal(again.cpu(), want.cpu())


@pytest.mark.parametrize("lb,cfg", CASES, ids=IDS)
@pytest.mark.parametrize("case", ["all_equal", "integer_ties"])
def test_ties_lower_index_wins_exactly_as_reference(lb, cfg, case):
    B, nn, ctx, k = 2, 2, 640, 300
    inp = _exact_inputs(B, nn, ctx, case)
    off = _offsets(B, nn, ctx)
    guard = torch.full((B * nn, k + 8), -7, dtype=torch.int32, device=DEVICE)   # a slot written past k shows
    got = K.fp8_paged_mqa_topk(**inp, k=k, offsets=off, config=cfg, out=guard[:, :k])
    assert (guard[:, k:].cpu() == -7).all()
    want, lg = _two_launch(inp, k, off)
    assert torch.equal(lg.cpu(), ref.fp8_paged_mqa_logits(**inp))      # exact logits: exact indices
    assert torch.equal(got.cpu(), want.cpu())
    assert torch.equal(got.cpu(), ref.fp8_paged_mqa_topk(**inp, k=k, offsets=off.cpu()))
    assert _arrivals_left() == 0


@pytest.mark.parametrize("lb,cfg", CASES, ids=IDS)
def test_short_rows_zero_rows_and_limits_past_the_table(lb, cfg):
    """N < k, limit 0 and negative limits (all -1), a limit past what the block table addresses, the
    1-D context_lens convention; no offsets (local indices)."""
    B, nn, ctx, k = 4, 2, 700, 512
    inp = make_paged_inputs({"B": B, "next_n": nn, "ctx": ctx}, "decode", 5, DEVICE)
    inp["context_lens"] = torch.tensor([[0, 1], [130, 131], [-3, 0], [700, 700]], dtype=torch.int32).to(DEVICE)
    inp["block_table"] = inp["block_table"][:, :10].contiguous()          # 640 entries addressable
    off = _offsets(B, nn, ctx)
    want, _ = _two_launch(inp, k, off)
    got = K.fp8_paged_mqa_topk(**inp, k=k, offsets=off, config=cfg)
    assert torch.equal(got.cpu(), want.cpu())
    assert (got[0].cpu() == -1).all() and got[1, 0] == off[1] and (got[1, 1:].cpu() == -1).all()
    assert (got[4:6].cpu() == -1).all() and int((got[6] >= 0).sum()) == 512
    loc = K.fp8_paged_mqa_topk(**inp, k=k, config=cfg)
    assert torch.equal(loc.cpu(), torch.where(want.cpu() >= 0, want.cpu() - off.cpu()[:, None], want.cpu()))
    inp1 = dict(inp, context_lens=inp["context_lens"][:, 1].contiguous())
    assert torch.equal(K.fp8_paged_mqa_topk(**inp1, k=k, offsets=off, config=cfg).cpu(), _two_launch(inp1, k, off)[0].cpu())
    assert _arrivals_left() == 0


@pytest.mark.parametrize("lb,cfg", CASES, ids=IDS)
def test_nan_and_inf_logits(lb, cfg):
    """NaN logits (a bad block id) are never selected and never counted into a histogram; +inf
    (and -inf, NaN from 0 * inf) from huge scales rank as the streaming select ranks them."""
    B, nn, ctx, k = 2, 1, 400, 256
    inp = make_paged_inputs({"B": B, "next_n": nn, "ctx": ctx}, "decode", 9, DEVICE)
    inp["context_lens"] = torch.tensor([[400], [400]], dtype=torch.int32, device=DEVICE)
    inp["block_table"][0, 2] = 10_000
    cache = inp["kv_cache"]
    from ds4lab.harness.specs.indexer import BLOCK_BYTES
    store = torch.as_strided(cache, (cache.shape[0], BLOCK_BYTES), (BLOCK_BYTES, 1))
    sc = torch.full((64,), 2.0 ** -6)
    sc[::5] = 3.0e38
    store[int(inp["block_table"][1, 1]), 64 * 128:64 * 132] = sc.view(torch.uint8).to(store.device)
    off = _offsets(B, nn, ctx)
    want, lg = _two_launch(inp, k, off)
    assert torch.isnan(lg[0, 128:192]).all() and torch.isinf(lg[1]).any()
    got = K.fp8_paged_mqa_topk(**inp, k=k, offsets=off, config=cfg)
    assert torch.equal(got.cpu(), want.cpu())
    lr = rtopk(lg.cpu(), k, torch.tensor([400, 400], dtype=torch.int32))
    assert torch.equal(torch.where(got.cpu() >= 0, got.cpu() - off.cpu()[:, None], got.cpu()), lr)
    assert _arrivals_left() == 0


def test_histograms_live_in_the_arrivals_buffer_after_the_counters():
    """H0 rows (warm) need ``paged_topk_h0_base(B)``, the warmer's ``max(next_pow2(k), SEL_ROW)`` output
    scratch and ``2^H0_BITS``-bin histogram, then ``B * next_n * 2^H0_BITS`` int32 of ``arrivals``: a shorter
    buffer is refused by name, one of that size is used and left zero; N = 0 and B = 0 work."""
    lb, cfg = next((lb, c) for lb, c in ROWS.items() if c.get("H0_BITS"))
    B, nn = 3, 2
    inp = make_paged_inputs({"B": B, "next_n": nn, "ctx": 500}, "decode", 2, DEVICE)
    need = K.paged_topk_h0_base(B) + max(128, cfg["SEL_ROW"]) + (1 + B * nn) * (1 << cfg["H0_BITS"])
    assert K.paged_topk_arrivals_need(B, nn, 128, cfg)[0] == need
    assert K.paged_topk_h0_base(B) == 32 and K.paged_topk_h0_base(33) == 64 and K.paged_topk_h0_base(0) == 0
    with pytest.raises(ValueError, match=rf"arrivals: {need - 1} contiguous int32, need >= {need}"):
        K.fp8_paged_mqa_topk(**inp, k=128, arrivals=torch.zeros(need - 1, dtype=torch.int32, device=DEVICE),
                             config=cfg)
    arr = torch.zeros(need, dtype=torch.int32, device=DEVICE)
    got = K.fp8_paged_mqa_topk(**inp, k=128, arrivals=arr, config=cfg)
    assert (arr.cpu() == 0).all()
    assert torch.equal(got.cpu(), _two_launch(inp, 128, None)[0].cpu())
    out = K.fp8_paged_mqa_topk(**dict(inp, max_context_len=0), k=16, config=cfg)
    assert out.shape == (B * nn, 16) and (out.cpu() == -1).all()
    e = K.fp8_paged_mqa_topk(inp["q"][:0], inp["kv_cache"], inp["weights"][:0], inp["context_lens"][:0],
                             inp["block_table"][:0], 500, k=16, config=cfg)
    assert e.shape == (0, 16) and _arrivals_left() == 0


# ---- the code-warming rows (SEL_WARM, NOTES.md "idx10w") ---------------------------------------------
class _WarmerOnly:
    """Stands in for ``indexer._fp8_paged_mqa_topk_kernel``: launches the real kernel on grid ``(1,)``, i.e.
    the code warmer (program 0) alone."""

    def __init__(self, real):
        self.real = real

    def __getitem__(self, grid):
        assert len(grid) == 1 and grid[0] > 1      # the warm rows' 1-D grid: the warmer + the logits programs
        return self.real[(1,)]


@pytest.mark.parametrize("garbage", [False, True], ids=["zero", "garbage-hist"])
@pytest.mark.parametrize("nn", [1, 2])
@pytest.mark.parametrize("lb", list(WARM))
def test_the_warmer_alone_touches_only_its_scratch(lb, nn, garbage, monkeypatch):
    """The warmer selects from row 0 of the workspace (distinct values, NaN / +-inf among them) into its own
    scratch and leaves that zero: the outputs (a sentinel), the counters and the rows' histograms (a pattern)
    are untouched. ``garbage``: its scratch histogram holds arbitrary counts (a broken zero contract): the
    descent still ends (each level lowers the shift) and writes nowhere else."""
    cfg = WARM[lb]
    B, ctx, k = 2, 700, 256
    inp = make_paged_inputs({"B": B, "next_n": nn, "ctx": ctx}, "decode", 4, DEVICE)
    M = B * nn
    n, what = K.paged_topk_arrivals_need(B, nn, k, cfg)
    base = K.paged_topk_h0_base(B)
    wz = max(k, cfg["SEL_ROW"])
    wh = (1 << cfg["H0_BITS"]) if cfg.get("H0_BITS") else 0
    assert n == base + wz + wh + (M * wh) and "warmer scratch" in what
    g = torch.Generator().manual_seed(nn)
    arr = torch.zeros(n + 64, dtype=torch.int32)
    arr[base + wz + wh:] = torch.randint(1, 1000, (n + 64 - base - wz - wh,), generator=g, dtype=torch.int32)
    if garbage:
        if not wh:
            pytest.skip("no scratch histogram without H0_BITS")
        arr[base + wz: base + wz + wh] = torch.randint(0, 300, (wh,), generator=g, dtype=torch.int32)
    want_arr = arr.clone()
    want_arr[base: base + wz + wh] = 0
    arr = arr.to(DEVICE)
    ws = torch.randn(M, ctx, generator=g)
    ws[0, ::7] = float("nan")
    ws[0, 3::11] = float("inf")
    ws[0, 5::13] = float("-inf")
    ws = ws.to(DEVICE)
    ws0 = ws.clone()
    out = torch.full((M, k), -7, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(K, "_fp8_paged_mqa_topk_kernel", _WarmerOnly(K._fp8_paged_mqa_topk_kernel))
    K.fp8_paged_mqa_topk(**inp, k=k, offsets=_offsets(B, nn, ctx), out=out, logits=ws, arrivals=arr, config=cfg)
    assert (out.cpu() == -7).all()                    # no output written
    assert torch.equal(ws.cpu().view(torch.int32), ws0.cpu().view(torch.int32))   # the workspace only read
    assert torch.equal(arr.cpu(), want_arr)            # counters 0, rows' histograms kept, its scratch re-zeroed


@pytest.mark.parametrize("lb", list(WARM))
def test_warm_rows_refuse_a_short_arrivals_buffer_and_leave_it_zero(lb):
    cfg = WARM[lb]
    B, nn, k = 3, 2, 512
    inp = make_paged_inputs({"B": B, "next_n": nn, "ctx": 500}, "decode", 2, DEVICE)
    need, _ = K.paged_topk_arrivals_need(B, nn, k, cfg)
    with pytest.raises(ValueError, match=rf"arrivals: {need - 1} contiguous int32, need >= {need}: .*warmer scratch"):
        K.fp8_paged_mqa_topk(**inp, k=k, arrivals=torch.zeros(need - 1, dtype=torch.int32, device=DEVICE),
                             config=cfg)
    arr = torch.zeros(need, dtype=torch.int32, device=DEVICE)
    got = K.fp8_paged_mqa_topk(**inp, k=k, arrivals=arr, config=cfg)
    assert (arr.cpu() == 0).all()
    assert torch.equal(got.cpu(), _two_launch(inp, k, None)[0].cpu())
    with pytest.raises(ValueError, match="config SEL_WARM: needs SEL_ROW and SEL_LOOP"):
        K.fp8_paged_mqa_topk(**inp, k=k, config=dict(cfg, SEL_LOOP=False))
    for patch in ({"SEL_WARM": False}, {"SEL_WARM": False, "SEL_ROW": 0, "H0_BITS": 0}):   # the removed layouts
        with pytest.raises(ValueError, match="config SEL_ROW/SEL_LOOP/H0_BITS: need SEL_WARM"):
            K.fp8_paged_mqa_topk(**inp, k=k, config=dict(cfg, **patch))


# ---- topk_indices' register row and the select's digit widths ----------------------------------------
REG_TOPK = TK.CONFIGS["sm_89"]["b1024r2048c"]


@pytest.mark.parametrize("case", topk_spec.CASES)
def test_topk_register_row_equals_reference_on_every_case(case):
    """The registry sweep runs b1024r2048c on its random case only: every adversarial case here, index
    for index against the reference (N 2,000 on registers; 300 as well)."""
    for shape in ({"R": 4, "N": 2000, "k": 512}, {"R": 3, "N": 300, "k": 64}):
        inp = topk_spec.make_inputs(shape, case, 11, DEVICE)
        got = topk_indices(inp["logits"], inp["k"], lengths=inp.get("lengths"), config=REG_TOPK)
        assert torch.equal(got.cpu(), rtopk(inp["logits"].cpu(), inp["k"], inp["lengths"].cpu() if
                                            inp.get("lengths") is not None else None)), case


def _rows(N):
    """Rows that stop the radix at every depth: random scores (the k-th entry's bin shared or not),
    a plateau of equal scores across the k-th place, scores equal in their top bits only, few distinct
    values, -0.0 / +0.0, NaN / -inf / +inf, all one value."""
    g = torch.Generator().manual_seed(N)
    x = torch.randn(8, N, generator=g)
    x[1, N // 4: 3 * N // 4] = 0.5
    x[2] = 1.0 + torch.randint(0, 8, (N,), generator=g) * 2.0 ** -20        # differ in the last key bits
    x[3] = torch.randint(-2, 3, (N,), generator=g).float()
    x[4, ::3] = -0.0
    x[4, 1::3] = 0.0
    x[5, ::7] = float("nan")
    x[5, 3::11] = float("-inf")
    x[5, 5::13] = float("inf")
    x[6] = -2.5
    x[7] = torch.randn(N, generator=g) * 1e-30
    return x


@pytest.mark.parametrize("bits", [5, 6, 7, 8])
@pytest.mark.parametrize("N,k,row", [(300, 64, 512), (1000, 512, 1024), (2048, 512, 2048), (700, 100, 256)])
def test_select_on_registers_every_digit_width(bits, N, k, row):
    """The first level and the levels below it at 5-8 bits (the last level what is left of 32: 2, 2, 4, 8
    bits, fewer bins of the loop's fixed 2^bits): equal to the reference for every row kind; row < N: the
    streaming select for the long rows, same result."""
    x = _rows(N).to(DEVICE)
    lens = torch.tensor([N, N - 1, N, N // 2, N, N, N, 1], dtype=torch.int32, device=DEVICE)
    guard = torch.full((8, k + 8), -7, dtype=torch.int32, device=DEVICE)       # a slot written past k shows
    got = topk_indices(x, k, lengths=lens, out=guard[:, :k],
                       config={"BLOCK": 256, "num_warps": 4, "ROW": row, "BITS": bits, "LOOP": True})
    assert torch.equal(got.cpu(), rtopk(x.cpu(), k, lens.cpu()))
    assert (guard[:, k:].cpu() == -7).all()


@pytest.mark.parametrize("patch,match", [({"SEL_ROW": 3000}, "row 3000"), ({"SEL_ROW": 32768}, "row 32768"),
                                         ({"SEL_BITS": 13}, "bits 13"), ({"SEL_BITS": 0}, "bits 0"),
                                         ({"H0_BITS": 13}, "first-level bits 13")])
def test_bad_select_configs_are_refused(patch, match):
    inp = make_paged_inputs({"B": 1, "next_n": 1, "ctx": 100}, "decode", 0, "cpu")
    cfg = dict(next(iter(ROWS.values())), **patch)
    with pytest.raises(ValueError, match=rf"config SEL_ROW/SEL_BITS/H0_BITS: {match}"):
        K.fp8_paged_mqa_topk(**inp, k=16, config=cfg)
    if "SEL_ROW" in patch:
        with pytest.raises(ValueError, match=rf"config ROW/BITS: {match}"):
            topk_indices(torch.zeros(1, 10), 4, config=dict(REG_TOPK, ROW=patch["SEL_ROW"]))


def test_a_register_row_without_the_loop_is_refused():
    """The unrolled register select was removed: ``ROW`` without ``LOOP`` is refused by name."""
    with pytest.raises(ValueError, match="config ROW: needs LOOP"):
        topk_indices(torch.zeros(1, 10), 4, config=dict(REG_TOPK, LOOP=False))
