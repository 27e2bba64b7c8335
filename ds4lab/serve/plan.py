"""The planner adapter: a merged serve profile -> the memory planner's verdict per card
(:func:`ds4lab.planner.memory.plan_for_profile`), for ``ds4lab serve --print/--artifacts``. torch-free."""
from __future__ import annotations

from typing import Any, Mapping

from ds4lab.config.stacks import stack as _stack

__all__ = ["plan_cards"]


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

