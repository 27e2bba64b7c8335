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

from ds4lab.config import profiles
from ds4lab.serve import artifacts, logs, measure, startup
from ds4lab.serve.launch import Launch, build_launch, free_port, option_value
from ds4lab.serve.server import Server, ServerError
from ds4lab.serve.snapshot import SnapshotError, resolve_hf_snapshot

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
    assert option_value(a, "--port") == "1234"
    assert Path(option_value(a, "--model"), "config.json").is_file()
    assert json.loads(option_value(a, "--speculative-config")) == {
        "method": "mtp", "num_speculative_tokens": 1}
    assert option_value(a, "--max-num-batched-tokens") == "4096"
    assert L.env["VLLM_PLUGINS"] == "ds4lab" and L.env["HF_HUB_OFFLINE"] == "1"
    off = build_launch("tiny-cpu", {"num_speculative_tokens": 0}, base_env=ENV, port=1)
    assert "--speculative-config" not in off.argv
    with pytest.raises(ValueError, match="override"):
        build_launch("tiny-cpu", {"not_a_key": 1}, base_env=ENV, port=1)


def test_community_recipe_corner_and_scrub():
    env = dict(ENV, VLLM_TRITON_MLA_SPARSE_BLOCK_N="64", VLLM_TRITON_MLA_SPARSE_TOPK="1024")
    L = build_launch("community-sm89-fork", base_env=env, port=8000, resolve_model=False)
    a = L.argv
    assert option_value(a, "--max-num-seqs") == "1"
    assert option_value(a, "--max-model-len") == "98304"
    assert option_value(a, "--gpu-memory-utilization") == "0.95"
    assert option_value(a, "--kv-cache-dtype") == "fp8_ds_mla"
    assert option_value(a, "--block-size") == "256"
    assert a.count("--speculative-config") == 1 and a.count("--tokenizer-mode") == 1
    assert L.env["VLLM_TRITON_MLA_SPARSE"] == "1"
    assert not [k for k in L.env if k.startswith("VLLM_TRITON_MLA_SPARSE_")]
    assert L.unset == ["VLLM_TRITON_MLA_SPARSE_BLOCK_N", "VLLM_TRITON_MLA_SPARSE_TOPK"]
    assert any("scrubbed" in n for n in L.notes)
    watched = build_launch("community-sm89-fork", {"gpu_memory_utilization": 0.97}, base_env=ENV,
                           port=8000, resolve_model=False)
    assert option_value(watched.argv, "--gpu-memory-utilization") == "0.97"
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
    assert option_value(L.argv, "--model").endswith("snapshots/old2")
    assert option_value(L.argv, "--served-model-name") == "deepseek-v4-flash"


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
    assert set(files) == {"serve.sh", "warmup.sh", "canary.sh", "api-key", f"ds4lab-serve-{name}.service"}
    assert oct(files["api-key"].stat().st_mode & 0o777) == "0o600"
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

    # log_cap: this server writes ~64 MB/s; the cap (test_log_cap_keeps_head_and_tail) is not the point here
    srv = Server(_fake_launch(FAKE, "16"), log_path=tmp_path / "log", on_progress=None, log_cap=1 << 30)
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
    a, b = (logs.new_log_path("tiny-cpu", "mtp1", tmp_path) for _ in range(2))
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


# ---- log cap, log clean-up, heartbeat (fake servers) -------------------------------------------
LOOPY = r'''
import http.server, os, sys, threading, time
port, delay = int(sys.argv[1]), float(sys.argv[2])
print("FIRST LINE of the start-up", flush=True)
def loop():                      # a looping server: ~20 MB/s of numbered lines
    i = 0
    while True:
        os.write(1, b"".join(b"line %09d %s\n" % (i + k, b"y" * 100) for k in range(2000)))
        i += 2000
        time.sleep(0.01)
if delay < 0:
    threading.Thread(target=loop, daemon=True).start()
time.sleep(abs(delay))
print("(EngineCore pid=1) INFO x [kv_cache_utils.py:2327] CPU KV cache size: 2,048 tokens, "
      "Maximum concurrency for 512 tokens per request: 4.00x", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_log_cap_keeps_head_and_tail(tmp_path):
    """A looping server (~20 MB/s) cannot grow its log past the cap: the watchdog keeps the head
    (how it started) and the tail (what it does now) around one marker line."""
    from ds4lab.serve.logs import MARKER

    cap = 2 << 20
    log = tmp_path / "log"
    with Server(_fake_launch(LOOPY, "-0.5"), log_path=log, log_cap=cap, on_progress=None) as srv:
        time.sleep(3.0)              # ~60 MB written
        size = log.stat().st_size
        data = log.read_bytes()
        assert srv.ready_s is not None   # (lines cut from the middle before the parser read them are gone)
    assert size < cap + (8 << 20), size    # at most one 0.2 s watchdog interval over the cap
    assert data.startswith(b"FIRST LINE of the start-up\n")
    assert MARKER in data and b"bytes of the middle dropped" in data
    last = [ln for ln in data.splitlines() if ln.startswith(b"line ")][-1]
    assert int(last.split()[1]) > 100_000   # the tail is recent: well past the first 100k lines
    with pytest.raises(ValueError, match="log_cap=10"):
        Server(_fake_launch(LOOPY, "0"), log_path=log, log_cap=10)


def test_cap_log_unit(tmp_path):
    from ds4lab.serve.logs import MARKER, cap_log

    p = tmp_path / "l"
    p.write_bytes(b"".join(b"%06d\n" % i for i in range(10_000)))   # 70,000 B
    assert cap_log(p, 1 << 20) == 0
    dropped = cap_log(p, 8192)
    data = p.read_bytes()
    assert dropped > 0 and len(data) <= 8192 + 200
    assert data.startswith(b"000000\n") and data.endswith(b"009999\n") and data.count(MARKER) == 1
    with p.open("ab") as f:
        f.write(b"".join(b"x%05d\n" % i for i in range(5000)))
    cap_log(p, 8192)
    data = p.read_bytes()
    assert data.startswith(b"000000\n") and data.endswith(b"x04999\n") and data.count(MARKER) == 1


def test_launcher_log_removed_when_the_run_ends_well_kept_when_it_fails(tmp_path, capsys):
    """/tmp log files the launcher created: gone after a good run, kept (path printed) after a failure."""
    srv = Server(_fake_launch(LOOPY, "0"), on_progress=None)
    assert srv.own_log and srv.log_path.is_file()
    with srv:
        assert srv.log_path.is_file()
    assert not srv.log_path.exists()
    bad = Server(_fake_launch(DIES), on_progress=None)
    with pytest.raises(ServerError, match=str(bad.log_path)):
        bad.start()
    try:
        assert bad.log_path.is_file() and "boom" in bad.log_path.read_text()
    finally:
        bad.log_path.unlink()
    mine = Server(_fake_launch(LOOPY, "0"), log_path=tmp_path / "mine.log", on_progress=None)
    with mine:
        pass
    assert (tmp_path / "mine.log").is_file()   # a path the caller chose is the caller's


def test_heartbeat_while_the_log_is_silent(tmp_path):
    """Nothing in the log for 2.5 s: heartbeats say the elapsed time, the stage and the last line."""
    events = []
    with Server(_fake_launch(LOOPY, "2.5"), log_path=tmp_path / "log", heartbeat_s=0.5,
                on_progress=events.append) as srv:
        pass
    beats = [e for e in events if e.stage == "heartbeat"]
    assert len(beats) >= 3, [(e.t, e.stage) for e in events]
    assert all("stage launch" in b.message and " s, " in b.message for b in beats)
    assert any("FIRST LINE of the start-up" in b.message for b in beats)
    assert events[0].stage == "launch" and events[-1].stage == "ready"
    assert beats[-1].t >= 1.5 and srv.ready_s >= 2.5


def test_start_is_torn_down_on_keyboard_interrupt(tmp_path, capsys):
    """A KeyboardInterrupt (or cancellation) at any point of the start: the group is gone before it
    propagates and the message says so (the real-server, real-kernel version: test_serve_interrupt)."""
    import asyncio

    import psutil

    srv = Server(_fake_launch(LOOPY, "30"), log_path=tmp_path / "log", on_progress=None)
    orig = srv._check_ready
    calls = []

    def interrupted(*a):
        calls.append(srv.pids())
        if len(calls) == 3:
            raise KeyboardInterrupt
        return orig(*a)
    srv._check_ready = interrupted
    with pytest.raises(KeyboardInterrupt):
        srv.start()
    assert calls[-1] and not [p for p in calls[-1] if psutil.pid_exists(p)
                              and psutil.Process(p).status() != "zombie"]
    assert "interrupted; server stopped" in capsys.readouterr().out

    async def cancel_during_start():
        s = Server(_fake_launch(LOOPY, "30"), log_path=tmp_path / "log2", on_progress=None)
        t = asyncio.ensure_future(s.astart())
        await asyncio.sleep(1.5)
        pids = s.pids()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        return pids
    pids = asyncio.run(cancel_during_start())
    assert pids and not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert "interrupted; server stopped" in capsys.readouterr().out


# ---- fit_to_machine, --print port, waterfall rows ----------------------------------------------
def test_fit_to_machine_says_the_switch(capsys):
    from ds4lab.serve import fit_to_machine

    got = fit_to_machine("community-sm89-fork", gpu=False, max_tokens=256, n_prompts=16, concurrency=1)
    assert got == {"profile": "tiny-cpu", "max_tokens": 64, "n_prompts": 8, "concurrency": 1}
    out = capsys.readouterr().out
    assert "'community-sm89-fork' -> 'tiny-cpu'" in out and "no CUDA GPU" in out
    assert "max_tokens 256 -> 64" in out and "n_prompts 16 -> 8" in out and "concurrency" not in out.split("capped")[1]
    assert fit_to_machine("community-sm89-fork", gpu=True, max_tokens=256)["profile"] == "community-sm89-fork"
    assert capsys.readouterr().out == ""


def test_print_and_run_agree_on_the_port(capsys):
    """No --port: --print shows the port the run would listen on (the profile's, else 8000)."""
    from ds4lab.cli import main
    from ds4lab.serve import cli

    assert main(["serve", "--print", "--profile", "tiny-cpu"]) == 0
    assert "--port 8000" in capsys.readouterr().out
    import argparse
    ns = argparse.Namespace(port=None, profile="tiny-cpu")
    assert cli._port(ns, {}) == 8000 and cli._port(ns, {"port": 9001}) == 9001
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"--port {busy}: 127.0.0.1:{busy} is not free"):
            cli._check_port_free(build_launch("tiny-cpu", base_env=ENV, port=busy, resolve_model=False))


def test_stage_rows_are_a_waterfall():
    i = startup.StartupInfo(stages_s={"weights": 9.0, "kv_cache": 20.0, "api": 25.5, "ready": 31.0})
    rows = startup.stage_rows(i)
    assert [r["stage"] for r in rows] == ["launch", "weights", "kv_cache", "api", "ready"]
    assert all(a["end_s"] == b["start_s"] for a, b in zip(rows, rows[1:]))
    assert rows[1]["seconds"] == 11.0 and rows[-1]["seconds"] == 0
    from ds4lab.views.serve import startup_figure
    bar = startup_figure(i).data[0]
    assert list(bar.base) == [0.0, 9.0, 20.0, 25.5] and list(bar.x) == [9.0, 11.0, 5.5, 5.5]


# ---- API key beyond loopback -------------------------------------------------------------------
def test_api_key_required_beyond_loopback(tmp_path):
    from ds4lab.serve import apikey

    with pytest.raises(ValueError, match="host='0.0.0.0' is not a loopback address.*api_key_file"):
        build_launch("tiny-cpu", {"host": "0.0.0.0"}, base_env=ENV, port=8000, resolve_model=False)
    assert apikey.is_loopback("127.0.0.1") and apikey.is_loopback("::1") and apikey.is_loopback("localhost")
    assert not apikey.is_loopback("0.0.0.0") and not apikey.is_loopback("10.0.0.5")
    key = tmp_path / "api-key"
    assert apikey.write_api_key(key) and not apikey.write_api_key(key)   # an existing key is kept
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    secret = key.read_text().strip()
    L = build_launch("tiny-cpu", {"host": "0.0.0.0", "api_key_file": str(key)}, base_env=ENV, port=8000,
                     resolve_model=False)
    assert L.url == "http://127.0.0.1:8000"
    srv = Server(L, log_path=tmp_path / "log", on_progress=None)
    assert srv.api_key == secret and srv.headers == {"Authorization": f"Bearer {secret}"}
    assert srv._child_env()["VLLM_API_KEY"] == secret
    assert secret not in " ".join(L.argv) and secret not in L.describe() and "VLLM_API_KEY" not in L.env
    assert f'VLLM_API_KEY="$(cat {key})"' in L.describe()
    key.chmod(0o644)
    with pytest.raises(ValueError, match="mode 0644 lets others read the key"):
        Server(L, log_path=tmp_path / "log")


def test_serve_sh_needs_the_key_beyond_loopback_and_scripts_send_it(tmp_path):
    L = build_launch("tiny-cpu", base_env=ENV, port=8000, resolve_model=False)
    files = artifacts.write_artifacts(L, tmp_path, port=8000)
    secret = files["api-key"].read_text().strip()
    for n in ("serve.sh", "warmup.sh", "canary.sh"):
        assert secret not in files[n].read_text()
    stub = tmp_path / "py"
    stub.write_text("#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" > \"$OUT_ARGS\"\nenv > \"$OUT_ENV\"\n")
    stub.chmod(0o755)
    env = dict(ENV, PYTHON=str(stub), OUT_ARGS=str(tmp_path / "a"), OUT_ENV=str(tmp_path / "e"), MODEL=str(tmp_path))
    r = subprocess.run(["bash", str(files["serve.sh"])], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "VLLM_API_KEY" not in (tmp_path / "e").read_text()   # loopback: no key
    r = subprocess.run(["bash", str(files["serve.sh"])], env=dict(env, HOST="0.0.0.0"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"VLLM_API_KEY={secret}" in (tmp_path / "e").read_text() and secret not in (tmp_path / "a").read_text()
    files["api-key"].chmod(0o644)
    r = subprocess.run(["bash", str(files["serve.sh"])], env=dict(env, HOST="0.0.0.0"), capture_output=True, text=True)
    assert r.returncode == 1 and "readable by others" in r.stderr
    files["api-key"].unlink()
    r = subprocess.run(["bash", str(files["serve.sh"])], env=dict(env, HOST="0.0.0.0"), capture_output=True, text=True)
    assert r.returncode == 1 and "an API key is required" in r.stderr


def test_inprocess_routes_vllm_records_before_vllm_configures_logging(tmp_path, capsys):
    """vLLM 0.32 logs at import ("Triton is installed, but doesn't include CPU backend") and in
    run_server ("Found ulimit ... Too many open files") before it configures its logger; those records
    went to logging.lastResort, i.e. the notebook cell's stderr. In-process they go to the log file."""
    import logging

    from ds4lab.serve.server import InProcessServer

    srv = InProcessServer(_fake_launch(DIES), log_path=tmp_path / "log", on_progress=None)
    lg = logging.getLogger("vllm")
    before = list(lg.handlers)
    if before:
        pytest.skip("vLLM's logger is already configured in this process")
    with open(tmp_path / "log", "ab", buffering=0) as log:
        srv._redirect_vllm_logging(log)
        logging.getLogger("vllm.triton_utils.importing").warning("Triton is installed, but doesn't include CPU backend.")
        while srv._restore:
            srv._restore.pop()()
    assert "doesn't include CPU backend" in (tmp_path / "log").read_text()
    assert "CPU backend" not in capsys.readouterr().err
    assert lg.handlers == before
