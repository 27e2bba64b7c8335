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
                      make_prompts, new_log_path, startup_rows)
from .profiles import (Launch, SnapshotError, build_launch, fit_to_machine, load_profiles, parse_setting,
                       profile, resolve_hf_snapshot)
from .server import Server, ServerError
from .startup import StartupInfo, parse_log, print_progress

__all__ = ["Launch", "build_launch", "profile", "load_profiles", "resolve_hf_snapshot", "SnapshotError",
           "fit_to_machine", "Server", "ServerError", "StartupInfo", "parse_log", "print_progress", "write_artifacts",
           "awarmup", "acanary", "abenchmark", "acompare", "canary", "benchmark", "compare",
           "comparison_rows", "startup_rows", "new_log_path", "parse_setting", "acceptance_rows", "format_table", "make_prompts", "BenchResult", "Comparison", "SpecStats",
           "add_arguments", "main"]


def _parse_set(items: list[str]) -> dict:
    """``--set KEY=VALUE`` items -> overrides, each VALUE parsed by its key's type and range-checked
    (:func:`~ds4lab.serve.profiles.parse_setting`); ValueError naming the item otherwise."""
    out = {}
    for it in items or []:
        if "=" not in it:
            raise ValueError(f"--set {it!r}: expected KEY=VALUE")
        k, v = it.split("=", 1)
        try:
            out[k.replace("-", "_")] = parse_setting(k, v)
        except ValueError as e:
            raise ValueError(f"--set {e}") from None
    return out


def _check_args(args: argparse.Namespace) -> None:
    """Reject out-of-range numbers before anything starts (one line naming the flag; the CLI
    turns the ValueError into exit status 2)."""
    if args.port is not None and not 1 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: must be 1-65535 (leave --port out to use the profile's port, "
                         "else a free one)")
    if args.requests < 1:
        raise ValueError(f"--requests {args.requests}: must be >= 1")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: must be >= 1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="tiny-cpu",
                        help="a profile of env/profiles.toml (tiny-cpu, ada-upstream, community-sm89-fork)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a profile key, parsed by the key's type (lists and env as JSON), "
                             "e.g. --set num_speculative_tokens=0")
    parser.add_argument("--port", type=int, default=None,
                        help="TCP port 1-65535 (default: the profile's port, else a free one; 8000 for "
                             "--print/--artifacts)")
    parser.add_argument("--print", action="store_true",
                        help="print the launch as a bash command (env + argv) and exit")
    parser.add_argument("--artifacts", metavar="DIR",
                        help="write serve.sh, warmup.sh, canary.sh and a systemd unit into DIR and exit")
    parser.add_argument("--bench", action="store_true",
                        help="start with and without MTP, warm up, canary, benchmark; print the table")
    parser.add_argument("--max-tokens", type=int, default=64, help="benchmark: tokens per request (>= 1)")
    parser.add_argument("--requests", type=int, default=8, help="benchmark: number of prompts (>= 1)")
    parser.add_argument("--json", action="store_true", help="benchmark: print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    try:
        return _main(args)
    except SnapshotError as e:
        print(f"ds4lab serve: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    _check_args(args)
    over = _parse_set(args.set)
    if args.artifacts:
        launch = build_launch(args.profile, over, port=args.port or 8000, resolve_model=False)
        files = write_artifacts(launch, args.artifacts, port=args.port or 8000)
        for name, p in files.items():
            print(f"wrote {p}")
        return 0
    if args.print:
        # planning machines usually lack the weights: show the command; the model path is resolved at
        # launch (the "# model:" line says from where)
        print(build_launch(args.profile, over, port=args.port or 8000, resolve_model=False).describe())
        return 0
    if args.bench:
        c = compare(args.profile, over, prompts=make_prompts(args.requests), max_tokens=args.max_tokens)
        if args.json:
            print(json.dumps({"rows": c.rows(), "outputs_identical": c.outputs_identical,
                              "speedup": c.speedup, "startup": c.startup, "logs": c.logs},
                             indent=2, default=str))
        else:
            print(format_table(c.rows()))
            print(f"outputs identical with and without MTP: {c.outputs_identical}; "
                  f"speed-up {c.speedup:.2f}x; logs {' '.join(c.logs.values())}")
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
        with Server(launch) as srv:   # its log: a new file of its own (measure.new_log_path)
            print(f"serving {srv.model} at {srv.url} (Ctrl-C stops; log {srv.log_path})", flush=True)
            while srv.proc is not None and srv.proc.poll() is None:
                time.sleep(1)
            print(f"server exited with {srv.proc.returncode if srv.proc else '?'}:\n{srv.log_tail()}",
                  file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0
