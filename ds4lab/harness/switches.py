"""Run-time overrides of the decode path's module switches, for A/B runs of the step and the model check.

The kernel backend's choices (``ds4lab.model.backend_kernel.COMPRESS_ONE_LAUNCH``, ``INDEXER_FUSED_MAX_N``,
``GATE_FUSED_MAX_T``, ...) and the kernels' own tables (``ds4lab_kernels.moe_gate.DECODE_DEFAULTS``,
``ds4lab_kernels.moe_w4a16.DECODE_MAX_PAIRS``, ...) are module constants, so that one home holds each
default. ``--set backend_kernel.COMPRESS_ONE_LAUNCH=False`` rebinds one of them in this process before the
model is built, so a single device call can time the step with a candidate switched on and off.

A setting is ``MODULE.NAME=VALUE``: ``MODULE`` is ``backend_kernel`` (``ds4lab.model.backend_kernel``) or
a kernel module of ``ds4lab_kernels`` (``moe_gate``, ``fp8_gemm``, ...); ``NAME`` must already exist there
(an upper-case constant); ``VALUE`` is a Python literal (``ast.literal_eval``: ``True``, ``2048``,
``{"sm_89": [(2, "r2w4")]}``) of the same type as the current value (an int may replace a float, and a
list a tuple).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import re

__all__ = ["add_set_argument", "parse_setting", "apply_settings", "restore", "overridden", "describe"]

_PACKAGES = {"backend_kernel": "ds4lab.model.backend_kernel"}


def _module_name(mod: str) -> str:
    if mod in _PACKAGES:
        return _PACKAGES[mod]
    if not mod.isidentifier():
        raise ValueError(f"--set: module {mod!r} is not a name (expected backend_kernel or a ds4lab_kernels module)")
    return f"ds4lab_kernels.{mod}"


def parse_setting(text: str) -> tuple[str, str, object]:
    """``"MODULE.NAME=VALUE"`` -> ``(module path, NAME, value)``; checks the form and the literal only.

    Raises:
        ValueError: naming ``--set`` and the bad part (no ``=``, no ``MODULE.``, a lower-case or
            private ``NAME``, a ``VALUE`` that is not a Python literal).
    """
    key, eq, raw = text.partition("=")
    if not eq:
        raise ValueError(f"--set {text!r}: expected MODULE.NAME=VALUE")
    mod, dot, name = key.strip().rpartition(".")
    if not dot or not mod:
        raise ValueError(f"--set {text!r}: expected MODULE.NAME=VALUE (e.g. backend_kernel.COMPRESS_ONE_LAUNCH=False)")
    if not name.isidentifier() or name.startswith("_") or name.upper() != name:
        raise ValueError(f"--set {text!r}: NAME {name!r} must be a public upper-case constant")
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"--set {text!r}: VALUE {raw.strip()!r} is not a Python literal ({e})") from None
    return _module_name(mod), name, value


def _compatible(old, new) -> bool:
    if old is None or new is None:  # an optional switch: None means off (e.g. a row name or None)
        return True
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool)
    if isinstance(old, (int, float)) and isinstance(new, (int, float)):
        return not (isinstance(old, int) and isinstance(new, float))
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        return True
    return type(old) is type(new)


def apply_settings(settings: list[str] | None) -> list[tuple[str, str, object, object]]:
    """Rebind each ``MODULE.NAME=VALUE`` of ``settings`` (in order); returns ``(module, name, old, new)``
    per setting. A list or tuple value is stored with the old value's type.

    Call before the model is built (the backend reads its switches per call, the kernels their tables
    per launch, so a rebinding holds for everything built or launched after it).

    Raises:
        ValueError: a malformed setting (see :func:`parse_setting`), a module that does not import,
            a NAME the module does not define, or a VALUE of another type than the current one (None
            may replace, or be replaced by, any value: an optional switch).
            Nothing is rebound when any setting is bad.
    """
    plan = []
    for text in settings or []:
        path, name, value = parse_setting(text)
        try:
            module = importlib.import_module(path)
        except ImportError as e:
            raise ValueError(f"--set {text!r}: module {path} does not import ({e})") from None
        if not hasattr(module, name):
            raise ValueError(f"--set {text!r}: {path} has no {name}")
        old = getattr(module, name)
        if not _compatible(old, value):
            raise ValueError(f"--set {text!r}: {path}.{name} is {type(old).__name__} ({old!r}), "
                             f"got {type(value).__name__}")
        if isinstance(old, (list, tuple)):
            value = type(old)(value)
        plan.append((module, path, name, old, value))
    for module, _path, name, _old, value in plan:
        setattr(module, name, value)
    return [(path, name, old, value) for _m, path, name, old, value in plan]


def restore(applied: list[tuple[str, str, object, object]]) -> None:
    """Undo :func:`apply_settings` (its return value), last setting first."""
    for path, name, old, _new in reversed(applied):
        setattr(importlib.import_module(path), name, old)


@contextlib.contextmanager
def overridden(settings):
    """``with overridden(["backend_kernel.COMPRESS_ONE_LAUNCH=False"]):`` the settings hold inside the block only
    (the step's A/B variants: one model, one cache fill, one CUDA graph per variant)."""
    applied = apply_settings(list(settings))
    try:
        yield applied
    finally:
        restore(applied)


def describe(applied: list[tuple[str, str, object, object]]) -> str:
    """The rows' note for a run with overrides: ``"set backend_kernel.COMPRESS_ONE_LAUNCH=False; ..."`` ('' if none)."""
    if not applied:
        return ""
    short = {v: k for k, v in _PACKAGES.items()}
    parts = [f"{short.get(p, p.removeprefix('ds4lab_kernels.'))}.{n}={v!r}" for p, n, _o, v in applied]
    return "set " + "; ".join(parts)


def split_settings(text: str) -> tuple[str, ...]:
    """One ``--ab`` value ``"SETTING[,SETTING...]"`` -> its settings: split at the commas that start a new
    ``MODULE.NAME=``, so a list, tuple or dict literal keeps its own commas
    (``"backend_kernel.BRANCH_MAIN_FIRST=('attn', 'moe'),moe_gate.X=1"`` is two settings)."""
    parts = re.split(r",\s*(?=[A-Za-z_]\w*\.[A-Za-z_]\w*\s*=)|,\s*$", text)
    return tuple(x.strip() for x in parts if x.strip())


def add_set_argument(p: argparse.ArgumentParser, ab: bool = False) -> None:
    """``--set MODULE.NAME=VALUE`` (repeatable) on a harness CLI; ``ab``: also ``--ab SETTING[,SETTING...]``,
    one extra variant per use, each timed after the plain run at every point."""
    p.add_argument("--set", dest="settings", action="append", metavar="MODULE.NAME=VALUE",
                   help="override a decode switch before the model is built, e.g. "
                        "backend_kernel.COMPRESS_ONE_LAUNCH=False or moe_w4a16.DECODE_MAX_PAIRS=96 (repeatable)")
    if ab:
        p.add_argument("--ab", dest="variants", action="append", metavar="SETTING[,SETTING...]",
                       help="also time each point with these settings on top of --set (repeatable: one variant "
                            "per use; the rows' note names it), e.g. --ab backend_kernel.COMPRESS_ONE_LAUNCH=False")
