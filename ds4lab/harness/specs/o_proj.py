"""Registry entries: the DeepSeek-V4 o-projection (SPEC.md §2 item 3, issue 5).

``inv_rope_fp8_quant`` (fused inverse RoPE + 1x128 FP8 quant), ``fp8_einsum_bhr_hdr_bhd`` (grouped
block-scaled FP8 ``wo_a``), ``bf16_einsum_bhr_hdr_bhd`` (the BF16 MTP drafter's ``wo_a``) and the
whole ``o_proj``. Shapes come from ``geometry.op_shapes(cfg, tp)["o_proj"]``.
"""
from __future__ import annotations

import math
import os

import torch

from ds4lab.geometry import DEFAULT_CONFIG, op_shapes
from ds4lab.harness import costs
from ds4lab.harness.numerics import Tolerance, fp8_mma_rel_error, compare, compare_exact
from ds4lab.reference.quant import ceil_pow2, encode_ue8m0, per_token_group_quant_fp8
from ds4lab.harness.registry import KernelSpec, register

GROUP = 128
HEAD_DIM = DEFAULT_CONFIG.head_dim            # 512
ROPE_DIM = DEFAULT_CONFIG.qk_rope_head_dim    # 64
HPG = DEFAULT_CONFIG.heads_per_o_group        # 8
BENCH_T = (1, 2, 4, 8, 16, 64, 512, 4096)
BENCH_POS = 8192      # cos/sin rows in bench inputs (the real cache has 1M rows; only T rows are read)
TEST_POS = 64


# ---- input helpers -------------------------------------------------------------------------------
def _gen(seed, device):
    return torch.Generator(device=device).manual_seed(int(seed))


def cos_sin_cache(n_pos: int, rope_dim: int = ROPE_DIM, theta: float = DEFAULT_CONFIG.rope_theta,
                  device="cpu") -> torch.Tensor:
    """vLLM layout ``[n_pos, rope_dim]`` float32, ``cos || sin`` (plain RoPE, mscale 1)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
    f = torch.arange(n_pos, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    return torch.cat([f.cos(), f.sin()], dim=-1).contiguous()


def block_quant_weight(w: torch.Tensor, fmt: str = "fp32"):
    """``[G, N, K]`` float -> (e4m3 ``[G, N, K]``, scales ``[G, N/128, K/128]`` fp32 or UE8M0 bytes)
    with one scale per 128x128 block (``amax/448``; ue8m0 rounds it up to a power of two)."""
    G, N, K = w.shape
    b = w.float().reshape(G, N // GROUP, GROUP, K // GROUP, GROUP)
    s = b.abs().amax(dim=(2, 4)).clamp_min(1e-10) / 448.0
    if fmt == "ue8m0":
        s = ceil_pow2(s)
    q = (b / s[:, :, None, :, None]).to(torch.float64).clamp(-448, 448).to(torch.float8_e4m3fn)
    q = q.reshape(G, N, K)
    return (q, encode_ue8m0(s)) if fmt == "ue8m0" else (q, s)


def _positions(T, n_pos, case, g, device):
    if case == "cache_end":
        return (n_pos - 1 - torch.arange(T, device=device) % min(n_pos, 4)).to(torch.int64)
    return torch.randint(0, n_pos, (T,), generator=g, device=device, dtype=torch.int64)


# ---- inv_rope_fp8_quant ----------------------------------------------------------------------------
ROPE_CASES = ("random", "zero_rows", "cache_end", "nan_rows", "outliers")


def rope_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """bf16 attention output ``[T, H, 512]`` (per-token magnitudes log-uniform 1e-2..1e2),
    positions, a cos/sin cache. Cases: zero rows, positions at the very end of the cache, a NaN in
    one head's rope part and an inf in another's nope part, single huge outliers."""
    T, H = shape["T"], shape["H"]
    n_pos = shape.get("P", TEST_POS)
    g = _gen(seed, device)
    mag = torch.exp(torch.empty(T, 1, 1, device=device).uniform_(-4.6, 4.6, generator=g))
    o = torch.randn(T, H, HEAD_DIM, generator=g, device=device) * mag
    if case == "zero_rows" and T:
        o[::2] = 0.0
        o[:, 1::3, 100:300] = 0.0
    elif case == "nan_rows" and T:
        o[0, 0, HEAD_DIM - 3] = float("nan")
        o[-1, -1, 5] = float("inf")
    elif case == "outliers" and T:
        o[:, :, HEAD_DIM - 1] = 3e4
        o[:, :, 7] = -1e-30
    elif case not in ROPE_CASES:
        raise ValueError(f"case={case!r}: known cases {ROPE_CASES}")
    return {"o": o.to(torch.bfloat16), "positions": _positions(T, n_pos, case, g, device),
            "cos_sin_cache": cos_sin_cache(n_pos, device=device), "heads_per_group": HPG,
            "quantize": shape.get("quantize", True), "scale_fmt": shape.get("scale_fmt", "ue8m0")}


def rope_check(out, ref, inputs) -> list:
    if not inputs["quantize"]:
        return [compare_exact(out, ref, "rotated bf16")]
    (q, s), (rq, rs) = out, ref
    return [compare_exact(q, rq, "q (fp8 bytes)"), compare_exact(s, rs, f"scales ({inputs['scale_fmt']})")]


def rope_bench_shapes(cfg, tp: int) -> list[dict]:
    H = op_shapes(cfg, tp)["o_proj"].dims["H"]
    return [{"T": t, "H": H, "P": BENCH_POS, "scale_fmt": "ue8m0"} for t in (1, 8, 64, 256, 512, 4096)]


def _rope_torch(inputs):
    from ds4lab.reference.o_proj import torch_inv_rope_quant
    kw = {k: v for k, v in inputs.items() if k != "check_positions"}
    return lambda: torch_inv_rope_quant(**kw)


def _configs_rope():
    from ds4lab_kernels.o_proj import CONFIGS, ROPE_LABELS
    return {a: {lab: CONFIGS[a][lab] for lab in ROPE_LABELS} for a in CONFIGS}


register(KernelSpec(
    name="inv_rope_fp8_quant",
    family="o_proj",
    launcher="ds4lab_kernels.o_proj:inv_rope_fp8_quant",
    reference="ds4lab.reference.o_proj:inv_rope_fp8_quant",
    make_inputs=rope_inputs,
    cases=ROPE_CASES,
    test_shapes=[{"T": 1, "H": 8, "scale_fmt": "ue8m0"}, {"T": 7, "H": 16, "scale_fmt": "fp32"},
                 {"T": 33, "H": 64, "scale_fmt": "pow2"}, {"T": 5, "H": 32, "quantize": False}],
    bench_shapes=rope_bench_shapes,
    flops=costs.FLOPS["inv_rope_fp8_quant"],
    min_bytes=costs.MIN_BYTES["inv_rope_fp8_quant"],
    check=rope_check,
    configs=_configs_rope(),
    baselines={"torch_eager": _rope_torch},
    bound="memory",
    aot_shape={"T": 4096, "H": 16, "P": 8192, "scale_fmt": "ue8m0"},
))


# ---- fp8_einsum_bhr_hdr_bhd --------------------------------------------------------------------------
EINSUM_CASES = ("random", "zero_rows", "tiny_scales", "nan_rows", "strided", "max_magnitude")


def einsum_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """``x [T, G, K]`` e4m3 from quantizing bf16 activations 1x128 (``x_fmt`` fp32 or ue8m0 scales),
    ``wo_a [G, N, K]`` from block-quantizing ``N(0, 1/K)`` weights (``w_fmt``). Cases: zero token
    rows, scales near 2^-60 / 2^-20, a NaN value and a NaN scale, non-contiguous x with vLLM's
    MN-major scale layout, all-448 operands (largest partial sums)."""
    T, G, N, K = shape["T"], shape["G"], shape["N"], shape["K"]
    x_fmt, w_fmt = shape.get("x_fmt", "ue8m0"), shape.get("w_fmt", "fp32")
    g = _gen(seed, device)
    a = torch.randn(T * G, K, generator=g, device=device)
    if case == "zero_rows" and T:
        a.view(T, G, K)[::2] = 0.0
    x, xs = per_token_group_quant_fp8(a.to(torch.bfloat16), GROUP, scale_fmt=x_fmt)
    x, xs = x.reshape(T, G, K), xs.reshape(T, G, K // GROUP)
    w, ws = block_quant_weight(torch.randn(G, N, K, generator=g, device=device) / math.sqrt(K), w_fmt)
    if case == "tiny_scales":
        xs = xs - 60 if x_fmt == "ue8m0" else xs * 2.0 ** -60
        ws = ws - 20 if w_fmt == "ue8m0" else ws * 2.0 ** -20
        xs = xs.clamp_min(1) if x_fmt == "ue8m0" else xs
    elif case == "nan_rows" and T:
        x.view(torch.uint8)[0, 0, 5] = 0x7F
        if x_fmt == "ue8m0":
            xs[-1, -1, -1] = 255
        else:
            xs[-1, -1, -1] = float("nan")
    elif case == "strided":
        xb = torch.zeros(T, G + 1, K, dtype=torch.float8_e4m3fn, device=device)
        xb[:, 1:] = x
        x = xb[:, 1:]
        xsb = torch.empty(G, K // GROUP, T, dtype=xs.dtype, device=device)
        xsb.copy_(xs.permute(1, 2, 0))
        xs = xsb.permute(2, 0, 1)  # MN-major (token stride 1), as vLLM's fused_inv_rope_fp8_quant writes
    elif case == "max_magnitude":
        sign = torch.where(torch.rand(T, G, K, generator=g, device=device) < 0.5, -448.0, 448.0)
        x = sign.to(torch.float8_e4m3fn)
        w = torch.full((G, N, K), 448.0, device=device).to(torch.float8_e4m3fn)
    elif case not in EINSUM_CASES:
        raise ValueError(f"case={case!r}: known cases {EINSUM_CASES}")
    return {"x": x, "x_s": xs, "wo_a": w, "wo_a_s": ws}


def einsum_check(out, ref, inputs) -> list:
    return [compare(out, ref, "bfloat16", name="z")]


def einsum_bench_shapes(cfg, tp: int) -> list[dict]:
    d = op_shapes(cfg, tp)["o_proj"].dims
    return [{"T": t, "G": d["G"], "N": d["R"], "K": d["K"], "x_fmt": "ue8m0", "w_fmt": "fp32"} for t in BENCH_T]


def _einsum_config_for(arch, shape):
    return ["decode", "prefill"] if shape["T"] <= 64 else ["prefill"]


def _configs_einsum():
    from ds4lab_kernels.o_proj import CONFIGS, EINSUM_LABELS
    return {a: {lab: CONFIGS[a][lab] for lab in EINSUM_LABELS} for a in CONFIGS}


def _torch_dequant_bmm(inputs):
    from ds4lab.reference.o_proj import torch_dequant_bmm
    return lambda: torch_dequant_bmm(inputs["x"], inputs["x_s"], inputs["wo_a"], inputs["wo_a_s"])


def _torch_bf16_bmm(inputs):
    """Weights upcast once ahead of time (a bf16 copy of wo_a, 2x the bytes); x dequantized per call."""
    from ds4lab.reference.o_proj import dequant_weight, torch_dequant_bmm
    wb = dequant_weight(inputs["wo_a"], inputs["wo_a_s"]).to(torch.bfloat16)
    return lambda: torch_dequant_bmm(
        (inputs["x"].float().reshape(*inputs["x"].shape[:2], -1, GROUP) *
         _scale_f32(inputs["x_s"])[..., None]).reshape(inputs["x"].shape).bfloat16(), None, wb, None)


def _scale_f32(s):
    from ds4lab.reference.quant import decode_ue8m0
    return decode_ue8m0(s) if s.dtype == torch.uint8 else s


register(KernelSpec(
    name="fp8_einsum_bhr_hdr_bhd",
    family="o_proj",
    launcher="ds4lab_kernels.o_proj:fp8_einsum_bhr_hdr_bhd",
    reference="ds4lab.reference.o_proj:fp8_einsum_bhr_hdr_bhd",
    make_inputs=einsum_inputs,
    cases=EINSUM_CASES,
    test_shapes=[{"T": 7, "G": 2, "N": 128, "K": 512, "x_fmt": "ue8m0", "w_fmt": "fp32"},
                 {"T": 1, "G": 1, "N": 256, "K": 1024, "x_fmt": "fp32", "w_fmt": "ue8m0"},
                 {"T": 33, "G": 2, "N": 128, "K": 256, "x_fmt": "ue8m0", "w_fmt": "ue8m0"}],
    bench_shapes=einsum_bench_shapes,
    flops=costs.FLOPS["fp8_einsum_bhr_hdr_bhd"],
    min_bytes=costs.MIN_BYTES["fp8_einsum_bhr_hdr_bhd"],
    check=einsum_check,
    configs=_configs_einsum(),
    config_for=_einsum_config_for,
    baselines={"torch_dequant_bmm": _torch_dequant_bmm, "torch_bf16_bmm": _torch_bf16_bmm},
    bound="memory",
    aot_shape={"T": 64, "G": 2, "N": 1024, "K": 4096, "x_fmt": "ue8m0", "w_fmt": "fp32"},
    sm89_mma={"_grouped_gemm_kernel": "QMMA"},
))


# ---- bf16_einsum_bhr_hdr_bhd (BF16 MTP drafter) -------------------------------------------------------
BF16_CASES = ("random", "zero_rows", "nan_rows")


def bf16_einsum_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    T, G, N, K = shape["T"], shape["G"], shape["N"], shape["K"]
    g = _gen(seed, device)
    x = torch.randn(T, G, K, generator=g, device=device)
    if case == "zero_rows" and T:
        x[::2] = 0.0
    elif case == "nan_rows" and T:
        x[0, 0, 3] = float("nan")
    elif case not in BF16_CASES:
        raise ValueError(f"case={case!r}: known cases {BF16_CASES}")
    w = torch.randn(G, N, K, generator=g, device=device) / math.sqrt(K)
    return {"x": x.to(torch.bfloat16), "wo_a": w.to(torch.bfloat16)}


def bf16_einsum_bench_shapes(cfg, tp: int) -> list[dict]:
    d = op_shapes(cfg, tp)["o_proj"].dims
    return [{"T": t, "G": d["G"], "N": d["R"], "K": d["K"]} for t in (1, 8, 64)]


def _torch_bmm(inputs):
    from ds4lab.reference.o_proj import torch_dequant_bmm
    return lambda: torch_dequant_bmm(inputs["x"], None, inputs["wo_a"], None)


register(KernelSpec(
    name="bf16_einsum_bhr_hdr_bhd",
    family="o_proj",
    launcher="ds4lab_kernels.o_proj:bf16_einsum_bhr_hdr_bhd",
    reference="ds4lab.reference.o_proj:bf16_einsum_bhr_hdr_bhd",
    make_inputs=bf16_einsum_inputs,
    cases=BF16_CASES,
    test_shapes=[{"T": 7, "G": 2, "N": 128, "K": 512}, {"T": 33, "G": 1, "N": 256, "K": 256}],
    bench_shapes=bf16_einsum_bench_shapes,
    flops=costs.FLOPS["bf16_einsum_bhr_hdr_bhd"],
    min_bytes=costs.MIN_BYTES["bf16_einsum_bhr_hdr_bhd"],
    check=einsum_check,
    configs=_configs_einsum(),
    config_for=_einsum_config_for,
    baselines={"torch_bmm": _torch_bmm},
    bound="memory",
    aot_shape={"T": 64, "G": 2, "N": 1024, "K": 4096},
))


# ---- o_proj ----------------------------------------------------------------------------------------
OPROJ_CASES = ("random", "zero_rows", "outlier_head", "cache_end")


def o_proj_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """Attention output ``[T, H, 512]`` ~ N(0, 1), positions, cos/sin cache, ``wo_a`` ``[G, R, 4096]``
    and ``wo_b`` ``[N, G*R]`` drawn N(0, 1/fan_in) so outputs are O(1); ``path="fp8"`` block-quantizes
    both (scales in ``w_fmt``), ``path="bf16"`` keeps them bf16 without scales (the MTP drafter)."""
    T, H, R, N = shape["T"], shape["H"], shape["R"], shape["N"]
    G, K = H // HPG, HPG * HEAD_DIM
    n_pos = shape.get("P", TEST_POS)
    g = _gen(seed, device)
    o = torch.randn(T, H, HEAD_DIM, generator=g, device=device)
    if case == "zero_rows" and T:
        o[::2] = 0.0
    elif case == "outlier_head" and T:
        o[:, 0] *= 1e3
        o[:, -1, : HEAD_DIM - ROPE_DIM] = 0.0
    elif case not in OPROJ_CASES:
        raise ValueError(f"case={case!r}: known cases {OPROJ_CASES}")
    wa = torch.randn(G, R, K, generator=g, device=device) / math.sqrt(K)
    wb = torch.randn(1, N, G * R, generator=g, device=device) / math.sqrt(G * R)
    out = {"o": o.to(torch.bfloat16), "positions": _positions(T, n_pos, case, g, device),
           "cos_sin_cache": cos_sin_cache(n_pos, device=device), "heads_per_group": HPG,
           "scale_fmt": shape.get("scale_fmt", "ue8m0")}
    if shape.get("path", "fp8") == "fp8":
        w_fmt = shape.get("w_fmt", "fp32")
        out["wo_a"], out["wo_a_s"] = block_quant_weight(wa, w_fmt)
        q, s = block_quant_weight(wb, w_fmt)
        out["wo_b"], out["wo_b_s"] = q[0], s[0]
    else:
        out["wo_a"], out["wo_b"] = wa.to(torch.bfloat16), wb[0].to(torch.bfloat16)
        out["wo_a_s"] = out["wo_b_s"] = None
    return out


def o_proj_check(out, ref, inputs) -> list:
    """bf16 budget on the interpreter. On FP8 tensor cores (~14-bit accumulation, see
    numerics.fp8_mma_rel_error) z can land one e4m3 step away from the reference's before it is
    re-quantized for wo_b (as DeepGEMM's path does), moving an output by up to 2^-3 |z_k w_nk|:
    there the elementwise budget is a quarter of the output RMS and the similarity budget 1e-4
    (measured worst on the H200: 9.2e-6 at N=4096 in run 2, 2.5e-5 at N=256 in run 3)."""
    if fp8_mma_rel_error(out.device) > 2.0 ** -20 and inputs.get("wo_a_s") is not None:
        rms = float(ref.double().square().mean().sqrt()) if ref.numel() else 0.0
        return [compare(out, ref, Tolerance(atol=0.25 * rms, rtol=0.0625, max_diff=1e-4), name="o_proj out")]
    return [compare(out, ref, "bfloat16", name="o_proj out")]


def o_proj_bench_shapes(cfg, tp: int) -> list[dict]:
    """TP=4: T 1-16 (decode, every candidate), 64, 4096; other TP 1/8/512. ``DS4LAB_OPROJ_BENCH_T``
    (comma-separated token counts; scripts/gpu/oproj.sh sets ``1,2,4,8,16``) replaces the list."""
    d = op_shapes(cfg, tp)["o_proj"].dims
    ts = (1, 2, 4, 8, 16, 64, 4096) if tp == 4 else (1, 8, 512)
    env = os.environ.get("DS4LAB_OPROJ_BENCH_T", "").strip()
    if env:
        try:
            ts = tuple(int(v) for v in env.split(","))
        except ValueError:
            raise ValueError(f"DS4LAB_OPROJ_BENCH_T={env!r}: expected comma-separated token counts") from None
    return [{"T": t, "H": d["H"], "R": d["R"], "N": d["N"], "P": BENCH_POS, "path": "fp8",
             "scale_fmt": "ue8m0", "w_fmt": "fp32"} for t in ts]


def _o_proj_configs():
    """Per arch: the 2-launch fused row (``fused``), the 3-launch rows (``unfused3*``), today's parts
    at decode (``unfused``, the named baseline) and the parts at prefill (``prefill``)."""
    from ds4lab_kernels.o_proj import CONFIGS, OPROJ_LABELS
    return {a: {**{lab: t[lab] for lab in OPROJ_LABELS},
                "prefill": {"path": "unfused", "rope": t["rope_large"], "einsum": t["prefill"], "wo_b": t["prefill"]}}
            for a, t in CONFIGS.items()}


def _o_proj_config_for(arch, shape):
    """Decode shapes (T <= FUSED_MAX_T) time every candidate; larger T only the parts (prefill).
    ``DS4LAB_OPROJ_BENCH_CONFIGS`` (comma-separated labels; scripts/gpu/oproj.sh sets it) keeps only
    those decode candidates."""
    from ds4lab_kernels.o_proj import FUSED_MAX_T, OPROJ_LABELS
    if shape.get("path", "fp8") != "fp8":
        return ["unfused", "prefill"] if shape["T"] <= FUSED_MAX_T else ["prefill"]
    if shape["T"] > FUSED_MAX_T:
        return ["prefill"]
    env = os.environ.get("DS4LAB_OPROJ_BENCH_CONFIGS", "").strip()
    if not env:
        return list(OPROJ_LABELS)
    keep = [v.strip() for v in env.split(",") if v.strip()]
    unknown = sorted(set(keep) - set(OPROJ_LABELS))
    if unknown:
        raise ValueError(f"DS4LAB_OPROJ_BENCH_CONFIGS: unknown labels {unknown}; known {list(OPROJ_LABELS)}")
    return [lab for lab in OPROJ_LABELS if lab in keep]


def _o_proj_torch_bf16(inputs):
    """The upcast fork: bf16 copies of wo_a/wo_b made once, then eager inverse RoPE + bmm + matmul."""
    from ds4lab.reference.o_proj import dequant_weight, inv_rope
    G = inputs["o"].shape[1] // HPG
    wa = dequant_weight(inputs["wo_a"], inputs["wo_a_s"]).to(torch.bfloat16)
    wb = dequant_weight(inputs["wo_b"][None], None if inputs["wo_b_s"] is None else inputs["wo_b_s"][None])[0]
    wb = wb.to(torch.bfloat16)
    o, pos, cs = inputs["o"], inputs["positions"], inputs["cos_sin_cache"]

    def run():
        x = inv_rope(o, pos, cs).to(torch.bfloat16).view(o.shape[0], G, -1)
        z = torch.bmm(x.transpose(0, 1), wa.transpose(1, 2)).transpose(0, 1).reshape(o.shape[0], -1)
        return z @ wb.t()
    return run


register(KernelSpec(
    name="o_proj",
    family="o_proj",
    launcher="ds4lab_kernels.o_proj:o_proj",
    reference="ds4lab.reference.o_proj:o_proj",
    make_inputs=o_proj_inputs,
    cases=OPROJ_CASES,
    test_shapes=[{"T": 1, "H": 8, "R": 128, "N": 256, "path": "fp8", "scale_fmt": "ue8m0"},
                 {"T": 7, "H": 8, "R": 128, "N": 128, "path": "fp8", "scale_fmt": "fp32", "w_fmt": "ue8m0"},
                 {"T": 33, "H": 8, "R": 128, "N": 128, "path": "fp8", "scale_fmt": "pow2"},
                 {"T": 7, "H": 8, "R": 128, "N": 128, "path": "bf16"}],
    bench_shapes=o_proj_bench_shapes,
    flops=costs.FLOPS["o_proj"],
    min_bytes=costs.MIN_BYTES["o_proj"],
    check=o_proj_check,
    configs=_o_proj_configs(),
    config_for=_o_proj_config_for,
    baselines={"torch_bf16_upcast": _o_proj_torch_bf16},
    bound="memory",
    aot_shape={"T": 8, "H": 16, "R": 1024, "N": 4096, "P": 8192, "path": "fp8", "scale_fmt": "ue8m0"},
))
