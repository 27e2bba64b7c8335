"""``ds4lab step``: the DeepSeek-V4-Flash decode step end to end, timed and attributed per op group.

One rank of the model (:func:`ds4lab.model.build_rank`, random weights at the real per-rank shapes
on a GPU, the tiny checkpoint on a CPU) decodes one step at batch ``B`` and ``next_n`` query rows
per request (1: plain decode; 2: MTP verification) against caches filled to ``ctx`` tokens.

Timing (same conventions as :mod:`ds4lab.harness.bench`):
- the step is captured in ONE CUDA graph per (batch, ctx, mode) and replayed; p20/p50/p80 of the
  replay times (CUDA events) are the step time (events around eager calls if capture fails, and the
  row says so). L2 is cold by construction: one step reads the whole rank (~38 GiB at TP=4), far
  more than the 60 MB L2, so no rotation is needed.
- roofs are measured in the same run (:func:`ds4lab.harness.bench.measure_roofs`); each op group's
  floor is its bytes at the copy roof.
- every point's replays are timed before the run profiles anything (:func:`schedule`): Kineto leaves CUPTI
  attached after a ``torch.profiler`` session, and an attached CUPTI slowed every graph replay timed after
  it (H200, torch 2.11, CUDA 13.0: batch 1 4,846 us before any profiling, 5,084-5,444 us for the same
  settings after; NOTES.md "cupti"). Releasing it instead (``TEARDOWN_CUPTI=1``) made the later profiled
  replays report kernel names the eager pass did not, so the groups could not be attributed.

Attribution (the method; it works on torch 2.11 + triton 3.6, where a graph replay's kernels show up
in the profiler but not the ranges they were captured in):
1. one eager step under ``torch.profiler`` with :class:`GroupRecorder` installed as the model's op
   hook (:func:`ds4lab.model.ops.set_hook`): each op group opens a ``record_function`` range, so each
   GPU activity (kernel, memcpy, memset) maps to a group through its launch's correlation id and the
   innermost range around that launch;
2. a few graph replays under ``torch.profiler``: the same activities in launch order (a graph
   replays its kernels in capture order on one stream);
3. the two sequences are aligned by kernel name (:func:`align_labels`; identical in practice, a
   ``difflib`` alignment otherwise): each replayed activity takes its eager twin's group. A group's
   time is the mean over the profiled replays of its activities' GPU durations; ``launches`` counts
   them. What the graph spends between activities is the row ``(gaps)``; the groups plus the gaps
   are the profiled replay, and ``sum_vs_p50`` compares that with the unprofiled p50.

All-reduce: a single GPU runs one rank, so where the TP ranks would all-reduce (after the attention
output projection and after the MoE, SPEC.md / vLLM ``DeepseekV4``) the recorder issues an equal-size
device copy (``T x hidden`` bf16) in the group ``comm.all_reduce (device copy)``: its time is the
local part only. The link cost is a separate stated assumption (:func:`link_assumptions`): PCIe
without P2P on GeForce (host bounce), P2P over PCIe on the pro cards; it is never added to the
measured step.

On a CPU the same function runs the tiny model on the Triton interpreter: eager, no graphs, host
wall time per group (``timing="wall (interpreter)"``) and Triton launches counted at the
interpreter's grid executor, so the attribution code path runs for real in tests and notebook 10.

Rows go to ``results/decode_step.csv`` (:data:`FIELDS`: the provenance columns of
``results/bench.csv`` plus the step's): one ``(step)`` row per configuration and one row per op group.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import datetime as _dt
import difflib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

from ds4lab.harness.switches import add_set_argument, apply_settings, overridden, split_settings

__all__ = ["FIELDS", "GroupRecorder", "StepPlan", "align_labels", "attribute_trace", "link_assumptions",
           "plan", "run_step", "main", "add_arguments", "summary_table", "load_rows", "configs", "group_table",
           "latest_configs", "ab_table",
           "launches_table", "local_step", "DEFAULT_CSV"]

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CSV = os.path.join(_ROOT, "results", "decode_step.csv")

PROVENANCE = ["timestamp", "gpu", "sm_clock_mhz", "mem_clock_mhz", "torch", "triton", "cuda", "git_sha", "build"]
FIELDS = PROVENANCE + [
    "tp", "rank", "batch", "next_n", "mode", "ctx", "group", "kind", "launches", "launches_per_layer",
    "us", "share", "bytes", "floor_us", "p20_us", "p50_us", "p80_us", "sum_vs_p50", "timing",
    "roof_copy_tbps", "roof_bf16_tflops", "roof_fp8_tflops", "sms", "allreduce_copies", "status", "note", "repro"]

STEP = "(step)"
GAPS = "(gaps)"
ALLREDUCE_GROUP = "comm.all_reduce (device copy)"
# op groups of ds4lab.model after which the TP ranks all-reduce (vLLM DeepseekV4: the attention
# output projection, whose wo_b is row-parallel, and the MoE's routed + shared sum) -> how many
# ``T x hidden`` bf16 tensors' bytes that all-reduce carries. ds4lab.model runs the shared expert first
# (fp32 down projection) and the routed experts add into that fp32 buffer (issue 20 moe1), so its MoE
# all-reduce is one call over the fp32 sum after ``moe.experts`` (2 bf16 tensors' bytes). The recorder
# matches a group name ending in one of these.
ALLREDUCE_AFTER = {"attn.o_proj": 1, "moe.experts": 2}
# ds4lab.model op group -> the decode model's ops (planner.speed.step_bytes) whose bytes it moves;
# groups not listed have no byte formula yet and get no floor: among them the q preparations, attn.q_norm_rope
# and indexer.q_quant, and (backend_kernel.FUSE_Q_INDEXER_Q, C4A layers) the one launch of both,
# attn.q_norm_rope+indexer.q_quant
GROUP_OPS = {
    # attn.wq_b: in C4A layers the indexer's wq_b runs in the same GEMM (ds4lab.model.weights.fuse_layer)
    "attn.wqkv_a": ("wq_a_wkv",), "attn.wq_b": ("wq_b", "indexer_wq_b"), "attn.o_proj": ("o_proj", "wo_b"),
    "attn.sparse_mla": ("sparse_mla",),
    # the SWA and indexer K inserts run inside their producers' launches (q_kv_norm_rope(swa_cache=),
    # compressor_insert): their bytes are those groups' (a lower bound: the norm's and the compressor's
    # own bytes have no formula in the decode model); the groups attn.swa_insert / indexer.k_insert are gone
    "attn.q_kv_norm_rope": ("kv_cache_insert",), "indexer.compressor": ("indexer_k_insert",),
    "indexer.logits_topk": ("mqa_logits", "topk_indices"), "moe.gate": ("router_gate",), "moe.route": ("moe_router",),
    "moe.gate_route": ("router_gate", "moe_router"),
    "moe.experts": ("moe_w13+moe_w2",), "moe.shared_w13": ("shared_gate_up",), "moe.shared_w2": ("shared_down",),
    "head.lm_head": ("lm_head",),
}

SMOKE = {"batches": (1, 16), "ctxs": (8192, 32768)}
FULL = {"batches": (1, 4, 8, 16), "ctxs": (8192, 32768, 131072)}


# ---- the op hook ---------------------------------------------------------------------------------

class GroupRecorder:
    """The op hook of the step (``ds4lab.model.ops.set_hook``): enter/exit of every op group.

    ``annotate``: open a ``torch.profiler.record_function(name)`` range per group (the eager
    profiled pass maps GPU activities to groups through them). ``wall``: host wall time per group
    (the CPU/interpreter path; exclusive of nested groups) and Triton launches per group counted at
    the interpreter's grid executor. ``allreduce``: after a group named in :data:`ALLREDUCE_AFTER`,
    copy the group's output-sized buffer (``T x hidden`` bf16, :meth:`arm_allreduce`) as the
    stand-in for the all-reduce (captured into the graph like any op).
    """

    def __init__(self, annotate: bool = False, wall: bool = False):
        self.annotate, self.wall = annotate, wall
        self.kinds: dict[str, str] = {}
        self.order: list[str] = []
        self.us: dict[str, float] = {}
        self.launches: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.allreduce_copies = 0
        self._stack: list[tuple[str, object, float]] = []
        self._ar: tuple | None = None

    # the model's Hook protocol
    def enter(self, name: str, kind: str) -> None:
        if name not in self.kinds:
            self.kinds[name] = kind
            self.order.append(name)
        self.calls[name] = self.calls.get(name, 0) + 1
        rf = None
        if self.annotate:
            import torch
            rf = torch.profiler.record_function(name)
            rf.__enter__()
        now = time.perf_counter()
        if self.wall and self._stack:  # exclusive time: pause the enclosing group
            outer = self._stack[-1][0]
            self.us[outer] = self.us.get(outer, 0.0) + (now - self._stack[-1][2]) * 1e6
        self._stack.append((name, rf, now))

    def exit(self, name: str, kind: str) -> None:
        top, rf, t0 = self._stack.pop()
        now = time.perf_counter()
        if self.wall:
            self.us[top] = self.us.get(top, 0.0) + (now - t0) * 1e6
            if self._stack:  # resume the enclosing group's clock
                o = self._stack[-1]
                self._stack[-1] = (o[0], o[1], now)
        if rf is not None:
            rf.__exit__(None, None, None)
        if self._ar is not None:
            for point, n in ALLREDUCE_AFTER.items():
                if name.endswith(point):
                    self._allreduce(n)
                    break

    def arm_allreduce(self, tokens: int, hidden: int, device) -> None:
        """Issue an ``n x tokens x hidden`` bf16 device copy after every all-reduce point (TP > 1)."""
        import torch
        n = max(ALLREDUCE_AFTER.values())
        src = torch.zeros(n, tokens, hidden, dtype=torch.bfloat16, device=device)
        self._ar = (src, torch.empty_like(src))

    def _allreduce(self, n: int = 1) -> None:
        src, dst = self._ar
        self.enter(ALLREDUCE_GROUP, "torch:copy_ (stand-in for the TP all-reduce)")
        dst[:n].copy_(src[:n])
        self.exit(ALLREDUCE_GROUP, "torch:copy_")
        self.allreduce_copies += 1

    def reset_counts(self) -> None:
        self.us.clear(), self.launches.clear(), self.calls.clear()
        self.allreduce_copies = 0

    @contextlib.contextmanager
    def counting_interpreter_launches(self):
        """Count Triton interpreter launches into the innermost open group (CPU path only)."""
        try:
            from triton.runtime.interpreter import GridExecutor
        except Exception:  # not an interpreter build: nothing to count
            yield
            return
        orig = GridExecutor.__call__
        rec = self

        def counted(ex, *a, **k):
            g = rec._stack[-1][0] if rec._stack else "(outside any group)"
            rec.launches[g] = rec.launches.get(g, 0) + 1
            return orig(ex, *a, **k)
        GridExecutor.__call__ = counted
        try:
            yield
        finally:
            GridExecutor.__call__ = orig


@contextlib.contextmanager
def _hooked(rec: GroupRecorder | None):
    from ds4lab.model.ops import set_hook
    old = set_hook(rec)
    try:
        yield rec
    finally:
        set_hook(old)


# ---- profiler traces -> groups -------------------------------------------------------------------

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _trace(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "trace.json")
        prof.export_chrome_trace(p)
        with open(p) as f:
            return json.load(f).get("traceEvents", [])


def attribute_trace(events: list[dict]) -> list[tuple[str, str, float]]:
    """An eager profiled step's trace events -> ``[(activity name, group, us)]`` in GPU order.

    Each GPU activity (``kernel`` / ``gpu_memcpy`` / ``gpu_memset``) is matched to the CPU runtime
    call that launched it (same ``correlation``), and that call to the innermost ``user_annotation``
    range (a :class:`GroupRecorder` group) around it on the same thread; none: ``(outside any group)``."""
    ann = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
    launch = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch[e["args"]["correlation"]] = e
    out = []
    for k in sorted((e for e in events if e.get("cat") in _GPU_CATS and e.get("ph") == "X"), key=lambda e: e["ts"]):
        c = launch.get(k.get("args", {}).get("correlation"))
        group = "(outside any group)"
        if c is not None:
            inner = [a for a in ann if a.get("tid") == c.get("tid") and a["ts"] <= c["ts"] <= a["ts"] + a["dur"]]
            if inner:
                group = min(inner, key=lambda a: a["dur"])["name"]
        out.append((k["name"], group, float(k.get("dur", 0.0))))
    return out


def busy_us(acts: list[tuple[str, float, float]]) -> float:
    """The time at least one of ``acts`` ``[(name, ts, us)]`` (sorted by ``ts``) runs: the length of the
    union of their intervals (activities of concurrent streams overlap; a GPU idle gap counts nowhere)."""
    busy, end = 0.0, float("-inf")
    for _, t, d in acts:
        if t + d > end:
            busy += t + d - max(t, end)
            end = t + d
    return busy


def replay_activities(events: list[dict]) -> list[tuple[str, float, float]]:
    """A profiled graph replay's GPU activities ``[(name, ts, us)]`` in GPU order."""
    return sorted(((e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in events
                   if e.get("cat") in _GPU_CATS and e.get("ph") == "X"), key=lambda x: x[1])


def align_labels(eager: list[tuple[str, str]], replay_names: list[str]) -> list[str]:
    """Group label for each replayed activity from the eager ``[(name, group)]`` sequence.

    Equal name sequences map one to one. The same names in another order (kernels of two streams
    interleaved differently in the eager pass and the replay, ``backend_kernel.BRANCH_STREAMS``) map
    occurrence by occurrence: the k-th replayed ``name`` gets the k-th eager ``name``'s group (each
    stream keeps its own order, and no kernel name runs on both streams at once). Otherwise a
    ``difflib`` alignment on names maps the matching runs and leaves the rest ``(unattributed)``
    (say, a kernel capture replaced)."""
    names = [n for n, _ in eager]
    if names == replay_names:
        return [g for _, g in eager]
    if collections.Counter(names) == collections.Counter(replay_names):
        queues: dict[str, collections.deque] = {}
        for n, g in eager:
            queues.setdefault(n, collections.deque()).append(g)
        return [queues[n].popleft() for n in replay_names]
    out = ["(unattributed)"] * len(replay_names)
    sm = difflib.SequenceMatcher(a=names, b=replay_names, autojunk=False)
    for a, b, n in sm.get_matching_blocks():
        for i in range(n):
            out[b + i] = eager[a + i][1]
    return out


# ---- the plan and its rows -----------------------------------------------------------------------

@dataclass
class StepPlan:
    """What one ``ds4lab step`` run measures: one build, TP degree(s), batches, contexts, modes."""
    tps: tuple[int, ...] = (4,)
    batches: tuple[int, ...] = FULL["batches"]
    ctxs: tuple[int, ...] = FULL["ctxs"]
    modes: tuple[str, ...] = ("plain", "mtp")
    build: str = "native"
    replays: int = 20
    profiled_replays: int = 3
    rank: int = 0
    smoke: bool = False
    backend: str = "kernel"  # "reference": the reference twin (what runs without ds4lab's kernels)
    extra: dict = field(default_factory=dict)
    settings: tuple[str, ...] = ()  # the --set overrides in force (ds4lab.harness.switches), for the rows
    variants: tuple[tuple[str, ...], ...] = ((),)  # each point is timed once per variant (--ab), in order

    def points(self):
        for tp in self.tps:
            for ctx in self.ctxs:
                for batch in self.batches:
                    for mode in self.modes:
                        yield tp, ctx, batch, mode


def schedule(p: StepPlan, gpu: bool):
    """The order one TP degree's points run in: ``(phase, what, ctx, batch, mode, variant_index)`` with
    ``what`` "fill" (make and fill the (ctx, batch) caches, shared by the modes and variants after it) or
    "point". On a GPU two phases, "time" (every point's graph replays, nothing profiled yet) then
    "profile" (every point's attribution, with the p50 of the first phase), so that no timed replay
    runs after a profiler session (see the module docstring); on a CPU one phase, "both" (the interpreter
    runs under no profiler: wall time and attribution come from the same runs). Several TP degrees in one
    run: each degree's model is built and scheduled in turn, so a later degree's replays are timed after the
    earlier one's profiling; time one TP degree per process for p50s that compare."""
    for phase in (("time", "profile") if gpu else ("both",)):
        for ctx in p.ctxs:
            for batch in p.batches:
                yield phase, "fill", ctx, batch, None, None
                for mode in p.modes:
                    for i in range(len(p.variants)):
                        yield phase, "point", ctx, batch, mode, i


def plan(smoke: bool = False, tps=None, batches=None, ctxs=None, modes=None, build="native",
         backend: str = "kernel") -> StepPlan:
    """The default plan (``smoke``: batch 1 and 16, ctx 8k and 32k) with any field overridden."""
    if backend not in ("kernel", "reference"):
        raise ValueError(f"backend={backend!r}: expected 'kernel' or 'reference'")
    base = SMOKE if smoke else FULL
    return StepPlan(tps=tuple(tps or (4,)), batches=tuple(batches or base["batches"]),
                    ctxs=tuple(ctxs or base["ctxs"]), modes=tuple(modes or ("plain", "mtp")), build=build,
                    smoke=smoke, backend=backend)


def link_assumptions(tp: int, tokens: int, hidden: int, n_allreduce: int) -> list[dict]:
    """The all-reduce link cost the measured step leaves out, per Ada card (a stated assumption,
    :data:`ds4lab.planner.speed.CARDS`: GeForce PCIe without P2P through host memory, pro cards P2P
    over PCIe): ``n_allreduce`` ring all-reduces of ``tokens x hidden`` bf16 at TP ``tp``."""
    from ds4lab.planner.speed import CARDS
    n = tokens * hidden * 2
    out = []
    for c in CARDS.values():
        per = c.allreduce_us + 2 * (tp - 1) / tp * n / (c.link_gbs * 1e9) * 1e6
        out.append({"card": c.name, "link GB/s": c.link_gbs, "latency us": c.allreduce_us,
                    "per all-reduce us": round(per, 2), "all-reduces": n_allreduce,
                    "per step us": round(per * n_allreduce, 1), "source": c.source})
    return out


def _provenance(build: str, device) -> dict:
    import torch
    import triton
    from ds4lab.banner import git_sha
    base = {"timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda or "",
            "git_sha": os.environ.get("DS4LAB_GIT_SHA") or git_sha(), "build": build}
    if device.type == "cuda":
        from ds4lab.harness.bench import _clocks
        props = torch.cuda.get_device_properties(device)
        sm, mem = _clocks()
        base.update(gpu=props.name, sm_clock_mhz=sm, mem_clock_mhz=mem, sms=props.multi_processor_count)
    else:
        base.update(gpu="cpu", sm_clock_mhz="", mem_clock_mhz="", sms="")
    return base


def _group_bytes(cfg, tp: int, batch: int, next_n: int, ctx: int, groups) -> dict[str, float]:
    """Bytes per op group of one step from the decode model's per-op formulas
    (:func:`ds4lab.planner.speed.step_bytes`, built on :mod:`ds4lab.harness.costs`), through
    :data:`GROUP_OPS`; a group not listed is absent (its floor stays empty: no formula yet).
    ``"(step)"`` carries the whole step's bytes (every op, formulas and estimates)."""
    from ds4lab.planner.speed import step_bytes
    per_op = step_bytes(cfg, tp, batch, next_n, ctx)
    out = {g: sum(per_op.get(op, 0.0) for op in GROUP_OPS[g]) for g in groups if g in GROUP_OPS}
    out[STEP] = sum(per_op.values())
    return out


def _decode_inputs(m, cfg, batch: int, next_n: int, ctx: int, device):
    import torch
    g = torch.Generator(device="cpu").manual_seed(batch * 131 + next_n)
    tokens = torch.randint(0, cfg.vocab_size, (batch, next_n), generator=g).to(device)
    positions = (ctx + torch.arange(next_n)).expand(batch, next_n).contiguous().to(device)
    return tokens, positions


def _build(cfg, tp: int, rank: int, device, checkpoint: str | None, backend: str = "kernel"):
    """Rank ``rank`` of TP ``tp`` on ``backend``: random weights at the real shapes, or the checkpoint's
    (quantized on load for the kernel backend; as stored, bf16, for the reference twin)."""
    from ds4lab.model import build_rank
    from ds4lab.model import weights as W
    if checkpoint:  # quantized on load: FP8 128x128 blocks + UE8M0, packed INT4 experts, as the kernels read
        w = W.load_tiny(checkpoint, cfg, tp, rank, quantize=backend == "kernel", device=device)
    else:
        w = W.random_weights(cfg, tp, rank, device=device, seed=0)
    return build_rank(cfg, tp, rank, w, device=device, backend=backend)


def _fill(m, caches, batch: int, ctx: int, cfg) -> str:
    """Fill every request's caches to ``ctx`` tokens: the model's benchmark fill, or, where the model
    has none yet (NotImplementedError), a real chunked prefill of ``ctx`` random tokens per request
    (exact, slow: small contexts only). Returns a note ('' for the benchmark fill)."""
    import torch
    try:
        m.fill_caches(caches, ctx)
        return ""
    except NotImplementedError:
        g = torch.Generator().manual_seed(ctx)
        for b in range(batch):
            m.prefill(torch.randint(0, cfg.vocab_size, (ctx,), generator=g), caches, req=b)
        return "caches filled by prefill (the model has no benchmark fill yet)"


def _replays_gpu(fn, rec: GroupRecorder, replays: int):
    """``((p20, p50, p80), timing)`` of ``fn``'s graph replays (``bench.time_calls``), with ``rec``
    installed for the all-reduce copies (part of the step)."""
    from ds4lab.harness.bench import time_calls
    with _hooked(rec):
        return time_calls([fn], replays=replays)


def _time_gpu(fn, rec: GroupRecorder, replays: int, profiled: int, timed=None):
    """Graph-capture ``fn`` (with ``rec`` installed for the all-reduce copies), replay; then the
    eager profiled pass and the profiled replays. ``timed``: the ``(quantiles, timing)`` of this point's
    replays measured earlier (:func:`schedule`'s "time" phase), used instead of timing here. Returns
    (quantiles, timing, per-group stats, note)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ds4lab.harness.bench import time_calls
    with _hooked(rec):
        if timed is None:
            (p20, p50, p80), timing = time_calls([fn], replays=replays)
        else:   # timed earlier: the warm-up time_calls gave (first-call work out of the profiled eager pass)
            (p20, p50, p80), timing = timed
            fn()
        # eager profiled pass: activities -> groups (counts from here are one step's)
        rec.reset_counts()
        rec.annotate = True
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        rec.annotate = False
        eager = attribute_trace(_trace(prof))
        ar_copies = rec.allreduce_copies
        # the graph, profiled
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        note = ""
        try:
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        except Exception as e:  # events timing already says so; attribute the eager activities
            run, note = None, f"graph capture failed ({type(e).__name__}); groups from the eager pass"
    stats: dict[str, dict] = {}
    scale = 1  # profiled replays the activities below cover
    if run is not None:
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(profiled):
                run()
            torch.cuda.synchronize()
        acts = replay_activities(_trace(prof))
        if not eager or not acts:
            note = f"profiled replay showed {len(acts)} activities, the eager pass {len(eager)}; groups from the eager pass"
            reps = [eager]
        else:
            labels = align_labels([(a, gname) for a, gname, _ in eager] * profiled, [a for a, _, _ in acts])
            if len(acts) != profiled * len(eager):
                note = f"replay: {len(acts) / profiled:.0f} activities per step, eager {len(eager)} (aligned by name)"
            # the replays as one sequence, averaged per replay below
            reps = [[(a, lab, d) for (a, _, d), lab in zip(acts, labels)]]
            span = max(t + d for _, t, d in acts) - acts[0][1]
            busy = busy_us(acts)
            stats[GAPS] = {"us": (span - busy) / profiled, "launches": 0}
            overlap = sum(d for _, _, d in acts) - busy
            if overlap > 0.005 * span:   # concurrent streams: the groups add up to more than the busy time
                note = (note + "; " if note else "") + f"streams overlap {overlap / profiled:.0f} us a step"
            scale = profiled
    else:
        reps = [eager]
    for r in reps:
        for _, gname, d in r:
            st = stats.setdefault(gname, {"us": 0.0, "launches": 0})
            st["us"] += d / scale
            st["launches"] += 1
    for gname in stats:
        if gname != GAPS:
            stats[gname]["launches"] = round(stats[gname]["launches"] / scale)
    return (p20, p50, p80), timing, stats, note, ar_copies


def _time_cpu(fn, rec: GroupRecorder, replays: int, timing: str = "wall (interpreter)"):
    """Eager runs on the CPU: wall time per group (exclusive) and interpreter launches per group,
    taken from the run whose wall time is the median (so the groups add up to that p50 run, less
    the time outside any group)."""
    rec.wall = True
    runs = []
    with _hooked(rec), rec.counting_interpreter_launches():
        if replays > 1:
            fn()  # warm-up (imports, first-call work); the interpreter compiles nothing, so one run may skip it
        for _ in range(max(1, replays)):
            rec.reset_counts()
            t0 = time.perf_counter()
            fn()
            dt = (time.perf_counter() - t0) * 1e6
            runs.append((dt, dict(rec.us), dict(rec.launches), rec.allreduce_copies))
    from ds4lab.harness.bench import _quantiles
    q = _quantiles([r[0] for r in runs])
    _, us, launches, copies = min(runs, key=lambda r: abs(r[0] - q[1]))
    stats = {g: {"us": us.get(g, 0.0), "launches": launches.get(g, 0)} for g in rec.order}
    for g, n in launches.items():
        stats.setdefault(g, {"us": 0.0, "launches": n})
    return q, timing, stats, "", copies


def _config_rows(base, cfg, tp, rank, batch, mode, ctx, q, timing, stats, kinds, note, roofs, ar_copies,
                 repro) -> list[dict]:
    next_n = 2 if mode == "mtp" else 1
    p20, p50, p80 = q
    layers = cfg.num_hidden_layers
    gb = _group_bytes(cfg, tp, batch, next_n, ctx, stats)
    copy_tbps = (roofs or {}).get("roof_copy_tbps")
    total = sum(s["us"] for s in stats.values())
    launches = sum(s["launches"] for s in stats.values())
    common = {**base, **(roofs or {}), "tp": tp, "rank": rank, "batch": batch, "next_n": next_n, "mode": mode,
              "ctx": ctx, "timing": timing, "allreduce_copies": ar_copies, "repro": repro}
    step_bytes = gb.pop(STEP, "")
    rows = [{**common, "group": STEP, "kind": "", "launches": launches,
             "launches_per_layer": round(launches / layers, 1), "us": round(p50, 2), "share": 1.0,
             "bytes": step_bytes, "floor_us": round(step_bytes / (copy_tbps * 1e6), 2) if step_bytes and copy_tbps else "",
             "p20_us": round(p20, 2), "p50_us": round(p50, 2), "p80_us": round(p80, 2),
             "sum_vs_p50": round(total / p50, 3) if p50 else "", "status": "OK", "note": note}]
    for gname, st in sorted(stats.items(), key=lambda kv: -kv[1]["us"]):
        b = gb.get(gname, "")
        rows.append({**common, "group": gname, "kind": kinds.get(gname, ""), "launches": st["launches"],
                     "launches_per_layer": round(st["launches"] / layers, 2), "us": round(st["us"], 2),
                     "share": round(st["us"] / total, 4) if total else "", "bytes": b,
                     "floor_us": round(b / (copy_tbps * 1e6), 3) if b != "" and copy_tbps else "",
                     "status": "OK", "note": ""})
    return rows


def _point_call(m, caches, cfg, tp, batch, mode, ctx, device):
    """One point's step call and its recorder: ``(fn, rec)``; ``fn()`` decodes one step (``next_n`` 2 in
    mode "mtp") at positions ``ctx..`` of the filled ``caches``."""
    next_n = 2 if mode == "mtp" else 1
    tokens, positions = _decode_inputs(m, cfg, batch, next_n, ctx, device)
    rec = GroupRecorder()
    if tp > 1:
        rec.arm_allreduce(batch * next_n, cfg.hidden_size, device)
    return (lambda: m.decode(tokens, positions, caches)), rec


def routed_experts(m, fn) -> dict:
    """Run ``fn`` (one eager step of model ``m``; outside every timed region) and count, at each
    ``m.ops.experts`` call (one a MoE layer), the distinct routed experts its ``ids`` (``(T, top_k)`` int32,
    -1 = no expert) name and its valid (token, slot) pairs.

    Returns ``{"layers": n, "mean": float, "min": int, "max": int, "pairs": int}`` (``{}`` when the step made no
    experts call). Why: the routed MoE's time follows the distinct experts a call touches (issue 20, moe16:
    the kernel bench's ~14.5 + 1.8 us an expert at TP=4), and a random-weight model need not route like a
    trained checkpoint, so the step records what its own routing did (NOTES "moe16", "A discrepancy")."""
    import torch
    ops = m.ops
    own = vars(ops).get("experts")   # an instance attribute already there (restored below), else the method
    orig = ops.experts
    counts, pairs = [], []

    def counting(x, ex, weights, ids, *a, **k):
        valid = ids[ids >= 0]
        counts.append(int(torch.unique(valid).numel()))
        pairs.append(int(valid.numel()))
        return orig(x, ex, weights, ids, *a, **k)

    ops.experts = counting
    try:
        fn()
    finally:
        if own is None:
            del ops.experts
        else:
            ops.experts = own
    if not counts:
        return {}
    return {"layers": len(counts), "mean": sum(counts) / len(counts), "min": min(counts), "max": max(counts),
            "pairs": max(pairs)}


def experts_note(stats: dict) -> str:
    """:func:`routed_experts`'s count as a row note: ``"routed experts a MoE layer: mean 44.2 (30-61) for 96
    pairs, 43 layers"`` ('' for ``{}``)."""
    if not stats:
        return ""
    return (f"routed experts a MoE layer: mean {stats['mean']:.1f} ({stats['min']}-{stats['max']}) for "
            f"{stats['pairs']} pairs, {stats['layers']} layers")


def _time_point(m, caches, fill_err, p, cfg, tp, batch, mode, ctx, device):
    """:func:`schedule`'s "time" phase for one point: ``((p20, p50, p80), timing)`` of its graph replays,
    or the exception that stopped it (the "profile" phase reports it as the point's ERROR row)."""
    try:
        if fill_err:
            raise RuntimeError(fill_err)
        fn, rec = _point_call(m, caches, cfg, tp, batch, mode, ctx, device)
        return _replays_gpu(fn, rec, p.replays)
    except Exception as e:
        # kept until the "profile" phase: without its traceback, whose frames would hold this point's
        # caches, graph and activations (say, after an out-of-memory) through the rest of the run
        e.__traceback__ = e.__context__ = e.__cause__ = None
        return e


def _point(m, caches, fill_err, p, base, cfg, tp, batch, mode, ctx, roofs, gpu, device, log,
           settings=(), repeat: int = 1, timed=None) -> list[dict]:
    """One (tp, ctx, batch, mode) point: its rows, or one ERROR row naming what failed. ``settings``: the
    ``--set`` / ``--ab`` overrides in force (the rows' note and repro name them); ``repeat`` > 1: the n-th
    timing of the same settings at this point in this run (``--abba``), marked after the repro's command.
    ``timed``: this point's replays timed earlier (:func:`_time_point`: quantiles and timing, or the error
    that stopped them); None: timed here."""
    next_n = 2 if mode == "mtp" else 1
    repro = (f"python3 -m ds4lab.harness.step --tp {tp} --batch {batch} --ctx {ctx} --mode {mode} --arch {p.build}"
             + ("" if p.backend == "kernel" else f" --backend {p.backend}")
             + "".join(f" --set '{x}'" for x in settings) + (f"  # timing {repeat}" if repeat > 1 else ""))
    try:
        if fill_err:
            raise RuntimeError(fill_err)
        if isinstance(timed, Exception):
            raise timed
        fn, rec = _point_call(m, caches, cfg, tp, batch, mode, ctx, device)
        if gpu:
            q, timing, stats, note, ar = _time_gpu(fn, rec, p.replays, p.profiled_replays, timed)
            note = "; ".join(x for x in (note, experts_note(routed_experts(m, fn))) if x)
        else:
            q, timing, stats, note, ar = _time_cpu(fn, rec, p.replays, "wall (interpreter)" if p.backend == "kernel"
                                                   else "wall (CPU, torch eager)")
        if settings:
            note = "; ".join(x for x in (f"set {', '.join(settings)}", note) if x)
        new = _config_rows(base, cfg, tp, p.rank, batch, mode, ctx, q, timing, stats, rec.kinds, note, roofs, ar,
                           repro)
        log(f"TP={tp} ctx={ctx} B={batch} {mode}{' [' + ', '.join(settings) + ']' if settings else ''}: "
            f"p50 {new[0]['p50_us']:.1f} us, {new[0]['launches']} launches "
            f"({new[0]['launches_per_layer']}/layer), groups/p50 {new[0]['sum_vs_p50']}")
        return new
    except Exception as e:
        row = {**base, "tp": tp, "rank": p.rank, "batch": batch, "next_n": next_n, "mode": mode, "ctx": ctx,
               "group": STEP, "status": "ERROR", "note": f"{type(e).__name__}: {e}"[:300], "repro": repro}
        log(f"ERROR TP={tp} ctx={ctx} B={batch} {mode}: {row['note']}")
        return [row]


def run_step(p: StepPlan, device=None, checkpoint: str | None = None, cfg=None, csv_path: str | None = None,
             log=print, model=None) -> list[dict]:
    """Measure every point of plan ``p``; returns the rows (also appended to ``csv_path``).

    Args:
        p: the plan (:func:`plan`).
        device: ``cuda`` (graphs, profiler) or ``cpu`` (the Triton interpreter; eager, wall time).
            Default: cuda when available.
        checkpoint: a checkpoint folder to load (the tiny one on a CPU); None: random weights at
            the real per-rank shapes.
        cfg: the model config (default: the checkpoint's config.json, else DeepSeek-V4-Flash).
        model: an already built rank (tests reuse one); its ``tp``/``rank`` must match the plan.

    A point that fails (out of memory, a kernel error) gives one ``status=ERROR`` row naming the
    error; the other points still run.
    """
    import torch
    from ds4lab.geometry import DEFAULT_CONFIG, load_config
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if cfg is None:
        cfg = load_config(os.path.join(checkpoint, "config.json")) if checkpoint else DEFAULT_CONFIG
    gpu = device.type == "cuda"
    roofs = None
    if gpu:
        from ds4lab.harness.bench import measure_roofs
        roofs = measure_roofs()
        log(f"roofs: {roofs}")
    base = _provenance(p.build, device)
    rows: list[dict] = []

    def emit(new):
        rows.extend(new)
        if csv_path:
            write_csv(new, csv_path)

    for tp in p.tps:
        m = model
        if m is None:
            t0 = time.perf_counter()
            m = _build(cfg, tp, p.rank, device, checkpoint, p.backend)
            log(f"built rank {p.rank} of TP={tp} in {time.perf_counter() - t0:.1f} s")
        caches, timed = None, {}
        for phase, what, ctx, batch, mode, i in schedule(p, gpu):
            if what == "fill":   # one fill per (ctx, batch) and phase, shared by the modes (a step writes
                caches = None    # only positions >= ctx)
                if gpu:
                    torch.cuda.empty_cache()
                fill_err, fill_note = None, ""
                try:
                    caches = m.new_caches(batch, ctx + 8)
                    fill_note = _fill(m, caches, batch, ctx, cfg)
                except Exception as e:
                    fill_err = f"cache fill: {type(e).__name__}: {e}"
                continue
            variant = p.variants[i]
            with overridden(variant):
                if phase == "time":
                    timed[(ctx, batch, mode, i)] = _time_point(m, caches, fill_err, p, cfg, tp, batch, mode, ctx,
                                                               device)
                    continue
                new = _point(m, caches, fill_err, p, base, cfg, tp, batch, mode, ctx, roofs, gpu, device, log,
                             settings=tuple(p.settings) + tuple(variant), repeat=1 + p.variants[:i].count(variant),
                             timed=timed.get((ctx, batch, mode, i)))
            if fill_note:
                new[0]["note"] = "; ".join(x for x in (new[0].get("note"), fill_note) if x)
            emit(new)
        del caches
        if gpu:
            torch.cuda.empty_cache()
        if model is None:
            del m
            if gpu:
                torch.cuda.empty_cache()
    return rows


# ---- CSV and tables ------------------------------------------------------------------------------

def write_csv(rows: list[dict], path: str) -> None:
    new = not os.path.exists(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)


def load_rows(path: str = DEFAULT_CSV) -> list[dict]:
    """The committed (or given) decode-step rows, numbers parsed; [] when the file does not exist."""
    if not os.path.exists(path):
        return []
    num = {"tp", "rank", "batch", "next_n", "ctx", "launches", "sms", "allreduce_copies"}
    flt = {"launches_per_layer", "us", "share", "bytes", "floor_us", "p20_us", "p50_us", "p80_us", "sum_vs_p50",
           "roof_copy_tbps", "roof_bf16_tflops", "roof_fp8_tflops"}
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            for k in num | flt:
                v = r.get(k)
                if v not in (None, ""):
                    try:
                        r[k] = int(float(v)) if k in num else float(v)
                    except ValueError:
                        pass
                else:
                    r[k] = None
            out.append(r)
    return out


def summary_table(rows: list[dict], top: int = 5) -> list[dict]:
    """Per configuration: p50, launches (per layer), groups/p50 and the top op groups by time."""
    out = []
    for r in rows:
        if r.get("group") != STEP:
            continue
        key = (r.get("build"), r.get("tp"), r.get("batch"), r.get("mode"), r.get("ctx"))
        groups = [g for g in rows if g.get("group") not in (STEP,) and g.get("timestamp") == r.get("timestamp")
                  and g.get("repro") == r.get("repro")   # the --ab variants of one point share a timestamp
                  and (g.get("build"), g.get("tp"), g.get("batch"), g.get("mode"), g.get("ctx")) == key]
        groups.sort(key=lambda g: -(g.get("us") or 0))
        out.append({"build": key[0], "tp": key[1], "batch": key[2], "mode": key[3], "ctx": key[4],
                    "status": r.get("status"), "p50_us": r.get("p50_us"), "launches": r.get("launches"),
                    "per_layer": r.get("launches_per_layer"), "groups/p50": r.get("sum_vs_p50"),
                    "top": ", ".join(f"{g['group']} {float(g['us'] or 0):.0f}" for g in groups[:top]),
                    **({"set": _settings_of(r)} if any(_settings_of(x) for x in rows) else {})})
    return out


def _settings_of(row: dict) -> str:
    """The ``--set`` overrides a row ran under (from its repro), '' for the defaults."""
    parts = str(row.get("repro") or "").split("  # ")[0].split(" --set ")[1:]
    return ", ".join(x.strip().strip("'") for x in parts)


def configs(rows: list[dict]) -> list[dict]:
    """The ``(step)`` rows (one per measured configuration), in file order."""
    return [r for r in rows if r.get("group") == STEP]


def latest_configs(rows: list[dict]) -> list[dict]:
    """The OK ``(step)`` rows of the newest run per ``(build, tp, batch, mode, ctx)`` with the defaults (an A/B
    variant's rows, ``--set`` in their repro, left out), in file order: one bar per point in a chart."""
    best: dict[tuple, dict] = {}
    for r in configs(rows):
        if r.get("status") != "OK" or _settings_of(r):
            continue
        k = tuple(r.get(c) for c in ("build", "tp", "batch", "mode", "ctx"))
        if k not in best or str(r.get("timestamp") or "") >= str(best[k].get("timestamp") or ""):
            best[k] = r
    keep = {id(r) for r in best.values()}
    return [r for r in configs(rows) if id(r) in keep]


def ab_table(rows: list[dict]) -> list[dict]:
    """Each A/B variant (``--ab``) against the defaults of its own run and point: p50 us, the sum of the
    profiled op groups (us; the steadier of the two across variants, NOTES.md "Session 7"), launches per
    layer, and the differences to the defaults. A variant timed more than once at a point (``--abba``:
    the sequence, then again reversed, so a linear drift cancels) is averaged, and so are the defaults;
    ``n`` says how many timings each side has. [] when no run had variants."""
    def total(step):
        return sum(float(g.get("us") or 0) for g in group_table(rows, step))
    k = ("timestamp", "build", "tp", "batch", "mode", "ctx")
    runs: dict[tuple, dict[str, list]] = {}
    for r in configs(rows):
        if r.get("status") == "OK":
            runs.setdefault(tuple(r.get(c) for c in k), {}).setdefault(_settings_of(r), []).append(r)
    mean = lambda xs: sum(xs) / len(xs)   # noqa: E731
    out = []
    for key, by_set in runs.items():
        base = by_set.get("")
        if not base or len(by_set) < 2:
            continue
        bp, bs = mean([float(b["p50_us"]) for b in base]), mean([total(b) for b in base])
        bl = float(base[0]["launches_per_layer"])
        for sets, rs in by_set.items():
            if not sets:
                continue
            rp, rsum = mean([float(r["p50_us"]) for r in rs]), mean([total(r) for r in rs])
            r = rs[0]
            out.append({"build": r.get("build"), "tp": r.get("tp"), "batch": r.get("batch"), "mode": r.get("mode"),
                        "ctx": r.get("ctx"), "set": sets, "n": f"{len(rs)}/{len(base)}", "p50_us": round(rp, 1),
                        "d_p50_us": round(rp - bp, 1), "groups_us": round(rsum, 1), "d_groups_us": round(rsum - bs, 1),
                        "per_layer": r.get("launches_per_layer"),
                        "d_per_layer": round(float(r["launches_per_layer"]) - bl, 2), "git_sha": r.get("git_sha")})
    return out


def group_table(rows: list[dict], step_row: dict) -> list[dict]:
    """The op-group rows of the configuration ``step_row`` heads (same run and point), by time:
    group, kind, launches (per step and per layer), us, share, bytes, floor at the copy roof."""
    key = ("timestamp", "build", "tp", "batch", "mode", "ctx", "repro")
    g = [r for r in rows if r.get("group") != STEP and all(r.get(k) == step_row.get(k) for k in key)]
    g.sort(key=lambda r: -(float(r.get("us") or 0)))
    cols = ("group", "kind", "launches", "launches_per_layer", "us", "share", "bytes", "floor_us")
    return [{c: r.get(c) for c in cols} for r in g]


def launches_table(rows: list[dict]) -> list[dict]:
    """Per configuration: p50, launches per step and per layer, groups/p50 (the attribution check), and
    the commit whose tree ran it (``git_sha``: the committed CSV may hold rows of several runs)."""
    cols = ("build", "tp", "batch", "mode", "ctx", "timing", "status", "p50_us", "launches",
            "launches_per_layer", "sum_vs_p50", "allreduce_copies", "git_sha", "note")
    return [{c: r.get(c) for c in cols} for r in configs(rows)]


def model_missing(backend: str = "kernel") -> str | None:
    """Why :func:`run_step` cannot build a ``backend`` rank here (None: it can): the parts of
    :mod:`ds4lab.model` it needs (composition, weights, that backend; the benchmark cache fill for
    the kernel backend's real-shape runs)."""
    import importlib.util
    need = ["ds4lab.model.model", "ds4lab.model.weights",
            "ds4lab.model.backend_kernel" if backend == "kernel" else "ds4lab.model.backend_ref"]
    if backend == "kernel":
        need.append("ds4lab.model.fill")
    gone = [m for m in need if importlib.util.find_spec(m) is None]
    return f"ds4lab.model lacks {', '.join(gone)} in this tree" if gone else None


def local_step(batches=(1,), ctxs=(8192,), modes=("plain", "mtp"), tp: int = 4, cpu_ctx: int = 8,
               checkpoint: str | None = None, replays: int = 10, log=print) -> tuple[list[dict], str]:
    """The step on this machine, as notebook 10 runs it: on a GPU, rank 0 of TP ``tp`` with random
    weights at the real shapes at a small context (``ctxs``); on a CPU, the tiny checkpoint's model
    (TP=1) on the Triton interpreter at ``cpu_ctx`` tokens, one batch, plain decode (eager, wall
    time: the attribution code path, not a speed). Returns ``(rows, what ran)``; when the model
    package cannot build a rank yet, ``([], reason)``."""
    import torch
    gpu = torch.cuda.is_available()
    backend = "kernel" if model_missing("kernel") is None else "reference"
    missing = model_missing(backend)
    if missing or (gpu and backend != "kernel"):
        return [], f"not run: {missing or model_missing('kernel')}"
    if gpu:
        p = plan(tps=(tp,), batches=batches, ctxs=ctxs, modes=modes)
        p.replays = replays
        return run_step(p, device="cuda", log=log), f"GPU live: TP={tp} rank 0, random weights, ctx {list(ctxs)}"
    from ds4lab.checkpoint.tiny import ensure_tiny_checkpoint
    ck = str(checkpoint or ensure_tiny_checkpoint())
    p = plan(tps=(1,), batches=batches[:1], ctxs=(cpu_ctx,), modes=("plain",), backend=backend)
    p.replays = 1
    what = ("CPU: the tiny checkpoint's model on the Triton interpreter (eager, wall time)" if backend == "kernel" else
            f"CPU: the tiny checkpoint's reference twin (torch; {model_missing('kernel')}: no kernels yet), eager, "
            "wall time")
    return run_step(p, device="cpu", checkpoint=ck, log=log), f"{what}, ctx {cpu_ctx}"


def _print_table(rows: list[dict]) -> None:
    from ds4lab.tables import format_table
    print(format_table(summary_table(rows), digits=4))


# ---- CLI -----------------------------------------------------------------------------------------

def _int_at_least(lo: int):
    """argparse type: an int >= ``lo`` (a bad --batch/--ctx/--tp fails at parse time, before a model
    is built or an ERROR row is appended to OUT/decode_step.csv)."""
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r}: expected an int") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v}: must be >= {lo}")
        return v
    return parse


def add_arguments(p) -> None:
    p.add_argument("--tp", type=_int_at_least(1), action="append", help="TP degree(s) of the rank (default 4)")
    p.add_argument("--batch", type=_int_at_least(1), action="append", help="batch size(s) (default 1 4 8 16)")
    p.add_argument("--ctx", type=_int_at_least(0), action="append", help="context length(s) (default 8k 32k 128k)")
    p.add_argument("--mode", action="append", choices=["plain", "mtp"], help="plain decode / MTP verify (next_n=2)")
    p.add_argument("--arch", default="native", choices=["native", "sm89"],
                   help="native build, or the sm_89 build assembled for this GPU (as ds4lab bench)")
    p.add_argument("--smoke", action="store_true", help="batch 1 and 16, ctx 8k and 32k (< 3 min on the H200)")
    p.add_argument("--replays", type=_int_at_least(1), help="graph replays timed per point (default 20; --cpu: 3 runs)")
    p.add_argument("--checkpoint", help="load this checkpoint folder instead of random weights")
    p.add_argument("--backend", default="kernel", choices=["kernel", "reference"],
                   help="ds4lab's kernels (default) or the reference twin (torch only)")
    p.add_argument("--cpu", action="store_true",
                   help="run on the CPU (Triton interpreter; needs --checkpoint; default TP 1, batch 1, ctx 16, plain)")
    p.add_argument("--out", default="results", help="folder; rows are appended to OUT/decode_step.csv")
    add_set_argument(p, ab=True)
    p.add_argument("--abba", action="store_true",
                   help="with --ab: time the variants in order, then again in reverse order (ab_table averages them)")


def main(args) -> int:
    from ds4lab.harness.bench import _setup_build
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if not args.checkpoint:
            raise ValueError("--cpu needs --checkpoint (the tiny checkpoint: ds4lab tiny --out DIR)")
    else:
        _setup_build(args.arch)
    import torch
    if not args.cpu and not torch.cuda.is_available():
        print("ds4lab step: no CUDA device here. On a CPU run the tiny model on the interpreter with "
              "--cpu --checkpoint DIR; the committed H200 rows are results/decode_step.csv.", file=sys.stderr)
        return 2
    if args.cpu:
        from ds4lab import interp
        interp.install()
    if args.cpu:  # the tiny model on the interpreter: one small point unless asked otherwise
        args.tp, args.batch = args.tp or [1], args.batch or [1]
        args.ctx, args.mode = args.ctx or [16], args.mode or ["plain"]
    # after the build is chosen (the overridden modules import triton), before the model is built
    applied = apply_settings(getattr(args, "settings", None))
    for path, name, old, new in applied:
        print(f"--set {path}.{name}: {old!r} -> {new!r}")
    p = plan(args.smoke, args.tp, args.batch, args.ctx, args.mode, args.arch, args.backend)
    p.settings = tuple(args.settings or ())
    variants = [split_settings(v) for v in (getattr(args, "variants", None) or [])]
    for v in variants:   # a bad --ab fails here, before a model is built
        with overridden(v):
            pass
    p.variants = ((),) + tuple(variants)
    if getattr(args, "abba", False) and variants:   # A B C, then C B A: a linear drift cancels in ab_table
        p.variants = p.variants + p.variants[::-1]
    p.replays = args.replays or (3 if args.cpu else 20)
    path = os.path.join(args.out, "decode_step.csv")
    rows = run_step(p, device="cpu" if args.cpu else "cuda", checkpoint=args.checkpoint, csv_path=path)
    _print_table(rows)
    bad = [r for r in rows if r.get("status") != "OK"]
    print(f"{len(rows)} rows -> {path}; {len(bad)} not OK")
    return 1 if bad else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m ds4lab.harness.step", description=__doc__.splitlines()[0])
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
