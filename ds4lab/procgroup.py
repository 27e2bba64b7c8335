"""Stopping a server process group (ds4lab.serve.server's subprocess variant):
SIGTERM the group, wait, SIGKILL it, reap the child, and kill descendants that left the group."""
from __future__ import annotations

import os
import signal
import subprocess
import time

__all__ = ["kill_group", "group_alive"]


def kill_group(p: subprocess.Popen, grace: float) -> None:
    """SIGTERM the child's process group, wait ``grace`` s, then SIGKILL it; reap the child."""
    import psutil

    try:
        pgid = os.getpgid(p.pid)
    except ProcessLookupError:
        pgid = p.pid
    try:  # descendants that left the group (setsid) are found through the tree
        tree = psutil.Process(p.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if p.poll() is not None and not group_alive(pgid):
                break
            time.sleep(0.2)
        else:
            continue
        break
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass
    for c in tree:
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return True

