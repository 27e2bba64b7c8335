"""KV-cache accounting, an exact mirror of vLLM 0.32's DeepSeek-V4 KV-cache specs and its packed
block-outermost grouping.

Page sizes come from the geometry and the layer classes' ``get_kv_cache_spec``
(``vllm/models/deepseek_v4/attention.py``, ``compressor.py``,
``vllm/v1/attention/backends/mla/sparse_swa.py``); groups, bytes per block, per-request blocks,
capacity and the max-seq-len refusal come from ``vllm/v1/core/kv_cache_utils.py``
(``_get_packed_kv_cache_groups``, ``_get_kv_cache_bytes_per_block``,
``get_max_concurrency_for_kv_cache_config``, ``_check_enough_kv_cache_memory``) and
``vllm/v1/kv_cache_interface.py`` (``SlidingWindowSpec.max_admission_blocks_per_request``,
``FullAttentionSpec.max_memory_usage_bytes``). ``tests/test_memory_vllm.py`` checks it against
the real functions on the tiny checkpoint.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from ds4lab.geometry import (
    DEFAULT_CONFIG, FP8_BLOCK, FP8_DS_MLA_ALIGN, FP8_DS_MLA_ENTRY_BYTES, LayerKind, ModelConfig, layer_kinds,
)
from ds4lab.planner.terms import BF16, FP32, cdiv, format_gib, round_up

__all__ = ["BLOCK_SIZE", "SWA_BLOCK_SIZE", "PLAIN_ALIGN", "CacheSpec", "KVGroup", "KVLayout", "KVCapacity",
           "kv_cache_specs", "kv_layout", "kv_capacity"]

# vLLM 0.32 defaults for DeepSeek-V4 (SPEC.md §3, §6)
BLOCK_SIZE = 256            # --block-size 256 (the sparse MLA / indexer backends' only kernel block size)
SWA_BLOCK_SIZE = 64         # DeepseekV4SWACache(block_size=64) default (v1/attention/backends/mla/sparse_swa.py)
PLAIN_ALIGN = 512           # page alignment for plain bf16/fp8 rows (FlashInfer sparse, vLLM #44577)


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
    kv_state = FP8_DS_MLA_ENTRY_BYTES if ds else hd * BF16   # MLA: head_size_v = 0
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

