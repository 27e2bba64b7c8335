"""The MoE decode GPU driver (ds4lab.harness.moe_bench) end to end on the interpreter at a tiny
shape, the timer stubbed: numerics-first pass, ds4lab and peer rows (full step + GEMMs only), the
straw man, a failing candidate recorded as FAIL without stopping the rest, and the table."""
import csv
import json

import pytest
import torch

from ds4lab.harness import bench, moe_bench, peer_moe

pytestmark = pytest.mark.interp


def test_moe_bench_rows_and_table(tmp_path, monkeypatch):
    pytest.importorskip("vllm")  # the peer's source: the installed vLLM
    monkeypatch.setattr(bench, "_provenance", lambda build: (
        {"build": build, "roof_copy_tbps": 4.0}, {"device": torch.device("cpu"), "arch": "sm_89", "l2": 1,
                                                  "roofs": {"roof_copy_tbps": 4.0, "roof_fp8_tflops": 1.0}}))
    calls = []

    def fake_time(fns, replays=30):
        for f in fns[:1]:
            f()
        calls.append(len(fns))
        return (1.0, 2.0, 3.0), "stub"
    monkeypatch.setattr(bench, "time_calls", fake_time)
    monkeypatch.setattr(moe_bench, "candidate_labels", lambda arch: ["mma_n32s4", "mmaq_n64s2x", "broken"])
    from ds4lab_kernels import moe_w4a16
    monkeypatch.setitem(moe_w4a16.CONFIGS["sm_89"], "broken", {"path": "nope"})
    monkeypatch.setattr(peer_moe, "SWEEP", {"m16n32k128w4s4": peer_moe.SWEEP["m16n32k128w4s4"]})
    shape = lambda tp, T: {"T": T, "E": 8, "D": 256, "I": 128, "topk": 2, "tp": tp}
    monkeypatch.setattr("ds4lab.harness.specs.moe.MOE_CASES", ("random", "padding_nan"))
    rows = moe_bench.run("sm89", 4, [2], str(tmp_path), log=lambda *_: None, shape_of=shape, numerics_t=2)
    got = {(r["impl"], r["config_label"]): r["status"] for r in rows}
    assert got[("ds4lab", "mma_n32s4")] == "OK" and got[("ds4lab", "mmaq_n64s2x")] == "OK"
    assert got[("ds4lab", "broken")] == "FAIL"
    assert got[(moe_bench.PEER, "vllm")] == "OK" and got[(moe_bench.PEER_GEMMS, "vllm")] == "OK"
    assert got[(moe_bench.PEER, "m16n32k128w4s4")] == "OK"
    assert got[(moe_bench.STRAW, "straw man")] == "OK"
    peer_row = next(r for r in rows if r["impl"] == moe_bench.PEER)
    assert "peer rms_rel=" in peer_row["numerics"]
    with open(tmp_path / "moe_bench.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    t = moe_bench.table(rows)
    assert "peer best (full step) = 2.0 us" in t and "mma_n32s4" in t and "broken" in t


def test_exit_code_is_1_on_any_fail_or_error_row():
    assert moe_bench.exit_code([{"status": "OK"}, {"status": "SKIP"}]) == 0
    assert moe_bench.exit_code([{"status": "OK"}, {"status": "FAIL"}]) == 1
    assert moe_bench.exit_code([{"status": "ERROR"}]) == 1


def test_moe_bench_biteq_and_no_peer(tmp_path, monkeypatch):
    """``--biteq``: a row of the same arithmetic (the PTX dequant of the same tiles) passes, a row of other arithmetic (the FMA decode
    variant) FAILs on its bits though within the bf16 budget; ``--no-peer`` (peer_labels=[]) loads no peer."""
    monkeypatch.setattr(bench, "_provenance", lambda build: (
        {"build": build, "roof_copy_tbps": 4.0}, {"device": torch.device("cpu"), "arch": "sm_89", "l2": 1,
                                                  "roofs": {"roof_copy_tbps": 4.0, "roof_fp8_tflops": 1.0}}))
    monkeypatch.setattr(bench, "time_calls", lambda fns, replays=30: (fns[0](), ((1.0, 2.0, 3.0), "stub"))[1])
    monkeypatch.setattr(peer_moe, "load_peer", lambda: pytest.fail("--no-peer loaded the peer"))
    monkeypatch.setattr("ds4lab.harness.specs.moe.MOE_CASES", ("random", "padding_nan"))
    shape = lambda tp, T: {"T": T, "E": 8, "D": 256, "I": 128, "topk": 2, "tp": tp}
    logs = []
    rows = moe_bench.run("sm89", 4, [1], str(tmp_path), log=logs.append, shape_of=shape, numerics_t=2,
                         peer_labels=[], labels_only=["mma_n32s4", "mmaq_n32s4", "decode"], biteq="mma_n32s4",
                         straw_max_t=0)
    got = {r["config_label"]: r["status"] for r in rows}
    assert got == {"mma_n32s4": "OK", "mmaq_n32s4": "OK", "decode": "FAIL"}, got
    assert any(s.startswith("biteq") and "mmaq_n32s4" in s and s.endswith("PASS") for s in logs)
    assert any(s.startswith("biteq") and "decode" in s and s.endswith("FAIL") for s in logs)
    assert "bit-equal to mma_n32s4: True" in next(r for r in rows if r["config_label"] == "mmaq_n32s4")["numerics"]


def test_biteq_refs_per_row():
    """``--biteq LABEL ROW=REF ROW2=-`` (moe16): per-row references; an unknown or non-decode row raises naming it."""
    got = moe_bench.biteq_refs(["mmaq_n64s2x", "mmaq_n32s1xl_w2n128=mmaq_n64s1xl_w2n128", "mmaq_n64s1xl_w2n128=-"])
    assert got == {None: "mmaq_n64s2x", "mmaq_n32s1xl_w2n128": "mmaq_n64s1xl_w2n128", "mmaq_n64s1xl_w2n128": None}
    assert moe_bench.biteq_refs("mma_n32s4") == {None: "mma_n32s4"}
    for bad in (["nope"], ["mmaq_n64s2x=prefill"], ["zz=mmaq_n64s2x"]):
        with pytest.raises(ValueError, match="not a decode row"):
            moe_bench.biteq_refs(bad)


def test_uniform_routing_ids_and_table_rows():
    """``--routing uniform``: ids distinct per token, tokens independent (experts shared), seeded; the table
    keeps a T's uniform rows apart from its distinct rows."""
    a = moe_bench.uniform_ids(16, 256, 6, 3, "cpu")
    assert a.dtype == torch.int32 and a.shape == (16, 6) and a.is_contiguous()
    assert all(len(set(r.tolist())) == 6 for r in a) and int(a.min()) >= 0 and int(a.max()) < 256
    assert torch.equal(a, moe_bench.uniform_ids(16, 256, 6, 3, "cpu"))
    assert int(moe_bench.uniform_ids(32, 256, 6, 4, "cpu").unique().numel()) < 192   # shared at T=32
    base = {"build": "sm89", "impl": "ds4lab", "status": "OK", "tbps": 1.0, "frac_roof": 0.3}
    rows = [dict(base, config_label="a", p50_us=10.0, shape=json.dumps({"T": 16})),
            dict(base, config_label="a", p50_us=8.0, shape=json.dumps({"T": 16, "routing": "uniform", "experts": 80.5}))]
    t = moe_bench.table(rows)
    assert "T=16  peer" in t and "T=16 routing=uniform (80.5 experts)" in t


def test_pool_routing_ids_and_errors():
    """``--routing poolN`` (the step's concentrated routing): every token's top-k distinct and inside one seeded
    pool of N experts; a pool below top-k or above E, and a malformed name, raise naming the argument."""
    a = moe_bench.pool_ids(16, 256, 6, 19, 3, "cpu")
    assert a.dtype == torch.int32 and a.shape == (16, 6) and a.is_contiguous()
    assert all(len(set(r.tolist())) == 6 for r in a) and int(a.min()) >= 0 and int(a.max()) < 256
    assert 6 < int(a.unique().numel()) <= 19
    assert torch.equal(a, moe_bench.pool_ids(16, 256, 6, 19, 3, "cpu"))
    assert not torch.equal(a, moe_bench.pool_ids(16, 256, 6, 19, 4, "cpu"))
    assert moe_bench.routing_pool("pool19") == 19 and moe_bench.routing_pool("uniform") is None
    for bad in ("pool", "pool0", "poolx", "distinct", "zipf"):
        with pytest.raises(ValueError, match="routing="):
            moe_bench.routing_pool(bad)
    with pytest.raises(ValueError, match="pool=5"):
        moe_bench.pool_ids(16, 256, 6, 5, 0, "cpu")
    with pytest.raises(ValueError, match="pool=300"):
        moe_bench.pool_ids(16, 256, 6, 300, 0, "cpu")
    with pytest.raises(SystemExit):
        moe_bench.main(["--routing", "zipf"])
