"""ds4lab.harness.bench on a CPU: the cold-L2 set count (pure), the one home of the cost formulas,
the arch rule, the sm_89 build's ptxas wrapper path, and the check step's failure paths."""
import os

import pytest
import torch

from ds4lab.geometry import DEFAULT_CONFIG
from ds4lab.harness import bench, costs
from ds4lab.harness.registry import all_specs, get

H200_L2 = 60 * 2**20      # torch reports the H200's L2 as 60 MiB (50 MB on the H100)


def _moe_shape(T, tp=4):
    return next(s for s in get("fused_moe_w4a16").bench_shapes(DEFAULT_CONFIG, tp) if s["T"] == T)


def test_n_sets_counts_touched_bytes_not_inputs():
    s = _moe_shape(1)                                  # TP=4 decode: 6 of 256 experts
    inputs = s["E"] * costs.moe_expert_bytes(s)        # every expert is an input: ~830 MB
    touched = get("fused_moe_w4a16").touched_bytes(s)  # the 6 selected ones + activations: ~20 MB
    assert 800e6 < inputs < 900e6 and 15e6 < touched < 25e6
    assert bench.n_sets(inputs, H200_L2) == 1          # what the bench did before (warm L2)
    n = bench.n_sets(touched, H200_L2, inputs)
    assert n == -(-2 * H200_L2 // int(touched)) and n >= 6
    assert n * touched > 2 * H200_L2                   # the rotation really exceeds twice the L2
    # a batch that touches a third of the experts needs no rotation
    assert bench.n_sets(get("fused_moe_w4a16").touched_bytes(_moe_shape(16)), H200_L2) == 1


def test_n_sets_bounds():
    assert bench.n_sets(0, H200_L2) == bench.MAX_SETS                    # tiny inputs: capped
    assert bench.n_sets(1e3, H200_L2, max_sets=8) == 8
    assert bench.n_sets(10e9, H200_L2) == 1                              # never zero
    assert bench.n_sets(1e6, H200_L2, set_bytes=1e9, mem_budget=5e9) == 5  # memory cap
    assert bench.n_sets(1e6, H200_L2, set_bytes=1e9, mem_budget=1e8) == 1


def test_only_kernels_with_a_smaller_footprint_declare_touched_bytes():
    specs = {s.name: s for s in all_specs()}
    assert {n for n, s in specs.items() if s.touched_bytes is not None} == set(costs.TOUCHED_BYTES)


def test_specs_read_the_one_home_of_the_formulas():
    """Every spec's flops/min_bytes IS the costs function (not a copy), and the Ada estimate reads the
    same ones: a drift like `N // 128` against a ceiling cannot come back."""
    for s in all_specs():
        assert s.flops is costs.FLOPS[s.name], s.name
        assert s.min_bytes is costs.MIN_BYTES[s.name], s.name
    assert set(costs.FLOPS) == set(costs.MIN_BYTES) == {s.name for s in all_specs()}
    from ds4lab.planner import speed
    odd = {"M": 1, "N": 199, "K": 512, "a_fmt": "ue8m0_packed", "b_fmt": "ue8m0"}
    # 199 rows are two 128-row weight blocks: two scale rows (the old estimate's N // 128 said one)
    assert speed.kernel_bytes("fp8_gemm_nt", odd) - costs.gemm_min_bytes({**odd, "N": 128}) == \
        71 * 512 + 2 * 71 + (2 - 1) * 4
    with pytest.raises(KeyError, match="'nope'"):
        costs.min_bytes("nope", {})


def test_sm89_build_points_ptxas_at_the_wrapper(monkeypatch):
    for k in ("TRITON_OVERRIDE_ARCH", "TRITON_PTXAS_PATH", "DS4LAB_REAL_PTXAS", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(k, raising=False)
    bench._setup_build("sm89")
    path = os.environ["TRITON_PTXAS_PATH"]
    assert os.path.isfile(path) and os.access(path, os.X_OK), path   # was harness/tools/..., gone in the move
    assert os.environ["TRITON_OVERRIDE_ARCH"] == "sm89"
    with pytest.raises(ValueError, match="--arch 'sm80'"):
        bench._setup_build("sm80")


def test_arch_comes_from_arch_of(monkeypatch):
    """The bench reads its config table from ds4lab_kernels._arch.arch_of, not a rule of its own."""
    import inspect
    src = inspect.getsource(bench)
    assert "props.major" not in src and "arch_of(dev)" in src


class _Spec:
    """The two attributes _check uses, so its failure paths run without a GPU."""
    def __init__(self, reports):
        self.check = lambda got, want, inputs: reports


def test_check_paths_never_read_an_unassigned_reference_error():
    x = {"x": torch.ones(2)}
    ok, txt = bench._check(_Spec([]), lambda x, config: x, x, {}, torch.ones(2), None)
    assert ok and txt == ""                    # no reports: was a NameError on ref_err
    ok, txt = bench._check(_Spec([]), lambda x, config: x, x, {}, None, "reference failed: boom")
    assert not ok and txt == "reference failed: boom"
    ok, txt = bench._check(_Spec([]), lambda x, config: 1 / 0, x, {}, torch.ones(2), None)
    assert not ok and txt.startswith("ZeroDivisionError")


def test_input_sets_rotate_distinct_moe_inputs_on_the_touched_count():
    spec = get("fused_moe_w4a16")
    shape = {"T": 1, "E": 16, "D": 256, "I": 128, "topk": 2}
    l2 = 4 * spec.touched_bytes(shape)                      # an L2 four calls' worth: 8 sets
    sets = bench._input_sets(spec, shape, "cpu", int(l2))
    assert len(sets) == bench.n_sets(spec.touched_bytes(shape), int(l2)) == 8
    assert bench._tensor_bytes(sets[0]) > 7 * spec.touched_bytes(shape)   # all 16 experts are inputs, 2 touched
    assert not torch.equal(sets[0]["w13_packed"], sets[1]["w13_packed"])  # independent weights per set
