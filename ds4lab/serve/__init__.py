"""``ds4lab.serve``: launch DeepSeek-V4 with MTP speculative decoding from a notebook, and measure it.

- :mod:`~ds4lab.serve.profiles`: ``env/profiles.toml`` profile + overrides -> argv and environment
  (:func:`build_launch`), stale-variable scrubbing, offline HF snapshot resolution.
- :mod:`~ds4lab.serve.server`: :class:`Server`, subprocess or in-process, progress, start-up numbers,
  clean stop, a watchdog so nothing outlives a killed notebook kernel.
- :mod:`~ds4lab.serve.startup`: vLLM's start-up log -> :class:`StartupInfo`.
- :mod:`~ds4lab.serve.measure`: warmup, canary, benchmark (tokens/s, TTFT, TPOT, MTP acceptance from
  ``/metrics``) with and without speculation.
- :mod:`~ds4lab.serve.artifacts`: serve.sh, warmup.sh, canary.sh and a systemd unit from the profile.
- :mod:`~ds4lab.serve.views`: plotly charts (the core never imports it).

CLI ``ds4lab serve`` (this module's :func:`add_arguments` / :func:`main`) is a thin face over them.
Never imports kernels/: a server process gets kernels only through the vLLM plugin.
"""
from __future__ import annotations

import argparse
import json
import sys

from .artifacts import write_artifacts
from .measure import (BenchResult, Comparison, SpecStats, acanary, abenchmark, acompare, awarmup,
                      canary, benchmark, compare, comparison_rows, acceptance_rows, format_table,
                      make_prompts, startup_rows)
from .profiles import (Launch, SnapshotError, build_launch, fit_to_machine, load_profiles, profile,
                       resolve_hf_snapshot)
from .server import Server, ServerError
from .startup import StartupInfo, parse_log, print_progress

__all__ = ["Launch", "build_launch", "profile", "load_profiles", "resolve_hf_snapshot", "SnapshotError",
           "fit_to_machine", "Server", "ServerError", "StartupInfo", "parse_log", "print_progress", "write_artifacts",
           "awarmup", "acanary", "abenchmark", "acompare", "canary", "benchmark", "compare",
           "comparison_rows", "startup_rows", "acceptance_rows", "format_table", "make_prompts", "BenchResult", "Comparison", "SpecStats",
           "add_arguments", "main"]


def _parse_set(items: list[str]) -> dict:
    out = {}
    for it in items or []:
        if "=" not in it:
            raise SystemExit(f"--set {it!r}: expected KEY=VALUE")
        k, v = it.split("=", 1)
        try:
            out[k.replace("-", "_")] = json.loads(v)
        except json.JSONDecodeError:
            out[k.replace("-", "_")] = v
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="tiny-cpu",
                        help="a profile of env/profiles.toml (tiny-cpu, ada-upstream, community-sm89-fork)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a profile key (JSON value), e.g. --set num_speculative_tokens=0")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--print", action="store_true", help="print the launch (env + argv) and exit")
    parser.add_argument("--artifacts", metavar="DIR",
                        help="write serve.sh, warmup.sh, canary.sh and a systemd unit into DIR and exit")
    parser.add_argument("--bench", action="store_true",
                        help="start with and without MTP, warm up, canary, benchmark; print the table")
    parser.add_argument("--max-tokens", type=int, default=64, help="benchmark: tokens per request")
    parser.add_argument("--requests", type=int, default=8, help="benchmark: number of prompts")
    parser.add_argument("--json", action="store_true", help="benchmark: print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    try:
        return _main(args)
    except SnapshotError as e:
        print(f"ds4lab serve: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    over = _parse_set(args.set)
    if args.artifacts:
        launch = build_launch(args.profile, over, port=args.port or 8000, resolve_model=False)
        files = write_artifacts(launch, args.artifacts, port=args.port or 8000)
        for name, p in files.items():
            print(f"wrote {p}")
        return 0
    if args.print:
        # planning machines usually lack the weights: show the command; the model path is resolved at launch
        print(build_launch(args.profile, over, port=args.port or 8000, resolve_model=False).describe())
        print("# model: resolved from the HF cache at launch (offline; a dangling refs/main is not trusted)")
        return 0
    if args.bench:
        c = compare(args.profile, over, prompts=make_prompts(args.requests), max_tokens=args.max_tokens)
        if args.json:
            print(json.dumps({"rows": c.rows(), "outputs_identical": c.outputs_identical,
                              "speedup": c.speedup, "startup": c.startup}, indent=2, default=str))
        else:
            print(format_table(c.rows()))
            print(f"outputs identical with and without MTP: {c.outputs_identical}; "
                  f"speed-up {c.speedup:.2f}x")
        return 0
    launch = build_launch(args.profile, over, port=args.port)
    print(launch.describe())
    import signal
    import time


    def _interrupt(*_):
        raise KeyboardInterrupt

    # SIGTERM (systemd, kill) and SIGINT (also when started with SIGINT ignored, e.g. `cmd &`)
    # both stop the server group cleanly, during start-up too
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        with Server(launch) as srv:
            print(f"serving {srv.model} at {srv.url} (Ctrl-C stops; log {srv.log_path})", flush=True)
            while srv.proc is not None and srv.proc.poll() is None:
                time.sleep(1)
            print(f"server exited with {srv.proc.returncode if srv.proc else '?'}:\n{srv.log_tail()}",
                  file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0
