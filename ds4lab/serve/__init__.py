"""``ds4lab.serve``: launch DeepSeek-V4 with MTP speculative decoding from a notebook, and measure it.

- :mod:`~ds4lab.serve.profiles`: ``ds4lab/config/profiles.toml`` profile + overrides -> argv and environment
  (:func:`build_launch`), stale-variable scrubbing, offline HF snapshot resolution.
- :mod:`~ds4lab.serve.server`: :class:`Server`, subprocess or in-process, progress, start-up numbers,
  clean stop, a watchdog so nothing outlives a killed notebook kernel.
- :mod:`~ds4lab.serve.startup`: vLLM's start-up log -> :class:`StartupInfo`.
- :mod:`~ds4lab.serve.measure`: warmup, canary, benchmark (tokens/s, TTFT, TPOT, MTP acceptance from
  ``/metrics``) with and without speculation.
- :mod:`~ds4lab.serve.artifacts`: serve.sh, warmup.sh, canary.sh and a systemd unit from the profile.
- :mod:`~ds4lab.views.serve`: plotly charts (the core never imports it).

CLI ``ds4lab serve`` (this module's :func:`add_arguments` / :func:`main`) is a thin face over them.
Never imports kernels/: a server process gets kernels only through the vLLM plugin.
"""
from __future__ import annotations

import argparse
import json
import sys

from ds4lab.serve.artifacts import write_artifacts
from ds4lab.serve.measure import (BenchResult, Comparison, SpecStats, acanary, abenchmark, acompare, awarmup,
                      canary, benchmark, compare, comparison_rows, acceptance_rows, format_table,
                      make_prompts, new_log_path, startup_rows)
from ds4lab.serve.profiles import (Launch, SnapshotError, build_launch, fit_to_machine, load_profiles, parse_setting,
                       plan_cards, profile, resolve_hf_snapshot)
from ds4lab.serve.server import Server, ServerError
from ds4lab.serve.startup import StartupInfo, parse_log, print_progress

__all__ = ["Launch", "build_launch", "profile", "load_profiles", "resolve_hf_snapshot", "SnapshotError",
           "fit_to_machine", "Server", "ServerError", "StartupInfo", "parse_log", "print_progress", "write_artifacts",
           "awarmup", "acanary", "abenchmark", "acompare", "canary", "benchmark", "compare",
           "comparison_rows", "startup_rows", "new_log_path", "parse_setting", "plan_cards", "acceptance_rows", "format_table", "make_prompts", "BenchResult", "Comparison", "SpecStats",
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
    if args.gpu is not None:
        from ds4lab.planner.memory import GPUS, resolve_gpu

        try:
            resolve_gpu(args.gpu)
        except ValueError:
            raise ValueError(f"--gpu {args.gpu!r}: unknown card; known: {sorted(GPUS)}") from None


def _first_sentence(text: str) -> str:
    return text.split(". ", 1)[0].rstrip(".")


def _print_plan(launch: Launch, rows: list[dict], gpu: str | None) -> None:
    """The planner's verdict (:func:`~ds4lab.serve.profiles.plan_cards`) as ``# plan`` comment lines
    (the --print output stays pasteable), and a warning on stderr for each card where vLLM would
    not start. A warning, never a refusal: the planner models vLLM, the real card may differ. Cards
    of the stack's capability too small for the weights are listed on one line without a warning
    unless asked for with ``--gpu``."""
    if not rows:
        if gpu:
            print(f"# plan: not planned ({launch.profile} runs the tiny checkpoint on a CPU stack)")
        return
    s = launch.settings
    print(f"# plan (ds4lab.planner.memory.plan_for_profile; TP={s.get('tensor_parallel_size', 1)}, "
          f"max_model_len {s.get('max_model_len')}, max_num_seqs {s.get('max_num_seqs', 1)}):")
    small = [r for r in rows if r["load_oom"] and not r["named"]]
    for r in rows:
        if r in small:
            continue
        line = (f"#   {r['gpu']} at util {r['util']}: " + (
            f"starts, KV holds {r['max_concurrency']}x max_model_len" if r["starts"] else
            f"{r['outcome'].upper()}: {_first_sentence(r['verdict'])}"))   # the planner's wording
        if "watched_util" in r:
            line += f"; watched util {r['watched_util']}: " + (
                "starts" if r["watched_starts"] else r["watched_outcome"].upper()
                if r["watched_verdict"] == r["verdict"]
                else f"{r['watched_outcome'].upper()}: {_first_sentence(r['watched_verdict'])}")
        print(line)
        if not r["starts"]:
            print(f"ds4lab serve: warning: profile {launch.profile} would not start on {r['gpu']} at "
                  f"gpu_memory_utilization {r['util']} (planner; `ds4lab plan` shows why and what works): "
                  f"{_first_sentence(r['verdict'])}", file=sys.stderr)
    if small:
        print("#   not for " + ", ".join(r["gpu"] for r in small) + ": the weights alone do not fit ("
              + _first_sentence(small[0]["verdict"]).split(": ", 1)[-1] + ")")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="tiny-cpu",
                        help="a profile of ds4lab/config/profiles.toml (tiny-cpu, ada-upstream, community-sm89-fork)")
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
    parser.add_argument("--gpu", default=None, metavar="CARD",
                        help="--print/--artifacts: plan the profile on this card (a `ds4lab plan --gpu` key; "
                             "default: the profile's gpu key, else every planner card of its stack's capability); "
                             "a card where vLLM would not start is a warning")
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
        _print_plan(launch, plan_cards(launch.settings, args.gpu), args.gpu)
        return 0
    if args.print:
        # planning machines usually lack the weights: show the command; the model path is resolved at
        # launch (the "# model:" line says from where)
        launch = build_launch(args.profile, over, port=args.port or 8000, resolve_model=False)
        rows = plan_cards(launch.settings, args.gpu)
        print(launch.describe())
        _print_plan(launch, rows, args.gpu)
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
