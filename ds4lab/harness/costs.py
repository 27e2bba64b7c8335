"""The one home of every kernel's cost formulas: useful FLOPs, the fewest bytes a call must move,
and (where it differs from "every input tensor") the bytes one call actually touches.

Pure Python over shape dicts (the registry's shapes, e.g. ``{"M": 1, "N": 4096, "K": 8192}``), no
torch, so the Ada estimate (:mod:`ds4lab.planner.speed`, torch-free) and the registry specs
(:mod:`ds4lab.harness.specs`) read the same functions. Units: FLOPs (multiply-add = 2) and bytes.

- :data:`FLOPS` ``{kernel: shape -> float}``: useful arithmetic (0 for data movement).
- :data:`MIN_BYTES` ``{kernel: shape -> float}``: each operand read once, each output written once
  (the roofline's bytes; the bench's ``min_bytes`` column).
- :data:`TOUCHED_BYTES` ``{kernel: shape -> float}``: the bytes one call brings through L2, for
  kernels whose inputs hold far more than a call reads (the MoE: all 256 experts are inputs, a decode
  call reads the ``min(E, T*topk)`` selected ones). The bench sizes its cold-L2 rotation from it
  (:func:`ds4lab.harness.bench.n_sets`); kernels not listed touch all of their input tensors.

:func:`flops` / :func:`min_bytes` look a kernel up by name (``KeyError`` naming it and the known ones).
"""
from __future__ import annotations

from typing import Callable

from ds4lab.geometry import DEFAULT_CONFIG, FP8_BLOCK
from ds4lab.geometry import FP8_DS_MLA_DATA_BYTES as MLA_DATA
from ds4lab.geometry import FP8_DS_MLA_ENTRY_BYTES as MLA_ENTRY
from ds4lab.geometry import FP8_DS_MLA_SCALE_BYTES as MLA_SCALE

__all__ = ["FLOPS", "MIN_BYTES", "TOUCHED_BYTES", "flops", "min_bytes", "touched_bytes"]

G = FP8_BLOCK                                   # 128: 1x128 activation groups, 128x128 weight blocks
HEAD_DIM = DEFAULT_CONFIG.head_dim              # 512: the MLA latent (448 NoPE e4m3 + 64 bf16 RoPE)
ROPE_DIM = DEFAULT_CONFIG.qk_rope_head_dim      # 64
HPG = DEFAULT_CONFIG.heads_per_o_group          # 8 heads per o-projection group
IDX_D = DEFAULT_CONFIG.index_head_dim           # 128: indexer key / query dim
HC = DEFAULT_CONFIG.hc_mult                     # 4 hyper-connection copies
# fp8_ds_mla cache entry (SPEC.md §3; sizes from ds4lab.geometry): 576 data bytes (448 e4m3 + 64 bf16)
# + 8 scale bytes (7 UE8M0 + pad) = 584


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- fp8_gemm / fp8_quant -------------------------------------------------------------------------

def _scale_bytes(fmt: str | None, rows: int, groups: int, packed_ok: bool = True) -> int:
    """Bytes of a ``rows x groups`` scale tensor in ``fmt`` (fp32/pow2: 4 B; ue8m0: 1 B; ue8m0_packed:
    4 exponents per int32, rows padded to whole words)."""
    if fmt == "ue8m0_packed" and packed_ok:
        return rows * _cdiv(groups, 4) * 4
    return rows * groups * (1 if fmt in ("ue8m0", "ue8m0_packed") else 4)


def gemm_flops(s: dict) -> float:
    return 2.0 * s["M"] * s["N"] * s["K"]


def gemm_min_bytes(s: dict) -> float:
    """A and B fp8 once, their scales once (A 1x128 in ``a_fmt``, B 128x128 in ``b_fmt``; ``N`` is
    ceiling-divided: a last partial block still has a scale), D bf16 once."""
    M, N, K = s["M"], s["N"], s["K"]
    kb, nb = K // G, _cdiv(N, G)
    a_s = _scale_bytes(s.get("a_fmt"), M, kb)
    b_s = nb * kb * (1 if s.get("b_fmt") == "ue8m0" else 4)
    return M * K + N * K + a_s + b_s + 2 * M * N


def linear_min_bytes(s: dict) -> float:
    """``w8a8_block_fp8_linear``: bf16 A in (quantized on chip, no fp8 A or A scales in memory), B fp8
    and its 128x128 scales once, D bf16 once."""
    M, N, K = s["M"], s["N"], s["K"]
    b_s = _cdiv(N, G) * (K // G) * (1 if s.get("b_fmt", "ue8m0") == "ue8m0" else 4)
    return 2 * M * K + N * K + b_s + 2 * M * N


def quant_min_bytes(s: dict) -> float:
    """bf16 in, e4m3 out, one scale per 1x128 group (4 B fp32/pow2, 1 B ue8m0 / packed ue8m0)."""
    M, K = s["M"], s["K"]
    return M * K * (2 + 1) + M * (K // G) * (4 if s.get("scale_fmt", "fp32") in ("fp32", "pow2") else 1)


# ---- indexer ---------------------------------------------------------------------------------------

def k_insert_min_bytes(s: dict) -> float:
    """bf16 key in, 128 e4m3 + fp32 scale out, slot id in (int64)."""
    return s["T"] * (IDX_D * 2 + IDX_D + 4 + 8)


def mqa_flops(s: dict) -> float:
    """In-range entries of the causal shape (query t sees ``N - (M-1-t)//4`` compressed keys)."""
    M, N, H = s["M"], s["N"], s.get("H", 64)
    valid = sum(max(0, N - (M - 1 - t) // 4) for t in range(M))
    return 2.0 * H * IDX_D * valid


def mqa_min_bytes(s: dict) -> float:
    return s["M"] * s.get("H", 64) * (IDX_D + 4) + s["N"] * (IDX_D + 4) + s["M"] * s["N"] * 4


def _paged_valid(s: dict) -> int:
    return s["B"] * sum(s["ctx"] - s["next_n"] + 1 + i for i in range(s["next_n"]))


def paged_mqa_flops(s: dict) -> float:
    return 2.0 * s.get("H", 64) * IDX_D * _paged_valid(s)


def paged_mqa_min_bytes(s: dict) -> float:
    """The cache bytes read (values + scales) plus the logits written; q/weights are negligible."""
    return s["B"] * s["ctx"] * (IDX_D + 4) + s["B"] * s["next_n"] * s["ctx"] * 4


def paged_topk_min_bytes(s: dict) -> float:
    """Paged logits + top-k in one launch: the cache bytes read plus the int32 indices written (the
    logits stay in an L2-resident workspace)."""
    return s["B"] * s["ctx"] * (IDX_D + 4) + s["B"] * s["next_n"] * s.get("k", 512) * 4


# ---- mHC -------------------------------------------------------------------------------------------

def _mhc_dims(s: dict) -> tuple[int, int, int, int]:
    hc = s.get("hc", HC)
    return s["T"], s["D"], hc, s.get("N", (2 + hc) * hc)


def _coef_bytes(T: int, hc: int) -> int:
    return T * (hc + hc * hc) * 4


def mhc_min_bytes(kind: str) -> Callable[[dict], float]:
    """``kind``: gemm (hc_prenorm_gemm), pre, broadcast, post, fused (post of one sublayer + pre of
    the next), head (hc_head). Residual ``[T, hc, D]`` bf16, ``fn [N, hc*D]`` fp32, norm weight bf16."""
    def f(s: dict) -> float:
        T, D, hc, N = _mhc_dims(s)
        K = hc * D
        if kind == "gemm":
            return T * K * 2 + N * K * 4 + T * (N + 1) * 4
        if kind == "pre":
            return T * K * 2 + N * K * 4 + D * 2 + T * D * 2 + _coef_bytes(T, hc)
        if kind == "broadcast":
            return T * D * 2 + N * K * 4 + D * 2 + T * K * 2 + T * D * 2 + _coef_bytes(T, hc)
        if kind == "post":
            return T * K * 2 + T * D * 2 + _coef_bytes(T, hc) + T * K * 2
        if kind == "fused":
            return T * K * 2 + T * D * 2 + 2 * _coef_bytes(T, hc) + N * K * 4 + D * 2 + T * K * 2 + T * D * 2
        if kind == "head":
            return T * K * 2 + hc * K * 4 + T * D * 2
        raise ValueError(f"kind={kind!r}")
    return f


def mhc_flops(kind: str) -> Callable[[dict], float]:
    def f(s: dict) -> float:
        T, D, hc, N = _mhc_dims(s)
        K = hc * D
        if kind == "post":
            return 2.0 * T * K * (hc + 1)
        if kind == "head":
            return 2.0 * T * K * hc + 2.0 * T * K
        gemm = 2.0 * T * (D if kind == "broadcast" else K) * N
        return gemm + (2.0 * T * K * (hc + 1) if kind == "fused" else 0.0)
    return f


# ---- caches, routing, MoE, top-k -------------------------------------------------------------------

def mla_insert_min_bytes(s: dict) -> float:
    """bf16 latent in, one fp8_ds_mla entry out (576 data + 8 scale bytes), int32 slot in."""
    return s["T"] * (HEAD_DIM * 2 + MLA_DATA + MLA_SCALE + 4)


def step_maps_min_bytes(s: dict) -> float:
    """The step's index maps (``step_index_maps``): int64 positions + requests in; per token the SWA
    slot (8 B), window (4 B x W) and length (4), per ratio-4 state ring (1, or 2 when the indexer's ring
    differs) 8 int64 rows + 8 bool + its own row, the C4 counts (8 + 4 + 4); at ratio 128 the ring's
    128 rows + 128 bool + 8, the counts, the slot list (4 B x n_comp128) and its length."""
    per = 16 + 8 + 4 * s["window"] + 4
    if s["n_comp4"]:
        per += (1 if s["idx_ring4"] == s["ring4"] else 2) * (8 * 9 + 8) + 16
    if s["n_comp128"]:
        per += 128 * 9 + 8 + 16 + 4 * s["n_comp128"] + 4
    return s["T"] * per


def route_min_bytes(s: dict) -> float:
    return s["T"] * s["E"] * 4 + s["E"] * 4 + s["T"] * s["topk"] * 8


def gate_route_min_bytes(s: dict) -> float:
    """The bf16 gate weight ``E x D`` and hidden states in, fp32 logits + bias, the routing out."""
    T, E, D = s["T"], s["E"], s["D"]
    return E * D * 2 + T * D * 2 + T * E * 4 + E * 4 + T * s["topk"] * 8


def gate_route_flops(s: dict) -> float:
    return 2.0 * s["T"] * s["E"] * s["D"]


def indexer_q_min_bytes(s: dict) -> float:
    """bf16 q ``(T, H, D)`` and weights ``(T, H)`` in; e4m3 q and fp32 weights out; per token a
    position and one cos/sin row (``R`` fp32)."""
    T, H, D, R = s["T"], s["H"], s["D"], s.get("R", ROPE_DIM)
    return T * H * D * 3 + T * H * (2 + 4) + T * (8 + R * 4)


def moe_experts_touched(s: dict) -> int:
    """Distinct experts a call reads: the bench draws ids distinct per token and across tokens while
    ``T*topk <= E`` (``specs/moe._distinct_ids``), so ``min(E, T*topk)``."""
    return min(s["E"], s["T"] * s["topk"])


def moe_expert_bytes(s: dict) -> int:
    """One expert's INT4 nibbles + bf16 group-128 scales (gate, up: ``I x D``; down: ``D x I``)."""
    D, I = s["D"], s["I"]
    return 3 * D * I // 2 + 3 * D * I // G * 2


def moe_min_bytes(s: dict) -> float:
    """Touched experts' weights, x bf16 in + out bf16, routing weights/ids (fp32 + int32)."""
    return moe_experts_touched(s) * moe_expert_bytes(s) + s["T"] * s["D"] * 2 * 2 + s["T"] * s["topk"] * 8


def moe_flops(s: dict) -> float:
    return 2.0 * s["T"] * s["topk"] * 3 * s["D"] * s["I"]


def topk_min_bytes(s: dict) -> float:
    return s["R"] * s["N"] * 4 + s["R"] * s["k"] * 4


# ---- o-projection ----------------------------------------------------------------------------------

def rope_min_bytes(s: dict) -> float:
    """bf16 attention output in; e4m3 + 1x128 scales out (bf16 out when ``quantize`` is False);
    per token a position and one cos/sin row."""
    T, H = s["T"], s["H"]
    n = T * H * HEAD_DIM
    if not s.get("quantize", True):
        return n * 2 + n * 2 + T * (8 + ROPE_DIM * 4)
    sb = 1 if s.get("scale_fmt", "ue8m0") == "ue8m0" else 4
    return n * 2 + n + (n // G) * sb + T * (8 + ROPE_DIM * 4)


def einsum_flops(s: dict) -> float:
    return 2.0 * s["T"] * s["G"] * s["N"] * s["K"]


def einsum_min_bytes(s: dict, fp8: bool = True) -> float:
    T, Gr, N, K = s["T"], s["G"], s["N"], s["K"]
    if not fp8:
        return 2 * (Gr * N * K + T * Gr * K + T * Gr * N)
    xsb = 1 if s.get("x_fmt", "ue8m0") == "ue8m0" else 4
    wsb = 1 if s.get("w_fmt", "fp32") == "ue8m0" else 4
    return Gr * N * K + Gr * (N // G) * (K // G) * wsb + T * Gr * K + T * Gr * (K // G) * xsb + 2 * T * Gr * N


def o_proj_flops(s: dict) -> float:
    Gr, K = s["H"] // HPG, HPG * HEAD_DIM
    return 2.0 * s["T"] * (Gr * s["R"] * K + s["N"] * Gr * s["R"])


def o_proj_min_bytes(s: dict) -> float:
    T, H, R, N = s["T"], s["H"], s["R"], s["N"]
    Gr, K = H // HPG, HPG * HEAD_DIM
    wb = 1 if s.get("path", "fp8") == "fp8" else 2
    return wb * (Gr * R * K + N * Gr * R) + T * H * HEAD_DIM * 2 + T * (8 + ROPE_DIM * 4) + 2 * T * N


# ---- sparse MLA ------------------------------------------------------------------------------------

def _mla_candidates(s: dict) -> int:
    return s.get("W", 0) + s["Kc"]


def sparse_decode_flops(s: dict) -> float:
    """QK^T and PV over the 512-d latent, per candidate (SWA window + compressed)."""
    return 4.0 * s["T"] * s["H"] * _mla_candidates(s) * HEAD_DIM


def sparse_decode_min_bytes(s: dict) -> float:
    """Every candidate's fp8_ds_mla entry + its int32 index; q in, out (bf16)."""
    return s["T"] * (_mla_candidates(s) * (MLA_ENTRY + 4) + 2 * s["H"] * HEAD_DIM * 2)


def sparse_prefill_flops(s: dict) -> float:
    return 4.0 * s["Tq"] * s["H"] * s["Kc"] * HEAD_DIM


def sparse_prefill_min_bytes(s: dict) -> float:
    return min(s["N"], s["Tq"] * s["Kc"]) * HEAD_DIM * 2 + s["Tq"] * (s["Kc"] * 4 + 2 * s["H"] * HEAD_DIM * 2)


# ---- norm / rope / swiglu glue ---------------------------------------------------------------------

def rmsnorm_rope_min_bytes(s: dict) -> float:
    """bf16 rows in and out, the gain once, per token a position and one cos/sin row."""
    n = s["T"] * max(1, s.get("H", 0)) * s["D"]
    w = s["D"] * 2 if s.get("mode") in ("rmsnorm", "rmsnorm_rope") else 0
    rope = s.get("mode") != "rmsnorm"
    return 4 * n + w + (s["T"] * (4 + s.get("R", ROPE_DIM) * 4) if rope else 0)


def q_norm_rope_indexer_q_min_bytes(s: dict) -> float:
    """``q_norm_rope_indexer_q``: the floors of its two launches (the q heads' ``rmsnorm_rope`` and
    ``indexer_q_rope_quant``), the shared per-token position and cos/sin row counted once."""
    R = s.get("R", 64)
    return (rmsnorm_rope_min_bytes({"T": s["T"], "H": s["H"], "D": s["D"], "R": R, "mode": "q_norm_rope"})
            + indexer_q_min_bytes({"T": s["T"], "H": s["IH"], "D": s["ID"], "R": R}) - s["T"] * (4 + R * 4))


def q_kv_rmsnorm_rope_min_bytes(s: dict) -> float:
    """The bf16 ``(T, Dq + Dkv)`` row in, both bf16 segments out, both gains once, per token a
    position and one cos/sin row."""
    d = s["Dq"] + s["Dkv"]
    return s["T"] * (4 * d + 4 + s.get("R", ROPE_DIM) * 4) + 2 * d


def swiglu_min_bytes(s: dict) -> float:
    return s["T"] * s["I"] * (4 + 2)


def _zero(s: dict) -> float:
    return 0.0


def _compress_dims(s: dict) -> tuple[int, int, int]:
    coff = 2 if s["ratio"] == 4 else 1
    return coff, s["hd"], coff * s["ratio"]


def compress_decode_min_bytes(s: dict) -> float:
    """Decode compressor, every token on a boundary: its fp32 ``kv || score`` row in, its state row
    out, the window's ``coff*ratio`` fp32 half-rows (kv + score, ``hd`` each) in, the bf16 entry out."""
    coff, hd, W = _compress_dims(s)
    return s["T"] * (2 * coff * hd * 4 * 2 + W * 2 * hd * 4 + hd * 2)


def compress_decode_flops(s: dict) -> float:
    """Softmax-weighted sum over the window (exp, add, mul, add per element) + norm + rope."""
    coff, hd, W = _compress_dims(s)
    return s["T"] * (4.0 * W * hd + 4.0 * hd)


def q_kv_rmsnorm_rope_insert_min_bytes(s: dict) -> float:
    """:func:`q_kv_rmsnorm_rope_min_bytes` with the kv written as its fp8_ds_mla entry (576 data + 8 scale
    bytes, an int32 slot in) instead of a bf16 row."""
    return q_kv_rmsnorm_rope_min_bytes(s) - s["T"] * (s["Dkv"] * 2 - MLA_DATA - MLA_SCALE - 4)


def compress_decode_insert_min_bytes(s: dict) -> float:
    """:func:`compress_decode_min_bytes` with each entry written to its cache (hd 512: a 584-byte
    fp8_ds_mla entry; hd 128: 128 e4m3 bytes + an fp32 scale; an int64 slot in) instead of a bf16 row."""
    ent = MLA_DATA + MLA_SCALE if s["hd"] == HEAD_DIM else s["hd"] + 4
    return compress_decode_min_bytes(s) - s["T"] * (s["hd"] * 2 - ent - 8)


FLOPS: dict[str, Callable[[dict], float]] = {
    "fp8_gemm_nt": gemm_flops,
    "w8a8_block_fp8_linear": gemm_flops,
    "per_token_group_quant_fp8": _zero,
    "indexer_k_cache_insert": _zero,
    "fp8_mqa_logits": mqa_flops,
    "fp8_paged_mqa_logits": paged_mqa_flops,
    "fp8_paged_mqa_topk": paged_mqa_flops,
    "hc_prenorm_gemm": mhc_flops("gemm"),
    "mhc_pre": mhc_flops("pre"),
    "mhc_pre_broadcast": mhc_flops("broadcast"),
    "mhc_post": mhc_flops("post"),
    "mhc_fused_post_pre": mhc_flops("fused"),
    "hc_head": mhc_flops("head"),
    "fp8_ds_mla_insert": _zero,
    "sqrtsoftplus_topk": _zero,
    "gate_sqrtsoftplus_topk": gate_route_flops,
    "indexer_q_rope_quant": _zero,
    "fused_moe_w4a16": moe_flops,
    "inv_rope_fp8_quant": _zero,
    "fp8_einsum_bhr_hdr_bhd": einsum_flops,
    "bf16_einsum_bhr_hdr_bhd": einsum_flops,
    "o_proj": o_proj_flops,
    "sparse_mla_decode": sparse_decode_flops,
    "sparse_mla_prefill": sparse_prefill_flops,
    "topk_indices": _zero,
    "rmsnorm_rope": _zero,
    "q_norm_rope_indexer_q": _zero,
    "q_kv_rmsnorm_rope": _zero,
    "swiglu_clamp": _zero,
    "compress_decode": compress_decode_flops,
    "step_index_maps": _zero,
    "q_kv_rmsnorm_rope_insert": _zero,
    "compress_decode_insert": compress_decode_flops,
}

MIN_BYTES: dict[str, Callable[[dict], float]] = {
    "fp8_gemm_nt": gemm_min_bytes,
    "w8a8_block_fp8_linear": linear_min_bytes,
    "per_token_group_quant_fp8": quant_min_bytes,
    "indexer_k_cache_insert": k_insert_min_bytes,
    "fp8_mqa_logits": mqa_min_bytes,
    "fp8_paged_mqa_logits": paged_mqa_min_bytes,
    "fp8_paged_mqa_topk": paged_topk_min_bytes,
    "hc_prenorm_gemm": mhc_min_bytes("gemm"),
    "mhc_pre": mhc_min_bytes("pre"),
    "mhc_pre_broadcast": mhc_min_bytes("broadcast"),
    "mhc_post": mhc_min_bytes("post"),
    "mhc_fused_post_pre": mhc_min_bytes("fused"),
    "hc_head": mhc_min_bytes("head"),
    "fp8_ds_mla_insert": mla_insert_min_bytes,
    "sqrtsoftplus_topk": route_min_bytes,
    "gate_sqrtsoftplus_topk": gate_route_min_bytes,
    "indexer_q_rope_quant": indexer_q_min_bytes,
    "fused_moe_w4a16": moe_min_bytes,
    "inv_rope_fp8_quant": rope_min_bytes,
    "fp8_einsum_bhr_hdr_bhd": einsum_min_bytes,
    "bf16_einsum_bhr_hdr_bhd": lambda s: einsum_min_bytes(s, fp8=False),
    "o_proj": o_proj_min_bytes,
    "sparse_mla_decode": sparse_decode_min_bytes,
    "sparse_mla_prefill": sparse_prefill_min_bytes,
    "topk_indices": topk_min_bytes,
    "rmsnorm_rope": rmsnorm_rope_min_bytes,
    "q_norm_rope_indexer_q": q_norm_rope_indexer_q_min_bytes,
    "q_kv_rmsnorm_rope": q_kv_rmsnorm_rope_min_bytes,
    "swiglu_clamp": swiglu_min_bytes,
    "compress_decode": compress_decode_min_bytes,
    "step_index_maps": step_maps_min_bytes,
    "q_kv_rmsnorm_rope_insert": q_kv_rmsnorm_rope_insert_min_bytes,
    "compress_decode_insert": compress_decode_insert_min_bytes,
}

# the selected experts' weights + the activations: what a MoE call brings through L2
TOUCHED_BYTES: dict[str, Callable[[dict], float]] = {"fused_moe_w4a16": moe_min_bytes}


def _get(table: dict, what: str, kernel: str) -> Callable[[dict], float]:
    if kernel not in table:
        raise KeyError(f"kernel {kernel!r}: no {what} formula; known: {sorted(table)}")
    return table[kernel]


def flops(kernel: str, shape: dict) -> float:
    """Useful FLOPs of one call of ``kernel`` at ``shape``."""
    return _get(FLOPS, "FLOPs", kernel)(shape)


def min_bytes(kernel: str, shape: dict) -> float:
    """The fewest bytes one call of ``kernel`` at ``shape`` must move."""
    return _get(MIN_BYTES, "min-bytes", kernel)(shape)


def touched_bytes(kernel: str, shape: dict) -> float | None:
    """Bytes one call touches where that is less than its inputs (:data:`TOUCHED_BYTES`), else None."""
    f = TOUCHED_BYTES.get(kernel)
    return None if f is None else f(shape)
