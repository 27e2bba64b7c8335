"""Lightning indexer: cache byte layout round trip, logits semantics, bad inputs (beyond the sweep)."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.specs.indexer import BLOCK_BYTES, _logit_tol, make_cache
from ds4lab.harness.numerics import compare
from ds4lab.reference import indexer as ref
from ds4lab_kernels import indexer as K

pytestmark = pytest.mark.interp
D, BS = 128, 64


def _position_coded(T):
    """Token t's key encodes t: k[t, d] = (t+1) * (d - 63.5)/64, so every row differs and decodes back."""
    t = torch.arange(T, dtype=torch.float32)[:, None] + 1
    d = torch.arange(D, dtype=torch.float32)[None, :]
    return (t * (d - 63.5) / 64).bfloat16()


def test_block_geometry_and_byte_offsets():
    assert BLOCK_BYTES == 8640 == ref.block_bytes(64)
    assert BLOCK_BYTES % 576 == 0 and BLOCK_BYTES >= 64 * 132
    # slot 0: values at byte 0, scale right after ALL 64 entries' values (planar, not [.., 132])
    assert ref.entry_offsets(0, BLOCK_BYTES) == (0, 8192)
    assert ref.entry_offsets(1, BLOCK_BYTES) == (128, 8196)
    assert ref.entry_offsets(63, BLOCK_BYTES) == (63 * 128, 8192 + 252)
    assert ref.entry_offsets(64, BLOCK_BYTES) == (8640, 8640 + 8192)
    assert ref.entry_offsets(299, BLOCK_BYTES) == (4 * 8640 + 43 * 128, 4 * 8640 + 8192 + 43 * 4)


def test_round_trip_300_tokens_byte_exact_through_every_reader():
    T = 300  # crosses four block boundaries
    k = _position_coded(T).to(DEVICE)
    nb = 6
    cache = make_cache(nb, DEVICE)
    # a non-trivial block table: logical block i lives in physical block perm[i]
    perm = torch.tensor([4, 0, 5, 2, 1, 3], dtype=torch.int32)
    slots = (perm[torch.arange(T) // BS].long() * BS + torch.arange(T) % BS).to(DEVICE)
    K.indexer_k_cache_insert(k, cache, slots)
    q_ref, s_ref = ref.quantize_k(k.cpu())
    # explicit byte offsets in the raw storage
    raw = torch.as_strided(cache, (nb * BLOCK_BYTES,), (1,)).cpu()
    for t in (0, 1, 63, 64, 65, 127, 128, 255, 256, 299):
        b, i = int(perm[t // BS]), t % BS
        vo = b * BLOCK_BYTES + i * 128
        so = b * BLOCK_BYTES + 64 * 128 + 4 * i
        assert torch.equal(raw[vo:vo + 128], q_ref[t].view(torch.uint8)), t
        assert torch.equal(raw[so:so + 4], s_ref[t:t + 1].view(torch.uint8)), t
        # position code survives quantization: the scale is the power of two above (t+1)*63.5/64/448
        assert s_ref[t] == ref.ceil_pow2(torch.tensor((t + 1) * 63.5 / 64 / 448))
    # reader 1: slot reader; reader 2: block-table gather (the paged reference)
    kq, ks = ref.read_indexer_k_cache(cache, slots.cpu())
    assert torch.equal(kq.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(ks, s_ref)
    kq2, ks2 = ref.gather_indexer_k(cache.cpu(), perm, T)
    assert torch.equal(kq2.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(ks2, s_ref)
    # reader 3: the paged logits kernel reads the same keys: with q = e_d one-hot heads the logits
    # recover sum_h w_h relu(k[j, d_h]) * s_j for every position j
    q = torch.zeros(1, 1, 64, D)
    for h in range(64):
        q[0, 0, h, 2 * h] = 1.0
    q = q.to(torch.float8_e4m3fn).to(DEVICE)
    w = torch.ones(1, 64, device=DEVICE)
    out = K.fp8_paged_mqa_logits(q, cache, w, torch.tensor([[T]], dtype=torch.int32, device=DEVICE),
                                 perm[None].to(DEVICE), T + 20)
    want = (q_ref.float()[:, 0:128:2].relu().sum(1) * s_ref)
    assert torch.equal(out[0, :T].cpu(), want)
    assert torch.isneginf(out[0, T:]).all()
    # reader 4: the ragged prefill kernel over the gathered keys agrees with the paged kernel
    out2 = K.fp8_mqa_logits(q[0].contiguous(), (kq2.to(DEVICE), ks2.to(DEVICE)), w,
                            torch.zeros(1, dtype=torch.int32, device=DEVICE),
                            torch.full((1,), T, dtype=torch.int32, device=DEVICE))
    assert torch.equal(out2.cpu(), out[:, :T].cpu())


def test_negative_slots_are_skipped_and_nan_keys_flagged():
    cache = make_cache(1, DEVICE)
    before = cache.clone()
    k = torch.randn(3, D).bfloat16()
    k[1, 7] = float("nan")
    K.indexer_k_cache_insert(k.to(DEVICE), cache, torch.tensor([-1, 5, -7], device=DEVICE))
    _, s = ref.read_indexer_k_cache(cache, [5])
    assert torch.isnan(s).all()
    flat = lambda c: torch.as_strided(c, (64 * 132,), (1,)).cpu()
    changed = set((flat(cache) != flat(before)).nonzero().squeeze(1).tolist())
    # only entry 5's bytes: values at 5*128.., its scale at 64*128 + 5*4 (planar)
    assert changed and changed <= set(range(640, 768)) | set(range(8212, 8216))


def test_paged_next_n_2_causal_rows_and_1d_convention_agree():
    from ds4lab.harness.specs.indexer import make_paged_inputs
    inp = make_paged_inputs({"B": 2, "next_n": 2, "ctx": 150}, "decode", 1, DEVICE)
    a = K.fp8_paged_mqa_logits(**inp)
    # row 1 of each request sees one entry more than row 0 (MTP verification)
    lim = inp["context_lens"].cpu()
    for b in range(2):
        assert torch.isfinite(a[2 * b, :lim[b, 0]]).all() and torch.isneginf(a[2 * b, lim[b, 0]:]).all()
        assert torch.isfinite(a[2 * b + 1, :lim[b, 1]]).all()
    inp1 = dict(inp, context_lens=inp["context_lens"][:, 1].contiguous())
    assert torch.equal(K.fp8_paged_mqa_logits(**inp1).cpu(), a.cpu())
    # interpreter: fp32 accumulation, the fp32 budget; FP8 tensor cores keep ~14 accumulator bits:
    # the sweep's budget from numerics.fp8_mma_rel_error (kernel_specs.indexer._logit_tol)
    r = ref.fp8_paged_mqa_logits(**inp)
    assert compare(a, r, _logit_tol(r.cpu(), a.device) if a.is_cuda else "float32")


def test_paged_bad_block_id_gives_nan_not_numbers():
    from ds4lab.harness.specs.indexer import make_paged_inputs
    inp = make_paged_inputs({"B": 1, "next_n": 1, "ctx": 100}, "decode", 2, DEVICE)
    inp["block_table"][0, 1] = 10_000
    out = K.fp8_paged_mqa_logits(**inp)
    assert torch.isnan(out[0, 64:100]).all() and torch.isfinite(out[0, :64]).all()


def _mqa_args():
    q = torch.zeros(2, 64, D).to(torch.float8_e4m3fn)
    k = torch.zeros(5, D).to(torch.float8_e4m3fn)
    z = torch.zeros(2, dtype=torch.int32)
    return dict(q=q, kv=(k, torch.ones(5)), weights=torch.zeros(2, 64), cu_seqlen_ks=z, cu_seqlen_ke=z)


@pytest.mark.parametrize("patch,exc,match", [
    ({"q": torch.zeros(2, 64, D)}, TypeError, "q: dtype"),
    ({"q": torch.zeros(2, 64, 64).to(torch.float8_e4m3fn)}, ValueError, "q: head dim"),
    ({"kv": torch.zeros(5, D)}, TypeError, "kv"),
    ({"kv": (torch.zeros(5, D).to(torch.float8_e4m3fn), torch.ones(4))}, ValueError, "k_scale"),
    ({"weights": torch.zeros(2, 64, dtype=torch.float64)}, TypeError, "weights: dtype"),
    ({"weights": torch.zeros(3, 64)}, ValueError, "weights: shape"),
    ({"cu_seqlen_ks": torch.zeros(2, dtype=torch.int64)}, TypeError, "cu_seqlen_ks"),
    ({"cu_seqlen_ke": torch.zeros(3, dtype=torch.int32)}, ValueError, "cu_seqlen_ke"),
])
def test_mqa_bad_inputs(patch, exc, match):
    with pytest.raises(exc, match=match):
        K.fp8_mqa_logits(**{**_mqa_args(), **patch})


def test_cache_and_paged_bad_inputs():
    k = torch.randn(2, D).bfloat16()
    good = make_cache(2, "cpu")
    with pytest.raises(ValueError, match="kv_cache: last dim"):
        K.indexer_k_cache_insert(k, torch.zeros(2, 64, 136, dtype=torch.uint8), torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="kv_cache: dtype"):
        K.indexer_k_cache_insert(k, torch.zeros(2, 64, 132, dtype=torch.int8), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping: slot 128"):
        K.indexer_k_cache_insert(k, good, torch.tensor([0, 128]))
    with pytest.raises(ValueError, match="block stride"):
        K.indexer_k_cache_insert(k, torch.as_strided(torch.zeros(20000, dtype=torch.uint8), (2, 64, 132), (4000, 132, 1)),
                                 torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="k: head dim"):
        K.indexer_k_cache_insert(torch.randn(2, 64).bfloat16(), good, torch.tensor([0, 1]))
    q = torch.zeros(1, 3, 64, D).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="next_n=3"):
        K.fp8_paged_mqa_logits(q, good, torch.zeros(3, 64), torch.zeros(1, 3, dtype=torch.int32),
                               torch.zeros(1, 2, dtype=torch.int32), 128)
    q = torch.zeros(1, 1, 64, D).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="block_table"):
        K.fp8_paged_mqa_logits(q, good, torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.int32),
                               torch.zeros(1, 2, dtype=torch.int64), 128)
    with pytest.raises(ValueError, match="context_lens"):
        K.fp8_paged_mqa_logits(q, good, torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.int32),
                               torch.zeros(1, 2, dtype=torch.int32), 128)


# ---- short contexts on FP8 tensor cores (H200 notebook 03: short_contexts B=5 failed diff 1.04e-7) ----
SHORT = {"B": 5, "next_n": 1, "ctx": 130, "H": 64}
SHORT2 = {"B": 3, "next_n": 2, "ctx": 200, "H": 64}
HW_REL = 8 * 2.0 ** -13  # the budget's rel on an FP8 tensor-core device (8 * numerics.fp8_mma_rel_error)


@pytest.mark.parametrize("case", ["short_contexts", "block_boundaries"])
def test_paged_logits_read_nothing_past_the_context(case):
    from ds4lab.harness.specs.indexer import make_paged_inputs, poison_outside_context
    for shape in (SHORT, SHORT2):
        inp = make_paged_inputs(shape, case, 3, DEVICE)
        clean = K.fp8_paged_mqa_logits(**inp).cpu()
        for byte in (0x7F, 0xFF):
            out = K.fp8_paged_mqa_logits(**poison_outside_context(inp, byte)).cpu()
            assert torch.equal(out, clean), (shape, case, hex(byte))


def test_short_context_logits_are_the_decode_logits():
    """short_contexts has no computation of its own: same q, weights, cache and block table as
    decode (same seed), so its 4 finite logits are decode's at the same positions, bit for bit (the
    GPU check, scripts/gpu/paged_check.sh, asserts the same on the H200). Only the sample differs."""
    from ds4lab.harness.specs.indexer import make_paged_inputs
    for shape in (SHORT, SHORT2):
        s = K.fp8_paged_mqa_logits(**make_paged_inputs(shape, "short_contexts", 0, DEVICE)).cpu()
        d = K.fp8_paged_mqa_logits(**make_paged_inputs(shape, "decode", 0, DEVICE)).cpu()
        fin = torch.isfinite(s)
        assert 0 < int(fin.sum()) <= 4 and torch.equal(s[fin], d[fin])


def test_similarity_budget_is_not_stricter_than_the_elementwise_one_on_fp8_mma():
    """The H200 failure reproduced on the e8m13 accumulator model (numerics.fp8_mma_emulated):
    seed 55 of short_contexts B=5 gives diff 1.02e-7, rms_rel 4.5e-4 (H200: 1.04e-7, 4.6e-4) with
    every element inside its elementwise bound; the old similarity budget (1e-7) fails it."""
    import dataclasses
    from ds4lab.harness.specs.indexer import make_paged_inputs, paged_logits_mma_model
    inp = make_paged_inputs(SHORT, "short_contexts", 55, "cpu")
    r = ref.fp8_paged_mqa_logits(**inp)
    hw = paged_logits_mma_model(inp)
    tol = _logit_tol(r, rel=HW_REL)
    rep = compare(hw, r, tol)
    assert rep and rep.n_fail == 0 and 1e-7 < rep.diff < tol.max_diff, rep
    old = compare(hw, r, dataclasses.replace(tol, max_diff=1e-7))
    assert not old and old.n_fail == 0  # the old verdict: FAIL on similarity alone
    # fresh model draws of both short shapes pass (200 draws each: worst 0.69 of the budget)
    for shape, seeds in ((SHORT, (18, 63, 195, 0)), (SHORT2, (36, 83, 113, 0))):
        for seed in seeds:  # all but seed 0 fail the old budget on the model
            inp = make_paged_inputs(shape, "short_contexts", seed, "cpu")
            r = ref.fp8_paged_mqa_logits(**inp)
            assert compare(paged_logits_mma_model(inp), r, _logit_tol(r, rel=HW_REL)), (shape, seed)
    # the CPU budget is unchanged: 2 rel^2 / n_eff is far below 1e-7 at rel = 8 * 2^-23
    assert _logit_tol(r, "cpu").max_diff == 1e-7


def test_fp8_mma_budget_still_fails_broken_kernels():
    """Under the FP8 tensor-core budget: a kernel 2 accumulator bits worse than the hardware fails
    on a full-size case through the similarity check alone (elementwise passes); bf16-rounded
    logits, a dropped head, a stale block and an off-by-one entry fail everywhere."""
    from ds4lab.harness.specs.indexer import make_paged_inputs, paged_logits_mma_model
    inp = make_paged_inputs(SHORT, "decode", 0, "cpu")
    r = ref.fp8_paged_mqa_logits(**inp)
    tol = _logit_tol(r, rel=HW_REL)
    assert tol.max_diff == 1e-7  # n_eff >= 19: the full-size budget
    assert compare(paged_logits_mma_model(inp), r, tol)  # the hardware model passes
    worse = compare(paged_logits_mma_model(inp, acc_bits=11), r, tol)
    assert not worse and worse.n_fail == 0, worse
    assert not compare(paged_logits_mma_model(inp).bfloat16().float(), r, tol)
    w = inp["weights"].clone()
    w[:, 7] = 0.0
    assert not compare(paged_logits_mma_model(dict(inp, weights=w)), r, tol)
    bt = inp["block_table"].clone()
    bt[2, 1] = inp["kv_cache"].shape[0] - 1  # a block no request owns (stale contents)
    assert not compare(paged_logits_mma_model(dict(inp, block_table=bt)), r, tol)
    inp = make_paged_inputs(SHORT, "short_contexts", 0, "cpu")
    r = ref.fp8_paged_mqa_logits(**inp)
    tol = _logit_tol(r, rel=HW_REL)
    hw = paged_logits_mma_model(inp)
    assert compare(hw, r, tol)
    shifted = hw.clone()
    shifted[2, 1] = hw[2, 0]  # the 2-entry row reads entry 0 twice
    assert not compare(shifted, r, tol)
    bt = inp["block_table"].clone()
    bt[:, 0] = bt[:, 0].roll(1)  # every request reads its neighbour's block
    assert not compare(paged_logits_mma_model(dict(inp, block_table=bt)), r, tol)
