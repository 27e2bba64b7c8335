"""ds4lab.planner.speed: the scaling math, the decode model's op coverage and monotonicity, and that it
runs on the committed results/bench.csv."""
import json

import pytest

from ds4lab.planner import speed as ada
from ds4lab.geometry import DEFAULT_CONFIG, op_shapes
from ds4lab.harness.report import load_results

CARD = ada.CARDS["RTX 4090-48G"]
A0 = ada.Assumptions(launch_floor_us=0.0)


def _row(kernel="k", min_bytes=0.0, flops=0.0, p50=10.0, bw=4.0, fp8=1000.0):
    return {"kernel": kernel, "build": "sm89", "impl": "ds4lab", "tp": 1, "shape": json.dumps({"M": 1}),
            "status": "OK", "p50_us": p50, "min_bytes": min_bytes, "flops": flops,
            "roof_copy_tbps": bw, "roof_fp8_tflops": fp8}


def test_memory_bound_row_scales_by_bandwidth_ratio():
    r = _row(min_bytes=20e6, flops=1e6, p50=10.0)  # 2 TB/s of a 4 TB/s roof: e = 0.5
    assert ada.row_efficiency(r) == pytest.approx(0.5)
    s = ada.scale_row(r, CARD, A0)
    assert s["bound"] == "memory"
    assert s["ada_us"] == pytest.approx(10.0 * 4.0 / CARD.bw_tbps)
    assert s["ada_us"] * 1e-6 * CARD.bw_tbps * 1e12 / 20e6 == pytest.approx(1 / 0.5)  # efficiency carried


def test_compute_bound_row_scales_by_fp8_ratio():
    r = _row(min_bytes=1e6, flops=5e9, p50=10.0)  # 500 TFLOP/s of 1000: e = 0.5
    assert ada.row_efficiency(r) == pytest.approx(0.5)
    s = ada.scale_row(r, CARD, A0)
    assert s["bound"] == "compute"
    assert s["ada_us"] == pytest.approx(10.0 * 1000.0 / CARD.fp8_tflops)


def test_launch_floor_and_additive_bracket():
    tiny = _row(min_bytes=1e3, p50=2.0)
    assert ada.scale_row(tiny, CARD)["ada_us"] >= ada.Assumptions().launch_floor_us
    big = _row(min_bytes=20e6, p50=10.0)
    s = ada.scale_row(big, CARD)
    # latency part carried: additive never above the efficiency method for a row at e <= stream_eff
    assert s["ada_additive_us"] <= s["ada_us"]
    assert s["ada_additive_us"] >= 20e6 / (CARD.bw_tbps * 1e12) * 1e6


def test_formulas_agree_with_the_registry():
    from ds4lab.harness.registry import get
    used = {"fp8_gemm_nt", "per_token_group_quant_fp8", "fp8_einsum_bhr_hdr_bhd", "inv_rope_fp8_quant",
            "fused_moe_w4a16", "sqrtsoftplus_topk", "fp8_paged_mqa_logits", "topk_indices", "sparse_mla_decode",
            "fp8_ds_mla_insert", "indexer_k_cache_insert", "mhc_fused_post_pre", "mhc_pre", "hc_head"}
    for name in used:
        spec = get(name)
        for tp in (1, 4):
            for s in spec.bench_shapes(DEFAULT_CONFIG, tp):
                assert ada.kernel_bytes(name, s) == pytest.approx(spec.min_bytes(s)), (name, s)
                assert ada.kernel_flops(name, s) == pytest.approx(spec.flops(s)), (name, s)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_every_geometry_op_is_mapped(tp):
    ops = set(op_shapes(DEFAULT_CONFIG, tp))
    assert ops <= set(ada.OP_MAP), ops - set(ada.OP_MAP)
    terms = ada.decode_terms([], CARD, tp, 1)
    covered = {p for t in terms for p in t["op"].split("+")}
    assert ops <= covered, ops - covered
    for t in terms:  # no rows: everything is an estimate, and says so
        assert t["source"] == "estimated"
    est = {t["op"] for t in terms if t["kernel"] == "(none)"}
    assert est <= set(ada.ESTIMATED_OPS)
    assert ("all_reduce" in est) == (tp > 1)


@pytest.fixture(scope="module")
def model():
    return ada.decode_model(load_results())


def test_runs_on_committed_rows(model):
    assert len(model) == len(ada.CARDS) * 4 * 2 * 3
    for r in model:
        assert r["tok_s"] > 0 and r["tok_s_additive"] > 0
        assert r["tok_s"] < r["ceiling_tok_s"]
        assert r["sm89_share"] + r["native_share"] + r["estimated_share"] == pytest.approx(1.0)
        assert r["sm89_share"] > 0.5  # the estimate rests on sm_89-build rows
    head = ada.headline(model)
    assert head["4090_48g_tp4_b1_plain_seed_tok_s"] == 82.0
    assert head["6000ada_tp4_b1_mtp_seed_tok_s"] == 124.0


def test_more_batch_more_tokens_up_to_the_ceiling(model):
    for card in ada.CARDS:
        for tp in (1, 2, 4, 8):
            for mode in ("plain", "mtp"):
                sel = sorted((r for r in model if r["card"] == card and r["tp"] == tp and r["mode"] == mode),
                             key=lambda r: r["batch"])
                ceil = [r["ceiling_tok_s"] for r in sel]
                assert ceil == sorted(ceil)
                if mode == "plain":
                    tok = [r["tok_s"] for r in sel]
                    assert tok == sorted(tok), (card, tp, tok)


def test_tp_splits_weights(model):
    for card in ada.CARDS:
        gb = [next(r["gb_per_step"] for r in model if r["card"] == card and r["tp"] == tp and r["batch"] == 1
                   and r["mode"] == "plain") for tp in (1, 2, 4, 8)]
        assert gb == sorted(gb, reverse=True)
    w = [ada.weight_bytes_per_rank(tp=tp) for tp in (1, 2, 4, 8)]
    assert w == sorted(w, reverse=True)
    assert 30 < w[2] / 2**30 < 45  # SPEC.md §1: ~38 GiB per GPU at TP4 (community W4A16 checkpoint)
    fits = {r["tp"]: r["fits"] for r in model if r["card"] == "RTX 6000 Ada"}
    assert not fits[1] and fits[4]


def test_scaled_table_covers_every_sm89_row():
    rows = load_results()
    table = ada.ada_scaled_table(rows)
    assert {r["kernel"] for r in table} == {r["kernel"] for r in rows if r["build"] == "sm89" and r["impl"] == "ds4lab"}
    assert all(r["RTX 4090-48G us"] > 0 for r in table)


def test_headline_names_the_point_it_reports(model):
    with pytest.raises(ValueError, match="tp=3 is not in the model"):
        ada.headline(model, tp=3)
    with pytest.raises(ValueError, match="no rows"):
        ada.headline([])
    no_tp4 = [r for r in model if r["tp"] in (1, 2)]
    head = ada.headline(no_tp4)  # was {} without a word
    assert "TP4 not in the model's tps [1, 2]: headline at TP2" in head["headline_note"]
    assert head["4090_48g_tp2_b1_plain_tok_s"] > 0 and not any("seed" in k for k in head)
    assert ada.headline_point(model) == (4, 1, "")
    assert "headline_note" not in ada.headline(model)
    assert set(ada.headline([r for r in model if r["card"] == "L40S"])) == {
        f"l40s_tp4_b1_{m}_{f}" for m in ("plain", "mtp") for f in ("tok_s", "tok_s_additive", "ceiling_tok_s")}


def test_card_table_says_na_for_the_h200_links():
    rows = {r["card"]: r for r in ada.card_table(["L40S"])}
    assert set(rows) == {"L40S", "H200"}
    assert rows["H200"]["link GB/s"] == rows["H200"]["all-reduce us"] == "n/a (not modelled)"
    assert rows["L40S"]["link GB/s"] == 20.0
    with pytest.raises(ValueError, match="'RTX 4090'"):
        ada.get_card("RTX 4090")
    with pytest.raises(ValueError, match="no link model"):
        ada.decode_terms([], ada.H200, 4, 1)


# ---- issue 19 item 5: the per-op method, the lookup order, the norms, the measured step ----------

def _krow(kernel, shape, p50, build="sm89", tp=4):
    from ds4lab.harness import costs
    return {"kernel": kernel, "build": build, "impl": "ds4lab", "tp": tp, "shape": json.dumps(shape), "status": "OK",
            "p50_us": p50, "min_bytes": costs.min_bytes(kernel, shape), "flops": costs.flops(kernel, shape),
            "roof_copy_tbps": 4.25, "roof_fp8_tflops": 1256.0}


def test_latency_bound_op_keeps_its_h200_time():
    """max(sm_89 time on the H200, bytes / card BW): 2.6 us of act-quant stays 2.6 us on a 4090
    (the efficiency method made it ~11 us), a bandwidth-bound MoE call is charged the card's BW."""
    q = {"M": 1, "K": 4096}
    rows = [_krow("per_token_group_quant_fp8", q, 2.6)]
    t = ada._term_time({"kernel": "per_token_group_quant_fp8", "shape": q}, rows, 4, CARD, ada.Assumptions())
    assert t["us"] == pytest.approx(2.6) and t["source"] == "measured-sm89"
    moe = {"T": 16, "E": 256, "D": 4096, "I": 512, "topk": 6, "tp": 4}
    rows = [_krow("fused_moe_w4a16", moe, 100.0)]
    t = ada._term_time({"kernel": "fused_moe_w4a16", "shape": moe}, rows, 4, CARD, ada.Assumptions())
    floor = ada.kernel_bytes("fused_moe_w4a16", moe) / (CARD.bw_tbps * 1e12) * 1e6
    assert floor > 100 and t["us"] == pytest.approx(floor)


def test_lookup_prefers_a_near_native_row_to_a_far_sm89_row():
    s = lambda T: {"T": T, "E": 256, "D": 4096, "I": 512, "topk": 6, "tp": 4}  # noqa: E731
    far = [_krow("fused_moe_w4a16", s(1), 50.0), _krow("fused_moe_w4a16", s(16), 540.0, build="native")]
    t, _, src, _ = ada.lookup_row(far, "fused_moe_w4a16", s(16), 4)
    assert src == "measured-native" and t == pytest.approx(540.0)     # was the T=1 sm_89 row
    near = far + [_krow("fused_moe_w4a16", s(8), 300.0)]
    t, _, src, match = ada.lookup_row(near, "fused_moe_w4a16", s(16), 4)
    assert src == "measured-sm89" and "nearest T=8" in match           # one doubling away: sm_89 kept
    both = near + [_krow("fused_moe_w4a16", s(16), 520.0)]
    assert ada.lookup_row(both, "fused_moe_w4a16", s(16), 4)[:3] == (520.0, ada.row_efficiency(both[-1]),
                                                                       "measured-sm89")
    t, _, _, match = ada.lookup_row(both, "fused_moe_w4a16", s(4), 4)  # between T=1 and T=8: affine in T
    assert t == pytest.approx(50.0 + (300.0 - 50.0) * 3 / 7) and match.startswith("interp T 1-8")


def test_rmsnorm_counts_only_q_and_kv_norms():
    terms = ada.decode_terms([], CARD, 4, 1)
    norms = [t for t in terms if t["op"] == "rmsnorm"]
    from ds4lab.geometry import LayerKind, layer_counts
    c4a = layer_counts(DEFAULT_CONFIG)[LayerKind.C4A]  # + the indexer's own norm on C4A layers
    assert sum(t["calls"] for t in norms) == 2 * DEFAULT_CONFIG.num_hidden_layers + c4a  # attn/ffn: in mHC
    assert "mHC" in ada.ESTIMATED_OPS["rmsnorm"]


def _step_rows(tp=4, batch=1, mode="plain", ctx=8192):
    base = {"timestamp": "t0", "build": "sm89", "tp": tp, "batch": batch, "mode": mode, "ctx": ctx, "status": "OK"}
    return [{**base, "group": "(step)", "us": 2500.0, "p50_us": 2500.0},
            {**base, "group": "moe.experts", "kind": "kernel:fused_moe_w4a16", "us": 600.0, "launches": 43,
             "bytes": 43 * 20e6},
            {**base, "group": "attn.wq_b", "kind": "kernel:fp8_gemm_nt", "us": 400.0, "launches": 43, "bytes": 43 * 8.4e6},
            {**base, "group": "(gaps)", "us": 200.0, "launches": 0, "bytes": None},
            {**base, "group": "comm.all_reduce (device copy)", "us": 150.0, "launches": 86}]


def test_decode_model_uses_the_measured_step_and_says_so():
    rows = load_results()
    m = ada.decode_model(rows, [CARD], (4,), (1, 4), ("plain",), step_rows=_step_rows())
    on_step = next(r for r in m if r["batch"] == 1)
    assert on_step["basis"].startswith("decode_step.csv")
    assert next(r for r in m if r["batch"] == 4)["basis"].startswith("bench.csv")  # no step at batch 4
    terms = ada.step_terms(_step_rows(), rows, CARD, 4, 1)
    by = {t["op"]: t for t in terms}
    assert by["moe.experts"]["us"] == pytest.approx(43 * 20e6 / (CARD.bw_tbps * 1e12) * 1e6)  # bytes-bound on a 4090
    assert by["attn.wq_b"]["us"] == pytest.approx(400.0)        # the H200 time is above the card's floor
    assert by["(gaps)"]["us"] == 200.0
    assert "all_reduce" in by and "comm.all_reduce (device copy)" not in by  # the copy -> the link model
    assert on_step["step_ms"] * 1e3 == pytest.approx(sum(t["us"] for t in terms))


def test_step_terms_take_the_newest_default_run_not_an_ab_variant():
    """An A/B run (``ds4lab step --ab``) writes one configuration per variant under ONE timestamp; the
    planner reads the newest run's defaults only (a variant's repro names its ``--set``)."""
    def rows_of(ts, wq_b_us, repro):
        out = _step_rows()
        for r in out:
            r.update(timestamp=ts, repro=repro)
            if r["group"] == "attn.wq_b":
                r["us"] = wq_b_us
        return out
    step_rows = (rows_of("2026-12-01T10:00:00+00:00", 500.0, "python3 -m ds4lab.harness.step")
                 + rows_of("2026-12-02T10:00:00+00:00", 450.0, "python3 -m ds4lab.harness.step")
                 + rows_of("2026-12-02T10:00:00+00:00", 1111.0,
                           "python3 -m ds4lab.harness.step --set 'backend_kernel.COMPRESS_ONE_LAUNCH=False'"))
    terms = ada.step_terms(step_rows, load_results(), CARD, 4, 1)
    assert [t["us"] for t in terms if t["op"] == "attn.wq_b"] == [pytest.approx(450.0)]   # one run, the newest (above the floor)
    assert sum(t["op"] == "moe.experts" for t in terms) == 1                             # no variant merged in


def test_community_comparison_is_like_for_like():
    m = ada.decode_model(load_results(), tps=(4,), batches=(1,))
    cmp = ada.community_comparison(m)
    assert {(r["card"], r["mode"]) for r in cmp} == {(s["card"], s["mode"]) for s in ada.SEED_FIGURES}
    a = ada.Assumptions()
    for r in cmp:
        assert r[f"+ host {a.host_us_per_step:.0f} us tok/s"] < r["step tok/s"] < r["ceiling tok/s"]
    assert any("host" in s for s in ada.STEP_LEAVES_OUT) and any("prefill" in s for s in ada.STEP_LEAVES_OUT)


def test_step_bytes_are_the_costs_formulas():
    b = ada.step_bytes(DEFAULT_CONFIG, 4, 1, 1, 8192)
    o = op_shapes(DEFAULT_CONFIG, 4)["wq_b"]
    want = ada.kernel_bytes("fp8_gemm_nt", {"op": "wq_b", "M": 1, "N": o.dims["N"], "K": o.dims["K"]})
    assert b["wq_b"] == pytest.approx(want * DEFAULT_CONFIG.num_hidden_layers)
    assert b["moe_w13+moe_w2"] > b["wq_b"]


def test_scaled_rows_carry_the_max_method_too():
    r = _row(min_bytes=20e6, flops=1e6, p50=10.0)
    s = ada.scale_row(r, CARD, A0)
    assert s["ada_max_us"] == pytest.approx(20e6 / (CARD.bw_tbps * 1e12) * 1e6)  # bandwidth-bound on the card
    assert ada.scale_row(_row(min_bytes=1e3, p50=2.0), CARD)["ada_max_us"] == 2.0  # latency kept, not scaled
