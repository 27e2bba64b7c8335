"""ds4lab.harness.step on a CPU: the attribution code path for real (ds4lab kernels on the Triton
interpreter inside the model's op groups), the trace parsing and alignment the GPU path uses, the
rows/CSV, and - once the model composition has landed - the tiny model's step."""
import os

import pytest
import torch

from ds4lab.harness import step as S
from ds4lab.model.ops import op_group

INTERP = os.environ.get("TRITON_INTERPRET") == "1"


# ---- the GPU path's pure parts -------------------------------------------------------------------

def test_align_labels_maps_equal_sequences_and_aligns_the_rest():
    eager = [("k_quant", "ffn.act_quant"), ("k_gemm", "attn.wq_b"), ("k_copy", "comm"), ("k_gemm", "attn.wo_b")]
    assert S.align_labels(eager, ["k_quant", "k_gemm", "k_copy", "k_gemm"]) == [g for _, g in eager]
    # a replay where capture replaced one kernel: the rest still maps, the odd one is unattributed
    got = S.align_labels(eager, ["k_quant", "k_gemm", "memcpy_node", "k_gemm"])
    assert got == ["ffn.act_quant", "attn.wq_b", "(unattributed)", "attn.wo_b"]


def test_align_labels_maps_interleaved_streams_occurrence_by_occurrence():
    """Two streams (backend_kernel.BRANCH_STREAMS): the replay interleaves the side chain's kernels with
    the main chain's in another order than the eager pass; each name's k-th occurrence keeps its group."""
    eager = [("k_mm", "attn.x_proj"), ("k_comp", "attn.compressor"), ("k_gemm", "attn.wqkv_a"),
             ("k_norm", "attn.q_kv_norm_rope"), ("k_gemm", "attn.wq_b")]
    replay = ["k_gemm", "k_mm", "k_norm", "k_comp", "k_gemm"]
    assert S.align_labels(eager, replay) == ["attn.wqkv_a", "attn.x_proj", "attn.q_kv_norm_rope",
                                             "attn.compressor", "attn.wq_b"]


def test_busy_us_counts_overlapping_activities_once():
    acts = [("a", 0.0, 10.0), ("b", 5.0, 10.0), ("c", 6.0, 2.0), ("d", 20.0, 1.0)]
    assert S.busy_us(acts) == 16.0          # [0, 15] and [20, 21]
    assert S.busy_us([("a", 0.0, 1.0), ("b", 1.0, 1.0)]) == 2.0
    assert S.busy_us([]) == 0.0


def test_attribute_trace_uses_the_innermost_range_of_the_launch():
    """The kineto chrome-trace shape: user_annotation ranges on the CPU thread, cuda_runtime launches
    carrying a correlation id, kernels on the GPU with the same id."""
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "moe", "ts": 0, "dur": 100, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "moe.experts", "ts": 10, "dur": 50, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 20, "dur": 2, "tid": 1,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 80, "dur": 2, "tid": 1,
         "args": {"correlation": 8}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 200, "dur": 2, "tid": 1,
         "args": {"correlation": 9}},
        {"ph": "X", "cat": "kernel", "name": "_moe_kernel", "ts": 1000, "dur": 40.0, "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "_combine", "ts": 1050, "dur": 5.0, "args": {"correlation": 8}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 1060, "dur": 3.0, "args": {"correlation": 9}},
    ]
    assert S.attribute_trace(ev) == [("_moe_kernel", "moe.experts", 40.0), ("_combine", "moe", 5.0),
                                     ("Memcpy DtoD", "(outside any group)", 3.0)]
    assert [n for n, _, _ in S.replay_activities(ev)] == ["_moe_kernel", "_combine", "Memcpy DtoD"]


def test_plan_smoke_and_link_assumptions():
    p = S.plan(smoke=True)
    assert p.batches == (1, 16) and p.ctxs == (8192, 32768) and p.tps == (4,)
    assert len(list(p.points())) == 2 * 2 * 2
    link = {r["card"]: r for r in S.link_assumptions(4, 1, 4096, 86)}
    assert link["RTX 4090-48G"]["per step us"] > link["RTX 6000 Ada"]["per step us"]  # no P2P on GeForce


# ---- the CPU path: real kernels on the interpreter inside op groups ------------------------------

class KernelChain:
    """A two-layer stand-in rank whose ops are real ds4lab kernels (activation quant + FP8 GEMM on
    the interpreter) and torch ops, each in the model's op groups, with the step's face
    (new_caches / fill_caches / decode). It exercises run_step's CPU path without the full model."""

    def __init__(self, K=256, N=128):
        from ds4lab.harness.specs.fp8_gemm import make_inputs
        w = make_inputs({"M": 1, "N": N, "K": K, "a_fmt": "ue8m0_packed", "b_fmt": "ue8m0"})
        self.b, self.b_scale, self.K = w["b"], w["b_scale"], K

    def new_caches(self, batch, max_ctx):
        return {"kv": torch.zeros(batch, 4)}

    def fill_caches(self, caches, ctx):
        caches["kv"].fill_(ctx)

    def decode(self, tokens, positions, caches):
        from ds4lab_kernels.fp8_gemm import fp8_gemm_nt
        from ds4lab_kernels.fp8_quant import per_token_group_quant_fp8
        x = torch.randn(tokens.numel(), self.K).bfloat16()
        for _ in range(2):
            with op_group("layer.attn", "torch:container"):
                with op_group("attn.act_quant", "kernel:per_token_group_quant_fp8"):
                    q, s = per_token_group_quant_fp8(x, 128, scale_fmt="ue8m0_packed")
                with op_group("attn.o_proj", "kernel:fp8_gemm_nt"):
                    y = fp8_gemm_nt(q, s, self.b, self.b_scale)
            with op_group("moe.experts", "torch:add"):
                x = x + y.sum() * 0
        return y


@pytest.mark.interp
@pytest.mark.skipif(not INTERP, reason="the CPU path runs on the Triton interpreter")
def test_run_step_cpu_attributes_real_kernel_launches(tmp_path):
    from ds4lab.geometry import DEFAULT_CONFIG
    p = S.plan(tps=(4,), batches=(1,), ctxs=(64,), modes=("plain",))
    p.replays = 1
    path = tmp_path / "decode_step.csv"
    rows = S.run_step(p, device="cpu", cfg=DEFAULT_CONFIG, csv_path=str(path), log=lambda *a: None,
                      model=KernelChain())
    step = rows[0]
    assert step["group"] == S.STEP and step["status"] == "OK", step.get("note")
    by = {r["group"]: r for r in rows[1:]}
    assert by["attn.act_quant"]["launches"] >= 2 and by["attn.o_proj"]["launches"] >= 2   # 2 layers, >= 1 each
    assert by["moe.experts"]["launches"] == 0                                           # torch: no Triton launch
    assert by["attn.o_proj"]["kind"] == "kernel:fp8_gemm_nt"
    # TP=4: an all-reduce stand-in after each o_proj and each MoE sum (2 per layer here)
    assert step["allreduce_copies"] == 4 and by[S.ALLREDUCE_GROUP]["us"] > 0
    # exclusive times: the container group holds only its own glue, and the groups sum to the step
    assert by["layer.attn"]["us"] < by["attn.o_proj"]["us"]
    assert 0.8 < step["sum_vs_p50"] <= 1.0 + 1e-6
    assert step["launches"] == sum(r["launches"] for r in rows[1:])
    # bytes from the decode model's formulas where the group maps to its ops (GROUP_OPS)
    from ds4lab.planner.speed import step_bytes
    sb = step_bytes(DEFAULT_CONFIG, 4, 1, 1, 64)
    assert by["attn.o_proj"]["bytes"] == pytest.approx(sb["o_proj"] + sb["wo_b"])
    assert by["attn.act_quant"]["bytes"] == "" and step["bytes"] == pytest.approx(sum(sb.values()))
    back = S.load_rows(str(path))
    assert len(back) == len(rows) and back[0]["p50_us"] == pytest.approx(step["p50_us"], rel=1e-3)
    t = S.summary_table(back)
    assert len(t) == 1 and t[0]["launches"] == step["launches"] and "attn.o_proj" in t[0]["top"]


def test_ab_variants_time_each_point_once_per_variant(tmp_path):
    """``--ab``: one model and cache fill, each point timed plain then per variant with its settings in
    force only there; the rows' note and repro name the settings and the tables keep the variants apart."""
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.model import backend_kernel as BK
    before = BK.DECODE_MAX_T
    seen = []

    class Spy(KernelChain):
        def decode(self, *a, **k):
            seen.append(BK.DECODE_MAX_T)
            return super().decode(*a, **k)
    p = S.plan(tps=(4,), batches=(1,), ctxs=(64,), modes=("plain",))
    p.replays = 1
    p.variants = ((), ("backend_kernel.DECODE_MAX_T=32",))
    path = tmp_path / "decode_step.csv"
    rows = S.run_step(p, device="cpu", cfg=DEFAULT_CONFIG, csv_path=str(path), log=lambda *a: None, model=Spy())
    steps = [r for r in rows if r["group"] == S.STEP]
    assert [r["status"] for r in steps] == ["OK", "OK"] and BK.DECODE_MAX_T == before   # restored after
    assert set(seen) == {before, 32}
    assert "--set" not in steps[0]["repro"] and steps[1]["repro"].endswith(" --set 'backend_kernel.DECODE_MAX_T=32'")
    assert steps[1]["note"].startswith("set backend_kernel.DECODE_MAX_T=32")
    t = S.summary_table(S.load_rows(str(path)))
    assert [r["set"] for r in t] == ["", "backend_kernel.DECODE_MAX_T=32"]
    assert len(S.group_table(rows, steps[1])) == len(rows) // 2 - 1   # its own groups only
    assert S.latest_configs(rows) == [steps[0]]                        # the chart's one bar: the defaults
    ab = S.ab_table(rows)
    assert [r["set"] for r in ab] == ["backend_kernel.DECODE_MAX_T=32"]
    groups = lambda st: sum(g["us"] for g in S.group_table(rows, st))   # noqa: E731
    assert ab[0]["d_groups_us"] == pytest.approx(groups(steps[1]) - groups(steps[0]), abs=0.2)
    assert ab[0]["d_p50_us"] == pytest.approx(steps[1]["p50_us"] - steps[0]["p50_us"], abs=0.1)
    assert ab[0]["n"] == "1/1"
    # --abba: the sequence, then reversed; each side averaged over its two timings
    p.variants = p.variants + p.variants[::-1]
    rows2 = S.run_step(p, device="cpu", cfg=DEFAULT_CONFIG, log=lambda *a: None, model=Spy())
    steps2 = [r for r in rows2 if r["group"] == S.STEP]
    assert [S._settings_of(r) for r in steps2] == ["", "backend_kernel.DECODE_MAX_T=32"] * 1 + \
        ["backend_kernel.DECODE_MAX_T=32", ""]
    ab2 = S.ab_table(rows2)
    assert len(ab2) == 1 and ab2[0]["n"] == "2/2"
    assert steps2[3]["repro"].endswith("  # timing 2") and len(S.group_table(rows2, steps2[3])) == len(rows2) // 4 - 1
    g2 = [sum(g["us"] for g in S.group_table(rows2, st)) for st in steps2]
    assert ab2[0]["d_groups_us"] == pytest.approx((g2[1] + g2[2]) / 2 - (g2[0] + g2[3]) / 2, abs=0.2)
    want = (steps2[1]["p50_us"] + steps2[2]["p50_us"]) / 2 - (steps2[0]["p50_us"] + steps2[3]["p50_us"]) / 2
    assert ab2[0]["d_p50_us"] == pytest.approx(want, abs=0.1)


def test_failed_point_is_one_error_row(tmp_path):
    class Broken(KernelChain):
        def fill_caches(self, caches, ctx):
            raise RuntimeError("no room for ctx")
    p = S.plan(tps=(1,), batches=(1,), ctxs=(64,), modes=("mtp",))
    rows = S.run_step(p, device="cpu", cfg=None, log=lambda *a: None, model=Broken.__new__(Broken))
    assert len(rows) == 1 and rows[0]["status"] == "ERROR" and "no room for ctx" in rows[0]["note"]
    assert rows[0]["next_n"] == 2


def test_cli_without_a_gpu_says_what_to_do(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    from ds4lab.cli import main
    assert main(["step", "--smoke"]) == 2
    assert "--cpu --checkpoint" in capsys.readouterr().err
    assert main(["step", "--cpu"]) == 2          # --cpu without a checkpoint: a named error
    assert "--checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [(["--batch", "0"], "--batch: 0: must be >= 1"),
                                       (["--ctx", "-5"], "--ctx: -5: must be >= 0"),
                                       (["--tp", "x"], "--tp: 'x': expected an int")])
def test_cli_bad_numbers_fail_at_parse_time_naming_the_option(tmp_path, capsys, argv, msg):
    from ds4lab.cli import main
    with pytest.raises(SystemExit) as e:
        main(["step", "--cpu", "--checkpoint", str(tmp_path), "--out", str(tmp_path), *argv])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "decode_step.csv").exists()     # no ERROR row appended


# ---- the tiny model's step (runs once ds4lab.model's composition has landed) ---------------------

@pytest.mark.interp
@pytest.mark.skipif(S.model_missing() is not None, reason=f"{S.model_missing()} (branch model, not merged yet)")
def test_tiny_model_step_on_the_interpreter(tmp_path):
    from ds4lab.checkpoint.tiny import ensure_tiny_checkpoint
    ck = str(ensure_tiny_checkpoint())
    p = S.plan(tps=(1,), batches=(1,), ctxs=(16,), modes=("plain",))
    p.replays = 1
    rows = S.run_step(p, device="cpu", checkpoint=ck, log=lambda *a: None)
    assert rows[0]["status"] == "OK", rows[0].get("note")
    groups = {r["group"] for r in rows[1:]}
    assert any(g.startswith("moe.") for g in groups) and any(g.startswith("attn.") for g in groups)
    assert rows[0]["launches"] > 0 and 0.8 < rows[0]["sum_vs_p50"] <= 1.0 + 1e-6


def test_recorder_ranges_reach_the_real_profiler_trace():
    """The eager pass's half that runs on a CPU: the recorder's ranges appear in this torch's
    exported chrome trace as the `user_annotation` X events attribute_trace reads (nested ones too)."""
    from torch.profiler import ProfilerActivity, profile
    rec = S.GroupRecorder(annotate=True)
    with S._hooked(rec), profile(activities=[ProfilerActivity.CPU]) as prof:
        with op_group("moe", "torch:container"):
            with op_group("moe.experts", "torch:mm"):
                torch.ones(8, 8) @ torch.ones(8, 8)
    ann = {e["name"]: e for e in S._trace(prof) if e.get("cat") == "user_annotation" and e.get("ph") == "X"}
    assert {"moe", "moe.experts"} <= set(ann)
    outer, inner = ann["moe"], ann["moe.experts"]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert outer["tid"] == inner["tid"] and rec.kinds["moe.experts"] == "torch:mm"


def test_reference_twin_step_on_the_real_composition():
    """The whole CPU path over ds4lab.model's real composition (tiny checkpoint, reference twin, the
    caches filled by a real prefill while the model has no benchmark fill): every layer's op groups
    attributed, the groups summing to the step, MoE and attention groups present."""
    missing = S.model_missing("reference")
    if missing:
        pytest.skip(missing)
    from ds4lab.checkpoint.tiny import TINY_CONFIG, ensure_tiny_checkpoint
    p = S.plan(tps=(1,), batches=(1,), ctxs=(8,), modes=("plain",), backend="reference")
    p.replays = 1
    rows = S.run_step(p, device="cpu", checkpoint=str(ensure_tiny_checkpoint()), log=lambda *a: None)
    step = rows[0]
    assert step["status"] == "OK", step.get("note")
    by = {r["group"]: r for r in rows[1:]}
    assert {"attn.sparse_mla", "attn.o_proj", "moe.experts", "mhc.pre_attn", "head.lm_head"} <= set(by)
    assert all(r["kind"].startswith("torch:") for r in rows[1:] if r["kind"])   # the twin runs no kernel
    assert step["launches"] == 0 and step["allreduce_copies"] == 0            # TP=1: no all-reduce point
    assert 0.9 < step["sum_vs_p50"] <= 1.0 + 1e-6
    assert by["attn.o_proj"]["bytes"] > 0 and "--backend reference" in step["repro"]
    assert TINY_CONFIG.num_hidden_layers == 4 and step["launches_per_layer"] == 0


def test_launches_table_says_which_commit_ran_each_configuration():
    rows = [{"group": "(step)", "build": b, "tp": 4, "batch": 1, "mode": "plain", "ctx": 8192, "git_sha": sha,
             "status": "OK", "p50_us": 1.0} for b, sha in (("sm89", "aaaaaaa"), ("native", "bbbbbbb"))]
    assert [r["git_sha"] for r in S.launches_table(rows)] == ["aaaaaaa", "bbbbbbb"]


def test_schedule_times_every_point_before_profiling_any():
    """On a GPU every point's replays are timed before the run profiles anything (an attached CUPTI slows
    the replays timed after a profiler session, NOTES "cupti"); each (ctx, batch) fill comes before its
    points in each phase; on a CPU one phase."""
    from ds4lab.harness.step import StepPlan, schedule
    p = StepPlan(tps=(4,), batches=(1, 16), ctxs=(8192, 32768), modes=("plain", "mtp"), variants=((), ("a=1",)))
    ev = list(schedule(p, gpu=True))
    phases = [e[0] for e in ev]
    assert phases == ["time"] * (len(ev) // 2) + ["profile"] * (len(ev) // 2)
    pts = {ph: [e[2:] for e in ev if e[0] == ph and e[1] == "point"] for ph in ("time", "profile")}
    assert pts["time"] == pts["profile"] and len(set(pts["time"])) == 2 * 2 * 2 * 2
    for ph in ("time", "profile"):
        seq = [e for e in ev if e[0] == ph]
        for k, e in enumerate(seq):
            if e[1] == "point":   # the last fill before it is its own (ctx, batch)
                fill = [f for f in seq[:k] if f[1] == "fill"][-1]
                assert fill[2:4] == e[2:4]
    cpu = list(schedule(p, gpu=False))
    assert {e[0] for e in cpu} == {"both"} and [e[2:] for e in cpu if e[1] == "point"] == pts["time"]


def test_run_step_gpu_flow_hands_each_point_its_own_timing(monkeypatch):
    """run_step's two-phase flow (the GPU schedule, faked on this CPU host): every timing runs before the
    first attribution; each attributed point gets the timing of its own (ctx, batch, mode, variant index),
    ABBA repeats included; a cache fill's error reaches that (ctx, batch)'s points in both phases; the
    repeat numbers are those of the one-phase flow."""
    from ds4lab.harness import step
    calls, fills = [], []

    class Model:
        def new_caches(self, batch, n):
            fills.append((batch, n - 8))
            return {"batch": batch, "ctx": n - 8}

        def fill_caches(self, caches, ctx):
            if (ctx, caches["batch"]) == (128, 2):
                raise ValueError("no room")

    real = step.schedule
    monkeypatch.setattr(step, "schedule", lambda p, gpu: real(p, True))

    def fake_time(m, caches, fill_err, p, cfg, tp, batch, mode, ctx, device):
        i = len([c for c in calls if c[0] == "time" and c[1:4] == (ctx, batch, mode)])
        calls.append(("time", ctx, batch, mode, fill_err))
        return ((float(ctx), float(batch), float(i)), f"{mode}")

    def fake_point(m, caches, fill_err, p, base, cfg, tp, batch, mode, ctx, roofs, gpu, device, log,
                   settings=(), repeat=1, timed=None):
        calls.append(("point", ctx, batch, mode, fill_err, timed, settings, repeat))
        return [{"note": ""}]

    monkeypatch.setattr(step, "_time_point", fake_time)
    monkeypatch.setattr(step, "_point", fake_point)
    monkeypatch.setattr(step, "overridden", lambda v: __import__("contextlib").nullcontext())
    A, B = ("x.A=1",), ("x.B=2",)
    p = step.StepPlan(tps=(4,), batches=(1, 2), ctxs=(64, 128), modes=("plain", "mtp"), variants=((), A, B, B, A, ()))
    rows = step.run_step(p, device="cpu", cfg=object(), model=Model(), log=lambda *a: None)
    n = 2 * 2 * 2 * 6
    assert [c[0] for c in calls] == ["time"] * n + ["point"] * n and len(rows) == n
    assert fills == [(1, 64), (2, 64), (1, 128), (2, 128)] * 2          # each (ctx, batch) once per phase
    points = [c for c in calls if c[0] == "point"]
    for k, (_, ctx, batch, mode, fill_err, timed, settings, repeat) in enumerate(points):
        i = k % 6                                                           # the variant index of this point
        assert timed == ((float(ctx), float(batch), float(i)), mode)        # its own timing, not a neighbour's
        assert settings == p.variants[i] and repeat == 1 + p.variants[:i].count(p.variants[i])
        assert (fill_err is not None) == ((ctx, batch) == (128, 2))
        if fill_err:
            assert "no room" in fill_err
    times = [c for c in calls if c[0] == "time"]
    assert all((c[4] is not None) == ((c[1], c[2]) == (128, 2)) for c in times)


def test_a_failed_timing_keeps_no_traceback():
    """The "time" phase keeps a failed point's error for the "profile" phase without its traceback (whose
    frames would hold the point's caches and graph through the rest of the run)."""
    from ds4lab.harness import step
    p = step.StepPlan(tps=(4,), batches=(1,), ctxs=(64,), modes=("plain",))
    e = step._time_point(None, None, "cache fill: ValueError: no room", p, None, 4, 1, "plain", 64, "cpu")
    assert isinstance(e, RuntimeError) and "no room" in str(e)
    assert e.__traceback__ is None and e.__context__ is None


def test_a_failed_timing_is_the_points_error_row():
    """The "profile" phase reports a point whose "time" phase failed as its ERROR row, naming the error."""
    from ds4lab.harness import step
    p = step.StepPlan(tps=(4,), batches=(1,), ctxs=(64,), modes=("plain",))
    rows = step._point(None, None, None, p, {}, None, 4, 1, "plain", 64, None, True, "cuda", lambda *a: None,
                       timed=MemoryError("CUDA out of memory"))
    assert len(rows) == 1 and rows[0]["status"] == "ERROR" and "MemoryError: CUDA out of memory" in rows[0]["note"]


def test_waterfall_totals_the_p50_when_streams_overlap():
    """With concurrent streams the op groups sum to more than the step: the waterfall adds one negative
    overlap bar so that its total is the step's p50; without overlap it adds none."""
    from ds4lab.views.step import OVERLAP_BAR, waterfall_figure
    groups = [{"group": "a", "us": 600.0, "floor_us": 1.0}, {"group": "b", "us": 500.0, "floor_us": ""}]
    fig = waterfall_figure(groups, step_us=1000.0)
    w = fig.data[0]
    assert list(w.x) == ["a", "b", OVERLAP_BAR, "step"] and w.y[2] == -100.0 and sum(w.y[:3]) == 1000.0
    assert len(fig.data[1].x) == len(fig.data[1].y) == 3
    assert list(waterfall_figure(groups, step_us=1090.0).data[0].x) == ["a", "b", "step"]
    assert list(waterfall_figure(groups).data[0].x) == ["a", "b", "step"]


def test_routed_experts_counts_the_real_routing_and_restores_the_method():
    """routed_experts over the real composition (tiny checkpoint, reference twin, batch 2 MTP: 4 tokens): one
    count a MoE layer, equal to a direct count of the ids the real ``experts`` received; the backend's method is
    the class's again afterwards (also when the step raises); the note names the numbers."""
    missing = S.model_missing("reference")
    if missing:
        pytest.skip(missing)
    import torch
    from ds4lab.checkpoint.tiny import TINY_CONFIG, ensure_tiny_checkpoint
    cfg = TINY_CONFIG
    m = S._build(cfg, 1, 0, torch.device("cpu"), str(ensure_tiny_checkpoint()), "reference")
    caches = m.new_caches(2, 8 + 8)
    S._fill(m, caches, 2, 8, cfg)
    fn, _ = S._point_call(m, caches, cfg, 1, 2, "mtp", 8, torch.device("cpu"))
    seen = []
    real = type(m.ops).experts

    def spy(self, x, ex, weights, ids, *a, **k):
        seen.append(ids.clone())
        return real(self, x, ex, weights, ids, *a, **k)

    type(m.ops).experts = spy
    try:
        got = S.routed_experts(m, fn)
    finally:
        type(m.ops).experts = real
    assert "experts" not in vars(m.ops)
    assert got["layers"] == len(seen) >= cfg.num_hidden_layers
    want = [int(torch.unique(i[i >= 0]).numel()) for i in seen]
    assert (got["min"], got["max"]) == (min(want), max(want)) and got["mean"] == pytest.approx(sum(want) / len(want))
    assert got["pairs"] == 4 * cfg.num_experts_per_tok and 1 <= got["min"] <= got["max"] <= cfg.n_routed_experts
    note = S.experts_note(got)
    assert note.startswith("routed experts a MoE layer: mean") and f"for {got['pairs']} pairs" in note
    assert S.experts_note({}) == ""

    def boom():
        raise RuntimeError("step failed")
    with pytest.raises(RuntimeError):
        S.routed_experts(m, boom)
    assert "experts" not in vars(m.ops)
