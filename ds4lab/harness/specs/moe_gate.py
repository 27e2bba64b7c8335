"""Registry entry: the DeepSeek-V4 router gate GEMM fused with the sqrtsoftplus top-k / hash routing
(``ds4lab_kernels.moe_gate``, one launch), next to the glue it replaces in the decode step
(``F.linear(x.float(), W.float())`` + ``sqrtsoftplus_topk``: 3 + 1 launches)."""
from __future__ import annotations

import torch

from ds4lab.harness import costs
from ds4lab.harness.numerics import Report
from ds4lab.harness.registry import KernelSpec, kernel_configs, register
from ds4lab.harness.specs.moe import check_route, hash_case

GATE_CASES = ("random", "ties", "nonfinite", "hash")
DECODE_T = (1, 2, 4, 8, 16, 32)
#: logits budget: |out - ref| <= LOGIT_RTOL * sum_k |x_k w_k| (fp32 accumulation of exact bf16 x bf16
#: products; worst-case pairwise-ish summation error is a few 2^-24 of that sum, 2^-17 leaves margin
#: and still fails any wrong term, which moves a logit by O(its sum))
LOGIT_RTOL = 2.0 ** -17


def make_gate_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """Hidden states ``[T, D]`` bf16 of unit RMS (after the FFN RMSNorm), gate weight ``[E, D]``
    bf16 ~ N(0, 1/D) (logits ~ N(0, 1)), correction bias ~ N(0, 0.1). ``ties``: the gate rows
    come in groups of 4 identical rows and the bias is zero (exact logit ties: the lowest id must
    win); ``nonfinite``: token rows with one NaN element, one +inf element (logits +-inf, NaN
    where the weight is 0), all zeros; ``hash``: a ``tid2eid`` table with out-of-range entries and a
    token id outside the vocab."""
    T, E, D, K = shape["T"], shape["E"], shape["D"], shape["topk"]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    w = torch.randn(E, D, generator=g) * D ** -0.5
    bias = torch.randn(E, generator=g) * 0.1
    kw = {}
    if case == "ties":
        w = w[torch.arange(E) // 4 * 4]
        bias = torch.zeros(E)
    elif case == "nonfinite":
        t = torch.arange(T)
        x[t % 4 == 1, 3 % D] = float("nan")
        x[t % 4 == 2, 5 % D] = float("inf")
        x[t % 4 == 3] = 0.0
        w[::7, 5 % D] = 0.0
    elif case == "hash":
        kw, bias = hash_case(T, E, K, g, device), None
    elif case not in GATE_CASES:
        raise ValueError(f"case={case!r}: known cases {GATE_CASES}")
    return {"hidden_states": x.to(torch.bfloat16).to(device), "gate_weight": w.to(torch.bfloat16).to(device),
            "e_score_correction_bias": None if bias is None else bias.to(device), "topk": K,
            "routed_scaling_factor": 1.5, **kw}


def check_gate(out, ref, inputs) -> list:
    """Logits: within :data:`LOGIT_RTOL` of ``sum |x w|`` of the float64 product (NaN / inf at the
    same places). Routing: exactly the router's rules applied to the kernel's OWN logits
    (:func:`ds4lab.harness.specs.moe.check_route` against the reference router run on them), so a
    near-tie decided by fp32 summation noise is judged on the logits the kernel had."""
    from ds4lab.reference import moe as R
    w, ids, lg = out
    lg = lg.detach().cpu()
    x = inputs["hidden_states"].cpu().double()
    W = inputs["gate_weight"].cpu().double()
    want = x @ W.T
    mag = x.abs().nan_to_num(0.0, 0.0, 0.0) @ W.abs().T
    o = lg.double()
    special = (o.isnan() != want.isnan()) | (o.isinf() != want.isinf()) | \
        (o.isinf() & want.isinf() & (o.sign() != want.sign()))
    fin = o.isfinite() & want.isfinite()
    err = torch.where(fin, (o - want).abs(), torch.zeros_like(o))
    bad = special | (fin & (err > LOGIT_RTOL * mag + 1e-30))
    idx = bad.nonzero()[:5].tolist()
    reps = [Report(ok=not bool(bad.any()), name="router_logits", shape=tuple(lg.shape), n_fail=int(bad.sum()),
                   first_fail=[(i, float(o[i[0], i[1]]), float(want[i[0], i[1]])) for i in idx],
                   max_abs=float(err.max()) if err.numel() else 0.0)]
    rin = {"router_logits": lg, "e_score_correction_bias": inputs["e_score_correction_bias"],
           "topk": inputs["topk"], "routed_scaling_factor": inputs["routed_scaling_factor"]}
    if "tid2eid" in inputs:
        rin.update(input_ids=inputs["input_ids"].cpu(), tid2eid=inputs["tid2eid"].cpu())
    if rin["e_score_correction_bias"] is not None:
        rin["e_score_correction_bias"] = rin["e_score_correction_bias"].cpu()
    rref = R.sqrtsoftplus_topk(**rin)
    reps += check_route((w.cpu(), ids.cpu()), rref, rin)
    return reps


def _bench(cfg, tp):
    base = {"E": cfg.n_routed_experts, "D": cfg.hidden_size, "topk": cfg.num_experts_per_tok}
    ts = DECODE_T if tp != 1 else (1, 16, 4096)   # the gate is replicated: the same at every TP
    return [{"T": t, **base} for t in ts]


def _config_for(arch, shape):
    """Bench shapes (the real D) time the path's candidates; test / AOT shapes build every row."""
    from ds4lab_kernels.moe_gate import CONFIGS, DECODE_CANDIDATES, ROWS_CANDIDATES, SPREAD_CANDIDATES
    if shape.get("D", 0) < 4096:   # every row; of the rows path one (r2w4): the interpreter runs its
        # EPP / warp variants the same way and one program at a time (r1w1 took 21 s here; tests/test_moe_gate.py)
        one = "r2w4" if "r2w4" in CONFIGS[arch] else "r2w2"   # sm_90 has no r2w4 (it spills there)
        return [lb for lb in CONFIGS[arch] if lb not in ROWS_CANDIDATES or lb == one]
    if shape["T"] > 64:
        return ["prefill"]
    if shape["T"] <= 4:   # the rows path (no split-K) next to the split default at T <= 4
        return [lb for lb in ROWS_CANDIDATES if lb in CONFIGS[arch]] + ["e32k16t4"]
    if shape["T"] <= 16:   # e32k16 (the session-4 default) lost to both at T = 1, 2, 16: timed only step-like;
        # the token-spread rows (m16) next to the split-K rows
        return [lb for lb in SPREAD_CANDIDATES if lb in CONFIGS[arch]] + \
            [lb for lb in DECODE_CANDIDATES if lb not in ROWS_CANDIDATES]
    return ["t32e32k8", "e32k16"]


def _glue(inputs):
    """The decode step's glue today (``KernelBackend.linear(out_dtype=fp32)`` + ``route``):
    ``F.linear(x.float(), W.float())`` (two casts + an fp32 GEMM) then the ds4lab router kernel."""
    from ds4lab_kernels.moe_routing import sqrtsoftplus_topk
    x, W = inputs["hidden_states"], inputs["gate_weight"]
    args = (inputs["e_score_correction_bias"], inputs["topk"], inputs["routed_scaling_factor"],
            inputs.get("input_ids"), inputs.get("tid2eid"))

    def run():
        return sqrtsoftplus_topk(torch.nn.functional.linear(x.float(), W.float()), *args)
    return run


def _cublas_out_fp32(inputs):
    """vLLM ``GateLinear``'s cuBLAS tier (bf16 x bf16 -> fp32 epilogue, ``torch.mm(out_dtype=)``)
    then the ds4lab router kernel: 2 launches, the real peer of the fused kernel."""
    from ds4lab_kernels.moe_routing import sqrtsoftplus_topk
    x, W = inputs["hidden_states"], inputs["gate_weight"]
    Wt = W.t()
    args = (inputs["e_score_correction_bias"], inputs["topk"], inputs["routed_scaling_factor"],
            inputs.get("input_ids"), inputs.get("tid2eid"))

    def run():
        return sqrtsoftplus_topk(torch.mm(x, Wt, out_dtype=torch.float32), *args)
    return run


register(KernelSpec(
    name="gate_sqrtsoftplus_topk",
    family="moe_gate",
    launcher="ds4lab_kernels.moe_gate:gate_sqrtsoftplus_topk",
    reference="ds4lab.reference.moe:gate_sqrtsoftplus_topk",
    make_inputs=make_gate_inputs,
    cases=GATE_CASES,
    test_shapes=[{"T": 5, "E": 256, "D": 512, "topk": 6}, {"T": 33, "E": 64, "D": 256, "topk": 8},
                 {"T": 3, "E": 6, "D": 200, "topk": 6}],
    bench_shapes=_bench,
    flops=costs.FLOPS["gate_sqrtsoftplus_topk"],
    min_bytes=costs.MIN_BYTES["gate_sqrtsoftplus_topk"],
    check=check_gate,
    configs=kernel_configs("moe_gate"),
    config_for=_config_for,
    baselines={"torch_glue(linear_fp32+route)": _glue, "cublas_out_fp32+route": _cublas_out_fp32},
    bound="memory",
    # T=4: the rows path at its widest token tile (BLOCK_T 4); T=16: the split-K decode rows
    aot_shape=[{"T": 4, "E": 256, "D": 4096, "topk": 6}, {"T": 16, "E": 256, "D": 4096, "topk": 6},
               {"T": 4096, "E": 256, "D": 4096, "topk": 6}],
    sm89_mma={"_gate_topk_kernel": "HMMA"},
))
