"""Registry entry: the step's index maps in one launch (``ds4lab_kernels.step_maps``, issue 20).

Shapes: the sizes the decode step's caches have (``ds4lab.model.cache.map_sizes`` of the geometry at
``max_ctx = ctx + 8``, as ``ds4lab.harness.step`` makes them; chunk 256), batch 1 / 16, ctx 8k / 32k,
next_n 1 / 2: ``T = batch * next_n`` tokens, request ``b`` owning rows ``b*next_n ..``."""
from __future__ import annotations

import torch

from ds4lab.geometry import DEFAULT_CONFIG
from ds4lab.harness import costs
from ds4lab.harness.numerics import Report, compare_exact
from ds4lab.harness.registry import KernelSpec, kernel_configs, reference_baseline, register

CASES = ("decode", "first_tokens", "ratio_edges", "short_window", "past_ring", "negative_positions")
#: the decode step's caches hold ctx + this many tokens (ds4lab.harness.step)
CTX_SLACK = 8


def layers_of(shape: dict) -> tuple:
    """The ``layers`` argument for ``shape``: one ratio-0, one ratio-4 and one ratio-128 layer with the
    shape's sizes (absent where its ``n_comp`` is 0; layers of one ratio share their maps, so the
    real 43-layer pattern gives the same maps)."""
    out = [(0, 0, 0, 0)]
    if shape["n_comp4"]:
        out.append((4, shape["n_comp4"], shape["ring4"], shape["idx_ring4"]))
    if shape["n_comp128"]:
        out.append((128, shape["n_comp128"], shape["ring128"], 0))
    return tuple(out)


def shape_for(cfg, batch: int, next_n: int, ctx: int, chunk: int = 256) -> dict:
    """The bench shape of a decode step of ``batch`` x ``next_n`` tokens over caches of ``ctx + 8``."""
    from ds4lab.model.cache import map_sizes
    swa_ring, layers = map_sizes(cfg, ctx + CTX_SLACK, chunk)
    by_ratio = {L[0]: L for L in layers if L[0]}
    n4, r4, i4 = by_ratio.get(4, (4, 0, 0, 0))[1:]
    n128, r128 = by_ratio.get(128, (128, 0, 0, 0))[1:3]
    return {"T": batch * next_n, "next_n": next_n, "ctx": ctx, "window": cfg.sliding_window, "swa_ring": swa_ring,
            "n_comp4": n4, "ring4": r4, "idx_ring4": i4, "n_comp128": n128, "ring128": r128}


def make_inputs(shape: dict, case: str = "decode", seed: int = 0, device="cpu") -> dict:
    """int64 positions and requests of ``T / next_n`` requests x ``next_n`` rows (consecutive positions
    per request). Cases: decode (near ``ctx``), first_tokens (positions 0, 1, 2..), ratio_edges (around
    ``(pos + 1) % 4 == 0`` and ``% 128 == 0``), short_window (pos < window), past_ring (far past every
    ring: ~1e6 and ~2^40), negative_positions (floor ``//`` / ``%`` semantics of the reference)."""
    T, n = shape["T"], shape["next_n"]
    B = T // n
    g = torch.Generator().manual_seed(seed)
    W, ctx = shape["window"], shape["ctx"]
    if case == "decode":
        p0 = ctx - torch.randint(0, min(ctx, 300), (B,), generator=g)
    elif case == "first_tokens":
        p0 = torch.randint(0, 3, (B,), generator=g)
        p0[0] = 0
    elif case == "ratio_edges":
        k = torch.randint(1, 40, (B,), generator=g)
        base = torch.where(torch.rand(B, generator=g) < 0.5, 128 * k, 4 * k)
        p0 = base - 1 + torch.randint(-1, 2, (B,), generator=g) - (n - 1) * torch.randint(0, 2, (B,), generator=g)
        p0 = p0.clamp_min(0)
    elif case == "short_window":
        p0 = torch.randint(0, max(W - n, 1), (B,), generator=g)
    elif case == "past_ring":
        p0 = torch.where(torch.arange(B) % 2 == 0, 10 ** 6, 2 ** 40) + torch.randint(0, 1000, (B,), generator=g)
    elif case == "negative_positions":
        p0 = torch.randint(-300, 3, (B,), generator=g)
    else:
        raise ValueError(f"case={case!r}: known cases {CASES}")
    pos = (p0[:, None] + torch.arange(n)[None, :]).reshape(-1)
    req = torch.arange(B)[:, None].expand(B, n).reshape(-1)
    if case != "decode":    # request ids out of order and repeated (prefill chunk / any batch layout)
        req = torch.randint(0, max(B, 2), (B,), generator=g)[:, None].expand(B, n).reshape(-1)
    return {"positions": pos.to(torch.int64).to(device), "req": req.to(torch.int64).contiguous().to(device),
            "window": W, "swa_ring": shape["swa_ring"], "layers": layers_of(shape)}


def _leaves(d, path=""):
    for k, v in d.items():
        p = f"{path}/{k}"
        if isinstance(v, dict):
            yield from _leaves(v, p)
        else:
            yield p, v


def check(out, ref, inputs) -> list:
    """The same keys (nested), then every map bit-exact (dtype and shape included) and contiguous."""
    ko, kr = dict(_leaves(out)), dict(_leaves(ref))
    if list(ko) != list(kr):
        return [Report(ok=False, name="keys", note=f"out {list(ko)} != ref {list(kr)}")]
    reps = []
    for name, r in kr.items():
        o = ko[name]
        if o.dtype != r.dtype or tuple(o.shape) != tuple(r.shape) or not o.is_contiguous():
            reps.append(Report(ok=False, name=name, shape=tuple(o.shape),
                               note=f"{o.dtype} {tuple(o.shape)} contiguous={o.is_contiguous()} vs {r.dtype} "
                                    f"{tuple(r.shape)}"))
        else:
            reps.append(compare_exact(o, r, name))
    return reps


def bench_shapes(cfg, tp: int) -> list[dict]:
    # the maps do not depend on tp (caches are replicated across ranks)
    return [shape_for(cfg, b, n, ctx) for b in (1, 16) for ctx in (8192, 32768) for n in (1, 2)]


TEST_SHAPES = [
    # tiny: window 16, ring 64, C4 ring 24 shared with the indexer's, C128 2 entries (ring 144)
    {"T": 4, "next_n": 2, "ctx": 40, "window": 16, "swa_ring": 64, "n_comp4": 64, "ring4": 24, "idx_ring4": 24,
     "n_comp128": 2, "ring128": 144},
    # batch 16, next_n 1, a non-power-of-two window, a distinct indexer ring, C128 slot list of 300 (> CHUNK)
    {"T": 16, "next_n": 1, "ctx": 600, "window": 100, "swa_ring": 192, "n_comp4": 192, "ring4": 40,
     "idx_ring4": 36, "n_comp128": 300, "ring128": 256},
]

register(KernelSpec(
    name="step_index_maps",
    family="step_maps",
    launcher="ds4lab_kernels.step_maps:step_index_maps",
    reference="ds4lab.reference.step_maps:step_index_maps",
    make_inputs=make_inputs,
    cases=CASES,
    test_shapes=TEST_SHAPES,
    bench_shapes=bench_shapes,
    flops=costs.FLOPS["step_index_maps"],
    min_bytes=costs.MIN_BYTES["step_index_maps"],
    check=check,
    configs=kernel_configs("step_maps"),
    baselines={"torch_reference": reference_baseline("ds4lab.reference.step_maps:step_index_maps")},
    bound="memory",
    # the constexpr sizes of the decode step at 8k (batch 1) and 32k (batch 16, MTP)
    aot_shape=[shape_for(DEFAULT_CONFIG, 1, 1, 8192), shape_for(DEFAULT_CONFIG, 16, 2, 32768)],
))
