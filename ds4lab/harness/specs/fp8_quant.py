"""Registry entry: per-token-group FP8 activation quant (SPEC.md §2 item 1)."""
from __future__ import annotations

import torch

from ds4lab.geometry import op_shapes
from ds4lab.harness import costs
from ds4lab.harness.numerics import compare_exact
from ds4lab.harness.registry import KernelSpec, kernel_configs, reference_baseline, register

GROUP = 128
SCALE_FMTS = ("fp32", "pow2", "ue8m0", "ue8m0_packed")
CASES = ("random", "zero_groups", "tiny_groups", "nan_inf_rows", "midpoints", "outliers")


def make_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """bf16 activations ``[M, K]``. ``random``: normal rows with log-uniform magnitudes over
    1e-3..1e3 (activations differ by orders of magnitude across tokens). Adversarial cases overwrite
    parts of it: all-zero groups, 1e-30 groups, NaN / ±inf entries, values that land exactly on
    e4m3 rounding midpoints, single huge outliers per group."""
    M, K = shape["M"], shape["K"]
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(M, 1).uniform_(-6.9, 6.9, generator=g))
    x = torch.randn(M, K, generator=g) * mag
    G = K // GROUP
    if case == "zero_groups" and M:
        x.view(M, G, GROUP)[::2, ::2] = 0.0
    elif case == "tiny_groups" and M:
        x.view(M, G, GROUP)[:, 0] = 1e-30 * torch.randn(M, GROUP, generator=g)
    elif case == "nan_inf_rows" and M:
        x[0, 3] = float("nan")
        if M > 1:
            x[1, GROUP + 1] = float("inf")
            x[-1, -1] = float("-inf")
    elif case == "midpoints" and M:
        # group max 448 * 2^k so the scale is a power of two and x/s lands on e4m3 midpoints
        # (e.g. 1.0625 between 1.0 and 1.125): ties-to-even decides every value
        base = torch.tensor([1.0625, 1.1875, 3.25, 0.0146484375, 0.001953125 * 1.5, 448.0])
        idx = torch.randint(0, len(base), (M, K), generator=g)
        x = base[idx] * torch.where(torch.rand(M, K, generator=g) < 0.5, -1.0, 1.0)
        x.view(M, G, GROUP)[:, :, 0] = 448.0
    elif case == "outliers" and M:
        x.view(M, G, GROUP)[:, :, 7] = 3e4
    elif case != "random" and case not in CASES:
        raise ValueError(f"case={case!r}: known cases {CASES}")
    return {"x": x.to(torch.bfloat16).to(device), "group_size": GROUP,
            "scale_fmt": shape.get("scale_fmt", "fp32")}


def bench_shapes(cfg, tp: int) -> list[dict]:
    ops = op_shapes(cfg, tp)
    ks = sorted({ops[n].dims["K"] for n in ("wq_a_wkv", "wq_b", "wo_b", "shared_down")})
    return [{"M": m, "K": k, "scale_fmt": "ue8m0"} for k in ks for m in (1, 16, 256, 2048, 8192)]


def check(out, ref, inputs) -> list:
    (q, s), (rq, rs) = out, ref
    return [compare_exact(q, rq, "q (fp8 bytes)"), compare_exact(s, rs, f"scales ({inputs['scale_fmt']})")]


register(KernelSpec(
    name="per_token_group_quant_fp8",
    family="fp8_quant",
    launcher="ds4lab_kernels.fp8_quant:per_token_group_quant_fp8",
    reference="ds4lab.reference.quant:per_token_group_quant_fp8",
    make_inputs=make_inputs,
    cases=CASES,
    # M in {1, 7, 64, 300} (issue 4), each with one scale format; tests/test_fp8_quant.py checks
    # that the formats agree with each other on one input
    test_shapes=[{"M": 1, "K": 128, "scale_fmt": "fp32"}, {"M": 7, "K": 512, "scale_fmt": "pow2"},
                 {"M": 64, "K": 256, "scale_fmt": "ue8m0"}, {"M": 300, "K": 384, "scale_fmt": "ue8m0_packed"},
                 {"M": 33, "K": 640, "scale_fmt": "fp32"}],
    bench_shapes=bench_shapes,
    flops=costs.FLOPS["per_token_group_quant_fp8"],
    min_bytes=costs.MIN_BYTES["per_token_group_quant_fp8"],
    check=check,
    configs=kernel_configs("fp8_quant"),
    baselines={"torch_eager": reference_baseline("ds4lab.reference.quant:per_token_group_quant_fp8")},
    bound="memory",
    aot_shape={"M": 4096, "K": 4096, "scale_fmt": "ue8m0"},
))
