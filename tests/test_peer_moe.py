"""The vLLM W4A16 MoE peer (ds4lab.harness.peer_moe): moe_align_block_size semantics in torch,
vLLM's config choice, the zero-copy weight view, and the peer's numerics against ds4lab's float64
reference (interpreter; the peer's kernel loaded from the installed vLLM)."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness import peer_moe as PM
from ds4lab.harness.specs.moe import make_moe_inputs
from ds4lab.reference import moe as R

pytestmark = pytest.mark.interp


def test_align_block_size_matches_vllm_docstring_example():
    # vllm/model_executor/layers/fused_moe/moe_align_block_size.py docstring (experts 1..4 used)
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    sorted_ids, expert_ids, ntpp = PM.align_block_size(ids, 4, 5)
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert (sorted_ids[16:] == 12).all() and len(sorted_ids) == 12 + 5 * 3
    assert expert_ids[:4].tolist() == [1, 2, 3, 4] and (expert_ids[4:] == -1).all()
    assert ntpp.tolist() == [16]


def test_align_block_size_invalid_ids_ragged_and_decode_sizes():
    ids = torch.tensor([[0, -1], [0, 7], [0, 2]], dtype=torch.int32)   # -1 and 7 (= E) ignored
    s, e, n = PM.align_block_size(ids, 2, 7)
    assert n.tolist() == [6]                                         # expert 0: 3 -> 4, expert 2: 1 -> 2
    assert s[:6].tolist() == [0, 2, 4, 6, 5, 6] and e[:3].tolist() == [0, 0, 2]
    # T*topk < E: vLLM caps the padded length at T*topk*BLOCK_SIZE_M
    s, e, n = PM.align_block_size(torch.arange(6, dtype=torch.int32).view(1, 6), 16, 256)
    assert len(s) == 96 and n.tolist() == [96] and e.tolist() == [0, 1, 2, 3, 4, 5]


def test_vllm_config_and_sweep():
    assert PM.vllm_config(1, 6) == {"BLOCK_SIZE_M": 16, "GROUP_SIZE_M": 1, "SPLIT_K": 1,
                                    "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64}
    assert PM.vllm_config(16, 6)["BLOCK_SIZE_N"] == 64 and PM.vllm_config(16, 6)["BLOCK_SIZE_K"] == 32
    assert PM.vllm_config(32, 6)["BLOCK_SIZE_M"] == 32 and PM.vllm_config(64, 6)["BLOCK_SIZE_M"] == 64
    sw = PM.sweep_for(4, 6)
    assert list(sw)[0] == "vllm" and len(sw) == 1 + len(PM.SWEEP)


def test_peer_weight_view_is_the_peers_layout():
    q = torch.randint(-8, 8, (2, 3, 16), dtype=torch.int8)
    u8 = PM.peer_weights(R.pack_int4(q))
    k = torch.arange(16)
    nib = (u8[..., k // 2].to(torch.int32) >> ((k % 2) * 4)) & 0xF     # the peer's b_shifter
    assert torch.equal((nib - 8).to(torch.int8), q)
    with pytest.raises(ValueError, match="packed"):
        PM.peer_weights(torch.zeros(2, 3, dtype=torch.int64))


def test_peer_matches_reference_within_its_bf16_budget():
    peer = pytest.importorskip("vllm") and PM.load_peer()
    inp = make_moe_inputs({"T": 3, "E": 8, "D": 256, "I": 128, "topk": 2}, "random", 5, DEVICE)
    ref = R.fused_moe_w4a16(**inp).double()
    for cfg in (None, {"GROUP_SIZE_M": 1, "SPLIT_K": 1, **PM.SWEEP["m16n64k128w4s3"]}):
        pm = PM.PeerMoE(peer, **inp, config=cfg)
        out = pm().double()
        rms = float((out - ref).square().mean().sqrt() / ref.square().mean().sqrt())
        assert rms < 2e-2, rms              # bf16 weights after scaling, bf16 intermediates
        assert rms > 0                      # it is the peer's own rounding, not ours
        c3 = pm.gemms().double().view(3, 2, -1).sum(1)
        assert float((c3 - ref).abs().max()) < 0.1 * float(ref.abs().max())
