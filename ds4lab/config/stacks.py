"""The known software stacks (``ds4lab/config/stacks.toml``) as data for the doctor and the launcher."""
from __future__ import annotations

import os
import tomllib
from functools import lru_cache

__all__ = ["STACKS_PATH", "stacks", "stack", "option_value"]

STACKS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stacks.toml")


@lru_cache(maxsize=1)
def stacks() -> dict[str, dict]:
    with open(STACKS_PATH, "rb") as f:
        return tomllib.load(f)


def stack(name: str) -> dict:
    """One stack by name; ValueError naming the known ones otherwise."""
    s = stacks()
    if name not in s:
        raise ValueError(f"stack {name!r}: known stacks are {sorted(s)}")
    return s[name]


def option_value(argv: list[str], flag: str, *aliases: str) -> str | None:
    """The value of ``flag`` (or one of its ``aliases``, e.g. ``-tp`` for ``--tensor-parallel-size``)
    in an argv (``--flag v`` or ``--flag=v``); the last one wins, as in vLLM's argparse."""
    names = (flag, *aliases)
    out = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                out = argv[i + 1]
            elif a.startswith(n + "="):
                out = a.split("=", 1)[1]
    return out
