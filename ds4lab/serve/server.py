"""``Server``: start vLLM's OpenAI-compatible server from a :class:`~ds4lab.serve.profiles.Launch`.

Two modes, one object (a context manager, sync or async):

- ``mode="subprocess"`` (default): ``python -m vllm.entrypoints.openai.api_server`` as a child in its
  **own session / process group**, stdout+stderr to a log file (a file, not a pipe: a chatty server
  can never block on a full pipe). Shape of vLLM's ``tests/utils.py::RemoteOpenAIServer``: argv list,
  free port, ``/health`` polling that notices a dead process, terminate-then-kill (of the group).
- ``mode="inprocess"``: vLLM's async ``run_server(args)`` as a task on the **running event loop** of
  the caller (the notebook kernel's: ``await server.astart()`` / ``async with``). vLLM installs
  SIGINT/SIGTERM handlers (``signal.signal`` and ``loop.add_signal_handler``); they are removed and the
  kernel's own handlers restored as soon as the server is up, so the notebook's interrupt button keeps
  interrupting cells. vLLM's ``AsyncLLM`` always runs the EngineCore as a child process (also with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which only slows it down here: see ``inprocess_env``);
  ``--distributed-executor-backend uni`` keeps the worker inside that EngineCore, which is reaped on
  stop. The EngineCore's output and the API server's log records (vLLM's and uvicorn's loggers) go to
  the log file, not into the notebook's cells. Note the kernel's event loop is blocked while
  ``AsyncLLM`` starts its EngineCore (a synchronous handshake), so progress arrives in bursts.

In both modes the log streams through :class:`~ds4lab.serve.startup.StartupParser` (progress and the
start-up numbers, :attr:`Server.startup`) while ``/health`` is polled, and the last log lines are
shown if the server dies. A watchdog (``ds4lab.serve._watchdog``, its own session) kills the server's
process group and every process it spawned when the launching process disappears, also on SIGKILL of
a notebook kernel. Never imports kernels/ (house rule) nor vLLM at module level.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from ds4lab.procgroup import kill_group
from ds4lab.serve.profiles import Launch, build_launch
from ds4lab.serve.startup import ProgressEvent, StartupInfo, StartupParser, print_progress

__all__ = ["Server", "ServerError"]


class _LogStream:
    """Where vLLM's in-process log records go: the running in-process server's log file, else the
    process's original stderr."""

    target = None

    def write(self, s: str) -> int:
        t = self.target or sys.__stderr__
        return t.write(s) if t else 0

    def flush(self) -> None:
        t = self.target or sys.__stderr__
        if t:
            t.flush()


#: ``VLLM_LOGGING_STREAM=ext://ds4lab.serve.server.vllm_log_stream`` during an in-process start
vllm_log_stream = _LogStream()


class ServerError(RuntimeError):
    """The server died or did not become healthy in time (the message ends with its log tail)."""


def _health(url: str, timeout: float = 2.0) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


async def _ahealth(client, url: str) -> bool:
    import httpx

    try:
        return (await client.get(url + "/health", timeout=2.0)).status_code == 200
    except httpx.HTTPError:
        return False


class _LogTail:
    """Incremental reader of a growing log file: feeds whole lines to a parser, keeps the last N."""

    def __init__(self, path: Path, parser: StartupParser, keep: int = 200):
        self.path, self.parser = path, parser
        self.pos = 0
        self.buf = b""
        self.last: collections.deque[str] = collections.deque(maxlen=keep)

    def poll(self, chunk_bytes: int = 8 << 20, max_chunks: int = 32) -> None:
        """Read what was appended since the last call (up to ``max_chunks`` x ``chunk_bytes``)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                for _ in range(max_chunks):
                    chunk = f.read(chunk_bytes)
                    self.pos += len(chunk)
                    self._lines(chunk)
                    if len(chunk) < chunk_bytes:
                        break
        except OSError:
            return

    def _lines(self, chunk: bytes) -> None:
        data = self.buf + chunk
        lines = data.split(b"\n")
        self.buf = lines.pop()
        if len(self.buf) > 1 << 16:  # a giant line without newline: do not keep growing
            lines.append(self.buf)
            self.buf = b""
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            # tqdm bars use \r: the last state is what matters
            line = line.rsplit("\r", 1)[-1] if "\r" in line else line
            self.last.append(line)
            self.parser.feed(line)


class Server:
    """A vLLM OpenAI server for one profile (see module docstring).

    ``Server(build_launch("tiny-cpu"))`` or ``Server(profile="tiny-cpu", overrides={...})``.
    After start: :attr:`url`, :attr:`model` (served name), :attr:`startup` (:class:`StartupInfo`),
    :attr:`ready_s`. ``on_progress`` receives :class:`~ds4lab.serve.startup.ProgressEvent` s
    (default: print a line; ``None``: quiet).
    """

    def __init__(self, launch: Launch | None = None, *, profile: str = "tiny-cpu",
                 overrides: Mapping[str, Any] | None = None, mode: str = "subprocess",
                 log_path: str | os.PathLike | None = None, startup_timeout: float = 900.0,
                 on_progress: Callable[[ProgressEvent], None] | None = print_progress,
                 watchdog: bool = True, uni_executor: bool = True):
        if mode not in ("subprocess", "inprocess"):
            raise ValueError(f"mode {mode!r}: 'subprocess' or 'inprocess'")
        self.launch = launch or build_launch(profile, overrides)
        self.mode = mode
        if log_path is None:  # a new file of our own: a fixed name was truncated by concurrent runs
            from ds4lab.serve.measure import new_log_path

            log_path = new_log_path(self.launch.profile, str(self.launch.port))
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.on_progress = on_progress
        self.use_watchdog = watchdog
        self.uni_executor = uni_executor
        #: extra environment for an in-process start. Not ``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
        #: vLLM 0.32's ``AsyncLLM`` (what ``run_server`` uses) runs the EngineCore as a child process
        #: whatever it says, and the EngineCore inheriting it decoded ~20x slower on the tiny CPU
        #: checkpoint (4.4 vs 81-85 output tok/s, TPOT 210 vs 10-11 ms, measured 2025-11-30).
        self.inprocess_env: dict[str, str] = {}
        self.proc: subprocess.Popen | None = None
        self.task: asyncio.Task | None = None
        self.watchdog: subprocess.Popen | None = None
        self.parser: StartupParser | None = None
        self._tail: _LogTail | None = None
        self._t0 = 0.0
        self._restore: list[Callable[[], None]] = []
        self._engine_children: list = []

    # ---- properties ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.launch.url

    @property
    def model(self) -> str:
        return self.launch.served_model_name

    @property
    def startup(self) -> StartupInfo:
        return self.parser.info if self.parser else StartupInfo()

    @property
    def ready_s(self) -> float | None:
        return self.startup.ready_s

    def log_tail(self, n: int = 40) -> str:
        if self._tail is not None:
            self._tail.poll()
            return "\n".join(list(self._tail.last)[-n:])
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def pids(self) -> list[int]:
        """The server's processes (subprocess: the child and its descendants; in-process: the
        children this server started)."""
        import psutil

        if self.proc is not None:
            try:
                root = psutil.Process(self.proc.pid)
                return [root.pid] + [c.pid for c in root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return []
        return [p.pid for p in self._own_children() if p.is_running()]

    # ---- common start-up pieces ------------------------------------------------------------
    def _begin(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")   # this server's own file (default: unique per Server)
        self._t0 = time.monotonic()
        self._wall0 = time.time()
        self.parser = StartupParser(self.on_progress, t0=self._t0)
        self._tail = _LogTail(self.log_path, self.parser)
        if self.on_progress:
            self.on_progress(ProgressEvent(0.0, "launch", f"{self.mode}: {self.launch.profile} -> {self.url} "
                                                          f"(log {self.log_path})"))

    def _start_watchdog(self, pgid: int | None) -> None:
        if not self.use_watchdog:
            return
        argv = [sys.executable, "-m", "ds4lab.serve._watchdog", "--parent", str(os.getpid()),
                "--since", repr(self._wall0)]
        if pgid:
            argv += ["--pgid", str(pgid)]
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.watchdog = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True, env=env)

    def _stop_watchdog(self) -> None:
        w, self.watchdog = self.watchdog, None
        if w is None:
            return
        try:
            w.stdin.close()  # EOF: it kills whatever is left of ours and exits
        except OSError:
            pass
        try:
            w.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            w.kill()
            w.wait()

    def _check_ready(self, healthy: bool, dead_reason: str | None) -> bool:
        self._tail.poll()
        if dead_reason is not None:
            self._tail.poll()
            raise ServerError(f"{dead_reason}; log {self.log_path}, last lines:\n{self.log_tail()}")
        if healthy:
            self.parser.info.ready_s = round(time.monotonic() - self._t0, 2)
            self.parser.stage = "ready"
            self.parser.info.stages_s["ready"] = self.parser.info.ready_s
            if self.on_progress:
                i = self.parser.info
                nums = ", ".join(f"{k}={v}" for k, v in i.rows() if k in (
                    "weights_gib", "checkpoint_gib", "kv_gib", "kv_tokens", "max_concurrency"))
                self.on_progress(ProgressEvent(i.ready_s, "ready", f"/health 200 after {i.ready_s:.1f} s; {nums}"))
            return True
        if time.monotonic() - self._t0 > self.startup_timeout:
            raise ServerError(f"not healthy after {self.startup_timeout:.0f} s; log {self.log_path}, "
                              f"last lines:\n{self.log_tail()}")
        return False

    # ---- subprocess mode -------------------------------------------------------------------
    def start(self) -> "Server":
        """Start and wait for ``/health`` (blocking). In-process mode needs :meth:`astart`."""
        if self.mode == "inprocess":
            raise RuntimeError("in-process mode runs on the caller's event loop: "
                               "`await server.astart()` or `async with Server(...)`")
        self._begin()
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.launch.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.launch.env,
                                     start_new_session=True)
        self._start_watchdog(self.proc.pid)
        try:
            while True:
                rc = self.proc.poll()
                dead = None if rc is None else f"vLLM server exited with {rc} during start-up"
                if self._check_ready(rc is None and _health(self.url), dead):
                    return self
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 20.0) -> None:
        """Stop the server and everything it started (idempotent)."""
        if self.mode == "inprocess":
            if self.task is not None:
                raise RuntimeError("in-process server: `await server.astop()`")
            return
        p, self.proc = self.proc, None
        if p is not None:
            kill_group(p, grace)
        if getattr(self, "_log", None):
            self._log.close()
            self._log = None
        self._stop_watchdog()
        if self._tail:
            self._tail.poll()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- async face (both modes) -----------------------------------------------------------
    async def astart(self) -> "Server":
        if self.mode == "subprocess":
            return await asyncio.to_thread(self.start)
        return await self._astart_inprocess()

    async def astop(self) -> None:
        if self.mode == "subprocess":
            await asyncio.to_thread(self.stop)
        else:
            await self._astop_inprocess()

    async def __aenter__(self) -> "Server":
        return await self.astart()

    async def __aexit__(self, *exc) -> None:
        await self.astop()

    # ---- in-process mode -------------------------------------------------------------------
    async def _astart_inprocess(self) -> "Server":
        import httpx

        self._begin()
        loop = asyncio.get_running_loop()
        # environment of the launch (restored on stop); engine in-process where vLLM allows it
        env = dict(self.launch.env_overlay)
        env.update(self.inprocess_env)
        env["VLLM_LOGGING_STREAM"] = "ext://ds4lab.serve.server.vllm_log_stream"
        saved_env = {k: os.environ.get(k) for k in list(env) + list(self.launch.unset)}
        for k in self.launch.unset:
            os.environ.pop(k, None)
        os.environ.update(env)
        self._restore.append(lambda: [os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
                                      for k, v in saved_env.items()])
        log = open(self.log_path, "ab", buffering=0)
        self._restore.append(log.close)
        # children (EngineCore) inherit fds 1/2 at spawn: point them at the log during start-up
        saved_fds = (os.dup(1), os.dup(2))
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)

        def restore_fds():
            for fd, s in zip((1, 2), saved_fds):
                os.dup2(s, fd)
                os.close(s)
        fds_restored = False
        saved_sig = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def restore_signals():
            # vLLM's handlers (signal.signal + loop.add_signal_handler): give the kernel its own back
            for s, h in saved_sig.items():
                try:
                    loop.remove_signal_handler(s)
                except (RuntimeError, ValueError, NotImplementedError):
                    pass
                signal.signal(s, h)
        self._children_before = {p.pid for p in _children()}
        try:
            from vllm.entrypoints.launchers.api_server.entry import run_server
            from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
            from vllm.utils.argparse_utils import FlexibleArgumentParser

            self._redirect_vllm_logging(log)
            argv = list(self.launch.server_args)
            if self.uni_executor and "--distributed-executor-backend" not in argv:
                argv += ["--distributed-executor-backend", "uni"]
            args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
            validate_parsed_serve_args(args)
            self._start_watchdog(None)
            self.task = loop.create_task(run_server(args), name=f"ds4lab-vllm-{self.launch.port}")
            async with httpx.AsyncClient() as client:
                while True:
                    dead = None
                    if self.task.done():
                        exc = None if self.task.cancelled() else self.task.exception()
                        dead = f"in-process vLLM server task ended during start-up ({exc!r})"
                    if self._check_ready(dead is None and await _ahealth(client, self.url), dead):
                        break
                    await asyncio.sleep(0.5)
            restore_fds()
            fds_restored = True
            self._swap_vllm_handlers()  # vLLM configured its logging during start-up
            restore_signals()
            self._engine_children = self._own_children()
            return self
        except BaseException:
            if not fds_restored:
                restore_fds()
            restore_signals()
            await self._astop_inprocess()
            raise

    def _redirect_vllm_logging(self, log) -> None:
        """vLLM's log records in this process go to the log file, not into the notebook's cells:
        a fresh vLLM logging config resolves ``VLLM_LOGGING_STREAM`` (``ext://`` this module's
        :data:`vllm_log_stream`); an existing one has its StreamHandlers pointed there."""
        import io

        stream = io.TextIOWrapper(open(os.dup(log.fileno()), "ab", buffering=0), write_through=True)
        vllm_log_stream.target = stream

        def done():
            vllm_log_stream.target = None
            stream.close()
        self._restore.append(done)
        self._swap_vllm_handlers()

    def _swap_vllm_handlers(self) -> None:
        for name in ("vllm", "uvicorn", "uvicorn.access", "uvicorn.error"):
            for h in logging.getLogger(name).handlers:
                if type(h) is logging.StreamHandler and h.stream is not vllm_log_stream:
                    old = h.setStream(vllm_log_stream)
                    self._restore.append(lambda h=h, old=old: h.setStream(old))

    def _own_children(self) -> list:
        before = getattr(self, "_children_before", set())
        return [p for p in _children() if p.pid not in before and _not_tracker(p)]

    async def _astop_inprocess(self, grace: float = 20.0) -> None:
        import psutil

        t, self.task = self.task, None
        if t is not None and not t.done():
            t.cancel()
            try:
                await asyncio.wait_for(asyncio.shield(t), timeout=grace)
            except BaseException:  # noqa: BLE001 - cancelled / timed out / server error: reap below
                pass
        procs = [p for p in set(self._own_children()) | set(self._engine_children)]
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = await asyncio.to_thread(psutil.wait_procs, procs, 10)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        await asyncio.to_thread(psutil.wait_procs, alive, 5)
        self._engine_children = []
        self._stop_watchdog()
        while self._restore:
            try:
                self._restore.pop()()
            except Exception:  # noqa: BLE001
                pass
        if self._tail:
            self._tail.poll()


def _children() -> list:
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.NoSuchProcess:  # pragma: no cover
        return []


def _not_tracker(p) -> bool:
    try:
        return "resource_tracker" not in " ".join(p.cmdline()) and "ds4lab.serve._watchdog" not in " ".join(p.cmdline())
    except Exception:  # noqa: BLE001
        return False


