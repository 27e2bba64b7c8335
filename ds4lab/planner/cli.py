"""``ds4lab plan``: the planner's command-line face (argparse in, text tables or JSON out)."""
from __future__ import annotations

import argparse
import json
import sys

from ds4lab.geometry import SUPPORTED_TP, load_config
from ds4lab.planner.gpus import GPUS
from ds4lab.planner.plan import plan
from ds4lab.planner.recommend import recommend
from ds4lab.planner.terms import GiB
from ds4lab.planner.weights import FORMATS
from ds4lab.tables import format_table

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="config.json or checkpoint folder (default: official geometry)")
    p.add_argument("--format", dest="fmt", default="community", choices=sorted(FORMATS),
                   help="checkpoint format (weight bytes per class): " + "; ".join(
                       f"{k}: {v['desc']}" for k, v in sorted(FORMATS.items())) + " (default: community)")
    p.add_argument("--gpu", default="l40s", help=f"card, one of {sorted(GPUS)} (default: l40s)")
    p.add_argument("--gpu-bytes", type=int, default=None, help="total GPU memory in bytes (overrides --gpu)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=4,
                   help=f"tensor-parallel degree, one of {SUPPORTED_TP} (default: 4)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="plan this value (default: the recommended watched value)")
    p.add_argument("--max-model-len", type=int, default=98304,
                   help="longest request in tokens; one must fit the KV pool or vLLM refuses (default: 98304)")
    p.add_argument("--max-num-seqs", type=int, default=1, help="concurrent requests (default: 1)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per scheduler step; the profile run's token count and, x2 with async "
                        "scheduling, the sliding-window reservation (default: vLLM's for the card, "
                        "2048 below 70 GiB)")
    p.add_argument("--num-speculative-tokens", type=int, default=1, help="MTP tokens (0: no speculation; default: 1)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA graphs off")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="one batch in flight instead of two (halves the sliding-window reservation)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="pin the KV pool per GPU in bytes (vLLM then ignores the utilization for KV)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _check_args(args: argparse.Namespace) -> None:
    """Input errors name the flag (the CLI turns ValueError into one line and exit status 2)."""
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1]")
    if args.gpu_bytes is not None and args.gpu_bytes < 2**30:
        raise ValueError(f"--gpu-bytes {args.gpu_bytes}: less than 1 GiB is not a GPU")
    for flag in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
        v = getattr(args, flag)
        if v is not None and v <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} {v}: must be a positive integer")
    if args.num_speculative_tokens < 0:
        raise ValueError(f"--num-speculative-tokens {args.num_speculative_tokens}: must be >= 0 (0: no MTP)")
    if args.tp not in SUPPORTED_TP:
        raise ValueError(f"--tp {args.tp}: supported tensor-parallel degrees are {SUPPORTED_TP}")


def main(args: argparse.Namespace) -> int:
    """``ds4lab plan``: one plan, then the recommendation. Exit 0: it is a report, also when a mode
    is impossible (the table says so and names the flags that fix it); 2 for bad input (cli.py)."""
    _check_args(args)
    cfg = load_config(args.config)
    kw = dict(gpu=args.gpu_bytes if args.gpu_bytes is not None else args.gpu, fmt=args.fmt, tp=args.tp,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              num_speculative_tokens=args.num_speculative_tokens, cuda_graphs=not args.enforce_eager,
              async_scheduling=not args.no_async_scheduling, kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    rec = recommend(cfg, **kw)
    u = args.gpu_memory_utilization
    if u is None:
        u = rec.watched or rec.util_max_watched or 0.95
    p = plan(cfg, gpu_memory_utilization=u, **kw)
    if args.json:
        print(json.dumps({"plan": p.summary(), "terms": p.rows(), "refusal": p.verdict,
                          "recommendation": {"util_min": rec.util_min, "watched": rec.watched,
                                             "unattended": rec.unattended, "reasons": rec.reasons,
                                             "fixes": rec.fixes, "table": rec.table(),
                                             "remedies": {m: {"flags": r.flags, "overrides": r.overrides,
                                                              "gpu_memory_utilization": r.util,
                                                              "kv_tokens": r.plan.kv.tokens}
                                                          for m, r in rec.remedies.items()}}}, indent=1))
        return 0
    print(f"# {p.gpu.name} x TP={p.tp}, {p.fmt} checkpoint, util {u}, max-model-len {p.max_model_len}, "
          f"max-num-seqs {p.max_num_seqs}, max-num-batched-tokens {p.max_num_batched_tokens}")
    if args.gpu_memory_utilization is None and rec.watched is None:
        print(f"# no utilization works as given for watched operation; planned at {u} to show why")
    print(format_table(p.rows()))
    k = p.kv
    print(f"\nKV: {k.num_blocks} blocks x {k.bytes_per_block:,} B; {k.blocks_per_request} blocks/request "
          f"({k.fixed_blocks_per_request} fixed); vLLM would print 'KV cache size: {k.tokens:,} tokens, "
          f"Maximum concurrency for {p.max_model_len:,} tokens per request: {k.max_concurrency:.2f}x'")
    if p.load_oom:
        print(f"vLLM FAILS WHILE LOADING: {p.verdict}")
    elif k.refused:
        print(f"vLLM REFUSES TO START: {k.message}")
    if p.jit_oom_risk:
        print(f"JIT-OOM risk: only {p.headroom_bytes / GiB:.2f} GiB outside the torch pool")
    print("\n# recommendation")
    print(format_table(rec.table()))
    for r in rec.reasons:
        print(f"- {r}")
    for f in rec.fixes:
        print(f"- fix: {f}")
    return 0


if __name__ == "__main__":   # pragma: no cover
    ap = argparse.ArgumentParser(prog="ds4lab plan")
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
