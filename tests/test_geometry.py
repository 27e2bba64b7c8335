import json

import pytest

from ds4lab import geometry as g


def test_official_layer_pattern():
    kinds = g.layer_kinds()
    assert len(kinds) == 44
    assert kinds[:2] == ["swa", "swa"]
    assert kinds[-1] == "mtp"
    assert all(k == "c4a" for k in kinds[2:43:2])
    assert all(k == "c128a" for k in kinds[3:42:2])
    assert g.layer_counts() == {"swa": 2, "c4a": 21, "c128a": 20, "mtp": 1}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_per_rank_shapes_split_and_replicate(tp):
    ops = g.op_shapes(tp=tp)
    assert ops["wq_a_wkv"].dims == {"N": 1536, "K": 4096}
    assert ops["wq_b"].dims == {"N": 32768 // tp, "K": 1024}
    assert ops["wo_b"].dims == {"N": 4096, "K": 8192 // tp}
    assert ops["indexer_wq_b"].dims == {"N": 8192, "K": 1024}
    assert ops["shared_gate_up"].dims == {"N": 4096 // tp, "K": 4096}
    assert ops["shared_down"].dims == {"N": 4096, "K": 2048 // tp}
    o = ops["o_proj"].dims
    assert (o["H"], o["G"], o["K"], o["R"]) == (64 // tp, 8 // tp, 4096, 1024)
    assert ops["sparse_mla"].dims["H"] == 64 // tp
    assert ops["moe_w13"].dims["N"] == 2 * 2048 // tp
    assert ops["hc_prenorm_gemm"].dims == {"K": 16384, "N": 24, "hc": 4, "D": 4096}
    # replicated ops keep their shape on every rank
    for name, op in ops.items():
        if op.replicated:
            assert op.dims == g.op_shapes(tp=1)[name].dims


def test_calls_per_step():
    ops = g.op_shapes()
    assert g.calls_per_step(g.DEFAULT_CONFIG, ops["mqa_logits"]) == 21
    assert g.calls_per_step(g.DEFAULT_CONFIG, ops["wq_b"]) == 44
    assert g.calls_per_step(g.DEFAULT_CONFIG, ops["hc_prenorm_gemm"]) == 88


def test_round_trip_through_config_json(tmp_path):
    d = g.DEFAULT_CONFIG.to_json_dict()
    d["model_type"] = "deepseek_v4"
    d["architectures"] = ["DeepseekV4ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = g.load_config(tmp_path)
    assert cfg == g.DEFAULT_CONFIG
    assert cfg.extra["architectures"] == ["DeepseekV4ForCausalLM"]


@pytest.mark.parametrize("field,value,match", [
    ("model_type", "deepseek_v3", "model_type"),
    ("compress_ratios", [0] * 10, "compress_ratios"),
    ("compress_ratios", [0, 0] + [8, 128] * 20 + [4, 0], r"ratios \[8\]"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("o_groups", 7, "o_groups"),
    ("hidden_size", 4000, "hidden_size"),
    ("scoring_func", "softmax", "scoring_func"),
])
def test_bad_configs_name_the_field(field, value, match):
    d = g.DEFAULT_CONFIG.to_json_dict()
    d[field] = value
    with pytest.raises(g.ConfigError, match=match):
        g.from_dict(d)


def test_bad_tp_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="tp=3"):
        g.op_shapes(tp=3)
    with pytest.raises(g.ConfigError, match="no config.json"):
        g.load_config(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(g.ConfigError, match="not valid JSON"):
        g.load_config(tmp_path)
