"""The tiny DeepSeek-V4 checkpoint (ds4lab.checkpoint.tiny) and the vLLM plugin's pure parts: fast, no server."""
import hashlib
import json
import re

import pytest
import torch

from ds4lab.checkpoint import tiny
from ds4lab.geometry import LayerKind, layer_kinds, load_config

CFG = tiny.TINY_CONFIG


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def _tensors(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_config_is_deepseek_v4_with_every_layer_kind(ckpt):
    d = json.loads((ckpt / "config.json").read_text())
    assert d["model_type"] == "deepseek_v4" and d["architectures"] == ["DeepseekV4ForCausalLM"]
    assert "quantization_config" not in d  # bf16: the no-AMX CPU path
    cfg = load_config(ckpt)
    kinds = layer_kinds(cfg)
    assert {LayerKind.SWA, LayerKind.C4A, LayerKind.C128A, LayerKind.MTP} <= set(kinds)
    assert kinds[-1] == LayerKind.MTP and cfg.num_nextn_predict_layers == 1
    assert 0 < cfg.num_hash_layers < cfg.num_hidden_layers  # hash- and bias-routed layers
    # SPEC.md §6 CPU kernel constraints
    assert (cfg.head_dim, cfg.qk_rope_head_dim, cfg.index_head_dim, cfg.index_topk) == (512, 64, 128, 512)
    assert cfg.n_routed_experts in (64, 128, 256, 384) and 6 <= cfg.num_experts_per_tok <= 8
    assert cfg.hc_mult == 4


# Name templates of the official DeepSeek-V4-Flash index ({i} = layer, {e} = expert).
_BLOCK = ["hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
          "attn_norm.weight", "ffn_norm.weight", "attn.attn_sink", "attn.wq_a.weight",
          "attn.q_norm.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.kv_norm.weight",
          "attn.wo_a.weight", "attn.wo_b.weight", "ffn.gate.weight",
          "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
          "ffn.shared_experts.w3.weight"]
_COMP = ["attn.compressor.ape", "attn.compressor.wkv.weight", "attn.compressor.wgate.weight",
         "attn.compressor.norm.weight"]
_INDEXER = ["attn.indexer.wq_b.weight", "attn.indexer.weights_proj.weight",
            "attn.indexer.compressor.ape", "attn.indexer.compressor.wkv.weight",
            "attn.indexer.compressor.wgate.weight", "attn.indexer.compressor.norm.weight"]


def test_tensor_names_follow_the_real_checkpoint(ckpt):
    names = set(_tensors(ckpt))
    want = {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}
    kinds = layer_kinds(CFG)
    for i in range(CFG.num_layers_with_mtp):
        p = f"layers.{i}." if i < CFG.num_hidden_layers else f"mtp.{i - CFG.num_hidden_layers}."
        want |= {p + n for n in _BLOCK}
        want |= {f"{p}ffn.experts.{e}.w{k}.weight" for e in range(CFG.n_routed_experts) for k in (1, 2, 3)}
        want.add(p + ("ffn.gate.tid2eid" if i < CFG.num_hash_layers else "ffn.gate.bias"))
        if kinds[i] in (LayerKind.C4A, LayerKind.C128A):
            want |= {p + n for n in _COMP}
        if kinds[i] == LayerKind.C4A:
            want |= {p + n for n in _INDEXER}
    want |= {f"mtp.0.{n}" for n in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight",
                                      "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")}
    assert names == want
    assert not any(n.endswith(".scale") for n in names)  # bf16 linears carry no FP8 scales


def test_dtypes_and_shapes_match_the_real_checkpoint(ckpt):
    t = _tensors(ckpt)
    for name, x in t.items():
        if name.endswith("tid2eid"):
            assert x.dtype == torch.int64
        elif re.search(r"(hc_\w+_(fn|base|scale)|attn_sink|\.ape|gate\.bias)$", name):
            assert x.dtype == torch.float32, name
        else:
            assert x.dtype == torch.bfloat16, name
        assert tuple(x.shape) == tiny.tensor_specs()[name][0]
    D, hc = CFG.hidden_size, CFG.hc_mult
    assert t["layers.0.hc_attn_fn"].shape == (CFG.hc_mix_dim, hc * D)
    assert t["layers.2.attn.compressor.ape"].shape == (4, 2 * CFG.head_dim)        # C4A: overlap
    assert t["layers.3.attn.compressor.ape"].shape == (128, CFG.head_dim)          # C128A
    assert t["layers.2.attn.indexer.compressor.ape"].shape == (4, 2 * CFG.index_head_dim)
    assert t["layers.0.ffn.gate.tid2eid"].shape == (CFG.vocab_size, CFG.num_experts_per_tok)
    rows = t["layers.0.ffn.gate.tid2eid"]
    assert int(rows.max()) < CFG.n_routed_experts
    assert all(len(set(r.tolist())) == CFG.num_experts_per_tok for r in rows[:32])


def test_names_map_onto_vllm_loader_namespaces():
    """vLLM 0.32's CPU mapper sends every main-model name under model./lm_head and drops mtp.*;
    the ds4lab CPU MTP loader recognises every mtp.* name as spec layer num_hidden_layers."""
    from vllm.models.deepseek_v4.cpu.model import _make_deepseek_v4_weights_mapper
    from vllm.model_executor.models.deepseek_v2 import get_spec_layer_idx_from_weight_name

    names = list(tiny.tensor_specs())
    mapper = _make_deepseek_v4_weights_mapper(CFG.expert_dtype)
    main = [n for n in names if not n.startswith("mtp.")]
    for n in main:
        m = mapper._map_name(n)
        assert m is not None and (m.startswith("model.") or m == "lm_head.weight"), (n, m)
    assert mapper._map_name("embed.weight") == "model.embed_tokens.weight"
    assert mapper._map_name("layers.3.ffn.gate.bias") == "model.layers.3.ffn.gate.e_score_correction_bias"
    assert all(mapper._map_name(n) is None for n in names if n.startswith("mtp."))

    class _Cfg:
        num_hidden_layers = CFG.num_hidden_layers
        num_nextn_predict_layers = CFG.num_nextn_predict_layers

    for n in names:
        if n.startswith("mtp."):
            spec = n.replace("mtp.0.", f"model.layers.{CFG.num_hidden_layers}.", 1)
            assert get_spec_layer_idx_from_weight_name(_Cfg, spec) == CFG.num_hidden_layers


def test_deterministic_from_seed(tmp_path):
    def digest(p):
        return hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()

    a = tiny.write_tiny_checkpoint(tmp_path / "a", seed=3)
    b = tiny.write_tiny_checkpoint(tmp_path / "b", seed=3)
    c = tiny.write_tiny_checkpoint(tmp_path / "c", seed=4)
    assert digest(a) == digest(b) != digest(c)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes()


def test_agree_heads_main_and_mtp_predict_the_same_successor():
    sd = tiny.build_state_dict(agree_heads=True)
    emb, head = sd["embed.weight"].float(), sd["head.weight"].float()
    succ = tiny._successor_table(CFG)
    # main head on the (normalised) embedding of t picks succ[t] for every byte token
    x = emb / emb.norm(dim=-1, keepdim=True)
    pred = (x @ head.T).argmax(-1)
    byte_ids = torch.arange(tiny.BYTE_OFFSET, tiny.BYTE_OFFSET + 256)
    assert torch.equal(pred[byte_ids], torch.tensor(succ)[byte_ids])
    assert torch.equal(sd["mtp.0.e_proj.weight"].float(), torch.eye(CFG.hidden_size))


def test_tokenizer_is_offline_byte_level_with_dsv4_specials(ckpt):
    from transformers import AutoTokenizer
    from vllm.tokenizers.deepseek_v4_encoding import encode_messages

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1
    text = "héllo, wörld ✓"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text
    for i, s in enumerate(tiny.SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(s) == i
    prompt = encode_messages([{"role": "user", "content": "hi"}], thinking_mode="thinking")
    ids = tok.encode(prompt, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<｜User｜>") in ids and tok.convert_tokens_to_ids("<think>") in ids
    assert max(ids) < CFG.vocab_size


def test_cli_writes_checkpoint(tmp_path, capsys):
    from ds4lab.cli import main

    assert main(["tiny", "--out", str(tmp_path / "t"), "--agree-heads", "--seed", "1"]) == 0
    assert (tmp_path / "t" / "model.safetensors").exists()
    assert json.loads((tmp_path / "t" / "ds4lab_tiny.json").read_text())["agree_heads"] is True
    assert "agree_heads=True" in capsys.readouterr().out


def test_ensure_reuses_a_fresh_checkpoint(tmp_path):
    p = tiny.ensure_tiny_checkpoint(tmp_path / "e")
    m = (p / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_tiny_checkpoint(tmp_path / "e") == p
    assert (p / "model.safetensors").stat().st_mtime_ns == m


# ---- plugin pure parts -------------------------------------------------------------------------
def test_version_gate_refuses_unknown_vllm():
    from ds4lab.vllm_plugin.version_gate import UnsupportedVllmError, check_vllm_version

    assert check_vllm_version("0.32.0") == "0.32.0"
    assert check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"
    with pytest.raises(UnsupportedVllmError, match=r"'0\.33\.0'.*0\.32\.0"):
        check_vllm_version("0.33.0")


def test_plugin_disabled_by_env_is_a_no_op(monkeypatch):
    import ds4lab.vllm_plugin as plugin

    monkeypatch.setattr(plugin, "_INSTALLED", [])
    monkeypatch.setenv("DS4LAB_VLLM_PLUGIN", "0")
    plugin.register()
    assert plugin.installed_patches() == []


def test_torch_token_to_req_indices():
    from ds4lab.vllm_plugin.metadata_ops import compute_token_to_req_indices

    qsl = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    out = torch.full((8,), 9, dtype=torch.int32)
    r = compute_token_to_req_indices(qsl, out, 5, 7)
    assert r.tolist() == [0, 0, 2, 2, 2, 0, 0]


def test_torch_swa_indices_match_a_loop():
    from ds4lab.vllm_plugin.metadata_ops import ComputeSWAIndicesAndLens

    bs, W = 4, 3
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    seq = torch.tensor([6, 3], dtype=torch.int32)
    bt = torch.tensor([[5, 7], [2, 9]], dtype=torch.int32)
    t2r = torch.tensor([0, 1, 1, 1], dtype=torch.int32)
    valid = torch.tensor([True, True, False, True])
    idx = torch.zeros(4, 1, W, dtype=torch.int32)
    lens = torch.zeros(4, dtype=torch.int32)
    replay = torch.zeros(3, dtype=torch.int32)
    ComputeSWAIndicesAndLens()(idx, lens, W, W, lens, lens, qsl, seq, t2r, valid, bt, bs, replay,
                               num_tokens=4, token_offset=0)
    # token 0: req 0, pos 5 -> window 3..5 ; tokens 1,3: req 1 pos 0 and 2
    def slot(r, p):
        return int(bt[r, p // bs]) * bs + p % bs
    assert idx[0, 0].tolist() == [slot(0, 3), slot(0, 4), slot(0, 5)]
    assert idx[1, 0].tolist() == [slot(1, 0), -1, -1] and lens[1] == 1
    assert idx[2, 0].tolist() == [-1, -1, -1] and lens[2] == 0
    assert idx[3, 0].tolist() == [slot(1, 0), slot(1, 1), slot(1, 2)] and lens[3] == 3


def test_torch_compressed_slot_mapping():
    from ds4lab.vllm_plugin.metadata_ops import CompressedSlotMapping

    qsl = torch.tensor([0, 8], dtype=torch.int32)
    seq = torch.tensor([10], dtype=torch.int32)   # positions 2..9
    slots = torch.arange(8, dtype=torch.int64)
    slots[5] = -1                                  # replayed token (pos 7) -> PAD
    bt = torch.tensor([[3, 6]], dtype=torch.int32)
    out = torch.full((8,), -1, dtype=torch.int64)
    CompressedSlotMapping()(out, slots, qsl, seq, bt, 2, 4, 1, 1)
    # pos 3 -> state 0 -> block 3 (of 2 entries) offset 0 = slot 6; pos 7 is PAD; others PAD
    assert out.tolist() == [-1, 6, -1, -1, -1, -1, -1, -1]


def test_plugin_refuses_unknown_vllm_on_cpu(monkeypatch):
    import ds4lab.vllm_plugin as plugin
    from ds4lab.vllm_plugin import version_gate

    monkeypatch.setattr(plugin, "_INSTALLED", [])
    monkeypatch.delenv("DS4LAB_VLLM_PLUGIN", raising=False)
    monkeypatch.setattr(version_gate, "vllm_version", lambda: "0.99.0")
    with pytest.raises(plugin.UnsupportedVllmError, match="0.99.0"):
        plugin.register()
    assert plugin.installed_patches() == []


def test_plugin_is_a_no_op_off_cpu(monkeypatch):
    import ds4lab.vllm_plugin as plugin
    from vllm.platforms import current_platform

    monkeypatch.setattr(plugin, "_INSTALLED", [])
    monkeypatch.delenv("DS4LAB_VLLM_PLUGIN", raising=False)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False)
    plugin.register()
    assert plugin.installed_patches() == []
