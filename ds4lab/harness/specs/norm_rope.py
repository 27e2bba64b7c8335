"""Registry entries: fused RMSNorm + RoPE, the q_norm + kv_norm + kv RoPE of the fused ``wq_a | wkv``
output, and the clamped SwiGLU (``ds4lab_kernels.norm_rope``)."""
from __future__ import annotations

import torch

from ds4lab.harness import costs
from ds4lab.harness.numerics import compare
from ds4lab.harness.registry import KernelSpec, kernel_configs, reference_baseline, register
from ds4lab.reference.rope import cos_sin_cache

NR_CASES = ("random", "zero_rows", "tiny_rows", "huge_rows", "pos_edges")
SW_CASES = ("random", "zero_rows", "clamp_edges", "huge")
#: what each ``mode`` of a shape runs: (norm, weight, rope)
MODES = {"q_norm_rope": (True, False, True), "rmsnorm": (True, True, False), "rope": (False, False, True),
         "rmsnorm_rope": (True, True, True)}


def _case_cos_sin(shape: dict, seed: int, max_pos: int) -> torch.Tensor:
    """The RoPE table of a test case: YaRN-scaled (the compressed layers' table) on even seeds, plain
    (the SWA layers') on odd ones, ``shape["R"]`` (default 64) rotary dims, ``max_pos`` positions."""
    yarn = seed % 2 == 0
    return cos_sin_cache(max_pos, shape.get("R", 64), 160000.0 if yarn else 10000.0, factor=16.0 if yarn else 1.0,
                         original_max=65536 if yarn else 2048)


def make_nr_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """bf16 ``x (T, H, D)`` (``H`` 0: ``(T, D)``) of per-row gain 1e-2..1e2, a float32 table of
    ``max_pos`` rows (YaRN base 160000 on even seeds, plain 10000 on odd). Adversarial: all-zero
    rows, rows of 1e-20 (below ``sqrt(eps)``), rows of 1e15 (sum of squares near the fp32 top),
    positions 0, 1 and ``max_pos - 1``."""
    T, H, D, mode = shape["T"], shape.get("H", 0), shape["D"], shape["mode"]
    max_pos = shape.get("max_pos", 64)
    norm, has_w, rope = MODES[mode]
    g = torch.Generator().manual_seed(seed)
    rows = (T, H) if H else (T,)
    gain = torch.exp(torch.empty(*rows, 1).uniform_(-4.6, 4.6, generator=g))
    x = torch.randn(*rows, D, generator=g) * gain
    pos = torch.randint(0, max_pos, (T,), generator=g)
    if case == "zero_rows":
        x.reshape(-1, D)[::2] = 0.0
    elif case == "tiny_rows":
        x.reshape(-1, D)[::2] *= 1e-20 / gain.reshape(-1, 1)[::2]
    elif case == "huge_rows":
        x.reshape(-1, D)[1::2] *= 1e15 / gain.reshape(-1, 1)[1::2]
    elif case == "pos_edges":
        pos[0::3], pos[1::3], pos[2::3] = 0, max_pos - 1, min(1, max_pos - 1)
    elif case not in NR_CASES:
        raise ValueError(f"case={case!r}: known cases {NR_CASES}")
    cs = _case_cos_sin(shape, seed, max_pos)
    w = (1 + 0.5 * torch.randn(D, generator=g)).to(torch.bfloat16) if has_w else None
    return {"x": x.to(torch.bfloat16).to(device), "weight": None if w is None else w.to(device), "eps": 1e-6,
            "positions": pos.to(torch.int32).to(device) if rope else None,
            "cos_sin": cs.to(device) if rope else None, "norm": norm}


def check_nr(out, ref, inputs) -> list:
    return [compare(out, ref, name="rmsnorm_rope")]


def nr_bench_shapes(cfg, tp: int) -> list[dict]:
    """Per decode step at batch 1 / 16 / 64 (TP rank): the q heads, q_norm, kv_norm, kv rope."""
    H = cfg.num_attention_heads // tp
    out = []
    for T in (1, 16, 64):
        out += [{"T": T, "H": H, "D": cfg.head_dim, "mode": "q_norm_rope", "max_pos": 65536},
                {"T": T, "D": cfg.q_lora_rank, "mode": "rmsnorm"},
                {"T": T, "D": cfg.head_dim, "mode": "rope", "max_pos": 65536}]
    return out


QKV_CASES = ("random", "zero_rows", "huge_rows", "pos_edges")


def make_qkv_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """bf16 ``x (T, Dq + Dkv)`` whose q and kv segments have independent gains 1e-2..1e2 (one norm
    must not leak into the other), bf16 gains ``1 + 0.5 N(0,1)``, a float32 table of ``max_pos`` rows.
    Adversarial: a zero q segment on even rows and a zero kv segment on odd rows, 1e15-scaled
    segments (fp32 sum of squares near the top), positions 0, 1 and ``max_pos - 1``."""
    T, Dq, Dkv = shape["T"], shape["Dq"], shape["Dkv"]
    max_pos = shape.get("max_pos", 64)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, Dq + Dkv, generator=g)
    x[:, :Dq] *= torch.exp(torch.empty(T, 1).uniform_(-4.6, 4.6, generator=g))
    x[:, Dq:] *= torch.exp(torch.empty(T, 1).uniform_(-4.6, 4.6, generator=g))
    pos = torch.randint(0, max_pos, (T,), generator=g)
    if case == "zero_rows":
        x[0::2, :Dq] = 0.0
        x[1::2, Dq:] = 0.0
    elif case == "huge_rows":
        x[0::2, Dq:] *= 1e15 / x[0::2, Dq:].abs().amax(1, keepdim=True)
        x[1::2, :Dq] *= 1e15 / x[1::2, :Dq].abs().amax(1, keepdim=True)
    elif case == "pos_edges":
        pos[0::3], pos[1::3], pos[2::3] = 0, max_pos - 1, min(1, max_pos - 1)
    elif case not in QKV_CASES:
        raise ValueError(f"case={case!r}: known cases {QKV_CASES}")
    cs = _case_cos_sin(shape, seed, max_pos)
    wq = (1 + 0.5 * torch.randn(Dq, generator=g)).to(torch.bfloat16)
    wkv = (1 + 0.5 * torch.randn(Dkv, generator=g)).to(torch.bfloat16)
    return {"x": x.to(torch.bfloat16).to(device), "q_weight": wq.to(device), "kv_weight": wkv.to(device),
            "q_dim": Dq, "eps": 1e-6, "positions": pos.to(torch.int32).to(device), "cos_sin": cs.to(device)}


def check_qkv(out, ref, inputs) -> list:
    return [compare(out[0], ref[0], name="q"), compare(out[1], ref[1], name="kv")]


def qkv_bench_shapes(cfg, tp: int) -> list[dict]:
    """Per decode step at batch 1 / 16 / 64: the ``wqkv_a`` output (replicated across TP)."""
    return [{"T": T, "Dq": cfg.q_lora_rank, "Dkv": cfg.head_dim, "max_pos": 65536} for T in (1, 16, 64)]


def _torch_qkv(inputs):
    """the glue this kernel replaces: q_norm, kv_norm, kv rope as three launches of ``rmsnorm_rope``."""
    from ds4lab_kernels.norm_rope import rmsnorm_rope

    def run():
        x, d = inputs["x"], inputs["q_dim"]
        q = rmsnorm_rope(x[:, :d].contiguous(), inputs["q_weight"], inputs["eps"])
        kv = rmsnorm_rope(x[:, d:].contiguous(), inputs["kv_weight"], inputs["eps"])
        return q, rmsnorm_rope(kv, None, 0.0, inputs["positions"], inputs["cos_sin"], norm=False)
    return run


def make_sw_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """bf16 ``gu (T, 2I)`` of scale ~8 (so ~10% of values clamp at 10). Adversarial: zero rows,
    values exactly at / one bf16 step around +-limit, huge values (1e30, -1e30)."""
    T, I = shape["T"], shape["I"]
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(T, 2 * I, generator=g) * 8
    if case == "zero_rows":
        gu[::2] = 0.0
    elif case == "clamp_edges":
        edge = torch.tensor([10.0, -10.0, 9.9375, 10.0625, -9.9375, -10.0625])
        gu.reshape(-1)[: 6 * (gu.numel() // 6)] = edge.repeat(gu.numel() // 6)
    elif case == "huge":
        gu[:, ::3] = 1e30
        gu[:, 1::3] = -1e30
    elif case not in SW_CASES:
        raise ValueError(f"case={case!r}: known cases {SW_CASES}")
    return {"gu": gu.to(torch.bfloat16).to(device), "limit": 10.0}


def check_sw(out, ref, inputs) -> list:
    return [compare(out, ref, name="swiglu_clamp")]


def sw_bench_shapes(cfg, tp: int) -> list[dict]:
    I = cfg.moe_intermediate_size * max(1, int(getattr(cfg, "n_shared_experts", 1) or 1)) // tp
    return [{"T": T, "I": I} for T in (1, 16, 64, 8192)]


def _torch_nr(inputs):
    """the torch glue this kernel replaces (fp32 ops, as ``backend_kernel`` ran them)."""
    from ds4lab.reference.rope import apply_rope

    def run():
        x = inputs["x"].float()
        if inputs["norm"]:
            x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + inputs["eps"])
            if inputs["weight"] is not None:
                x = x * inputs["weight"].float()
        if inputs["positions"] is not None:
            x = apply_rope(x, inputs["positions"], inputs["cos_sin"], dtype=torch.float32)
        return x.to(torch.bfloat16)
    return run


register(KernelSpec(
    name="rmsnorm_rope",
    family="norm_rope",
    launcher="ds4lab_kernels.norm_rope:rmsnorm_rope",
    reference="ds4lab.reference.norm_rope:rmsnorm_rope",
    make_inputs=make_nr_inputs,
    cases=NR_CASES,
    test_shapes=[{"T": 3, "H": 4, "D": 512, "mode": "q_norm_rope"}, {"T": 5, "D": 1024, "mode": "rmsnorm"},
                 {"T": 4, "D": 512, "mode": "rope"}, {"T": 3, "D": 96, "R": 32, "mode": "rmsnorm_rope"}],
    bench_shapes=nr_bench_shapes,
    flops=costs.FLOPS["rmsnorm_rope"],
    min_bytes=costs.MIN_BYTES["rmsnorm_rope"],
    check=check_nr,
    configs=kernel_configs("norm_rope", "rmsnorm_rope"),
    baselines={"torch_eager": _torch_nr},
    bound="memory",
    aot_shape=[{"T": 4, "H": 16, "D": 512, "mode": "q_norm_rope"}, {"T": 4, "D": 1024, "mode": "rmsnorm"},
               {"T": 4, "D": 512, "mode": "rope"}],
))

register(KernelSpec(
    name="q_kv_rmsnorm_rope",
    family="norm_rope",
    launcher="ds4lab_kernels.norm_rope:q_kv_rmsnorm_rope",
    reference="ds4lab.reference.norm_rope:q_kv_rmsnorm_rope",
    make_inputs=make_qkv_inputs,
    cases=QKV_CASES,
    test_shapes=[{"T": 3, "Dq": 128, "Dkv": 512}, {"T": 4, "Dq": 96, "Dkv": 160, "R": 32}],
    bench_shapes=qkv_bench_shapes,
    flops=costs.FLOPS["q_kv_rmsnorm_rope"],
    min_bytes=costs.MIN_BYTES["q_kv_rmsnorm_rope"],
    check=check_qkv,
    configs=kernel_configs("norm_rope", "q_kv_rmsnorm_rope"),
    baselines={"three_launches": _torch_qkv},
    bound="memory",
    aot_shape={"T": 4, "Dq": 1536, "Dkv": 512},
))

register(KernelSpec(
    name="swiglu_clamp",
    family="norm_rope",
    launcher="ds4lab_kernels.norm_rope:swiglu_clamp",
    reference="ds4lab.reference.norm_rope:swiglu_clamp",
    make_inputs=make_sw_inputs,
    cases=SW_CASES,
    test_shapes=[{"T": 3, "I": 512}, {"T": 2, "I": 1500}],
    bench_shapes=sw_bench_shapes,
    flops=costs.FLOPS["swiglu_clamp"],
    min_bytes=costs.MIN_BYTES["swiglu_clamp"],
    check=check_sw,
    configs=kernel_configs("norm_rope", "swiglu_clamp"),
    baselines={"torch_eager": reference_baseline("ds4lab.reference.norm_rope:swiglu_clamp")},
    bound="memory",
    aot_shape={"T": 4, "I": 512},
))
