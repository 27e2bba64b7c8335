"""A memory model per serving stack (``ds4lab plan --stack NAME``; the stacks of ``config/stacks.toml``).

The memory terms outside the weights and the KV pool differ between upstream vLLM 0.32 and the
community sm_89 fork (vLLM 0.23.1rc1.dev145 era). Each stack here names its terms and each term its
source: a file / function of vLLM 0.32's installed source, the fork's own notes, or the community
recipe (docs/SPEC.md §6, issue 23). Values that had to be fitted to the recipe's observations live in
:data:`FITTED` (their one home) and say so in their source text.

Environment variables (vLLM 0.32 ``vllm/envs.py``) are read from the ``env`` mapping a plan gets
(:data:`HONOURED_ENV` / :data:`IGNORED_ENV` list which and why).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ds4lab.geometry import ModelConfig
from ds4lab.planner.terms import BF16, FP32, GiB, MiB, Term, cdiv, round_up

__all__ = ["StackModel", "STACK_MODELS", "FITTED", "HONOURED_ENV", "IGNORED_ENV", "stack_model", "stack_terms",
           "indexer_logits_bytes", "graphs_in_budget"]

#: Fitted values, each with why it is fitted and to what (the one home of every fitted number).
FITTED: dict[str, dict] = {
    "fork_unexplained_bytes": {
        "value": int(1.45 * GiB),
        "why": ("fitted: the community recipe (SPEC.md §6, issue 23) on 4x RTX 6000 Ada, TP=4, W4A16-FP8-MTP, "
                "fp8_ds_mla, block 256, --max-num-batched-tokens 2048, MTP k=1 saw ~1 GiB/GPU of KV at "
                "262,144 and util 0.97, 262,144 refused at 0.95, 98,304 fitting at 0.95. The sourced fork "
                "terms leave ~1.45 GiB/GPU more KV than that; this term carries the difference (the fork's "
                "portable Triton/torch fallbacks of PR #41834 and Marlin MoE scratch, not itemised)"),
    },
}

#: vLLM 0.32 environment variables the planner reads (name -> effect).
HONOURED_ENV = {
    "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": "the DeepSeek-V4 indexer's logits reservation in every profile run "
                                         "(model_executor/layers/sparse_attn_indexer.py; MiB, default 512)",
    "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0: the CUDA-graph estimate is not taken off the KV budget "
                                                "(v1/worker/gpu_worker.py determine_available_memory); graphs "
                                                "then eat the headroom outside the budget",
}
#: vLLM 0.32 memory-related variables deliberately not modelled, and why.
IGNORED_ENV = {
    "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE": "sizes FlashInfer MLA prefill / FLASHINFER_MLA_SPARSE workspaces; "
                                             "DeepSeek-V4 on Ada runs neither (a forced --attention-backend "
                                             "is forbidden on the sm_89 stacks)",
    "VLLM_DEEPEP_BUFFER_SIZE_MB": "DeepEP all-to-all buffers: expert parallelism only; the planner models TP",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "symmetric-memory all-reduce buffers: inside the NCCL estimate",
    "VLLM_USE_NCCL_SYMM_MEM": "NCCL symmetric memory: inside the NCCL estimate",
    "VLLM_KV_CACHE_LAYOUT": "changes the KV layout, not its bytes",
    "VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE": "ROCm sleep mode only",
    "VLLM_ROCM_QUICK_REDUCE_MAX_SIZE_BYTES_MB": "ROCm only",
}

_SRC_IDX = "vllm 0.32 model_executor/layers/sparse_attn_indexer.py sparse_attn_indexer (profile branch)"
_SRC_WS = "vllm 0.32 v1/worker/workspace.py WorkspaceManager.get_simultaneous (one buffer, grows to the largest set)"


@dataclass(frozen=True)
class StackModel:
    """How one stack spends the memory outside weights and KV.

    ``swa_reservation``: ``"in_flight"`` (vLLM 0.32: sliding-window / compressor-state caches reserve
    blocks for every in-flight token, ``max_concurrent_batches * max_num_batched_tokens``) or
    ``"decode"`` (the fork: one decode step's tokens, ~26 blocks per request as SPEC.md §3 says).
    ``graphs_in_budget``: the CUDA-graph estimate comes off the KV budget (default since vLLM 0.21).
    ``sparse_mla_materializes``: the decode path gathers bf16 KV and fp32 scores per token.
    ``flashinfer_workspace``: bytes of FlashInfer workspace the stack allocates.
    ``fitted``: a :data:`FITTED` key added as its own term (None: nothing fitted).
    """
    name: str
    vllm: str
    swa_reservation: str
    graphs_in_budget: bool
    sparse_mla_materializes: bool
    flashinfer_workspace: int
    flashinfer_source: str
    fitted: str | None
    source: str


STACK_MODELS: dict[str, StackModel] = {m.name: m for m in (
    StackModel("vllm-0.32", "0.32.0", "in_flight", True, False, 0,
               "not allocated: DeepSeek-V4's FlashInfer path (models/deepseek_v4/nvidia/flashinfer_sparse.py, "
               "128 MiB) runs only under --attention-backend FLASHINFER_MLA_SPARSE_DSV4, forbidden on Ada",
               None, "upstream vLLM 0.32 (the installed source)"),
    StackModel("community-sm89-fork", "0.23.1rc1.dev145", "decode", True, True, 128 * MiB,
               "flashinfer 0.6.14+sm89 is in the stack; 128 MiB as DeepSeek-V4's FlashInfer workspace "
               "(vllm 0.32 models/deepseek_v4/nvidia/flashinfer_sparse.py); assumed for the fork",
               "fork_unexplained_bytes",
               "yhfgyyf/vllm-deepseek-v4-sm89 (PR #41834's portable Triton path extended to sm_89), "
               "checked against the community recipe (SPEC.md §6)"),
)}

#: stacks.toml names -> model (a stack pinned at vLLM >= 0.32 uses the upstream model)
_ALIASES = {"ada-upstream": "vllm-0.32", "cpu": "vllm-0.32", "upstream": "vllm-0.32", "fork": "community-sm89-fork"}


def stack_model(stack: str | StackModel | Mapping | None = None) -> StackModel:
    """The :class:`StackModel` for a name (a model key or a ``config/stacks.toml`` table name), a
    stacks.toml table (its ``vllm_source`` / ``vllm`` pin decide), or None (upstream 0.32).
    Raises ValueError naming ``stack`` for an unknown name or a table pinned below vLLM 0.32 that
    is not the fork."""
    if stack is None:
        return STACK_MODELS["vllm-0.32"]
    if isinstance(stack, StackModel):
        return stack
    if isinstance(stack, Mapping):
        if "vllm-deepseek-v4-sm89" in str(stack.get("vllm_source", "")):
            return STACK_MODELS["community-sm89-fork"]
        pin = str(stack.get("vllm", "0.32")).lstrip(">=<~! ").split(".")
        try:
            if (int(pin[0]), int(pin[1])) >= (0, 32):
                return STACK_MODELS["vllm-0.32"]
        except (ValueError, IndexError):
            pass
        raise ValueError(f"stack={dict(stack)!r}: no memory model for vLLM {stack.get('vllm')!r} "
                         f"(known: {sorted(STACK_MODELS)})")
    key = _ALIASES.get(str(stack), str(stack))
    if key not in STACK_MODELS:
        known = sorted(set(STACK_MODELS) | set(_ALIASES))
        raise ValueError(f"stack={stack!r}: unknown; known: {known}")
    return STACK_MODELS[key]


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    v = env.get(name)
    if v is None or v == "":
        return default
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"environment {name}={v!r}: not an integer") from None
    if n < 0:
        raise ValueError(f"environment {name}={v!r}: must be >= 0")
    return n


def indexer_logits_bytes(env: Mapping[str, str] | None = None) -> int:
    """``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB * 1024 * 1024`` (MiB despite the name): the dummy allocation
    the indexer makes in every profile run, whatever the batch or context (vLLM 0.32
    ``sparse_attn_indexer.py``: ``torch.empty(max_logits_elems, dtype=torch.uint8)``)."""
    return _env_int(env or {}, "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", 512) * MiB


def graphs_in_budget(model: StackModel, env: Mapping[str, str] | None = None) -> bool:
    """The stack's rule, unless ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0`` turns the estimate off."""
    return model.graphs_in_budget and bool(_env_int(env or {}, "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", 1))


def _activation_bytes(cfg: ModelConfig, tp: int, tokens: int) -> int:
    """Peak live activations of one forward over ``tokens`` (profile_run), estimate from geometry:
    mHC residual in/out + collapsed x (3 x [T, hc, D] bf16), attention q / o ([T, H/tp, 512] bf16
    x 3), MoE ([T*topk, 2I/tp + I/tp + D] bf16), whichever sublayer is larger."""
    D = cfg.hidden_size
    resid = 3 * tokens * cfg.hc_mult * D * BF16
    attn = 3 * tokens * (cfg.num_attention_heads // tp) * cfg.head_dim * BF16
    moe = tokens * cfg.num_experts_per_tok * (3 * cfg.moe_intermediate_size // tp + D) * BF16
    return resid + max(attn, moe)


def stack_terms(model: StackModel, cfg: ModelConfig, *, tp: int, batched_tokens: int, max_model_len: int,
                max_num_seqs: int, num_speculative_tokens: int, cuda_graphs: bool,
                env: Mapping[str, str] | None = None) -> list[Term]:
    """Every per-rank term outside weights, KV pool and headroom for one setting on one stack.

    ``batched_tokens`` is ``max_num_batched_tokens`` (the profile run's token count). Groups:
    ``activations``, ``workspaces``, ``graphs`` (or ``headroom`` when the estimate is not in the
    budget), ``non_torch``. Raises ValueError naming an environment variable with a bad value.
    """
    env = env or {}
    B, L, k = batched_tokens, max_model_len, num_speculative_tokens
    mtp = k > 0
    H = cfg.num_attention_heads // tp
    out: list[Term] = []
    out.append(Term(f"activation peak ({B} tokens)", _activation_bytes(cfg, tp, B), "activations",
                    "estimate from geometry at the profile run's token count: vLLM measures it in "
                    "v1/worker/gpu_model_runner.py GPUModelRunner.profile_run -> "
                    "_dummy_run(self.max_num_tokens = max_num_batched_tokens), also with MTP "
                    "(spec_decode/llm_base_proposer.py dummy_run(num_tokens)); "
                    "gpu_worker.determine_available_memory"))
    reqs = min(B, max_num_seqs)
    rows = 2 * reqs + (3 * reqs if mtp else 0)
    out.append(Term(f"sampler logits ({rows} rows x vocab fp32)", rows * cfg.vocab_size * FP32, "activations",
                    "estimate: gpu_model_runner.py _dummy_sampler_run (logits + sampler copy per request; "
                    "with MTP the rejection sampler's 2 rows + draft probs per request)"))
    out.append(Term("RoPE cos/sin caches", 512 * MiB, "workspaces", "SPEC.md §3 (512 MiB fixed)"))
    out.append(Term("topk_indices_buffer [B, index_topk] i32", B * cfg.index_topk * 4, "workspaces", "SPEC.md §3"))
    out.append(Term("C128 metadata 2x[B, ceil(L/128)->128] i32", 2 * B * round_up(cdiv(L, 128), 128) * 4,
                    "workspaces", "SPEC.md §3"))
    # One WorkspaceManager buffer serves both dummy-run reservations; it grows to the larger set.
    factor = 5 if L <= 256 * 1024 else 2     # config/vllm.py sparse_mla_prefill_workspace_factor
    total_seq = L * (576 * 2 // 132) * factor // 4   # indexer.py get_max_prefill_buffer_size // ratio 4
    idx_set = sum(round_up(x, 256) for x in (total_seq * cfg.index_head_dim, total_seq * 4, 1 * MiB))
    M = cdiv(L, 4) + cfg.sliding_window + B
    mla_set = sum(round_up(x, 256) for x in (4 * M * cfg.head_dim * BF16,
                                              B * round_up(cfg.index_topk + cfg.sliding_window, 128) * 4, B * 4))
    out.append(Term("prefill gather workspace max(indexer K gather, 4x(L/4+128+B)x512 bf16)", max(idx_set, mla_set),
                    "workspaces", f"{_SRC_WS}: indexer values [L*8*f/4, 128] fp8 + scales + 1 MiB radix topk "
                    f"({_SRC_IDX}; f={factor}, config/vllm.py), vs models/deepseek_v4/nvidia/flashmla.py "
                    "dummy-run bf16 gather (PREFILL_CHUNK_SIZE=4)"))
    out.append(Term("indexer logits reservation (VLLM_SPARSE_INDEXER_MAX_LOGITS_MB)", indexer_logits_bytes(env),
                    "workspaces", f"{_SRC_IDX}: torch.empty(MAX_LOGITS_MB * 1024 * 1024, uint8) in every "
                    "profile run, whatever B or L"))
    if mtp:
        out.append(Term("MTP hidden buffer [B, hc*D] bf16", B * cfg.hc_mult * cfg.hidden_size * BF16,
                        "workspaces", "SPEC.md §3"))
    if model.sparse_mla_materializes:
        n = cfg.index_topk + cfg.sliding_window
        out.append(Term(f"sparse-MLA gather: bf16 KV + fp32 scores [{B}, {n}] ({H} heads)",
                        B * n * (cfg.head_dim * BF16 + H * FP32), "workspaces",
                        "the fork's Triton sparse-MLA path (VLLM_TRITON_MLA_SPARSE=1, PR #41834 portable ops) "
                        "materializes the top-512 + window candidates as bf16 rows and fp32 scores per token "
                        "(fork SM89_DEEPSEEK_V4_NOTES.md; sized at the profile run's token count, estimate)"))
    gib = graphs_in_budget(model, env)
    if cuda_graphs:
        # config/vllm.py _set_cudagraph_sizes: min(512, 2 x max_num_seqs x (1 + k)), capped at B
        cap = min(512, 2 * max_num_seqs * (1 + k), B)
        sizes = [s for s in (1, 2, 4, 8) if s <= cap] + list(range(16, cap + 1, 8))
        per_size = (cfg.num_layers_with_mtp + 1) * 2 * MiB
        out.append(Term(f"CUDA-graph pool: largest capture's activations ({cap} tokens)",
                        _activation_bytes(cfg, tp, cap), "graphs" if gib else "headroom",
                        "estimate: one shared graph pool holds the largest capture's activations "
                        "(v1/worker/gpu_model_runner.py profile_cudagraph_memory)"))
        out.append(Term(f"CUDA-graph pool: {len(sizes)} captured sizes x ~2 MiB per piecewise graph",
                        len(sizes) * per_size, "graphs" if gib else "headroom",
                        f"estimate: sizes {sizes} (config/vllm.py _set_cudagraph_sizes), one piecewise graph "
                        "per layer + 1 per size"))
    out.append(Term("CUDA context + loaded modules (non-torch)", int(0.50 * GiB), "non_torch",
                    "estimate: measured as non-torch memory by vLLM's profiler (utils/mem_utils.py)"))
    out.append(Term("cuBLAS / cuBLASLt workspaces", int(0.05 * GiB), "non_torch",
                    "estimate: per-stream cuBLAS workspaces (torch CUBLAS_WORKSPACE_CONFIG default) and handles"))
    if tp > 1:
        out.append(Term("NCCL communicators + custom all-reduce buffers", int(0.25 * GiB), "non_torch",
                        "estimate: NCCL channels / proxy buffers per peer and vLLM's custom all-reduce IPC "
                        "buffers (distributed/parallel_state.py), TP > 1 only"))
    if model.flashinfer_workspace:
        out.append(Term("FlashInfer workspace", model.flashinfer_workspace, "workspaces", model.flashinfer_source))
    else:
        out.append(Term("FlashInfer workspace", 0, "workspaces", model.flashinfer_source))
    if model.fitted:
        f = FITTED[model.fitted]
        out.append(Term(f"fork overhead not itemised (FITTED: {model.fitted})", f["value"], "workspaces", f["why"]))
    return out
