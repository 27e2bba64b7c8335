"""W4A16 MoE decode in one launch (issue 20, moe1): variant "fused" (``_dec_fused_kernel``) adds the routed
experts into a float32 ``out`` with atomics; the other paths' ``accumulate=True`` (their last launch adds).

Budget: ``out - out0`` is judged against the float64 reference on the bf16 budget the family's decode
rows use. The kernel's own error is h rounded to fp16 (2^-11 relative per h element, as the two-launch path
stores it), fp32 accumulation, and the unordered fp32 adds into ``out``: each element takes
``topk * inter / BLOCK_I + 1`` adds (here <= 6 * 8 + 1 = 49), each rounding by <= 2^-24 of the running
|sum| (<= |out0| + sum |terms| ~ 10 here): <= 49 * 6e-8 * 10 = 3e-5 absolute, far inside atol 1e-2.
Worst seen over the draws here: max |err| ~7e-3 against |ref| up to ~4 (the fp16 h; below the budget's
atol + rtol |ref|). A deliberately broken output (one pair's term dropped) fails."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare
from ds4lab.reference import moe as R
from ds4lab_kernels import moe_w4a16 as K
from test_moe import MMAQ, PRE, DEC, _weights

pytestmark = pytest.mark.interp

FUSED = dict(K._INTERP["fused"])            # BLOCK_I 64, tl.dot down projection
FUSED_I16 = dict(FUSED, BLOCK_I=16, BLOCK_D=128)
FUSED_FMA = dict(FUSED, BLOCK_I=32, w2="fma", xperm=0)


def _inputs(T, k, E=8, seed=0, D=256, I=128):
    w = _weights(E=E, D=D, I=I, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    tw = (torch.rand(T, k, generator=g) + 0.1).float()
    out0 = torch.randn(T, D, generator=g).float()
    return x, w, tw, ids, out0


def _dev(d):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def _run(x, w, tw, ids, out0, cfg, **kw):
    out = out0.clone().to(DEVICE)
    r = K.fused_moe_w4a16(**_dev({"x": x, **w, "topk_weights": tw, "topk_ids": ids}), out=out, accumulate=True,
                          config=cfg, **kw)
    assert r is out
    return out.cpu()


def _ref(x, w, tw, ids, limit=10.0):
    ids = torch.where(ids >= w["w13_packed"].shape[0], torch.full_like(ids, -1), ids)
    # float64 routed sum (accumulate into zeros: no bf16 rounding of the reference)
    return R.fused_moe_w4a16(x, **w, topk_weights=tw, topk_ids=ids, swiglu_limit=limit,
                             out=torch.zeros(x.shape, dtype=torch.float64), accumulate=True)


def _check(out, out0, ref):
    rep = compare(out.double() - out0.double(), ref.double(), "bfloat16")
    assert rep, rep.summary()


@pytest.mark.parametrize("T,k,cfg", [(1, 2, FUSED), (1, 6, FUSED_I16), (2, 6, FUSED_FMA), (5, 3, FUSED),
                                     (4, 6, FUSED_FMA), (3, 4, FUSED_I16)],
                         ids=["t1k2", "t1k6_i16", "t2k6_fma", "t5k3", "t4k6_fma", "t3k4_i16"])
def test_fused_adds_the_routed_experts(T, k, cfg):
    x, w, tw, ids, out0 = _inputs(T, k, seed=T * 10 + k)
    out = _run(x, w, tw, ids, out0, cfg)
    ref = _ref(x, w, tw, ids)
    _check(out, out0, ref)
    # a deliberately broken output (the last pair's term left out) fails the same check
    tw2 = tw.clone()
    tw2[-1, -1] = 0.0
    broken = out.double() - ref + _ref(x, w, tw2, ids)
    assert not compare(broken.double() - out0.double(), ref.double(), "bfloat16")


def test_fused_adversarial_routing():
    """All tokens on one expert (20 pairs: two leader tiles of 16 + 4), the same expert twice in one token,
    zero routing weights, ids -1 and >= E skipped, an expert picked by every token in another slot."""
    T, k, E = 20, 2, 8
    x, w, tw, ids, out0 = _inputs(T, k, E=E, seed=5)
    ids[:, 0] = 3
    ids[:, 1] = torch.arange(T, dtype=torch.int32) % E
    ids[0, 1] = 3                      # expert 3 twice in token 0
    ids[1, 1] = -1
    ids[2, 1] = E                      # out of range: skipped
    tw[4] = 0.0                        # zero routing weights
    tw[5, 0] = 0.0
    for cfg in (FUSED, FUSED_FMA):
        out = _run(x, w, tw, ids, out0, cfg)
        _check(out, out0, _ref(x, w, tw, ids))
        assert torch.equal(out[4], out0[4])   # 0 * finite adds exactly 0


def test_fused_clamp_and_nan_rows():
    """gate/up far past the clamp (w13 scales x 40: |g|, |u| >> 10) on a tight-scan batch, and a NaN x row
    that stays in its own token's row (the other rows equal a clean run up to the unordered fp32 adds)."""
    x, w, tw, ids, out0 = _inputs(3, 4, seed=7)
    w["w13_scale"] = (w["w13_scale"].float() * 40).bfloat16()
    ref = _ref(x, w, tw, ids)
    gu = x.double() @ R.dequant_int4(w["w13_packed"], w["w13_scale"])[ids[0, 0]].double().T
    assert gu.abs().max() > 20              # the clamp is hit
    out = _run(x, w, tw, ids, out0, FUSED_I16)
    _check(out, out0, ref)
    xn = x.clone()
    xn[1, 3] = float("nan")
    bad = _run(xn, w, tw, ids, out0, FUSED_I16)
    assert bad[1].isnan().all()
    assert torch.allclose(bad[[0, 2]], out[[0, 2]], rtol=1e-5, atol=1e-5)


def test_every_path_accumulates():
    """accumulate=True on the two-launch rows (the mma top-k tail and prefill's top-k sum add in their last
    launch; the older decode variant adds its result once) gives the fused row's sum; the fused row agrees
    with the mma row to fp32 noise (same fp16 h, same products)."""
    x, w, tw, ids, out0 = _inputs(4, 3, seed=11)
    ref = _ref(x, w, tw, ids)
    fused = _run(x, w, tw, ids, out0, FUSED)
    for cfg in (MMAQ, PRE, DEC):
        got = _run(x, w, tw, ids, out0, cfg)
        _check(got, out0, ref)
    mma = _run(x, w, tw, ids, out0, MMAQ)
    assert torch.allclose(fused, mma, rtol=1e-5, atol=1e-5), (fused - mma).abs().max()


def test_pick_config_accumulate():
    dev = torch.device("cpu")
    assert K.pick_config(6, dev, accumulate=True)["variant"] == "fused"
    assert K.pick_config(K.INTERP_FUSED_MAX_PAIRS + 1, dev, accumulate=True).get("variant") != "fused"
    assert K.pick_config(6, dev).get("variant") != "fused"
    for arch in ("sm_89", "sm_90"):
        assert K.CONFIGS[arch][K.FUSED_DEFAULT]["variant"] == "fused"


def test_fused_bad_out_and_config():
    x, w, tw, ids, out0 = _inputs(2, 3, seed=13)
    inp = _dev({"x": x, **w, "topk_weights": tw, "topk_ids": ids})
    f = K.fused_moe_w4a16
    with pytest.raises(ValueError, match="out"):
        f(**inp, accumulate=True, config=FUSED)
    with pytest.raises(TypeError, match="out"):
        f(**inp, out=out0.bfloat16().to(DEVICE), accumulate=True, config=FUSED)
    with pytest.raises(ValueError, match="out"):
        f(**inp, out=torch.zeros(2, 128, device=DEVICE), accumulate=True, config=FUSED)
    with pytest.raises(ValueError, match="out"):
        f(**inp, out=torch.zeros(3, 256, device=DEVICE), accumulate=True, config=FUSED)
    with pytest.raises(ValueError, match="out"):
        f(**inp, out=torch.zeros(2, 256, device="meta"), accumulate=True, config=FUSED)
    with pytest.raises(ValueError, match="out"):
        f(**inp, out=torch.zeros(256, 2, device=DEVICE).t(), accumulate=True, config=FUSED)
    # the fused row behind the overwrite API: a zeroed fp32 sum rounded once to bf16
    got = f(**inp, config=FUSED)
    assert got.dtype == torch.bfloat16
    _check(got.float(), torch.zeros_like(out0), _ref(x, w, tw, ids))
    with pytest.raises(ValueError, match="BLOCK_I"):
        f(**inp, out=out0.clone().to(DEVICE), accumulate=True, config=dict(FUSED, BLOCK_I=8))
    # T = 0: nothing to add, out returned untouched
    e = torch.zeros(0, 256, device=DEVICE)
    assert f(**_dev({"x": x[:0], **w, "topk_weights": tw[:0], "topk_ids": ids[:0]}), out=e, accumulate=True) is e
