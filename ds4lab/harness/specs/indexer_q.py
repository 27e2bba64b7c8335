"""Registry entry: the lightning indexer's query side in one launch (``indexer_q_rope_quant``: RoPE,
bf16, pow2 FP8 e4m3 per head, the scale folded into the head weights), next to the decode step's
glue it replaces (torch fp32 RoPE ~6 launches + ``per_token_group_quant_fp8`` + the weight product)."""
from __future__ import annotations

import torch

from ds4lab.harness import costs
from ds4lab.harness.numerics import compare_exact, compare_fp8_bytes
from ds4lab.harness.registry import KernelSpec, kernel_configs, register

Q_CASES = ("random", "zeros", "huge", "nonfinite")
DECODE_T = (1, 2, 16, 32)


def make_q_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """bf16 ``q (T, H, D)`` with per-head magnitudes ``exp(N(0, 2))`` (heads span ~10 binades),
    bf16 head weights ~ N(0, 1), positions in ``[0, max_pos)`` of a real (YaRN) cos/sin table.
    Adversarial: ``zeros`` (whole heads and whole tokens 0: the 1e-4 amax floor), ``huge`` (values
    near the bf16 max: the rotation overflows to inf in fp32), ``nonfinite`` (a NaN element, an
    inf element, a NaN head weight)."""
    from ds4lab.reference.rope import cos_sin_cache
    T, H, D, R, P = shape["T"], shape["H"], shape["D"], shape.get("R", 64), shape.get("max_pos", 4096)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g) * torch.exp(torch.randn(T, H, 1, generator=g) * 2)
    w = torch.randn(T, H, generator=g)
    if case == "zeros":
        q[:, ::3] = 0.0
        q[T // 2] = 0.0
    elif case == "huge":
        q[:, ::2] = q[:, ::2].sign() * 3.0e38
    elif case == "nonfinite":
        q[0, 1 % H, 7] = float("nan")
        q[-1, 2 % H, D - 3] = float("inf")
        w[0, 3 % H] = float("nan")
    elif case not in Q_CASES:
        raise ValueError(f"case={case!r}: known cases {Q_CASES}")
    pos = torch.randint(0, P, (T,), generator=g)
    cs = cos_sin_cache(P, R, 160000.0, factor=16.0, original_max=65536)
    return {"q": q.to(torch.bfloat16).to(device), "positions": pos.to(device), "cos_sin": cs.to(device),
            "weights": w.to(torch.bfloat16).to(device)}


def check_q(out, ref, inputs) -> list:
    """Bit-exact: e4m3 bytes and fp32 weights equal the fp32-RoPE reference (which is the glue's
    arithmetic, op for op)."""
    return [compare_fp8_bytes(out[0], ref[0].to(out[0].device), "q_fp8"),
            compare_exact(out[1], ref[1].to(out[1].device), "weights")]


def _bench(cfg, tp):
    base = {"H": cfg.index_n_heads, "D": cfg.index_head_dim, "R": cfg.qk_rope_head_dim}
    ts = DECODE_T if tp != 1 else (1, 16, 4096)   # the indexer q is not head-split: the same at every TP
    return [{"T": t, **base} for t in ts]


def _config_for(arch, shape):
    from ds4lab_kernels.indexer import CONFIGS
    labels = list(CONFIGS["q"][arch])
    if "max_pos" in shape:   # interpreter test shapes: r1 is r4's code at ROWS=1 (and 5 s there)
        return [k for k in labels if k != "r1"]
    return [k for k in labels if k != "interp"]


def indexer_q_glue(q, positions, cos_sin, weights, config=None):
    """``KernelBackend.indexer_q`` before the fused kernel (kept as the baseline and as the
    bit-identity oracle of tests/test_indexer_q.py): ``_rope_f32`` (torch fp32, ~6 launches) ->
    bf16 -> ``per_token_group_quant_fp8(x, D, "pow2", eps=1e-4)`` -> ``w * s * D^-0.5 * H^-0.5``."""
    from ds4lab.model.backend_kernel import _rope_f32
    from ds4lab_kernels.fp8_quant import per_token_group_quant_fp8
    T, H, D = q.shape
    x = _rope_f32(q, positions, cos_sin).to(torch.bfloat16)
    qf, s = per_token_group_quant_fp8(x.reshape(T * H, D), D, scale_fmt="pow2", eps=1e-4)
    w = weights.float() * s.reshape(T, H) * (D ** -0.5 * H ** -0.5)
    return qf.reshape(T, H, D), w.contiguous()


def _glue(inputs):
    return lambda: indexer_q_glue(**inputs)


register(KernelSpec(
    name="indexer_q_rope_quant",
    family="indexer",
    launcher="ds4lab_kernels.indexer:indexer_q_rope_quant",
    reference="ds4lab.reference.indexer:indexer_q_rope_quant",
    make_inputs=make_q_inputs,
    cases=Q_CASES,
    test_shapes=[{"T": 3, "H": 64, "D": 128, "max_pos": 4096}, {"T": 5, "H": 4, "D": 32, "R": 16, "max_pos": 64}],
    bench_shapes=_bench,
    flops=costs.FLOPS["indexer_q_rope_quant"],
    min_bytes=costs.MIN_BYTES["indexer_q_rope_quant"],
    check=check_q,
    configs=kernel_configs("indexer", "q"),
    config_for=_config_for,
    baselines={"torch_glue(rope_f32+quant+mul)": _glue},
    bound="memory",
    aot_shape={"T": 16, "H": 64, "D": 128},
))
