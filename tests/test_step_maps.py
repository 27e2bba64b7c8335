"""The step's index maps in one launch (``ds4lab_kernels.step_maps``): bit-identical to the torch
reference (same nested keys, dtypes, shapes) at the real geometry's cache sizes and at small ones,
positions 0 / 1 / ratio boundaries / inside the first window / far past every ring, several requests,
MTP rows, batch 16; key structures the kernel does not cover keep the torch path in the model's
kernel backend; argument errors; one launch per step. (The registry sweep covers the spec's cases.)"""
import pytest
import torch

from conftest import DEVICE, op_kinds
from ds4lab.geometry import DEFAULT_CONFIG
from ds4lab.harness.specs.step_maps import check, make_inputs, shape_for
from ds4lab.model.cache import map_sizes, new_caches
from ds4lab.reference.step_maps import step_index_maps as ref_maps
from ds4lab_kernels import step_maps as k

pytestmark = pytest.mark.interp

W = DEFAULT_CONFIG.sliding_window


def _assert_same(out, ref, path=""):
    """Nested dicts with the same keys in the same order; leaves equal in dtype, shape and value."""
    assert list(out) == list(ref), (path, list(out), list(ref))
    for key in ref:
        o, r = out[key], ref[key]
        if isinstance(r, dict):
            _assert_same(o, r, f"{path}/{key}")
            continue
        assert o.dtype == r.dtype and o.shape == r.shape and o.is_contiguous(), (path, key, o.dtype, r.dtype)
        assert torch.equal(o.cpu(), r.cpu()), (path, key, o, r)


def _run(pos, req, swa_ring, layers, window=W):
    pos = torch.as_tensor(pos, dtype=torch.int64).to(DEVICE)
    req = torch.as_tensor(req, dtype=torch.int64).to(DEVICE)
    out = k.step_index_maps(pos, req, window, swa_ring, layers)
    ref = ref_maps(pos, req, window, swa_ring, layers)
    _assert_same(out, ref)
    return out


@pytest.mark.parametrize("ctx", [8192, 32768])
@pytest.mark.parametrize("pos,req", [
    ([0], [0]),                                            # first token
    ([1], [0]),
    ([3, 127, 255, 511], [0, 1, 2, 3]),                    # (pos+1) % 4 == 0, % 128 == 0 (C4 + C128 writes)
    ([126, 127, 127, 128], [0, 0, 1, 1]),                  # MTP rows (2 per request) across a C128 boundary
    ([2, 3, 6, 7], [0, 0, 1, 1]),                          # MTP rows inside the C4 overlap window, < window
    ([10 ** 6, 10 ** 6 + 1, 2 ** 40 + 3, 2 ** 40 + 4], [1, 1, 0, 0]),   # far past every ring
])
def test_real_geometry_sizes_equal_the_reference(ctx, pos, req):
    swa_ring, layers = map_sizes(DEFAULT_CONFIG, ctx + 8)
    out = _run(pos, req, swa_ring, layers)
    assert list(out["win"]) == [(4, 264), (128, 384)] and list(out["comp"]) == [(4, layers[2][1]), (128, layers[3][1])]


def test_batch16_mtp_decode_step_at_8k():
    """The batch-16 MTP step's positions (ctx + 0/1 per request, requests 0..15), at the step's sizes."""
    swa_ring, layers = map_sizes(DEFAULT_CONFIG, 8192 + 8)
    pos = (8192 - torch.arange(16) * 37)[:, None] + torch.arange(2)[None, :]
    req = torch.arange(16)[:, None].expand(16, 2)
    _run(pos.reshape(-1), req.reshape(-1), swa_ring, layers)


def test_distinct_indexer_ring_non_pow2_window_and_long_slot_list():
    """A structure whose indexer ring (36) differs from the C4 ring (40): three ring entries (new_caches
    makes them equal: one shared entry); window 100 (masked tail); C128 slot list 1,100 > CHUNK."""
    layers = ((0, 0, 0, 0), (4, 256, 40, 36), (128, 1100, 256, 0), (4, 256, 40, 36), (128, 1100, 256, 0))
    pos = [0, 1, 99, 100, 3, 511, 140_000, 7]
    out = _run(pos, [0, 1, 2, 3, 4, 5, 6, 7], 192, layers, window=100)
    assert list(out["win"]) == [(4, 40), (4, 36), (128, 256)]
    out = _run(pos, [3] * 8, 192, layers[:2], window=100)     # no C128 layer: no C128 maps
    assert list(out["comp"]) == [(4, 256)]


def test_swa_only_and_c128_first_layer_orders():
    _run([0, 5, 300], [0, 1, 2], 384, ((0, 0, 0, 0),) * 3)                  # SWA-only model: no comp / win
    out = _run([0, 5, 300], [0, 1, 2], 384, ((128, 66, 384, 0), (4, 2112, 264, 264)))
    assert list(out["win"]) == [(128, 384), (4, 264)]                       # first-use order, as the reference


def test_tiny_caches_and_strided_positions():
    """new_caches' own sizes (tiny config) and positions / requests that are column views (any stride)."""
    from ds4lab.checkpoint.tiny import TINY_CONFIG
    C = new_caches(TINY_CONFIG, 3, 400, chunk=16)
    both = torch.tensor([[0, 0], [255, 0], [256, 1], [127, 1], [128, 2], [11, 2]]).to(DEVICE)
    pos, req = both[:, 0], both[:, 1]
    assert pos.stride(0) == 2
    out = k.step_index_maps(pos, req, TINY_CONFIG.sliding_window, C.swa_ring, C.map_sizes())
    _assert_same(out, ref_maps(pos.contiguous(), req.contiguous(), TINY_CONFIG.sliding_window, C.swa_ring,
                               C.map_sizes()))


def test_zero_tokens_launch_nothing():
    swa_ring, layers = map_sizes(DEFAULT_CONFIG, 8200)
    e = torch.empty(0, dtype=torch.int64, device=DEVICE)
    _assert_same(k.step_index_maps(e, e, W, swa_ring, layers), ref_maps(e, e, W, swa_ring, layers))


def test_check_catches_a_broken_map():
    """A deliberately broken output fails the spec's check: one value, a dtype, a missing key."""
    s = shape_for(DEFAULT_CONFIG, 2, 2, 8192)
    inp = make_inputs(s, "ratio_edges", 0, DEVICE)
    ref = ref_maps(**inp)
    assert all(check(k.step_index_maps(**inp), ref, inp))
    out = k.step_index_maps(**inp)
    out["comp"][(128, s["n_comp128"])]["slots"][1, 5] += 1
    assert not all(check(out, ref, inp))
    out = k.step_index_maps(**inp)
    out["swa_slots"] = out["swa_slots"].to(torch.int32)
    assert not all(check(out, ref, inp))
    out = k.step_index_maps(**inp)
    del out["win"][(4, s["ring4"])]
    assert not all(check(out, ref, inp))


def test_uncovered_structures_raise_and_covers_says_so():
    p = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    two_sizes = ((4, 64, 24, 24), (4, 128, 24, 24))              # two n_comp for ratio 4
    other_ratio = ((8, 64, 24, 0),)
    for layers in (two_sizes, other_ratio, ((128, 2, 144, 0), (128, 2, 256, 0))):
        assert not k.covers(layers)
        with pytest.raises(ValueError, match="layers: key structure not covered"):
            k.step_index_maps(p, p, W, 384, layers)
    assert k.covers(map_sizes(DEFAULT_CONFIG, 8200)[1]) and k.covers(())


@pytest.mark.parametrize("bad,err,match", [
    (dict(positions=torch.zeros(2, dtype=torch.int32)), TypeError, "positions: dtype int32"),
    (dict(req=torch.zeros(3, dtype=torch.int64)), ValueError, "req: expected shape"),
    (dict(positions=torch.zeros(2, 1, dtype=torch.int64)), ValueError, "positions: expected 1 dims"),
    (dict(req=[0, 0]), TypeError, "req: expected a torch.Tensor"),
    (dict(window=0), ValueError, "window=0"),
    (dict(swa_ring=2.5), ValueError, "swa_ring=2.5"),
    (dict(layers=((4, 0, 24, 24),)), ValueError, r"layers\[0\]"),
    (dict(layers=((4, 64, 24),)), ValueError, r"layers\[0\]"),
    (dict(layers=5), TypeError, "layers: expected a sequence"),
])
def test_argument_errors_name_the_argument(bad, err, match):
    args = dict(positions=torch.zeros(2, dtype=torch.int64), req=torch.zeros(2, dtype=torch.int64), window=W,
                swa_ring=384, layers=((4, 64, 24, 24),))
    args.update(bad)
    with pytest.raises(err, match=match):
        k.step_index_maps(**args)


def test_kernel_backend_one_launch_and_torch_fallback():
    """The model's kernel backend: one Triton launch in ``step.maps`` (kind ``kernel:step_maps...``) for
    the caches new_caches makes; a structure the kernel does not cover runs the torch reference there
    (kind ``torch:index_maps``) with the same maps."""
    from ds4lab.model.backend_kernel import KernelBackend
    from ds4lab.model.launches import count_launches

    ops = KernelBackend()
    pos = torch.tensor([8191, 8192], device=DEVICE)
    req = torch.tensor([0, 0], device=DEVICE)
    swa_ring, layers = map_sizes(DEFAULT_CONFIG, 8200)
    maps, n = count_launches(ops.index_maps, pos, req, W, swa_ring, layers)
    assert dict(n) == {"step.maps": 1}
    _assert_same(maps, ref_maps(pos, req, W, swa_ring, layers))
    odd = layers + ((4, 64, 264, 264),)                            # a second C4 size: not covered
    (maps, maps_odd), kinds = op_kinds(lambda: (ops.index_maps(pos, req, W, swa_ring, layers),
                                                 ops.index_maps(pos, req, W, swa_ring, odd)))
    assert kinds == [("step.maps", "kernel:step_maps.step_index_maps"), ("step.maps", "torch:index_maps")]
    _assert_same(maps_odd, ref_maps(pos, req, W, swa_ring, odd))
    assert (4, 64) in maps_odd["comp"]
