"""The per-rank memory model and vLLM's verdict for one setting: :func:`plan`, :func:`sweep`.

Weights per checkpoint format, activation peak, workspaces that grow with the settings (SPEC.md §3),
CUDA-graph pool, non-torch memory; the KV pool is what ``gpu_memory_utilization * total`` leaves
(``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``); JIT headroom is what lies outside
that budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from ds4lab.geometry import DEFAULT_CONFIG, ModelConfig, check_tp
from ds4lab.planner.gpus import GPU, resolve_gpu
from ds4lab.planner.kv import KVCapacity, KVLayout, kv_cache_specs, kv_capacity, kv_layout
from ds4lab.planner.stack_models import StackModel, stack_model, stack_terms
from ds4lab.planner.terms import GiB, Term
from ds4lab.planner.weights import weight_terms

__all__ = ["JIT_HEADROOM", "JIT_SOURCE", "Plan", "default_max_num_batched_tokens", "plan", "sweep"]


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
    stack: str = "vllm-0.32"
    warnings: tuple[str, ...] = ()

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

    @property
    def outcome(self) -> str:
        """The verdict in two words, the one wording every face uses (CLI, ``serve --print``, views):
        ``"load OOM"`` (CUDA out of memory in load_model), ``"refused"`` (vLLM refuses to start: KV),
        ``"starts"``."""
        return "load OOM" if self.load_oom else "refused" if self.kv.refused else "starts"

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
            "jit_oom_risk": self.jit_oom_risk, "stack": self.stack, "outcome": self.outcome,
            "warnings": list(self.warnings),
        }


def plan(cfg: ModelConfig = DEFAULT_CONFIG, *, gpu: str | GPU | int = "l40s", fmt: str = "community",
         tp: int = 4, gpu_memory_utilization: float = 0.95, max_model_len: int = 98304,
         max_num_seqs: int = 1, max_num_batched_tokens: int | None = None,
         num_speculative_tokens: int = 1, cuda_graphs: bool = True, async_scheduling: bool = True,
         kv_cache_memory_bytes: int | None = None, kv_cache_dtype: str = "fp8_ds_mla",
         graphs_in_budget: bool | None = None, jit_headroom: int = JIT_HEADROOM["watched"],
         stack: str | StackModel | Mapping | None = None, env: Mapping[str, str] | None = None) -> Plan:
    """Per-GPU memory for one serving setting (all bytes per rank).

    Parameters mirror ``vllm serve`` flags. ``num_speculative_tokens`` > 0 means MTP speculation
    (adds the MTP layer's SWA cache and the MTP hidden buffer). ``async_scheduling`` doubles the
    in-flight tokens that sliding-window caches reserve (``VllmConfig.max_concurrent_batches``).
    ``stack``: the serving stack's memory model (:func:`ds4lab.planner.stack_models.stack_model`: a
    model key, a ``config/stacks.toml`` name or table; default upstream vLLM 0.32); it decides the
    terms outside weights and KV and the sliding-window reservation. ``env``: the environment vLLM
    would see (``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB``, ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``;
    :data:`~ds4lab.planner.stack_models.HONOURED_ENV`); default: none set. ``graphs_in_budget``
    overrides the stack's rule for the CUDA-graph estimate (None: the stack's, then the env's).
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
    model = stack_model(stack)
    env = dict(env or {})
    mtp = num_speculative_tokens > 0
    if model.swa_reservation == "in_flight":   # vLLM 0.32 VllmConfig.max_in_flight_tokens
        in_flight = (2 if async_scheduling else 1) * B
    else:                                      # the fork: one decode step per request
        in_flight = 1 + num_speculative_tokens
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
    st = stack_terms(model, cfg, tp=tp, batched_tokens=B, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                     num_speculative_tokens=num_speculative_tokens, cuda_graphs=cuda_graphs, env=env)
    if graphs_in_budget is not None:   # explicit override of the stack / env rule
        st = [Term(t.name, t.bytes, ("graphs" if graphs_in_budget else "headroom") if t.group in ("graphs", "headroom")
                   else t.group, t.source, t.replicated) for t in st]
    terms += st
    graph_bytes = sum(t.bytes for t in st if t.group == "headroom")   # graphs outside the budget
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
    headroom = outside - graph_bytes
    if kv_cache_memory_bytes is not None:
        headroom = g.total_bytes - used - kv_bytes
    terms.append(Term("free for JIT / driver (outside the torch pool)", max(headroom, 0), "headroom",
                      "(1 - util) * total; Triton cuModuleLoad needs it (SPEC.md §3)"))
    warnings: list[str] = []
    if not kv.refused and kv.max_concurrency < max_num_seqs:
        warnings.append(f"the KV pool holds {kv.max_concurrency:.2f} requests of {max_model_len:,} tokens, fewer "
                        f"than --max-num-seqs {max_num_seqs}: that many long requests at once will be preempted "
                        f"or queued (vLLM's 'Maximum concurrency' line)")
    return Plan(g, fmt, tp, gpu_memory_utilization, max_model_len, max_num_seqs, B, in_flight,
                num_speculative_tokens, cuda_graphs, tuple(terms), kv, layout, headroom,
                headroom < jit_headroom, tuple(notes), model.name, tuple(warnings))


def sweep(utils: Iterable[float] | None = None, **kw) -> list[Plan]:
    """:func:`plan` at each utilization (default 0.80 .. 0.99 step 0.005)."""
    if utils is None:
        utils = [round(0.80 + 0.005 * i, 3) for i in range(39)]
    return [plan(gpu_memory_utilization=u, **kw) for u in utils]

