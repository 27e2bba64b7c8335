"""Interrupting a real tiny-server start never leaves a process behind (issue 22 item 1).

One Jupyter kernel (jupyter_client's KernelManager, the real ipykernel, the interrupt a person sends
with Kernel > Interrupt) runs start-ups of the tiny-cpu server and is interrupted at three points:
before the EngineCore exists, while the weights load, and after ``/health`` (during the warmup that
``acompare`` runs inside ``async with``). Each time the cell must say "interrupted; server stopped"
and no process of that launch may be alive 10 s later. Then ``ds4lab serve`` gets a Ctrl-C (SIGINT)
during its start-up: exit status 130 and nothing left. Cost: about one server start in all (the
starts are cut short), ~60 s on the 2-core box.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _alive(pids) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _on_port(port: int) -> set[int]:
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        try:
            if f"--port {port}" in " ".join(p.info["cmdline"] or []):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


class _Kernel:
    def __init__(self):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=_env(), cwd=ROOT)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.pid = self.km.provisioner.process.pid

    def run(self, code: str, interrupt_when=None, delay: float = 0.0, timeout: float = 300.0):
        """Execute ``code``; when a stream output matches ``interrupt_when``, wait ``delay`` s, note
        the kernel's descendants and interrupt. Returns (text, reply content, descendants seen)."""
        msg_id = self.kc.execute(code)
        text, seen, sent, reply = "", set(), False, None
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                msg = None
            try:
                seen |= {c.pid for c in psutil.Process(self.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
            if msg and msg["parent_header"].get("msg_id") == msg_id:
                c = msg["content"]
                if msg["msg_type"] == "stream":
                    text += c["text"]
                elif msg["msg_type"] == "error":
                    text += f"{c['ename']}: {c['evalue']}\n"
                elif msg["msg_type"] == "status" and c["execution_state"] == "idle":
                    while reply is None:   # replies of earlier cells may still be queued
                        m = self.kc.get_shell_msg(timeout=30)
                        if m["parent_header"].get("msg_id") == msg_id:
                            reply = m["content"]
                    break
            if interrupt_when and not sent and re.search(interrupt_when, text):
                time.sleep(delay)
                try:
                    seen |= {c.pid for c in psutil.Process(self.pid).children(recursive=True)}
                except psutil.NoSuchProcess:
                    pass
                self.km.interrupt_kernel()
                sent = True
        assert reply is not None, f"cell did not finish in {timeout} s:\n{text[-3000:]}"
        return text, reply, seen

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


START = ("srv = Server(build_launch('tiny-cpu', {'num_speculative_tokens': 0}), log_path=LOG, heartbeat_s=2)\n"
         "await srv.astart()\n")
COMPARE = ("cmp = await measure.acompare('tiny-cpu', prompts=measure.make_prompts(2), max_tokens=8, "
           "log_dir=LOGDIR)\n")


def _check_gone(text: str, seen: set[int], what: str) -> None:
    assert "interrupted; server stopped" in text, f"{what}:\n{text[-3000:]}"
    port = int(re.search(r"-> http://127\.0\.0\.1:(\d+) \(log", text).group(1))
    deadline = time.time() + 10
    while time.time() < deadline and (_alive(seen) or _on_port(port)):
        time.sleep(0.25)
    left = [(p.pid, p.name()) for p in _alive(seen | _on_port(port))]
    assert not left, f"{what}: processes of the launch survive 10 s after the interrupt: {left}\n{text[-2000:]}"


def test_interrupted_start_leaves_nothing(tmp_path):
    pytest.importorskip("jupyter_client")
    k = _Kernel()
    try:
        text, reply, _ = k.run("from ds4lab.serve import Server, build_launch, measure\n"
                               f"LOG = {str(tmp_path / 'start.log')!r}; LOGDIR = {str(tmp_path)!r}\n")
        assert reply["status"] == "ok", text
        # 1) the API server is starting, no EngineCore yet (vLLM's imports take ~8 s)
        text, reply, seen = k.run(START, interrupt_when=r"launch\s+subprocess: tiny-cpu", delay=1.5)
        # (ipykernel reports a cancelled cell's CancelledError as an error output, its reply status "ok")
        assert "CancelledError" in text and not re.search(r"\]\s+weights\s", text), text
        _check_gone(text, seen, "before EngineCore")
        # 2) while the weights load (the worker printed "Starting to load model")
        text, reply, seen = k.run(START, interrupt_when=r"\]\s+weights\s")
        assert "CancelledError" in text and not re.search(r"\]\s+ready\s", text), text
        _check_gone(text, seen, "during weights")
        # 3) after /health: acompare warms up inside `async with`, interrupted there
        text, reply, seen = k.run(COMPARE, interrupt_when=r"\]\s+ready\s", delay=0.5)
        assert "CancelledError" in text and "/health 200" in text, text
        _check_gone(text, seen, "after /health")
        assert "server logs kept: " + str(tmp_path) in text or "server logs kept" in text
        # the kernel itself is fine and holds no server
        text, reply, _ = k.run("import psutil; print('children', [p.name() for p in "
                               "psutil.Process().children(recursive=True)])")
        assert reply["status"] == "ok" and "VLLM" not in text and "EngineCore" not in text, text
    finally:
        k.close()


def test_ctrl_c_on_ds4lab_serve_exits_130_and_stops_the_server(tmp_path):
    """Ctrl-C during `ds4lab serve`'s start-up: the server group is stopped, exit status 130."""
    from ds4lab.serve import free_port

    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "ds4lab", "serve", "--profile", "tiny-cpu", "--port", str(port)],
                         env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in p.stdout:
        out.append(line)
        if "heartbeat" in line:   # the API server is up and still starting
            break
    seen = {c.pid for c in psutil.Process(p.pid).children(recursive=True)} | _on_port(port)
    assert seen, "".join(out)
    p.send_signal(signal.SIGINT)
    rest, _ = p.communicate(timeout=60)
    assert p.returncode == 130, "".join(out) + rest
    assert "interrupted; server stopped" in rest
    assert f"--port {port}" in "".join(out) and f"http://127.0.0.1:{port}" in "".join(out)
    deadline = time.time() + 10
    while time.time() < deadline and (_alive(seen) or _on_port(port)):
        time.sleep(0.25)
    assert not _alive(seen | _on_port(port))
