"""Registry entries: the cache writes fused into their producers (issue 20, the decode step's
standalone insert launches): ``q_kv_rmsnorm_rope(kv_cache=...)`` writes the SWA fp8_ds_mla entry of
its kv, ``compress_decode(cache=...)`` the compressed fp8_ds_mla (hd 512) / indexer K (hd 128) entry of
each boundary row. References: the producer's reference, then the layout's reference insert
(:func:`ds4lab.reference.norm_rope.q_kv_rmsnorm_rope_insert`,
:func:`ds4lab.reference.compressor.compress_decode_insert`).

Budget of an entry: the kernel quantizes its own bf16 row, the reference its float64 row rounded to
bf16; the two rows may differ by one bf16 ulp (2^-8 relative) on some elements, which can move an e4m3
value by one step or a tile's pow2 scale across a binade. Each side's dequantized value is within half
an e4m3 step of its row, at most ``amax_tile / 16`` (scale ``s <= 2 amax / 448``, half-step 16 s in the
top binade), so the two entries agree within ``amax_tile / 8 + 2^-7 amax_tile`` per NoPE / indexer
element; the bf16 RoPE dims within one bf16 ulp (the ``bfloat16`` budget). A wrong slot, scale byte,
tile order or rotation gives O(amax). Bit-identity to the unfused insert on the kernel's own rows is
tested in tests/test_cache_fused.py and checked on the GPU by scripts/gpu/cache_fused_check.py."""
from __future__ import annotations

import torch

from ds4lab.harness import costs
from ds4lab.harness.numerics import Report, compare
from ds4lab.harness.registry import KernelSpec, kernel_configs, register
from ds4lab.harness.specs import compressor as comp_spec
from ds4lab.harness.specs import indexer as idx_spec
from ds4lab.harness.specs import mla_cache as mla_spec
from ds4lab.harness.specs import norm_rope as nr_spec
from ds4lab.reference import indexer as ridx
from ds4lab.reference import mla_cache as rmla

QKV_CASES = nr_spec.QKV_CASES + ("skip_slots",)
COMP_CASES = comp_spec.CASES + ("skip_slots",)


def _slots(T: int, n_slots: int, skip: bool, g) -> torch.Tensor:
    """Distinct slots of a cache of ``n_slots`` entries; ``skip``: every third -1, every fifth past the
    end (both skipped), the first on the cache's first entry and the second on its last."""
    s = torch.randperm(n_slots, generator=g)[:T].to(torch.int64)
    if T >= 2:
        s[0], s[1] = 0, n_slots - 1
        s[2:] = torch.tensor([x for x in torch.randperm(n_slots, generator=g).tolist() if x not in (0, n_slots - 1)]
                             [:T - 2], dtype=torch.int64)
    if skip:
        s[::3] = -1
        s[1::5] = n_slots + 7
    return s


def make_qkv_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """:func:`ds4lab.harness.specs.norm_rope.make_qkv_inputs` (``Dkv`` 512) plus a poison-filled
    fp8_ds_mla cache of ``num_blocks`` blocks of ``block_size`` and distinct slots (``skip_slots``:
    -1 and past-the-end slots)."""
    if case not in QKV_CASES:
        raise ValueError(f"case={case!r}: known cases {QKV_CASES}")
    d = nr_spec.make_qkv_inputs(shape, "random" if case == "skip_slots" else case, seed, device)
    bs, nb = shape["block_size"], shape["num_blocks"]
    g = torch.Generator().manual_seed(seed + 1)
    d["kv_cache"] = torch.full((nb, mla_spec.block_bytes(bs)), mla_spec.POISON, dtype=torch.uint8).to(device)
    d["slot_mapping"] = _slots(shape["T"], nb * bs, case == "skip_slots", g).to(torch.int32).to(device)
    d["block_size"] = bs
    return d


def _mla_entries(out_cache, ref_cache, slots, bs, name) -> list:
    """The entry budget (module doc) over the written slots, and no byte written outside them."""
    n = out_cache.shape[0] * bs
    s = slots.detach().cpu().long()
    s = s[(s >= 0) & (s < n)]
    a, b = rmla.dequant_slots(out_cache, s, bs), rmla.dequant_slots(ref_cache, s, bs)
    amax = b[:, :448].abs().reshape(-1, 7, 64).amax(-1, keepdim=True)
    bad = ((a[:, :448] - b[:, :448]).abs().reshape(-1, 7, 64) > amax * (1 / 8 + 2 ** -7)) | \
        ~torch.isfinite(a[:, :448].reshape(-1, 7, 64))
    reps = [Report(ok=not bool(bad.any()), name=f"{name} NoPE entries", shape=tuple(bad.shape),
                   n_fail=int(bad.sum()), max_abs=float((a[:, :448] - b[:, :448]).abs().max()) if len(s) else 0.0),
            compare(a[:, 448:], b[:, 448:], "bfloat16", f"{name} RoPE dims")]
    mask = rmla.written_mask(out_cache, slots, bs)
    stray = (out_cache.detach().cpu().reshape(mask.shape) != mla_spec.POISON) & ~mask
    reps.append(Report(ok=not bool(stray.any()), name="untouched bytes", shape=tuple(mask.shape),
                       n_fail=int(stray.sum())))
    return reps


def check_qkv(out, ref, inputs) -> list:
    """q within the bf16 budget; the written entries within the entry budget; nothing else written."""
    return [compare(out, ref[0], name="q")] + _mla_entries(inputs["kv_cache"], ref[1], inputs["slot_mapping"],
                                                           inputs["block_size"], "kv")


def make_comp_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """:func:`ds4lab.harness.specs.compressor.make_inputs` plus the cache its entries go to (hd 512:
    poison-filled fp8_ds_mla, ``block_size`` 64 at ratio 4 and 2 at ratio 128; hd 128: the indexer K
    cache of ``specs.indexer.make_cache``) and a distinct slot per token (``skip_slots``: -1 / past the
    end on some boundary rows; rows off a boundary carry a valid slot too: the kernel must not write them)."""
    if case not in COMP_CASES:
        raise ValueError(f"case={case!r}: known cases {COMP_CASES}")
    d = comp_spec.make_inputs(shape, "non_boundary" if case == "skip_slots" else case, seed, device)
    return add_comp_cache(d, shape, seed, device, skip=case == "skip_slots")


def add_comp_cache(d: dict, shape: dict, seed: int = 0, device="cpu", skip: bool = False) -> dict:
    """``d`` (compressor inputs of ``shape``) plus the cache of :func:`make_comp_inputs` and its slots."""
    T, hd, ratio = shape["T"], shape["hd"], shape["ratio"]
    nb = shape.get("num_blocks", 2)
    g = torch.Generator().manual_seed(seed + 1)
    if hd == 512:
        bs = 64 if ratio == 4 else 2
        d["cache"] = torch.full((nb, mla_spec.block_bytes(bs)), mla_spec.POISON, dtype=torch.uint8).to(device)
        d["block_size"] = bs
    else:
        bs = idx_spec.BS
        d["cache"] = idx_spec.make_cache(nb, device)
    s = _slots(T, nb * bs, skip, g)
    if hd != 512:
        s = torch.where(s >= nb * bs, -1, s)      # the indexer layout's caller guarantees the bound
    d["cache_slots"] = s.to(device)
    return d


def check_comp(out, ref, inputs) -> list:
    """The written entries within the entry budget; nothing written off a boundary or outside the slots."""
    c, pos, ratio = inputs["cache"], inputs["positions"].cpu(), inputs["ratio"]
    slots = torch.where((pos + 1) % ratio == 0, inputs["cache_slots"].cpu().long(), -1)
    if c.dim() == 2:
        return _mla_entries(c, ref, slots, inputs["block_size"], "compressed")
    s = slots[slots >= 0]
    qa, sa = ridx.read_indexer_k_cache(c, s)
    qb, sb = ridx.read_indexer_k_cache(ref, s)
    a, b = qa.double() * sa.double()[:, None], qb.double() * sb.double()[:, None]
    amax = b.abs().amax(-1, keepdim=True)
    bad = ((a - b).abs() > amax * (1 / 8 + 2 ** -7)) | ~torch.isfinite(a)
    return [Report(ok=not bool(bad.any()), name="indexer K entries", shape=tuple(bad.shape), n_fail=int(bad.sum())),
            idx_spec.untouched_report(c, slots)]


def _qkv_bench(cfg, tp: int) -> list[dict]:
    return [dict(s, block_size=64, num_blocks=max(4, s["T"] // 16)) for s in nr_spec.qkv_bench_shapes(cfg, tp)]


def _unfused_qkv(inputs):
    """The two launches this one replaces: ``q_kv_rmsnorm_rope`` then ``fp8_ds_mla_insert``."""
    from ds4lab_kernels.mla_cache import fp8_ds_mla_insert
    from ds4lab_kernels.norm_rope import q_kv_rmsnorm_rope
    a = {k: v for k, v in inputs.items() if k not in ("kv_cache", "slot_mapping", "block_size")}

    def run():
        q, kv = q_kv_rmsnorm_rope(**a)
        fp8_ds_mla_insert(kv, inputs["slot_mapping"], inputs["kv_cache"], inputs["block_size"])
        return q
    return run


def _unfused_comp(inputs):
    """The two launches + the insert this one replaces: ``compress_decode`` then the layout's insert."""
    from ds4lab_kernels.compressor import compress_decode
    from ds4lab_kernels.indexer import indexer_k_cache_insert
    from ds4lab_kernels.mla_cache import fp8_ds_mla_insert
    a = {k: v for k, v in inputs.items() if k not in ("cache", "cache_slots", "block_size")}
    slots = torch.where((inputs["positions"] + 1) % inputs["ratio"] == 0, inputs["cache_slots"], -1)

    def run():
        e = compress_decode(**a)
        if e.shape[1] == 512:
            return fp8_ds_mla_insert(e, slots, inputs["cache"], inputs["block_size"])
        return indexer_k_cache_insert(e, inputs["cache"], slots)
    return run


def _comp_bench(cfg, tp: int) -> list[dict]:
    return [dict(s, num_blocks=max(2, s["T"])) for s in comp_spec.bench_shapes(cfg, tp)]


register(KernelSpec(
    name="q_kv_rmsnorm_rope_insert",
    family="norm_rope",
    launcher="ds4lab_kernels.norm_rope:q_kv_rmsnorm_rope",
    reference="ds4lab.reference.norm_rope:q_kv_rmsnorm_rope_insert",
    make_inputs=make_qkv_inputs,
    cases=QKV_CASES,
    test_shapes=[{"T": 5, "Dq": 128, "Dkv": 512, "block_size": 64, "num_blocks": 2},
                 {"T": 4, "Dq": 96, "Dkv": 512, "block_size": 2, "num_blocks": 3}],
    bench_shapes=_qkv_bench,
    flops=costs.FLOPS["q_kv_rmsnorm_rope_insert"],
    min_bytes=costs.MIN_BYTES["q_kv_rmsnorm_rope_insert"],
    check=check_qkv,
    configs=kernel_configs("norm_rope", "q_kv_rmsnorm_rope"),
    baselines={"unfused": _unfused_qkv},
    bound="memory",
    aot_shape={"T": 4, "Dq": 1024, "Dkv": 512, "block_size": 64, "num_blocks": 2},
))

register(KernelSpec(
    name="compress_decode_insert",
    family="compressor",
    launcher="ds4lab_kernels.compressor:compress_decode",
    reference="ds4lab.reference.compressor:compress_decode_insert",
    make_inputs=make_comp_inputs,
    cases=COMP_CASES,
    test_shapes=[{"T": 3, "ratio": 4, "hd": 512}, {"T": 2, "ratio": 128, "hd": 128},
                 {"T": 3, "ratio": 4, "hd": 128}, {"T": 2, "ratio": 128, "hd": 512}],
    bench_shapes=_comp_bench,
    flops=costs.FLOPS["compress_decode_insert"],
    min_bytes=costs.MIN_BYTES["compress_decode_insert"],
    check=check_comp,
    configs=kernel_configs("compressor"),
    config_for=comp_spec.config_labels,
    baselines={"unfused": _unfused_comp},
    bound="memory",
    aot_shape=[{"T": 4, "ratio": 4, "hd": 512}, {"T": 4, "ratio": 128, "hd": 512},
               {"T": 4, "ratio": 4, "hd": 128}, {"T": 4, "ratio": 128, "hd": 128}],
))
