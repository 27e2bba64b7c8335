"""FP8 GEMM decode candidates (issue 20, gemm5): the CUDA-core GEMV rows (``KIND="gemv"``), the MMA
rows with scale prefetch and a split floor, and the clamped-SwiGLU prologue of
``w8a8_block_fp8_linear`` (``act="swiglu_clamp"``): numerics against the torch reference on the
registry's adversarial cases, bit-identity of every fused path to its two-launch twin, the host-side
tile / split rules, bad arguments, and the sm_89 compile of the new variants at the real TP=4 shapes."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare_exact
from ds4lab.harness.specs import fp8_gemm as S
from ds4lab_kernels import fp8_gemm as G
from ds4lab_kernels import fp8_quant
from ds4lab_kernels.norm_rope import swiglu_clamp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T89 = G.CONFIGS["sm_89"]
# the interpreter runs programs one by one: the GEMV tests take 32-column programs (the "auto" width
# at a 128-SM count would be 4, i.e. 8x the programs); test_gemv_tiles_... checks the auto rule
NARROW = {"BLOCK_N": 32}


def _check_all(out, inputs):
    reps = S.check(out, S.R.fp8_gemm_nt(**inputs), inputs)
    assert all(reps), [r.summary() for r in reps]


@pytest.mark.interp
@pytest.mark.parametrize("label,cfg_extra,shape", [
    ("gemv", NARROW, {"M": 1, "N": 40, "K": 512, "a_fmt": "ue8m0_packed", "b_fmt": "ue8m0"}),
    # 5 rows over 4-row programs (two m-tiles), odd N, fp32 / pow2 scales
    ("gemv_r4", NARROW, {"M": 5, "N": 37, "K": 384, "a_fmt": "fp32", "b_fmt": "pow2"}),
    # split-K in one launch (5 k-blocks -> 3 splits of 2/2/1) and chunks narrower than a split
    ("gemv", {"SPLIT_K": 3, "TILE_BYTES": 1024, "BLOCK_N": 8}, {"M": 2, "N": 24, "K": 640, "a_fmt": "ue8m0",
                                                                   "b_fmt": "ue8m0_packed"}),
])
def test_gemv_matches_reference_on_adversarial_cases(label, cfg_extra, shape):
    cfg = {**T89[label], **cfg_extra}
    for case in S.CASES:
        inputs = S.make_inputs(shape, case, 3, DEVICE)
        _check_all(G.fp8_gemm_nt(**inputs, config=cfg), inputs)


@pytest.mark.interp
@pytest.mark.parametrize("label,M", [("gemv", 1), ("gemv_r4", 6), ("decode_pf", 1), ("decode_pf", 3)])
def test_fused_candidates_are_bit_identical_to_quant_then_gemm(label, M):
    """Zero, 1e-30, bf16-subnormal, NaN, ±inf and 2^108 groups: the fused quant of the candidate
    rows gives the same bits as the quant kernel followed by the same config on fp8 A."""
    K, N = 512, 44
    g = torch.Generator().manual_seed(5)
    x = torch.randn(M, K, generator=g) * 3
    x[0, :128] = 0.0
    x[M - 1, 128:256] = 1e-30
    x[0, 256:384] = 2.0 ** -130
    x[M // 2, 400] = 448.0 * 2.0 ** 100
    if M > 2:
        x[1, 5] = float("nan")
        x[2, 300] = float("-inf")
    x = x.bfloat16().to(DEVICE)
    w = S.make_linear_inputs({"M": 1, "N": N, "K": K, "b_fmt": "ue8m0"}, "random", 9, DEVICE)
    cfg = {**T89[label], "SPLIT_K": 2, **(NARROW if label.startswith("gemv") else {})}
    q, s = fp8_quant.per_token_group_quant_fp8(x, 128, scale_fmt="ue8m0")
    two = G.fp8_gemm_nt(q, s, w["weight"], w["weight_scale"], config=cfg)
    fused = G.w8a8_block_fp8_linear(x, w["weight"], w["weight_scale"], config=cfg, fused=True)
    assert compare_exact(fused, two, f"{label} fused vs quant+gemm")
    _check_all(two, {"a": q, "a_scale": s, "b": w["weight"], "b_scale": w["weight_scale"]})


@pytest.mark.interp
@pytest.mark.parametrize("a_fmt", ["fp32", "ue8m0", "ue8m0_packed"])
def test_scale_prefetch_is_bit_identical_to_in_loop_scale_loads(a_fmt):
    """decode_pf's one-ahead scale loads change when the scales arrive, not their values: same bits
    as the same tile without the prefetch, also for packed UE8M0 and a k-block count that is no
    multiple of 4, with split-K."""
    inputs = S.make_inputs({"M": 3, "N": 96, "K": 1152, "a_fmt": a_fmt, "b_fmt": "ue8m0_packed"}, "random", 4, DEVICE)
    for extra in ({"SPLIT_K": 1}, {"SPLIT_K": 3}):
        cfg = {**T89["decode_pf"], **extra}
        got = G.fp8_gemm_nt(**inputs, config=cfg)
        assert compare_exact(got, G.fp8_gemm_nt(**inputs, config={**cfg, "SCALE_PREFETCH": 0}), f"prefetch {extra}")
    _check_all(got, inputs)


@pytest.mark.interp
@pytest.mark.parametrize("label,M", [("decode", 1), ("decode", 3), ("gemv", 1), ("gemv_r4", 3)])
def test_swiglu_prologue_is_bit_identical_to_swiglu_kernel_then_linear(label, M):
    """``act="swiglu_clamp"``: the clamped SwiGLU of the gate/up row in the GEMM's prologue (single-row
    path at M=1, full tile above, GEMV) == norm_rope.swiglu_clamp + quant + GEMM, bit for bit, with
    gate/up values beyond the clamp, NaN and -inf; and within budget of the reference GEMM."""
    K, N, L = 384, 70, 10.0
    g = torch.Generator().manual_seed(2 + M)
    gu = torch.randn(M, 2 * K, generator=g) * 8
    gu[0, 3] = 60.0          # gate above the clamp
    gu[0, K + 7] = -60.0     # up below -limit
    if M > 1:
        gu[1, 10] = float("nan")
        gu[M - 1, K + 200] = float("-inf")
    gu = gu.bfloat16().to(DEVICE)
    w = S.make_linear_inputs({"M": 1, "N": N, "K": K, "b_fmt": "ue8m0"}, "random", 6, DEVICE)
    cfg = {**T89[label], "SPLIT_K": 2, **(NARROW if label.startswith("gemv") else {})}
    kw = dict(config=cfg, act="swiglu_clamp", act_limit=L)
    fused = G.w8a8_block_fp8_linear(gu, w["weight"], w["weight_scale"], fused=True, **kw)
    two = G.w8a8_block_fp8_linear(gu, w["weight"], w["weight_scale"], fused=False, **kw)
    h = swiglu_clamp(gu, L)
    assert compare_exact(two, G.w8a8_block_fp8_linear(h, w["weight"], w["weight_scale"], config=cfg, fused=False),
                         "two-launch act path")
    assert compare_exact(fused, two, f"{label} act fused vs swiglu+quant+gemm")
    if M > 1:
        assert fused[1].isnan().all() and not fused[0].isnan().any()
    inp = {"x": h, "weight": w["weight"], "weight_scale": w["weight_scale"]}
    reps = S.check_linear(two, S.R.w8a8_block_fp8_linear(**inp), inp)
    assert all(reps), [r.summary() for r in reps]


@pytest.mark.interp
@pytest.mark.parametrize("label,M,split,act", [("decode", 1, 1, False), ("decode", 3, 2, True), ("gemv", 1, 2, True),
                                              ("gemv_r4", 3, 1, False), ("decode_pf", 1, 2, False)])
def test_fp32_output_is_the_unrounded_accumulator(label, M, split, act):
    """``out_dtype=torch.float32`` (the shared expert's down projection the routed experts add into, issue 20
    moe1): every decode path (MMA / GEMV, split-K tail or not, fused quant, SwiGLU prologue, two-launch)
    stores the fp32 accumulator; rounded to bf16 it is bit-equal to the bf16 output of the same config."""
    K, N = 384, 70
    g = torch.Generator().manual_seed(30 + M)
    x = (torch.randn(M, 2 * K if act else K, generator=g) * 3).bfloat16().to(DEVICE)
    w = S.make_linear_inputs({"M": 1, "N": N, "K": K, "b_fmt": "ue8m0"}, "random", 8, DEVICE)
    cfg = {**T89[label], "SPLIT_K": split, **(NARROW if label.startswith("gemv") else {})}
    kw = dict(config=cfg, act="swiglu_clamp", act_limit=10.0) if act else dict(config=cfg)
    for fused in (True, False):
        b16 = G.w8a8_block_fp8_linear(x, w["weight"], w["weight_scale"], fused=fused, **kw)
        f32 = G.w8a8_block_fp8_linear(x, w["weight"], w["weight_scale"], fused=fused, out_dtype=torch.float32, **kw)
        assert f32.dtype == torch.float32 and b16.dtype == torch.bfloat16
        assert compare_exact(f32.bfloat16(), b16, f"{label} fp32 out rounded vs bf16 out (fused={fused})")
        assert not torch.equal(f32, b16.float())      # really unrounded
    with pytest.raises(TypeError, match="out_dtype"):
        G.w8a8_block_fp8_linear(x, w["weight"], w["weight_scale"], out_dtype=torch.float16, **kw)


@pytest.mark.interp
@pytest.mark.parametrize("kw,exc,match", [
    ({"act": "gelu", "act_limit": 10.0}, ValueError, "act='gelu'"),
    ({"act": "swiglu_clamp"}, ValueError, "act_limit"),
    ({"act": "swiglu_clamp", "act_limit": -1.0}, ValueError, "act_limit"),
    ({"act": "swiglu_clamp", "act_limit": 10.0, "x": torch.zeros(1, 513, dtype=torch.bfloat16)}, ValueError,
     "x: act='swiglu_clamp' needs"),
    ({"act": "swiglu_clamp", "act_limit": 10.0, "x": torch.zeros(1, 512)}, TypeError, "x: dtype"),
    ({"act": "swiglu_clamp", "act_limit": 10.0, "x": torch.zeros(1, 1024, dtype=torch.bfloat16)}, ValueError,
     "weight: shape"),
    ({"config": {**T89["gemv"], "BLOCK_M": 8}}, ValueError, "config=.*GEMV row"),
    ({"config": {**T89["gemv"], "KIND": "simt"}}, ValueError, "config=.*KIND"),
    ({"config": {**T89["gemv"], "TILE_BYTES": 100}}, ValueError, "config=.*TILE_BYTES"),
])
def test_act_and_gemv_config_errors_name_the_argument(kw, exc, match):
    w = S.make_linear_inputs({"M": 1, "N": 32, "K": 256, "b_fmt": "ue8m0"}, "random", 1, "cpu")
    args = {"x": torch.zeros(1, 512, dtype=torch.bfloat16), "weight": w["weight"], "weight_scale": w["weight_scale"],
            **kw}
    if "act" not in kw:
        args["x"] = torch.zeros(1, 256, dtype=torch.bfloat16)
    args = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    with pytest.raises(exc, match=match):
        G.w8a8_block_fp8_linear(**args)


def test_gemv_tiles_and_split_floor_at_the_tp4_shapes():
    """Host rules at the TP=4 decode shapes on a 132-SM H200: GEMV programs hold their whole K in
    one chunk (no split, >= 256 programs); the split floor of decode_pf leaves shared_down (4
    k-blocks) unsplit while wq_a_wkv still splits."""
    dev = torch.device("cpu")
    from unittest import mock
    with mock.patch.object(G, "num_sms", lambda d: 132):
        for N, K, bn in ((1536, 4096, 4), (8192, 1024, 8), (4096, 2048, 4), (1024, 4096, 4), (4096, 512, 4)):
            cfg = T89["gemv"]
            got = G.gemv_block_n(cfg, 1, N, dev)
            assert got == bn, (N, K, got)
            assert G.gemv_ktile(cfg, got, K // 128) == K and N // got >= 256
            assert G._split_k(cfg, N // got, K // 128, dev) == 1
        assert G._split_k(T89["decode_pf"], 4096 // 32, 4, dev) == 1       # shared_down: no split
        assert G._split_k(T89["decode"], 4096 // 32, 4, dev) == 2          # the current default splits
        assert G._split_k(T89["decode_pf"], 1536 // 32, 32, dev) == 6      # wq_a_wkv: still 6
    assert G.gemv_ktile({**T89["gemv"], "TILE_BYTES": 8192}, 32, 32) == 256
    assert G.decode_candidates(1, "sm_90") == ("decode", "decode_16x64", "fq_16x32", "fq_16x64")
    assert "gemv" in G.decode_candidates(4, "sm_89") and "gemv" not in G.decode_candidates(16, "sm_89")
    # session 5's H200 rows made gemv_w8 the sm_89 M=1 default, session 9 gemv the plain M=2 one (gemv9); the
    # other new rows stay candidates
    assert set(G.GPU_DEFAULTS["sm_89"]) & {"gemv", "gemv_p8", "gemv_r4", "gemv_w8", "decode_pf"} == {"gemv_w8", "gemv"}
    assert G.config_label(1, "sm_89") == "gemv_w8" and G.config_label(3, "sm_89") == "decode"
    assert G.config_label(2, "sm_89") == "gemv" and G.config_label(1, "sm_90") == "decode_16x64"
    assert G.fused_config_label(2, "sm_89") == G.FUSED_M2_LABEL == "gemv"
    assert G.fused_config_label(2, "sm_90") == "decode_16x64" and G.fused_config_label(3, "sm_89") == "fq_16x64"
    assert G.config_label(1, "interp") == "decode"


def test_linear_config_takes_the_plain_row_for_a_quantized_input(monkeypatch):
    """``linear_config(a_quantized=True)`` (the model's producer-quant linears): the plain pick up to
    ``PLAIN_PICK_MAX_M`` tokens, the fused launch's tiles above; ``FUSED_M2_LABEL`` is read at call time (so a
    step A/B can set it)."""
    dev = torch.device("cuda")   # only its type is read: the sm_89 table on this CPU-only host
    monkeypatch.setattr(G, "arch_of", lambda d: "sm_89")
    T = G.CONFIGS["sm_89"]
    assert G.linear_config(1, dev, a_quantized=True) is T["gemv_w8"] is G.linear_config(1, dev)
    monkeypatch.setattr(G, "FUSED_M2_LABEL", "decode_16x64")
    assert G.linear_config(2, dev, a_quantized=True) is T["gemv"]
    assert G.linear_config(2, dev) is T["decode_16x64"]                 # the fused launch: its own M=2 label
    assert G.linear_config(3, dev, a_quantized=True) is T["fq_16x64"] is G.linear_config(3, dev)
    monkeypatch.setattr(G, "PLAIN_PICK_MAX_M", 0)
    assert G.linear_config(2, dev, a_quantized=True) is T["decode_16x64"]
    monkeypatch.setattr(G, "FUSED_M2_LABEL", "gemv")
    assert G.linear_config(2, dev) is T["gemv"]


@pytest.mark.aot
def test_new_variants_compile_for_sm89_without_spills():
    """The gemm5 variants at the shapes they run at (K decides the GEMV chunk, ``act`` and the
    single-row path are constexprs the registry's compile shape (M=16, K=4096; tests/test_aot.py,
    every row) does not reach): sm_89, no spills, within 101,376 B of shared memory."""
    code = r'''
import json, sys
from ds4lab.harness import aot
from ds4lab.harness.specs import fp8_gemm as S
from ds4lab_kernels import fp8_gemm as G
import torch
rows = []
def go(tag, fn):
    with aot.capture_compiles("sm_89") as cap:
        fn()
    for f, c in cap:
        rows.append({"tag": tag, "fn": f.__name__, **aot._inspect(c, "sm_89")})
T = G.CONFIGS["sm_89"]
for tag, M, N, K, label, act in (("wq_a_wkv gemv fused", 1, 1536, 4096, "gemv", None),
                                  ("shared_down gemv act", 1, 4096, 512, "gemv", "swiglu_clamp"),
                                  ("shared_down decode act", 1, 4096, 512, "decode", "swiglu_clamp")):
    w = S.make_linear_inputs({"M": 1, "N": N, "K": K, "b_fmt": "ue8m0"}, "random", 0, "cpu")
    x = torch.zeros(M, 2 * K if act else K, dtype=torch.bfloat16)
    go(tag, lambda: G.w8a8_block_fp8_linear(x, w["weight"], w["weight_scale"], config=T[label], fused=True,
                                            act=act, act_limit=10.0 if act else None))
print(json.dumps(rows))
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(rows) == 3, rows
    for r in rows:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["local"] == 0, r
        assert r["shared"] <= 101_376, r
    assert {r["fn"] for r in rows} == {"_fp8_gemv_kernel", "_fp8_gemm_nt_kernel"}
