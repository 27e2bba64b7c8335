"""Torch references added for issue 19: RoPE tables/rotation (ds4lab.reference.rope) and the KV
compressor (ds4lab.reference.compressor)."""
import pytest
import torch

from ds4lab.checkpoint import tiny
from ds4lab.reference import compressor as rc
from ds4lab.reference.rope import apply_rope, layer_cos_sin


@pytest.mark.parametrize("ratio", [0, 4])
def test_rope_table_matches_vllm_bit_for_bit(ratio):
    rot = pytest.importorskip("vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope")
    from vllm.config import VllmConfig, set_current_vllm_config
    cfg = tiny.TINY_CONFIG
    rs = cfg.extra["rope_scaling"]
    with set_current_vllm_config(VllmConfig()):
        emb = _vllm_rope(rot, cfg, rs, ratio)
    ours = layer_cos_sin(cfg, ratio, emb.cos_sin_cache.shape[0])
    assert torch.equal(ours, emb.cos_sin_cache.float())


def _vllm_rope(rot, cfg, rs, ratio):
    if ratio:
        emb = rot.DeepseekV4ScalingRotaryEmbedding(512, 64, rs["original_max_position_embeddings"],
                                                   cfg.compress_rope_theta, False, rs["factor"], torch.bfloat16,
                                                   beta_fast=32, beta_slow=1, mscale=0, mscale_all_dim=0)
    else:
        emb = rot.DeepseekV4ScalingRotaryEmbedding(512, 64, cfg.max_position_embeddings, cfg.rope_theta, False,
                                                   1.0, torch.bfloat16, beta_fast=32, beta_slow=1, mscale=0,
                                                   mscale_all_dim=0)
    return emb


def test_rope_inverse_undoes_forward_and_keeps_nope():
    cs = layer_cos_sin(tiny.TINY_CONFIG, 4, 4096)
    x = torch.randn(50, 3, 512, dtype=torch.float64)
    pos = torch.randint(0, 4096, (50,))
    y = apply_rope(x, pos, cs)
    assert torch.equal(y[..., :448], x[..., :448])
    assert not torch.allclose(y[..., 448:], x[..., 448:])
    assert torch.allclose(apply_rope(y, pos, cs, inverse=True), x, atol=1e-6)


def test_compressor_window_semantics():
    hd, r = 8, 4
    L = 16
    kv = torch.randn(L, 2 * hd)
    score = torch.zeros(L, 2 * hd)
    ape = torch.zeros(r, 2 * hd)
    pos = torch.arange(L)
    st = rc.state_rows(kv, score, ape, pos, r)
    win = rc.window_positions(pos[[7]], r, 2)                       # boundary at pos 7: 0..7
    c = rc.compress_window(st[win], win >= 0, hd, r, 2)[0]
    want = torch.cat([kv[0:4, :hd], kv[4:8, hd:]]).double().mean(0)  # older block: first half; current: second
    assert torch.allclose(c, want)
    win0 = rc.window_positions(pos[[3]], r, 2)                      # first boundary: negatives masked
    c0 = rc.compress_window(st[win0.clamp_min(0)], win0 >= 0, hd, r, 2)[0]
    assert torch.allclose(c0, kv[0:4, hd:].double().mean(0))
    score[5, hd + 2] = 50.0                                         # a dominant score picks its row
    st = rc.state_rows(kv, score, ape, pos, r)
    c = rc.compress_window(st[win], win >= 0, hd, r, 2)[0]
    assert torch.allclose(c[2], kv[5, hd + 2].double(), atol=1e-6)
    out = rc.compress(kv, score, ape, pos, torch.ones(hd), 1e-6, r, layer_cos_sin(tiny.TINY_CONFIG, 4, 64)[:, :8])
    assert out.shape == (L // r, hd) and out.dtype == torch.bfloat16
