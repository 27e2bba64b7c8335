"""The decode step's composition glue (issue 20 item "<= 12 launches per layer"): the per-step index
maps computed once in ``RankModel._maps`` (the backend's ``index_maps``: the torch reference, or one
``step_maps`` launch on the kernel backend) equal the per-layer formulas they replaced, the fused C4A
GEMMs (``weights.fuse_layer``) equal the split GEMMs, and the tiny decode step's launch budget per
op group (``ds4lab.model.launches``, interpreter lane)."""
import types

import pytest
import torch

from ds4lab.checkpoint.tiny import TINY_CONFIG as CFG
from ds4lab.model.cache import new_caches
from ds4lab.model.model import RankModel, make_backend
from ds4lab.model.ops import Linear
from ds4lab.model.weights import fuse_layer, random_weights, quant_linear
from ds4lab.reference.compressor import window_positions


def _maps(pos, req, caches, backend="reference"):
    m = types.SimpleNamespace(cfg=CFG, ops=make_backend(backend))
    return RankModel._maps(m, pos, req, caches)


@pytest.mark.parametrize("backend", ["reference", pytest.param("kernel", marks=pytest.mark.interp)])
@pytest.mark.parametrize("pos,req", [
    ([0, 1, 2, 3], [0, 0, 0, 0]),                       # first window: negative positions masked
    ([255, 256, 127, 128, 7, 8], [0, 0, 1, 1, 2, 2]),   # B=3 x next_n=2 around C4 / C128 boundaries
    (list(range(300, 316)), [1] * 16),                  # a prefill chunk
])
def test_hoisted_maps_equal_the_per_layer_formulas(pos, req, backend):
    C = new_caches(CFG, 3, 400, chunk=16)
    pos, req = torch.tensor(pos), torch.tensor(req)
    maps = _maps(pos, req, C, backend)
    ratios = {L.ratio for L in C.layers if L.ratio}
    # layers of one ratio have equal cache sizes: one entry per ratio, shared by its layers
    assert {k[0] for k in maps["comp"]} == ratios and len(maps["comp"]) == len(ratios)
    for L in C.layers:
        if not L.ratio:
            continue
        r = L.ratio
        c = maps["comp"][(r, L.n_comp)]
        ncomp = (pos + 1) // r
        want_w = torch.where((pos + 1) % r == 0, req * L.n_comp + ncomp - 1, torch.full_like(pos, -1))
        assert torch.equal(c["comp_w"], want_w)
        assert c["ncomp"].dtype == torch.int32 and torch.equal(c["ncomp"].long(), ncomp)
        if r == 128:
            j = torch.arange(L.n_comp)
            assert c["slots"].dtype == torch.int32 and c["slots"].is_contiguous()
            assert torch.equal(c["slots"].long(), req[:, None] * L.n_comp + j[None, :])
            assert torch.equal(c["lens"].long(), ncomp.clamp_max(L.n_comp))
        top = torch.tensor([[0, 5, -1]]).expand(len(pos), 3).to(torch.int32)
        assert torch.equal(torch.where(top >= 0, top + c["base"], top).long(),
                           torch.where(top >= 0, req[:, None] * L.n_comp + top, -1))
        for ring in [L.state_ring] + ([L.idx_state_ring] if r == 4 else []):
            w = maps["win"][(r, ring)]
            win = window_positions(pos, r, 2 if r == 4 else 1)
            assert torch.equal(w["valid"], win >= 0)
            assert torch.equal(w["wslots"], req[:, None] * ring + win.clamp_min(0) % ring)
            assert torch.equal(w["sslots"], req * ring + pos % ring)
    R, W = C.swa_ring, CFG.sliding_window
    for t in range(len(pos)):
        p, b = int(pos[t]), int(req[t])
        live = list(range(max(0, p - W + 1), p + 1))
        assert int(maps["swa_lens"][t]) == len(live)
        assert maps["swa_idx"][t].tolist() == [b * R + q % R for q in live] + [-1] * (W - len(live))
        assert int(maps["swa_slots"][t]) == b * R + p % R


def test_fused_c4a_gemms_equal_the_split_gemms():
    from ds4lab.model.backend_ref import ReferenceBackend
    W = random_weights(CFG, 1, device="cpu", layers=[2, 3])
    L = W["layers"][2]
    I = L["idx"]
    assert L["x_cat_n"] == (4 * CFG.head_dim, 4 * CFG.index_head_dim, CFG.index_n_heads)
    assert L["wq_b_cat_n"] == (CFG.num_attention_heads * CFG.head_dim, CFG.index_n_heads * CFG.index_head_dim)
    assert "x_cat" not in W["layers"][3] and "wq_b_cat" not in W["layers"][3]      # C128: nothing shares x
    # the split entries are row views of the fused tensors (one copy of the bytes)
    for split, cat in ((L["comp"]["wkv_gate"], L["x_cat"]), (I["weights_proj"], L["x_cat"]),
                       (I["wq_b"], L["wq_b_cat"])):
        assert split.weight.untyped_storage().data_ptr() == cat.weight.untyped_storage().data_ptr()
    assert I["wq_b"].scale.untyped_storage().data_ptr() == L["wq_b_cat"].scale.untyped_storage().data_ptr()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, CFG.hidden_size, generator=g).to(torch.bfloat16)
    qr = torch.randn(3, CFG.q_lora_rank, generator=g).to(torch.bfloat16)
    o = ReferenceBackend()
    y = o.linear(x, L["x_cat"], "x")
    n1, n2, _ = L["x_cat_n"]
    assert torch.equal(y[:, :n1], o.linear(x, L["comp"]["wkv_gate"], "a"))
    assert torch.equal(y[:, n1:n1 + n2], o.linear(x, I["comp"]["wkv_gate"], "b"))
    assert torch.equal(y[:, n1 + n2:], o.linear(x, I["weights_proj"], "c"))
    q = o.linear(qr, L["wq_b_cat"], "q")
    nq = L["wq_b_cat_n"][0]
    assert torch.equal(q[:, :nq], o.linear(qr, L["wq_b"], "d")) and torch.equal(q[:, nq:], o.linear(qr, I["wq_b"], "e"))


def test_fuse_layer_keeps_fp8_pairs_apart_when_a_scale_block_would_straddle():
    g = torch.Generator().manual_seed(1)

    def lin(n, k=256):
        return quant_linear(torch.randn(n, k, generator=g))
    bf = Linear(torch.randn(64, 256, generator=g).to(torch.bfloat16))
    L = {"ratio": 4, "wq_b": lin(192), "comp": {"wkv_gate": bf}, "idx": {"wq_b": lin(256), "comp": {"wkv_gate": bf},
                                                                        "weights_proj": Linear(bf.weight.float())}}
    fuse_layer(L)
    assert "wq_b_cat" not in L     # 192 rows: the last scale block would hold rows of both weights
    assert "x_cat" not in L        # weights_proj float32 vs bf16: not one GEMM


@pytest.mark.interp
def test_tiny_decode_step_launch_budget():
    """Launches per op group of one decode step (B=2) of the tiny config cut to its C4A and C128A
    layers (the interpreter runs ~7 s per layer) on the kernel backend: the index maps once per
    step, no per-layer slot glue, nothing outside a group but the decode wrapper's own two ops,
    the fused norm / GEMM / add in one launch each. Measured 177 on this work alone, 133 with the
    other issue-20 branches merged (main before both: 221), 67 with the index maps in one launch
    (``step_maps``: 62 -> 1), then the compressor in one launch (comp1: -1 a compressor call); the q head
    norm inside the attention launch (qmla6, -1 a layer) and the one-launch MoE (moe1) were removed in
    session 8 (they lost on the H200): 61, then the C4A q launches as one (qidx): 60 now; the ceiling catches
    new glue."""
    import dataclasses

    from ds4lab.model import build_rank
    from ds4lab.model.launches import OUTSIDE, count_launches
    cfg = dataclasses.replace(CFG, num_hidden_layers=2, compress_ratios=(4, 128, 0), num_hash_layers=1)
    W = random_weights(cfg, 1, device="cpu", seed=3)
    m = build_rank(cfg, 1, 0, W, backend="kernel", max_pos=512, chunk=16)
    C = m.new_caches(2, 16)       # zeroed caches: launches do not depend on their contents
    ids = torch.randint(0, CFG.vocab_size, (2, 1), generator=torch.Generator().manual_seed(0))
    lg, n = count_launches(m.decode, ids, torch.full((2, 1), 11), C)   # pos 11: a C4 boundary
    assert torch.isfinite(lg).all()
    print("\nlaunches per group:", dict(n.most_common()))
    assert n.calls["step.maps"] == 1 and n["step.maps"] == 1      # one step_maps launch
    assert not [g for g in n if g.endswith(".slots") and g != "indexer.slots"] and "attn.c128_slots" not in n
    assert n[OUTSIDE] <= 2
    for g in ("attn.q_kv_norm_rope", "attn.x_proj", "moe.add", "indexer.slots"):
        assert n[g] == n.calls[g] * (3 if g == "indexer.slots" else 1), g
    # the q head norm + RoPE: one launch before each attention (qmla6's fused load lost on the H200); at the C4A
    # layer in the same launch as the indexer q's RoPE + quant (qidx, FUSE_Q_INDEXER_Q)
    assert n["attn.q_norm_rope"] == n.calls["attn.q_norm_rope"] == 1 and n.calls["attn.sparse_mla"] == 2
    assert n["attn.q_norm_rope+indexer.q_quant"] == n.calls["attn.q_norm_rope+indexer.q_quant"] == 1
    assert "indexer.q_quant" not in n
    assert n.calls["attn.wq_b"] == 2 and "indexer.wq_b" not in n and "attn.kv_norm" not in n   # one per layer
    # the cache entries are written by their producers: no insert launch (glue6: -5 here, 128 -> 123)
    assert not {"attn.swa_insert", "attn.comp_insert", "indexer.k_insert"} & set(n.calls)
    assert n["attn.q_kv_norm_rope"] == n.calls["attn.q_kv_norm_rope"]
    # the compressor in one launch (COMPRESS_ONE_LAUNCH_INTERP; comp1: -3 here, the pair's state write gone)
    assert n["attn.compressor"] == n.calls["attn.compressor"]
    # 1 launch + the indexer K writer's CPU-only slot bound check (max + item; skipped on CUDA)
    assert n.calls["indexer.compressor"] == 1 and n["indexer.compressor"] == 1 + 2
    # maps6 (1 maps launch) + glue6 (no insert launches) + comp1: 61 (64 with the pair); moe.experts 3 a layer
    # here (the interpreter's decode row: 2 launches, then its fp32 add; the GPU's mma row adds in launch 2)
    assert sum(n.values()) <= 66
