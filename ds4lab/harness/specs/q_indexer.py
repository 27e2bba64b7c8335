"""Registry entry: a C4A layer's attention q norm + RoPE and indexer q RoPE + FP8 quant in one launch
(``norm_rope.q_norm_rope_indexer_q``), next to the two launches it replaces (``rmsnorm_rope`` +
``indexer_q_rope_quant``). Inputs are laid out as the model passes them: ``q`` and ``iq`` column
slices of one fused ``wq_b | indexer wq_b`` GEMM output, the head weights a column slice of ``x_proj``'s."""
from __future__ import annotations

import torch

from ds4lab.harness import costs
from ds4lab.harness.numerics import compare, compare_exact, compare_fp8_bytes
from ds4lab.harness.registry import KernelSpec, kernel_configs, register
from ds4lab.harness.specs import indexer_q as SQ
from ds4lab.harness.specs import norm_rope as SNR

QI_CASES = ("random", "pos_edges", "zeros", "huge", "nonfinite")
#: each case -> (the q-norm inputs' case, the indexer inputs' case)
_SUB = {"random": ("random", "random"), "pos_edges": ("pos_edges", "random"), "zeros": ("zero_rows", "zeros"),
        "huge": ("huge_rows", "huge"), "nonfinite": ("random", "nonfinite")}
DECODE_T = (1, 2, 16)


def fused_gemm_views(q: torch.Tensor, iq: torch.Tensor, weights: torch.Tensor, pad: int = 24):
    """``(q, iq, weights)`` copied into the model's layout: ``q (T, H, D)`` and ``iq (T, IH, ID)`` column
    slices of one ``(T, H*D + IH*ID + pad)`` bf16 buffer (the fused GEMM output, row stride > either row),
    ``weights (T, IH)`` a column slice of a ``(T, IH + pad)`` buffer of its dtype."""
    T, H, D = q.shape
    IH, ID = iq.shape[1], iq.shape[2]
    n = H * D
    qq = torch.zeros(T, n + IH * ID + pad, dtype=q.dtype, device=q.device)
    qq[:, :n] = q.reshape(T, n)
    qq[:, n:n + IH * ID] = iq.reshape(T, IH * ID)
    wide = torch.zeros(T, pad + IH, dtype=weights.dtype, device=weights.device)
    wide[:, pad:] = weights
    return qq[:, :n].reshape(T, H, D), qq[:, n:n + IH * ID].reshape(T, IH, ID), wide[:, pad:]


def make_qi_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """The q rows of :func:`ds4lab.harness.specs.norm_rope.make_nr_inputs` (gains 1e-2..1e2) and the
    indexer rows of :func:`ds4lab.harness.specs.indexer_q.make_q_inputs` (heads over ~10 binades), one
    position vector and ``cos || sin`` table for both, in the fused-GEMM layout (:func:`fused_gemm_views`).
    Adversarial: positions 0, 1 and ``max_pos - 1`` (``pos_edges``); zero rows / heads / tokens
    (``zeros``); 1e15 q rows and indexer values near the bf16 max (``huge``); a NaN q row, an inf q
    element, a NaN and an inf indexer element and a NaN head weight (``nonfinite``)."""
    if case not in QI_CASES:
        raise ValueError(f"case={case!r}: known cases {QI_CASES}")
    T, H, D, IH, ID = shape["T"], shape["H"], shape["D"], shape["IH"], shape["ID"]
    R, P = shape.get("R", 64), shape.get("max_pos", 64)
    cq, ci = _SUB[case]
    nr = SNR.make_nr_inputs({"T": T, "H": H, "D": D, "R": R, "mode": "q_norm_rope", "max_pos": P}, cq, seed)
    ix = SQ.make_q_inputs({"T": T, "H": IH, "D": ID, "R": R, "max_pos": P}, ci, seed + 1)
    q = nr["x"]
    if case == "nonfinite":
        q[0, 0] = float("nan")
        q[-1, H - 1, 3] = float("inf")
    qv, iqv, wv = fused_gemm_views(q.to(device), ix["q"].to(device), ix["weights"].to(device))
    return {"q": qv, "iq": iqv, "positions": nr["positions"].to(device), "cos_sin": nr["cos_sin"].to(device),
            "weights": wv, "eps": 1e-6}


def check_qi(out, ref, inputs) -> list:
    """The q rows within bf16 of the float64 reference (as ``rmsnorm_rope``'s entry); the indexer's e4m3
    bytes and fp32 weights bit-exact (as ``indexer_q_rope_quant``'s)."""
    return [compare(out[0], ref[0].to(out[0].device), name="q_normed"),
            compare_fp8_bytes(out[1], ref[1].to(out[1].device), "q_fp8"),
            compare_exact(out[2], ref[2].to(out[2].device), "weights")]


def _bench(cfg, tp):
    """The C4A layer's shapes on one TP rank: ``H = heads / tp`` attention heads, the indexer's 64 x 128
    (not head-split), decode steps of 1, 2 (MTP verify) and 16 tokens."""
    base = {"H": cfg.num_attention_heads // tp, "D": cfg.head_dim, "IH": cfg.index_n_heads, "ID": cfg.index_head_dim,
            "R": cfg.qk_rope_head_dim, "max_pos": 65536}
    return [{"T": t, **base} for t in DECODE_T]


def two_launches(q, iq, positions, cos_sin, weights, eps, config=None):
    """What the fused launch replaces (and its bit-identity oracle): ``rmsnorm_rope`` of the q heads,
    then ``indexer_q_rope_quant`` of the indexer q -> ``(q_normed, q_fp8, w)``."""
    from ds4lab_kernels.indexer import indexer_q_rope_quant
    from ds4lab_kernels.norm_rope import rmsnorm_rope
    return (rmsnorm_rope(q, None, eps, positions, cos_sin),) + tuple(indexer_q_rope_quant(iq, positions, cos_sin,
                                                                                          weights))


def _pair(inputs):
    return lambda: two_launches(**inputs)


register(KernelSpec(
    name="q_norm_rope_indexer_q",
    family="norm_rope",
    launcher="ds4lab_kernels.norm_rope:q_norm_rope_indexer_q",
    reference="ds4lab.reference.q_indexer:q_norm_rope_indexer_q",
    make_inputs=make_qi_inputs,
    cases=QI_CASES,
    test_shapes=[{"T": 2, "H": 4, "D": 512, "IH": 8, "ID": 128, "max_pos": 64},
                 {"T": 3, "H": 3, "D": 96, "IH": 4, "ID": 32, "R": 16, "max_pos": 64}],
    bench_shapes=_bench,
    flops=costs.FLOPS["q_norm_rope_indexer_q"],
    min_bytes=costs.MIN_BYTES["q_norm_rope_indexer_q"],
    check=check_qi,
    configs=kernel_configs("norm_rope", "q_norm_rope_indexer_q"),
    baselines={"two_launches(rmsnorm_rope+indexer_q_rope_quant)": _pair},
    bound="memory",
    aot_shape={"T": 4, "H": 16, "D": 512, "IH": 64, "ID": 128},
))
