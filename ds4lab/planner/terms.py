"""Units and the one line of a per-rank budget (:class:`Term`) the planner modules share.

All sizes are bytes unless a name says ``_gib``.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GiB", "MiB", "FP32", "BF16", "cdiv", "round_up", "format_gib", "Term"]

GiB = 1 << 30
MiB = 1 << 20
FP32 = 4
BF16 = 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(x: int, a: int) -> int:
    return cdiv(x, a) * a


def format_gib(b: int | float) -> str:
    """vLLM's ``vllm.utils.mem_utils.format_gib``: ``round(b / GiB, 2)`` as text."""
    return f"{round(b / GiB, 2)}"


@dataclass(frozen=True)
class Term:
    """One line of the per-rank budget: ``bytes`` on each GPU, where it lives and why."""
    name: str
    bytes: int
    group: str      # weights | activations | workspaces | graphs | non_torch | kv | headroom
    source: str
    replicated: bool = False

    @property
    def gib(self) -> float:
        return self.bytes / GiB
