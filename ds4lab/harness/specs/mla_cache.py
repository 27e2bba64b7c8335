"""Registry entry: fp8_ds_mla KV cache writer (SPEC.md §2 item 10, §3)."""
from __future__ import annotations

import torch

from ds4lab.geometry import FP8_DS_MLA_ALIGN, FP8_DS_MLA_ENTRY_BYTES, op_shapes
from ds4lab.harness import costs
from ds4lab.harness.numerics import Report, compare_exact
from ds4lab.harness.registry import KernelSpec, kernel_configs, register

POISON = 0xA5  # every byte the writer must not touch starts as this
CASES = ("random", "zero_rows", "tiny_rows", "outliers", "skip_slots", "block_edges")


def block_bytes(block_size: int) -> int:
    """vLLM pads a block of ``block_size * 584`` bytes to a multiple of 576."""
    return -(-block_size * FP8_DS_MLA_ENTRY_BYTES // FP8_DS_MLA_ALIGN) * FP8_DS_MLA_ALIGN


def make_inputs(shape: dict, case: str = "random", seed: int = 0, device="cpu") -> dict:
    """bf16 latent rows ``[T, 512]`` (RMS-normed magnitudes, per-row gain 1e-2..1e2), distinct slots
    in a cache of ``num_blocks`` blocks filled with the poison byte 0xA5. Adversarial: all-zero rows
    (amax floor 1e-4), rows of 1e-6 (below the floor: subnormal e4m3), one huge value per 64-tile,
    slots of -1 / past the cache (skipped), and slots on the first/last entry of every block."""
    T, bs, nb = shape["T"], shape["block_size"], shape["num_blocks"]
    g = torch.Generator().manual_seed(seed)
    gain = torch.exp(torch.empty(T, 1).uniform_(-4.6, 4.6, generator=g))
    kv = torch.randn(T, 512, generator=g) * gain
    slots = torch.randperm(nb * bs, generator=g)[:T].to(torch.int64)
    if case == "zero_rows":
        kv[::2] = 0.0
    elif case == "tiny_rows":
        kv[::2, :448] = 1e-6 * torch.randn(len(kv[::2]), 448, generator=g)
    elif case == "outliers":
        kv[:, 5:448:64] = 3e4
    elif case == "skip_slots":
        slots[::3] = -1
        slots[1::5] = nb * bs + 7
    elif case == "block_edges":
        edges = torch.stack([torch.arange(nb) * bs, torch.arange(nb) * bs + bs - 1], 1).reshape(-1).unique()
        slots[: min(T, len(edges))] = edges[torch.randperm(len(edges), generator=g)][:T]
        rest = torch.tensor([s for s in torch.randperm(nb * bs, generator=g).tolist()
                             if s not in set(slots[: min(T, len(edges))].tolist())])
        if T > len(edges):
            slots[len(edges):] = rest[: T - len(edges)]
    elif case not in CASES:
        raise ValueError(f"case={case!r}: known cases {CASES}")
    cache = torch.full((nb, block_bytes(bs)), POISON, dtype=torch.uint8)
    return {"kv": kv.to(torch.bfloat16).to(device), "slot_mapping": slots.to(torch.int32).to(device),
            "kv_cache": cache.to(device), "block_size": bs}


def check(out, ref, inputs) -> list:
    """Byte-exact cache, and every byte outside the written entries still the poison byte."""
    from ds4lab.reference.mla_cache import written_mask
    reps = [compare_exact(out, ref, "kv_cache bytes")]
    mask = written_mask(out, inputs["slot_mapping"], inputs["block_size"])
    stray = (out.detach().cpu().reshape(mask.shape) != POISON) & ~mask
    reps.append(Report(ok=not bool(stray.any()), name="untouched bytes", shape=tuple(mask.shape),
                       n_fail=int(stray.sum())))
    return reps


def bench_shapes(cfg, tp: int) -> list[dict]:
    D = op_shapes(cfg, tp)["kv_cache_insert"].dims["D"]
    assert D == 512, D
    # per-step inserts: decode batches and a prefill chunk, SWA/C4 (64) and C128 (2) blocks
    return [{"T": t, "block_size": bs, "num_blocks": max(64, 2 * t // bs)}
            for bs in (64, 2) for t in (32, 8192)]


def _torch_eager(inputs):
    """torch-only writer (quantize + index_put into the byte tensor), as a baseline row."""
    from ds4lab.reference.mla_cache import quantize_entry

    def run():
        kv, slots, cache, bs = inputs["kv"], inputs["slot_mapping"].long(), inputs["kv_cache"], inputs["block_size"]
        q, b, rope = quantize_entry(kv)
        blocks = cache.view(cache.shape[0], -1)
        blk, pos = slots // bs, slots % bs
        D, S = FP8_DS_MLA_DATA_BYTES, FP8_DS_MLA_SCALE_BYTES
        ar = torch.arange(D, device=kv.device)
        data = torch.cat([q.view(torch.uint8), rope.contiguous().view(torch.uint8)], 1)
        blocks[blk[:, None], pos[:, None] * D + ar] = data
        blocks[blk[:, None], bs * D + pos[:, None] * S + torch.arange(S - 1, device=kv.device)] = b
        return cache
    return run


register(KernelSpec(
    name="fp8_ds_mla_insert",
    family="mla_cache",
    launcher="ds4lab_kernels.mla_cache:fp8_ds_mla_insert",
    reference="ds4lab.reference.mla_cache:fp8_ds_mla_insert",
    make_inputs=make_inputs,
    cases=CASES,
    test_shapes=[{"T": 9, "block_size": 64, "num_blocks": 3}, {"T": 7, "block_size": 2, "num_blocks": 6}],
    bench_shapes=bench_shapes,
    flops=costs.FLOPS["fp8_ds_mla_insert"],
    min_bytes=costs.MIN_BYTES["fp8_ds_mla_insert"],
    check=check,
    configs=kernel_configs("mla_cache"),
    baselines={"torch_eager": _torch_eager},
    bound="memory",
    aot_shape={"T": 64, "block_size": 64, "num_blocks": 4},
))
