"""ds4lab.serve without vLLM: profiles -> argv/env, scrubbing, offline snapshot resolution, the
start-up log parser, /metrics parsing, generated scripts and units, and the Server's process
handling against small fake servers (a chatty one, a dying one)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ds4lab.serve import artifacts, measure, profiles, startup
from ds4lab.serve.profiles import Launch, SnapshotError, build_launch, resolve_hf_snapshot
from ds4lab.serve.server import Server, ServerError
from ds4lab.vllm_plugin.server import free_port

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root")}


# ---- profiles ---------------------------------------------------------------------------------
def test_profiles_name_known_stacks():
    from ds4lab.config.stacks import stacks

    ps = profiles.load_profiles()
    assert {"tiny-cpu", "ada-upstream", "community-sm89-fork"} <= set(ps)
    for name, p in ps.items():
        assert p["stack"] in stacks(), name
    with pytest.raises(ValueError, match="known profiles"):
        profiles.profile("nope")


def test_tiny_launch_argv_and_env():
    L = build_launch("tiny-cpu", base_env=ENV, port=1234)
    a = L.argv
    assert a[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert profiles.option_value(a, "--port") == "1234"
    assert Path(profiles.option_value(a, "--model"), "config.json").is_file()
    assert json.loads(profiles.option_value(a, "--speculative-config")) == {
        "method": "mtp", "num_speculative_tokens": 1}
    assert profiles.option_value(a, "--max-num-batched-tokens") == "4096"
    assert L.env["VLLM_PLUGINS"] == "ds4lab" and L.env["HF_HUB_OFFLINE"] == "1"
    off = build_launch("tiny-cpu", {"num_speculative_tokens": 0}, base_env=ENV, port=1)
    assert "--speculative-config" not in off.argv
    with pytest.raises(ValueError, match="override"):
        build_launch("tiny-cpu", {"not_a_key": 1}, base_env=ENV, port=1)


def test_community_recipe_corner_and_scrub():
    env = dict(ENV, VLLM_TRITON_MLA_SPARSE_BLOCK_N="64", VLLM_TRITON_MLA_SPARSE_TOPK="1024")
    L = build_launch("community-sm89-fork", base_env=env, port=8000, resolve_model=False)
    a = L.argv
    assert profiles.option_value(a, "--max-num-seqs") == "1"
    assert profiles.option_value(a, "--max-model-len") == "98304"
    assert profiles.option_value(a, "--gpu-memory-utilization") == "0.95"
    assert profiles.option_value(a, "--kv-cache-dtype") == "fp8_ds_mla"
    assert profiles.option_value(a, "--block-size") == "256"
    assert a.count("--speculative-config") == 1 and a.count("--tokenizer-mode") == 1
    assert L.env["VLLM_TRITON_MLA_SPARSE"] == "1"
    assert not [k for k in L.env if k.startswith("VLLM_TRITON_MLA_SPARSE_")]
    assert L.unset == ["VLLM_TRITON_MLA_SPARSE_BLOCK_N", "VLLM_TRITON_MLA_SPARSE_TOPK"]
    assert any("scrubbed" in n for n in L.notes)
    watched = build_launch("community-sm89-fork", {"gpu_memory_utilization": 0.97}, base_env=ENV,
                           port=8000, resolve_model=False)
    assert profiles.option_value(watched.argv, "--gpu-memory-utilization") == "0.97"
    with pytest.raises(ValueError, match="--attention-backend"):
        build_launch("ada-upstream", {"extra_args": ["--attention-backend", "FLASHMLA"]}, base_env=ENV,
                     port=8000, resolve_model=False)


def _fake_repo(cache: Path, repo="org/model", snaps=("abc",), ref="abc") -> Path:
    root = cache / ("models--" + repo.replace("/", "--"))
    for s in snaps:
        (root / "snapshots" / s).mkdir(parents=True)
        (root / "snapshots" / s / "config.json").write_text("{}")
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    if ref is not None:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / "main").write_text(ref)
    return root


def test_snapshot_resolution_distrusts_dangling_refs_main(tmp_path):
    _fake_repo(tmp_path, "org/good", ("abc",), "abc")
    p, note = resolve_hf_snapshot("org/good", cache_dir=tmp_path)
    assert p.name == "abc" and note is None
    # refs/main points at a snapshot that is not on disk: choose the existing one and say so
    root = _fake_repo(tmp_path, "org/stale", ("old1", "old2"), "missing0")
    os.utime(root / "snapshots/old1/config.json", (1, 1))
    p, note = resolve_hf_snapshot("org/stale", cache_dir=tmp_path)
    assert p.name == "old2" and "missing0" in note and "not on disk" in note
    # an incomplete snapshot (no config.json) does not count
    r = _fake_repo(tmp_path, "org/empty", (), "x")
    (r / "snapshots" / "x").mkdir(parents=True)
    with pytest.raises(SnapshotError, match="no complete snapshot"):
        resolve_hf_snapshot("org/empty", cache_dir=tmp_path)
    with pytest.raises(SnapshotError, match="not in the HF cache"):
        resolve_hf_snapshot("org/absent", cache_dir=tmp_path)
    # build_launch uses it when offline
    L = build_launch("ada-upstream", base_env=dict(ENV, HF_HUB_OFFLINE="1"), port=8000,
                     hf_cache=tmp_path, overrides={"model": "org/stale"})
    assert profiles.option_value(L.argv, "--model").endswith("snapshots/old2")
    assert profiles.option_value(L.argv, "--served-model-name") == "deepseek-v4-flash"


# ---- start-up log -----------------------------------------------------------------------------
GPU_LOG = """\
(Worker pid=7) INFO 01-01 00:00:00 [gpu_model_runner.py:5040] Starting to load model /m...
(Worker pid=7) INFO 01-01 00:00:09 [default_loader.py:501] Loading weights took 8.51 seconds
(Worker pid=7) INFO 01-01 00:00:10 [gpu_model_runner.py:5150] Model loading took 37.84 GiB memory and 9.612 seconds
(Worker pid=7) INFO 01-01 00:00:30 [monitor.py:20] torch.compile took 14.20 s in total
(Worker pid=7) INFO 01-01 00:00:40 [gpu_worker.py:760] Available KV cache memory: 4.13 GiB
(EngineCore pid=6) INFO 01-01 00:00:40 [kv_cache_utils.py:2327] GPU KV cache size: 4,352 tokens, Maximum concurrency for 98,304 tokens per request: 0.04x
Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 35/35 [00:05<00:00]
(Worker pid=7) INFO 01-01 00:00:50 [gpu_model_runner.py:6582] Graph capturing finished in 7 secs, took 0.41 GiB
(Worker pid=7) INFO 01-01 00:00:51 [gpu_worker.py:939] Compile and warming up model for size 512
(EngineCore pid=6) INFO 01-01 00:00:55 [core.py:402] init engine (profile, create kv cache, warmup model) took 44.10 s
(APIServer pid=5) INFO 01-01 00:00:56 [entry.py:140] Starting vLLM server on http://0.0.0.0:8000
INFO:     Application startup complete.
"""


def test_startup_parser_gpu_log():
    events = []
    p = startup.StartupParser(events.append)
    for line in GPU_LOG.splitlines():
        p.feed(line)
    i = p.info
    assert (i.weights_gib, i.weights_load_s, i.kv_gib, i.kv_tokens, i.max_model_len) == (
        37.84, 8.51, 4.13, 4352, 98304)
    assert i.max_concurrency == 0.04 and i.graph_capture_s == 7 and i.graph_gib == 0.41
    assert i.compile_s == 14.2 and i.init_engine_s == 44.1 and i.listen_address == "http://0.0.0.0:8000"
    assert [e.stage for e in events][0] == "weights"
    assert {"weights", "kv_cache", "graph_capture", "warmup", "api", "ready"} <= {e.stage for e in events}


def test_startup_parser_cpu_lines():
    i = startup.parse_log(
        "(Worker pid=1) INFO x [weight_utils.py:1108] Filesystem type for checkpoints: EXT4. "
        "Checkpoint size: 0.08 GiB. Available RAM: 20.26 GiB.\n"
        "(Worker pid=1) INFO x [cpu_worker.py:260] Explicitly set (0.25/10.71) GiB for KV cache on node 0.\n"
        "(EngineCore pid=1) INFO x [kv_cache_utils.py:2327] CPU KV cache size: 12,237 tokens, "
        "Maximum concurrency for 4,096 tokens per request: 2.99x\n")
    assert (i.checkpoint_gib, i.kv_gib, i.host_memory_gib, i.kv_tokens, i.max_concurrency) == (
        0.08, 0.25, 10.71, 12237, 2.99)


def test_startup_parser_strips_colour():
    i = startup.parse_log("\x1b[0;36m(EngineCore pid=2)\x1b[0;0m \x1b[32mINFO\x1b[0m [kv_cache_utils.py:2327]"
                          "\x1b[0m CPU KV cache size: 12,676 tokens, Maximum concurrency for 4,096 tokens "
                          "per request: 3.09x\n")
    assert i.kv_tokens == 12676 and i.max_concurrency == 3.09


METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 80.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 60.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 36.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 24.0
"""


def test_spec_metrics_and_acceptance():
    after = measure.parse_spec_metrics(METRICS)
    before = {k: 0.0 for k in after}
    before["num_drafts_total"] = 20.0
    before["num_draft_tokens_total"] = 40.0
    before["num_accepted_tokens_total"] = 30.0
    before["num_accepted_tokens_per_pos_total[0]"] = 18.0
    before["num_accepted_tokens_per_pos_total[1]"] = 12.0
    s = measure.spec_stats(before, after)
    assert (s.drafts, s.draft_tokens, s.accepted_tokens) == (20, 40, 30)
    assert s.acceptance_rate == 0.75 and s.mean_acceptance_length == 2.5
    assert s.per_position == [0.9, 0.6]
    assert measure.spec_stats({}, {}) is None  # a server without speculation


def test_prompts_deterministic_and_table():
    assert measure.make_prompts(3, seed=1) == measure.make_prompts(3, seed=1)
    assert measure.make_prompts(3, seed=1) != measure.make_prompts(3, seed=2)
    t = measure.format_table([{"run": "mtp1", "tok/s": 1.5, "x": None}])
    assert "mtp1" in t and "1.5" in t and "-" in t


# ---- artefacts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(profiles.load_profiles()))
def test_artifacts_for_each_profile(name, tmp_path):
    L = build_launch(name, base_env=ENV, port=8000, resolve_model=False)
    files = artifacts.write_artifacts(L, tmp_path, port=8000)
    assert set(files) == {"serve.sh", "warmup.sh", "canary.sh", f"ds4lab-serve-{name}.service"}
    for n, p in files.items():
        if n.endswith(".sh"):
            assert os.access(p, os.X_OK)
            r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
            assert r.returncode == 0, (n, r.stderr)
    serve = files["serve.sh"].read_text()
    assert "exec \"$PYTHON\" -m vllm.entrypoints.openai.api_server" in serve
    if name == "community-sm89-fork":
        assert "VLLM_TRITON_MLA_SPARSE_*) unset" in serve and "export VLLM_TRITON_MLA_SPARSE=1" in serve
        assert "--max-num-seqs 1" in serve and "--max-model-len 98304" in serve
        assert "--gpu-memory-utilization 0.95" in serve
    unit = files[f"ds4lab-serve-{name}.service"].read_text()
    assert "Restart=always" in unit
    assert f"ExecStartPost={tmp_path.resolve()}/warmup.sh" in unit
    assert f"ExecStart={tmp_path.resolve()}/serve.sh" in unit
    if shutil.which("systemd-analyze"):
        r = subprocess.run(["systemd-analyze", "verify", "--man=no",
                            str(files[f"ds4lab-serve-{name}.service"])], capture_output=True, text=True)
        # only problems with *this* unit count (a container has no running systemd/multi-user.target)
        bad = [ln for ln in (r.stderr + r.stdout).splitlines() if f"ds4lab-serve-{name}" in ln]
        assert not bad, bad


def test_serve_sh_defaults_to_the_generating_interpreter(tmp_path):
    """A systemd unit has a bare PATH: serve.sh must not fall back to whatever python3 is there."""
    L = build_launch("community-sm89-fork", base_env=ENV, port=8000, resolve_model=False)
    serve = artifacts.write_artifacts(L, tmp_path, port=8000)["serve.sh"]
    assert f'PYTHON="${{PYTHON:-{sys.executable}}}"' in serve.read_text()
    other = artifacts.render_serve_sh(L, python="/opt/v/bin/python")
    assert 'PYTHON="${PYTHON:-/opt/v/bin/python}"' in other
    with pytest.raises(ValueError, match="python="):
        artifacts.render_serve_sh(L, python='/opt/"x"/python')
    env = dict(ENV, PYTHON=str(tmp_path / "no-such-python"), MODEL=str(tmp_path))
    r = subprocess.run(["bash", str(serve)], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "no interpreter" in r.stderr and "set PYTHON=" in r.stderr


def test_serve_sh_execs_the_same_argv(tmp_path):
    """serve.sh, run with a stub python, execs exactly the profile's server argv."""
    L = build_launch("community-sm89-fork", base_env=ENV, port=8000, resolve_model=False)
    files = artifacts.write_artifacts(L, tmp_path, port=8000)
    stub = tmp_path / "py"   # records the server argv; the snapshot resolution runs in the real interpreter
    stub.write_text("#!/usr/bin/env bash\n"
                    f"if [ \"$1 $2\" = '-m ds4lab.hf_snapshot' ]; then exec {sys.executable} \"$@\"; fi\n"
                    "printf '%s\\n' \"$@\" > \"$OUT_ARGS\"\nenv > \"$OUT_ENV\"\n")
    stub.chmod(0o755)
    env = dict(ENV, PYTHON=str(stub), OUT_ARGS=str(tmp_path / "a"), OUT_ENV=str(tmp_path / "e"),
               VLLM_TRITON_MLA_SPARSE_OLD="1", HF_HUB_CACHE=str(tmp_path / "hub"),
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(["bash", str(files["serve.sh"])], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "not in the HF cache" in r.stderr   # nothing cached: clear failure
    assert not (tmp_path / "a").exists()                              # and the server never started
    # refs/main points at a snapshot that is not on disk: the script picks the existing one, says so
    root = _fake_repo(tmp_path / "hub", L.model, ("good1",), "dangling")
    r = subprocess.run(["bash", str(files["serve.sh"])], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "dangling is not on disk" in r.stderr
    got = (tmp_path / "a").read_text().splitlines()
    want = list(L.argv[1:])
    want[want.index("--model") + 1] = str(root / "snapshots" / "good1")
    assert got == want
    e = (tmp_path / "e").read_text()
    assert "VLLM_TRITON_MLA_SPARSE=1" in e and "VLLM_TRITON_MLA_SPARSE_OLD" not in e
    # `echo $SHA > refs/main`: huggingface_hub (and so vLLM) does not strip the newline; serve.sh
    # resolves the way the hub does and says why it falls back to the snapshot on disk
    (root / "refs" / "main").write_text("good1\n")
    r = subprocess.run(["bash", str(files["serve.sh"])], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "verbatim" in r.stderr, r.stderr
    assert (tmp_path / "a").read_text().splitlines() == want


# ---- Server process handling against fake servers ---------------------------------------------
FAKE = r'''
import http.server, os, sys, threading, time
port = int(sys.argv[1]); mb = int(sys.argv[2])
line = ("x" * 1023 + "\n").encode()
for _ in range(mb * 1024):            # a chatty start-up: far more than any pipe buffer
    os.write(1, line)
print("(EngineCore pid=1) INFO x [kv_cache_utils.py:2327] CPU KV cache size: 1,024 tokens, "
      "Maximum concurrency for 512 tokens per request: 2.00x", flush=True)
if mb < 0: pass
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        sys.stdout.write("access %s\n" % (a,)); sys.stdout.flush()
srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
def chatter():
    while True:
        os.write(2, line * 64)
        time.sleep(0.001)
threading.Thread(target=chatter, daemon=True).start()
srv.serve_forever()
'''

DIES = r'''
import sys, time
print("(Worker pid=1) INFO x [cpu_model_runner.py:68] Starting to load model /x...", flush=True)
time.sleep(0.5)
print("Traceback (most recent call last):\nRuntimeError: boom: fake JIT OOM", flush=True)
sys.exit(3)
'''


def _fake_launch(script: str, *args: str) -> Launch:
    port = free_port()
    return Launch(profile="fake", stack="cpu", argv=[sys.executable, "-c", script, str(port), *args],
                  env=dict(os.environ), env_overlay={}, unset=[], scrub_prefixes=[], host="127.0.0.1",
                  port=port, model="fake", served_model_name="fake", num_speculative_tokens=0)


def test_chatty_server_does_not_block(tmp_path):
    import psutil

    srv = Server(_fake_launch(FAKE, "16"), log_path=tmp_path / "log", on_progress=None)
    t = time.time()
    with srv:
        assert time.time() - t < 120  # ~2 s on an idle box
        assert srv.startup.kv_tokens == 1024 and srv.startup.max_concurrency == 2.0
        size = (tmp_path / "log").stat().st_size
        assert size > 16 << 20
        time.sleep(1.0)
        assert (tmp_path / "log").stat().st_size > size  # still writing, never blocked
        pids = srv.pids()
        assert pids
    time.sleep(0.3)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_dying_server_shows_log_tail(tmp_path):
    srv = Server(_fake_launch(DIES), log_path=tmp_path / "log", on_progress=None)
    with pytest.raises(ServerError) as e:
        srv.start()
    assert "exited with 3" in str(e.value) and "boom: fake JIT OOM" in str(e.value)
    assert srv.proc is None and srv.watchdog is None


def test_inprocess_needs_await():
    srv = Server(_fake_launch(DIES), mode="inprocess", on_progress=None)
    with pytest.raises(RuntimeError, match="await"):
        srv.start()


def test_cli_print_and_artifacts(tmp_path, capsys):
    from ds4lab.cli import main

    assert main(["serve", "--print", "--profile", "tiny-cpu", "--port", "8123"]) == 0
    out = capsys.readouterr().out
    assert "--port 8123" in out and "VLLM_PLUGINS=ds4lab" in out
    assert main(["serve", "--profile", "community-sm89-fork", "--artifacts", str(tmp_path)]) == 0
    assert (tmp_path / "ds4lab-serve-community-sm89-fork.service").is_file()
    # --print works on a planning machine without the weights; launching needs them (clear message)
    capsys.readouterr()
    assert main(["serve", "--profile", "ada-upstream", "--print"]) == 0
    assert "resolved offline from the HF cache at launch" in capsys.readouterr().out
    from ds4lab.serve import SnapshotError, build_launch
    with pytest.raises(SnapshotError, match="not in the HF cache"):
        build_launch("ada-upstream")


@pytest.mark.parametrize("name", ["ada-upstream", "community-sm89-fork"])
def test_print_and_artifacts_show_the_planner_verdict(name, tmp_path, capsys):
    """serve --print/--artifacts plan the profile on the cards of its stack's capability and warn
    (never refuse) where vLLM would not start; the lines agree with memory.plan_for_profile and
    keep the output pasteable (comments)."""
    from ds4lab.planner import memory
    from ds4lab.cli import main

    assert main(["serve", "--profile", name, "--print"]) == 0
    cap = capsys.readouterr()
    assert subprocess.run(["bash", "-n", "-c", cap.out]).returncode == 0
    settings = build_launch(name, port=8000, resolve_model=False).settings
    for card in (g for g in memory.GPUS.values() if g.sm == "sm_89"):
        p = memory.plan_for_profile(settings, card)
        line = next((ln for ln in cap.out.splitlines() if ln.startswith(f"#   {card.name} at util")), None)
        if p.load_oom:   # too small for the weights: listed once, no warning
            assert line is None and card.name in next(ln for ln in cap.out.splitlines() if "not for" in ln)
            assert card.name not in cap.err
        elif p.verdict:
            assert "REFUSED" in line.split(";")[0] and f"would not start on {card.name}" in cap.err, line
        else:
            assert "starts, KV holds" in line and card.name not in cap.err, line
    assert main(["serve", "--profile", name, "--artifacts", str(tmp_path), "--gpu", "rtx6000ada"]) == 0
    out = capsys.readouterr().out
    assert "wrote " in out and "#   RTX 6000 Ada 48 GB at util" in out and "L40S" not in out
    assert main(["serve", "--profile", name, "--print", "--gpu", "nope"]) == 2
    assert "--gpu 'nope': unknown card" in capsys.readouterr().err
    assert main(["serve", "--profile", "tiny-cpu", "--print"]) == 0
    assert "# plan" not in capsys.readouterr().out       # the tiny checkpoint on CPU: nothing to plan


@pytest.mark.parametrize("argv, msg", [
    (["--bench", "--requests", "0"], "--requests 0: must be >= 1"),
    (["--bench", "--max-tokens", "-1"], "--max-tokens -1: must be >= 1"),
    (["--print", "--port", "0"], "--port 0: must be 1-65535"),
    (["--print", "--port", "99999"], "--port 99999: must be 1-65535"),
    (["--print", "--set", "num_speculative_tokens=-1"], "--set num_speculative_tokens=-1: must be >= 0"),
    (["--print", "--set", "num_speculative_tokens=abc"], "--set num_speculative_tokens=abc: expected an integer"),
    (["--print", "--set", "max-model-len=1.5"], "--set max_model_len=1.5: expected an integer"),
    (["--print", "--set", "gpu_memory_utilization=0"], "--set gpu_memory_utilization=0: must be > 0 and <= 1"),
    (["--print", "--set", "port=70000"], "--set port=70000: must be >= 1 and <= 65535"),
    (["--print", "--set", "env=abc"], "--set env=abc: expected JSON"),
    (["--print", "--set", "nope=1"], "--set nope=1: unknown key"),
    (["--print", "--set", "novalue"], "--set 'novalue': expected KEY=VALUE"),
])
def test_cli_rejects_bad_numbers_before_starting(argv, msg, capsys):
    """Bad input is one line naming the flag and exit status 2, before any server starts (a
    --bench that got this far would take minutes and then fail on HTTP 400)."""
    from ds4lab.cli import main

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ds4lab serve: error: ") and msg in err and "\n" not in err, err


def test_set_values_parse_by_type():
    P = profiles.parse_setting
    assert P("num_speculative_tokens", "0") == 0 and P("gpu_memory_utilization", "0.97") == 0.97
    assert P("tiny_agree_heads", "false") is False and P("model", "123") == "123"
    assert P("warmup_prompt_lens", "[16, 64]") == [16, 64] and P("flags", "--x") == ["--x"]
    assert P("env", '{"A": "1"}') == {"A": "1"}
    with pytest.raises(ValueError, match="warmup_prompt_lens=\\[0\\]: must be >= 1"):
        P("warmup_prompt_lens", "[0]")
    # the API checks overrides the same way, naming the key
    with pytest.raises(ValueError, match="override max_num_seqs=0: must be >= 1"):
        build_launch("tiny-cpu", {"max_num_seqs": 0}, base_env=ENV, port=1)
    with pytest.raises(ValueError, match="port=0: must be an integer 1-65535"):
        build_launch("tiny-cpu", base_env=ENV, port=0)
    # every shipped profile passes its own checks
    for name, prof in profiles.load_profiles().items():
        for k, v in prof.items():
            profiles.check_setting(k, v)


def test_print_is_pasteable_bash(tmp_path):
    """`ds4lab serve --print`'s command runs in bash as printed: the tiny checkpoint's folder stays
    a live expansion (double quotes), the JSON speculative config survives, stale variables are
    dropped for the command only, and the model line says where the model really comes from."""
    stub = tmp_path / "py"
    stub.write_text("#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" > \"$OUT_ARGS\"\nenv > \"$OUT_ENV\"\n")
    stub.chmod(0o755)
    env = dict(ENV, OUT_ARGS=str(tmp_path / "a"), OUT_ENV=str(tmp_path / "e"), XDG_CACHE_HOME=str(tmp_path / "xdg"),
               VLLM_PLUGINS="other")
    L = build_launch("tiny-cpu", base_env=dict(ENV, VLLM_TRITON_MLA_SPARSE_X="1"), python=str(stub), port=8123,
                     resolve_model=False)
    text = L.describe()
    assert '--model "${XDG_CACHE_HOME:-$HOME/.cache}/ds4lab/tiny-dsv4-agree"' in text
    model_line = next(ln for ln in text.splitlines() if ln.startswith("# model:"))
    assert "embedded tiny checkpoint" in model_line and "HF cache" not in model_line
    r = subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = (tmp_path / "a").read_text().splitlines()
    want = list(L.argv[1:])
    want[want.index("--model") + 1] = str(tmp_path / "xdg" / "ds4lab" / "tiny-dsv4-agree")
    assert got == want
    e = dict(ln.split("=", 1) for ln in (tmp_path / "e").read_text().splitlines() if "=" in ln)
    assert e["VLLM_PLUGINS"] == "ds4lab" and e["HF_HUB_OFFLINE"] == "1"
    fork = build_launch("community-sm89-fork", base_env=dict(ENV, VLLM_TRITON_MLA_SPARSE_TOPK="1"), port=8000,
                        resolve_model=False)
    text = fork.describe()
    assert "env -u VLLM_TRITON_MLA_SPARSE_TOPK " in text
    assert "resolved offline from the HF cache at launch" in text and "not in the HF cache" in text
    assert subprocess.run(["bash", "-n", "-c", text]).returncode == 0


def test_log_paths_are_unique_per_run(tmp_path):
    """Two runs of the same profile never share a log file (a fixed name let a concurrent run
    truncate the file and the start-up parser read the other server's lines)."""
    a, b = (measure.new_log_path("tiny-cpu", "mtp1", tmp_path) for _ in range(2))
    assert a != b and os.path.isfile(a) and os.path.getsize(a) == 0
    assert os.path.basename(a).startswith("ds4lab-serve-tiny-cpu-mtp1-") and a.endswith(".log")
    L = _fake_launch(DIES)
    s1, s2 = Server(L, on_progress=None), Server(L, on_progress=None)   # same profile, same port
    try:
        assert s1.log_path != s2.log_path and s1.log_path.is_file()
    finally:
        for p in (s1.log_path, s2.log_path):
            p.unlink(missing_ok=True)


@pytest.mark.parametrize("kw, msg", [
    ({"max_tokens": 0}, "max_tokens=0: must be an integer >= 1"),
    ({"prompts": []}, "prompts: empty"),
    ({"concurrency": 0}, "concurrency=0: must be an integer >= 1"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens=0: must be >= 1"),
    ({"overrides": {"max_num_seqs": -1}}, "override max_num_seqs=-1"),
])
def test_compare_checks_arguments_before_starting(kw, msg, tmp_path):
    with pytest.raises(ValueError, match=msg):
        measure.compare("tiny-cpu", log_dir=tmp_path, **kw)
    assert not list(tmp_path.iterdir())   # nothing started, nothing logged
