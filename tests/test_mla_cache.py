"""fp8_ds_mla writer: byte layout, byte-exact vs the reference, round trip across block boundaries,
untouched bytes, errors. (The registry sweep covers the adversarial input cases.)"""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.specs.mla_cache import block_bytes
from ds4lab.reference import mla_cache as ref
from ds4lab_kernels import mla_cache as k
from ds4lab_kernels.mla_cache import fp8_ds_mla_insert

pytestmark = pytest.mark.interp


def test_layout_constants_and_page_sizes():
    assert (k.NOPE_DIM, k.ROPE_DIM, k.ENTRY_BYTES, k.SCALE_BYTES, k.N_TILES) == (448, 64, 576, 8, 7)
    # SPEC.md §3 page bytes: 64-entry block 37,440 B, 2-entry block 1,728 B (padded to 576)
    assert block_bytes(64) == 37_440 and block_bytes(2) == 1_728


@pytest.mark.parametrize("bs", [64, 2])
def test_round_trip_across_block_boundaries(bs):
    nb = 3
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, (1,)).item())
    slots = torch.tensor([0, bs - 1, bs, 2 * bs - 1, 2 * bs, nb * bs - 1], dtype=torch.int32)
    kv = (torch.randn(len(slots), 512, generator=g) * 3).bfloat16()
    cache = torch.randint(0, 256, (nb, block_bytes(bs)), generator=g, dtype=torch.uint8)
    before = cache.clone()
    out = fp8_ds_mla_insert(kv.to(DEVICE), slots.to(DEVICE), cache.to(DEVICE), bs).cpu()
    assert torch.equal(out, ref.fp8_ds_mla_insert(kv, slots, before, bs))
    touched = ref.written_mask(before, slots, bs)
    assert torch.equal(out[~touched], before[~touched])       # random prior content kept
    back = ref.dequant_slots(out, slots, bs)
    x = kv.double()
    # RoPE dims are stored verbatim; NoPE within half an e4m3 step of the tile scale
    assert torch.equal(back[:, 448:], x[:, 448:])
    err = (back[:, :448] - x[:, :448]).abs().reshape(-1, 7, 64).amax(-1)
    amax = x[:, :448].abs().reshape(-1, 7, 64).amax(-1)
    assert torch.all(err <= amax / 16 + 1e-12)


def test_explicit_byte_offsets():
    bs, slot = 64, 64 + 5                    # block 1, entry 5
    kv = torch.zeros(1, 512, dtype=torch.bfloat16)
    kv[0, 0] = 448.0                         # tile 0: amax 448 -> scale 1 (byte 127), q = 448 (0x7E)
    kv[0, 64] = 2.0 ** -10                   # tile 1: scale ceil_pow2(2^-10/448) = 2^-18 (byte 109)
    kv[0, 448] = 1.5                         # first RoPE dim (bf16 0x3FC0)
    cache = torch.zeros(2, block_bytes(bs), dtype=torch.uint8)
    out = fp8_ds_mla_insert(kv.to(DEVICE), torch.tensor([slot], dtype=torch.int32).to(DEVICE),
                            cache.to(DEVICE), bs).cpu()
    e = 5 * 576
    assert out[1, e] == 0x7E
    assert out[1, e + 448] == 0xC0 and out[1, e + 449] == 0x3F
    sc = 64 * 576 + 5 * 8
    assert out[1, sc].item() == 127 and out[1, sc + 1].item() == 109
    assert out[1, sc + 2].item() == 105      # zero tile: amax floor 1e-4 -> 2^-22
    assert out[1, sc + 7].item() == 0        # pad byte
    assert out[0].sum() == 0                 # block 0 untouched


def test_3d_strided_view_and_padded_stride(device):
    # vLLM view: (num_blocks, 64, 584) over blocks padded to 37,440 B
    bs, nb = 64, 2
    raw = torch.zeros(nb, block_bytes(bs), dtype=torch.uint8, device=device)
    view3 = torch.as_strided(raw, (nb, bs, 584), (block_bytes(bs), 584, 1))
    kv = torch.randn(3, 512).bfloat16()
    slots = torch.tensor([1, 64, 127], dtype=torch.int32)
    fp8_ds_mla_insert(kv.to(device), slots.to(device), view3, bs)   # writes through the view into raw
    assert torch.equal(raw.cpu(), ref.fp8_ds_mla_insert(kv, slots, torch.zeros_like(raw.cpu()), bs))


def test_skip_and_short_slot_mapping():
    kv = torch.randn(4, 512).bfloat16()
    cache = torch.full((2, block_bytes(2)), 7, dtype=torch.uint8)
    slots = torch.tensor([-1, 3, 99], dtype=torch.int64)     # DP padding: 3 slots for 4 rows
    out = fp8_ds_mla_insert(kv.to(DEVICE), slots.to(DEVICE), cache.clone().to(DEVICE), 2).cpu()
    assert torch.equal(out, ref.fp8_ds_mla_insert(kv, slots, cache, 2))


@pytest.mark.parametrize("kw,exc,match", [
    ({"kv": torch.zeros(2, 512)}, TypeError, "kv"),
    ({"kv": torch.zeros(2, 448, dtype=torch.bfloat16)}, ValueError, "kv"),
    ({"slot_mapping": torch.zeros(2)}, TypeError, "slot_mapping"),
    ({"slot_mapping": torch.zeros(3, dtype=torch.int32)}, ValueError, "slot_mapping"),
    ({"kv_cache": torch.zeros(2, block_bytes(64), dtype=torch.int8)}, TypeError, "kv_cache"),
    ({"kv_cache": torch.zeros(2, 64 * 584 - 2, dtype=torch.uint8)}, ValueError, "kv_cache"),
    ({"kv_cache": torch.zeros(block_bytes(64), 2, dtype=torch.uint8).t()}, ValueError, "contiguous"),
    ({"block_size": 0}, ValueError, "block_size"),
])
def test_bad_inputs_raise(kw, exc, match):
    args = {"kv": torch.zeros(2, 512, dtype=torch.bfloat16), "slot_mapping": torch.zeros(2, dtype=torch.int32),
            "kv_cache": torch.zeros(2, block_bytes(64), dtype=torch.uint8), "block_size": 64}
    args.update(kw)
    with pytest.raises(exc, match=match):
        fp8_ds_mla_insert(**args)
