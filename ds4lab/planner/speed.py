"""Ada (sm_89) estimates from the H200 sm_89-build measurements, and a DeepSeek-V4-Flash decode-step model.

Everything here is an ESTIMATE: no Ada card was measured. Pure Python over measured rows
(``results/decode_step.csv`` via :func:`ds4lab.harness.step.load_rows`, else ``results/bench.csv``
via :func:`ds4lab.harness.report.load_results`) and :mod:`ds4lab.geometry`; no torch. Cost
formulas come from their one home, :mod:`ds4lab.harness.costs`.

Per-op method (issue 19 item 5)
-------------------------------
For one op (a kernel call, or an op group of the measured step) the time on an Ada card is::

    t_card = max( t_h200_sm89 , max(bytes / BW_card, flops / FP8_card) )

``t_h200_sm89`` is the op's time in the sm_89 build on the H200 (same ISA and instruction mix as
on Ada, the H200's latency): a latency-bound op keeps its measured time (an H200 launch is not
slower on Ada), a bandwidth-bound one is charged the card's bandwidth. (The previous method divided
the card's roofline time by the H200 efficiency, which scaled the latency of small ops by the
bandwidth ratio too: 2.6 us of act-quant became 11 us.) It ignores the card's lower clocks and SM
count for latency-bound ops (optimistic), L2 size, and anything the H200 hides that Ada does not.

Where the measurement comes from (:func:`decode_model` says which in ``basis``):
1. ``decode_step.csv`` sm_89 rows (``ds4lab step --arch sm89``): every op group of the measured
   step, its bytes from the same formulas, plus the measured gaps between kernels;
2. else ``bench.csv``: one registered kernel row per op (:func:`lookup_row`: the nearest row, the
   sm_89 build preferred unless a native row is more than one token doubling nearer; a row at
   other dims is carried by its bytes ratio, not below a launch floor), plus labelled estimates for ops that have
   no kernel (:data:`ESTIMATED_OPS`). RMSNorm counts q_norm and kv_norm only: attn_norm and
   ffn_norm run inside the mHC kernel.

Stated assumptions, never measured here (:class:`Assumptions`, :data:`CARDS`): the all-reduce over
PCIe (two per layer at TP > 1; GeForce without P2P goes through host memory), the host's per-step
overhead (scheduler, sampler, detokenizer: ``host_us_per_step``), MTP acceptance.
:func:`community_comparison` sets the seeds' end-to-end serving figures beside the step with those
added, and names what the step leaves out.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from ds4lab.geometry import (DEFAULT_CONFIG, FP8_DS_MLA_ENTRY_BYTES, LayerKind, ModelConfig, layer_counts,
                             op_shapes)
from ds4lab.harness import costs

__all__ = ["Card", "CARDS", "H200", "SEED_FIGURES", "Assumptions", "row_efficiency", "scale_row",
           "ada_scaled_table", "additive_time", "kernel_bytes", "kernel_flops", "decode_terms",
           "bandwidth_ceiling", "weight_bytes_per_rank", "decode_model", "headline", "headline_point", "HEADLINE_KEYS",
           "get_card", "card_table", "ESTIMATED_OPS", "lookup_row", "step_bytes", "step_terms",
           "community_comparison", "STEP_LEAVES_OUT"]


@dataclass(frozen=True)
class Card:
    """One GPU. ``bw_tbps`` memory bandwidth (TB/s), ``fp8_tflops`` dense FP8 with fp32 accumulate,
    ``mem_gb`` memory, ``link_gbs`` effective all-reduce bus bandwidth (GB/s), ``allreduce_us`` the
    per-all-reduce latency (both ``None`` where not modelled: the H200 is the single benchmark
    card, never a TP member here), ``source`` where the figures come from."""
    name: str
    bw_tbps: float
    fp8_tflops: float
    mem_gb: float
    sms: int
    link_gbs: float | None
    allreduce_us: float | None
    source: str


# SPEC.md §4 (datasheet leads). Links: all three are PCIe 4.0 x16 cards without NVLink. GeForce has
# P2P disabled, so NCCL all-reduce goes through host memory (~10-15 GB/s bus bandwidth reported by
# nccl-tests users on 4x 4090); pro cards keep P2P over PCIe (~20 GB/s). Latencies: small-message
# NCCL ring over PCIe, ~10-20 us (a lead, not measured here).
CARDS: dict[str, Card] = {c.name: c for c in (
    Card("RTX 4090-48G", 1.008, 330.0, 48, 128, 12.0, 18.0,
         "SPEC.md §4 datasheet lead (GeForce FP8 fp32-acc = half rate); 48 GB memory mod"),
    Card("RTX 6000 Ada", 0.960, 728.0, 48, 142, 20.0, 12.0, "SPEC.md §4 datasheet lead"),
    Card("L40S", 0.864, 733.0, 48, 142, 20.0, 12.0, "SPEC.md §4 datasheet lead"),
)}
# The benchmark GPU, measured (SPEC.md §4); rows carry their own same-run roofs, used in preference.
H200 = Card("H200", 4.25, 1256.0, 141, 132, None, None, "measured (copy roof, cuBLAS FP8 8192^3)")

# The seeds' published figures (batch 1, one stream; SPEC.md §6 seed recipe). Claims, not measured here.
SEED_FIGURES = [
    {"card": "RTX 4090-48G", "tp": 4, "batch": 1, "mode": "plain", "tok_s": 82.0,
     "source": "fork yhfgyyf/vllm-deepseek-v4-sm89, 4x RTX 4090-48G TP4"},
    {"card": "RTX 6000 Ada", "tp": 4, "batch": 1, "mode": "plain", "tok_s": 80.0,
     "source": "seed claim, 4x RTX 6000 Ada TP4"},
    {"card": "RTX 6000 Ada", "tp": 4, "batch": 1, "mode": "mtp", "tok_s": 124.0, "tok_s_range": "115-133",
     "source": "seed claim, 4x RTX 6000 Ada TP4, MTP k=1"},
]


def get_card(name: str) -> Card:
    """The Ada card called ``name`` (a key of :data:`CARDS`); ValueError naming it and the known ones."""
    if name not in CARDS:
        raise ValueError(f"card {name!r}: not modelled; cards: {sorted(CARDS)}")
    return CARDS[name]


def card_table(cards=None, with_h200: bool = True) -> list[dict]:
    """The card figures as table rows (``cards``: names, :class:`Card` objects or a dict of them;
    default every Ada card), plus the H200 benchmark card. Link bandwidth and all-reduce latency
    read ``n/a`` where not modelled (the H200: one card, never a TP member here), not 0."""
    if cards is None:
        cards = CARDS
    cs = list(cards.values()) if isinstance(cards, dict) else [c if isinstance(c, Card) else get_card(c)
                                                               for c in cards]
    na = "n/a (not modelled)"
    return [{"card": c.name, "TB/s": c.bw_tbps, "FP8 TFLOP/s": c.fp8_tflops, "GB": c.mem_gb, "SMs": c.sms,
             "link GB/s": na if c.link_gbs is None else c.link_gbs,
             "all-reduce us": na if c.allreduce_us is None else c.allreduce_us, "source": c.source}
            for c in [*cs, *([H200] if with_h200 else [])]]


@dataclass(frozen=True)
class Assumptions:
    """Every assumption of the decode model, each with its default and where it comes from."""
    launch_floor_us: float = 3.0      # per kernel call under CUDA-graph replay (H200 floor rows 1.7-2.6 us)
    stream_eff: float = 0.85          # fraction of card bandwidth a streaming kernel reaches (additive model)
    est_efficiency: float = 0.3       # roof fraction for small ops with no row (typical of our decode rows)
    est_weight_efficiency: float = 0.6  # roof fraction of large weight-streaming GEMVs with no kernel
                                        # (LM head, compressors, router): cuBLAS/Marlin-class GEMV, a lead
    ctx_len: int = 8192               # context per request (tokens) for cache reads
    mtp_acceptance: float = 0.8       # P(draft accepted), MTP k=1 (DeepSeek-V3 report: 85-90% for token 2)
    mtp_k: int = 1                    # draft tokens per step (seeds use num_speculative_tokens=1)
    lm_head_bytes: float = 2.0        # LM head dtype bytes (bf16 in the checkpoint), vocab-split by TP
    mtp_weight_bytes: float = 2.0     # community checkpoint: MTP block mtp.0.* is BF16 (SPEC.md §1)
    compressor_weight_bytes: float = 1.0  # compressor wkv/wgate (dim -> coff*head_dim) assumed FP8
    router_weight_bytes: float = 2.0  # router gate [256, 4096] assumed bf16, replicated
    uniform_routing: bool = True      # distinct experts touched: E(1-(1-k/E)^T) (uniform routing)
    plain_runs_mtp_layer: bool = False  # vLLM runs the MTP layer only as the drafter
    host_us_per_step: float = 1000.0  # vLLM V1 host work per decode step outside the GPU graph (scheduler,
                                      # sampler, detokenize, streaming): a lead of ~1 ms at batch 1, not measured
    native_slack: float = 1.0         # lookup: a native row wins only when nearer by more than this
                                      # (log2 token gap + shape distance; 1 = one doubling)

    def to_dict(self) -> dict:
        return asdict(self)


# ---- the scaling method --------------------------------------------------------------------------

def row_efficiency(row: dict) -> float | None:
    """Fraction of its binding roof a row reached (max of bandwidth and FP8 fractions, same-run roofs)."""
    t = row.get("p50_us")
    if not t:
        return None
    bw = (row.get("min_bytes") or 0.0) / (t * 1e-6) / 1e12
    fl = (row.get("flops") or 0.0) / (t * 1e-6) / 1e12
    roof_bw = row.get("roof_copy_tbps") or H200.bw_tbps
    roof_fp8 = row.get("roof_fp8_tflops") or H200.fp8_tflops
    e = max(bw / roof_bw, fl / roof_fp8)
    return e if e > 0 else None


def roof_us(min_bytes: float, flops: float, card: Card) -> float:
    """Roofline time (us) of ``min_bytes`` and ``flops`` on ``card``."""
    return max(min_bytes / (card.bw_tbps * 1e12), flops / (card.fp8_tflops * 1e12)) * 1e6


def eff_time(min_bytes: float, flops: float, e: float, card: Card, floor_us: float) -> float:
    """The issue's method: the card's roofline time at efficiency ``e``, not below the launch floor."""
    return max(floor_us, roof_us(min_bytes, flops, card) / e)


def additive_time(min_bytes: float, flops: float, t_h200_us: float, card: Card, a: Assumptions,
                  h200: Card = H200) -> float:
    """Bracket: t = latency part (H200 time minus its streaming time at ``stream_eff``, carried over)
    + the card's streaming time at ``stream_eff``; not below the launch floor."""
    stream_h = roof_us(min_bytes, flops, h200) / a.stream_eff
    lat = max(0.0, t_h200_us - stream_h)
    return max(a.launch_floor_us, lat + roof_us(min_bytes, flops, card) / a.stream_eff)


def _h200_of(row: dict) -> Card:
    return Card("H200", row.get("roof_copy_tbps") or H200.bw_tbps, row.get("roof_fp8_tflops") or H200.fp8_tflops,
                141, 132, None, None, "same-run roofs")


def scale_row(row: dict, card: Card, a: Assumptions = Assumptions()) -> dict:
    """One benchmark row scaled to ``card``: efficiency, H200 time, Ada time by the efficiency-carry
    method (``ada_us``, issue 15), by the decode model's per-op method (``ada_max_us``:
    ``max(H200 time, card roofline)``, issue 19) and the additive bracket."""
    e = row_efficiency(row)
    b, f = row.get("min_bytes") or 0.0, row.get("flops") or 0.0
    out = {"kernel": row["kernel"], "build": row["build"], "tp": row["tp"], "shape": row["shape"],
           "h200_us": row["p50_us"], "e": e, "card": card.name}
    if e is None:
        out.update(ada_us=None, ada_max_us=None, ada_additive_us=None, bound=None, ratio=None)
        return out
    h = _h200_of(row)
    mem = b / (h.bw_tbps * 1e12) >= f / (h.fp8_tflops * 1e12)
    out["bound"] = "memory" if mem else "compute"
    out["ada_us"] = eff_time(b, f, e, card, a.launch_floor_us)
    out["ada_max_us"] = max(row["p50_us"], roof_us(b, f, card))  # the decode model's per-op method (issue 19)
    out["ada_additive_us"] = additive_time(b, f, row["p50_us"], card, a, h)
    out["ratio"] = out["ada_us"] / row["p50_us"]
    return out


def _best_rows(rows: list[dict], build: str | None = "sm89") -> list[dict]:
    """Our kernel's fastest config per (kernel, build, tp, shape), OK rows with a p50."""
    best: dict[tuple, dict] = {}
    for r in rows:
        if r.get("impl") != "ds4lab" or r.get("p50_us") is None or r.get("status", "OK") != "OK":
            continue
        if build and r.get("build") != build:
            continue
        k = (r["kernel"], r["build"], r["tp"], r["shape"])
        if k not in best or r["p50_us"] < best[k]["p50_us"]:
            best[k] = r
    return [best[k] for k in sorted(best, key=lambda k: (k[0], k[1], k[2] or 0, k[3]))]


def ada_scaled_table(rows: list[dict], cards=None, a: Assumptions = Assumptions()) -> list[dict]:
    """Every sm_89-build row scaled to every card: one row per (kernel, tp, shape) with a column per card."""
    cards = list((cards or CARDS).values()) if isinstance(cards or CARDS, dict) else list(cards)
    out = []
    for r in _best_rows(rows, "sm89"):
        t = None
        for c in cards:
            s = scale_row(r, c, a)
            if t is None:
                t = {"kernel": r["kernel"], "tp": r["tp"], "shape": r["shape"], "bound": s["bound"],
                     "h200_sm89_us": r["p50_us"], "e": s["e"]}
            t[f"{c.name} us"] = s["ada_us"]
            t[f"{c.name} max-method us"] = s["ada_max_us"]
            t[f"{c.name} additive us"] = s["ada_additive_us"]
        out.append(t)
    return out


# ---- byte / FLOP formulas: the registry's own (ds4lab.harness.costs, torch-free) -----------------

def kernel_bytes(kernel: str, s: dict) -> float:
    """Minimum bytes of one call (:func:`ds4lab.harness.costs.min_bytes`; KeyError for an unknown kernel)."""
    return costs.min_bytes(kernel, s)


def kernel_flops(kernel: str, s: dict) -> float:
    """Useful FLOPs of one call (:func:`ds4lab.harness.costs.flops`; 0 for data movement)."""
    return costs.flops(kernel, s)


# ---- row lookup -------------------------------------------------------------------------------------

_TOKEN_KEYS = ("M", "T", "B", "R")  # the per-step token count of each kernel's shape


def _shape(r: dict) -> dict:
    s = r.get("_shape")
    if s is None:
        s = json.loads(r["shape"]) if isinstance(r["shape"], str) else dict(r["shape"])
        r["_shape"] = s
    return s


def _dist(a: dict, b: dict, tok: str | None) -> float:
    """Log2 distance between shapes over the non-token keys (a differing string key costs 100)."""
    d = 0.0
    for k in set(a) | set(b):
        if k == tok or k in ("scale_fmt", "a_fmt", "b_fmt", "x_fmt", "w_fmt"):
            continue
        va, vb = a.get(k), b.get(k)
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va > 0 and vb > 0:
            d += abs(math.log2(va / vb))
        elif va != vb:
            d += 100.0
    return d


def _near_rows(rows, kernel, build, shape, tp, tok):
    """(shape distance, rows at that distance) of ``build``'s rows of ``kernel``; (inf, []) if none.
    Distance: log2 over the non-token dims, 0.5 for another TP."""
    cand = [r for r in rows if r["kernel"] == kernel and r["build"] == build and row_efficiency(r)]
    if not cand:
        return math.inf, []
    scored = [(_dist(_shape(r), shape, tok) + (0.0 if r["tp"] == tp else 0.5), r) for r in cand]
    dmin = min(d for d, _ in scored)
    return dmin, [r for d, r in scored if d == dmin]


def _at_tokens(near, tok, x):
    """(t_us, bytes, e, token gap, how) at ``x`` tokens from same-dims rows ``near``: linear in
    tokens between the bracketing rows (gap = log2 of the wider bracket side, 0 when exact), else
    the nearest row (gap = |log2| of the ratio)."""
    if tok is None or not any(tok in _shape(r) for r in near):
        r = near[0]
        return r["p50_us"], r.get("min_bytes") or 0.0, row_efficiency(r), 0.0, "exact"
    pts = {}
    for r in near:
        if tok in _shape(r):
            pts.setdefault(_shape(r)[tok], r)
    xs = sorted(pts)
    below, above = [v for v in xs if v <= x], [v for v in xs if v >= x]
    if below and above:
        x0, x1 = below[-1], above[0]
        r0, r1 = pts[x0], pts[x1]
        if x0 == x1:
            return r0["p50_us"], r0.get("min_bytes") or 0.0, row_efficiency(r0), 0.0, "exact"
        w = (x - x0) / (x1 - x0)  # time is affine in tokens (fixed latency + per-token work)
        lerp = lambda a, b: a + w * (b - a)  # noqa: E731
        return (lerp(r0["p50_us"], r1["p50_us"]), lerp(r0.get("min_bytes") or 0.0, r1.get("min_bytes") or 0.0),
                lerp(row_efficiency(r0), row_efficiency(r1)), math.log2(max(x / x0, x1 / x)),
                f"interp {tok} {x0}-{x1}")
    v = below[-1] if below else above[0]
    r = pts[v]
    return r["p50_us"], r.get("min_bytes") or 0.0, row_efficiency(r), abs(math.log2(x / v)), f"nearest {tok}={v}"


def lookup_row(rows: list[dict], kernel: str, shape: dict, tp: int,
               a: "Assumptions | None" = None) -> tuple[float | None, float | None, str, str]:
    """The H200 time of ``kernel`` at ``shape`` from benchmark rows: ``(t_us, e, source, match)``.

    Each build's nearest rows (shape distance over the non-token dims, +0.5 for another TP) are
    interpolated linearly in tokens; the build's distance is that shape distance plus the log2 token gap.
    The sm_89 build is used unless the native build is nearer by more than ``a.native_slack`` (one
    token doubling by default): a far sm_89 row (T=1 for a batch-16 op) no longer beats a near
    native row. A row at other dims, or outside the measured token range, is carried by its bytes
    ratio (as the efficiency method did), not below ``a.launch_floor_us``. ``source``: ``measured-sm89`` / ``measured-native``;
    ``(None, None, "estimated", "no row")`` when neither build has a row of the kernel.
    """
    a = a or Assumptions()
    tok = next((k for k in _TOKEN_KEYS if k in shape), None)
    best = {}
    for build in ("sm89", "native"):
        d, near = _near_rows(rows, kernel, build, shape, tp, tok)
        if not near:
            continue
        t_us, b_row, e, gap, how = _at_tokens(near, tok, shape.get(tok) if tok else None)
        best[build] = (d + gap, d, t_us, b_row, e, how)
    if not best:
        return None, None, "estimated", "no row"
    pick = "sm89" if "sm89" in best and ("native" not in best
                                         or best["sm89"][0] <= best["native"][0] + a.native_slack) else "native"
    dist, d, t_us, b_row, e, how = best[pick]
    if d > 0 or how.startswith("nearest"):  # not the target's dims or tokens: carry the time by bytes
        b = kernel_bytes(kernel, shape)
        if b_row:
            t_us = max(a.launch_floor_us, t_us * b / b_row)
        how += (", other TP" if d == 0.5 else ", nearest shape" if d > 0 else "") + " (time x bytes ratio)"
    return t_us, e, f"measured-{pick}", how


def lookup_efficiency(rows: list[dict], kernel: str, shape: dict, tp: int) -> tuple[float | None, str, str]:
    """``(e, source, match)`` of :func:`lookup_row` (the efficiency of the row it picks)."""
    _, e, src, match = lookup_row(rows, kernel, shape, tp)
    return e, src, match


# ---- the decode-step model ------------------------------------------------------------------------

# Ops that no ds4lab kernel implements yet: always estimated, each with its basis.
ESTIMATED_OPS = {
    "rmsnorm": "q_norm, kv_norm per layer (+ the indexer's on C4A); attn_norm/ffn_norm run inside the mHC kernel",
    "rope_qk": "forward RoPE on q and the new k entry, one fused call per layer",
    "compressor": "C4A main + indexer compressor, C128A compressor: wkv/wgate dim -> coff*head_dim GEMVs",
    "router_gate": "router logits x @ W_gate^T [256, 4096], replicated",
    "lm_head": "vocab-parallel LM head [129280/tp, 4096], once per forward pass",
    "all_reduce": "two per layer at TP > 1 (after wo_b and after the MoE), T x 4096 bf16, ring over PCIe",
    "sampler": "argmax / sampling over the gathered logits, once per forward pass",
}

# geometry op -> how it is implemented (kernels it maps to); every op of op_shapes() is listed.
OP_MAP = {
    "wq_a_wkv": "fp8_gemm_nt", "wq_b": "fp8_gemm_nt", "wo_b": "fp8_gemm_nt", "indexer_wq_b": "fp8_gemm_nt",
    "shared_gate_up": "fp8_gemm_nt", "shared_down": "fp8_gemm_nt",
    "act_quant_hidden": "per_token_group_quant_fp8",
    "o_proj": "inv_rope_fp8_quant + fp8_einsum_bhr_hdr_bhd + per_token_group_quant_fp8 (wo_b is its own op)",
    "mqa_logits": "fp8_paged_mqa_logits", "topk_indices": "topk_indices", "sparse_mla": "sparse_mla_decode",
    "hc_prenorm_gemm": "mhc_fused_post_pre (decode path: post of one sublayer fused with pre of the next)",
    "moe_w13": "fused_moe_w4a16 (w13 + w2 in one call; router sqrtsoftplus_topk)", "moe_w2": "(in moe_w13's call)",
    "kv_cache_insert": "fp8_ds_mla_insert", "indexer_k_insert": "indexer_k_cache_insert",
}


def _expected_experts(cfg: ModelConfig, T: int, a: Assumptions) -> float:
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if not a.uniform_routing:
        return float(min(E, T * k))
    return E * (1.0 - (1.0 - k / E) ** T)


def _kernel_calls(cfg: ModelConfig, tp: int, T: int, B: int, next_n: int, a: Assumptions,
                  mtp_bf16: bool = False) -> list[dict]:
    """Per-layer-kind kernel calls at ``T`` tokens (``B`` requests x ``next_n`` rows).

    Each entry: op, kernel, shape, layers (kinds it runs in), per_layer, and for estimated ops the
    bytes / flops / fixed time that stand in for a row.
    """
    ops = op_shapes(cfg, tp)
    D = cfg.hidden_size
    g = ops["o_proj"].dims["G"]
    inter = cfg.moe_intermediate_size // tp
    L = a.ctx_len
    calls = []

    def add(op, kernel, shape, layers, per_layer=1, **kw):
        calls.append({"op": op, "kernel": kernel, "shape": shape, "layers": tuple(layers),
                      "per_layer": per_layer, **kw})

    for name in ("wq_a_wkv", "wq_b", "wo_b", "indexer_wq_b", "shared_gate_up", "shared_down"):
        o = ops[name]
        add(name, "fp8_gemm_nt", {"op": name, "M": T, "N": o.dims["N"], "K": o.dims["K"]}, o.layers)
    o = ops["act_quant_hidden"]
    add("act_quant_hidden", "per_token_group_quant_fp8", {"M": T, "K": D}, o.layers, o.per_layer)
    # the other FP8 GEMM inputs (q latent, wo_b input, shared-expert down input): not in the op list
    add("act_quant_q", "per_token_group_quant_fp8", {"M": T, "K": cfg.q_lora_rank}, ops["wq_b"].layers)
    add("act_quant_wo_b", "per_token_group_quant_fp8", {"M": T, "K": g * cfg.o_lora_rank}, ops["wo_b"].layers)
    add("act_quant_shared_down", "per_token_group_quant_fp8", {"M": T, "K": inter}, ops["shared_down"].layers)
    o = ops["o_proj"]
    add("o_proj", "inv_rope_fp8_quant", {"T": T, "H": o.dims["H"], "P": 8192}, o.layers)
    add("o_proj", "fp8_einsum_bhr_hdr_bhd", {"T": T, "G": g, "N": cfg.o_lora_rank, "K": o.dims["K"]}, o.layers)
    # lightning indexer over the 4x-compressed context, decode form (paged, next_n rows per request)
    add("mqa_logits", "fp8_paged_mqa_logits", {"B": B, "next_n": next_n, "ctx": max(1, L // 4), "H": 64},
        ops["mqa_logits"].layers)
    add("topk_indices", "topk_indices", {"R": T, "N": max(1, L // 4), "k": cfg.index_topk}, ops["topk_indices"].layers)
    h = ops["sparse_mla"].dims["H"]
    add("sparse_mla", "sparse_mla_decode", {"T": T, "H": h, "W": cfg.sliding_window,
                                            "Kc": min(cfg.index_topk, L // 4), "comp_bs": 64}, (LayerKind.C4A,))
    add("sparse_mla", "sparse_mla_decode", {"T": T, "H": h, "W": cfg.sliding_window,
                                            "Kc": max(1, L // 128), "comp_bs": 2}, (LayerKind.C128A,))
    add("sparse_mla", "sparse_mla_decode", {"T": T, "H": h, "W": cfg.sliding_window, "Kc": 0, "comp_bs": 64},
        (LayerKind.SWA, LayerKind.MTP))
    o = ops["hc_prenorm_gemm"]
    add("hc_prenorm_gemm", "mhc_fused_post_pre", {"T": T, "D": D, "hc": cfg.hc_mult, "N": cfg.hc_mix_dim},
        o.layers, o.per_layer)
    o = ops["moe_w13"]
    add("moe_w13+moe_w2", "fused_moe_w4a16", {"T": T, "E": cfg.n_routed_experts, "D": D, "I": inter,
                                              "topk": cfg.num_experts_per_tok, "tp": tp}, o.layers)
    add("moe_router", "sqrtsoftplus_topk", {"T": T, "E": cfg.n_routed_experts, "topk": cfg.num_experts_per_tok},
        o.layers)
    add("kv_cache_insert", "fp8_ds_mla_insert", {"T": T, "block_size": 64, "num_blocks": 64},
        ops["kv_cache_insert"].layers)
    add("indexer_k_insert", "indexer_k_cache_insert", {"T": T, "num_blocks": 2}, ops["indexer_k_insert"].layers)
    # ---- estimated: no kernel yet ----
    allk = (LayerKind.SWA, LayerKind.C4A, LayerKind.C128A, LayerKind.MTP)
    # q_norm [T, q_lora_rank] and kv_norm [T, head_dim], bf16 in + out (attn_norm / ffn_norm are
    # fused into the mHC pre kernel: counting them again was the double count of issue 19)
    add("rmsnorm", None, {"T": T}, allk, 2, bytes=T * (cfg.q_lora_rank + cfg.head_dim) * 2, flops=0.0)
    add("rmsnorm", None, {"T": T}, (LayerKind.C4A,), 1, bytes=T * 8192 * 4, flops=0.0)
    add("rope_qk", None, {"T": T}, allk, 1, bytes=T * (h + 1) * cfg.qk_rope_head_dim * 2 * 2, flops=0.0)
    cb = a.compressor_weight_bytes
    add("compressor", None, {"T": T, "N": 2 * 2 * cfg.head_dim + 2 * 2 * cfg.index_head_dim}, (LayerKind.C4A,), 1,
        bytes=(2 * 2 * cfg.head_dim + 2 * 2 * cfg.index_head_dim) * D * cb, flops=0.0, weight=True)
    add("compressor", None, {"T": T, "N": 2 * cfg.head_dim}, (LayerKind.C128A,), 1,
        bytes=2 * cfg.head_dim * D * cb, flops=0.0, weight=True)
    add("router_gate", None, {"T": T, "N": cfg.n_routed_experts}, allk, 1,
        bytes=cfg.n_routed_experts * D * a.router_weight_bytes, flops=2.0 * T * cfg.n_routed_experts * D, weight=True)
    if tp > 1:
        add("all_reduce", None, {"T": T, "tp": tp}, allk, 2, allreduce_bytes=T * D * 2)
    for c in calls:
        c["mtp_bf16"] = mtp_bf16
    return calls


def _counts(cfg: ModelConfig, with_main: bool, with_mtp: bool) -> dict[str, int]:
    c = layer_counts(cfg)
    if not with_main:
        c = {k: 0 for k in c}
        c[LayerKind.MTP] = layer_counts(cfg)[LayerKind.MTP]
    elif not with_mtp:
        c[LayerKind.MTP] = 0
    return c


def _term_time(call: dict, rows: list[dict], tp: int, card: Card, a: Assumptions) -> dict:
    """Time of one call on ``card`` (efficiency method and additive bracket) with its source."""
    if call["kernel"] is None:
        if "allreduce_bytes" in call:
            n = call["allreduce_bytes"]
            if card.link_gbs is None or card.allreduce_us is None:
                raise ValueError(f"card {card.name!r}: no link model (link_gbs / allreduce_us not modelled), "
                                 f"so tp={tp} cannot be estimated; use tp=1 or an Ada card")
            t = card.allreduce_us + 2 * (tp - 1) / tp * n / (card.link_gbs * 1e9) * 1e6
            return {"source": "estimated", "match": "link model", "us": t, "us_add": t, "e": None}
        e = a.est_weight_efficiency if call.get("weight") else a.est_efficiency
        t = eff_time(call["bytes"], call["flops"], e, card, a.launch_floor_us)
        return {"source": "estimated", "match": f"roofline at e={e}", "us": t, "us_add": t, "e": e}
    k, s = call["kernel"], call["shape"]
    b, f = kernel_bytes(k, s), kernel_flops(k, s)
    if call.get("mtp_bf16") and k in ("fp8_gemm_nt", "fp8_einsum_bhr_hdr_bhd"):
        b += s.get("N", 0) * s.get("K", 0) * s.get("G", 1) * (a.mtp_weight_bytes - 1)  # bf16 drafter weights
    t_h, e, src, match = lookup_row(rows, k, s, tp, a)
    if t_h is None:
        e, src, match = a.est_efficiency, "estimated", f"no row; roofline at e={a.est_efficiency}"
        t_h = max(a.launch_floor_us, roof_us(b, f, H200) / e)
    t = max(t_h, roof_us(b, f, card))  # the method: H200 sm_89 time, or the card's roofline
    return {"source": src, "match": match, "us": t, "us_add": additive_time(b, f, t_h, card, a), "e": e,
            "bytes": b}


def decode_terms(rows: list[dict], card: Card, tp: int, batch: int, mode: str = "plain",
                 cfg: ModelConfig = DEFAULT_CONFIG, a: Assumptions = Assumptions()) -> list[dict]:
    """Every term of one decode step: op, kernel, pass (target/drafter), calls, us per call, us per
    step, source (measured-sm89 / measured-native / estimated) and how the row was matched.

    ``mode="plain"``: the 43 main layers at T = batch. ``mode="mtp"``: the main layers verify at
    T = batch x (1 + k) (paged indexer with next_n = 1 + k), then the MTP layer drafts at T = batch.
    Per-step terms (hc_head, LM head, sampler) are added once per pass.
    """
    rows = _best_rows(rows, None)
    passes = []
    if mode == "plain":
        passes.append(("target", batch, 1, _counts(cfg, True, a.plain_runs_mtp_layer), False))
    elif mode == "mtp":
        nn = 1 + a.mtp_k
        passes.append(("target", batch * nn, nn, _counts(cfg, True, False), False))
        passes.append(("drafter", batch, 1, _counts(cfg, False, True), True))
    else:
        raise ValueError(f"mode={mode!r}: 'plain' or 'mtp'")
    out = []
    for pname, T, nn, counts, bf16 in passes:
        calls = _kernel_calls(cfg, tp, T, batch, nn, a, mtp_bf16=bf16)
        calls.append({"op": "hc_head", "kernel": "hc_head", "shape": {"T": T, "D": cfg.hidden_size,
                      "hc": cfg.hc_mult, "N": cfg.hc_mix_dim}, "layers": ("step",), "per_layer": 1})
        calls.append({"op": "lm_head", "kernel": None, "shape": {"T": T}, "layers": ("step",), "per_layer": 1,
                      "bytes": cfg.vocab_size // tp * cfg.hidden_size * a.lm_head_bytes,
                      "flops": 2.0 * T * cfg.vocab_size // tp * cfg.hidden_size, "weight": True})
        calls.append({"op": "sampler", "kernel": None, "shape": {"T": T}, "layers": ("step",), "per_layer": 1,
                      "bytes": T * cfg.vocab_size * 4, "flops": 0.0})
        for c in calls:
            n = sum(counts.get(k, 0) for k in c["layers"]) if c["layers"] != ("step",) else 1
            n *= c["per_layer"]
            if n == 0:
                continue
            tt = _term_time(c, rows, tp, card, a)
            out.append({"pass": pname, "op": c["op"], "kernel": c["kernel"] or "(none)", "T": T,
                        "shape": json.dumps(c["shape"]), "calls": n, "us_per_call": tt["us"],
                        "us": tt["us"] * n, "us_additive": tt["us_add"] * n, "e": tt["e"],
                        "source": tt["source"], "match": tt["match"]})
    return out


def weight_bytes_per_rank(cfg: ModelConfig = DEFAULT_CONFIG, tp: int = 1, all_experts: bool = True,
                          a: Assumptions = Assumptions()) -> float:
    """Weight bytes one rank holds (all experts) - the memory-fit check, not the ceiling."""
    ops = op_shapes(cfg, tp)
    counts = layer_counts(cfg)
    main = {k: v for k, v in counts.items() if k != LayerKind.MTP}
    tot = 0.0
    for n, o in ops.items():
        if o.family == "fp8_gemm":
            w = o.dims["N"] * o.dims["K"]
        elif n == "o_proj":
            w = o.dims["G"] * o.dims["R"] * o.dims["K"]
        else:
            continue
        tot += w * sum(main.get(k, 0) for k in o.layers)
        if LayerKind.MTP in o.layers:
            tot += w * a.mtp_weight_bytes * counts[LayerKind.MTP]
    inter = cfg.moe_intermediate_size // tp
    ex = 3 * cfg.hidden_size * inter // 2 + 3 * cfg.hidden_size * inter // 128 * 2
    tot += ex * cfg.n_routed_experts * cfg.num_layers_with_mtp
    tot += (cfg.vocab_size // tp) * cfg.hidden_size * a.lm_head_bytes * 2  # embedding + head
    return tot


def bandwidth_ceiling(card: Card, tp: int, batch: int, mode: str = "plain", cfg: ModelConfig = DEFAULT_CONFIG,
                      a: Assumptions = Assumptions()) -> dict:
    """Bytes one rank must read per decode step, and the tokens/s that bandwidth allows.

    Per rank: dense FP8 weights (wq_a/wkv, wq_b, wo_a, wo_b, indexer wq_b, shared expert; BF16 in the
    MTP layer), compressors and router (estimated dtypes), the routed experts touched at this batch
    (W4A16 INT4 + bf16 group scales; expected distinct experts under uniform routing), the vocab-split
    LM head, and the KV / indexer cache reads at ``ctx_len`` per request: SWA window 128 x 584 B per
    layer, C4A indexer keys ctx/4 x 132 B + top-512 x 584 B, C128A ctx/128 x 584 B (caches are
    replicated: every rank reads them in full). Activations are left out.
    """
    ops = op_shapes(cfg, tp)
    D = cfg.hidden_size
    L = a.ctx_len
    inter = cfg.moe_intermediate_size // tp
    ex = 3 * D * inter // 2 + 3 * D * inter // 128 * 2

    def pass_bytes(T, counts, bf16):
        wb = a.mtp_weight_bytes if bf16 else 1.0
        b = 0.0
        for n, o in ops.items():
            c = sum(counts.get(k, 0) for k in o.layers)
            if not c:
                continue
            if o.family == "fp8_gemm":
                b += c * o.dims["N"] * o.dims["K"] * wb
            elif n == "o_proj":
                b += c * o.dims["G"] * o.dims["R"] * o.dims["K"] * wb
            elif n == "moe_w13":
                b += c * _expected_experts(cfg, T, a) * ex
        b += counts.get(LayerKind.C4A, 0) * (4 * cfg.head_dim + 4 * cfg.index_head_dim) * D * a.compressor_weight_bytes
        b += counts.get(LayerKind.C128A, 0) * 2 * cfg.head_dim * D * a.compressor_weight_bytes
        b += sum(counts.values()) * cfg.n_routed_experts * D * a.router_weight_bytes
        b += cfg.vocab_size // tp * D * a.lm_head_bytes
        kv = sum(counts.values()) * cfg.sliding_window * FP8_DS_MLA_ENTRY_BYTES
        kv += counts.get(LayerKind.C4A, 0) * (L // 4 * 132 + min(cfg.index_topk, L // 4) * FP8_DS_MLA_ENTRY_BYTES)
        kv += counts.get(LayerKind.C128A, 0) * (L // 128) * FP8_DS_MLA_ENTRY_BYTES
        return b + batch * kv

    if mode == "plain":
        byts = pass_bytes(batch, _counts(cfg, True, a.plain_runs_mtp_layer), False)
        tokens = batch
    else:
        byts = pass_bytes(batch * (1 + a.mtp_k), _counts(cfg, True, False), False)
        byts += pass_bytes(batch, _counts(cfg, False, True), True)
        tokens = batch * (1 + a.mtp_acceptance * a.mtp_k)
    t = byts / (card.bw_tbps * 1e12)
    return {"bytes_per_step": byts, "ceiling_step_ms": t * 1e3, "ceiling_tok_s": tokens / t}


def step_bytes(cfg: ModelConfig = DEFAULT_CONFIG, tp: int = 4, batch: int = 1, next_n: int = 1,
               ctx: int = 8192, a: Assumptions = Assumptions()) -> dict[str, float]:
    """Bytes of one decode step per op (``{op: bytes}``; op names of :func:`decode_terms`, e.g.
    ``wq_b``, ``sparse_mla``, ``moe_w13+moe_w2``), the 43 main layers at ``T = batch * next_n``
    tokens against ``ctx`` cached tokens, from :mod:`ds4lab.harness.costs` (kernels) and the
    labelled estimates (ops with no kernel). The floor of :mod:`ds4lab.harness.step`'s op groups."""
    from dataclasses import replace
    a = replace(a, ctx_len=ctx)
    counts = _counts(cfg, True, False)
    out: dict[str, float] = {}
    for c in _kernel_calls(cfg, tp, batch * next_n, batch, next_n, a):
        n = sum(counts.get(k, 0) for k in c["layers"]) * c["per_layer"]
        if not n:
            continue
        b = kernel_bytes(c["kernel"], c["shape"]) if c["kernel"] else c.get("bytes", c.get("allreduce_bytes", 0.0))
        out[c["op"]] = out.get(c["op"], 0.0) + n * b
    return out


def _step_config(step_rows: list[dict], tp: int, batch: int, mode: str, ctx: int) -> list[dict]:
    """The op-group rows of the sm_89-build step measured nearest ``ctx`` at (tp, batch, mode), the
    newest such run, with the defaults (rows of an A/B variant, ``--set`` in their repro, are left out),
    the ``(step)`` row first; [] when there is none."""
    steps = [r for r in step_rows if r.get("group") == "(step)" and r.get("status") == "OK" and r.get("build") == "sm89"
             and r.get("tp") == tp and r.get("batch") == batch and r.get("mode") == mode
             and " --set " not in str(r.get("repro") or "")]
    if not steps:
        return []
    s = max(steps, key=lambda r: (-abs(math.log2(max(r["ctx"], 1) / max(ctx, 1))), str(r.get("timestamp") or "")))
    key = ("timestamp", "build", "tp", "batch", "mode", "ctx", "repro")
    return [s] + [r for r in step_rows if r.get("group") != "(step)" and all(r.get(k) == s.get(k) for k in key)]


def step_terms(step_rows: list[dict], rows: list[dict], card: Card, tp: int, batch: int, mode: str = "plain",
               cfg: ModelConfig = DEFAULT_CONFIG, a: Assumptions = Assumptions()) -> list[dict] | None:
    """:func:`decode_terms` from a measured step (``results/decode_step.csv``, sm_89 build): one term
    per op group, ``max(group time on the H200, group bytes / card bandwidth)``; the device-copy
    stand-in of the all-reduce is replaced by the card's link model (a stated assumption); in MTP
    mode the drafter pass (the MTP layer at T = batch, not part of the verify step) comes from the
    benchmark rows. None when no step was measured at (tp, batch, mode)."""
    sel = _step_config(step_rows, tp, batch, mode, a.ctx_len)
    if not sel:
        return None
    step, groups = sel[0], sel[1:]
    T = batch * (1 + a.mtp_k if mode == "mtp" else 1)
    out = []
    for g in groups:
        name = g["group"]
        if name.startswith("comm.all_reduce"):
            if tp > 1:
                out += [x for x in decode_terms(rows, card, tp, batch, mode, cfg, a)
                        if x["op"] == "all_reduce" and x["pass"] == "target"]
            continue
        b = g.get("bytes") or 0.0
        t = max(g.get("us") or 0.0, b / (card.bw_tbps * 1e12) * 1e6)
        out.append({"pass": "target", "op": name, "kernel": g.get("kind") or "", "T": T,
                    "shape": json.dumps({"ctx": step["ctx"]}), "calls": g.get("launches") or 0,
                    "us_per_call": t / max(1, g.get("launches") or 1), "us": t, "us_additive": t,
                    "e": None, "source": "measured-sm89",
                    "match": f"decode_step.csv {step['timestamp']} ctx={step['ctx']} group"})
    if mode == "mtp":
        out += [x for x in decode_terms(rows, card, tp, batch, mode, cfg, a) if x["pass"] == "drafter"]
    return out


def decode_model(rows: list[dict], cards=None, tps=(1, 2, 4, 8), batches=(1, 4, 16), modes=("plain", "mtp"),
                 cfg: ModelConfig = DEFAULT_CONFIG, a: Assumptions = Assumptions(),
                 step_rows: list[dict] | None = None) -> list[dict]:
    """Predicted decode tokens/s per card, TP, batch and mode, with the bandwidth ceiling and the seeds.

    ``tok_s``: the per-op method (module docstring) over the measured step where ``step_rows``
    (``results/decode_step.csv``) has the sm_89 build at that (tp, batch, mode), else over the
    benchmark ``rows``; ``basis`` says which. ``tok_s_additive``: the additive bracket. ``*_share``:
    the share of the step time on sm_89 / native rows / estimates. ``fits``: all weights of one rank
    within 90% of the card's memory. The all-reduce link is included (a stated assumption); host
    overhead is not (see :func:`community_comparison`).
    """
    cards = list((cards or CARDS).values()) if isinstance(cards or CARDS, dict) else list(cards)
    out = []
    for card in cards:
        for tp in tps:
            fits = weight_bytes_per_rank(cfg, tp, a=a) <= 0.9 * card.mem_gb * 1e9
            for mode in modes:
                for batch in batches:
                    terms = step_terms(step_rows, rows, card, tp, batch, mode, cfg, a) if step_rows else None
                    basis = "decode_step.csv (sm_89 build, measured step)" if terms else \
                        "bench.csv (sum of kernel rows + estimates)"
                    if terms is None:
                        terms = decode_terms(rows, card, tp, batch, mode, cfg, a)
                    us = sum(t["us"] for t in terms)
                    us_add = sum(t["us_additive"] for t in terms)
                    tokens = batch * (1 + a.mtp_acceptance * a.mtp_k) if mode == "mtp" else batch
                    ceil = bandwidth_ceiling(card, tp, batch, mode, cfg, a)
                    share = {s: sum(t["us"] for t in terms if t["source"] == s) / us
                             for s in ("measured-sm89", "measured-native", "estimated")}
                    seed = next((s for s in SEED_FIGURES if s["card"] == card.name and s["tp"] == tp
                                 and s["batch"] == batch and s["mode"] == mode), None)
                    out.append({"card": card.name, "tp": tp, "mode": mode, "batch": batch, "fits": fits,
                                "step_ms": us / 1e3, "tok_s": tokens / (us * 1e-6),
                                "tok_s_additive": tokens / (us_add * 1e-6),
                                "ceiling_tok_s": ceil["ceiling_tok_s"], "gb_per_step": ceil["bytes_per_step"] / 1e9,
                                "sm89_share": share["measured-sm89"], "native_share": share["measured-native"],
                                "estimated_share": share["estimated"], "basis": basis,
                                "seed_tok_s": seed["tok_s"] if seed else None,
                                "seed": seed.get("tok_s_range", "") + (" " if seed and seed.get("tok_s_range") else "")
                                + seed["source"] if seed else ""})
    return out


# What the decode step (and so this model) leaves out of an end-to-end serving figure.
STEP_LEAVES_OUT = (
    "host work per step outside the CUDA graph: vLLM's scheduler, input preparation, sampler, "
    "detokenizer, HTTP streaming (Assumptions.host_us_per_step, a lead, not measured)",
    "the all-reduce itself: one GPU copies on the device; the link cost is the stated PCIe model "
    "(CARDS: GeForce without P2P through host memory, pro cards P2P)",
    "prefill: a served request also prefills its prompt, and chunked prefill shares steps with decode",
    "MTP acceptance: the verify step is measured; tokens per step assume Assumptions.mtp_acceptance",
    "Ada's clocks and SM count for latency-bound ops (the sm_89 build ran on the H200's 132 SMs)",
    "the seeds' prompts and context lengths (unpublished); the model reads Assumptions.ctx_len per request",
)


def community_comparison(model_rows: list[dict], a: Assumptions = Assumptions()) -> list[dict]:
    """The seeds' end-to-end serving figures (:data:`SEED_FIGURES`) beside the model at the same
    card, TP, batch and mode, like for like: the step as measured (with the link assumption), and
    with the host's per-step overhead added (``a.host_us_per_step``); :data:`STEP_LEAVES_OUT` lists
    what else the step does not contain. Rows for seeds the model has no point for are left out."""
    out = []
    for s in SEED_FIGURES:
        r = next((r for r in model_rows if r["card"] == s["card"] and r["tp"] == s["tp"]
                  and r["batch"] == s["batch"] and r["mode"] == s["mode"]), None)
        if r is None:
            continue
        tokens = r["tok_s"] * r["step_ms"] * 1e-3
        served = tokens / ((r["step_ms"] * 1e3 + a.host_us_per_step) * 1e-6)
        out.append({"card": s["card"], "tp": s["tp"], "batch": s["batch"], "mode": s["mode"],
                    "seed tok/s": s["tok_s"], "step tok/s": round(r["tok_s"], 1),
                    f"+ host {a.host_us_per_step:.0f} us tok/s": round(served, 1),
                    "ceiling tok/s": round(r["ceiling_tok_s"], 1), "basis": r.get("basis", ""),
                    "seed source": s["source"]})
    return out


# card name -> the prefix of its headline keys (the tour reads them back into a table)
HEADLINE_KEYS = {"RTX 4090-48G": "4090_48g", "RTX 6000 Ada": "6000ada", "L40S": "l40s"}


def headline_point(model_rows: list[dict], tp: int | None = None, batch: int | None = None
                   ) -> tuple[int, int, str]:
    """The (tp, batch) the headline reports and a note saying why: TP4 batch 1 (the seeds' figures)
    when the model has it, else the largest TP / smallest batch it has, with the note naming the
    substitution. An explicit ``tp`` / ``batch`` the model lacks is a ValueError naming it."""
    if not model_rows:
        raise ValueError("headline: the model has no rows (decode_model over no cards, tps or batches?)")
    tps = sorted({r["tp"] for r in model_rows})
    batches = sorted({r["batch"] for r in model_rows})
    for name, want, have in (("tp", tp, tps), ("batch", batch, batches)):
        if want is not None and want not in have:
            raise ValueError(f"headline: {name}={want} is not in the model (it has {name} {have})")
    note = ""
    if tp is None:
        tp = 4 if 4 in tps else tps[-1]
        if tp != 4:
            note += f"TP4 not in the model's tps {tps}: headline at TP{tp}, where no seed figure exists. "
    if batch is None:
        batch = 1 if 1 in batches else batches[0]
        if batch != 1:
            note += f"batch 1 not in the model's batches {batches}: headline at batch {batch}. "
    return tp, batch, note.strip()


def headline(model_rows: list[dict], tp: int | None = None, batch: int | None = None) -> dict:
    """The numbers the tour summary records: per card in the model and mode, tokens/s (efficiency
    carried and additive), the bandwidth ceiling and the seed's figure, at ``tp`` / ``batch``
    (default TP4 batch 1, the seeds' setting; see :func:`headline_point`). Keys read
    ``<card>_tp<tp>_b<batch>_<mode>_<figure>``; ``headline_note`` says when the point was
    substituted. ValueError for an empty model or a requested tp/batch it lacks."""
    tp, batch, note = headline_point(model_rows, tp, batch)
    out = {"headline_note": note} if note else {}
    for card in dict.fromkeys(r["card"] for r in model_rows):
        key = HEADLINE_KEYS.get(card) or card.lower().replace(" ", "_").replace("-", "_")
        for mode in ("plain", "mtp"):
            r = next((r for r in model_rows if r["card"] == card and r["tp"] == tp and r["batch"] == batch
                      and r["mode"] == mode), None)
            if r is None:
                continue
            p = f"{key}_tp{tp}_b{batch}_{mode}"
            out[f"{p}_tok_s"] = round(r["tok_s"], 1)
            out[f"{p}_tok_s_additive"] = round(r["tok_s_additive"], 1)
            out[f"{p}_ceiling_tok_s"] = round(r["ceiling_tok_s"], 1)
            if r["seed_tok_s"]:
                out[f"{p}_seed_tok_s"] = r["seed_tok_s"]
    return out
