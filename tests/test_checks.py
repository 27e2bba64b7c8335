"""ds4lab_kernels/_checks: the one argument-check dialect, and every float scalar a launcher hands
a kernel going through ``fp32_scalar`` (issue 23: ``eps=1e-40`` used to crash deep in Triton with
"Expected dtype fp32 but got fp64", because Triton types a float outside the fp32 normal range as
fp64)."""
import math
import re

import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.registry import all_specs
from ds4lab_kernels import _checks as check

SPECS = {s.name: s for s in all_specs()}


# ---- the helpers ----------------------------------------------------------------------------------
def test_tensor_names_the_argument():
    t = torch.zeros(2, 3)
    assert check.tensor("x", t, (torch.float32,), 2) is t
    with pytest.raises(TypeError, match=r"^x: expected a torch.Tensor, got list$"):
        check.tensor("x", [1.0], torch.float32)
    with pytest.raises(TypeError, match=r"^x: dtype float32 not supported \(expected bfloat16, float16\)$"):
        check.tensor("x", t, (torch.bfloat16, torch.float16))
    with pytest.raises(ValueError, match=r"^x: expected 3 or 4 dims, got shape \(2, 3\)$"):
        check.tensor("x", t, torch.float32, (3, 4))
    with pytest.raises(ValueError, match=r"^x: last dim must be contiguous"):
        check.last_dim_contiguous("x", torch.zeros(3, 2).t())
    check.last_dim_contiguous("x", torch.zeros(0, 2).t())  # empty: nothing is read
    with pytest.raises(ValueError, match=r"^x: must be contiguous"):
        check.contiguous("x", torch.zeros(4, 4)[:, :2])
    with pytest.raises(ValueError, match=r"^x: expected shape \(3,\), got \(2, 3\)$"):
        check.shape("x", t, (3,))
    check.same_device("a", t, b=torch.zeros(1), c=None)
    with pytest.raises(ValueError, match=r"^b: on meta, but a is on cpu"):
        check.same_device("a", t, b=torch.zeros(1, device="meta"))


def test_scale_tensor_views_e8m0_as_bytes():
    e8 = getattr(torch, "float8_e8m0fnu", None)
    if e8 is not None:
        s = torch.ones(2, 2).to(e8)
        v = check.scale_tensor("s", s, (torch.float32, torch.uint8))
        assert v.dtype == torch.uint8 and v.data_ptr() == s.data_ptr() and (v == 127).all()
    with pytest.raises(TypeError, match=r"^s: dtype float16 .*UE8M0 exponent bytes"):
        check.scale_tensor("s", torch.ones(2).half(), (torch.float32, torch.uint8))


@pytest.mark.parametrize("v", [0.0, -0.0, 1e-38 * 1.18, 2.0 ** -126, 1.0, -3.0, 3.4e38, 7])
def test_fp32_scalar_accepts_zero_and_normals(v):
    assert check.fp32_scalar("v", v) == float(v)


@pytest.mark.parametrize("v,kw,why", [
    (1e-40, {}, "float32 normal range"), (2.0 ** -127, {}, "float32 normal range"),
    (-1e-39, {}, "float32 normal range"), (3.5e38, {}, "float32 normal range"),
    (float("nan"), {}, "NaN"), (float("inf"), {}, "finite"), (-float("inf"), {}, "finite"),
    (0.0, {"positive": True}, "> 0"), (-1.0, {"nonnegative": True}, ">= 0"),
    (True, {}, "real number"), ("1e-6", {}, "real number"),
])
def test_fp32_scalar_rejects(v, kw, why):
    with pytest.raises(ValueError, match="^" + re.escape(f"v={v!r}: ") + ".*" + re.escape(why)):
        check.fp32_scalar("v", v, **kw)


def test_fp32_scalar_bounds_are_tritons():
    """The accepted range is exactly the one Triton's typing keeps in fp32 (semantic.to_tensor_type)."""
    from triton.language import semantic
    sem = semantic.TritonSemantic.__new__(semantic.TritonSemantic) if hasattr(semantic, "TritonSemantic") else None
    if sem is None or not hasattr(sem, "to_tensor_type"):
        pytest.skip("triton without TritonSemantic.to_tensor_type")
    for v in (check.FP32_MIN_NORMAL, check.FP32_MAX, math.nextafter(check.FP32_MIN_NORMAL, 0),
              math.nextafter(check.FP32_MAX, math.inf), 1e-40, 1.0):
        fp32 = str(sem.to_tensor_type(v)) == "fp32"
        try:
            check.fp32_scalar("v", v)
            ok = True
        except ValueError:
            ok = False
        assert ok == fp32, (v, fp32)


# ---- every float scalar of every launcher ---------------------------------------------------------
# (spec, argument, values that must be refused); 1e-40 (subnormal), inf and nan everywhere, and a
# negative where the argument must be positive (eps floors, softmax scale, clamp limit, scaling).
# Zero-or-positive eps terms (mHC) accept 0.0; the post multiplier is any finite float.
BAD = [1e-40, float("inf"), float("nan")]
SCALARS = [
    ("per_token_group_quant_fp8", "eps", BAD + [-1e-6, 0.0]),
    ("inv_rope_fp8_quant", "eps", BAD + [-1e-6, 0.0]),
    ("mhc_pre", "rms_eps", BAD + [-1e-6]),
    ("mhc_pre", "hc_pre_eps", BAD + [-1e-6]),
    ("mhc_pre", "hc_sinkhorn_eps", BAD + [-1e-6]),
    ("mhc_pre", "norm_eps", BAD + [-1e-6]),
    ("mhc_pre", "hc_post_mult", BAD),
    ("mhc_pre_broadcast", "rms_eps", BAD + [-1e-6]),
    ("mhc_pre_broadcast", "hc_post_mult", BAD),
    ("mhc_fused_post_pre", "hc_sinkhorn_eps", BAD + [-1e-6]),
    ("mhc_fused_post_pre", "hc_post_mult", BAD),
    ("hc_head", "rms_eps", BAD + [-1e-6]),
    ("hc_head", "hc_eps", BAD + [-1e-6]),
    ("sparse_mla_decode", "scale", BAD + [-0.04, 0.0, 3e38]),  # 3e38 * log2(e) leaves fp32
    ("sparse_mla_prefill", "scale", BAD + [-0.04, 0.0]),
    ("sqrtsoftplus_topk", "routed_scaling_factor", BAD + [-1.5, 0.0]),
    ("fused_moe_w4a16", "swiglu_limit", BAD + [-10.0, 0.0, 1000.0]),  # > 255: fp16 h would overflow
]


def _inputs(name):
    spec = SPECS[name]
    return spec, spec.make_inputs(spec.test_shapes[0], spec.cases[0], 0, DEVICE)


@pytest.mark.interp
@pytest.mark.parametrize("name,arg,values", SCALARS, ids=[f"{n}-{a}" for n, a, _ in SCALARS])
def test_every_float_scalar_is_checked(name, arg, values):
    spec, inputs = _inputs(name)
    fn = spec.launcher_fn()
    for v in values:
        with pytest.raises(ValueError, match="^" + re.escape(f"{arg}={v!r}: ")):
            fn(**{**inputs, arg: v})


@pytest.mark.interp
@pytest.mark.parametrize("name,arg,value", [
    ("per_token_group_quant_fp8", "eps", 2.0 ** -126),   # the smallest normal: accepted and runs
    ("inv_rope_fp8_quant", "eps", 2.0 ** -126),
    ("mhc_pre", "rms_eps", 0.0),
    ("fused_moe_w4a16", "swiglu_limit", 255.0),
])
def test_edge_values_still_run_and_match(name, arg, value):
    spec, inputs = _inputs(name)
    inputs = {**inputs, arg: value}
    out = spec.launcher_fn()(**inputs)
    reports = spec.check(out, spec.reference_fn()(**inputs), inputs)
    assert reports and all(reports), [r.summary() for r in reports if not r]
