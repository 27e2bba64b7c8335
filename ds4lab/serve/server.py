"""The one server launcher: start vLLM's OpenAI-compatible server from a :class:`~ds4lab.serve.launch.Launch`.

Shaped like vLLM's ``tests/utils.py::RemoteOpenAIServer`` (argv list, free port, ``/health`` polling
that notices a dead process, terminate-then-kill), with one base class and a subclass per variant
(as ``RemoteOpenAIServerCustom`` overrides ``_start_server`` and ``_poll``), not ``if mode`` branches:

- :class:`Server` (the base): the life cycle both variants share. A new log file per run
  (:mod:`ds4lab.serve.logs`), the start-up parser (progress, :attr:`Server.startup`), a heartbeat
  every ``heartbeat_s`` (elapsed time and the last stage/log line), the ``/health`` poll, the log tail
  in every error, a watchdog process (:mod:`ds4lab.serve._watchdog`, its own session) that kills the
  server's processes when the launching process disappears (also on SIGKILL of a notebook kernel)
  and caps the log (head + tail), and the API key (:mod:`ds4lab.serve.apikey`) passed through the
  environment. ``Server(launch, mode="inprocess")`` returns the subclass for ``mode`` (as
  ``pathlib.Path()`` returns a ``PosixPath``).
- :class:`SubprocessServer` (``mode="subprocess"``, default): ``python -m vllm.entrypoints.openai.api_server``
  as a child in its **own session / process group**, stdout+stderr to the log file (a file, not a
  pipe: a chatty server can never block on a full pipe).
- :class:`InProcessServer` (``mode="inprocess"``): vLLM's async ``run_server(args)`` as a task on the
  **running event loop** of the caller (the notebook kernel's). vLLM installs SIGINT/SIGTERM handlers;
  they are removed and the kernel's own restored as soon as the server is up. vLLM's ``AsyncLLM``
  always runs the EngineCore as a child process; ``--distributed-executor-backend uni`` keeps the
  worker inside it. The kernel's event loop is blocked while ``AsyncLLM`` starts its EngineCore (a
  synchronous handshake), so progress arrives in bursts.

**Start-up is cancellable and never leaves an orphan.** :meth:`Server.astart` polls on the event loop
(no thread that a cancellation cannot reach): a cancelled task (Jupyter's interrupt button cancels
the cell's coroutine), a KeyboardInterrupt or any error at any point of the start tears the launch
down (the whole process group, then every descendant psutil still sees) before the exception leaves,
and prints ``interrupted; server stopped``. ``async with`` does the same for an interrupt after
``/health``. A log file the launcher created is removed when a run ends well and kept (its path
printed) when it fails. Never imports ds4lab_kernels (house rule) nor vLLM at module level.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from ds4lab.procgroup import kill_group
from ds4lab.serve.apikey import read_api_key
from ds4lab.serve.launch import Launch, build_launch
from ds4lab.serve.logs import DEFAULT_LOG_CAP, LogTail, new_log_path
from ds4lab.serve.startup import ProgressEvent, StartupInfo, StartupParser, print_progress

__all__ = ["Server", "SubprocessServer", "InProcessServer", "ServerError", "INTERRUPTED"]

#: what a cancelled / interrupted start (or a cancelled ``async with`` body) prints once torn down
INTERRUPTED = "interrupted; server stopped"


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


def _interrupt(exc: BaseException) -> bool:
    return isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt))


class Server:
    """A vLLM OpenAI server for one launch (see the module docstring); the base of the variants.

    ``Server(build_launch("tiny-cpu"))`` or ``Server(profile="tiny-cpu", overrides={...})``;
    ``mode`` picks the subclass. After start: :attr:`url`, :attr:`model` (served name),
    :attr:`api_key` (None on loopback without a key file), :attr:`startup` (:class:`StartupInfo`),
    :attr:`ready_s`. ``on_progress`` receives :class:`~ds4lab.serve.startup.ProgressEvent` s
    (default: print a line; ``None``: quiet); ``heartbeat_s``: seconds between heartbeat events
    while nothing else is said (0: none). ``log_cap``: bytes the log may grow to (head and tail kept).
    Subclasses implement :meth:`_spawn` (sync) / :meth:`_aspawn`, :meth:`_poll` (why the server is
    dead, or None), :meth:`stop` / :meth:`astop` and :meth:`pids`.
    """

    mode = "base"
    _MODES: dict[str, type["Server"]] = {}

    def __new__(cls, *args: Any, mode: str | None = None, **kw: Any):
        if cls is Server:
            mode = mode or "subprocess"
            if mode not in Server._MODES:
                raise ValueError(f"mode {mode!r}: {' or '.join(repr(m) for m in Server._MODES)}")
            cls = Server._MODES[mode]
        elif mode is not None and mode != cls.mode:
            raise ValueError(f"mode {mode!r}: {cls.__name__} is mode {cls.mode!r}")
        return super().__new__(cls)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        Server._MODES[cls.mode] = cls

    def __init__(self, launch: Launch | None = None, *, profile: str = "tiny-cpu",
                 overrides: Mapping[str, Any] | None = None, mode: str | None = None,
                 log_path: str | os.PathLike | None = None, startup_timeout: float = 900.0,
                 on_progress: Callable[[ProgressEvent], None] | None = print_progress,
                 watchdog: bool = True, uni_executor: bool = True, heartbeat_s: float = 5.0,
                 log_cap: int = DEFAULT_LOG_CAP):
        self.launch = launch or build_launch(profile, overrides)
        #: the launcher created the log (a new file in the temp folder): removed when the run ends well
        self.own_log = log_path is None
        if log_path is None:  # a new file of our own: a fixed name was truncated by concurrent runs
            log_path = new_log_path(self.launch.profile, str(self.launch.port))
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.on_progress = on_progress
        self.heartbeat_s = heartbeat_s
        if isinstance(log_cap, bool) or not isinstance(log_cap, int) or log_cap < 4096:
            raise ValueError(f"log_cap={log_cap!r}: must be an integer >= 4096 (bytes)")
        self.log_cap = log_cap
        self.use_watchdog = watchdog
        self.uni_executor = uni_executor
        key_file = self.launch.settings.get("api_key_file")
        self.api_key: str | None = read_api_key(os.path.expanduser(key_file)) if key_file else None
        self.watchdog: subprocess.Popen | None = None
        self.parser: StartupParser | None = None
        self._tail: LogTail | None = None
        self._t0 = 0.0
        self._said = 0.0
        self._healthy = False
        self._failed = False

    # ---- properties ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.launch.url

    @property
    def model(self) -> str:
        return self.launch.served_model_name

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers a client sends (the bearer key when there is one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

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
        """The server's processes."""
        raise NotImplementedError

    def tree_rss(self) -> int:
        """Resident set size in bytes summed over the server's processes (psutil)."""
        import psutil

        total = 0
        for pid in self.pids():
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    # ---- what a variant provides -----------------------------------------------------------
    def _spawn(self) -> None:
        raise RuntimeError(f"{type(self).__name__} runs on the caller's event loop: "
                           "`await server.astart()` or `async with Server(...)`")

    async def _aspawn(self) -> None:
        self._spawn()

    def _poll(self) -> str | None:
        """Why the server is gone (it exited), or None while it lives."""
        raise NotImplementedError

    def _child_env(self) -> dict[str, str]:
        """The launch's environment plus the API key (environment only: never argv, never the log)."""
        env = dict(self.launch.env)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        return env

    # ---- the shared life cycle -------------------------------------------------------------
    def _begin(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")   # this server's own file (default: unique per Server)
        self._t0 = self._said = time.monotonic()
        self._wall0 = time.time()
        self._healthy = self._failed = False
        self.parser = StartupParser(self._progress, t0=self._t0)
        self._tail = LogTail(self.log_path, self.parser)
        self._progress(ProgressEvent(0.0, "launch", f"{self.mode}: {self.launch.profile} -> {self.url} "
                                                    f"(log {self.log_path})"))

    def _progress(self, ev: ProgressEvent) -> None:
        self._said = time.monotonic()
        if self.on_progress:
            self.on_progress(ev)

    def _heartbeat(self) -> None:
        """Say something every ``heartbeat_s`` while the log says nothing new: elapsed time, the
        current stage and the last non-empty log line."""
        now = time.monotonic()
        if not self.heartbeat_s or now - self._said < self.heartbeat_s:
            return
        last = next((ln.strip() for ln in reversed(self._tail.last) if ln.strip()), "(nothing yet)")
        if len(last) > 120:
            last = last[:117] + "..."
        self._progress(ProgressEvent(round(now - self._t0, 1), "heartbeat",
                                     f"{now - self._t0:.0f} s, stage {self.parser.stage}; log: {last}"))

    def _start_watchdog(self, pgid: int | None) -> None:
        if not self.use_watchdog:
            return
        argv = [sys.executable, "-m", "ds4lab.serve._watchdog", "--parent", str(os.getpid()),
                "--since", repr(self._wall0), "--log", str(self.log_path), "--log-cap", str(self.log_cap)]
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
            self._healthy = True
            i = self.parser.info
            nums = ", ".join(f"{k}={v}" for k, v in i.rows() if k in (
                "weights_gib", "checkpoint_gib", "kv_gib", "kv_tokens", "max_concurrency"))
            self._progress(ProgressEvent(i.ready_s, "ready", f"/health 200 after {i.ready_s:.1f} s; {nums}"))
            return True
        if time.monotonic() - self._t0 > self.startup_timeout:
            raise ServerError(f"not healthy after {self.startup_timeout:.0f} s; log {self.log_path}, "
                              f"last lines:\n{self.log_tail()}")
        self._heartbeat()
        return False

    def _failed_start(self, exc: BaseException) -> None:
        """After the teardown of a start that did not finish: say so (and where the log is)."""
        self._failed = True
        if _interrupt(exc):
            print(f"{INTERRUPTED} (its processes are gone; log kept: {self.log_path})", flush=True)

    def _finish(self, well: bool) -> None:
        """After a stop: remove the log the launcher created when the run ended well, else say where it is."""
        if self._tail:
            self._tail.poll()
        if not self.own_log:
            return
        if well and self._healthy and not self._failed:
            self.log_path.unlink(missing_ok=True)
        elif self._healthy or self._failed:
            print(f"server log kept: {self.log_path}", file=sys.stderr, flush=True)

    def start(self) -> "Server":
        """Start and wait for ``/health`` (blocking). On any exception (KeyboardInterrupt included)
        the launch is torn down before it propagates."""
        self._begin()
        try:
            self._spawn()
            while True:
                dead = self._poll()
                if self._check_ready(dead is None and _health(self.url), dead):
                    return self
                time.sleep(0.5)
        except BaseException as e:
            self.stop()
            self._failed_start(e)
            raise

    async def astart(self) -> "Server":
        """Start and wait for ``/health`` on the running loop, cancellable at every point: a
        cancellation, KeyboardInterrupt or error tears the launch down before it propagates."""
        import httpx

        self._begin()
        try:
            await self._aspawn()
            async with httpx.AsyncClient() as client:
                while True:
                    dead = self._poll()
                    if self._check_ready(dead is None and await _ahealth(client, self.url), dead):
                        return self
                    await asyncio.sleep(0.5)
        except BaseException as e:
            await self._teardown()
            self._failed_start(e)
            raise

    async def _teardown(self) -> None:
        """Stop whatever was started, to the end even if the caller is cancelled again meanwhile."""
        t = asyncio.ensure_future(self.astop())
        try:
            await asyncio.shield(t)
        except BaseException:  # cancelled again: finish the stop before letting go
            while not t.done():
                try:
                    await asyncio.shield(t)
                except BaseException:  # noqa: BLE001
                    pass

    def stop(self, grace: float = 20.0) -> None:
        raise NotImplementedError

    async def astop(self) -> None:
        self.stop()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if exc[1] is not None and _interrupt(exc[1]):
            print(INTERRUPTED, flush=True)

    async def __aenter__(self) -> "Server":
        return await self.astart()

    async def __aexit__(self, *exc) -> None:
        await self._teardown()
        if exc[1] is not None and _interrupt(exc[1]):
            print(INTERRUPTED, flush=True)


class SubprocessServer(Server):
    """``python -m vllm.entrypoints.openai.api_server`` as a child in its own session (process group)."""

    mode = "subprocess"

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.proc: subprocess.Popen | None = None
        self._log = None

    def _spawn(self) -> None:
        self._log = open(self.log_path, "ab")   # O_APPEND: the watchdog may cap the file under it
        self.proc = subprocess.Popen(self.launch.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self._child_env(),
                                     start_new_session=True)
        self._start_watchdog(self.proc.pid)

    def _poll(self) -> str | None:
        rc = self.proc.poll()
        return None if rc is None else f"vLLM server exited with {rc} during start-up"

    def pids(self) -> list[int]:
        """The child and its descendants."""
        import psutil

        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, grace: float = 20.0) -> None:
        """Stop the server and everything it started (idempotent): SIGTERM the group, wait
        ``grace`` s, SIGKILL it, reap the child, kill descendants that left the group."""
        p, self.proc = self.proc, None
        well = p is not None and p.poll() is None
        if p is not None:
            kill_group(p, grace)
        if self._log:
            self._log.close()
            self._log = None
        self._stop_watchdog()
        if p is not None:
            self._finish(well)

    async def astop(self) -> None:
        # synchronous on purpose: nothing may cancel a teardown half-way (kill_group waits <= grace s)
        self.stop()


class InProcessServer(Server):
    """vLLM's ``run_server`` as a task on the caller's running event loop (needs :meth:`astart`)."""

    mode = "inprocess"

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        #: extra environment for an in-process start. Not ``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
        #: vLLM 0.32's ``AsyncLLM`` (what ``run_server`` uses) runs the EngineCore as a child process
        #: whatever it says, and the EngineCore inheriting it decoded ~20x slower on the tiny CPU
        #: checkpoint (4.4 vs 81-85 output tok/s, TPOT 210 vs 10-11 ms, measured 2025-11-30).
        self.inprocess_env: dict[str, str] = {}
        self.task: asyncio.Task | None = None
        self._restore: list[Callable[[], None]] = []
        self._engine_children: list = []
        self._children_before: set[int] = set()

    def start(self) -> "Server":
        self._spawn()   # raises: this variant needs the caller's event loop
        return self

    def stop(self, grace: float = 20.0) -> None:
        if self.task is not None:
            raise RuntimeError("in-process server: `await server.astop()`")

    def _poll(self) -> str | None:
        if self.task is None or not self.task.done():
            return None
        exc = None if self.task.cancelled() else self.task.exception()
        return f"in-process vLLM server task ended during start-up ({exc!r})"

    def pids(self) -> list[int]:
        """The children this server started (EngineCore)."""
        return [p.pid for p in self._own_children() if p.is_running()]

    async def astart(self) -> "Server":
        srv = await super().astart()
        self._after_ready()
        return srv

    async def astop(self) -> None:
        await self._astop_inprocess()

    async def _aspawn(self) -> None:
        loop = asyncio.get_running_loop()
        # environment of the launch (restored on stop); engine in-process where vLLM allows it
        env = dict(self.launch.env_overlay)
        env.update(self.inprocess_env)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
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
        saved_fds = [os.dup(1), os.dup(2)]
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        saved_sig = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def restore_fds():
            while saved_fds:
                fd, s = 3 - len(saved_fds), saved_fds.pop(0)
                os.dup2(s, fd)
                os.close(s)

        def restore_signals():
            # vLLM's handlers (signal.signal + loop.add_signal_handler): give the kernel its own back
            for s, h in saved_sig.items():
                try:
                    loop.remove_signal_handler(s)
                except (RuntimeError, ValueError, NotImplementedError):
                    pass
                signal.signal(s, h)
        self._restore_now = [restore_fds, restore_signals]
        self._children_before = {p.pid for p in _children()}
        self._redirect_vllm_logging(log)   # before vLLM is imported: its import-time warnings too
        from vllm.entrypoints.launchers.api_server.entry import run_server
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        argv = list(self.launch.server_args)
        if self.uni_executor and "--distributed-executor-backend" not in argv:
            argv += ["--distributed-executor-backend", "uni"]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        validate_parsed_serve_args(args)
        self._start_watchdog(None)
        self.task = loop.create_task(run_server(args), name=f"ds4lab-vllm-{self.launch.port}")

    def _give_back(self) -> None:
        """fds 1/2 and the SIGINT/SIGTERM handlers back to the caller's (once)."""
        for f in getattr(self, "_restore_now", []):
            try:
                f()
            except Exception:  # noqa: BLE001
                pass
        self._restore_now = []

    def _after_ready(self) -> None:
        self._give_back()
        self._swap_vllm_handlers()  # vLLM configured its logging during start-up
        self._engine_children = self._own_children()

    def _redirect_vllm_logging(self, log) -> None:
        """vLLM's log records in this process go to the log file, not into the notebook's cells:
        a fresh vLLM logging config resolves ``VLLM_LOGGING_STREAM`` (``ext://`` this module's
        :data:`vllm_log_stream`); an existing one has its StreamHandlers pointed there."""
        import io

        stream = io.TextIOWrapper(open(os.dup(log.fileno()), "ab", buffering=0), write_through=True)
        vllm_log_stream.target = stream

        # vLLM 0.32 logs before it configures its "vllm" logger (e.g. "Triton is installed, but doesn't
        # include CPU backend" at import, "Found ulimit ... Too many open files" in run_server): such
        # records fall to logging.lastResort, i.e. the notebook cell's stderr (red). A handler of ours
        # on the "vllm" logger until vLLM installs its own sends them to the log file too.
        lg = logging.getLogger("vllm")
        own = None
        if not lg.handlers:
            own = logging.StreamHandler(vllm_log_stream)
            own.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"))
            saved = (lg.level, lg.propagate)
            lg.addHandler(own)
            lg.setLevel(logging.INFO)
            lg.propagate = False

        def done():
            vllm_log_stream.target = None
            stream.close()
            if own is not None and own in lg.handlers:
                lg.removeHandler(own)
                lg.setLevel(saved[0])
                lg.propagate = saved[1]
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

        self._give_back()
        well = self.task is not None and not self.task.done() and self._healthy
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
        self._finish(well)



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


