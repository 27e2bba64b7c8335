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
    d["model_type"] = "deepseek_v4"
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


@pytest.mark.parametrize("d, match", [
    ({}, "model_type: missing"),
    ({"hidden_size": 4096}, "model_type: missing"),
    ({"model_type": "deepseek_v4", "hidden_size": 4096}, "num_hidden_layers: missing"),
    ({"model_type": "deepseek_v41"}, "model_type='deepseek_v41'"),
])
def test_partial_configs_are_not_filled_with_v4_flash(d, match):
    with pytest.raises(g.ConfigError, match=match):
        g.from_dict(d)


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", "4096", "hidden_size='4096': must be an integer"),
    ("hidden_size", -128, "hidden_size=-128: must be positive"),
    ("hidden_size", 4096.0, "hidden_size=4096.0: must be an integer"),
    ("num_attention_heads", 0, "num_attention_heads=0: must be positive"),
    ("vocab_size", True, "vocab_size=True: must be an integer"),
    ("num_hash_layers", -1, "num_hash_layers=-1: must be >= 0"),
    ("compress_ratios", "4,128", "compress_ratios='4,128': must be a list of integers"),
    ("rms_norm_eps", 0, "rms_norm_eps=0: must be a positive number"),
    ("norm_topk_prob", "yes", "norm_topk_prob='yes': must be true or false"),
])
def test_field_types_and_ranges_name_the_key(field, value, match):
    d = g.DEFAULT_CONFIG.to_json_dict()
    d["model_type"] = "deepseek_v4"
    d[field] = value
    with pytest.raises(g.ConfigError, match=match):
        g.from_dict(d)


def test_non_object_config_and_zero_mtp_allowed(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(g.ConfigError, match="must be a JSON object"):
        g.load_config(tmp_path)
    d = g.DEFAULT_CONFIG.to_json_dict()
    d.update(model_type="deepseek_v4", num_nextn_predict_layers=0, compress_ratios=d["compress_ratios"][:-1])
    assert g.from_dict(d).num_layers_with_mtp == 43


def test_cli_config_errors_exit_2_naming_the_key(tmp_path, capsys):
    from ds4lab.cli import main

    d = g.DEFAULT_CONFIG.to_json_dict()
    d.update(model_type="deepseek_v4", hidden_size="4096")
    (tmp_path / "config.json").write_text(json.dumps(d))
    for cmd in ("info", "plan"):
        assert main([cmd, "--config", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"ds4lab {cmd}: error: config field hidden_size='4096': must be an integer"
