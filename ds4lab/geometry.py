"""DeepSeek-V4-Flash geometry: config.json -> layer pattern -> per-rank op shapes.

Every shape used by the tests, benchmarks, notebooks, the memory planner and the tiny-checkpoint
writer comes from here. Field names follow the official ``deepseek-ai/DeepSeek-V4-Flash``
``config.json`` and the keys vLLM 0.32's ``vllm/models/deepseek_v4`` reads from it.

Tensor parallelism (vLLM 0.32, ``DeepseekV4`` model): at TP=t the 64 query heads, ``wq_b`` output
rows, the 8 ``wo_a`` groups and the ``wo_b`` input columns are split by t, as are the MoE and
shared-expert intermediate sizes; ``wq_a``/``wkv``, the indexer, the compressors and all caches are
replicated on every rank.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable

__all__ = [
    "ModelConfig", "ConfigError", "LayerKind", "OpShape", "DEFAULT_CONFIG", "SUPPORTED_MODEL_TYPES",
    "REQUIRED_FIELDS",
    "load_config", "layer_kinds", "op_shapes", "SUPPORTED_TP", "FP8_BLOCK",
    "FP8_DS_MLA_DATA_BYTES", "FP8_DS_MLA_SCALE_BYTES", "FP8_DS_MLA_ENTRY_BYTES", "FP8_DS_MLA_ALIGN",
]

SUPPORTED_TP = (1, 2, 4, 8)
FP8_BLOCK = 128  # 128x128 weight blocks, 1x128 activation groups (config quantization_config)

# The fp8_ds_mla KV-cache entry (vLLM 0.32 ``deepseek_v4/attention.py`` state_content_bytes=584;
# FlashMLA's packing): per token 448 float8_e4m3fn NoPE bytes + 64 bf16 RoPE values = 576 data bytes
# at ``pos * 576``, then, after all data rows of a block, 8 scale bytes (7 UE8M0 exponents + 1 pad)
# at ``block_size * 576 + pos * 8``. A page is padded to a multiple of 576 B.
FP8_DS_MLA_DATA_BYTES = 576
FP8_DS_MLA_SCALE_BYTES = 8
FP8_DS_MLA_ENTRY_BYTES = FP8_DS_MLA_DATA_BYTES + FP8_DS_MLA_SCALE_BYTES   # 584 per token-entry
FP8_DS_MLA_ALIGN = FP8_DS_MLA_DATA_BYTES                                  # page alignment (576)


class ConfigError(ValueError):
    """A config.json that ds4lab does not understand (names the offending field)."""


class LayerKind:
    SWA = "swa"      # sliding window only (compress ratio 0)
    C4A = "c4a"      # SWA + indexer top-k over the 4x compressed cache
    C128A = "c128a"  # SWA + every entry of the 128x compressed cache
    MTP = "mtp"      # the next-token-prediction layer (SWA only)


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a DeepSeek-V4 ``config.json`` that shape compute and memory.

    Defaults are the official DeepSeek-V4-Flash values (SPEC.md §1).
    """
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_nextn_predict_layers: int = 1
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4, 0)
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    num_hash_layers: int = 3
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    vocab_size: int = 129280
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    expert_dtype: str = "fp4"
    tie_word_embeddings: bool = False
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """K = V latent width (one KV head): 448 NoPE + 64 RoPE = 512."""
        return self.head_dim * self.num_key_value_heads

    @property
    def heads_per_o_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def hc_mix_dim(self) -> int:
        """mHC mixes per token: pre (hc) + post (hc) + comb (hc*hc) = 24 for hc=4."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def num_layers_with_mtp(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def to_json_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        d["compress_ratios"] = list(self.compress_ratios)
        d.update(self.extra)
        return d


DEFAULT_CONFIG = ModelConfig()

_FIELD_NAMES = {f.name for f in fields(ModelConfig)} - {"extra"}


def _check(cfg: ModelConfig) -> ModelConfig:
    def bad(name: str, why: str) -> ConfigError:
        return ConfigError(f"config field {name}={getattr(cfg, name)!r}: {why}")

    if cfg.num_key_value_heads != 1:
        raise bad("num_key_value_heads", "DeepSeek-V4 MLA has exactly one latent KV head")
    if cfg.head_dim <= cfg.qk_rope_head_dim or cfg.qk_rope_head_dim % 2:
        raise bad("qk_rope_head_dim", f"must be even and smaller than head_dim={cfg.head_dim}")
    if cfg.o_groups <= 0 or cfg.num_attention_heads % cfg.o_groups:
        raise bad("o_groups", f"must divide num_attention_heads={cfg.num_attention_heads}")
    n = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    if len(cfg.compress_ratios) != n:
        raise bad("compress_ratios", f"needs num_hidden_layers + num_nextn_predict_layers = {n} entries, "
                                     f"got {len(cfg.compress_ratios)}")
    unknown = sorted(set(cfg.compress_ratios) - {0, 4, 128})
    if unknown:
        raise bad("compress_ratios", f"ratios {unknown} are not DeepSeek-V4 layer kinds (0, 4, 128)")
    if cfg.num_nextn_predict_layers > 1:
        raise bad("num_nextn_predict_layers", "DeepSeek-V4 ships one MTP layer; more is not modelled")
    if cfg.scoring_func != "sqrtsoftplus":
        raise bad("scoring_func", "only DeepSeek-V4's sqrtsoftplus router is modelled")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise bad("num_experts_per_tok", f"exceeds n_routed_experts={cfg.n_routed_experts}")
    if not 0 <= cfg.num_hash_layers <= cfg.num_hidden_layers:
        raise bad("num_hash_layers", "must be within [0, num_hidden_layers]")
    for name in ("hidden_size", "q_lora_rank", "moe_intermediate_size", "o_lora_rank"):
        if getattr(cfg, name) % FP8_BLOCK:
            raise bad(name, f"must be a multiple of the {FP8_BLOCK}-wide FP8 block")
    return cfg


#: model_type values ds4lab models (vLLM 0.32 ``DeepseekV4Config.model_type``)
SUPPORTED_MODEL_TYPES = ("deepseek_v4",)
#: fields every DeepSeek-V4 config.json carries (vLLM's DeepseekV4Config has no defaults for them);
#: a config without them is not one ds4lab should fill in with V4-Flash values
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                   "n_routed_experts", "moe_intermediate_size", "compress_ratios")
_MAY_BE_ZERO = {"num_nextn_predict_layers", "num_hash_layers", "n_shared_experts"}
_FIELD_TYPES = {f.name: f.type for f in fields(ModelConfig) if f.name != "extra"}


def _check_value(k: str, v: Any) -> Any:
    """Type and range of one config.json field; returns the value as ModelConfig stores it."""
    t = _FIELD_TYPES[k]

    def bad(why: str) -> ConfigError:
        return ConfigError(f"config field {k}={v!r}: {why}")

    if k == "compress_ratios":
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise bad("must be a list of integers (one compress ratio per layer)")
        return tuple(v)
    if t == "int":
        if not isinstance(v, int) or isinstance(v, bool):
            raise bad("must be an integer")
        if v < 0 or (v == 0 and k not in _MAY_BE_ZERO):
            raise bad("must be positive" if k not in _MAY_BE_ZERO else "must be >= 0")
    elif t == "float":
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v > 0 and v != float("inf")):
            raise bad("must be a positive number")
    elif t == "bool":
        if not isinstance(v, bool):
            raise bad("must be true or false")
    elif t == "str":
        if not isinstance(v, str):
            raise bad("must be a string")
    return v


def from_dict(d: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from a ``config.json`` dictionary.

    Raises ConfigError naming the field when ``d`` is not a JSON object, ``model_type`` is missing
    or not in :data:`SUPPORTED_MODEL_TYPES`, a field of :data:`REQUIRED_FIELDS` is missing, a
    field has the wrong type (integers must be positive integers; ``num_nextn_predict_layers``,
    ``num_hash_layers`` and ``n_shared_experts`` may be 0), or the fields do not describe a
    DeepSeek-V4 layout. Fields outside :class:`ModelConfig` are kept in ``extra`` unchecked.
    """
    if not isinstance(d, dict):
        raise ConfigError(f"config.json: must be a JSON object of config fields, got {type(d).__name__}")
    if "model_type" not in d:
        raise ConfigError(f"config field model_type: missing; ds4lab understands "
                          f"{', '.join(map(repr, SUPPORTED_MODEL_TYPES))} (a DeepSeek-V4 config.json names it)")
    mt = d["model_type"]
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"config field model_type={mt!r}: ds4lab understands "
                          f"{', '.join(map(repr, SUPPORTED_MODEL_TYPES))} only")
    missing = [k for k in REQUIRED_FIELDS if k not in d]
    if missing:
        raise ConfigError(f"config field {missing[0]}: missing (a DeepSeek-V4 config.json has all of "
                          f"{', '.join(REQUIRED_FIELDS)}; missing: {', '.join(missing)})")
    kw: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for k, v in d.items():
        if k in _FIELD_NAMES:
            kw[k] = _check_value(k, v)
        else:
            extra[k] = v
    try:
        cfg = ModelConfig(**kw, extra=extra)
    except TypeError as e:  # pragma: no cover - dataclass signature errors
        raise ConfigError(str(e)) from e
    return _check(cfg)


def load_config(path: str | os.PathLike | None = None) -> ModelConfig:
    """Load a config from a ``config.json`` file or a checkpoint folder; None gives the default."""
    if path is None:
        return DEFAULT_CONFIG
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    try:
        with open(p) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config path {path!r}: no config.json there") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config path {path!r}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"config path {path!r}: must be a JSON object of config fields, got {type(d).__name__}")
    return from_dict(d)


def layer_kinds(cfg: ModelConfig = DEFAULT_CONFIG) -> list[str]:
    """Layer kinds in order; the last ``num_nextn_predict_layers`` entries are MTP layers."""
    kinds = []
    for i, r in enumerate(cfg.compress_ratios):
        if i >= cfg.num_hidden_layers:
            kinds.append(LayerKind.MTP)
        else:
            kinds.append({0: LayerKind.SWA, 4: LayerKind.C4A, 128: LayerKind.C128A}[r])
    return kinds


def layer_counts(cfg: ModelConfig = DEFAULT_CONFIG) -> dict[str, int]:
    out = {LayerKind.SWA: 0, LayerKind.C4A: 0, LayerKind.C128A: 0, LayerKind.MTP: 0}
    for k in layer_kinds(cfg):
        out[k] += 1
    return out


def check_tp(cfg: ModelConfig, tp: int) -> int:
    if tp not in SUPPORTED_TP:
        raise ValueError(f"tp={tp!r}: supported tensor-parallel degrees are {SUPPORTED_TP}")
    for name, n in (("num_attention_heads", cfg.num_attention_heads), ("o_groups", cfg.o_groups),
                    ("moe_intermediate_size", cfg.moe_intermediate_size)):
        if n % tp:
            raise ValueError(f"tp={tp}: {name}={n} is not divisible by it")
    return tp


@dataclass(frozen=True)
class OpShape:
    """One op of a layer at one TP rank.

    ``name`` is the field's name for the op; ``family`` the kernel family in ``kernels/``;
    ``dims`` the per-rank sizes (``M``/``T`` is the token count and is left out: it varies);
    ``per_layer`` how many times a layer of each kind in ``layers`` calls it;
    ``replicated`` whether the weight is the same on every TP rank.
    """
    name: str
    family: str
    dims: dict
    layers: tuple[str, ...]
    per_layer: int = 1
    replicated: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


_ATTN = (LayerKind.SWA, LayerKind.C4A, LayerKind.C128A, LayerKind.MTP)
_MAIN = (LayerKind.SWA, LayerKind.C4A, LayerKind.C128A)


def op_shapes(cfg: ModelConfig = DEFAULT_CONFIG, tp: int = 1) -> dict[str, OpShape]:
    """Per-rank shape of every op DeepSeek-V4 runs, keyed by op name.

    GEMMs use DeepGEMM ``fp8_gemm_nt`` naming: ``D[M,N] = A[M,K] @ B[N,K]^T``.
    """
    check_tp(cfg, tp)
    h = cfg.num_attention_heads // tp
    g = cfg.o_groups // tp
    inter = cfg.moe_intermediate_size // tp
    D = cfg.hidden_size
    ops = [
        # dense FP8 linears (SPEC.md §2 item 2)
        OpShape("wq_a_wkv", "fp8_gemm", {"N": cfg.q_lora_rank + cfg.kv_latent_dim, "K": D},
                _ATTN, replicated=True),
        OpShape("wq_b", "fp8_gemm", {"N": h * cfg.head_dim, "K": cfg.q_lora_rank}, _ATTN),
        OpShape("wo_b", "fp8_gemm", {"N": D, "K": g * cfg.o_lora_rank}, _ATTN),
        OpShape("indexer_wq_b", "fp8_gemm", {"N": cfg.index_n_heads * cfg.index_head_dim,
                                             "K": cfg.q_lora_rank}, (LayerKind.C4A,), replicated=True),
        OpShape("shared_gate_up", "fp8_gemm", {"N": 2 * inter * cfg.n_shared_experts, "K": D}, _ATTN),
        OpShape("shared_down", "fp8_gemm", {"N": D, "K": inter * cfg.n_shared_experts}, _ATTN),
        # activation quant feeding each FP8 linear (item 1)
        OpShape("act_quant_hidden", "fp8_quant", {"K": D}, _ATTN, per_layer=2, replicated=True),
        # o-projection (item 3)
        OpShape("o_proj", "o_proj", {"H": h, "G": g, "head_dim": cfg.head_dim,
                                     "rope_dim": cfg.qk_rope_head_dim, "R": cfg.o_lora_rank,
                                     "K": cfg.heads_per_o_group * cfg.head_dim, "N": D}, _ATTN),
        # lightning indexer (items 4-5), C4A only, replicated
        OpShape("mqa_logits", "indexer", {"H": cfg.index_n_heads, "D": cfg.index_head_dim,
                                          "ratio": 4}, (LayerKind.C4A,), replicated=True),
        OpShape("topk_indices", "topk", {"k": cfg.index_topk}, (LayerKind.C4A,), replicated=True),
        # sparse MLA (items 6-7)
        OpShape("sparse_mla", "sparse_mla", {"H": h, "D": cfg.head_dim, "window": cfg.sliding_window,
                                             "topk": cfg.index_topk}, _ATTN),
        # mHC (item 8): two sublayers (attention, MoE) per layer
        OpShape("hc_prenorm_gemm", "mhc", {"K": cfg.hc_mult * D, "N": cfg.hc_mix_dim,
                                           "hc": cfg.hc_mult, "D": D}, _ATTN, per_layer=2,
                replicated=True),
        # routed MoE (item 9)
        OpShape("moe_w13", "moe", {"E": cfg.n_routed_experts, "N": 2 * inter, "K": D,
                                   "topk": cfg.num_experts_per_tok}, _ATTN),
        OpShape("moe_w2", "moe", {"E": cfg.n_routed_experts, "N": D, "K": inter,
                                  "topk": cfg.num_experts_per_tok}, _ATTN),
        # cache writers (item 10)
        OpShape("kv_cache_insert", "cache", {"D": cfg.kv_latent_dim}, _ATTN, replicated=True),
        OpShape("indexer_k_insert", "cache", {"D": cfg.index_head_dim}, (LayerKind.C4A,),
                replicated=True),
    ]
    return {o.name: o for o in ops}


def calls_per_step(cfg: ModelConfig, op: OpShape) -> int:
    """How many times one forward step over all layers (main + MTP) calls ``op``."""
    counts = layer_counts(cfg)
    return sum(counts[k] for k in op.layers) * op.per_layer


def gemm_shapes(cfg: ModelConfig = DEFAULT_CONFIG, tp: int = 1) -> dict[str, tuple[int, int]]:
    """``{name: (N, K)}`` of the dense FP8 linears at one rank."""
    return {n: (o.dims["N"], o.dims["K"]) for n, o in op_shapes(cfg, tp).items() if o.family == "fp8_gemm"}


def describe(cfg: ModelConfig = DEFAULT_CONFIG, tps: Iterable[int] = SUPPORTED_TP) -> list[dict]:
    """Rows ``{op, tp, family, dims...}`` for tables."""
    rows = []
    for tp in tps:
        for o in op_shapes(cfg, tp).values():
            rows.append({"op": o.name, "tp": tp, "family": o.family, **o.dims,
                         "calls_per_step": calls_per_step(cfg, o), "replicated": o.replicated})
    return rows
