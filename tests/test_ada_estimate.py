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
