"""The cache writes fused into their producers (issue 20: the decode step's insert launches):
``q_kv_rmsnorm_rope(kv_cache=...)`` and ``compress_decode(cache=...)`` leave, byte for byte, what the
unfused producer + its insert leaves (same kernel inputs), within the entry budget of the torch
references (the registry entries ``q_kv_rmsnorm_rope_insert`` / ``compress_decode_insert``), skip
exactly what the inserts skip, and name the argument they refuse. Slots must be distinct, as for the
inserts (a duplicate is the caller's error: which program's entry survives is unspecified)."""
import inspect
import re

import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.specs import cache_fused as spec
from ds4lab.harness.specs import compressor as comp_spec
from ds4lab.harness.specs import indexer as idx_spec
from ds4lab.harness.specs import mla_cache as mla_spec
from ds4lab.harness.specs import norm_rope as nr_spec
from ds4lab.reference.compressor import compress_decode_insert as ref_comp
from ds4lab.reference.norm_rope import q_kv_rmsnorm_rope_insert as ref_qkv
from ds4lab_kernels import compressor, indexer, mla_cache, norm_rope
from ds4lab_kernels.compressor import compress_decode
from ds4lab_kernels.indexer import indexer_k_cache_insert
from ds4lab_kernels.mla_cache import fp8_ds_mla_insert
from ds4lab_kernels.norm_rope import q_kv_rmsnorm_rope

pytestmark = pytest.mark.interp

DECODE_MAX_T = 64   # ds4lab.model.backend_kernel.DECODE_MAX_T: the decode bound of the fused compressor


def _clone_t(v):
    """A copy with ``v``'s strides and the bytes between its rows (a padded indexer K cache's gaps)."""
    if v.is_contiguous() or not v.numel():
        return v.clone()
    span = sum((n - 1) * st for n, st in zip(v.shape, v.stride())) + 1
    return torch.as_strided(torch.as_strided(v, (span,), (1,)).clone(), v.shape, v.stride())


def _clone(d):
    return {k: (_clone_t(v) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def _qkv_inputs(T, bs, nb, case, seed, gains=False):
    shape = {"T": T, "Dq": 128, "Dkv": 512, "block_size": bs, "num_blocks": nb}
    d = spec.make_qkv_inputs(shape, case, seed, DEVICE)
    if gains:   # per-tile kv_norm gains 1e-30 .. 1e30: tile amax from far below the 1e-4 floor to 1e31
        w = torch.ones(512)
        w[:448] = (10.0 ** torch.linspace(-30, 30, 7)).repeat_interleave(64)
        d["kv_weight"] = w.to(torch.bfloat16).to(DEVICE)
    return d


def _unfused_qkv(d):
    a = {k: v for k, v in d.items() if k not in ("kv_cache", "slot_mapping", "block_size")}
    q, kv = q_kv_rmsnorm_rope(**a)
    c = fp8_ds_mla_insert(kv, d["slot_mapping"], d["kv_cache"].clone(), d["block_size"])
    return q, c


@pytest.mark.parametrize("T,bs,nb", [(1, 64, 1), (5, 64, 2), (7, 2, 6), (DECODE_MAX_T, 64, 2)])
@pytest.mark.parametrize("case", spec.QKV_CASES + ("gains",))
def test_q_kv_fused_equals_unfused_insert_bytes(T, bs, nb, case):
    d = _qkv_inputs(T, bs, nb, "random" if case == "gains" else case, 11 + T, gains=case == "gains")
    q0, c0 = _unfused_qkv(d)
    f = _clone(d)
    q1 = q_kv_rmsnorm_rope(**f)
    assert torch.equal(q1, q0)
    assert torch.equal(f["kv_cache"], c0)
    written = c0.cpu() != mla_spec.POISON
    assert written.any() or (d["slot_mapping"] < 0).all()
    # and within the entry budget of the torch reference (the registry check)
    reps = spec.check_qkv(q1, ref_qkv(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}),
                          f)
    assert all(reps), [r.summary() for r in reps if not r]


def test_q_kv_fused_skips_what_the_insert_skips():
    d = _qkv_inputs(6, 64, 2, "random", 3)
    d["slot_mapping"] = torch.tensor([-1, 0, 127, 128, 10_000, -5], dtype=torch.int64).to(DEVICE)
    _, c0 = _unfused_qkv(d)
    f = _clone(d)
    q_kv_rmsnorm_rope(**f)
    assert torch.equal(f["kv_cache"], c0)
    from ds4lab.reference.mla_cache import written_mask
    wm = written_mask(f["kv_cache"].cpu(), torch.tensor([0, 127]), 64)     # slots 0 and 127 only
    changed = f["kv_cache"].cpu() != mla_spec.POISON
    assert not (changed & ~wm).any() and changed[wm].float().mean() > 0.9


def _comp_inputs(T, ratio, hd, case, seed, nb=None):
    shape = {"T": T, "ratio": ratio, "hd": hd, "num_blocks": nb or max(2, T)}
    return spec.make_comp_inputs(shape, case, seed, DEVICE)


def _unfused_comp(d):
    a = {k: v for k, v in d.items() if k not in ("cache", "cache_slots", "block_size")}
    e = compress_decode(**a)
    slots = torch.where((d["positions"] + 1) % d["ratio"] == 0, d["cache_slots"], -1)
    c = _clone_t(d["cache"])
    if e.shape[1] == 512:
        return a["state"], fp8_ds_mla_insert(e, slots, c, d["block_size"])
    return a["state"], indexer_k_cache_insert(e, c, slots)


def _bytes(c):
    return torch.as_strided(c, ((c.shape[0] - 1) * c.stride(0) + c[0].numel(),), (1,)).cpu() if c.dim() == 3 \
        else c.cpu()


@pytest.mark.parametrize("ratio,hd", [(4, 512), (128, 512), (4, 128), (128, 128)])
@pytest.mark.parametrize("T", [1, 3, DECODE_MAX_T])
@pytest.mark.parametrize("case", spec.COMP_CASES)
def test_compress_fused_equals_unfused_insert_bytes(ratio, hd, T, case):
    if T == DECODE_MAX_T and case not in ("random", "skip_slots"):
        pytest.skip("the decode bound on the realistic cases (the interpreter's time)")
    d = _comp_inputs(T, ratio, hd, case, 5 + T)
    st0, c0 = _unfused_comp(_clone(d))
    f = _clone(d)
    out = compress_decode(**f)
    assert out is f["cache"]
    assert torch.equal(f["state"], st0)
    assert torch.equal(_bytes(f["cache"]), _bytes(c0))
    r = ref_comp(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in _clone(d).items()})
    reps = spec.check_comp(out, r, f)
    assert all(reps), [x.summary() for x in reps if not x]


def test_compress_fused_never_writes_off_a_boundary():
    """A valid slot on a row off a ratio boundary: the insert of the unfused path would write that row's
    zeros (the model passes -1 there); the fused launch writes only boundary rows."""
    d = _comp_inputs(4, 4, 512, "non_boundary", 9)
    off = (d["positions"].cpu() + 1) % 4 != 0
    assert off.any() and (d["cache_slots"].cpu()[off] >= 0).all()
    f = _clone(d)
    compress_decode(**f)
    s = torch.where(off, -1, d["cache_slots"].cpu())
    from ds4lab.reference.mla_cache import written_mask
    wm = written_mask(f["cache"].cpu(), s, 64)
    changed = f["cache"].cpu() != mla_spec.POISON
    assert not (changed & ~wm).any() and changed[wm].float().mean() > 0.9


def test_extreme_norm_gains_keep_fp8_scales_bit_identical():
    """compress_decode with per-tile norm gains 1e-30 .. 1e30 (entries from below the amax floor to
    1e31): the fused entry's scale bytes and values are the insert's."""
    for hd, ratio in ((512, 4), (128, 128)):
        d = _comp_inputs(3, ratio, hd, "random", 21)
        g = (10.0 ** torch.linspace(-30, 30, hd // 64)).repeat_interleave(64)
        d["norm_weight"] = (d["norm_weight"].cpu() * g).to(DEVICE)
        _, c0 = _unfused_comp(_clone(d))
        f = _clone(d)
        compress_decode(**f)
        assert torch.equal(_bytes(f["cache"]), _bytes(c0)), hd


def test_broken_entries_fail_the_registry_checks():
    d = _qkv_inputs(5, 64, 2, "random", 1)
    f = _clone(d)
    q = q_kv_rmsnorm_rope(**f)
    r = ref_qkv(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in d.items()})
    assert all(spec.check_qkv(q, r, f))
    s0 = int(d["slot_mapping"][0])
    for broken in ("value", "scale", "stray"):
        g = _clone(f)
        c = g["kv_cache"].view(g["kv_cache"].shape[0], -1)
        blk, pos = divmod(s0, 64)
        if broken == "value":
            c[blk, pos * 576:pos * 576 + 64] ^= 0x80     # the signs of one NoPE tile
        elif broken == "scale":
            c[blk, 64 * 576 + pos * 8 + 1] += 1      # one tile's UE8M0 byte
        else:
            c[blk, (pos + 1) % 64 * 576 + 7] = 0      # a byte of an entry nobody wrote
        if broken == "stray" and int((pos + 1) % 64 + blk * 64) in d["slot_mapping"].tolist():
            continue
        assert not all(spec.check_qkv(q, r, g)), broken
    dc = _comp_inputs(3, 4, 128, "random", 2)
    fc = _clone(dc)
    out = compress_decode(**fc)
    rc = ref_comp(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in dc.items()})
    assert all(spec.check_comp(out, rc, fc))
    from ds4lab.reference.indexer import entry_offsets
    vo, so = entry_offsets(int(dc["cache_slots"][0]), fc["cache"].stride(0), 64, 128)
    flat = torch.as_strided(fc["cache"], ((fc["cache"].shape[0] - 1) * fc["cache"].stride(0) + 64 * 132,), (1,))
    flat[vo:vo + 128] ^= 0x80                    # the signs of one key
    assert not all(spec.check_comp(out, rc, fc))
    flat[vo:vo + 128] ^= 0x80
    flat[so + 2] ^= 0x80                         # its fp32 scale's lowest exponent bit (x2 or /2)
    assert not all(spec.check_comp(out, rc, fc))


def test_one_pack_helper_per_layout():
    """The quantize-and-pack math of each layout lives in one @triton.jit helper that the insert and
    the fused producers call (no copy in the producers' modules)."""
    for mod, kern in ((mla_cache, "_fp8_ds_mla_insert_kernel"), (norm_rope, "_q_kv_norm_rope_kernel"),
                      (compressor, "_compress_kernel")):
        src = inspect.getsource(getattr(mod, kern).fn)
        assert "fp8_ds_mla_pack(" in src, kern
    for mod, kern in ((indexer, "_indexer_k_cache_insert_kernel"), (compressor, "_compress_kernel")):
        assert "indexer_k_pack(" in inspect.getsource(getattr(mod, kern).fn), kern
    for mod in (norm_rope, compressor):
        # no quant math of their own: the cache entries through the pack helpers above, any other FP8 output
        # (norm_rope's q_fp8: the next linear's 1x128 operand) through _fp8's shared helpers
        src = inspect.getsource(mod)
        assert not re.search(r"def (ceil_pow2|to_e4m3|round_to_e4m3|quant_rows)", src), mod.__name__
        for name in ("ceil_pow2", "to_e4m3", "quant_rows_e4m3"):
            assert name not in src or re.search(rf"from \._fp8 import [^\n]*\b{name}", src), (mod.__name__, name)


@pytest.mark.parametrize("patch,exc,match", [
    ({"kv_cache": "int8"}, TypeError, "kv_cache"),
    ({"kv_cache": "small"}, ValueError, "kv_cache"),
    ({"slot_mapping": None}, ValueError, "slot_mapping"),
    ({"slot_mapping": "float"}, TypeError, "slot_mapping"),
    ({"slot_mapping": "short"}, ValueError, "slot_mapping"),
    ({"block_size": 0}, ValueError, "block_size"),
    ({"Dkv": 256}, ValueError, "kv_cache"),
    ({"kv_cache": None}, ValueError, "slot_mapping"),
])
def test_q_kv_fused_bad_inputs_name_the_argument(patch, exc, match):
    Dkv = patch.pop("Dkv", 512)
    d = nr_spec.make_qkv_inputs({"T": 3, "Dq": 64, "Dkv": Dkv}, "random", 0, "cpu")
    d.update(kv_cache=torch.zeros(2, mla_spec.block_bytes(64), dtype=torch.uint8),
             slot_mapping=torch.tensor([0, 1, 2]), block_size=64)
    for k, v in patch.items():
        d[k] = {"int8": lambda: d[k].to(torch.int8), "small": lambda: torch.zeros(2, 64 * 584 - 2, dtype=torch.uint8),
                "float": lambda: d[k].float(), "short": lambda: d[k][:2]}.get(v, lambda: v)() \
            if isinstance(v, str) else v
    with pytest.raises(exc, match=match):
        q_kv_rmsnorm_rope(**d)


@pytest.mark.parametrize("hd,patch,exc,match", [
    (512, {"cache_slots": None}, ValueError, "cache_slots"),
    (512, {"block_size": None}, ValueError, "block_size"),
    (512, {"cache": "int8"}, TypeError, "cache"),
    (512, {"cache_slots": "short"}, ValueError, "cache_slots"),
    (512, {"cache_slots": "float"}, TypeError, "cache_slots"),
    (128, {"block_size": 2}, ValueError, "block_size"),
    (128, {"cache": "flat"}, ValueError, "kv_cache|cache"),
    (128, {"cache_slots": "past"}, ValueError, "cache_slots"),
    (128, {"cache": None}, ValueError, "cache_slots"),
])
def test_compress_fused_bad_inputs_name_the_argument(hd, patch, exc, match):
    d = _comp_inputs(3, 4, hd, "random", 0)
    d = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
    for k, v in patch.items():
        if isinstance(v, str):
            d[k] = {"int8": lambda: d[k].to(torch.int8), "short": lambda: d[k][:2], "float": lambda: d[k].float(),
                    "flat": lambda: torch.zeros(2, 64 * 132, dtype=torch.uint8),
                    "past": lambda: torch.tensor([0, 1, 10_000])}[v]()
        else:
            d[k] = v
    with pytest.raises(exc, match=match):
        compress_decode(**d)


def test_unfused_paths_are_unchanged_by_the_new_arguments():
    """Without a cache both launchers return what they returned (the registry's own entries check the
    numbers); the kv / entry outputs feed the inserts bit-exactly as before."""
    d = nr_spec.make_qkv_inputs({"T": 4, "Dq": 96, "Dkv": 160, "R": 32}, "random", 4, DEVICE)
    q, kv = q_kv_rmsnorm_rope(**d)
    assert kv.shape == (4, 160)
    c = comp_spec.make_inputs({"T": 2, "ratio": 4, "hd": 128}, "random", 4, DEVICE)
    assert compress_decode(**c).shape == (2, 128)
    assert idx_spec.BS == 64
