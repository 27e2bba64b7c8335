"""Registry entries: mHC hyper-connections (SPEC.md §2 item 8).

Six launchers share one input generator: the pre-norm GEMM, pre, layer-0 broadcast pre, post, the fused
post+pre between sublayers and hc_head. Shapes come from ``geometry.op_shapes()["hc_prenorm_gemm"]``
(``K = hc * D = 16384``, ``N = 24``). mHC weights and work are replicated on every TP rank, so TP=4 runs
exactly the TP=1 work; its bench list is one decode shape to keep the GPU suite short.
"""
from __future__ import annotations

import math

import torch

from ds4lab.geometry import op_shapes
from ds4lab.harness import costs
from ds4lab.harness.numerics import Tolerance, compare, compare_exact, tolerance_for
from ds4lab.harness.registry import KernelSpec, kernel_configs, reference_baseline, register

HC = 4
CASES = ("random", "large_rows", "zero_rows", "sharp_comb")
POST_CASES = ("random", "large_rows", "zero_rows", "nan_row", "x2")
# "x2": a second addend (the shared expert's output, its own per-token scale) summed into x in bf16;
# "x2_cancel": x2 = -x on some rows (the bf16 sum is exactly 0: the post is the comb mix alone)
FUSED_CASES = CASES + ("x2", "x2_cancel")

# Normalised mixes (mix * rsqrt(mean x^2)) are O(1). fp32 (interpreter / ieee): accumulation-order noise only.
# TF32: operands keep 10 mantissa bits (2^-11 relative per product), over K=16384 random-signed products of
# size ~1/sqrt(K) that is ~5e-4 absolute on an O(1) mix; gates (sigmoid slope <= 1/4, x2 for post) and the
# Sinkhorn comb (a contraction of the softmax) inherit about that.
_TOL_FP32 = Tolerance(atol=2e-5, rtol=1e-4, max_diff=1e-8)
_TOL_TF32 = Tolerance(atol=3e-3, rtol=3e-3, max_diff=2e-5)


def _dims(shape):
    return shape["T"], shape["D"], shape.get("hc", HC), shape.get("N", (2 + HC) * HC)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _residual(T, hc, D, case, g):
    """bf16 residual streams with per-token log-uniform magnitudes (1e-2..1e2); adversarial rows on top."""
    mag = torch.exp(torch.empty(T, 1, 1).uniform_(-4.6, 4.6, generator=g))
    r = torch.randn(T, hc, D, generator=g) * mag * (1 + 0.5 * torch.rand(1, hc, 1, generator=g))
    if case == "large_rows" and T:
        r[::2] *= 1e3                       # massive activations ~1e4..1e5 (fp32 sum of squares ~1e14)
        r[1::4] *= 1e-4
    elif case == "zero_rows" and T:
        r[::3] = 0.0                         # rsqrt(0 + eps) path; the collapse and its norm stay finite
    return r


def _params(hc, D, n_mix, case, g, head=False):
    K = hc * D
    fn = torch.randn(n_mix, K, generator=g) * (2.0 / math.sqrt(K))
    if head:
        return fn, torch.tensor([1.0]) + 0.5 * torch.rand(1, generator=g), 0.5 * torch.randn(hc, generator=g)
    scale = torch.tensor([1.0, 1.0, 1.5]) * (0.5 + torch.rand(3, generator=g))
    base = 0.5 * torch.randn(n_mix, generator=g)
    if case == "sharp_comb":
        # near one-hot softmax rows (bias spread of +-10): Sinkhorn far from converged, eps terms matter
        base[2 * hc:] = 10.0 * torch.randn(hc * hc, generator=g)
        base[:2 * hc] = torch.tensor([-12.0, 12.0, 0.0, 3.0] * 2)[: 2 * hc]   # saturated gates
    return fn, scale, base


def make_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu", kind: str = "pre") -> dict:
    """Inputs for one mHC launcher ``kind`` in (gemm, pre, broadcast, post, fused, head)."""
    if case not in CASES + POST_CASES + FUSED_CASES:
        raise ValueError(f"case={case!r}: known cases {sorted(set(CASES + POST_CASES + FUSED_CASES))}")
    T, D, hc, n_mix = _dims(shape)
    g = _gen(seed)
    dev = torch.device(device)
    res = _residual(T, hc, D, case if case != "nan_row" else "random", g)
    if kind == "head":
        fn, scale, base = _params(hc, D, hc, case, g, head=True)
        return {"residual": res.to(torch.bfloat16).to(dev), "fn": fn.to(dev), "hc_scale": scale.to(dev),
                "hc_base": base.to(dev), "rms_eps": 1e-6, "hc_eps": 1e-6}
    fn, scale, base = _params(hc, D, n_mix, case, g)
    if kind == "gemm":
        return {"x": res.reshape(T, hc * D).to(torch.bfloat16).to(dev), "fn": fn.to(dev)}
    w = (1.0 + 0.2 * torch.randn(D, generator=g)).to(torch.bfloat16)
    common = {"fn": fn.to(dev), "hc_scale": scale.to(dev), "hc_base": base.to(dev), "norm_weight": w.to(dev),
              "rms_eps": 1e-6, "hc_pre_eps": 1e-6, "hc_sinkhorn_eps": 1e-6, "hc_post_mult": 2.0,
              "sinkhorn_iters": 20, "norm_eps": 1e-6}
    if kind == "pre":
        return {"residual": res.to(torch.bfloat16).to(dev), **common}
    if kind == "broadcast":
        return {"x": res[:, 0].contiguous().to(torch.bfloat16).to(dev), **common}
    # post / fused: the previous sublayer's output and a valid (post, comb) pair from the reference gates
    x = torch.randn(T, D, generator=g) * torch.exp(torch.empty(T, 1).uniform_(-4.6, 4.6, generator=g))
    if case == "nan_row" and T:
        x[0, 3] = float("nan")
        if T > 1:
            x[-1, -1] = float("inf")
    post = 2.0 * torch.sigmoid(torch.randn(T, hc, 1, generator=g))
    logits = torch.randn(T, hc, hc, generator=g) * (3.0 if case == "sharp_comb" else 1.0)
    from ds4lab.reference.mhc import sinkhorn
    comb = sinkhorn(logits.double(), 20, 1e-6).float()
    io = {"x": x.to(torch.bfloat16).to(dev), "residual": res.to(torch.bfloat16).to(dev),
          "post_mix": post.to(dev), "comb_mix": comb.to(dev)}
    if case in ("x2", "x2_cancel") or shape.get("x2"):  # shape "x2": the compile report's x2 variant
        x2 = torch.randn(T, D, generator=g) * torch.exp(torch.empty(T, 1).uniform_(-4.6, 4.6, generator=g))
        x2 = x2.to(torch.bfloat16)
        if case == "x2_cancel" and T:
            x2[::2] = -io["x"][::2].cpu()
        io["x2"] = x2.to(dev)
    if kind == "fused" and shape.get("quant_out"):  # the compile report's quant_out variant (pq-mhc)
        io["quant_out"] = True
    if kind == "fused" and shape.get("prefetch"):   # the compile report's prefetch variant (l2pf)
        io["prefetch"] = prefetch_tensors(D, dev)
    return io if kind == "post" else {**io, **common}


def prefetch_tensors(D: int, device="cpu") -> tuple:
    """``mhc_fused_post_pre(prefetch=...)``'s tensors as the decode step's ``post_attn+pre_ffn`` seam passes them
    at TP=4 (``RankModel._prefetch_moe``: dtypes and sizes, zeros): the router gate ``(256, D)`` bf16 and bias
    fp32, the shared expert's w13 ``(1024, D)`` e4m3 and its UE8M0 scale, the next seam's fn ``(24, 4 D)`` fp32,
    scale, base and norm weight."""
    def z(*shape, dtype=torch.float32):
        return torch.zeros(shape, dtype=dtype, device=device)
    return (z(256, D, dtype=torch.bfloat16), z(256), z(1024, D, dtype=torch.float8_e4m3fn),
            z(8, D // 128, dtype=torch.uint8), z(24, 4 * D), z(3), z(24), z(D, dtype=torch.bfloat16))


# ---- checks ------------------------------------------------------------------------------------------
def _tol(inputs) -> Tolerance:
    t = next(v for v in inputs.values() if isinstance(v, torch.Tensor))
    return _TOL_TF32 if (t.device.type == "cuda" and inputs.get("precision", "tf32") == "tf32") else _TOL_FP32


def _rowwise(out, ref, name, tol="bfloat16"):
    """Compare with every token row scaled by 1/rms(finite ref row): a fixed budget then means the same
    relative accuracy for a 1e-3 token and a 1e4 token (magnitudes differ by orders across tokens)."""
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    T = r.shape[0]
    rf = torch.where(r.isfinite(), r, torch.zeros_like(r)).reshape(T, -1)
    rms = rf.square().mean(-1).sqrt()
    s = torch.where(rms > 0, 1.0 / rms, torch.ones_like(rms)).reshape(T, *([1] * (r.dim() - 1)))
    return compare(o * s, r * s, tol, name=name + " (rows / rms)")


def _mixes_norm(mixes, sqrsum, numel, eps=1e-6):
    return mixes * torch.rsqrt(sqrsum / numel + eps).unsqueeze(-1)


def check_gemm(out, ref, inputs):
    (m, s), (rm, rs) = out, ref
    K = inputs["x"].shape[1]
    rsq = rs.sum(0).double().cpu()
    norm = lambda v: _mixes_norm(v.sum(0).double().cpu(), rsq, K)  # noqa: E731
    return [compare(norm(m), norm(rm), _tol(inputs), "mixes * rsqrt(mean x^2) (sum over splits)"),
            compare(s.sum(0), rs.sum(0), tolerance_for("float32"), "sqrsum (sum over splits)")]


def _check_pre_outputs(post, comb, out, rpost, rcomb, rout, inputs, norm=True):
    tol = _tol(inputs)
    return [compare(post, rpost, tol, "post_mix"), compare(comb, rcomb, tol, "comb_mix (Sinkhorn)"),
            compare(out, rout, "bfloat16", "layer_input") if norm else _rowwise(out, rout, "layer_input")]


def check_pre(out, ref, inputs):
    return _check_pre_outputs(*out, *ref, inputs, norm=inputs.get("norm_weight") is not None)


def check_broadcast(out, ref, inputs):
    return [compare_exact(out[0], ref[0], "residual (4 copies)"),
            *_check_pre_outputs(*out[1:], *ref[1:], inputs, norm=inputs.get("norm_weight") is not None)]


def check_post(out, ref, inputs):
    return [_rowwise(out, ref, "new residual")]


def check_fused(out, ref, inputs):
    """The new residual against the fp64 post; the gates and layer input against the fp64 pre OF THE
    RESIDUAL THE KERNEL WROTE: fp32 vs fp64 post arithmetic flips ~5e-5 of the bf16 roundings by one ulp,
    and one flipped element moves a mix by ~2^-8 |fn| (1e-3 at the small test K), which is not an error."""
    from ds4lab.reference.mhc import mhc_pre
    from ds4lab_kernels.fp8_quant import per_token_group_quant_fp8
    pre_kw = {k: v for k, v in inputs.items() if k not in ("x", "x2", "residual", "post_mix", "comb_mix", "quant_out")}
    ref_pre = mhc_pre(out[0], **pre_kw)
    reports = [_rowwise(out[0], ref[0], "residual_cur"),
               *_check_pre_outputs(*out[1:4], *ref_pre, inputs, norm=inputs.get("norm_weight") is not None)]
    if inputs.get("quant_out"):  # the FP8 copy: the standalone quant of the layer input returned, bit for bit
        q, s = per_token_group_quant_fp8(out[3], 128, scale_fmt="ue8m0", eps=1e-10)
        reports += [compare_exact(out[4][0], q, "layer_input_fp8 (bytes; any NaN equals any NaN)"),
                    compare_exact(out[4][1], s, "layer_input_scale (UE8M0 bytes)")]
    return reports


def check_head(out, ref, inputs):
    return [_rowwise(out, ref, "hc_head out")]


# ---- shapes, bytes, flops ----------------------------------------------------------------------------
def _geo(cfg, tp):
    d = op_shapes(cfg, tp)["hc_prenorm_gemm"].dims
    return {"D": d["D"], "hc": d["hc"], "N": d["N"]}


def _bench(ts1, ts4):
    def bench_shapes(cfg, tp):
        g = _geo(cfg, tp)
        return [{"T": t, **g} for t in (ts1 if tp == 1 else ts4)]
    return bench_shapes


# Candidates: timed only at the bench shapes that matter (each is a full config row, so the interpreter
# tests and the AOT report still run every row of the table at their shapes). H200 run 4: fused_m64k16.
# Issue 20: the decode seam rows (seam_*: the grid-barrier kernel; seam1_*: the one-level kernel, 1-4
# tokens) against the two-launch `decode`.
_SEAM_T = (1, 2, 4)  # T=16: `decode` alone (seam_* 27-36 us vs 18.2 there, session 4; seam1_* is `decode` above 4)
_SEAMR_T = (1, 2, 4, 8, 16)  # the row-tile seam: one launch up to 16 tokens (mhc6)
_BENCH_T4 = (1, 2, 4, 8, 16)
SEAM = "seam rows"  # every row with SEAM_BLOCK_D or SEAM1_BLOCK_D (ds4lab_kernels.mhc SEAM_ROWS / SEAM1_ROWS)
SEAMR = "seamr rows"  # every row with SEAMR_BLOCK_D (ds4lab_kernels.mhc SEAMR_ROWS)
SEAMT = "seamt rows"  # every row with SEAMT_BLOCK_D (ds4lab_kernels.mhc SEAMT_ROWS; issue 20, mhc16)
# session 6: of the seam_* / seam1_* rows only the default seam1_d64 is timed again (the others measured in
# session 5, code unchanged: NOTES.md "mHC seam (issue 20, mhc5)"); they stay in the table as candidates
_SEAM_RETIMED = ("seam1_d64",)
# mhc16: the token-parallel seamt rows at the bench's decode sizes (T = 32 too: scripts/gpu/mhc_seamt.py)
CANDIDATES = {"mhc_fused_post_pre": ((("fused_m64k16",), (512, 2048)), ((SEAM,), _SEAM_T), ((SEAMR,), _SEAMR_T),
                                     ((SEAMT,), _SEAMR_T))}


def is_seam(row: dict) -> bool:
    """A decode-seam row of the mhc table (only mhc_fused_post_pre reads its SEAM keys)."""
    return "SEAM_BLOCK_D" in row or "SEAM1_BLOCK_D" in row or "SEAMR_BLOCK_D" in row or "SEAMT_BLOCK_D" in row


def _group(labels, table, seam):
    """A candidate group's labels: SEAM -> the re-timed seam_* / seam1_* rows, SEAMR -> every seamr row."""
    if labels == (SEAM,):
        return [c for c in seam if c in _SEAM_RETIMED]
    if labels == (SEAMR,):
        return [c for c in seam if "SEAMR_BLOCK_D" in table[c]]
    if labels == (SEAMT,):
        return [c for c in seam if "SEAMT_BLOCK_D" in table[c]]
    return list(labels)


def _seam_key(row: dict, T: int, D: int):
    """The compiled seam code of ``row`` at ``(T, D)``: rows with equal keys build the same kernels; None
    when the row runs the two-pass `decode` kernels there (a seam1 row above SEAM1_MAX_T tokens)."""
    from ds4lab_kernels import mhc as K
    cpu = torch.device("cpu")
    if "SEAMT_BLOCK_D" in row:
        if T > row.get("SEAMT_MAX_T", K.SEAMT_MAX_T):
            return None
        p = K.seamt_plan(T, D, cpu, row, compiled=True)
        return ("seamt", p["BLOCK_M"], p["BLOCK_D"], p["launches"], p["BLOCK_S"], p["CHUNK"], row["SEAMT_WARPS"])
    if "SEAMR_BLOCK_D" in row:
        if T > row.get("SEAMR_MAX_T", K.SEAMR_MAX_T):
            return None
        p = K.seamr_plan(T, D, cpu, row, compiled=True)
        return ("seamr", p["BLOCK_M"], p["BLOCK_D"], p["launches"], p["BLOCK_S"], row["SEAMR_WARPS"])
    if "SEAM1_BLOCK_D" in row:
        if T > K.SEAM1_MAX_T:
            return None
        p = K.seam1_plan(T, D, cpu, row, compiled=True)
        return ("seam1", p["BLOCK_D"], p["launches"], p["BLOCK_S"], row["SEAM1_WARPS"])
    p = K.seam_plan(T, D, cpu, row, compiled=True)
    return ("seam", p["BLOCK_D"], p["launches"], p["BLOCK_S"], row["SEAM_WARPS"])


def _config_for_kernel(name):
    def config_for(arch, shape):
        table = kernel_configs("mhc")[arch]
        seam = {c for c, row in table.items() if is_seam(row)}
        # the seam rows change only mhc_fused_post_pre: every other launcher would run them as `decode`
        labels = [c for c in table if name == "mhc_fused_post_pre" or c not in seam]
        if shape.get("aot") == "quant":
            return [step_row(shape["T"], arch)]
        if shape.get("aot") == "seamt":  # mhc16: the seamt rows with quant_out at their phase-B chunk sizes
            return [c for c in labels if "SEAMT_BLOCK_D" in table[c]]
        if shape.get("aot"):
            # compile each distinct seam kernel once: rows whose launch plan and warps coincide at this
            # shape build the same code (at T = 8 every seam_* row's dot blocks are 32 columns, two
            # launches; the seam1_* rows run the two-pass `decode` kernels there)
            seen, keep = set(), []
            for c in labels:
                if c in seam:
                    key = _seam_key(table[c], shape["T"], shape["D"])
                    if key is None or key in seen:
                        continue
                    seen.add(key)
                elif shape["aot"] == "seam":
                    continue
                keep.append(c)
            return keep
        if shape.get("D") != 4096:
            return labels  # interpreter test shapes / AOT: every row
        # every seam row is a candidate (timed only where its group lists the shape's T)
        cands = {c for g in CANDIDATES.values() for ls, _ in g for c in _group(ls, table, seam)} | seam
        mine = {c for ls, ts in (CANDIDATES.get(name, ())) for c in _group(ls, table, seam) if shape["T"] in ts}
        if name == "mhc_fused_post_pre" and shape["T"] in _BENCH_T4:
            cands.add("prefill")  # never picked at T <= 64; keeps the decode sweep short
            # a seam1 row above its token limit is the two-pass `decode` again: not timed twice
            mine = {c for c in mine if _seam_key(table[c], shape["T"], shape["D"]) is not None}
        return [c for c in labels if c not in cands or c in mine]
    return config_for


TEST_SHAPES = [{"T": 1, "D": 128}, {"T": 3, "D": 256}, {"T": 33, "D": 128}]
AOT_SHAPE = {"T": 8, "D": 4096, "hc": 4, "N": 24, "aot": 1}  # "aot": every config row
# the seam rows again at T = 1: 1-token blocks, 65 programs, so the one-launch (grid barrier) variant is
# what compiles (at T = 8 the 16-token blocks make 129 programs: two launches on the 128-SM target); the
# seam1 rows compile only here (64 / 128 programs: one launch; seam1x2_d64: its two launches)
AOT_SHAPE_SEAM = {"T": 1, "D": 4096, "hc": 4, "N": 24, "aot": "seam", "x2": 1}  # with the x2 addend
# quant_out=True (pq-mhc, issue 20): only the row the decode step picks at each token count's kernel
# (mhc.SEAM_DEFAULTS, then `decode`): T=1 seamr_d64, T=4 seam1_d64 (its 4-token block), T=8 and T=32 seamt_d32 on sm_89,
# the two-pass apply on sm_90; T=64 the two-pass apply on both (sm_89 runs it from 33 tokens)
AOT_SHAPES_QUANT = [{"T": t, "D": 4096, "hc": 4, "N": 24, "aot": "quant", "x2": 1, "quant_out": 1}
                    for t in (1, 4, 8, 32, 64)]
# prefetch=... (l2pf, issue 20): the decode step's seam (quant_out, no x2) with its 8 prefetch regions, at the
# token counts where the step's row issues it: T=1 seamr_d64, T=2 / 4 seam1_d64
# the seamt rows (mhc16) as the step would run them (quant_out) at 2 tokens (128-column phase-B chunks) and at
# 32 with the x2 addend (1,024-column chunks for seamt_d64, 2 token blocks: the most registers)
AOT_SHAPES_SEAMT = [{"T": 2, "D": 4096, "hc": 4, "N": 24, "aot": "seamt", "quant_out": 1},
                    {"T": 32, "D": 4096, "hc": 4, "N": 24, "aot": "seamt", "quant_out": 1, "x2": 1}]
AOT_SHAPES_PREFETCH = [{"T": t, "D": 4096, "hc": 4, "N": 24, "aot": "quant", "quant_out": 1, "prefetch": 1}
                       for t in (1, 2, 4)]


def step_row(T: int, arch: str = "sm_89") -> str:
    """The mhc row the decode step's ``mhc_fused_post_pre`` runs at ``T`` tokens on a GPU whose table is ``arch``
    (``"sm_89"`` or ``"sm_90"``; pick_config's choice)."""
    from ds4lab_kernels import mhc as K
    return next((label for top, label in K.SEAM_DEFAULTS[arch] if T <= top), "decode" if T <= 64 else "prefill")

_KINDS = [
    # name, kind, check, cases, bench (tp=1, tp=4), bound
    ("hc_prenorm_gemm", "gemm", check_gemm, CASES[:3], ((1, 8, 512, 4096), (8,)), "memory"),
    ("mhc_pre", "pre", check_pre, CASES, ((1, 8, 512), (8,)), "memory"),
    ("mhc_pre_broadcast", "broadcast", check_broadcast, CASES, ((8, 512), (8,)), "memory"),
    ("mhc_post", "post", check_post, POST_CASES, ((1, 512, 4096), (8,)), "memory"),
    ("mhc_fused_post_pre", "fused", check_fused, FUSED_CASES, ((1, 8, 512, 2048, 8192), _BENCH_T4), "memory"),
    ("hc_head", "head", check_head, CASES[:3], ((1, 8, 512), (8,)), "memory"),
]

for _name, _kind, _check, _cases, (_b1, _b4), _bound in _KINDS:
    register(KernelSpec(
        name=_name,
        family="mhc",
        launcher=f"ds4lab_kernels.mhc:{_name}",
        reference=f"ds4lab.reference.mhc:{_name}",
        make_inputs=(lambda shape, case="random", seed=0, device="cpu", _k=_kind:
                     make_inputs(shape, case, seed, device, kind=_k)),
        cases=_cases,
        test_shapes=TEST_SHAPES,
        bench_shapes=_bench(_b1, _b4),
        flops=costs.FLOPS[_name],
        min_bytes=costs.MIN_BYTES[_name],
        check=_check,
        configs=kernel_configs("mhc"),
        config_for=_config_for_kernel(_name),
        baselines={"torch_eager": reference_baseline(f"ds4lab.reference.mhc:{_name}", compute_dtype=torch.float32)},
        bound=_bound,
        aot_shape=([AOT_SHAPE, AOT_SHAPE_SEAM, *AOT_SHAPES_QUANT, *AOT_SHAPES_PREFETCH, *AOT_SHAPES_SEAMT]
                   if _kind == "fused"
                   else AOT_SHAPE),
        sm89_mma={"_hc_prenorm_gemm_kernel": "HMMA"} if _kind in ("gemm", "pre", "broadcast", "head")
        else ({"_mhc_post_kernel": "HMMA"} if _kind == "fused" else {}),
    ))
