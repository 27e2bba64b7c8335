"""Registry entry: the DeepSeek-V4 KV compressor, decode path (state write + window softmax-sum,
RMSNorm, RoPE -> bf16 entry). Semantics: :mod:`ds4lab.reference.compressor`."""
from __future__ import annotations

import torch

from ds4lab.harness import costs
from ds4lab.harness.numerics import compare
from ds4lab.harness.registry import KernelSpec, kernel_configs, register
from ds4lab.reference.rope import cos_sin_cache

CASES = ("random", "first_window", "non_boundary", "large_scores", "mtp_pairs")


def _ring(ratio: int, coff: int, chunk: int = 8) -> int:
    """The model cache's state ring: window + the largest chunk, rounded up to the ratio."""
    return -(-(coff * ratio + chunk) // ratio) * ratio


def make_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """``T`` decode tokens of ratio ``ratio`` / head ``hd``, one request each (``mtp_pairs``: two
    consecutive positions per request, the second's window holding the first's fresh row), over a
    state ring filled with random rows (kv ~ N(0,1), scores ~ N(0,2)). Cases: ``random`` (every token
    on a compress boundary, deep in the context), ``first_window`` (boundaries at positions < coff*r:
    negative window positions masked), ``non_boundary`` (every other token off a boundary: zeros),
    ``large_scores`` (scores spread over +-3e3 and per-request gains 1e-3..1e3 on kv)."""
    T, ratio, hd = shape["T"], shape["ratio"], shape["hd"]
    if case not in CASES:
        raise ValueError(f"case={case!r}: known cases {CASES}")
    coff = 2 if ratio == 4 else 1
    W, width = coff * ratio, coff * hd
    ring = _ring(ratio, coff)
    g = torch.Generator().manual_seed(seed)
    if case == "mtp_pairs":
        B = -(-T // 2)
        req = torch.arange(T) // 2
        base = (torch.randint(4, 60, (B,), generator=g) * ratio - 2)        # pos, pos+1: the second on a boundary
        pos = base[req] + torch.arange(T) % 2
    else:
        B, req = T, torch.arange(T)
        hi = 2 if case == "first_window" else 60
        lo = 0 if case == "first_window" else 4
        pos = torch.randint(lo, hi, (T,), generator=g) * ratio + ratio - 1
        if case == "non_boundary":
            pos[1::2] -= torch.randint(1, ratio, (len(pos[1::2]),), generator=g)
    kv = torch.randn(T, width, generator=g)
    sc = torch.randn(T, width, generator=g) * 2
    state = torch.randn(B * ring, 2 * width, generator=g)
    state[:, width:] *= 2
    if case == "large_scores":
        sc = (torch.rand(T, width, generator=g) * 2 - 1) * 3e3
        state[:, width:] = (torch.rand(B * ring, width, generator=g) * 2 - 1) * 3e3
        gain = torch.exp(torch.empty(B, 1).uniform_(-6.9, 6.9, generator=g))
        kv = kv * gain[req]
        state[:, :width] *= gain.repeat_interleave(ring, 0)
    win = pos[:, None] - W + 1 + torch.arange(W)[None, :]
    valid = win >= 0
    wslots = req[:, None] * ring + win.clamp_min(0) % ring
    sslots = req * ring + pos % ring
    max_pos = int(pos.max()) + 1
    cs = cos_sin_cache(max_pos, 64, base=160000.0)
    d = dict(kv_score=torch.cat([kv, sc], 1), positions=pos, state=state, state_slots=sslots,
             window_slots=wslots, window_valid=valid, ape=torch.randn(ratio, width, generator=g) * 0.02,
             norm_weight=(1 + 0.1 * torch.randn(hd, generator=g)), eps=1e-6, ratio=ratio, cos_sin=cs)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def make_step_inputs(shape: dict, seed: int = 0, device="cpu") -> dict:
    """A decode step of ``ceil(T / next_n)`` requests with ``next_n`` consecutive positions each (MTP:
    ``next_n`` 2; a token's window holds the fresh rows of its request's earlier tokens), rows in request
    order or, with ``shape["shuffle"]``, the requests in a random order and each request's rows reversed (a
    boundary token's window then holds LATER rows' state slots). Per request the first position is
    ``k*ratio - 1 - o``: ``o = next_n - 1`` (the boundary on the last token, the one whose window holds the
    others' rows) for half of the requests, else ``o`` in ``0..next_n`` (``o == next_n``: no boundary); ``k`` in
    1..2 for about a third of them (the first windows: positions < 0 masked at ratio 4) else 4..59.
    Otherwise as :func:`make_inputs` (``random``)."""
    T, ratio, hd, nn = shape["T"], shape["ratio"], shape["hd"], shape.get("next_n", 1)
    coff = 2 if ratio == 4 else 1
    W, width = coff * ratio, coff * hd
    ring = _ring(ratio, coff)
    if nn > ring - W:
        raise ValueError(f"next_n={nn}: the ring ({ring} rows) holds window {W} + at most {ring - W} fresh rows")
    g = torch.Generator().manual_seed(seed)
    B = -(-T // nn)
    req, i = torch.arange(T) // nn, torch.arange(T) % nn
    k = torch.where(torch.rand(B, generator=g) < 1 / 3, torch.randint(1, 3, (B,), generator=g),
                    torch.randint(4, 60, (B,), generator=g))
    o = torch.where(torch.rand(B, generator=g) < 0.5, nn - 1, torch.randint(0, nn + 1, (B,), generator=g))
    p0 = (k * ratio - 1 - o).clamp_min(0)
    pos = p0[req] + i
    kv = torch.randn(T, width, generator=g)
    sc = torch.randn(T, width, generator=g) * 2
    state = torch.randn(B * ring, 2 * width, generator=g)
    state[:, width:] *= 2
    win = pos[:, None] - W + 1 + torch.arange(W)[None, :]
    valid = win >= 0
    wslots = req[:, None] * ring + win.clamp_min(0) % ring
    sslots = req * ring + pos % ring
    perm = torch.arange(T)
    if shape.get("shuffle"):
        perm = torch.cat([torch.arange(b * nn, min(T, (b + 1) * nn)).flip(0) for b in torch.randperm(B, generator=g)])
    cs = cos_sin_cache(int(pos.max()) + 1, 64, base=160000.0)
    d = dict(kv_score=torch.cat([kv, sc], 1)[perm], positions=pos[perm], state=state, state_slots=sslots[perm],
             window_slots=wslots[perm], window_valid=valid[perm],
             ape=torch.randn(ratio, width, generator=g) * 0.02,
             norm_weight=(1 + 0.1 * torch.randn(hd, generator=g)), eps=1e-6, ratio=ratio, cos_sin=cs)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def check(out, ref, inputs) -> list:
    """bf16 entries within the bf16 budget of the float64 reference (zeros off a boundary)."""
    return [compare(out, ref, "bfloat16", "compressed entries")]


def bench_shapes(cfg, tp: int) -> list[dict]:
    # decode: batch 1 / 16 / 64 tokens; main attention (hd = head_dim) at C4 and C128, indexer (C4, 128)
    hd, ihd = cfg.head_dim, cfg.index_head_dim
    return [{"T": t, "ratio": r, "hd": h} for (r, h) in ((4, hd), (128, hd), (4, ihd)) for t in (1, 16, 64)]


def config_labels(arch: str, s: dict) -> list[str]:
    """The table rows at a shape: the two-launch default and its one-launch twin (``_1l``, bit-identical)."""
    base = f"c{s['ratio']}_hd{s['hd']}"
    return [base, base + "_1l"]


def _torch_eager(inputs):
    """The torch path the model ran before this kernel (``backend_kernel.compress``, ~tens of launches)."""
    from ds4lab.model.backend_kernel import compress

    def run():
        return compress(**inputs)
    return run


register(KernelSpec(
    name="compress_decode",
    family="compressor",
    launcher="ds4lab_kernels.compressor:compress_decode",
    reference="ds4lab.reference.compressor:compress_decode",
    make_inputs=make_inputs,
    cases=CASES,
    test_shapes=[{"T": 3, "ratio": 4, "hd": 512}, {"T": 2, "ratio": 128, "hd": 128},
                 {"T": 2, "ratio": 4, "hd": 128}, {"T": 2, "ratio": 128, "hd": 512}],
    bench_shapes=bench_shapes,
    flops=costs.FLOPS["compress_decode"],
    min_bytes=costs.MIN_BYTES["compress_decode"],
    check=check,
    configs=kernel_configs("compressor"),
    config_for=config_labels,
    baselines={"torch_eager": _torch_eager},
    bound="memory",
    aot_shape=[{"T": 4, "ratio": 4, "hd": 512}, {"T": 4, "ratio": 128, "hd": 512},
               {"T": 4, "ratio": 4, "hd": 128}, {"T": 4, "ratio": 128, "hd": 128}],
))
