"""``ds4lab plan``: the planner's command-line face (argparse in, text tables or JSON out)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from ds4lab.config.stacks import option_value
from ds4lab.geometry import SUPPORTED_TP, load_config
from ds4lab.planner.gpus import GPUS
from ds4lab.planner.plan import plan
from ds4lab.planner.recommend import recommend
from ds4lab.planner.stack_models import HONOURED_ENV, STACK_MODELS, stack_model
from ds4lab.planner.terms import GiB
from ds4lab.planner.weights import FORMATS
from ds4lab.tables import format_table

__all__ = ["add_arguments", "main", "EXIT_REFUSED", "EXIT_LOAD_OOM"]

#: ``--check`` exit statuses (0: vLLM would start; 2: bad input, from ds4lab.cli)
EXIT_REFUSED = 3
EXIT_LOAD_OOM = 4


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
    p.add_argument("--stack", default="ada-upstream",
                   help="serving stack whose memory model to use: a ds4lab/config/stacks.toml name "
                        "(ada-upstream, community-sm89-fork, cpu) or a model key (vllm-0.32); "
                        "default: ada-upstream (vLLM 0.32)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--check", action="store_true",
                   help="exit status says whether vLLM would start at the planned utilization: 0 starts, "
                        f"{EXIT_REFUSED} vLLM refuses to start (KV cache too small), {EXIT_LOAD_OOM} CUDA out "
                        "of memory while loading the weights (2 stays bad input)")


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


def _stack_env() -> dict[str, str]:
    """The honoured vLLM variables from this process's environment (what vLLM would read here)."""
    return {k: os.environ[k] for k in HONOURED_ENV if k in os.environ}


def main(args: argparse.Namespace) -> int:
    """``ds4lab plan``: one plan, then the recommendation. Exit 0: it is a report, also when a mode
    is impossible (the table says so and names the flags that fix it); 2 for bad input (cli.py).
    With ``--check``: 0 when vLLM would start at the planned utilization, :data:`EXIT_REFUSED` when
    it refuses (KV), :data:`EXIT_LOAD_OOM` when loading runs out of memory. A closed stdout
    (``ds4lab plan | head``) ends quietly, as CLIs do on SIGPIPE."""
    try:
        code = _main(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # the reader went away: point stdout at /dev/null so the interpreter's final flush is quiet
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13   # the shell's status for a command ended by SIGPIPE


def _main(args: argparse.Namespace) -> int:
    _check_args(args)
    cfg = load_config(args.config)
    st = args.stack
    table = None
    if st not in STACK_MODELS:
        from ds4lab.config.stacks import stack as _stack   # pure TOML read; stays torch-free
        try:
            table = _stack(st)
        except (KeyError, ValueError):
            stack_model(st)   # raises the ValueError that names the known stacks
    model = stack_model(table if table is not None else st)
    kv_dtype = option_value([str(a) for a in (table or {}).get("flags", [])], "--kv-cache-dtype") or "fp8_ds_mla"
    kw = dict(gpu=args.gpu_bytes if args.gpu_bytes is not None else args.gpu, fmt=args.fmt, tp=args.tp,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              num_speculative_tokens=args.num_speculative_tokens, cuda_graphs=not args.enforce_eager,
              async_scheduling=not args.no_async_scheduling, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              kv_cache_dtype=kv_dtype, stack=model,
              env=dict({str(k): str(v) for k, v in (table or {}).get("env", {}).items()}, **_stack_env()))
    rec = recommend(cfg, gpu_memory_utilization=args.gpu_memory_utilization, **kw)
    u = rec.at
    p = plan(cfg, gpu_memory_utilization=u, **kw)
    code = 0
    if args.check:
        code = EXIT_LOAD_OOM if p.load_oom else EXIT_REFUSED if p.kv.refused else 0
    if args.json:
        print(json.dumps({"plan": p.summary(), "terms": p.rows(), "refusal": p.verdict,
                          "warnings": list(p.warnings),
                          "recommendation": {"util_min": rec.util_min, "watched": rec.watched,
                                             "unattended": rec.unattended, "reasons": rec.reasons,
                                             "fixes": rec.fixes, "fixes_at_util": rec.at, "table": rec.table(),
                                             "remedies": {m: {"flags": r.flags, "overrides": r.overrides,
                                                              "gpu_memory_utilization": r.util,
                                                              "kv_tokens": r.plan.kv.tokens}
                                                          for m, r in rec.remedies.items()}}}, indent=1))
        return code
    print(f"# {p.gpu.name} x TP={p.tp}, {p.fmt} checkpoint, stack {model.name}, util {u}, max-model-len "
          f"{p.max_model_len}, max-num-seqs {p.max_num_seqs}, max-num-batched-tokens {p.max_num_batched_tokens}")
    if args.gpu_memory_utilization is None and rec.watched is None:
        print(f"# no utilization works as given for watched operation; planned at {u} to show why")
    print(_verdict_line(p))
    print(format_table([{k: v for k, v in r.items() if k != "source"} for r in p.rows()]))
    k = p.kv
    print(f"\nKV: {k.num_blocks} blocks x {k.bytes_per_block:,} B; {k.blocks_per_request} blocks/request "
          f"({k.fixed_blocks_per_request} fixed); vLLM would print 'KV cache size: {k.tokens:,} tokens, "
          f"Maximum concurrency for {p.max_model_len:,} tokens per request: {k.max_concurrency:.2f}x'")
    if p.verdict:
        print(p.verdict)
    for w in p.warnings:
        print(f"warning: {w}")
    if p.jit_oom_risk:
        print(f"JIT-OOM risk: only {p.headroom_bytes / GiB:.2f} GiB outside the torch pool")
    print("\n# recommendation")
    print(format_table(rec.table()))
    for r in rec.reasons:
        print(f"- {r}")
    for f in rec.fixes:
        print(f"- fix: {f}")
    print("\n# sources (term: where it comes from)")
    for t in p.terms:
        print(f"- {t.name}: {t.source}")
    return code


def _verdict_line(p) -> str:
    """The verdict first: the outcome in the wording every face uses (``Plan.outcome``)."""
    if p.load_oom:
        return "verdict: LOAD OOM - vLLM FAILS WHILE LOADING (CUDA out of memory in load_model)"
    if p.kv.refused:
        return "verdict: REFUSED - vLLM REFUSES TO START (the KV cache cannot hold one max-model-len request)"
    return f"verdict: STARTS - KV holds {p.kv.max_concurrency:.2f}x max-model-len"


if __name__ == "__main__":   # pragma: no cover
    ap = argparse.ArgumentParser(prog="ds4lab plan")
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
