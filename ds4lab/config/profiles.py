"""Serve profiles (``ds4lab/config/profiles.toml``) as data: loading, and the settings' types and
ranges (:data:`SETTINGS`, :func:`check_setting`, :func:`parse_setting`).

A profile names a stack of ``stacks.toml`` and the settings of one deployment;
:func:`ds4lab.serve.launch.build_launch` turns one into an argv and environment. Pure Python (TOML
only): no vLLM, torch or kernels import.
"""
from __future__ import annotations

import json
import os
import tomllib
from functools import lru_cache
from typing import Any, Mapping

__all__ = ["PROFILES_PATH", "load_profiles", "profile", "SETTINGS", "check_setting", "parse_setting"]

PROFILES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles.toml")

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
    "host": ("str", None, None, "address to listen on (beyond loopback an api_key_file is required)"),
    "api_key_file": ("str", None, None, "file (mode 0600) holding the API key vLLM requires on /v1/*"),
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

