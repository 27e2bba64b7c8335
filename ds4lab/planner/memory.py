"""Per-GPU memory planner: ``--gpu-memory-utilization`` against KV headroom (``ds4lab plan``).

The public face of :mod:`ds4lab.planner`: re-exports the names notebooks, ``ds4lab.serve`` and the
tests use. Pure Python over :mod:`ds4lab.geometry` (no torch, no vLLM import): fast enough for a
slider. Views (plotly figures, ipywidgets) live in :mod:`ds4lab.views.memory`; the planner never
imports them. One job per module:

- :mod:`~ds4lab.planner.terms`: units and the budget line :class:`Term`;
- :mod:`~ds4lab.planner.gpus`: the GPU catalogue (SPEC.md §4);
- :mod:`~ds4lab.planner.kv`: KV accounting, an exact mirror of vLLM 0.32's specs and grouping;
- :mod:`~ds4lab.planner.weights`: weight bytes per checkpoint format;
- :mod:`~ds4lab.planner.plan`: the per-rank memory model and vLLM's verdict (:func:`plan`);
- :mod:`~ds4lab.planner.recommend`: the utilization window per mode and remedies;
- :mod:`~ds4lab.planner.profile`: a serve profile as a plan;
- :mod:`~ds4lab.planner.cli`: ``ds4lab plan``.

All sizes are bytes unless a name says ``_gib``.
"""
from __future__ import annotations

from ds4lab.geometry import DEFAULT_CONFIG, ModelConfig, load_config
from ds4lab.planner.cli import add_arguments, main
from ds4lab.planner.gpus import GPU, GPUS, resolve_gpu
from ds4lab.planner.kv import (
    BLOCK_SIZE, PLAIN_ALIGN, SWA_BLOCK_SIZE, CacheSpec, KVCapacity, KVGroup, KVLayout, kv_cache_specs, kv_capacity,
    kv_layout,
)
from ds4lab.planner.plan import JIT_HEADROOM, JIT_SOURCE, Plan, default_max_num_batched_tokens, plan, sweep
from ds4lab.planner.profile import plan_for_profile
from ds4lab.planner.recommend import Recommendation, Remedy, find_remedy, longest_max_model_len, recommend
from ds4lab.planner.stack_models import StackModel, stack_model
from ds4lab.planner.terms import BF16, FP32, GiB, MiB, Term, cdiv, format_gib, round_up
from ds4lab.planner.weights import FORMATS, weight_terms
from ds4lab.tables import format_table

__all__ = [
    "GiB", "MiB", "GPU", "GPUS", "FORMATS", "CacheSpec", "KVGroup", "KVLayout", "KVCapacity",
    "Term", "Plan", "Recommendation", "Remedy", "JIT_HEADROOM",
    "kv_cache_specs", "kv_layout", "kv_capacity", "weight_terms", "plan", "sweep", "recommend", "find_remedy",
    "plan_for_profile", "default_max_num_batched_tokens", "resolve_gpu", "format_gib", "format_table",
    "add_arguments", "main", "BLOCK_SIZE", "SWA_BLOCK_SIZE", "PLAIN_ALIGN", "JIT_SOURCE", "BF16", "FP32", "cdiv",
    "round_up", "DEFAULT_CONFIG", "ModelConfig", "load_config", "longest_max_model_len", "StackModel", "stack_model",
]
