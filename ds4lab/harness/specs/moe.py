"""Registry entries: DeepSeek-V4 routed MoE (SPEC.md §2 item 9): the sqrtsoftplus router and the
W4A16 INT4 grouped expert GEMM with the clamped SwiGLU fused."""
from __future__ import annotations

import torch

from ds4lab.geometry import op_shapes
from ds4lab.harness import costs
from ds4lab.harness.numerics import Report, compare, compare_exact
from ds4lab.harness.registry import KernelSpec, kernel_configs, reference_baseline, register

GROUP = 128

# ---- router ---------------------------------------------------------------------------------------
ROUTE_CASES = ("random", "ties", "nan_inf", "hash", "bias_dominant")


def hash_case(T: int, E: int, K: int, g: torch.Generator, device) -> dict:
    """A hash layer's routing inputs for the ``hash`` case of both routers: a ``tid2eid (97, K)`` int32
    table with two out-of-range entries (``E + 3``, ``-2``) and ``input_ids (T,)`` with token 0 = 5 (the
    row holding ``E + 3``) and, for T > 1, token 1 outside the vocab."""
    vocab = 97
    tbl = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(vocab)]).to(torch.int32)
    tbl[5, 0] = E + 3
    tbl[6, 1] = -2
    ids = torch.randint(0, vocab, (T,), generator=g)
    if T > 1:
        ids[1] = vocab + 10
    ids[0] = 5
    return {"input_ids": ids.to(device), "tid2eid": tbl.to(device)}


def make_route_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """Router logits ``[T, E]`` fp32 ~ N(0, 2) and a correction bias ~ N(0, 0.1) (the checkpoint's
    biases are of that order). ``ties``: logits and bias drawn from 4 values (many exact ties, lowest
    id must win); ``nan_inf``: NaN / +inf / -inf logits, a whole NaN row, a row with only 3
    numbers; ``hash``: ``tid2eid`` table with a few out-of-range entries and token ids (one outside
    the vocab); ``bias_dominant``: bias of +-5 so the selection differs from the score order."""
    T, E, K = shape["T"], shape["E"], shape["topk"]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.1
    kw = {}
    if case == "ties":
        vals = torch.tensor([-1.0, 0.0, 0.5, 2.0])
        logits = vals[torch.randint(0, 4, (T, E), generator=g)]
        bias = vals[torch.randint(0, 4, (E,), generator=g)] * 0.25
    elif case == "nan_inf":
        logits[torch.rand(T, E, generator=g) < 0.05] = float("nan")
        logits[torch.rand(T, E, generator=g) < 0.02] = float("-inf")
        if T > 1:
            logits[1] = float("nan")
        if T > 2:
            logits[2] = float("nan")
            logits[2, :3] = torch.tensor([0.5, -1.0, 3.0])
        if T > 3:
            logits[3, 7 % E] = float("inf")
    elif case == "hash":
        kw, bias = hash_case(T, E, K, g, device), None
    elif case == "bias_dominant":
        bias = torch.randn(E, generator=g).sign() * 5
    elif case not in ROUTE_CASES:
        raise ValueError(f"case={case!r}: known cases {ROUTE_CASES}")
    return {"router_logits": logits.to(device),
            "e_score_correction_bias": None if bias is None else bias.to(device),
            "topk": K, "routed_scaling_factor": 1.5, **kw}


def check_route(out, ref, inputs) -> list:
    """Ids: in range, distinct, and (bias path) the multiset of their fp64 selection scores equals
    the reference top-k's within fp32 rounding (near-ties may pick either expert); hash path: exact.
    Weights: against the fp64 reference recomputed for the kernel's own ids."""
    from ds4lab.reference import moe as R
    (w, ids), (rw, rids) = out, ref
    ids, rids = ids.cpu().long(), rids.cpu().long()
    logits = inputs["router_logits"].cpu()
    T, E = logits.shape
    s = R.sqrt_softplus(logits)
    reps = []
    if "tid2eid" in inputs:
        reps.append(compare_exact(ids.to(torch.int32), rids.to(torch.int32), "topk_ids (hash)"))
    else:
        bias = inputs["e_score_correction_bias"]
        sel = s + (0 if bias is None else bias.cpu().double())
        bad = []
        for t in range(T):
            row = ids[t]
            if ((row < 0) | (row >= E)).any():
                bad.append((t, f"out of range {row.tolist()}"))
            elif len(set(row.tolist())) != len(row):
                bad.append((t, f"duplicates {row.tolist()}"))
            else:
                got, want = sel[t, row], sel[t, rids[t]]
                gn, wn = got.isnan(), want.isnan()
                if int(gn.sum()) != int(wn.sum()):
                    bad.append((t, "NaN count"))
                    continue
                gs = torch.sort(got[~gn], descending=True).values
                ws = torch.sort(want[~wn], descending=True).values
                close = ((gs - ws).abs() <= 1e-6 * (1 + ws.abs())) | (gs == ws)
                if not bool(close.all()):
                    bad.append((t, f"scores {gs.tolist()} vs {ws.tolist()}"))
        reps.append(Report(ok=not bad, name="topk_ids (selection scores)", shape=tuple(ids.shape),
                           n_fail=len(bad), first_fail=bad[:5]))
    ok = (ids >= 0) & (ids < E)
    ws = torch.where(ok, torch.gather(s, 1, ids.clamp(0, E - 1)), torch.zeros((), dtype=torch.float64))
    want_w = R.renormalize(ws, inputs["routed_scaling_factor"])
    reps.append(compare(w.cpu(), want_w, "float32", name="topk_weights"))
    return reps


def _route_bench(cfg, tp):
    return [{"T": t, "E": cfg.n_routed_experts, "topk": cfg.num_experts_per_tok} for t in (1, 16, 4096)] \
        if tp == 1 else [{"T": 4, "E": cfg.n_routed_experts, "topk": cfg.num_experts_per_tok}]


def _route_torch(inputs):
    """Eager torch fp32 routing (what a framework without the fused kernel runs)."""
    lg, b, k, sc = (inputs["router_logits"], inputs["e_score_correction_bias"], inputs["topk"],
                    inputs["routed_scaling_factor"])

    def run():
        s = torch.nn.functional.softplus(lg).sqrt()
        ids = torch.topk(s + b, k, dim=-1).indices
        w = s.gather(1, ids)
        return w / w.sum(-1, keepdim=True) * sc, ids.to(torch.int32)
    return run


register(KernelSpec(
    name="sqrtsoftplus_topk",
    family="moe_routing",
    launcher="ds4lab_kernels.moe_routing:sqrtsoftplus_topk",
    reference="ds4lab.reference.moe:sqrtsoftplus_topk",
    make_inputs=make_route_inputs,
    cases=ROUTE_CASES,
    test_shapes=[{"T": 5, "E": 256, "topk": 6}, {"T": 33, "E": 64, "topk": 8}, {"T": 3, "E": 6, "topk": 6}],
    bench_shapes=_route_bench,
    flops=costs.FLOPS["sqrtsoftplus_topk"],
    min_bytes=costs.MIN_BYTES["sqrtsoftplus_topk"],
    check=check_route,
    configs=kernel_configs("moe_routing"),
    baselines={"torch_eager": _route_torch},
    bound="memory",
    aot_shape={"T": 64, "E": 256, "topk": 6},
))


# ---- W4A16 experts ----------------------------------------------------------------------------------
MOE_CASES = ("random", "ragged", "padding_nan", "tiny_scales", "clamp", "nan_unused_expert")


def _rand_i32(shape, g, device):
    return torch.randint(-2**31, 2**31 - 1, shape, generator=g, device=device, dtype=torch.int64).to(torch.int32) \
        if device == "cpu" else torch.randint(-2**31, 2**31 - 1, shape, generator=g, device=device, dtype=torch.int32)


def _distinct_ids(T, E, K, g, device):
    """``[T, K]`` ids, distinct per token; all distinct across tokens while ``T*K <= E``."""
    if T * K <= E:
        return torch.randperm(E, generator=g, device=device)[:T * K].view(T, K)
    return torch.argsort(torch.rand(T, E, generator=g, device=device), dim=1)[:, :K]


def make_moe_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """bf16 activations ``[T, D]`` (unit RMS, as after the FFN RMSNorm), random INT4 nibbles for all
    ``E`` experts, bf16 group scales ``~ exp(U(-.5,.5)) / (4.6 sqrt(K))`` (so pre-activations are
    O(1)), routing weights renormalised to 1.5 and ids distinct per token (touching ``min(E, T*topk)``
    experts at decode sizes). Adversarial: ``ragged`` (experts with 5, 0 and 33 tokens when T allows;
    a few -1 ids), ``padding_nan`` (padding tokens: ids all -1, x NaN), ``tiny_scales`` (scales
    ~1e-23 on half the groups), ``clamp`` (x x 8: the SwiGLU clamp at 10 is active),
    ``nan_unused_expert`` (NaN/inf scales and weights of experts nobody picks)."""
    T, E, D, I, K = shape["T"], shape["E"], shape["D"], shape["I"], shape["topk"]
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, D, generator=g, device=dev)
    w13 = _rand_i32((E, 2 * I, D // 8), g, dev.type)
    w2 = _rand_i32((E, D, I // 8), g, dev.type)

    def scales(N, Kd):
        return (torch.exp(torch.rand(E, N, Kd // GROUP, generator=g, device=dev) - 0.5) / (4.6 * Kd ** 0.5))
    s13, s2 = scales(2 * I, D), scales(D, I)
    ids = _distinct_ids(T, E, K, g, dev)
    tw = torch.rand(T, K, generator=g, device=dev) + 0.1
    if case == "ragged":
        # expert 1: 5 tokens, expert 2: 0 tokens, expert 3: 33 tokens (as many as T allows)
        ids = _distinct_ids(T, E, K, g, dev)
        ids = torch.where(ids == 2, torch.full_like(ids, 0), ids)  # nobody on expert 2 ...
        ids = torch.where((ids == 1) | (ids == 3), torch.full_like(ids, 0), ids)
        ids[:, 0] = 4 % E
        ids[:min(T, 5), 1] = 1
        ids[:min(T, 33), 2 % K] = 3
        # keep rows distinct: drop collisions to -1
        srt = torch.sort(ids, dim=1).values
        dup_row = (srt[:, 1:] == srt[:, :-1]).any(1)
        for t in dup_row.nonzero().flatten().tolist():
            seen = set()
            for j in range(K):
                v = int(ids[t, j])
                if v in seen:
                    ids[t, j] = -1
                seen.add(v)
        ids[-1, -1] = -1
    elif case == "padding_nan":
        pad = torch.arange(T, device=dev) % 3 == 2
        ids[pad] = -1
        x[pad] = float("nan")
    elif case == "tiny_scales":
        s13[..., ::2] = 1e-23
        s2[..., ::2] = 1e-23
    elif case == "clamp":
        x = x * 8
    elif case == "nan_unused_expert":
        used = torch.zeros(E, dtype=torch.bool, device=dev)
        used[ids.flatten()] = True
        s13[~used] = float("nan")
        s2[~used] = float("inf")
    elif case not in MOE_CASES:
        raise ValueError(f"case={case!r}: known cases {MOE_CASES}")
    tw = tw / tw.sum(1, keepdim=True) * 1.5
    return {"x": x.to(torch.bfloat16), "w13_packed": w13, "w13_scale": s13.to(torch.bfloat16),
            "w2_packed": w2, "w2_scale": s2.to(torch.bfloat16), "topk_weights": tw.float().contiguous(),
            "topk_ids": ids.to(torch.int32).contiguous(), "swiglu_limit": 10.0}


def check_moe(out, ref, inputs) -> list:
    """bf16 budget with ``atol`` scaled by the output's RMS (when above 1): an output element that
    is a small sum of large terms (the ``clamp`` case: |h| up to 100) carries the terms' absolute
    rounding error (fp16 h on the prefill path, 2^-11 relative), not its own."""
    from ds4lab.harness.numerics import Tolerance, tolerance_for
    base = tolerance_for("bfloat16")
    r = ref.detach().double()
    fin = r[r.isfinite()]
    rms = float(fin.square().mean().sqrt()) if fin.numel() else 0.0
    tol = Tolerance(atol=base.atol * max(1.0, rms), rtol=base.rtol, max_diff=base.max_diff)
    return [compare(out, ref, tol, name="moe out")]


# the step's decode calls at TP=4: batch 1, 4, 16 and batch-16 MTP (32 tokens, 192 pairs: still the decode path)
DECODE_T = (1, 4, 16, 32)
PREFILL_T = 4096


def _moe_bench(cfg, tp):
    w13, w2 = op_shapes(cfg, tp)["moe_w13"].dims, op_shapes(cfg, tp)["moe_w2"].dims
    base = {"E": w13["E"], "D": w13["K"], "I": w2["K"], "topk": w13["topk"], "tp": tp}
    ts = (1, PREFILL_T) if tp == 1 else DECODE_T + (PREFILL_T,)
    return [{"T": t, **base} for t in ts]


def _moe_config_for(arch, shape):
    """Bench shapes (from geometry: they carry ``tp``) time the configs of the path the launcher
    would pick; test and AOT shapes run every config (both paths are correct at any size)."""
    from ds4lab_kernels.moe_w4a16 import CONFIGS, DECODE_MAX_PAIRS
    if "tp" not in shape:
        return list(CONFIGS[arch])
    path = "decode" if shape["T"] * shape["topk"] <= DECODE_MAX_PAIRS else "prefill"
    if path == "prefill" and shape["T"] >= 1024:
        return ["prefill"]  # prefill_m16 is for short prefills (a few hundred pairs)
    if path == "decode":
        # every decode row: the defaults, one row per older variant and the moe5 candidates (the rows
        # that lost at every T were removed from the table)
        return [k for k, v in CONFIGS[arch].items() if v["path"] == path]
    return [k for k, v in CONFIGS[arch].items() if v["path"] == path]


def _vllm_peer(inputs):
    """vLLM 0.32's Triton ``fused_moe_kernel_gptq_awq`` at vLLM's own config for the shape, as a
    vLLM step runs it (2 peer GEMMs + activation + top-k sum; metadata made here, outside the timed
    region): :mod:`ds4lab.harness.peer_moe`. The config sweep is ``python -m ds4lab.harness.moe_bench``."""
    from ds4lab.harness import peer_moe
    return peer_moe.PeerMoE(peer_moe.load_peer(), **inputs)


register(KernelSpec(
    name="fused_moe_w4a16",
    family="moe_w4a16",
    launcher="ds4lab_kernels.moe_w4a16:fused_moe_w4a16",
    reference="ds4lab.reference.moe:fused_moe_w4a16",
    make_inputs=make_moe_inputs,
    cases=MOE_CASES,
    # decode (T*topk <= 128 pairs) and prefill (tokens grouped by expert) shapes; small D/I
    test_shapes=[{"T": 3, "E": 8, "D": 256, "I": 128, "topk": 2},
                 {"T": 40, "E": 4, "D": 256, "I": 256, "topk": 4}],
    bench_shapes=_moe_bench,
    flops=costs.FLOPS["fused_moe_w4a16"],
    min_bytes=costs.MIN_BYTES["fused_moe_w4a16"],
    # a call reads the selected experts only (all 256 are inputs): the bench's cold-L2 rotation
    # counts these bytes, not the 830 MB of inputs (issue 19 item 4)
    touched_bytes=costs.TOUCHED_BYTES["fused_moe_w4a16"],
    check=check_moe,
    configs=kernel_configs("moe_w4a16"),
    config_for=_moe_config_for,
    # torch_dequant_bf16 is a straw man (python loop over experts, eager); the real peer is vLLM's
    # Triton W4A16 MoE (issue 20)
    baselines={"torch_dequant_bf16": reference_baseline("ds4lab.reference.moe:dequant_bf16_moe"),
               "vllm_triton_w4a16": _vllm_peer},
    bound="memory",
    aot_shape={"T": 16, "E": 8, "D": 4096, "I": 512, "topk": 6},
    sm89_mma={"_prefill_w13_kernel": "HMMA", "_prefill_w2_kernel": "HMMA",
              "_dec_mma_w13_kernel": "HMMA", "_dec_mma_w2_kernel": "HMMA"},
))
