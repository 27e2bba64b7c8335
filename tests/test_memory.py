"""Unit tests of the memory planner core (pure Python) and its views."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time

import pytest

from ds4lab.planner import memory as M
from ds4lab.geometry import DEFAULT_CONFIG, ModelConfig

HAS_TINY = importlib.util.find_spec("ds4lab.checkpoint.tiny") is not None


# ---- KV accounting: SPEC.md §3 numbers re-derived from the geometry -------------------------
def test_page_sizes_official_geometry():
    pages = {}
    for s in M.kv_cache_specs(DEFAULT_CONFIG):
        pages.setdefault(s.role, set()).add((s.block_size, s.page_bytes, s.window))
    assert pages == {
        "swa": {(64, 37440, 128)}, "c4_kv": {(256, 37440, None)}, "c128_kv": {(256, 1728, None)},
        "indexer_k": {(256, 8640, None)}, "c4_state": {(4, 32832, 8)}, "c128_state": {(8, 32832, 128)},
        "indexer_state": {(4, 8640, 8)},
    }
    roles = [s.role for s in M.kv_cache_specs(DEFAULT_CONFIG)]
    assert roles.count("swa") == 43 and roles.count("c4_kv") == 21 and roles.count("c128_kv") == 20
    assert [s.role for s in M.kv_cache_specs(DEFAULT_CONFIG, mtp=True)].count("swa") == 44


def test_bf16_pages_use_plain_rows():
    pages = {s.role: s.page_bytes for s in M.kv_cache_specs(DEFAULT_CONFIG, kv_cache_dtype="bf16")}
    assert pages["swa"] == 64 * 512 * 2 and pages["c128_kv"] == 2 * 1024 and pages["c4_state"] == 32768
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        M.kv_cache_specs(DEFAULT_CONFIG, kv_cache_dtype="int8")


def test_pool_block_is_spec_1002240():
    lay = M.kv_layout(M.kv_cache_specs(DEFAULT_CONFIG))
    assert lay.bytes_per_block == 21 * (37440 + 8640) + 20 * 1728 == 1_002_240
    assert lay.bytes_per_block // 256 == 3915
    # SWA layers split in two groups (approximate gcd of the repeat counts = 22)
    assert lay.repeats_per_group == 22
    assert sorted(len(g.layers) for g in lay.groups) == [20, 21, 22, 42, 62]


def test_fixed_blocks_spec_26_only_without_in_flight_tokens():
    """SPEC.md §3's ~26 blocks/request is vLLM 0.32's count with ~1 token in flight; 0.32 reserves
    the sliding-window/compressor blocks for every in-flight (scheduled, unsettled) token."""
    lay = M.kv_layout(M.kv_cache_specs(DEFAULT_CONFIG))
    assert lay.fixed_blocks_per_request(98304, 1) == 2 * 3 + 3 + 17 == 26
    # seeds' corner on a 48 GB card: B = 2048 (server default < 70 GiB), async -> 4096 in flight
    assert lay.fixed_blocks_per_request(98304, 4096) == 2 * 67 + 1027 + 529
    assert lay.blocks_per_request(98304, 4096) == 1690 + 384


def test_capacity_and_refusal_boundary():
    lay = M.kv_layout(M.kv_cache_specs(DEFAULT_CONFIG))
    per = lay.blocks_per_request(98304, 1024)
    need = lay.bytes_per_block * (per + 1)            # + the null block
    ok = M.kv_capacity(lay, need, 98304, 1024)
    assert not ok.refused and ok.num_blocks == per + 1 and ok.message == ""
    assert ok.tokens == int((per + 1) / per * 98304)
    bad = M.kv_capacity(lay, need - 1, 98304, 1024)
    assert bad.refused and bad.message.startswith("To serve at least one request with the model's max seq len (98304)")
    est = bad.estimated_max_model_len
    assert 0 < est < 98304 and f"estimated maximum model length is {est}." in bad.message
    assert lay.bytes_per_block * lay.blocks_per_request(est, 1024) <= bad.available_bytes
    assert lay.bytes_per_block * lay.blocks_per_request(est + 1, 1024) > bad.available_bytes
    none = M.kv_capacity(lay, lay.bytes_per_block, 4096, 1024)
    assert none.refused and none.message.startswith("No available memory for the cache blocks")


def test_single_repeat_layout_tiny_like():
    """One C4A + one C128A layer: every bucket is balanced with one repeat (the tiny checkpoint)."""
    cfg = ModelConfig(hidden_size=256, num_hidden_layers=4, compress_ratios=(0, 0, 4, 128, 0),
                      num_attention_heads=8, o_groups=2, q_lora_rank=128, o_lora_rank=128,
                      n_routed_experts=64, moe_intermediate_size=128, num_hash_layers=2, vocab_size=512)
    lay = M.kv_layout(M.kv_cache_specs(cfg))
    assert lay.repeats_per_group == 1
    assert lay.bytes_per_block == 8640 + 37440 + 1728             # the MLA group is widest
    assert [g.roles for g in lay.groups].count(("swa",)) == 4    # one SWA layer per group
    assert ("indexer_state", "c4_state") in [g.roles for g in lay.groups]


# ---- per-rank model --------------------------------------------------------------------------
def test_weights_match_spec_totals():
    tot = sum(t.bytes for t in M.weight_terms(DEFAULT_CONFIG, "community", 1))
    assert tot == pytest.approx(159e9, rel=0.05)           # SPEC.md §1: ~159 GB
    per = sum(t.bytes for t in M.weight_terms(DEFAULT_CONFIG, "community", 4)) / M.GiB
    assert per == pytest.approx(38, rel=0.05)              # ~38 GiB/GPU at TP=4
    with pytest.raises(ValueError, match="fmt="):
        M.weight_terms(DEFAULT_CONFIG, "gguf", 1)


@pytest.mark.skipif(not HAS_TINY, reason="ds4lab.checkpoint.tiny (issue 11) does not exist yet")
def test_bf16_weights_match_tiny_checkpoint_tensors():
    """Planner's bf16 weight bytes vs the tiny checkpoint's actual tensor list (same names as the real one)."""
    from ds4lab.checkpoint.tiny import TINY_CONFIG, tensor_specs

    size = {"bfloat16": 2, "bf16": 2, "float32": 4, "fp32": 4, "int64": 8, "int32": 4}
    real = sum(math.prod(shape) * size[dt] for shape, dt in tensor_specs().values())
    ours = sum(t.bytes for t in M.weight_terms(TINY_CONFIG, "bf16", 1))
    assert ours == pytest.approx(real, rel=0.01)


def test_plan_terms_sum_to_total_and_name_sources():
    p = M.plan(DEFAULT_CONFIG, gpu="l40s", fmt="community", tp=4, gpu_memory_utilization=0.95)
    assert sum(t.bytes for t in p.terms) == p.total_bytes
    assert all(t.source for t in p.terms)
    assert p.max_num_batched_tokens == 2048 and p.max_in_flight_tokens == 4096
    g = p.by_group()
    assert g["headroom"] == p.total_bytes - math.ceil(p.total_bytes * 0.95)
    eager = M.plan(DEFAULT_CONFIG, gpu="l40s", gpu_memory_utilization=0.95, cuda_graphs=False)
    assert eager.kv.kv_bytes > p.kv.kv_bytes
    pinned = M.plan(DEFAULT_CONFIG, gpu="h200", tp=1, fmt="official", kv_cache_memory_bytes=4 * M.GiB)
    assert pinned.kv.kv_bytes == 4 * M.GiB


def test_defaults_follow_vllm_batch_rule():
    assert M.default_max_num_batched_tokens(48 * M.GiB, 1, 98304) == 2048
    assert M.default_max_num_batched_tokens(141 * M.GiB, 1, 98304) == 8192
    assert M.default_max_num_batched_tokens(141 * M.GiB, 1, 4096) == 4096
    assert M.default_max_num_batched_tokens(192 * M.GiB, 4, 98304) == 16384


@pytest.mark.parametrize("kw, match", [
    ({"gpu": "a100"}, "gpu="), ({"gpu": -5}, "gpu="), ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
    ({"tp": 3}, "tp="), ({"max_model_len": 0}, "max_model_len"), ({"max_num_batched_tokens": 2, "max_num_seqs": 4},
                                                                  "max_num_batched_tokens"),
])
def test_plan_rejects_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        M.plan(DEFAULT_CONFIG, **kw)


def test_gpu_table_and_bytes():
    assert M.resolve_gpu("L40S").total_bytes == 46068 * M.MiB
    assert M.resolve_gpu(48 * 10**9).total_bytes == 48 * 10**9
    assert {"rtx4090", "rtx6000ada", "l40s", "h200"} <= set(M.GPUS)


# ---- recommend -------------------------------------------------------------------------------
def test_recommend_seeds_corner_with_small_batch():
    """4x L40S, TP=4, community checkpoint, max-model-len 98304, max-num-seqs 1: with a 512-token
    prefill budget and no async scheduling the seeds' window (0.95-0.97) comes out."""
    r = M.recommend(DEFAULT_CONFIG, gpu="l40s", fmt="community", tp=4, max_model_len=98304, max_num_seqs=1,
                    max_num_batched_tokens=512, async_scheduling=False)
    assert r.util_min is not None and r.util_min < 0.95
    assert r.watched == 0.97 and 0.95 <= r.unattended < r.watched
    assert any("JIT" in x for x in r.reasons) and any("cannot hold one 98304-token request" in x for x in r.reasons)
    assert r.plans["watched"].headroom_bytes >= M.JIT_HEADROOM["watched"]


def test_activation_peak_uses_the_profile_runs_token_count():
    """vLLM profiles one dummy forward over max_num_batched_tokens tokens, MTP or not
    (gpu_model_runner.py profile_run -> _dummy_run(self.max_num_tokens)); the planner once used
    B x (1 + k), which made L40S util 0.97 refuse at the default setting."""
    def act(k):
        p = M.plan(DEFAULT_CONFIG, gpu="l40s", gpu_memory_utilization=0.97, num_speculative_tokens=k)
        t = next(t for t in p.terms if t.name.startswith("activation peak"))
        return t, p
    (t0, _), (t1, p1), (t9, p9) = act(0), act(1), act(9)
    assert t0.bytes == t1.bytes == t9.bytes and t1.name == "activation peak (2048 tokens)"
    assert "profile_run" in t1.source and "_dummy_run" in t1.source
    # default corner on L40S at 0.97: 1.69 GiB of KV against 1.94 GiB for one 98304-token request.
    # It was 2.02 GiB (starts) until issue 23: vLLM 0.32's indexer reserves its 512 MiB logits cap in
    # every profile run, where the planner had min(B*ceil(L/4)*4, 512e6) = 0.19 GiB.
    assert p1.kv.refused and round(p1.kv.kv_bytes / M.GiB, 2) == 1.69
    assert round(p1.kv.needed_bytes / M.GiB, 2) == 1.94
    assert p9.kv.kv_bytes > 0 and not p9.kv.message.startswith("No available memory")


def test_recommend_explains_impossible_and_finds_the_flags():
    # L40S default corner: since the indexer's 512 MiB reservation (issue 23) neither mode works as given
    r = M.recommend(DEFAULT_CONFIG, gpu="l40s", fmt="community", tp=4, max_model_len=98304, max_num_seqs=1)
    assert r.watched is None and r.unattended is None and r.util_min == 0.98
    fix = r.remedies["watched"]
    assert fix.flags == "--no-async-scheduling" and fix.overrides == {"async_scheduling": False}
    assert not fix.plan.kv.refused and fix.plan.headroom_bytes >= M.JIT_HEADROOM["watched"]
    assert r.remedies["unattended"].flags == "--max-num-batched-tokens 1024"
    assert r.fixes[0].startswith("watched: add --no-async-scheduling -> util 0.97")
    rows = r.table()
    assert [x["mode"] for x in rows] == ["watched", "watched (fixed)", "unattended", "unattended (fixed)"]
    assert rows[0]["gpu_memory_utilization"] == "impossible" and None not in rows[0].values()
    assert rows[1]["flags"] == "--no-async-scheduling" and rows[1]["gpu_memory_utilization"] == fix.util
    # a 49,140 MiB card has the room: both modes as given, no remedy
    r6 = M.recommend(DEFAULT_CONFIG, gpu="rtx6000ada", fmt="community", tp=4, max_model_len=98304, max_num_seqs=1)
    assert (r6.watched, r6.unattended, r6.remedies) == (0.97, 0.955, {})
    # nothing works as given at 9 spec tokens on one 4090 with the official format: weights alone OOM
    r2 = M.recommend(DEFAULT_CONFIG, gpu="rtx4090", fmt="official", tp=1)
    assert r2.util_min is None and "CUDA out of memory while loading the model" in r2.reasons[0]
    assert any("weights alone need" in f and "raise TP" in f for f in r2.fixes)
    assert all(r2.remedies[m].overrides.keys() <= {"tp", "max_num_batched_tokens", "async_scheduling",
                                                   "max_model_len"} for m in r2.remedies)


def test_find_remedy_order_and_none():
    """Least intrusive first: batch tokens before max-model-len before TP; None when nothing helps."""
    r = M.find_remedy(DEFAULT_CONFIG, "watched", gpu="l40s", max_model_len=98304, num_speculative_tokens=1,
                      max_num_batched_tokens=8192)
    assert r is not None and set(r.overrides) <= {"max_num_batched_tokens", "async_scheduling"}
    assert r.flags.startswith("--") and not r.plan.kv.refused
    tiny_card = 12 * M.GiB   # official weights at TP=8 are ~18 GiB per GPU: load OOM, no TP above 8
    assert M.find_remedy(DEFAULT_CONFIG, "watched", gpu=tiny_card, tp=8, fmt="official") is None
    with pytest.raises(ValueError, match="mode="):
        M.find_remedy(DEFAULT_CONFIG, "sometimes")


def test_load_oom_is_named_before_kv_refusal():
    """Weights larger than the card fail in load_model (CUDA OOM), not at KV sizing; weights that fit
    the card but not util*total leave vLLM's own 'No available memory for the cache blocks'."""
    big = M.plan(DEFAULT_CONFIG, gpu="rtx4090-48g", fmt="community", tp=2, gpu_memory_utilization=0.95)
    assert big.load_oom and big.weight_bytes > big.total_bytes
    assert big.verdict.startswith("CUDA out of memory while loading the model") and "TP=2" in big.verdict
    fits = M.plan(DEFAULT_CONFIG, gpu="l40s", fmt="community", tp=4, gpu_memory_utilization=0.95)
    tight_card = fits.weight_bytes + int(1.0 * M.GiB)   # weights + context fit, util*total does not
    p = M.plan(DEFAULT_CONFIG, gpu=tight_card, fmt="community", tp=4, gpu_memory_utilization=0.9)
    assert not p.load_oom and p.kv.refused
    assert p.verdict == p.kv.message and p.verdict.startswith("No available memory for the cache blocks")
    assert fits.verdict == "" or fits.verdict == fits.kv.message
    assert big.summary()["load_oom"] is True and p.summary()["load_oom"] is False


# ---- hot path stays pure, CLI ------------------------------------------------------------------
def test_core_imports_no_torch_and_is_slider_fast():
    code = ("import sys, time; t = time.time(); import ds4lab.planner.memory as M; M.sweep(); M.recommend();"
            "assert 'torch' not in sys.modules and 'ds4lab.views.memory' not in sys.modules;"
            "print(time.time() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # ~0.3-0.8 s; the bound only catches a pathological regression (e.g. a per-point torch import)
    assert float(out.stdout.strip()) < 10.0


def test_cli_plan_json(capsys):
    from ds4lab.cli import main

    assert main(["plan", "--gpu", "l40s", "--max-num-batched-tokens", "512", "--no-async-scheduling",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["recommendation"]["watched"] == 0.97 and d["plan"]["refused"] is False
    assert main(["plan", "--gpu-memory-utilization", "0.9"]) == 0
    assert "REFUSES TO START" in capsys.readouterr().out


def test_cli_plan_default_names_impossible_and_the_fix(capsys):
    from ds4lab.cli import main

    assert main(["plan"]) == 0   # a report: exit 0 also when a mode is impossible
    out = capsys.readouterr().out
    rec = out[out.index("# recommendation"):]
    assert "None" not in rec and "impossible" in rec
    assert "unattended (fixed)" in rec and "--no-async-scheduling" in rec
    assert "- fix: watched: add --no-async-scheduling -> util 0.97" in rec
    assert "- fix: unattended: add --max-num-batched-tokens 1024 -> util 0.955" in rec


@pytest.mark.parametrize("argv, flag", [
    (["--kv-cache-memory-bytes", "-5"], "--kv-cache-memory-bytes -5"),
    (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes 0"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens 0"),
    (["--max-model-len", "-1"], "--max-model-len -1"),
    (["--num-speculative-tokens", "-1"], "--num-speculative-tokens -1"),
    (["--tp", "3"], "--tp 3"),
    (["--gpu", "a100"], "gpu='a100'"),
])
def test_cli_plan_input_errors_exit_2_naming_the_flag(capsys, argv, flag):
    from ds4lab.cli import main

    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ds4lab plan: error: ") and flag in err and len(err.splitlines()) == 1


def test_plan_rejects_non_positive_byte_pins():
    for v in (0, -5):
        with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
            M.plan(DEFAULT_CONFIG, kv_cache_memory_bytes=v)


def test_gpu_names_of_notebook_09_resolve():
    assert M.resolve_gpu("RTX 4090-48G") is M.GPUS["rtx4090-48g"]
    assert M.resolve_gpu("RTX 6000 Ada") is M.GPUS["rtx6000ada"]
    assert M.resolve_gpu("l40s") is M.GPUS["l40s"]


def test_plan_help_describes_every_option():
    import argparse

    ap = argparse.ArgumentParser()
    M.add_arguments(ap)
    assert all(a.help for a in ap._actions if a.dest != "help")


# ---- views ---------------------------------------------------------------------------------------
def test_views_rows_and_figure():
    pytest.importorskip("plotly")
    from ds4lab.views import memory as V

    plans = M.sweep(cfg=DEFAULT_CONFIG, max_num_batched_tokens=512, async_scheduling=False)
    rows = V.budget_rows(plans)
    assert len(rows) == len(plans) and set(V.GROUP_ORDER) <= set(rows[0])
    assert rows[0]["refused"] and not rows[-1]["refused"] and rows[-1]["jit_oom_risk"]
    fig = V.budget_figure(plans)
    assert len(fig.data) == len(V.GROUP_ORDER) and len(fig.layout.shapes) >= 2
    assert V.plan_rows(plans[-1])[0]["group"] == "verdict"   # the verdict first (issue 22)
