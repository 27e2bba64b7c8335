"""Count a model step's would-be GPU launches per op group on a CPU (the Triton interpreter lane).

The step profile (:mod:`ds4lab.harness.step`) counts real kernels on a GPU; on a CPU it sees only
the interpreter's Triton launches. :func:`count_launches` adds the torch glue: every aten op the
step dispatches that would issue a CUDA kernel (views, ``empty*``, ``detach`` and other
metadata-only ops do not; one Triton launch is one launch, whatever aten ops the interpreter runs
inside it) is charged to the innermost :func:`ds4lab.model.ops.op_group` open at the time, or to
``"(outside any group)"``. A torch op counts as one launch; cuBLAS may issue two for one matmul on
a GPU (split-K), so GPU counts can be a little higher for ``torch:matmul`` groups.
"""
from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds4lab.model.ops import set_hook

__all__ = ["count_launches", "OUTSIDE", "NO_LAUNCH"]

OUTSIDE = "(outside any group)"
#: aten ops (overload packet names) that allocate or re-describe memory without a kernel
NO_LAUNCH = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "alias", "lift_fresh",
    "resize_", "set_", "_reshape_alias", "as_strided", "_unsafe_view", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "is_contiguous",
})


class _Stack:
    """The op hook: the stack of open op groups."""

    def __init__(self):
        self.stack: list[str] = []

    def enter(self, name: str, kind: str) -> None:
        self.stack.append(name)

    def exit(self, name: str, kind: str) -> None:
        self.stack.pop()

    def top(self) -> str:
        return self.stack[-1] if self.stack else OUTSIDE


@contextlib.contextmanager
def _triton_launches(on_launch):
    """Call ``on_launch()`` at every Triton interpreter launch; ``inside[0]`` is True during one."""
    inside = [False]
    try:
        from triton.runtime.interpreter import GridExecutor
    except Exception:   # not an interpreter build
        yield inside
        return
    orig = GridExecutor.__call__

    def counted(ex, *a, **k):
        on_launch()
        inside[0] = True
        try:
            return orig(ex, *a, **k)
        finally:
            inside[0] = False
    GridExecutor.__call__ = counted
    try:
        yield inside
    finally:
        GridExecutor.__call__ = orig


def count_launches(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` once and return ``(result, counts)``: ``counts`` a
    :class:`collections.Counter` of launches per op group (see the module doc), with the calls per
    group in ``counts.calls`` (how often each group was entered)."""
    st = _Stack()
    counts: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    class Hook(_Stack):
        def enter(self, name, kind):
            calls[name] += 1
            st.enter(name, kind)

        def exit(self, name, kind):
            st.exit(name, kind)

    def on_triton():
        counts[st.top()] += 1

    old = set_hook(Hook())
    try:
        with _triton_launches(on_triton) as inside:
            class Mode(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, a=(), kw=None):
                    if not inside[0] and not func.is_view and func.overloadpacket.__name__ not in NO_LAUNCH:
                        counts[st.top()] += 1
                    return func(*a, **(kw or {}))
            with Mode():
                out = fn(*args, **kwargs)
    finally:
        set_hook(old)
    counts.calls = calls
    return out, counts
