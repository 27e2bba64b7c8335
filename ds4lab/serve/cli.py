"""``ds4lab serve``: a thin face over :mod:`ds4lab.serve` (``add_arguments`` / ``main``).

``--print`` and ``--artifacts`` show or write the launch; ``--bench`` runs the MTP comparison; with
neither, the server runs until Ctrl-C / SIGTERM (exit status 130 / 143, the server stopped) or until
it dies (exit status 1, its log tail on stderr). The port is chosen before anything is printed: the
profile's, else 8000 (vLLM's default), the same for ``--print`` and the run.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from ds4lab.config.profiles import parse_setting
from ds4lab.serve.artifacts import write_artifacts
from ds4lab.serve.launch import Launch, build_launch
from ds4lab.serve.measure import compare, format_table, make_prompts
from ds4lab.serve.plan import plan_cards
from ds4lab.serve.server import Server
from ds4lab.serve.snapshot import SnapshotError

__all__ = ["add_arguments", "main", "DEFAULT_PORT"]

#: the CLI's port when neither --port nor the profile gives one (vLLM's own default)
DEFAULT_PORT = 8000


def _parse_set(items: list[str]) -> dict:
    """``--set KEY=VALUE`` items -> overrides, each VALUE parsed by its key's type and range-checked
    (:func:`~ds4lab.config.profiles.parse_setting`); ValueError naming the item otherwise."""
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
                         f"else {DEFAULT_PORT})")
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
    """The planner's verdict (:func:`~ds4lab.serve.plan.plan_cards`) as ``# plan`` comment lines
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
                        help="TCP port 1-65535 (default: the profile's port, else 8000; --print and the "
                             "run use the same)")
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


def _port(args: argparse.Namespace, over: dict) -> int:
    """--port, else the profile's (or --set port=), else :data:`DEFAULT_PORT`: chosen before
    anything is printed, so ``--print`` shows the port the run listens on."""
    from ds4lab.config.profiles import profile

    return int(args.port or over.get("port") or profile(args.profile).get("port") or DEFAULT_PORT)


def _check_port_free(launch: Launch) -> None:
    """ValueError naming --port when the launch's address is taken (vLLM would fail after ~30 s)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in launch.host else socket.AF_INET) as s:
        try:
            s.bind((launch.host, launch.port))
        except OSError as e:
            raise ValueError(f"--port {launch.port}: {launch.host}:{launch.port} is not free ({e.strerror}); "
                             "pass another --port") from None


def _main(args: argparse.Namespace) -> int:
    _check_args(args)
    over = _parse_set(args.set)
    port = _port(args, over)
    if args.artifacts:
        launch = build_launch(args.profile, over, port=port, resolve_model=False)
        files = write_artifacts(launch, args.artifacts, port=port)
        for name, p in files.items():
            print(f"wrote {p}")
        _print_plan(launch, plan_cards(launch.settings, args.gpu), args.gpu)
        return 0
    if args.print:
        # planning machines usually lack the weights: show the command; the model path is resolved at
        # launch (the "# model:" line says from where)
        launch = build_launch(args.profile, over, port=port, resolve_model=False)
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
                  f"speed-up {c.speedup:.2f}x" + (f"; logs {' '.join(c.logs.values())}" if c.logs else ""))
        return 0
    return _run(build_launch(args.profile, over, port=port))


def _run(launch: Launch) -> int:
    """Serve until Ctrl-C / SIGTERM (130 / 143, the server stopped first) or the server's death (1)."""
    _check_port_free(launch)
    print(launch.describe(), flush=True)
    got: list[int] = []

    def _interrupt(signum, _frame):
        got.append(signum)
        raise KeyboardInterrupt

    # SIGTERM (systemd, kill) and SIGINT (also when started with SIGINT ignored, e.g. `cmd &`)
    # both stop the server group cleanly, during start-up too
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        with Server(launch) as srv:   # its log: a new file of its own (logs.new_log_path)
            print(f"serving {srv.model} at {srv.url} (Ctrl-C stops; log {srv.log_path})", flush=True)
            while srv.proc is not None and srv.proc.poll() is None:
                time.sleep(1)
            print(f"server exited with {srv.proc.returncode if srv.proc else '?'}:\n{srv.log_tail()}",
                  file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("ds4lab serve: stopped", file=sys.stderr, flush=True)
        return 128 + (got[-1] if got else signal.SIGINT)
