"""Kill a server's processes when the process that launched it disappears, even on SIGKILL.

Started by :class:`ds4lab.serve.server.Server` as ``python -m ds4lab.serve._watchdog --parent PID
[--pgid PGID] --since T [--log PATH --log-cap BYTES]`` in its **own session** (so a signal to the launcher's group does not reach
it), with its stdin a pipe whose only writer is the launcher. It polls every 0.2 s and records the
launcher's descendants created since ``T`` (EngineCore, Worker, ...) with their create times. It acts
when stdin reaches EOF (the launcher closed it on a clean stop, or died) or when its parent pid
changes (the launcher died; a forked EngineCore may hold a copy of the pipe): it SIGKILLs the process
group ``PGID`` and every recorded process still alive with the same create time, then exits.
multiprocessing's resource_tracker is left alone (it exits by itself, and the kernel may still use it).
While it waits it also keeps the server's log under ``--log-cap`` bytes (:func:`ds4lab.serve.logs.cap_log`:
head and tail kept), for the server's whole life, whatever the launcher is doing.
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time


def _ours(p) -> bool:
    try:
        return "resource_tracker" not in " ".join(p.cmdline())
    except Exception:  # noqa: BLE001
        return True


def main(argv: list[str] | None = None) -> int:
    import psutil

    ap = argparse.ArgumentParser()
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--pgid", type=int, default=None)
    ap.add_argument("--since", type=float, default=0.0)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--log", default=None)
    ap.add_argument("--log-cap", type=int, default=0)
    a = ap.parse_args(argv)
    if a.log and a.log_cap:
        from ds4lab.serve.logs import cap_log
    for s in (signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    me = os.getpid()
    tracked: dict[int, float] = {}
    try:
        parent = psutil.Process(a.parent)
    except psutil.NoSuchProcess:
        parent = None
    fd = sys.stdin.fileno()
    while parent is not None and os.getppid() == a.parent:
        try:
            for c in parent.children(recursive=True):
                if c.pid != me and c.pid not in tracked:
                    ct = c.create_time()
                    if ct >= a.since - 1.0 and _ours(c):
                        tracked[c.pid] = ct
        except psutil.NoSuchProcess:
            break
        if a.log and a.log_cap:
            try:
                cap_log(a.log, a.log_cap)
            except Exception:  # noqa: BLE001 - a failed cap must never stop the watch
                pass
        r, _, _ = select.select([fd], [], [], a.interval)
        if r and not os.read(fd, 4096):
            break  # EOF: clean stop or launcher death
    # ---- the launcher is gone or done: nothing of the server may outlive it ----------------
    if a.pgid:
        try:
            os.killpg(a.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    victims = []
    for pid, ct in tracked.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - ct) < 1e-3:
                victims += [p] + p.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=5)
    return 0


if __name__ == "__main__":
    time.sleep(0)
    sys.exit(main())
