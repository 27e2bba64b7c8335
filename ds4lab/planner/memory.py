"""Per-GPU memory planner: ``--gpu-memory-utilization`` against KV headroom (``ds4lab plan``).

Pure Python over :mod:`ds4lab.geometry` (no torch, no vLLM import): fast enough for a slider.
Views (plotly figures, ipywidgets) live in :mod:`ds4lab.views.memory`; this module never imports them.

Three layers, each term naming its source:

1. **KV accounting** (exact): a mirror of vLLM 0.32's DeepSeek-V4 KV-cache specs and its packed
   block-outermost grouping. Page sizes come from the geometry and the layer classes'
   ``get_kv_cache_spec`` (``vllm/models/deepseek_v4/attention.py``, ``compressor.py``,
   ``vllm/v1/attention/backends/mla/sparse_swa.py``); groups, bytes per block, per-request blocks,
   capacity and the max-seq-len refusal come from ``vllm/v1/core/kv_cache_utils.py``
   (``_get_packed_kv_cache_groups``, ``_get_kv_cache_bytes_per_block``,
   ``get_max_concurrency_for_kv_cache_config``, ``_check_enough_kv_cache_memory``) and
   ``vllm/v1/kv_cache_interface.py`` (``SlidingWindowSpec.max_admission_blocks_per_request``,
   ``FullAttentionSpec.max_memory_usage_bytes``). ``tests/test_memory_vllm.py`` checks it against
   the real functions on the tiny checkpoint.
2. **Per-rank memory model** (estimates): weights per checkpoint format, activation peak,
   workspaces that grow with the settings (SPEC.md §3), CUDA-graph pool, non-torch memory; KV pool
   is what ``gpu_memory_utilization * total`` leaves (``vllm/v1/worker/gpu_worker.py``
   ``determine_available_memory``); JIT headroom is what lies outside that budget.
3. :func:`recommend`: the feasible utilization window and the setting for watched / unattended
   operation, each bound with its reason.

All sizes are bytes unless a name says ``_gib``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from ds4lab.geometry import (
    DEFAULT_CONFIG, FP8_BLOCK, SUPPORTED_TP, LayerKind, ModelConfig, check_tp, layer_counts, layer_kinds,
    load_config,
)

__all__ = [
    "GiB", "MiB", "GPU", "GPUS", "FORMATS", "CacheSpec", "KVGroup", "KVLayout", "KVCapacity",
    "Term", "Plan", "Recommendation", "Remedy", "JIT_HEADROOM",
    "kv_cache_specs", "kv_layout", "kv_capacity", "weight_terms", "plan", "sweep", "recommend", "find_remedy",
    "plan_for_profile", "default_max_num_batched_tokens", "resolve_gpu", "format_gib", "format_table",
    "add_arguments", "main",
]

GiB = 1 << 30
MiB = 1 << 20

# vLLM 0.32 defaults for DeepSeek-V4 (SPEC.md §3, §6)
BLOCK_SIZE = 256            # --block-size 256 (the sparse MLA / indexer backends' only kernel block size)
SWA_BLOCK_SIZE = 64         # DeepseekV4SWACache(block_size=64) default (v1/attention/backends/mla/sparse_swa.py)
FP8_DS_MLA_ENTRY = 584      # 448 e4m3 + 64 bf16 + 8 scale bytes (attention.py state_content_bytes=584)
FP8_DS_MLA_ALIGN = 576      # page alignment for fp8_ds_mla (FlashMLA packing stride)
PLAIN_ALIGN = 512           # page alignment for plain bf16/fp8 rows (FlashInfer sparse, vLLM #44577)
FP32 = 4
BF16 = 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(x: int, a: int) -> int:
    return cdiv(x, a) * a


def format_gib(b: int | float) -> str:
    """vLLM's ``vllm.utils.mem_utils.format_gib``: ``round(b / GiB, 2)`` as text."""
    return f"{round(b / GiB, 2)}"


# ---------------------------------------------------------------------------------------------
# Hardware table (SPEC.md §4). Totals are what the driver reports (nvidia-smi "Total", MiB), the
# number vLLM multiplies by gpu_memory_utilization; pass gpu_bytes to override.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    """One card: ``total_bytes`` is the driver-reported total (what vLLM's util multiplies)."""
    key: str
    name: str
    total_bytes: int
    sm: str
    source: str


GPUS: dict[str, GPU] = {g.key: g for g in (
    GPU("rtx4090", "RTX 4090 24 GB", 24564 * MiB, "sm_89", "SPEC.md §4; nvidia-smi total 24564 MiB"),
    GPU("rtx4090-48g", "RTX 4090D 48 GB (modded)", 49140 * MiB, "sm_89",
        "SPEC.md §4 ('4090D 48G' mods); assumed same total as RTX 6000 Ada"),
    GPU("rtx6000ada", "RTX 6000 Ada 48 GB", 49140 * MiB, "sm_89", "SPEC.md §4; nvidia-smi total 49140 MiB"),
    GPU("l40s", "L40S 48 GB", 46068 * MiB, "sm_89", "SPEC.md §4; nvidia-smi total 46068 MiB"),
    GPU("h200", "H200 141 GB", 143771 * MiB, "sm_90", "SPEC.md §4 (measured card); nvidia-smi total 143771 MiB"),
)}


#: other spellings of the keys (notebook 09 / SPEC.md names, spaces and case are ignored)
_GPU_ALIASES = {"rtx4090-24g": "rtx4090", "4090": "rtx4090", "rtx4090d-48g": "rtx4090-48g",
                "4090d-48g": "rtx4090-48g", "4090-48g": "rtx4090-48g", "rtx6000-ada": "rtx6000ada",
                "6000ada": "rtx6000ada", "h200-141g": "h200"}


def resolve_gpu(gpu: str | GPU | int) -> GPU:
    """A :class:`GPU` from a table key, a GPU, or a total in bytes. Raises ValueError naming the key.

    Keys ignore case, spaces and underscores, and accept the names notebook 09 uses
    (``"RTX 4090-48G"`` is ``rtx4090-48g``)."""
    if isinstance(gpu, GPU):
        return gpu
    if isinstance(gpu, int) and not isinstance(gpu, bool):
        if gpu <= 0:
            raise ValueError(f"gpu={gpu!r}: a total in bytes must be positive")
        return GPU("custom", f"custom {gpu / GiB:.2f} GiB", gpu, "?", "given bytes")
    key = str(gpu).lower().replace(" ", "").replace("_", "-")
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise ValueError(f"gpu={gpu!r}: unknown card; known: {sorted(GPUS)} (or give a total in bytes)")
    return GPUS[key]


# ---------------------------------------------------------------------------------------------
# 1. KV cache specs and vLLM's grouping (exact mirror)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheSpec:
    """One KV-cache layer as vLLM 0.32 sees it after ``get_kv_cache_spec``.

    ``block_size`` tokens per block, ``page_bytes`` bytes per block (padded to the alignment),
    ``window`` the sliding window for recycling specs (None: full attention, grows with context),
    ``kind`` the spec class family: ``"full"`` (MLAAttentionSpec) or ``"swa"`` (SlidingWindowMLASpec).
    """
    name: str
    role: str
    kind: str
    block_size: int
    page_bytes: int
    window: int | None
    source: str
    extra_retained_tokens: int = 0

    def blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """Blocks one request at ``max_model_len`` holds (vLLM's admission cap).

        full: ``FullAttentionSpec.max_memory_usage_bytes`` -> ``cdiv(L, block_size)``;
        swa: ``SlidingWindowSpec.max_admission_blocks_per_request`` ->
        ``cdiv(min(window - 1 + extra_retained + in_flight, L), block_size) + 1``.
        """
        if self.window is None:
            return cdiv(max_model_len, self.block_size)
        n = min(self.window - 1 + self.extra_retained_tokens + max_in_flight_tokens, max_model_len)
        return cdiv(n, self.block_size) + 1


def _mla_page(states: int, state_bytes: int, align: int) -> int:
    """``AttentionSpec.page_size_bytes`` with ``_apply_alignment_padding`` (kv_cache_interface.py)."""
    return round_up(states * state_bytes, align)


def kv_cache_specs(cfg: ModelConfig = DEFAULT_CONFIG, kv_cache_dtype: str = "fp8_ds_mla",
                   block_size: int = BLOCK_SIZE, mtp: bool = False,
                   extra_retained_tokens: int = 0) -> list[CacheSpec]:
    """The KV-cache layers vLLM 0.32 registers for DeepSeek-V4, in registration order.

    Parameters
    ----------
    kv_cache_dtype : ``"fp8_ds_mla"`` (FlashMLA / CPU backends; ``auto`` resolves to it there) or
        ``"bf16"`` (plain-row FlashInfer backends).
    mtp : add the MTP layer's SWA cache (speculative ``method="mtp"``; the MTP layer is SWA-only).
    extra_retained_tokens : ``max(0, num_prefill_lookahead_tokens - 1)`` applied by
        ``get_kv_cache_configs`` to every sliding-window spec.

    Sources per role (page bytes at the defaults):
    ``swa`` 64 tokens x 584 B -> 37,440 (``DeepseekV4SWACache.get_kv_cache_spec``);
    ``c4_kv`` / ``c128_kv`` ``block_size/ratio`` entries x 584 B -> 37,440 / 1,728
    (``DeepseekV4Attention.get_kv_cache_spec``); ``indexer_k`` 64 x (128 + 4) B -> 8,640
    (``DeepseekV4IndexerCache``); compressor states ``block x 2*coff*head_dim x fp32`` -> 32,832
    (C4, 4 tokens), 32,832 (C128, 8 tokens), 8,640 (indexer, 4 tokens) (``CompressorStateCache``).
    Raises ValueError for an unknown ``kv_cache_dtype``.
    """
    if kv_cache_dtype in ("fp8_ds_mla", "fp8", "auto"):
        ds = True
    elif kv_cache_dtype in ("bf16", "bfloat16"):
        ds = False
    else:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: use 'fp8_ds_mla' or 'bf16'")
    align = FP8_DS_MLA_ALIGN if ds else PLAIN_ALIGN
    hd = cfg.head_dim
    kv_state = FP8_DS_MLA_ENTRY if ds else hd * BF16   # MLA: head_size_v = 0
    idx_state = cfg.index_head_dim + cfg.index_head_dim // FP8_BLOCK * FP32   # 128 e4m3 + fp32 scale
    kinds = layer_kinds(cfg)
    specs: list[CacheSpec] = []
    src_swa = "sparse_swa.py DeepseekV4SWACache.get_kv_cache_spec"
    src_kv = "deepseek_v4/attention.py DeepseekV4Attention.get_kv_cache_spec"
    src_idx = "deepseek_v4/attention.py DeepseekV4IndexerCache.get_kv_cache_spec"
    src_st = "deepseek_v4/compressor.py CompressorStateCache.get_kv_cache_spec"

    def state(name: str, role: str, ratio: int, head_dim: int) -> CacheSpec:
        coff = 1 + (ratio == 4)
        bs = 4 if ratio == 4 else 8
        page = _mla_page(bs, 2 * coff * head_dim * FP32, align)
        return CacheSpec(name, role, "swa", bs, page, coff * ratio, src_st, extra_retained_tokens)

    for i, (kind, ratio) in enumerate(zip(kinds, cfg.compress_ratios)):
        if kind == LayerKind.MTP and not mtp:
            continue
        p = f"layers.{i}.attn"
        if kind == LayerKind.C4A:
            specs.append(CacheSpec(f"{p}.indexer.k_cache", "indexer_k", "full", block_size,
                                   _mla_page(block_size // 4, idx_state, align), None, src_idx))
            specs.append(state(f"{p}.indexer.compressor.state_cache", "indexer_state", 4, cfg.index_head_dim))
        specs.append(CacheSpec(f"{p}.swa_cache", "swa", "swa", SWA_BLOCK_SIZE,
                               _mla_page(SWA_BLOCK_SIZE, kv_state, align), cfg.sliding_window, src_swa,
                               extra_retained_tokens))
        if kind in (LayerKind.C4A, LayerKind.C128A):
            specs.append(CacheSpec(p, "c4_kv" if ratio == 4 else "c128_kv", "full", block_size,
                                   _mla_page(block_size // ratio, kv_state, align), None, src_kv))
            specs.append(state(f"{p}.compressor.state_cache", "c4_state" if ratio == 4 else "c128_state",
                               ratio, hd))
    return specs


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: layers that share a block table. ``page_bytes`` is the sum of its pages."""
    layers: tuple[str, ...]
    roles: tuple[str, ...]
    kind: str
    block_size: int
    window: int | None
    page_bytes: int
    spec: CacheSpec  # representative (the scheduler config keeps the first layer's spec)

    def blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        return self.spec.blocks_per_request(max_model_len, max_in_flight_tokens)


@dataclass(frozen=True)
class KVLayout:
    """vLLM's grouping of the KV-cache layers and the pool's bytes per block.

    ``bytes_per_block``: the largest group's page sum (block-outermost layout; every group draws
    blocks from one shared pool) - ``kv_cache_utils._get_kv_cache_bytes_per_block``.
    """
    specs: tuple[CacheSpec, ...]
    groups: tuple[KVGroup, ...]
    bytes_per_block: int
    repeats_per_group: int | None

    def blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """Sum over groups (``get_max_concurrency_for_kv_cache_config``)."""
        return sum(g.blocks_per_request(max_model_len, max_in_flight_tokens) for g in self.groups)

    def fixed_blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """Blocks of the recycling (sliding-window / compressor-state) groups: not context-bound."""
        return sum(g.blocks_per_request(max_model_len, max_in_flight_tokens)
                   for g in self.groups if g.window is not None)


def _approximate_gcd(values: list[int], lower_bound: int) -> int:
    """``kv_cache_utils._approximate_gcd``: the chunk size d >= lower_bound with least padding."""
    min_d = max(1, lower_bound)
    max_d = max(values)
    if min_d > max_d:
        return min_d
    best_d, best_pad = min_d, None
    for d in range(min_d, max_d + 1):
        pad = sum((d - (x % d)) % d for x in values)
        if best_pad is None or pad < best_pad or (pad == best_pad and d > best_d):
            best_pad, best_d = pad, d
    return best_d


def _bucket_key(s: CacheSpec) -> tuple:
    # UniformTypeKVCacheSpecs.is_uniform_type: one block size; SlidingWindowMLASpec also one window
    # (is_uniform_with_collection); MLAAttentionSpec groups with any full-attention spec.
    return (s.block_size, s.kind, s.window if s.kind == "swa" else None)


def kv_layout(specs: Iterable[CacheSpec]) -> KVLayout:
    """Group the layers as ``kv_cache_utils._get_packed_kv_cache_groups`` does (block-outermost).

    Raises ValueError when every layer has one page size (vLLM then takes a different path that
    DeepSeek-V4 never reaches).
    """
    specs = tuple(specs)
    if len({s.page_bytes for s in specs}) <= 1:
        raise ValueError("specs share one page size: not DeepSeek-V4's packed layout")
    buckets: dict[tuple, list[CacheSpec]] = {}
    for s in specs:
        buckets.setdefault(_bucket_key(s), []).append(s)

    bucketed = []
    for members in buckets.values():
        by_page: dict[int, list[CacheSpec]] = {}
        for s in members:
            by_page.setdefault(s.page_bytes, []).append(s)
        balanced = len({len(v) for v in by_page.values()}) == 1
        max_per_page = Counter(s.page_bytes for s in members).most_common(1)[0][1]
        bucketed.append((members, by_page, balanced, max_per_page))

    min_repeats = max((mp for _, bp, bal, mp in bucketed if bal and len(bp) > 1), default=0)
    repeats = (_approximate_gcd([mp for _, _, bal, mp in bucketed if bal], min_repeats)
               if min_repeats else None)

    def num_groups_for(balanced: bool, max_per_page: int) -> int:
        return cdiv(max_per_page, repeats) if balanced and repeats is not None else 1

    def widest(by_page: dict[int, list[CacheSpec]], n: int) -> int:
        return sum(cdiv(len(v), n) * page for page, v in by_page.items())

    def is_state(members: list[CacheSpec]) -> bool:
        return repeats is None and members[0].kind == "swa"

    anchor = max((widest(bp, len(m) if is_state(m) else num_groups_for(bal, mp))
                  for m, bp, bal, mp in bucketed), default=0)
    groups: list[KVGroup] = []
    for members, by_page, balanced, mp in bucketed:
        n = num_groups_for(balanced, mp)
        if anchor and is_state(members):
            per_block = max(anchor // members[0].page_bytes, 1)
            n = max(n, cdiv(len(members), per_block))
        if n == 1:
            chunks = [members]
        else:
            pattern = list(zip(*by_page.values()))
            chunks = [[s for rep in pattern[i::n] for s in rep] for i in range(n)]
        for c in chunks:
            first = c[0]
            groups.append(KVGroup(tuple(s.name for s in c), tuple(s.role for s in c), first.kind,
                                  first.block_size, first.window, sum(s.page_bytes for s in c), first))
    bytes_per_block = max(g.page_bytes for g in groups)   # block stride alignment is 1 for these specs
    return KVLayout(specs, tuple(groups), bytes_per_block, repeats)


@dataclass(frozen=True)
class KVCapacity:
    """What vLLM 0.32 prints and decides for one KV budget.

    ``num_blocks = kv_bytes // bytes_per_block``; ``max_concurrency = num_blocks / blocks_per_request``;
    ``tokens = int(max_concurrency * max_model_len)`` ("KV cache size: N tokens");
    ``refused`` when one request at ``max_model_len`` does not fit in ``kv_bytes - bytes_per_block``
    (the null block) - ``_check_enough_kv_cache_memory``; ``message`` is the ValueError text.
    """
    kv_bytes: int
    bytes_per_block: int
    num_blocks: int
    blocks_per_request: int
    fixed_blocks_per_request: int
    max_concurrency: float
    tokens: int
    needed_bytes: int
    available_bytes: int
    refused: bool
    estimated_max_model_len: int
    message: str
    context_tokens_per_request: int


def _refusal_message(max_model_len: int, needed: int, available: int, est: int) -> str:
    if available <= 0:
        return ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                "when initializing the engine (this flag also controls CPU memory reservation on the "
                "CPU backend, despite its name). See https://docs.vllm.ai/en/latest/configuration/"
                "conserving_memory/ for more details.")
    est_msg = (f"Based on the available memory, the estimated maximum model length is {est}. "
               if est > 0 else "")
    return (f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({format_gib(available)} GiB). {est_msg}Try increasing `gpu_memory_utilization` "
            f"(which also controls CPU memory on the CPU backend) or decreasing `max_model_len` when "
            f"initializing the engine. See https://docs.vllm.ai/en/latest/configuration/"
            f"conserving_memory/ for more details.")


def kv_capacity(layout: KVLayout, kv_bytes: int, max_model_len: int, max_in_flight_tokens: int) -> KVCapacity:
    """vLLM's KV sizing for one rank (``get_kv_cache_configs`` + ``get_kv_cache_capacity``).

    Parameters
    ----------
    kv_bytes : memory given to the KV cache (``kv_cache_memory_bytes`` or what profiling leaves), bytes.
    max_in_flight_tokens : ``VllmConfig.max_in_flight_tokens`` =
        ``max_concurrent_batches (2 with async scheduling, else 1) * max_num_batched_tokens``.
    """
    if max_model_len <= 0:
        raise ValueError(f"max_model_len={max_model_len!r}: must be positive")
    bpb = layout.bytes_per_block
    per_req = layout.blocks_per_request(max_model_len, max_in_flight_tokens)
    fixed = layout.fixed_blocks_per_request(max_model_len, max_in_flight_tokens)
    available = kv_bytes - bpb   # the null block BlockPool holds back
    needed = bpb * per_req       # _max_memory_usage_bytes_from_groups
    est = 0
    refused = available <= 0 or needed > available
    if refused and available > 0:
        def fits(n: int) -> bool:
            return bpb * layout.blocks_per_request(n, max_in_flight_tokens) <= available
        if fits(1):
            lo, hi, est = 1, max_model_len, 1
            while lo <= hi:   # _estimate_max_model_len_from_groups: same binary search
                mid = (lo + hi) // 2
                if fits(mid):
                    est, lo = mid, mid + 1
                else:
                    hi = mid - 1
    num_blocks = max(kv_bytes // bpb, 0)
    conc = num_blocks / per_req
    msg = _refusal_message(max_model_len, needed, available, est) if refused else ""
    # tokens of context one more request could hold once the fixed blocks are paid
    ctx = max(num_blocks - fixed, 0)
    ctx_tokens = min(ctx * layout.groups[0].block_size, max_model_len) if ctx else 0
    return KVCapacity(kv_bytes, bpb, num_blocks, per_req, fixed, conc, int(conc * max_model_len),
                      needed, available, refused, est, msg, ctx_tokens)


# ---------------------------------------------------------------------------------------------
# 2. Per-rank memory model
# ---------------------------------------------------------------------------------------------
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


@dataclass(frozen=True)
class Term:
    """One line of the per-rank budget: ``bytes`` on each GPU, where it lives and why."""
    name: str
    bytes: int
    group: str      # weights | activations | workspaces | graphs | non_torch | kv | headroom
    source: str
    replicated: bool = False

    @property
    def gib(self) -> float:
        return self.bytes / GiB


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


def default_max_num_batched_tokens(gpu_total_bytes: int, max_num_seqs: int, max_model_len: int,
                                   usage: str = "server") -> int:
    """vLLM's default ``max_num_batched_tokens`` on a CUDA GPU (``EngineArgs.get_batch_defaults``).

    OpenAI server: 2048 below 70 GiB, 8192 from 70 GiB, 16384 from 160 GiB; LLM class: 8192 /
    16384 / 16384; then capped at ``max_num_seqs * max_model_len`` (chunked prefill on).
    """
    if gpu_total_bytes >= 160 * GiB:
        b = 16384
    elif gpu_total_bytes >= 70 * GiB:
        b = 16384 if usage == "llm" else 8192
    else:
        b = 8192 if usage == "llm" else 2048
    return min(max_num_seqs * max_model_len, b)


# Free memory outside vLLM's budget that a freshly JIT-compiled Triton kernel (cuModuleLoad),
# cuBLAS/NCCL lazy workspaces and allocator fragmentation need. Calibrated so the seeds' settings
# are the edges: on a 48 GB card util 0.97 leaves ~1.4 GiB (watched), 0.95 ~2.3 GiB (unattended).
JIT_HEADROOM = {"watched": int(1.25 * GiB), "unattended": int(2.0 * GiB)}
JIT_SOURCE = "SPEC.md §6 seeds: util 0.97 watched / 0.95 unattended on 48 GB (calibration)"


@dataclass(frozen=True)
class Plan:
    """The per-rank budget for one setting, plus vLLM's KV verdict.

    ``terms`` lists every byte on one GPU (weights, activations, workspaces, graphs, non_torch, kv,
    headroom) and sums to ``total_bytes`` when the KV pool is non-negative.
    """
    gpu: GPU
    fmt: str
    tp: int
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_in_flight_tokens: int
    num_speculative_tokens: int
    cuda_graphs: bool
    terms: tuple[Term, ...]
    kv: KVCapacity
    layout: KVLayout
    headroom_bytes: int
    jit_oom_risk: bool
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.gpu.total_bytes

    @property
    def weight_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.group == "weights")

    @property
    def load_oom(self) -> bool:
        """The weights plus the CUDA context do not fit the card: vLLM dies with a CUDA
        out-of-memory error inside ``load_model``, before it profiles or sizes any KV cache."""
        non_torch = sum(t.bytes for t in self.terms if t.group == "non_torch")
        return self.weight_bytes + non_torch > self.gpu.total_bytes

    @property
    def verdict(self) -> str:
        """Why vLLM would not start with this setting, in the order it would fail ('' if it starts)."""
        if self.load_oom:
            return (f"CUDA out of memory while loading the model: {self.weight_bytes / GiB:.1f} GiB of "
                    f"weights per GPU (TP={self.tp}, {self.fmt} format) exceed the {self.gpu.name}'s "
                    f"{self.gpu.total_bytes / GiB:.1f} GiB; vLLM fails in load_model, before KV sizing")
        return self.kv.message if self.kv.refused else ""

    def by_group(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.terms:
            out[t.group] = out.get(t.group, 0) + t.bytes
        return out

    def rows(self) -> list[dict]:
        """Table rows: ``term, group, GiB, source``."""
        return [{"term": t.name, "group": t.group, "GiB": round(t.gib, 3), "source": t.source}
                for t in self.terms]

    def summary(self) -> dict:
        k = self.kv
        return {
            "gpu": self.gpu.name, "format": self.fmt, "tp": self.tp,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "kv_pool_gib": round(k.kv_bytes / GiB, 3), "kv_tokens": k.tokens,
            "max_concurrency": round(k.max_concurrency, 2), "blocks_per_request": k.blocks_per_request,
            "fixed_blocks_per_request": k.fixed_blocks_per_request, "bytes_per_block": k.bytes_per_block,
            "refused": k.refused, "load_oom": self.load_oom,
            "weights_gib": round(self.weight_bytes / GiB, 3),
            "headroom_gib": round(self.headroom_bytes / GiB, 3),
            "jit_oom_risk": self.jit_oom_risk,
        }


def _activation_bytes(cfg: ModelConfig, tp: int, tokens: int) -> int:
    """Peak live activations of one forward over ``tokens`` (profile_run), estimate from geometry:
    mHC residual in/out + collapsed x (3 x [T, hc, D] bf16), attention q / o ([T, H/tp, 512] bf16
    x 3), MoE ([T*topk, 2I/tp + I/tp + D] bf16), whichever sublayer is larger."""
    D = cfg.hidden_size
    resid = 3 * tokens * cfg.hc_mult * D * BF16
    attn = 3 * tokens * (cfg.num_attention_heads // tp) * cfg.head_dim * BF16
    moe = tokens * cfg.num_experts_per_tok * (3 * cfg.moe_intermediate_size // tp + D) * BF16
    return resid + max(attn, moe)


def plan(cfg: ModelConfig = DEFAULT_CONFIG, *, gpu: str | GPU | int = "l40s", fmt: str = "community",
         tp: int = 4, gpu_memory_utilization: float = 0.95, max_model_len: int = 98304,
         max_num_seqs: int = 1, max_num_batched_tokens: int | None = None,
         num_speculative_tokens: int = 1, cuda_graphs: bool = True, async_scheduling: bool = True,
         kv_cache_memory_bytes: int | None = None, kv_cache_dtype: str = "fp8_ds_mla",
         graphs_in_budget: bool = True, jit_headroom: int = JIT_HEADROOM["watched"]) -> Plan:
    """Per-GPU memory for one serving setting (all bytes per rank).

    Parameters mirror ``vllm serve`` flags. ``num_speculative_tokens`` > 0 means MTP speculation
    (adds the MTP layer's SWA cache and the MTP hidden buffer). ``async_scheduling`` doubles the
    in-flight tokens that sliding-window caches reserve (``VllmConfig.max_concurrent_batches``).
    ``graphs_in_budget``: vLLM 0.32 subtracts its CUDA-graph estimate from the KV budget
    (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1``); older forks did not, so graphs ate the headroom.
    ``kv_cache_memory_bytes`` pins the KV pool (vLLM skips the util-based sizing).

    Raises ValueError naming the argument for out-of-range settings.
    """
    g = resolve_gpu(gpu)
    check_tp(cfg, tp)
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization!r}: must be in (0, 1]")
    for name, v in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}={v!r}: must be a positive integer")
    for name, v in (("max_num_batched_tokens", max_num_batched_tokens), ("kv_cache_memory_bytes", kv_cache_memory_bytes)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ValueError(f"{name}={v!r}: must be a positive integer (or None for vLLM's default)")
    if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r}: must be an integer >= 0")
    B = (max_num_batched_tokens if max_num_batched_tokens is not None
         else default_max_num_batched_tokens(g.total_bytes, max_num_seqs, max_model_len))
    if B < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens={B}: must be >= max_num_seqs={max_num_seqs} (vLLM rule)")
    mtp = num_speculative_tokens > 0
    in_flight = (2 if async_scheduling else 1) * B
    # num_prefill_lookahead_tokens: one MTP module reads one token ahead (config/vllm.py)
    if not mtp:
        lookahead = 0
    elif min(cfg.num_nextn_predict_layers, num_speculative_tokens) > 1:   # multi-module MTP
        lookahead = num_speculative_tokens
    else:
        lookahead = 1
    layout = kv_layout(kv_cache_specs(cfg, kv_cache_dtype, mtp=mtp,
                                      extra_retained_tokens=max(0, lookahead - 1)))

    terms = list(weight_terms(cfg, fmt, tp, mtp=mtp))
    # The profile run is one dummy forward over max_num_batched_tokens tokens with or without MTP:
    # draft tokens count inside that budget, and the drafter's own dummy_run repeats the same
    # token count afterwards (sequentially), so the peak does not scale with 1 + k.
    terms.append(Term(f"activation peak ({B} tokens)", _activation_bytes(cfg, tp, B), "activations",
                      "estimate from geometry at the profile run's token count: vLLM measures it in "
                      "v1/worker/gpu_model_runner.py GPUModelRunner.profile_run -> "
                      "_dummy_run(self.max_num_tokens = max_num_batched_tokens), also with MTP "
                      "(spec_decode/llm_base_proposer.py dummy_run(num_tokens)); "
                      "gpu_worker.determine_available_memory"))
    reqs = min(B, max_num_seqs)
    sampler_rows = 2 * reqs + (3 * reqs if mtp else 0)
    terms.append(Term(f"sampler logits ({sampler_rows} rows x vocab fp32)", sampler_rows * cfg.vocab_size * FP32,
                      "activations", "estimate: gpu_model_runner.py _dummy_sampler_run (logits + sampler copy "
                      "per request; with MTP the rejection sampler's 2 rows + draft probs per request)"))
    nc = cdiv(max_model_len, 4)
    terms += [
        Term("RoPE cos/sin caches", 512 * MiB, "workspaces", "SPEC.md §3 (512 MiB fixed)"),
        Term("topk_indices_buffer [B, index_topk] i32", B * cfg.index_topk * 4, "workspaces", "SPEC.md §3"),
        Term("C128 metadata 2x[B, ceil(L/128)->128] i32",
             2 * B * round_up(cdiv(max_model_len, 128), 128) * 4, "workspaces", "SPEC.md §3"),
        Term("prefill gather workspace 4x(L/4+128+B)x512 bf16", 4 * (nc + 128 + B) * cfg.head_dim * BF16,
             "workspaces", "SPEC.md §3"),
        Term("indexer logits transient (<= 512 MB)", min(B * nc * FP32, 512 * 10**6), "workspaces",
             "SPEC.md §3 (VLLM_SPARSE_INDEXER_MAX_LOGITS_MB)"),
    ]
    if mtp:
        terms.append(Term("MTP hidden buffer [B, hc*D] bf16", B * cfg.hc_mult * cfg.hidden_size * BF16,
                          "workspaces", "SPEC.md §3"))
    graph_bytes = 0
    if cuda_graphs:
        # config/vllm.py _set_cudagraph_sizes: min(512, 2 x max_num_seqs x (1 + k)), capped at
        # max_num_batched_tokens
        cap = min(512, 2 * max_num_seqs * (1 + num_speculative_tokens), B)
        n_sizes = len([s for s in (1, 2, 4, 8) if s <= cap]) + max(0, (cap - 8) // 8)
        graph_bytes = _activation_bytes(cfg, tp, cap) + n_sizes * (cfg.num_layers_with_mtp + 1) * 2 * MiB
        terms.append(Term(f"CUDA-graph pool ({n_sizes} sizes <= {cap})", graph_bytes,
                          "graphs" if graphs_in_budget else "headroom",
                          "estimate: largest capture's activations + ~2 MiB per piecewise graph"))
    terms.append(Term("CUDA context + cuBLAS + NCCL (non-torch)", int((0.55 + (0.25 if tp > 1 else 0)) * GiB),
                      "non_torch", "estimate: measured as non-torch memory by vLLM's profiler"))
    budget = math.ceil(g.total_bytes * gpu_memory_utilization)   # worker.utils.request_memory
    used = sum(t.bytes for t in terms if t.group not in ("headroom",))
    notes: list[str] = []
    if kv_cache_memory_bytes is not None:
        kv_bytes = int(kv_cache_memory_bytes)
        notes.append("kv_cache_memory_bytes given: vLLM uses it instead of the util-based budget")
    else:
        kv_bytes = budget - used
    kv = kv_capacity(layout, max(kv_bytes, 0), max_model_len, in_flight)
    if kv_bytes < 0:
        notes.append(f"weights + activations + workspaces exceed the budget by {(-kv_bytes) / GiB:.2f} GiB")
    terms.append(Term("KV cache pool", max(kv_bytes, 0), "kv",
                      "util*total - non-KV (gpu_worker.determine_available_memory)"))
    outside = g.total_bytes - budget
    headroom = outside - (graph_bytes if cuda_graphs and not graphs_in_budget else 0)
    if kv_cache_memory_bytes is not None:
        headroom = g.total_bytes - used - kv_bytes
    terms.append(Term("free for JIT / driver (outside the torch pool)", max(headroom, 0), "headroom",
                      "(1 - util) * total; Triton cuModuleLoad needs it (SPEC.md §3)"))
    return Plan(g, fmt, tp, gpu_memory_utilization, max_model_len, max_num_seqs, B, in_flight,
                num_speculative_tokens, cuda_graphs, tuple(terms), kv, layout, headroom,
                headroom < jit_headroom, tuple(notes))


def sweep(utils: Iterable[float] | None = None, **kw) -> list[Plan]:
    """:func:`plan` at each utilization (default 0.80 .. 0.99 step 0.005)."""
    if utils is None:
        utils = [round(0.80 + 0.005 * i, 3) for i in range(39)]
    return [plan(gpu_memory_utilization=u, **kw) for u in utils]


@dataclass(frozen=True)
class Remedy:
    """Settings that make an impossible mode feasible, found by planning them (not a rule of thumb).

    ``overrides``: the :func:`plan` keywords changed; ``flags``: the same change as ``vllm serve`` /
    ``ds4lab plan`` flags; ``plan``: the plan at the highest utilization that keeps the mode's JIT
    headroom, where vLLM starts.
    """
    mode: str
    overrides: dict
    flags: str
    plan: Plan

    @property
    def util(self) -> float:
        return self.plan.gpu_memory_utilization


@dataclass(frozen=True)
class Recommendation:
    """Feasible utilization window and the setting for watched / unattended operation.

    ``util_min``: smallest utilization at which vLLM starts (KV fits one max_model_len request);
    ``util_max_watched`` / ``util_max_unattended``: largest that leaves the JIT headroom.
    ``watched`` / ``unattended``: recommended utilization or None when impossible; ``reasons``
    explains each bound; ``fixes`` says what to change when a mode is impossible (concrete flags
    first); ``remedies`` holds, per impossible mode, the first change :func:`find_remedy` found
    that makes it feasible.
    """
    util_min: float | None
    util_max_watched: float | None
    util_max_unattended: float | None
    watched: float | None
    unattended: float | None
    reasons: tuple[str, ...]
    fixes: tuple[str, ...]
    plans: dict
    remedies: dict = field(default_factory=dict)

    def table(self) -> list[dict]:
        """One row per mode; an impossible mode reads ``impossible`` and is followed by a
        ``<mode> (fixed)`` row planned with the remedy's flags."""
        out = []
        for mode in ("watched", "unattended"):
            p = self.plans.get(mode)
            out.append(_rec_row(mode, p, "(as given)"))
            r = self.remedies.get(mode)
            if p is None:
                out.append(_rec_row(f"{mode} (fixed)", r.plan, r.flags) if r else
                           _rec_row(f"{mode} (fixed)", None, "none found"))
        return out


def _rec_row(mode: str, p: Plan | None, flags: str) -> dict:
    if p is None:
        return {"mode": mode, "gpu_memory_utilization": "impossible", "kv_tokens": "-",
                "max_concurrency": "-", "headroom_gib": "-", "flags": flags}
    return {"mode": mode, "gpu_memory_utilization": p.gpu_memory_utilization, "kv_tokens": p.kv.tokens,
            "max_concurrency": round(p.kv.max_concurrency, 2), "headroom_gib": round(p.headroom_bytes / GiB, 2),
            "flags": flags}


def _utils(lo: float, hi: float, step: float) -> list[float]:
    n = int(round((hi - lo) / step))
    return [round(lo + step * i, 4) for i in range(n + 1)]


def _mode_plan(cfg: ModelConfig, need: int, utils: list[float], kw: dict) -> Plan | None:
    """The plan at the highest utilization in ``utils`` that keeps ``need`` bytes of headroom,
    if vLLM starts there (None otherwise: KV grows with util, so no lower util starts either)."""
    for u in reversed(utils):
        p = plan(cfg, gpu_memory_utilization=u, **kw)
        if p.headroom_bytes >= need:
            return None if (p.kv.refused or p.load_oom) else p
    return None


def _flag_text(overrides: dict) -> str:
    parts = []
    for k, v in overrides.items():
        if k == "async_scheduling":
            parts.append("--async-scheduling" if v else "--no-async-scheduling")
        elif k == "tp":
            parts.append(f"--tensor-parallel-size {v}")
        else:
            parts.append(f"--{k.replace('_', '-')} {v}")
    return " ".join(parts)


def find_remedy(cfg: ModelConfig = DEFAULT_CONFIG, mode: str = "watched", step: float = 0.005,
                lo: float = 0.50, hi: float = 0.99, **kw) -> Remedy | None:
    """The first change to a setting that makes ``mode`` feasible, or None.

    Tried in this order, least intrusive first, each planned at the highest utilization that keeps
    the mode's :data:`JIT_HEADROOM`: ``--no-async-scheduling``; ``--max-num-batched-tokens`` 1024,
    512, 256 (each alone, then without async scheduling; these shrink the sliding-window /
    compressor reservation, ``max_in_flight_tokens``); ``--max-model-len`` down to the longest that
    fits (vLLM's own estimate, rounded down to 1024); ``--tensor-parallel-size`` up. Accepts
    :func:`plan`'s keywords. Raises ValueError for an unknown ``mode``.
    """
    if mode not in JIT_HEADROOM:
        raise ValueError(f"mode={mode!r}: one of {sorted(JIT_HEADROOM)}")
    kw.pop("gpu_memory_utilization", None)
    kw.pop("jit_headroom", None)
    need, utils = JIT_HEADROOM[mode], _utils(lo, hi, step)
    base = plan(cfg, gpu_memory_utilization=hi, **kw)
    b0, seqs, async0 = base.max_num_batched_tokens, base.max_num_seqs, kw.get("async_scheduling", True)
    cands: list[dict] = []
    for b in [b0] + [b for b in (1024, 512, 256) if seqs <= b < b0]:
        for a in ([True, False] if async0 else [False]):
            ov: dict = {}
            if b != b0:
                ov["max_num_batched_tokens"] = b
            if async0 and not a:
                ov["async_scheduling"] = False
            if ov:
                cands.append(ov)
    # the longest max_model_len that fits where this mode's headroom allows (as given otherwise)
    top = next((u for u in reversed(utils) if plan(cfg, gpu_memory_utilization=u, **kw).headroom_bytes >= need),
               None)
    if top is not None:
        est = plan(cfg, gpu_memory_utilization=top, **kw).kv.estimated_max_model_len
        est = est // 1024 * 1024 if est >= 1024 else est
        if 0 < est < base.max_model_len:
            cands.append({"max_model_len": est})
    cands += [{"tp": t} for t in SUPPORTED_TP if t > base.tp]
    for ov in cands:
        try:
            p = _mode_plan(cfg, need, utils, dict(kw, **ov))
        except ValueError:   # e.g. a TP the geometry does not divide
            continue
        if p is not None:
            return Remedy(mode, ov, _flag_text(ov), p)
    return None


def recommend(cfg: ModelConfig = DEFAULT_CONFIG, step: float = 0.005, lo: float = 0.50,
              hi: float = 0.99, remedies: bool = True, **kw) -> Recommendation:
    """The feasible ``--gpu-memory-utilization`` window for a setting and a value per mode.

    A utilization is feasible when vLLM would start (one ``max_model_len`` request fits the KV
    pool) and ``(1 - util) * total`` keeps the JIT headroom of the mode (:data:`JIT_HEADROOM`).
    Watched operation takes the highest feasible value (most KV; a JIT OOM costs a restart you
    see); unattended the highest with the larger headroom. For a mode with no feasible value,
    ``remedies`` (default on) runs :func:`find_remedy` and puts its flags first in ``fixes``.
    Accepts :func:`plan`'s keywords.
    """
    kw.pop("gpu_memory_utilization", None)
    kw.pop("jit_headroom", None)
    utils = _utils(lo, hi, step)
    plans = [plan(cfg, gpu_memory_utilization=u, **kw) for u in utils]
    ok = [p for p in plans if not p.kv.refused and not p.load_oom]
    g = plans[0].gpu
    util_min = ok[0].gpu_memory_utilization if ok else None
    reasons, fixes = [], []
    p_hi = plans[-1]
    if util_min is None:
        reasons.append(f"even at util {hi} vLLM does not start: {p_hi.verdict or 'no KV memory'}")
    else:
        p0 = ok[0]
        reasons.append(
            f"util >= {util_min}: below it the KV pool cannot hold one {p0.max_model_len}-token request "
            f"({p0.kv.blocks_per_request} blocks of {p0.kv.bytes_per_block:,} B = "
            f"{p0.kv.needed_bytes / GiB:.2f} GiB; {p0.kv.fixed_blocks_per_request} of them are the "
            f"sliding-window/compressor reservation for {p0.max_in_flight_tokens} in-flight tokens)")
    res: dict = {}
    maxes = {}
    found: dict = {}
    for mode in ("watched", "unattended"):
        need = JIT_HEADROOM[mode]
        cands = [p for p in ok if p.headroom_bytes >= need]
        umax_all = max((p.gpu_memory_utilization for p in plans if p.headroom_bytes >= need), default=None)
        maxes[mode] = umax_all
        if umax_all is not None:
            reasons.append(f"{mode}: util <= {umax_all}: keeps >= {need / GiB:.2f} GiB outside the torch pool "
                           f"for Triton JIT modules / driver on {g.name} ({JIT_SOURCE})")
        if cands:
            res[mode] = cands[-1]
            continue
        if util_min is not None:
            reasons.append(f"{mode}: impossible - the KV minimum (util {util_min}) leaves less than "
                           f"{need / GiB:.2f} GiB of JIT headroom")
        else:
            reasons.append(f"{mode}: impossible - vLLM does not start at any util up to {hi}")
        r = find_remedy(cfg, mode, step=step, lo=lo, hi=hi, **kw) if remedies else None
        if r is not None:
            found[mode] = r
            k = r.plan.kv
            fixes.append(f"{mode}: add {r.flags} -> util {r.util}: {k.tokens:,} KV tokens, "
                         f"{k.max_concurrency:.2f}x concurrency, {r.plan.headroom_bytes / GiB:.2f} GiB headroom")
        elif remedies:
            fixes.append(f"{mode}: no single change tried (async scheduling off, max-num-batched-tokens "
                         f"1024/512/256, shorter max-model-len, higher TP) makes it feasible")
        fixes.append(_fixes(ok[0] if ok else p_hi))
    return Recommendation(util_min, maxes["watched"], maxes["unattended"],
                          res["watched"].gpu_memory_utilization if "watched" in res else None,
                          res["unattended"].gpu_memory_utilization if "unattended" in res else None,
                          tuple(reasons), tuple(dict.fromkeys(f for f in fixes if f)), res, found)


def _fixes(p: Plan) -> str:
    k = p.kv
    if p.load_oom:
        return (f"the weights alone need {p.weight_bytes / GiB:.1f} GiB per GPU: raise TP "
                f"(the experts and attention split across ranks) or use a smaller checkpoint format")
    parts = []
    if k.estimated_max_model_len:
        parts.append(f"lower --max-model-len to <= {k.estimated_max_model_len}")
    if k.fixed_blocks_per_request > 64:
        parts.append(f"lower --max-num-batched-tokens (now {p.max_num_batched_tokens}; the sliding-window "
                     f"caches reserve {k.fixed_blocks_per_request} blocks for {p.max_in_flight_tokens} "
                     f"in-flight tokens per request) or turn async scheduling off")
    parts.append("raise TP or use a smaller checkpoint format")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Serve profiles (ds4lab/config/profiles.toml) -> a plan
# ---------------------------------------------------------------------------------------------
def _profile_format(model: str) -> str:
    m = model.lower()
    if m == "tiny":
        return "bf16"
    if "w4a16" in m:
        return "community"
    return "official"


def plan_for_profile(settings: dict, gpu: str | GPU | int, *, cfg: ModelConfig = DEFAULT_CONFIG,
                     watched: bool = False, stack: dict | None = None) -> Plan:
    """:func:`plan` for a serve profile (a table of ``ds4lab/config/profiles.toml``) on one card.

    ``settings`` uses the profile keys: ``tensor_parallel_size`` (default 1), ``max_model_len``,
    ``max_num_seqs`` (default 1), ``max_num_batched_tokens`` (default: vLLM's for the card),
    ``gpu_memory_utilization`` (``gpu_memory_utilization_watched`` when ``watched``; default 0.92),
    ``kv_cache_memory_bytes``, ``num_speculative_tokens`` (0: no MTP), ``model`` (the checkpoint
    format: ``tiny`` -> bf16, a ``W4A16`` repo -> community, else official), ``flags`` /
    ``extra_args``. ``stack`` is the profile's table of ``ds4lab/config/stacks.toml`` (looked up by
    ``settings["stack"]`` when None); its ``flags`` come before the profile's, as in
    ``ds4lab.serve.launch.build_launch``, and the last spelling of a flag wins, as in vLLM's
    argparse. Flags read: ``--max-num-batched-tokens``, ``--max-model-len``, ``--max-num-seqs``,
    ``--gpu-memory-utilization``, ``--kv-cache-dtype``, ``--enforce-eager``, ``--[no-]async-scheduling``.
    A stack pinned below vLLM 0.32 (the community fork) does not subtract its CUDA-graph estimate
    from the KV budget (``graphs_in_budget=False``). Raises ValueError naming the key for a bad value.
    """
    from ds4lab.config.stacks import option_value   # pure TOML module; memory stays torch-free
    s = dict(settings)
    if stack is None and s.get("stack"):
        from ds4lab.config.stacks import stack as _stack   # pure TOML read; memory stays torch-free
        stack = _stack(str(s["stack"]))
    stack = stack or {}
    argv = [str(a) for a in list(stack.get("flags", [])) + list(s.get("flags", [])) + list(s.get("extra_args", []))]

    def flag(name: str) -> str | None:
        return option_value(argv, name)

    def num(key: str, text: str | None, conv=int):
        if text is None:
            return s.get(key)
        try:
            return conv(text)
        except ValueError:
            raise ValueError(f"flag --{key.replace('_', '-')} {text!r}: not a number") from None

    ukey = "gpu_memory_utilization_watched" if watched and "gpu_memory_utilization_watched" in s \
        else "gpu_memory_utilization"
    kw = dict(
        tp=int(s.get("tensor_parallel_size", 1)),
        max_model_len=num("max_model_len", flag("--max-model-len")),
        max_num_seqs=num("max_num_seqs", flag("--max-num-seqs")) or 1,
        max_num_batched_tokens=num("max_num_batched_tokens", flag("--max-num-batched-tokens")),
        gpu_memory_utilization=float(num(ukey, flag("--gpu-memory-utilization"), float) or 0.92),
        kv_cache_memory_bytes=num("kv_cache_memory_bytes", flag("--kv-cache-memory-bytes")),
        num_speculative_tokens=int(s.get("num_speculative_tokens", 0) or 0),
        kv_cache_dtype=flag("--kv-cache-dtype") or "fp8_ds_mla",
        cuda_graphs="--enforce-eager" not in argv,
    )
    if kw["max_model_len"] is None:
        raise ValueError("profile key max_model_len: missing (the planner needs the longest request)")
    asyncs = [a for a in argv if a in ("--async-scheduling", "--no-async-scheduling")]
    kw["async_scheduling"] = not asyncs or asyncs[-1] == "--async-scheduling"
    pin = str(stack.get("vllm", ""))
    digits = pin.lstrip(">=<~! ").split(".")
    try:
        kw["graphs_in_budget"] = (int(digits[0]), int(digits[1])) >= (0, 32)
    except (ValueError, IndexError):
        kw["graphs_in_budget"] = True
    return plan(cfg, gpu=gpu, fmt=_profile_format(str(s.get("model", "official"))), **kw)


# ---------------------------------------------------------------------------------------------
# CLI: ds4lab plan
# ---------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="config.json or checkpoint folder (default: official geometry)")
    p.add_argument("--format", dest="fmt", default="community", choices=sorted(FORMATS),
                   help="checkpoint format (weight bytes per class): " + "; ".join(
                       f"{k}: {v['desc']}" for k, v in sorted(FORMATS.items())) + " (default: community)")
    p.add_argument("--gpu", default="l40s", help=f"card, one of {sorted(GPUS)} (default: l40s)")
    p.add_argument("--gpu-bytes", type=int, default=None, help="total GPU memory in bytes (overrides --gpu)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=4,
                   help=f"tensor-parallel degree, one of {SUPPORTED_TP} (default: 4)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="plan this value (default: the recommended watched value)")
    p.add_argument("--max-model-len", type=int, default=98304,
                   help="longest request in tokens; one must fit the KV pool or vLLM refuses (default: 98304)")
    p.add_argument("--max-num-seqs", type=int, default=1, help="concurrent requests (default: 1)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per scheduler step; the profile run's token count and, x2 with async "
                        "scheduling, the sliding-window reservation (default: vLLM's for the card, "
                        "2048 below 70 GiB)")
    p.add_argument("--num-speculative-tokens", type=int, default=1, help="MTP tokens (0: no speculation; default: 1)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA graphs off")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="one batch in flight instead of two (halves the sliding-window reservation)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="pin the KV pool per GPU in bytes (vLLM then ignores the utilization for KV)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def format_table(rows: list[dict]) -> str:
    """Rows of dicts (same keys) as a plain left-aligned text table; '' for no rows."""
    if not rows:
        return ""
    cols = list(rows[0])
    w = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(w[c]) for c in cols).rstrip(), "  ".join("-" * w[c] for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(w[c]) for c in cols).rstrip() for r in rows]
    return "\n".join(lines)


_fmt_table = format_table   # the name views and older notebooks used


def _check_args(args: argparse.Namespace) -> None:
    """Input errors name the flag (the CLI turns ValueError into one line and exit status 2)."""
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1]")
    if args.gpu_bytes is not None and args.gpu_bytes < 2**30:
        raise ValueError(f"--gpu-bytes {args.gpu_bytes}: less than 1 GiB is not a GPU")
    for flag in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
        v = getattr(args, flag)
        if v is not None and v <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} {v}: must be a positive integer")
    if args.num_speculative_tokens < 0:
        raise ValueError(f"--num-speculative-tokens {args.num_speculative_tokens}: must be >= 0 (0: no MTP)")
    if args.tp not in SUPPORTED_TP:
        raise ValueError(f"--tp {args.tp}: supported tensor-parallel degrees are {SUPPORTED_TP}")


def main(args: argparse.Namespace) -> int:
    """``ds4lab plan``: one plan, then the recommendation. Exit 0: it is a report, also when a mode
    is impossible (the table says so and names the flags that fix it); 2 for bad input (cli.py)."""
    _check_args(args)
    cfg = load_config(args.config)
    kw = dict(gpu=args.gpu_bytes if args.gpu_bytes is not None else args.gpu, fmt=args.fmt, tp=args.tp,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              num_speculative_tokens=args.num_speculative_tokens, cuda_graphs=not args.enforce_eager,
              async_scheduling=not args.no_async_scheduling, kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    rec = recommend(cfg, **kw)
    u = args.gpu_memory_utilization
    if u is None:
        u = rec.watched or rec.util_max_watched or 0.95
    p = plan(cfg, gpu_memory_utilization=u, **kw)
    if args.json:
        print(json.dumps({"plan": p.summary(), "terms": p.rows(), "refusal": p.verdict,
                          "recommendation": {"util_min": rec.util_min, "watched": rec.watched,
                                             "unattended": rec.unattended, "reasons": rec.reasons,
                                             "fixes": rec.fixes, "table": rec.table(),
                                             "remedies": {m: {"flags": r.flags, "overrides": r.overrides,
                                                              "gpu_memory_utilization": r.util,
                                                              "kv_tokens": r.plan.kv.tokens}
                                                          for m, r in rec.remedies.items()}}}, indent=1))
        return 0
    print(f"# {p.gpu.name} x TP={p.tp}, {p.fmt} checkpoint, util {u}, max-model-len {p.max_model_len}, "
          f"max-num-seqs {p.max_num_seqs}, max-num-batched-tokens {p.max_num_batched_tokens}")
    if args.gpu_memory_utilization is None and rec.watched is None:
        print(f"# no utilization works as given for watched operation; planned at {u} to show why")
    print(format_table(p.rows()))
    k = p.kv
    print(f"\nKV: {k.num_blocks} blocks x {k.bytes_per_block:,} B; {k.blocks_per_request} blocks/request "
          f"({k.fixed_blocks_per_request} fixed); vLLM would print 'KV cache size: {k.tokens:,} tokens, "
          f"Maximum concurrency for {p.max_model_len:,} tokens per request: {k.max_concurrency:.2f}x'")
    if p.load_oom:
        print(f"vLLM FAILS WHILE LOADING: {p.verdict}")
    elif k.refused:
        print(f"vLLM REFUSES TO START: {k.message}")
    if p.jit_oom_risk:
        print(f"JIT-OOM risk: only {p.headroom_bytes / GiB:.2f} GiB outside the torch pool")
    print("\n# recommendation")
    print(format_table(rec.table()))
    for r in rec.reasons:
        print(f"- {r}")
    for f in rec.fixes:
        print(f"- fix: {f}")
    return 0


if __name__ == "__main__":   # pragma: no cover
    ap = argparse.ArgumentParser(prog="ds4lab plan")
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
