"""``ds4lab.serve``: launch DeepSeek-V4 with MTP speculative decoding from a notebook, and measure it.

- :mod:`ds4lab.config.profiles`: ``ds4lab/config/profiles.toml`` and the settings' types and ranges.
- :mod:`~ds4lab.serve.launch`: profile + overrides -> argv and environment (:func:`build_launch`),
  stale-variable scrubbing; :mod:`~ds4lab.serve.snapshot`: offline HF snapshot resolution.
- :mod:`~ds4lab.serve.server`: the one launcher, :class:`Server`, with a subprocess and an in-process
  variant; progress and heartbeat, start-up numbers, a start that can be interrupted at any point,
  clean stop, a watchdog so nothing outlives a killed notebook kernel; :mod:`~ds4lab.serve.logs`:
  the log file (unique, capped); :mod:`~ds4lab.serve.apikey`: the key beyond loopback.
- :mod:`~ds4lab.serve.startup`: vLLM's start-up log -> :class:`StartupInfo`.
- :mod:`~ds4lab.serve.measure`: warmup, canary, benchmark (tokens/s, TTFT, TPOT, MTP acceptance from
  ``/metrics``) with and without speculation.
- :mod:`~ds4lab.serve.artifacts`: serve.sh, warmup.sh, canary.sh, the API key file and a systemd unit.
- :mod:`~ds4lab.serve.plan` (the planner's verdict per card), :mod:`~ds4lab.serve.machine` (which
  profile fits this machine), :mod:`~ds4lab.serve.cli` (``ds4lab serve``).
- :mod:`ds4lab.views.serve`: plotly charts (the core never imports it).

Never imports ds4lab_kernels: a server process gets kernels only through the vLLM plugin.
"""
from __future__ import annotations

from ds4lab.config.profiles import load_profiles, parse_setting, profile
from ds4lab.serve.artifacts import write_artifacts
from ds4lab.serve.launch import Launch, build_launch, cpu_env, free_port
from ds4lab.serve.logs import new_log_path
from ds4lab.serve.machine import fit_to_machine
from ds4lab.serve.measure import (BenchResult, Comparison, SpecStats, acanary, abenchmark, acompare, awarmup,
                                  canary, benchmark, compare, comparison_rows, acceptance_rows, format_table,
                                  make_prompts, startup_rows)
from ds4lab.serve.plan import plan_cards
from ds4lab.serve.server import InProcessServer, Server, ServerError, SubprocessServer
from ds4lab.serve.snapshot import SnapshotError, resolve_hf_snapshot
from ds4lab.serve.startup import StartupInfo, parse_log, print_progress, stage_rows

__all__ = ["Launch", "build_launch", "cpu_env", "free_port", "profile", "load_profiles", "resolve_hf_snapshot",
           "SnapshotError", "fit_to_machine", "Server", "SubprocessServer", "InProcessServer", "ServerError",
           "StartupInfo", "parse_log", "print_progress", "write_artifacts",
           "awarmup", "acanary", "abenchmark", "acompare", "canary", "benchmark", "compare",
           "comparison_rows", "startup_rows", "new_log_path", "parse_setting", "plan_cards", "acceptance_rows",
           "format_table", "make_prompts", "stage_rows", "BenchResult", "Comparison", "SpecStats"]
