#!/usr/bin/env python3
"""Hardware counters of the decode step's largest kernels (issue 20), for Nsight Compute.

Runs each named kernel at one registry bench shape with its default config (what the step picks):
three warm-up calls, then ONE call inside ``cudaProfilerStart/Stop``, so
``ncu --profile-from-start off`` captures exactly that call's launches. Meant to run under
``scripts/gpu/ncu_decode.sh``; alone it is a smoke test of the cases.

Usage: python3 scripts/gpu/ncu_decode.py --arch sm89|native [CASE ...]
  CASE: ``kernel[:key=value,...]`` picks the first bench shape (TP=4 rank) whose keys match, e.g.
  ``fused_moe_w4a16:T=1``. Default: the T=1 set below. ``routing=poolN`` (fused_moe_w4a16 only) replaces the
  bench's distinct-expert ids by the step's concentrated routing (every token's top-k from one seeded pool of N
  experts, :func:`ds4lab.harness.moe_bench.pool_ids`), e.g. ``fused_moe_w4a16:T=16,routing=pool19``.
  ``row=LABEL`` runs that row of the build's config table instead of the default, e.g.
  ``fused_moe_w4a16:T=16,routing=pool19,row=mmaq_n64p8xl_w2n128``.
"""
import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

DEFAULT_CASES = (
    "fused_moe_w4a16:T=1", "fused_moe_w4a16:T=16", "mhc_fused_post_pre:T=1", "gate_sqrtsoftplus_topk:T=1",
    "w8a8_block_fp8_linear:op=wq_b,M=1", "w8a8_block_fp8_linear:op=shared_down,M=1",
    "fp8_gemm_nt:op=wq_b,M=16", "sparse_mla_decode:T=1", "o_proj:T=1",
)


def _parse(case: str) -> tuple[str, dict]:
    name, _, rest = case.partition(":")
    want = {}
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        want[k] = int(v) if v.lstrip("-").isdigit() else v
    return name, want


def with_routing(name: str, inputs: dict, routing: str | None, seed: int = 0) -> dict:
    """``inputs`` with ``topk_ids`` drawn by ``routing`` (``"poolN"``; None: unchanged). ValueError naming
    ``routing`` for a kernel without ``topk_ids`` or a name other than ``poolN``."""
    if routing is None:
        return inputs
    from ds4lab.harness.moe_bench import pool_ids, routing_pool
    pool = routing_pool(routing)
    if pool is None or "topk_ids" not in inputs:
        raise ValueError(f"routing={routing!r}: expected 'poolN' on a kernel with topk_ids ({name} has "
                         f"{'topk_ids' if 'topk_ids' in inputs else 'none'})")
    T, K = inputs["topk_ids"].shape
    ids = pool_ids(T, inputs["w13_packed"].shape[0], K, pool, seed, inputs["topk_ids"].device)
    return {**inputs, "topk_ids": ids}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm89", choices=["native", "sm89"])
    p.add_argument("cases", nargs="*", default=list(DEFAULT_CASES))
    a = p.parse_args(argv)
    from ds4lab.harness.bench import _setup_build
    _setup_build(a.arch)
    import torch
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.harness import registry
    from ds4lab_kernels._arch import arch_of
    dev = torch.device("cuda")
    cudart = torch.cuda.cudart()
    rc = 0
    for case in a.cases:
        name, want = _parse(case)
        routing = want.pop("routing", None)
        row = want.pop("row", None)
        spec = registry.get(name)
        shapes = [s for s in spec.bench_shapes(DEFAULT_CONFIG, 4) if all(s.get(k) == v for k, v in want.items())]
        if not shapes:
            print(f"{case}: no bench shape matches", flush=True)
            rc = 1
            continue
        shape = shapes[0]
        fn = spec.launcher_fn()
        try:
            if row is not None:
                table = spec.configs["sm_89" if a.arch == "sm89" else arch_of(dev)]
                if row not in table:
                    raise ValueError(f"row={row!r}: not a row of {name}'s table ({', '.join(sorted(table))})")
                fn = functools.partial(fn, config=table[row])
            inputs = with_routing(name, spec.make_inputs(shape, spec.cases[0], 0, dev), routing)
            for _ in range(3):
                fn(**inputs)
            torch.cuda.synchronize()
            cudart.cudaProfilerStart()
            fn(**inputs)
            torch.cuda.synchronize()
            cudart.cudaProfilerStop()
            print(f"PROFILED {name} {shape}{' routing=' + routing if routing else ''}{' row=' + row if row else ''}",
                  flush=True)
        except Exception as e:   # one failing case must not stop the rest
            print(f"{case}: {type(e).__name__}: {e}", flush=True)
            rc = 1
        inputs = None
        torch.cuda.empty_cache()
    return rc


if __name__ == "__main__":
    sys.exit(main())
