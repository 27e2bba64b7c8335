"""vLLM start-up log -> progress stages and the start-up numbers (:class:`StartupInfo`).

Every pattern is one of vLLM 0.32's own log strings (file:function in the comment); the parser is fed
line by line while the log streams (:meth:`StartupParser.feed`) and calls ``on_progress`` when a
stage starts or a number is found. No view imports: progress is a callback, the default one prints
one text line per event.
"""
from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

__all__ = ["StartupInfo", "StartupParser", "ProgressEvent", "print_progress", "STAGES", "parse_log", "stage_rows"]

#: start-up stages in order (progress shows the current one)
STAGES = ("launch", "weights", "kv_cache", "graph_capture", "warmup", "api", "ready")

_NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"


def _f(s: str) -> float:
    return float(s.replace(",", ""))


# (stage, regex, fields) - fields are StartupInfo attributes filled from the groups, in order
_PATTERNS: list[tuple[str, re.Pattern, tuple[str, ...]]] = [
    # v1/worker/{gpu,cpu}_model_runner.py load_model: "Starting to load model %s..."
    ("weights", re.compile(r"Starting to load model"), ()),
    # model_executor/model_loader/weight_utils.py (CPU and GPU): "... Checkpoint size: %.2f GiB."
    ("weights", re.compile(r"Checkpoint size: " + _NUM + r" GiB"), ("checkpoint_gib",)),
    # model_executor/model_loader/default_loader.py: "Loading weights took %.2f seconds"
    ("weights", re.compile(r"Loading weights took " + _NUM + r" seconds"), ("weights_load_s",)),
    # v1/worker/gpu_model_runner.py: "Model loading took %s GiB memory and %.6f seconds"
    ("weights", re.compile(r"Model loading took " + _NUM + r" GiB memory and " + _NUM + r" seconds"),
     ("weights_gib", "weights_load_s")),
    # v1/worker/gpu_worker.py determine_available_memory: "Available KV cache memory: %s GiB"
    ("kv_cache", re.compile(r"Available KV cache memory: " + _NUM + r" GiB"), ("kv_gib",)),
    # v1/worker/cpu_worker.py: "Explicitly set (%s/%s) GiB for KV cache" / "Auto set (%s/%s) GiB ..."
    ("kv_cache", re.compile(r"(?:Explicitly|Auto) set \(" + _NUM + "/" + _NUM + r"\) GiB for KV cache"),
     ("kv_gib", "host_memory_gib")),
    # v1/core/kv_cache_utils.py update_kv_cache_capacity:
    # "%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx"
    ("kv_cache", re.compile(r"KV cache size: " + _NUM + r" tokens, Maximum concurrency for " + _NUM
                            + r" tokens per request: " + _NUM + "x"),
     ("kv_tokens", "max_model_len", "max_concurrency")),
    # compilation/monitor.py: "%storch.compile took %.2f s in total"
    ("graph_capture", re.compile(r"torch\.compile took " + _NUM + r" s in total"), ("compile_s",)),
    # v1/worker/gpu_model_runner.py capture_model progress bar "Capturing CUDA graphs (...)"
    ("graph_capture", re.compile(r"Capturing CUDA graphs"), ()),
    # v1/worker/gpu_model_runner.py: "Graph capturing finished in %.0f secs, took %.2f GiB"
    ("graph_capture", re.compile(r"Graph capturing finished in " + _NUM + r" secs, took " + _NUM + " GiB"),
     ("graph_capture_s", "graph_gib")),
    # v1/worker/gpu_worker.py: "Compile and warming up model for size %d";
    # v1/worker/cpu_model_runner.py: "Warming up model for the compilation..." / "Warming up done."
    ("warmup", re.compile(r"Compile and warming up model for size|Warming up model for the compilation"), ()),
    # v1/engine/core.py: "init engine (profile, create kv cache, warmup model) took %.2f s"
    ("api", re.compile(r"init engine \(profile, create kv cache, warmup model\) took " + _NUM + " s"),
     ("init_engine_s",)),
    # entrypoints/launchers/api_server/entry.py: "Starting vLLM server on %s"
    ("api", re.compile(r"Starting vLLM server on (\S+)"), ("listen_address",)),
    # uvicorn
    ("ready", re.compile(r"Application startup complete"), ()),
]
#: a line is looked at only if it contains one of these (substring tests are cheap)
_KEYWORDS = ("load model", "Checkpoint size", "Loading weights", "Model loading", "KV cache",
             "torch.compile", "Capturing CUDA", "Graph capturing", "arming up", "init engine",
             "Starting vLLM server", "Application startup", "Traceback", "ERROR", "Error", "out of memory")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_INT_FIELDS = {"kv_tokens", "max_model_len"}
_ERROR = re.compile(r"(Traceback \(most recent call last\)|\bERROR\b|Error: |out of memory)")


@dataclass
class StartupInfo:
    """The numbers vLLM prints while it starts (None: not printed by this platform/version).

    GPU boxes print ``weights_gib`` (model memory) and ``kv_gib`` ("Available KV cache memory");
    the CPU worker prints the checkpoint size and the KV bytes it was given.
    """

    weights_gib: float | None = None
    checkpoint_gib: float | None = None
    weights_load_s: float | None = None
    kv_gib: float | None = None
    host_memory_gib: float | None = None
    kv_tokens: int | None = None
    max_model_len: int | None = None
    max_concurrency: float | None = None
    compile_s: float | None = None
    graph_capture_s: float | None = None
    graph_gib: float | None = None
    init_engine_s: float | None = None
    listen_address: str | None = None
    ready_s: float | None = None          # launch -> /health 200 (set by the Server)
    stages_s: dict[str, float] = field(default_factory=dict)   # stage -> seconds after launch
    errors: list[str] = field(default_factory=list)             # first error lines seen

    def as_dict(self) -> dict:
        return asdict(self)

    def rows(self) -> list[tuple[str, object]]:
        """(name, value) rows of the numbers that were found, for a text table."""
        return [(k, v) for k, v in asdict(self).items()
                if v is not None and k not in ("stages_s", "errors")]


@dataclass
class ProgressEvent:
    t: float            # seconds since launch
    stage: str
    message: str        # the log line (trimmed) or a summary


def print_progress(ev: ProgressEvent) -> None:
    """Default progress view: one text line per event."""
    print(f"[{ev.t:6.1f}s] {ev.stage:<13} {ev.message}", flush=True)


class StartupParser:
    """Feed log lines; keeps :attr:`info`, :attr:`stage` and calls ``on_progress`` on events."""

    def __init__(self, on_progress: Callable[[ProgressEvent], None] | None = None,
                 t0: float | None = None):
        self.info = StartupInfo()
        self.stage = "launch"
        self.on_progress = on_progress
        self.t0 = time.monotonic() if t0 is None else t0
        self._first: set[str] = set()

    def feed(self, line: str) -> None:
        line = _ANSI.sub("", line[:4096]).rstrip()   # vLLM colours its log when it thinks it may
        if not line or not any(k in line for k in _KEYWORDS):  # cheap filter: chatty logs are long
            return
        for stage, rx, fields in _PATTERNS:
            m = rx.search(line)
            if not m:
                continue
            new = False
            for name, val in zip(fields, m.groups()):
                if getattr(self.info, name) is None:   # first value wins (the drafter repeats some)
                    setattr(self.info, name, val if name == "listen_address" else
                            (int(_f(val)) if name in _INT_FIELDS else _f(val)))
                    new = True
            if STAGES.index(stage) > STAGES.index(self.stage):
                self.stage = stage
                self.info.stages_s.setdefault(stage, round(time.monotonic() - self.t0, 2))
                new = True
            if new:
                self._emit(stage, _trim(line))
            return
        if _ERROR.search(line) and len(self.info.errors) < 20 and "DeprecationWarning" not in line:
            self.info.errors.append(_trim(line))

    def _emit(self, stage: str, msg: str) -> None:
        if self.on_progress is not None:
            self.on_progress(ProgressEvent(round(time.monotonic() - self.t0, 2), stage, msg))


def _trim(line: str, n: int = 160) -> str:
    # drop vLLM's "(Worker pid=1) INFO 11-30 00:22:46 [file.py:12] " prefix
    m = re.search(r"\] (.*)$", line)
    s = m.group(1) if m and "[" in line[:80] else line
    return s if len(s) <= n else s[: n - 3] + "..."


def parse_log(text: str) -> StartupInfo:
    """Parse a whole log (e.g. a finished server's file)."""
    p = StartupParser()
    for line in text.splitlines():
        p.feed(line)
    return p.info


def stage_rows(info: "StartupInfo | dict") -> list[dict]:
    """The start-up as consecutive stages (a waterfall): one row per stage seen, in order, with
    ``start_s`` (seconds after launch when vLLM's log entered it), ``seconds`` (until the next stage
    began; the last, ``ready``, has 0) and ``end_s``. ``info``: a :class:`StartupInfo` or its
    ``as_dict()``. The launch stage starts at 0."""
    stages = dict(info["stages_s"] if isinstance(info, dict) else info.stages_s)
    stages.setdefault("launch", 0.0)
    st = sorted(stages.items(), key=lambda kv: (kv[1], STAGES.index(kv[0]) if kv[0] in STAGES else 99))
    rows = []
    for i, (name, t0) in enumerate(st):
        t1 = st[i + 1][1] if i + 1 < len(st) else t0
        rows.append({"stage": name, "start_s": round(t0, 2), "seconds": round(t1 - t0, 2), "end_s": round(t1, 2)})
    return rows
