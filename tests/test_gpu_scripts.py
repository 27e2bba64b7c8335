"""scripts/gpu/*.sh outside a GPU: OUT (and PEER_SRC) are read relative to the caller's folder, and a
failing step makes the script exit non-zero. The benches themselves exit 2 here (no CUDA), which is
the failure these scripts must report."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(tmp_path):
    # the scripts call `python3`: this venv's real interpreter, its bin folder first on PATH
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}


def test_topics_reads_out_relative_to_the_caller_and_fails_on_a_missing_topic(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu/topics.sh")], cwd=tmp_path, capture_output=True,
                       text=True, env={**_env(tmp_path), "OUT": "rel_out", "TOPICS": "nope"}, timeout=60)
    assert r.returncode == 1 and "no scripts/gpu/nope.sh" in r.stdout
    assert (tmp_path / "rel_out").is_dir() and not (ROOT / "rel_out").exists()


def test_moe_script_writes_logs_under_a_caller_relative_out_and_exits_1_without_cuda(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu/moe.sh")], cwd=tmp_path, capture_output=True, text=True,
                       env={**_env(tmp_path), "OUT": "o", "MOE_BUILD_TIMEOUT": "60"}, timeout=150)
    assert r.returncode == 1, r.stdout + r.stderr
    log = tmp_path / "o" / "moe_native.log"
    assert log.is_file() and "no CUDA device" in log.read_text()


def test_topics_refuses_more_than_one_device_call(tmp_path):
    import subprocess
    r = subprocess.run(["bash", "scripts/gpu/topics.sh"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OUT": str(tmp_path), "TOPICS": "gemm moe mhc route"})
    assert r.returncode == 2 and "split TOPICS over several calls" in r.stderr


def test_ncu_digest_reads_a_real_ncu_raw_csv():
    """The digest of a real `ncu --csv --page raw` file (H200, session 5: the decode kernels at T=1)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ncu_digest", ROOT / "scripts" / "gpu" / "ncu_digest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lines = mod.digest((ROOT / "results" / "issue20" / "s5" / "ncu_sm89_before.csv").read_text())
    w13 = next(ln for ln in lines if ln.startswith("_dec_mma_w13_kernel"))
    f = w13.split()
    assert f[1] == "384x128" and f[2] == "72"          # grid x block, registers
    assert float(f[3]) == 18.56                         # us (ncu gives ns)
    assert 12000 < float(f[4]) < 14000 and float(f[5]) == 14.6   # DRAM KB read+written, % of peak
    assert "long_scoreboard" in w13
    assert mod.digest("no csv here") == ["no ncu rows (did the profiled calls run? see the .err file)"]


def test_compress_1l_script_smoke_and_exits_1_without_cuda(tmp_path):
    """scripts/gpu/compress_1l.py --smoke runs its own checks on the interpreter (one launch == the pair);
    the .sh reports the missing GPU as a failure."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gpu/compress_1l.py"), "--smoke", "--out", "o"],
                       cwd=tmp_path, capture_output=True, text=True, env=_env(tmp_path), timeout=120)
    assert r.returncode == 0 and "0 failing" in r.stdout, r.stdout + r.stderr
    assert (tmp_path / "o" / "compress_1l_sm89_smoke.csv").is_file()
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu/compress_1l.sh")], cwd=tmp_path, capture_output=True,
                       text=True, env={**_env(tmp_path), "OUT": "o2", "COMP1_TIMEOUT": "60"}, timeout=90)
    assert r.returncode == 1 and "COMPRESS_1L sm89 FAILED" in r.stdout, r.stdout + r.stderr
    assert (tmp_path / "o2" / "compress_1l_sm89.log").is_file()


def test_step_ab_reports_the_steps_rc_and_keeps_its_log(tmp_path):
    """scripts/gpu/step_ab.sh (sourced by the device calls' run scripts): `step NAME TIMEOUT ARGS...` writes the step's
    console to $OUT/NAME.log and prints its exit status; without CUDA the step fails, and that status is what shows."""
    out = tmp_path / "o"
    out.mkdir()
    r = subprocess.run(["bash", "-c", f". {ROOT}/scripts/gpu/step_ab.sh; T0=$SECONDS; step nogpu 120 --batch 1"],
                       cwd=ROOT, capture_output=True, text=True, env={**_env(tmp_path), "OUT": str(out)}, timeout=150)
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("nogpu: rc=") and not first.startswith("nogpu: rc=0 "), r.stdout
    assert (out / "nogpu.log").is_file() and (out / "nogpu.log").read_text().strip()


def test_ncu_decode_pool_routing_replaces_the_ids():
    """``fused_moe_w4a16:T=16,routing=pool19``: the profiled call's ids come from one seeded pool of 19 experts (the
    step's routing), each token's top-k distinct; ``routing`` on a kernel without ids, or not ``poolN``, raises."""
    import importlib.util
    import pytest
    import torch
    spec = importlib.util.spec_from_file_location("ncu_decode", ROOT / "scripts" / "gpu" / "ncu_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    inp = {"topk_ids": torch.arange(96, dtype=torch.int32).view(16, 6), "w13_packed": torch.zeros(256, 1, 1),
           "x": torch.zeros(16, 8)}
    got = mod.with_routing("fused_moe_w4a16", inp, "pool19")
    ids = got["topk_ids"]
    assert ids.shape == (16, 6) and ids.dtype == torch.int32 and got["x"] is inp["x"]
    assert ids.unique().numel() <= 19 and all(row.unique().numel() == 6 for row in ids)
    assert torch.equal(ids, mod.with_routing("fused_moe_w4a16", inp, "pool19")["topk_ids"])   # seeded
    assert mod.with_routing("fused_moe_w4a16", inp, None) is inp
    with pytest.raises(ValueError, match="routing='pool19'"):
        mod.with_routing("o_proj", {"x": torch.zeros(1)}, "pool19")
    with pytest.raises(ValueError, match="routing='uniform'"):
        mod.with_routing("fused_moe_w4a16", inp, "uniform")
    with pytest.raises(ValueError, match="routing='poolx'"):
        mod.with_routing("fused_moe_w4a16", inp, "poolx")
