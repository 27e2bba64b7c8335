"""What the checks look at: :class:`DoctorContext` (environ, checked interpreter, HF cache, stack
profile, server argv) and how the real one is gathered (:func:`gather_context`)."""
from __future__ import annotations

import os
import shlex
import sys
import threading
from dataclasses import dataclass, field

from ds4lab.config.stacks import option_value, stack, stacks
from ds4lab.doctor.probes import probe_python, probe_triton_compile

__all__ = ["hf_cache_dir", "ServerCmdError", "split_server_cmd", "DoctorContext", "default_profile",
           "resolve_profile_name", "default_server_argv", "gather_context"]


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
    _compile_lock: threading.Lock = field(init=False, repr=False, compare=False, default_factory=threading.Lock)

    def __post_init__(self):
        self.hf_cache_given = self.hf_cache is not None
        if self.hf_cache is None:
            self.hf_cache = hf_cache_dir(self.environ)

    def get_facts(self) -> dict:
        if self.facts is None:
            self.facts = probe_python(self.python, self.environ, torch=self.probe_torch, hash_moe=self.probe_hash_moe)
        return self.facts

    def get_compile_facts(self) -> dict:
        """The Triton AOT probe, run once: a caller arriving while another thread runs it waits."""
        with self._compile_lock:
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

    @property
    def tensor_parallel_size(self) -> int:
        """``--tensor-parallel-size`` / ``-tp`` of the server command, else the profile's, else 1.
        :class:`ServerCmdError` when the command's value is not an integer >= 1."""
        v = option_value(self.server_argv, "--tensor-parallel-size", "-tp")
        if not v:
            return int(self.profile.get("tensor_parallel_size", 1))
        flag = "--tensor-parallel-size" if option_value(self.server_argv, "--tensor-parallel-size") == v else "-tp"
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
        m = option_value(self.server_argv, "--model")
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
    from ds4lab.config.profiles import load_profiles

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

