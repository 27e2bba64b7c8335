"""MoE routing and W4A16 experts: specifics beyond the registry sweep (issue 9): ragged experts
(5, 0, 33 tokens), NaN in padding rows / workspaces, tiny scales, untouched experts never read,
token permutation (bitwise), decode == prefill, accumulate=True into a float32 out, router
NaN/inf/ties/hash, bad inputs, the safetensors loader."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare
from ds4lab.reference import moe as R
from ds4lab_kernels import moe_w4a16 as K
from ds4lab_kernels.moe_routing import sqrtsoftplus_topk

DEC = {"path": "decode", "BLOCK_N": 256, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4,
       "BLOCK_N2": 256, "BLOCK_K2": 128, "num_warps2": 4}
DEC_SPLIT = dict(DEC, BLOCK_K=128, SPLIT_K=2)
PRE = {"path": "prefill", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_N2": 128,
       "num_warps": 4, "SUM_T": 16, "SUM_N": 256}
# decode variant "mma" (issue 20): expert-grouped tensor-core tiles, split-K tickets, fused top-k sum
MMA = {"path": "decode", "variant": "mma", "BLOCK_N": 64, "SPLIT_K": 2, "num_warps": 4, "BLOCK_N2": 128,
       "num_warps2": 4}
# the same with the packed PTX dequant (on the interpreter: the fp32 bit trick, same values), the tight
# id scan, h and x stored in plane order (what the interpreter proves: the permuted stores and loads agree)
MMAQ = dict(MMA, deq="asm", pb="tight", hperm=1, xperm=1, SPLIT_K=2, BLOCK_N=32, BLOCK_N2=64)
PATHS = {"decode": DEC, "decode_split": DEC_SPLIT, "prefill": PRE, "mma": MMA, "mmaq": MMAQ}


def _weights(E=4, D=256, I=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q13 = torch.randint(-8, 8, (E, 2 * I, D), generator=g)
    q2 = torch.randint(-8, 8, (E, D, I), generator=g)
    s13 = (torch.rand(E, 2 * I, D // 128, generator=g) + 0.5) / (4.6 * D ** 0.5)
    s2 = (torch.rand(E, D, I // 128, generator=g) + 0.5) / (4.6 * I ** 0.5)
    return {"w13_packed": R.pack_int4(q13), "w13_scale": s13.bfloat16(),
            "w2_packed": R.pack_int4(q2), "w2_scale": s2.bfloat16()}


def _ragged(seed=0):
    """38 tokens, top-2: expert 2 gets 33 tokens, expert 0 gets 5, expert 1 none, expert 3 all."""
    g = torch.Generator().manual_seed(seed)
    T = 38
    ids = torch.empty(T, 2, dtype=torch.int32)
    ids[:33, 0] = 2
    ids[33:, 0] = 0
    ids[:, 1] = 3
    w = torch.rand(T, 2, generator=g) + 0.1
    w = (w / w.sum(1, keepdim=True) * 1.5).float()
    x = torch.randn(T, 256, generator=g).bfloat16()
    return x, w, ids


def _dev(d):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


pytestmark = pytest.mark.interp


def test_pack_matches_compressed_tensors():
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = torch.randint(-8, 8, (5, 64), dtype=torch.int8)
    assert torch.equal(R.pack_int4(q), ct.pack_to_int32(q, 4))
    assert torch.equal(R.unpack_int4(R.pack_int4(q)), q)
    assert torch.equal(ct.unpack_from_int32(R.pack_int4(q), 4, q.shape), q)


# mmaq: the same ragged inputs run in test_nan_workspace_and_padding_rows_stay_out (plus padding)
@pytest.mark.parametrize("path", sorted(set(PATHS) - {"mmaq"}))
def test_ragged_experts_and_untouched_expert_never_read(path):
    w = _weights()
    w["w13_scale"][1] = float("nan")  # expert 1 has no token: its weights must never be read
    w["w2_scale"][1] = float("inf")
    x, tw, ids = _ragged()
    inp = _dev({"x": x, **w, "topk_weights": tw, "topk_ids": ids})
    out = K.fused_moe_w4a16(**inp, config=PATHS[path])
    ref = R.fused_moe_w4a16(**{k: v.cpu() for k, v in inp.items()})
    assert not out.isnan().any()
    rep = compare(out.cpu(), ref, "bfloat16")
    assert rep, rep.summary()


def test_tile_schedule():
    ids = torch.tensor([[2, 3]] * 33 + [[0, 3]] * 5, dtype=torch.int32)
    order, te, tr0, tn = K.moe_tile_schedule(ids, 4, 16)
    live = tn > 0
    # expert 0: 5 rows (1 tile), 1: none, 2: 33 (16+16+1), 3: 38 (16+16+6)
    assert te[live].tolist() == [0, 2, 2, 2, 3, 3, 3]
    assert tn[live].tolist() == [5, 16, 16, 1, 16, 16, 6]
    assert tr0[live].tolist() == [0, 5, 21, 37, 38, 54, 70]
    flat = ids.flatten().long()
    assert torch.equal(flat[order.long()], torch.sort(flat, stable=True).values)
    assert len(tn) == -(-76 // 16) + 4  # fixed grid: no host sync


@pytest.mark.parametrize("path", ["decode_split", "prefill", "mma", "mmaq"])
def test_nan_workspace_and_padding_rows_stay_out(path):
    w = _weights()
    x, tw, ids = _ragged()
    ids[::4] = -1            # padding tokens (a CUDA-graph batch padded to its bucket)
    x[::4] = float("nan")
    inp = _dev({"x": x, **w, "topk_weights": tw, "topk_ids": ids})
    T, P, I, D = 38, 76, 128, 256
    if path == "prefill":
        ws = {"h": torch.full((P + 64, I), float("nan"), dtype=torch.float16, device=DEVICE),
              "y": torch.full((P, D), float("nan"), device=DEVICE)}
    elif path in ("mma", "mmaq"):
        splits, nb1, nb2 = PATHS[path]["SPLIT_K"], I // PATHS[path]["BLOCK_N"], D // PATHS[path]["BLOCK_N2"]
        ws = {"h": torch.full((P, I), float("nan"), dtype=torch.float16, device=DEVICE),
              "y": torch.full((P, D), float("nan"), device=DEVICE),
              "part": torch.full((splits, P, 2 * I), float("nan"), device=DEVICE),
              "counters": torch.zeros(P * nb1 + nb2, dtype=torch.int32, device=DEVICE)}
    else:
        ws = {"part": torch.full((2, P, 2 * I), float("nan"), device=DEVICE)}
    out = K.fused_moe_w4a16(**inp, config=PATHS[path], workspace=ws)
    ref = R.fused_moe_w4a16(**{k: v.cpu() for k, v in inp.items()})
    assert not out.isnan().any()
    assert torch.all(out[::4] == 0)
    assert compare(out.cpu(), ref, "bfloat16")
    if path == "prefill":  # rows past the used pairs were never written
        assert ws["h"][P:].isnan().all()
    if path in ("mma", "mmaq"):  # every ticket counter was reset by the program that took the last ticket
        assert int(ws["counters"].abs().sum()) == 0


@pytest.mark.parametrize("path", ["decode", "prefill", "mma"])
def test_tiny_scales_no_nan(path):
    w = _weights()
    w["w2_scale"] = (w["w2_scale"].float() * 1e-21).bfloat16()  # ~1e-23 scales
    w["w13_scale"][:, :, 0] = 1e-23
    x, tw, ids = _ragged()
    inp = _dev({"x": x, **w, "topk_weights": tw, "topk_ids": ids})
    out = K.fused_moe_w4a16(**inp, config=PATHS[path])
    ref = R.fused_moe_w4a16(**{k: v.cpu() for k, v in inp.items()})
    assert not out.isnan().any() and out.abs().max() > 0
    rep = compare(out.cpu().double() * 1e21, ref.double() * 1e21, "bfloat16")
    assert rep, rep.summary()


@pytest.mark.parametrize("path", ["decode", "prefill", "mma"])
def test_token_permutation_is_bitwise(path):
    """Bound guaranteed: bit-for-bit. Every (token, expert) pair's row is computed from its own
    x row with a fixed K order (GEMV per pair on decode; MMA rows are independent on prefill), and
    the top-k sum runs in slot order, so moving tokens between tile positions changes nothing."""
    w = _weights()
    x, tw, ids = _ragged()
    perm = torch.randperm(38)
    a = K.fused_moe_w4a16(**_dev({"x": x, **w, "topk_weights": tw, "topk_ids": ids}), config=PATHS[path])
    b = K.fused_moe_w4a16(**_dev({"x": x[perm], **w, "topk_weights": tw[perm].contiguous(),
                                  "topk_ids": ids[perm].contiguous()}), config=PATHS[path])
    assert torch.equal(a[perm.to(a.device)].view(torch.int16), b.view(torch.int16))


def test_decode_and_prefill_agree():
    w = _weights()
    x, tw, ids = _ragged()
    inp = _dev({"x": x, **w, "topk_weights": tw, "topk_ids": ids})
    a = K.fused_moe_w4a16(**inp, config=DEC)
    b = K.fused_moe_w4a16(**inp, config=PRE)
    assert compare(a.cpu(), b.cpu(), "bfloat16")


def _mma_inputs(T=5, E=8, K_TOP=3, seed=3):
    w = _weights(E=E, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 256, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(T)]).to(torch.int32)
    tw = (torch.rand(T, K_TOP, generator=g) + 0.1).float()
    return x, w, tw, ids


def test_mma_repeated_experts_invalid_ids_and_nan_token():
    """Decode variant "mma": a token naming one expert twice gets both terms; ids -1 and ids >= E
    are skipped (as -1 in the reference); a NaN/inf x row on a valid token stays in that token's
    output row (other rows bit-equal to a clean run); two calls are bit-equal (tickets reset)."""
    x, w, tw, ids = _mma_inputs()
    ids[0, 1] = ids[0, 0]           # repeated expert in one token
    ids[1, 2] = 8                   # id == E: skipped
    ids[2, 0] = -1                  # padding slot
    inp = _dev({"x": x, **w, "topk_weights": tw, "topk_ids": ids})
    out = K.fused_moe_w4a16(**inp, config=MMA)
    again = K.fused_moe_w4a16(**inp, config=MMA)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))
    ids_ref = torch.where(ids >= 8, torch.full_like(ids, -1), ids)
    ref = R.fused_moe_w4a16(**{**{k: v.cpu() for k, v in inp.items()}, "topk_ids": ids_ref})
    rep = compare(out.cpu(), ref, "bfloat16")
    assert rep, rep.summary()
    xn = x.clone()
    xn[3, 5] = float("nan")
    xn[4, 7] = float("inf")
    bad = K.fused_moe_w4a16(**_dev({"x": xn, **w, "topk_weights": tw, "topk_ids": ids}), config=MMA)
    assert bad[3].isnan().all() and not bad[4].isfinite().all()
    assert torch.equal(bad[:3].view(torch.int16), out[:3].view(torch.int16))


def test_mmaq_rows_are_bit_equal_to_mma():
    """The moe5 options change where operands come from (h and x in plane order, a 16-id scan at
    <= 16 pairs), not the arithmetic: bit-equal to the mma row of the same tiles (15 pairs here: the
    tight scan; the ragged tests above run 76 pairs)."""
    x, w, tw, ids = _mma_inputs()
    ids[1, 2] = -1
    inp = _dev({"x": x, **w, "topk_weights": tw, "topk_ids": ids})
    base = {k: v for k, v in MMAQ.items() if k not in ("deq", "pb", "hperm", "xperm")}
    a = K.fused_moe_w4a16(**inp, config=base)
    b = K.fused_moe_w4a16(**inp, config=MMAQ)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_mma_extreme_scales_and_config_errors():
    """Scales near bf16's largest finite (products stay finite in fp32) and a bad tile config."""
    x, w, tw, ids = _mma_inputs(seed=4)
    w["w13_scale"] = (w["w13_scale"].float() * 1e30).bfloat16()
    w["w2_scale"] = (w["w2_scale"].float() * 1e-30).bfloat16()
    inp = _dev({"x": x, **w, "topk_weights": tw, "topk_ids": ids})
    out = K.fused_moe_w4a16(**inp, config=MMA)
    ref = R.fused_moe_w4a16(**{k: v.cpu() for k, v in inp.items()})
    assert out.isfinite().all() and out.abs().max() > 0
    rep = compare(out.cpu().double() * 1e30, ref.double() * 1e30, "bfloat16")
    assert rep, rep.summary()
    with pytest.raises(ValueError, match="BLOCK_N"):
        K.fused_moe_w4a16(**inp, config=dict(MMA, BLOCK_N=8))


def test_moe_bad_inputs():
    w = _dev(_weights())
    x, tw, ids = _ragged()
    ok = _dev({"x": x, **w, "topk_weights": tw, "topk_ids": ids})
    f = K.fused_moe_w4a16
    with pytest.raises(TypeError, match="x"):
        f(**{**ok, "x": ok["x"].float()})
    with pytest.raises(TypeError, match="w13_packed"):
        f(**{**ok, "w13_packed": ok["w13_packed"].to(torch.int64)})
    with pytest.raises(ValueError, match="w2_scale"):
        f(**{**ok, "w2_scale": ok["w2_scale"][:, :, :0]})
    with pytest.raises(TypeError, match="topk_ids"):
        f(**{**ok, "topk_ids": ok["topk_ids"].long()})
    with pytest.raises(ValueError, match="topk_weights"):
        f(**{**ok, "topk_weights": ok["topk_weights"][:, :1].contiguous()})
    with pytest.raises(ValueError, match="x"):
        f(**{**ok, "x": ok["x"][:, :200]})
    with pytest.raises(ValueError, match="path"):
        f(**ok, config={"path": "nope"})


# ---- accumulate=True: add into a float32 out (the model: the shared expert's fp32 output) ---------------
def _acc_inputs(T=4, k=3, E=8, seed=11):
    w = _weights(E=E, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(T, 256, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    tw = (torch.rand(T, k, generator=g) + 0.1).float()
    out0 = torch.randn(T, 256, generator=g).float()      # nonzero: the add must keep it
    return _dev({"x": x, **w, "topk_weights": tw, "topk_ids": ids}), out0


@pytest.mark.parametrize("path", ["mmaq", "prefill", "decode"])
def test_accumulate_adds_into_float32_out(path):
    """The mma top-k tail and prefill's top-k sum add ``out`` in their last launch, the older decode
    variant adds its result once: ``out - out0`` against the float64 routed sum on the bf16 budget; a
    deliberately broken sum (the last pair's term left out) fails the same check."""
    inp, out0 = _acc_inputs()
    out = out0.clone().to(DEVICE)
    assert K.fused_moe_w4a16(**inp, out=out, accumulate=True, config=PATHS[path]) is out
    cpu = {k: v.cpu() for k, v in inp.items()}
    zeros = torch.zeros(out0.shape, dtype=torch.float64)
    ref = R.fused_moe_w4a16(**cpu, out=zeros, accumulate=True)
    rep = compare(out.cpu().double() - out0.double(), ref, "bfloat16")
    assert rep, rep.summary()
    tw2 = cpu["topk_weights"].clone()
    tw2[-1, -1] = 0.0
    broken = R.fused_moe_w4a16(**{**cpu, "topk_weights": tw2}, out=zeros, accumulate=True)
    assert not compare(broken, ref, "bfloat16")


def test_accumulate_bad_out():
    """accumulate=True needs a float32 (tokens, hidden) row-contiguous out on x's device (errors name
    ``out``); no tokens: out returned untouched."""
    inp, out0 = _acc_inputs(T=2)
    f = K.fused_moe_w4a16
    bads = ((None, ValueError), (out0.bfloat16().to(DEVICE), TypeError),
            (torch.zeros(2, 128, device=DEVICE), ValueError), (torch.zeros(3, 256, device=DEVICE), ValueError),
            (torch.zeros(2, 256, device="meta"), ValueError), (torch.zeros(256, 2, device=DEVICE).t(), ValueError))
    for bad, err in bads:
        with pytest.raises(err, match="out"):
            f(**inp, out=bad, accumulate=True, config=MMAQ)
    e = torch.zeros(0, 256, device=DEVICE)
    empty = {**inp, "x": inp["x"][:0], "topk_weights": inp["topk_weights"][:0], "topk_ids": inp["topk_ids"][:0]}
    assert f(**empty, out=e, accumulate=True) is e


# ---- router ----------------------------------------------------------------------------------------
def test_router_nan_inf_rows_give_valid_distinct_ids():
    g = torch.Generator().manual_seed(1)
    lg = torch.randn(6, 256, generator=g)
    lg[0] = float("nan")
    lg[1, torch.rand(256, generator=g) < 0.9] = float("nan")
    lg[2] = float("inf")
    lg[3] = float("-inf")
    lg[4, ::2] = float("nan")
    lg[4, 1::2] = float("-inf")
    bias = torch.randn(256, generator=g) * 0.1
    w, ids = sqrtsoftplus_topk(lg.to(DEVICE), bias.to(DEVICE))
    ids = ids.cpu()
    for row in ids.tolist():
        assert len(set(row)) == 6 and all(0 <= i < 256 for i in row)
    assert ids[0].tolist() == list(range(6))           # all NaN: the lowest ids
    assert not torch.isnan(w[3]).any()                  # all -inf: scores 0, bias decides
    assert ids[4].tolist() == R.select_topk(bias.double()[None] + R.sqrt_softplus(lg[4:5]), 6)[0].tolist()


def test_router_ties_pick_lowest_ids():
    lg = torch.zeros(2, 64)
    w, ids = sqrtsoftplus_topk(lg.to(DEVICE), torch.zeros(64, device=DEVICE), topk=6)
    assert ids.cpu().tolist() == [list(range(6))] * 2
    assert torch.allclose(w.cpu(), torch.full((2, 6), 0.25))


def test_router_hash_and_scaling():
    g = torch.Generator().manual_seed(2)
    lg = torch.randn(4, 32, generator=g)
    tbl = torch.stack([torch.randperm(32, generator=g)[:6] for _ in range(10)]).to(torch.int32)
    tbl[3, 2] = 40
    tok = torch.tensor([3, 0, 9, 12])
    w, ids = sqrtsoftplus_topk(lg.to(DEVICE), None, 6, 1.5, tok.to(DEVICE), tbl.to(DEVICE))
    rw, rids = R.sqrtsoftplus_topk(lg, None, 6, 1.5, tok, tbl)
    assert torch.equal(ids.cpu(), rids)
    assert ids[0, 2] == -1 and w[0, 2] == 0 and (ids[3] == -1).all() and (w[3] == 0).all()
    assert compare(w.cpu(), rw, "float32")
    assert torch.allclose(w.cpu()[:3].sum(1), torch.full((3,), 1.5))


def test_router_bad_inputs():
    lg = torch.randn(3, 16, device=DEVICE)
    with pytest.raises(TypeError, match="router_logits"):
        sqrtsoftplus_topk(lg.to(torch.int32))
    with pytest.raises(ValueError, match="topk"):
        sqrtsoftplus_topk(lg, topk=17)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        sqrtsoftplus_topk(lg, torch.zeros(15, device=DEVICE))
    with pytest.raises(ValueError, match="tid2eid"):
        sqrtsoftplus_topk(lg, input_ids=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="tid2eid"):
        sqrtsoftplus_topk(lg, topk=6, input_ids=torch.zeros(3, dtype=torch.int32, device=DEVICE),
                          tid2eid=torch.zeros(5, 4, dtype=torch.int32, device=DEVICE))


# ---- loader ------------------------------------------------------------------------------------------
def _write_ckpt(tmp_path, E=3, D=256, I=256, stacked=False):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(3)
    q = {wn: torch.randint(-8, 8, (E,) + ((I, D) if wn != "w2" else (D, I)), generator=g, dtype=torch.int8)
         for wn in ("w1", "w3", "w2")}
    s = {wn: torch.rand(E, v.shape[1], v.shape[2] // 128, generator=g).bfloat16() for wn, v in q.items()}
    pre = "layers.1.ffn"
    t = {f"{pre}.gate.weight": torch.randn(E, D, generator=g).bfloat16(),
         f"{pre}.gate.bias": torch.randn(E, generator=g)}
    if stacked:
        t[f"{pre}.experts.w13_weight_packed"] = R.pack_int4(torch.cat([q["w1"], q["w3"]], 1))
        t[f"{pre}.experts.w13_weight_scale"] = torch.cat([s["w1"], s["w3"]], 1)
        t[f"{pre}.experts.w2_weight_packed"] = R.pack_int4(q["w2"])
        t[f"{pre}.experts.w2_weight_scale"] = s["w2"]
    else:
        for e in range(E):
            for wn in ("w1", "w3", "w2"):
                t[f"{pre}.experts.{e}.{wn}.weight_packed"] = R.pack_int4(q[wn][e])
                t[f"{pre}.experts.{e}.{wn}.weight_scale"] = s[wn][e].clone()
                t[f"{pre}.experts.{e}.{wn}.weight_shape"] = torch.tensor(list(q[wn][e].shape))
    save_file(t, str(tmp_path / "model-00001.safetensors"))
    return q, s


@pytest.mark.parametrize("stacked", [False, True])
def test_loader_reads_pack_quantized_layout_with_tp(tmp_path, stacked):
    from ds4lab.checkpoint.moe_loader import load_moe_layer
    q, s = _write_ckpt(tmp_path, stacked=stacked)
    full = load_moe_layer(tmp_path, layer=1)
    assert full.w13_packed.dtype == torch.int32 and full.w13_packed.shape == (3, 512, 32)
    assert torch.equal(R.unpack_int4(full.w13_packed), torch.cat([q["w1"], q["w3"]], 1))
    assert torch.equal(full.w2_scale, s["w2"])
    assert full.e_score_correction_bias.dtype == torch.float32
    r1 = load_moe_layer(tmp_path, layer=1, tp=2, rank=1)
    assert torch.equal(R.unpack_int4(r1.w13_packed), torch.cat([q["w1"][:, 128:], q["w3"][:, 128:]], 1))
    assert torch.equal(R.unpack_int4(r1.w2_packed), q["w2"][:, :, 128:])
    assert torch.equal(r1.w2_scale, s["w2"][:, :, 1:])
    with pytest.raises(ValueError, match="multiple of 128"):
        load_moe_layer(tmp_path, layer=1, tp=4, rank=0)
    with pytest.raises(KeyError):
        load_moe_layer(tmp_path, layer=2)
