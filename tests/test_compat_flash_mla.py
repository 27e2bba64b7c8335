"""ds4lab_kernels.compat.flash_mla at the FlashMLA API boundary, on the interpreter, against ds4lab's
fp64 references: the corner cases FlashMLA's tests/test_flash_mla_sparse_decoding.py and
test_flash_mla_prefill.py exercise (every index -1, seqlen 0, sink on/off/+inf, topk_length shorter
than the index width, extra-cache block sizes 2/53/61/64/69/576, h_q 64/128, s_q 1/3, varlen batches)
and the LSE convention (natural log, sink outside, +inf without a candidate)."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare
from ds4lab.harness.specs.sparse_mla import _cache, check
from ds4lab.reference import sparse_mla as ref
from ds4lab_kernels.compat import flash_mla as fm

pytestmark = pytest.mark.interp


def _gen():
    return torch.Generator().manual_seed(torch.randint(0, 2**31, (1,)).item())


def _paged(cache: torch.Tensor, bs: int) -> torch.Tensor:
    """(num_blocks, block_bytes) fp8_ds_mla bytes -> vLLM's (num_blocks, bs, 1, 584) view (padded block stride)."""
    return torch.as_strided(cache, (cache.shape[0], bs, 1, 584), (cache.stride(0), 584, 584, 1))


def _case(g, b, s_q, h, topk, ebs, etopk, n_swa=128, sink="on"):
    sw = _cache(n_swa, 64, g)
    q = torch.randn(b, s_q, h, 512, generator=g).bfloat16()
    d = {"q": q, "sw": sw, "idx": torch.randint(0, sw.shape[0] * 64, (b, s_q, topk), generator=g, dtype=torch.int32),
         "tl": torch.randint(0, topk + 1, (b,), generator=g, dtype=torch.int32),
         "sink": None if sink == "off" else torch.randn(h, generator=g) * 2}
    if sink == "inf":
        d["sink"][::3] = float("inf")
    if ebs:
        ec = _cache(max(2 * etopk, ebs), ebs, g)
        d.update(ec=ec, ebs=ebs, eidx=torch.randint(0, ec.shape[0] * ebs, (b, s_q, etopk), generator=g, dtype=torch.int32),
                 etl=torch.randint(0, etopk + 1, (b,), generator=g, dtype=torch.int32))
    return d


def _call(d, **kw):
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    meta, none = fm.get_mla_metadata()
    assert none is None
    return fm.flash_mla_with_kvcache(
        dev(d["q"]), _paged(d["sw"].to(DEVICE), 64), None, None, 512, meta, is_fp8_kvcache=True,
        indices=dev(d["idx"]), attn_sink=dev(d["sink"]), topk_length=dev(d["tl"]),
        extra_k_cache=_paged(d["ec"].to(DEVICE), d["ebs"]) if "ec" in d else None,
        extra_indices_in_kvcache=dev(d.get("eidx")), extra_topk_length=dev(d.get("etl")), **kw)


def _ref_args(d):
    b, s_q, h, _ = d["q"].shape
    T = b * s_q
    a = dict(q=d["q"].reshape(T, h, 512), swa_cache=d["sw"], swa_indices=d["idx"].reshape(T, -1),
             swa_lens=d["tl"].repeat_interleave(s_q),
             attn_sink=torch.full((h,), float("-inf")) if d["sink"] is None else d["sink"])
    if "ec" in d:
        a.update(comp_cache=d["ec"], comp_indices=d["eidx"].reshape(T, -1), comp_lens=d["etl"].repeat_interleave(s_q),
                 comp_block_size=d["ebs"])
    return a


def _assert_matches(d, out, lse):
    b, s_q, h, _ = d["q"].shape
    a = _ref_args(d)
    r = ref.sparse_mla_decode(**a)
    # FlashMLA: +inf sink zeroes the head; the reference's e^(sink-M) gives 0/inf -> compare to zeros
    if d["sink"] is not None:
        r[:, torch.isposinf(d["sink"])] = 0.0
    reps = check(out.reshape(b * s_q, h, 512), r, a)
    assert all(reps), [str(x) for x in reps]
    assert out.shape == (b, s_q, h, 512) and lse.shape == (b, h, s_q) and lse.dtype == torch.float32
    rl = ref.sparse_mla_decode_lse(**a).view(b, s_q, h).transpose(1, 2)
    lse = lse.cpu().double()
    assert torch.equal(torch.isposinf(lse), torch.isposinf(rl)), "rows without a candidate must be +inf"
    fin = torch.isfinite(rl)
    assert (lse[fin] - rl[fin]).abs().max().item() <= 1e-4 * (1 + rl[fin].abs().max().item()) if fin.any() else True


# extra-cache block sizes of FlashMLA's decode tests x h_q x s_q (one case each; a cross product is 24 runs)
@pytest.mark.parametrize("ebs,h,s_q", [(2, 64, 1), (53, 128, 3), (61, 64, 3), (64, 128, 1), (69, 64, 1), (576, 64, 1)])
def test_decode_extra_cache_block_sizes(ebs, h, s_q):
    d = _case(_gen(), 2, s_q, h, 16, ebs, 24)
    out, lse = _call(d)
    _assert_matches(d, out, lse)


@pytest.mark.parametrize("sink", ["off", "inf"])
def test_decode_sink_off_and_plus_inf(sink):
    d = _case(_gen(), 2, 1, 64, 32, 64, 32, sink=sink)
    _assert_matches(d, *_call(d))


def test_decode_every_index_invalid_and_seqlen_zero():
    d = _case(_gen(), 3, 3, 64, 32, 2, 16)
    d["idx"][0] = -1
    d["eidx"][0] = -1                    # request 0: every index invalid
    d["tl"][1], d["etl"][1] = 0, 0       # request 1: seqlen 0 (no index read)
    out, lse = _call(d)
    _assert_matches(d, out, lse)
    assert torch.isposinf(lse[:2]).all() and (out[:2] == 0).all()
    assert torch.isfinite(lse[2]).all()


def test_decode_topk_length_shorter_than_width_ignores_the_tail():
    g = _gen()
    d = _case(g, 2, 1, 64, 64, 0, 0)
    d["tl"] = torch.tensor([5, 33], dtype=torch.int32)
    out, lse = _call(d)
    _assert_matches(d, out, lse)
    d2 = dict(d, idx=d["idx"].clone())
    d2["idx"][0, :, 5:] = torch.randint(0, 128, (1, 59), generator=g, dtype=torch.int32)  # tail changes
    out2, lse2 = _call(d2)
    assert torch.equal(out[0], out2[0]) and torch.equal(lse[0], lse2[0])


def test_decode_varlen_batch_and_out_buffer_as_vllm_passes_it():
    d = _case(_gen(), 4, 1, 64, 128, 64, 64)
    d["tl"] = torch.tensor([128, 1, 77, 0], dtype=torch.int32)
    d["idx"] = d["idx"][:, 0]                     # vLLM's SWA indices are 2-D (num_decode_tokens, width)
    output = torch.full((4, 64, 512), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out, lse = _call(d, out=output.unsqueeze(1))
    assert out.data_ptr() == output.data_ptr()
    d["idx"] = d["idx"][:, None]
    _assert_matches(d, out, lse)


def test_decode_sched_meta_reuse_and_refusals():
    d = _case(_gen(), 1, 1, 64, 16, 0, 0)
    meta, _ = fm.get_mla_metadata()
    args = dict(is_fp8_kvcache=True, indices=d["idx"].to(DEVICE), topk_length=d["tl"].to(DEVICE))
    q, kc = d["q"].to(DEVICE), _paged(d["sw"].to(DEVICE), 64)
    fm.flash_mla_with_kvcache(q, kc, None, None, 512, meta, **args)
    assert meta.have_initialized and meta.config.topk == 16
    fm.flash_mla_with_kvcache(q, kc, None, None, 512, meta, **args)           # same shapes: reuse
    with pytest.raises(ValueError, match="tile_scheduler_metadata"):
        fm.flash_mla_with_kvcache(q, kc, None, None, 512, meta, **{**args, "indices": args["indices"][..., :8]})
    fresh = lambda: fm.get_mla_metadata()[0]  # noqa: E731
    with pytest.raises(NotImplementedError, match="indices=None"):
        fm.flash_mla_with_kvcache(q, kc, None, None, 512, fresh(), is_fp8_kvcache=True)
    with pytest.raises(NotImplementedError, match="is_fp8_kvcache"):
        fm.flash_mla_with_kvcache(q, kc, None, None, 512, fresh(), **{**args, "is_fp8_kvcache": False})
    with pytest.raises(NotImplementedError, match="head_dim_v"):
        fm.flash_mla_with_kvcache(q, kc, None, None, 576, fresh(), **args)
    with pytest.raises(NotImplementedError, match="d_qk"):
        fm.flash_mla_with_kvcache(torch.zeros(1, 1, 64, 576, dtype=torch.bfloat16), kc, None, None, 512, fresh(), **args)
    with pytest.raises(NotImplementedError, match="k_cache: 656"):
        fm.flash_mla_with_kvcache(q, torch.zeros(4, 64, 1, 656, dtype=torch.uint8), None, None, 512, fresh(), **args)
    with pytest.raises(ValueError, match="num_heads_q=16"):
        fm.flash_mla_with_kvcache(q[:, :, :16], kc, None, None, 512, fresh(), **args)
    with pytest.raises(ValueError, match="causal"):
        fm.flash_mla_with_kvcache(q, kc, None, None, 512, fresh(), causal=True, **args)
    with pytest.raises(TypeError, match="topk_length"):
        fm.flash_mla_with_kvcache(q, kc, None, None, 512, fresh(), **{**args, "topk_length": d["tl"].long()})


@pytest.mark.parametrize("h,sink", [(64, "on"), (128, "off")])
def test_sparse_prefill_out_max_logits_lse(h, sink):
    g = _gen()
    sq, skv, topk = 5, 300, 64
    q = torch.randn(sq, h, 512, generator=g).bfloat16()
    kv = torch.randn(skv, 1, 512, generator=g).bfloat16()
    idx = torch.randint(-1, skv + 5, (sq, 1, topk), generator=g, dtype=torch.int32)   # -1 and >= s_kv skipped
    idx[0] = -1
    lens = torch.tensor([topk, 0, 17, topk, 40], dtype=torch.int32)
    s = None if sink == "off" else torch.randn(h, generator=g)
    output = torch.empty(sq, h, 512, dtype=torch.bfloat16, device=DEVICE)
    o, mlog, lse = fm.flash_mla_sparse_fwd(q.to(DEVICE), kv.to(DEVICE), idx.to(DEVICE), 512 ** -0.5,
                                           attn_sink=None if s is None else s.to(DEVICE), topk_length=lens.to(DEVICE),
                                           out=output)
    assert o.data_ptr() == output.data_ptr() and mlog.shape == lse.shape == (sq, h)
    sink_t = torch.full((h,), float("-inf")) if s is None else s
    a = dict(q=q, kv=kv[:, 0], indices=idx[:, 0], attn_sink=sink_t, lengths=lens)
    reps = check(o, ref.sparse_mla_prefill(**a), a)
    assert all(reps), [str(x) for x in reps]
    rm, rl = ref.sparse_mla_prefill_stats(**a)
    assert torch.isposinf(lse[:2].cpu()).all() and torch.isneginf(mlog[:2].cpu()).all()
    assert compare(lse[2:], rl[2:], "float32", name="lse") and compare(mlog[2:], rm[2:], "float32", name="max_logits")
    with pytest.raises(NotImplementedError, match="d_v"):
        fm.flash_mla_sparse_fwd(q, kv, idx, 0.1, d_v=128)
    with pytest.raises(NotImplementedError, match="h_kv"):
        fm.flash_mla_sparse_fwd(q, kv.expand(skv, 2, 512), idx, 0.1)
