"""Per-rank weight bytes by class for each checkpoint format (SPEC.md §1)."""
from __future__ import annotations

from ds4lab.geometry import DEFAULT_CONFIG, FP8_BLOCK, LayerKind, ModelConfig, check_tp, layer_counts
from ds4lab.planner.terms import BF16, FP32, Term

__all__ = ["FORMATS", "weight_terms"]

# Bytes per parameter (plus scale bytes) per weight class, per checkpoint format (SPEC.md §1).
#   dense: attention / shared-expert linears; experts: routed MoE; mtp: the MTP block's classes.
_FP8 = (1.0, FP32 / (FP8_BLOCK * FP8_BLOCK), "FP8 e4m3, one fp32 scale per 128x128 block")
_MXFP4 = (0.5, 1 / 32, "MXFP4 e2m1, one UE8M0 byte per 32")
_INT4 = (0.5, BF16 / 128, "INT4 W4A16 pack-quantized, one bf16 scale per 128 (group 128)")
_BF16 = (2.0, 0.0, "bf16")
FORMATS: dict[str, dict] = {
    "official": {"desc": "deepseek-ai/DeepSeek-V4-Flash: FP8 128x128 attention + MXFP4 experts, MTP same",
                 "dense": _FP8, "experts": _MXFP4, "mtp_dense": _FP8, "mtp_experts": _MXFP4},
    "community": {"desc": "canada-quant W4A16+FP8: INT4 g128 experts, FP8 attention, BF16 MTP block",
                  "dense": _FP8, "experts": _INT4, "mtp_dense": _BF16, "mtp_experts": _BF16},
    "bf16": {"desc": "everything bf16 (the tiny test checkpoint)",
             "dense": _BF16, "experts": _BF16, "mtp_dense": _BF16, "mtp_experts": _BF16},
}



def _lin(n: int, k: int, fmt: tuple) -> int:
    per, scale, _ = fmt
    return int(n * k * (per + scale))


def weight_terms(cfg: ModelConfig = DEFAULT_CONFIG, fmt: str = "official", tp: int = 1,
                 mtp: bool = True) -> list[Term]:
    """Per-rank weight bytes by class, from the geometry's shapes and the checkpoint format.

    Split by TP (vLLM ``DeepseekV4`` model, geometry docstring): q heads (``wq_b``), ``wo_a`` groups,
    ``wo_b`` input, routed + shared expert intermediate, vocab (``VocabParallelEmbedding`` /
    ``ParallelLMHead``). Replicated: ``wq_a``/``wkv``, compressors, indexer, mHC, norms, router.
    Compressor ``fused_wkv_wgate`` and the indexer ``weights_proj`` are bf16 in every format
    (``DeepseekCompressor(quant_config=None)``). Estimates: scale tensors and small vectors are
    approximated; Marlin repacking keeps 4-bit sizes. Raises ValueError for an unknown ``fmt``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: known checkpoint formats are {sorted(FORMATS)}")
    check_tp(cfg, tp)
    f = FORMATS[fmt]
    D, hd, H, G = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.o_groups
    I, E = cfg.moe_intermediate_size, cfg.n_routed_experts
    counts = layer_counts(cfg)
    n_main = cfg.num_hidden_layers
    src_geo = "geometry.op_shapes + SPEC.md §1 format"

    def attn(dense: tuple) -> tuple[int, int]:
        rep = _lin(cfg.q_lora_rank + hd, D, dense) + (cfg.q_lora_rank + hd) * BF16   # wq_a+wkv, norms
        split = (_lin(H * hd // tp, cfg.q_lora_rank, dense)                          # wq_b
                 + _lin(G // tp * cfg.o_lora_rank, H // G * hd, dense)               # wo_a (bmm)
                 + _lin(D, G * cfg.o_lora_rank // tp, dense)                         # wo_b
                 + H // tp * FP32)                                                   # attn_sink
        return rep, split

    def hc_and_norms() -> int:   # mHC fn/base/scale for two sublayers (fp32) + two RMSNorms
        return 2 * (cfg.hc_mix_dim * cfg.hc_mult * D + cfg.hc_mix_dim + 3) * FP32 + 2 * D * BF16

    def moe(dense: tuple, experts: tuple) -> tuple[int, int]:
        rep = E * D * BF16 + E * FP32                                                # router + bias
        split = (E * (_lin(2 * I // tp, D, experts) + _lin(D, I // tp, experts))
                 + _lin(2 * I * cfg.n_shared_experts // tp, D, dense)
                 + _lin(D, I * cfg.n_shared_experts // tp, dense))
        return rep, split

    def compressor(ratio: int, head_dim: int) -> int:
        coff = 1 + (ratio == 4)
        return 2 * coff * head_dim * D * BF16 + ratio * coff * head_dim * FP32 + head_dim * BF16

    terms: list[Term] = []
    a_rep, a_split = attn(f["dense"])
    m_rep, m_split = moe(f["dense"], f["experts"])
    comp = counts[LayerKind.C4A] * compressor(4, hd) + counts[LayerKind.C128A] * compressor(128, hd)
    idx = counts[LayerKind.C4A] * (_lin(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, f["dense"])
                                   + cfg.index_n_heads * D * BF16 + compressor(4, cfg.index_head_dim))
    terms += [
        Term("attention (split: wq_b, wo_a, wo_b)", n_main * a_split, "weights", f"{src_geo}; {f['dense'][2]}"),
        Term("attention (replicated: wq_a+wkv, norms)", n_main * a_rep, "weights", src_geo, True),
        Term("compressors + indexer (replicated, bf16 wkv_wgate)", comp + idx, "weights",
             "deepseek_v4/compressor.py, attention.py DeepseekV4Indexer", True),
        Term("routed + shared experts (split by TP)", n_main * m_split, "weights",
             f"{src_geo}; experts {f['experts'][2]}"),
        Term("router, mHC, norms (replicated)", n_main * (m_rep + hc_and_norms())
             + cfg.num_hash_layers * cfg.vocab_size * cfg.num_experts_per_tok * 4, "weights",
             "SPEC.md §1 (mHC fp32, hash layers tid2eid int32)", True),
        Term("embedding + lm_head (vocab split)", 2 * cfg.vocab_size // tp * D * BF16
             + cfg.hc_mult * cfg.hc_mult * D * FP32, "weights", "VocabParallelEmbedding / ParallelLMHead"),
    ]
    if mtp and cfg.num_nextn_predict_layers:
        ma_rep, ma_split = attn(f["mtp_dense"])
        mm_rep, mm_split = moe(f["mtp_dense"], f["mtp_experts"])
        proj = 2 * _lin(D, D, f["mtp_dense"]) + 4 * D * BF16
        terms.append(Term(f"MTP layer ({'bf16' if f['mtp_dense'] is _BF16 else fmt})",
                          ma_rep + ma_split + mm_rep + mm_split + proj + hc_and_norms(), "weights",
                          "SPEC.md §1 MTP block (community: BF16); SWA-only layer"))
    return terms

