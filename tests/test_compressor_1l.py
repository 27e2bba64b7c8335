"""compress_decode in ONE launch (the ``<name>_1l`` rows, issue 20 comp1) vs the two-launch pair (state
write, then compress): bit-identical outputs, state rings and fused cache writes on decode steps of
1..8 tokens, one token a request or MTP pairs (``next_n`` 2: consecutive positions of one request, the
second's window holding the first's fresh row), in request order and shuffled (a token's window
holding the row of a token the interpreter runs LATER: only the in-register rows of this launch give
the pair's numbers there), ratio 4 / 128, hd 512 / 128, boundary and non-boundary positions, masked
first windows. The kernel backend picks the row by COMPRESS_ONE_LAUNCH(_INTERP); bad configs are named."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.specs import cache_fused as cf_spec
from ds4lab.harness.specs.compressor import make_step_inputs
from ds4lab_kernels.compressor import CONFIGS, compress_decode, pick_config

pytestmark = pytest.mark.interp

RH = [(4, 512), (128, 512), (4, 128), (128, 128)]


def _clone_t(v):
    """A copy with ``v``'s strides and the bytes between its rows (a padded indexer K cache's gaps)."""
    if v.is_contiguous() or not v.numel():
        return v.clone()
    span = sum((n - 1) * st for n, st in zip(v.shape, v.stride())) + 1
    return torch.as_strided(torch.as_strided(v, (span,), (1,)).clone(), v.shape, v.stride())


def _clone(d):
    return {k: (_clone_t(v) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def _row(ratio, hd, launches):
    return pick_config(ratio, hd, torch.device(DEVICE), launches=launches)


def _bytes(c):
    return torch.as_strided(c, ((c.shape[0] - 1) * c.stride(0) + c[0].numel(),), (1,)).cpu() if c.dim() == 3 \
        else c.cpu()


def _orders(next_n):
    return (False,) if next_n == 1 else (False, True)


CASES = [(r, h, T, nn, sh) for r, h in RH for T in range(1, 9) for nn in (1, 2) for sh in _orders(nn)]


@pytest.mark.parametrize("ratio,hd,T,next_n,shuffle", CASES,
                         ids=[f"c{r}_hd{h}-T{T}-n{nn}{'-shuf' if sh else ''}" for r, h, T, nn, sh in CASES])
def test_one_launch_equals_the_pair(ratio, hd, T, next_n, shuffle):
    d = make_step_inputs({"T": T, "ratio": ratio, "hd": hd, "next_n": next_n, "shuffle": shuffle},
                         seed=100 * T + 10 * next_n + shuffle, device=DEVICE)
    a, b = _clone(d), _clone(d)
    pair = compress_decode(**a, config=_row(ratio, hd, 2))
    one = compress_decode(**b, config=_row(ratio, hd, 1))
    assert torch.equal(one, pair)
    assert torch.equal(b["state"], a["state"])
    assert torch.equal(a["state"][a["state_slots"].long()], b["state"][b["state_slots"].long()])


def test_step_inputs_cover_what_the_brief_asks():
    """The generated steps hold boundary and non-boundary rows, masked first windows and, for next_n 2,
    windows holding rows this launch writes, LATER rows among them once shuffled (rows the interpreter's
    sequential programs have not written yet), and those rows change the answer: the pair run with only
    the token's own row written (the stale ring elsewhere) gives another entry."""
    seen = {"boundary": 0, "off": 0, "masked": 0, "fresh": 0, "later": 0, "differs": 0}
    for T in (2, 5, 8):
        for ratio in (4, 128):
            d = make_step_inputs({"T": T, "ratio": ratio, "hd": 128, "next_n": 2, "shuffle": True},
                                 seed=100 * T + 21, device=DEVICE)
            pos, ss, ws, wv = (d[k].cpu() for k in ("positions", "state_slots", "window_slots", "window_valid"))
            bnd = (pos + 1) % ratio == 0
            seen["boundary"] += int(bnd.sum())
            seen["off"] += int((~bnd).sum())
            seen["masked"] += int((~wv).any(1).sum())
            want = compress_decode(**_clone(d), config=_row(ratio, 128, 1))
            for t in bnd.nonzero().flatten().tolist():
                others = [u for u in range(T) if u != t and bool(((ws[t] == ss[u]) & wv[t]).any())]
                seen["fresh"] += len(others)
                seen["later"] += sum(u > t for u in others)
                if others:
                    stale = _clone(d)
                    stale["state_slots"] = torch.where(torch.arange(T) == t, ss, -1).to(DEVICE)
                    got = compress_decode(**stale, config=_row(ratio, 128, 2))
                    seen["differs"] += not torch.equal(got[t], want[t])
    assert all(v > 0 for v in seen.values()), seen


@pytest.mark.parametrize("ratio,hd", RH, ids=[f"c{r}_hd{h}" for r, h in RH])
@pytest.mark.parametrize("T,next_n,shuffle,skip", [(1, 1, False, False), (2, 2, False, False), (5, 2, True, True),
                                                   (8, 2, True, False), (7, 1, False, True)])
def test_one_launch_cache_write_equals_the_pair(ratio, hd, T, next_n, shuffle, skip):
    """The fused cache-write variant (``cache=``): the same entry bytes, state ring and skipped slots."""
    shape = {"T": T, "ratio": ratio, "hd": hd, "next_n": next_n, "shuffle": shuffle, "num_blocks": max(2, T)}
    d = cf_spec.add_comp_cache(make_step_inputs(shape, seed=7 * T + next_n, device=DEVICE), shape, seed=T,
                               device=DEVICE, skip=skip)
    bnd = ((d["positions"].cpu() + 1) % ratio == 0)
    a, b = _clone(d), _clone(d)
    ca = compress_decode(**a, config=_row(ratio, hd, 2))
    cb = compress_decode(**b, config=_row(ratio, hd, 1))
    assert ca is a["cache"] and cb is b["cache"]
    assert torch.equal(_bytes(cb), _bytes(ca))
    assert torch.equal(b["state"], a["state"])
    n_slots = d["cache"].shape[0] * (d["block_size"] if hd == 512 else cf_spec.idx_spec.BS)
    live = bnd & (d["cache_slots"].cpu() >= 0) & (d["cache_slots"].cpu() < n_slots)
    assert torch.equal(_bytes(ca), _bytes(d["cache"])) == (not live.any())      # entries written iff a live slot


def test_table_rows_pair_up():
    """Each two-launch row has a one-launch twin with the same chunking and warps (so the same fp32 order)."""
    for arch, rows in CONFIGS.items():
        for name, cfg in rows.items():
            if name.endswith("_1l"):
                twin = rows[name[:-3]]
                assert cfg["launches"] == 1 and twin["launches"] == 2, (arch, name)
                assert {k: v for k, v in cfg.items() if k != "launches"} == \
                    {k: v for k, v in twin.items() if k != "launches"}, (arch, name)
    for ratio, hd in RH:    # the launcher's default stays the pair
        assert pick_config(ratio, hd, torch.device("cpu"))["launches"] == 2


def test_bad_launches_are_named():
    d = make_step_inputs({"T": 2, "ratio": 4, "hd": 128, "next_n": 2}, seed=0, device=DEVICE)
    with pytest.raises(ValueError, match="launches"):
        compress_decode(**d, config=dict(_row(4, 128, 1), launches=3))
    with pytest.raises(ValueError, match="launches"):
        pick_config(4, 128, torch.device("cpu"), launches=0)
    with pytest.raises(ValueError, match="next_n"):
        make_step_inputs({"T": 2, "ratio": 4, "hd": 128, "next_n": 9})


@pytest.mark.parametrize("one", [False, True])
def test_kernel_backend_picks_the_row(monkeypatch, one):
    """``KernelBackend.compressor`` / ``compressor_insert``: COMPRESS_ONE_LAUNCH_INTERP True = one launch,
    False = the pair; same numbers either way."""
    from ds4lab.model import backend_kernel as bk
    from ds4lab.model.launches import count_launches
    monkeypatch.setattr(bk, "COMPRESS_ONE_LAUNCH_INTERP", one)
    kb = bk.KernelBackend()
    d = make_step_inputs({"T": 4, "ratio": 4, "hd": 128, "next_n": 2, "shuffle": True}, seed=3, device=DEVICE)
    a = _clone(d)
    out, n = count_launches(kb.compressor, **a, name="attn.compressor")
    assert n["attn.compressor"] == (1 if one else 2)
    ref = compress_decode(**_clone(d), config=_row(4, 128, 2))
    assert torch.equal(out, ref)
    shape = {"T": 4, "ratio": 4, "hd": 512, "next_n": 2, "num_blocks": 2}
    d = cf_spec.add_comp_cache(make_step_inputs(shape, seed=4, device=DEVICE), shape, seed=4, device=DEVICE)
    a, b = _clone(d), _clone(d)
    _, n = count_launches(kb.compressor_insert, **{k: v for k, v in a.items() if k != "block_size"},
                          name="attn.compressor", block_size=d["block_size"])
    assert n["attn.compressor"] == (1 if one else 2)
    compress_decode(**b, config=_row(4, 512, 2))
    assert torch.equal(_bytes(a["cache"]), _bytes(b["cache"])) and torch.equal(a["state"], b["state"])


def test_more_tokens_than_one_search_block():
    """T = 70 > MAX_BLOCK_T (a prefill-sized call): the state-slot search walks two blocks."""
    from ds4lab_kernels.compressor import MAX_BLOCK_T
    T = MAX_BLOCK_T + 6
    d = make_step_inputs({"T": T, "ratio": 4, "hd": 128, "next_n": 2, "shuffle": True}, seed=70, device=DEVICE)
    a, b = _clone(d), _clone(d)
    assert torch.equal(compress_decode(**b, config=_row(4, 128, 1)), compress_decode(**a, config=_row(4, 128, 2)))
    assert torch.equal(b["state"], a["state"])
