"""The feasible utilization window per operating mode and the changes that fix an impossible one."""
from __future__ import annotations

from dataclasses import dataclass, field

from ds4lab.geometry import DEFAULT_CONFIG, SUPPORTED_TP, ModelConfig
from ds4lab.planner.plan import JIT_HEADROOM, JIT_SOURCE, Plan, plan
from ds4lab.planner.terms import GiB

__all__ = ["Remedy", "Recommendation", "find_remedy", "recommend", "longest_max_model_len"]


@dataclass(frozen=True)
class Remedy:
    """Settings that make an impossible mode feasible, found by planning them (not a rule of thumb).

    ``overrides``: the :func:`plan` keywords changed; ``flags``: the same change as ``vllm serve`` /
    ``ds4lab plan`` flags; ``plan``: the plan at the highest utilization that keeps the mode's JIT
    headroom, where vLLM starts.
    """
    mode: str
    overrides: dict
    flags: str
    plan: Plan

    @property
    def util(self) -> float:
        return self.plan.gpu_memory_utilization


@dataclass(frozen=True)
class Recommendation:
    """Feasible utilization window and the setting for watched / unattended operation.

    ``util_min``: smallest utilization at which vLLM starts (KV fits one max_model_len request);
    ``util_max_watched`` / ``util_max_unattended``: largest that leaves the JIT headroom.
    ``watched`` / ``unattended``: recommended utilization or None when impossible; ``reasons``
    explains each bound; ``fixes`` says what to change when a mode is impossible (concrete flags
    first); ``remedies`` holds, per impossible mode, the first change :func:`find_remedy` found
    that makes it feasible.
    """
    util_min: float | None
    util_max_watched: float | None
    util_max_unattended: float | None
    watched: float | None
    unattended: float | None
    reasons: tuple[str, ...]
    fixes: tuple[str, ...]
    plans: dict
    remedies: dict = field(default_factory=dict)
    at: float | None = None   # the utilization the fixes were computed at (asked, else the watched pick)

    def table(self) -> list[dict]:
        """One row per mode; an impossible mode reads ``impossible`` and is followed by a
        ``<mode> (fixed)`` row planned with the remedy's flags."""
        out = []
        for mode in ("watched", "unattended"):
            p = self.plans.get(mode)
            out.append(_rec_row(mode, p, "(as given)"))
            r = self.remedies.get(mode)
            if p is None:
                out.append(_rec_row(f"{mode} (fixed)", r.plan, r.flags) if r else
                           _rec_row(f"{mode} (fixed)", None, "none found"))
        return out


def _rec_row(mode: str, p: Plan | None, flags: str) -> dict:
    if p is None:
        return {"mode": mode, "gpu_memory_utilization": "impossible", "kv_tokens": "-",
                "max_concurrency": "-", "headroom_gib": "-", "flags": flags}
    return {"mode": mode, "gpu_memory_utilization": p.gpu_memory_utilization, "kv_tokens": p.kv.tokens,
            "max_concurrency": round(p.kv.max_concurrency, 2), "headroom_gib": round(p.headroom_bytes / GiB, 2),
            "flags": flags}


def _utils(lo: float, hi: float, step: float) -> list[float]:
    n = int(round((hi - lo) / step))
    return [round(lo + step * i, 4) for i in range(n + 1)]


def _mode_plan(cfg: ModelConfig, need: int, utils: list[float], kw: dict) -> Plan | None:
    """The plan at the highest utilization in ``utils`` that keeps ``need`` bytes of headroom,
    if vLLM starts there (None otherwise: KV grows with util, so no lower util starts either)."""
    for u in reversed(utils):
        p = plan(cfg, gpu_memory_utilization=u, **kw)
        if p.headroom_bytes >= need:
            return None if (p.kv.refused or p.load_oom) else p
    return None


def _flag_text(overrides: dict) -> str:
    parts = []
    for k, v in overrides.items():
        if k == "async_scheduling":
            parts.append("--async-scheduling" if v else "--no-async-scheduling")
        elif k == "tp":
            parts.append(f"--tensor-parallel-size {v}")
        else:
            parts.append(f"--{k.replace('_', '-')} {v}")
    return " ".join(parts)


def find_remedy(cfg: ModelConfig = DEFAULT_CONFIG, mode: str = "watched", step: float = 0.005,
                lo: float = 0.50, hi: float = 0.99, **kw) -> Remedy | None:
    """The first change to a setting that makes ``mode`` feasible, or None.

    Tried in this order, least intrusive first, each planned at the highest utilization that keeps
    the mode's :data:`JIT_HEADROOM`: ``--no-async-scheduling``; ``--max-num-batched-tokens`` 1024,
    512, 256 (each alone, then without async scheduling; these shrink the sliding-window /
    compressor reservation, ``max_in_flight_tokens``); ``--max-model-len`` down to the longest that
    fits (:func:`longest_max_model_len`, a multiple of 1024); ``--tensor-parallel-size`` up. Accepts
    :func:`plan`'s keywords. Raises ValueError for an unknown ``mode``.
    """
    if mode not in JIT_HEADROOM:
        raise ValueError(f"mode={mode!r}: one of {sorted(JIT_HEADROOM)}")
    kw.pop("gpu_memory_utilization", None)
    kw.pop("jit_headroom", None)
    need, utils = JIT_HEADROOM[mode], _utils(lo, hi, step)
    base = plan(cfg, gpu_memory_utilization=hi, **kw)
    b0, seqs, async0 = base.max_num_batched_tokens, base.max_num_seqs, kw.get("async_scheduling", True)
    cands: list[dict] = []
    for b in [b0] + [b for b in (1024, 512, 256) if seqs <= b < b0]:
        for a in ([True, False] if async0 else [False]):
            ov: dict = {}
            if b != b0:
                ov["max_num_batched_tokens"] = b
            if async0 and not a:
                ov["async_scheduling"] = False
            if ov:
                cands.append(ov)
    # the longest max_model_len that fits where this mode's headroom allows (as given otherwise)
    top = next((u for u in reversed(utils) if plan(cfg, gpu_memory_utilization=u, **kw).headroom_bytes >= need),
               None)
    if top is not None:
        est = longest_max_model_len(cfg, block=1024, **dict(kw, gpu_memory_utilization=top,
                                                             max_model_len=base.max_model_len))
        if 0 < est < base.max_model_len:
            cands.append({"max_model_len": est})
    cands += [{"tp": t} for t in SUPPORTED_TP if t > base.tp]
    for ov in cands:
        try:
            p = _mode_plan(cfg, need, utils, dict(kw, **ov))
        except ValueError:   # e.g. a TP the geometry does not divide
            continue
        if p is not None:
            return Remedy(mode, ov, _flag_text(ov), p)
    return None


def recommend(cfg: ModelConfig = DEFAULT_CONFIG, step: float = 0.005, lo: float = 0.50,
              hi: float = 0.99, remedies: bool = True, **kw) -> Recommendation:
    """The feasible ``--gpu-memory-utilization`` window for a setting and a value per mode.

    A utilization is feasible when vLLM would start (one ``max_model_len`` request fits the KV
    pool) and ``(1 - util) * total`` keeps the JIT headroom of the mode (:data:`JIT_HEADROOM`).
    Watched operation takes the highest feasible value (most KV; a JIT OOM costs a restart you
    see); unattended the highest with the larger headroom. For a mode with no feasible value,
    ``remedies`` (default on) runs :func:`find_remedy` and puts its flags first in ``fixes``.
    Accepts :func:`plan`'s keywords; ``gpu_memory_utilization`` is the utilization asked for: the
    fixes (e.g. "lower --max-model-len to <= N") are computed there, so N itself fits at that
    utilization (default: the watched value, else the highest util that keeps the watched headroom,
    else 0.95: what ``ds4lab plan`` plans when no utilization is given; ``Recommendation.at``).
    """
    asked = kw.pop("gpu_memory_utilization", None)
    kw.pop("jit_headroom", None)
    utils = _utils(lo, hi, step)
    plans = [plan(cfg, gpu_memory_utilization=u, **kw) for u in utils]
    ok = [p for p in plans if not p.kv.refused and not p.load_oom]
    g = plans[0].gpu
    util_min = ok[0].gpu_memory_utilization if ok else None
    reasons, fixes = [], []
    p_hi = plans[-1]
    if util_min is None:
        reasons.append(f"even at util {hi} vLLM does not start: {p_hi.verdict or 'no KV memory'}")
    else:
        p0 = ok[0]
        reasons.append(
            f"util >= {util_min}: below it the KV pool cannot hold one {p0.max_model_len}-token request "
            f"({p0.kv.blocks_per_request} blocks of {p0.kv.bytes_per_block:,} B = "
            f"{p0.kv.needed_bytes / GiB:.2f} GiB; {p0.kv.fixed_blocks_per_request} of them are the "
            f"sliding-window/compressor reservation for {p0.max_in_flight_tokens} in-flight tokens)")
    res: dict = {}
    maxes = {}
    found: dict = {}
    for mode in ("watched", "unattended"):
        need = JIT_HEADROOM[mode]
        cands = [p for p in ok if p.headroom_bytes >= need]
        umax_all = max((p.gpu_memory_utilization for p in plans if p.headroom_bytes >= need), default=None)
        maxes[mode] = umax_all
        if umax_all is not None:
            reasons.append(f"{mode}: util <= {umax_all}: keeps >= {need / GiB:.2f} GiB outside the torch pool "
                           f"for Triton JIT modules / driver on {g.name} ({JIT_SOURCE})")
        if cands:
            res[mode] = cands[-1]
            continue
        if util_min is not None:
            reasons.append(f"{mode}: impossible - the KV minimum (util {util_min}) leaves less than "
                           f"{need / GiB:.2f} GiB of JIT headroom")
        else:
            reasons.append(f"{mode}: impossible - vLLM does not start at any util up to {hi}")
        r = find_remedy(cfg, mode, step=step, lo=lo, hi=hi, **kw) if remedies else None
        if r is not None:
            found[mode] = r
            k = r.plan.kv
            fixes.append(f"{mode}: add {r.flags} -> util {r.util}: {k.tokens:,} KV tokens, "
                         f"{k.max_concurrency:.2f}x concurrency, {r.plan.headroom_bytes / GiB:.2f} GiB headroom")
        elif remedies:
            fixes.append(f"{mode}: no single change tried (async scheduling off, max-num-batched-tokens "
                         f"1024/512/256, shorter max-model-len, higher TP) makes it feasible")
    at = asked if asked is not None else (
        res["watched"].gpu_memory_utilization if "watched" in res else maxes["watched"] or 0.95)
    if len(res) < 2:
        fixes.append(_fixes(cfg, plan(cfg, gpu_memory_utilization=at, **kw), kw))
    return Recommendation(util_min, maxes["watched"], maxes["unattended"],
                          res["watched"].gpu_memory_utilization if "watched" in res else None,
                          res["unattended"].gpu_memory_utilization if "unattended" in res else None,
                          tuple(reasons), tuple(dict.fromkeys(f for f in fixes if f)), res, found, at)


def longest_max_model_len(cfg: ModelConfig = DEFAULT_CONFIG, *, block: int = 256, **kw) -> int:
    """The longest ``--max-model-len`` (a multiple of ``block``) at which vLLM starts with this
    setting, at the plan's own utilization (0 if none does). Each candidate is planned in full
    (workspaces shrink with L too), so the result fits and ``result + block`` does not. Accepts
    :func:`plan`'s keywords (``max_model_len`` is the upper bound)."""
    top = kw.pop("max_model_len", 98304)

    def starts(n: int) -> bool:
        p = plan(cfg, max_model_len=n, **kw)
        return not (p.kv.refused or p.load_oom)

    lo, hi = 0, top // block   # in blocks; 0 stands for "none"
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if starts(mid * block):
            lo = mid
        else:
            hi = mid - 1
    return lo * block


def _fixes(cfg: ModelConfig, p: Plan, kw: dict) -> str:
    """What to change for the plan ``p`` at its own utilization (the one asked for)."""
    k = p.kv
    if p.load_oom:
        return (f"the weights alone need {p.weight_bytes / GiB:.1f} GiB per GPU: raise TP "
                f"(the experts and attention split across ranks) or use a smaller checkpoint format")
    parts = []
    if k.refused:
        n = longest_max_model_len(cfg, **dict(kw, gpu_memory_utilization=p.gpu_memory_utilization,
                                              max_model_len=p.max_model_len))
        if n:
            parts.append(f"lower --max-model-len to <= {n} (starts at util {p.gpu_memory_utilization})")
    if k.fixed_blocks_per_request > 64:
        parts.append(f"lower --max-num-batched-tokens (now {p.max_num_batched_tokens}; the sliding-window "
                     f"caches reserve {k.fixed_blocks_per_request} blocks for {p.max_in_flight_tokens} "
                     f"in-flight tokens per request) or turn async scheduling off")
    parts.append("raise TP or use a smaller checkpoint format")
    return "; ".join(parts)

