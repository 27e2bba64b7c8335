"""Sparse MLA decode's split merge (issue 20, attn5): the one-pass merge and the merge fused into the
split launch (the last-arriving split program of each (token, head block) merges in split order and
resets its arrival counter), the length-free chain and the next-tile prefetch, on the CPU interpreter:
numerics vs the fp64 reference incl. the registry's adversarial cases, bit-equal repeated calls,
counters zero after a call, the launch plan. The sm_89 compile check of these rows (0 spills, shared
memory <= 101,376 B) is the compile report's (tests/test_aot.py); test_candidate_rows_compile_for_sm89
builds the T=1 C4A specialisations the report's T=4 shapes do not reach."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.registry import get
from ds4lab.harness.specs.sparse_mla import check
from ds4lab.reference import sparse_mla as ref
from ds4lab_kernels import sparse_mla as sm

pytestmark = pytest.mark.interp
ROWS = ("h16n16m1o", "h16n16m1ow8", "h16n16p2", "h16n16f8")
SPEC = get("sparse_mla_decode")


def _ok(out, inputs):
    reps = check(out, ref.sparse_mla_decode(**inputs), inputs)
    assert all(reps), [str(r) for r in reps]


def _counters_zero():
    buf = sm._COUNTERS.get((torch.device(DEVICE).type, torch.device(DEVICE).index))
    return buf is None or int(buf.abs().sum()) == 0


def test_candidate_rows_are_in_both_tables():
    for arch in ("sm_89", "sm_90"):
        assert set(ROWS) <= set(sm.CONFIGS[arch])
    assert sm.CONFIGS["sm_89"]["h16n16f8"]["FUSE"] and sm.CONFIGS["sm_90"]["h16n16m1o"]["MERGE_ONE_PASS"]
    for gone in ("h16n32s2", "h16n32s2m1", "h32n32p1"):   # lost every timed shape (NOTES.md)
        assert gone not in sm.CONFIGS["sm_90"]


def test_launch_plan_t1_shapes():
    # C4A TP=4 at T=1 on 132 SMs: 40 tiles of 16; m1o one tile per split and a one-pass merge 16 x 32
    # programs wide; f8 caps the splits at 8 (5 tiles each) and merges in the split launch
    cpu = torch.device("cpu")
    sms = sm.num_sms(cpu)
    p = sm.launch_plan(1, 16, 40, cpu, sm.CONFIGS["sm_89"]["h16n16m1o"])
    assert p["splits"] == 40 and p["tiles_per_split"] == 1 and p["launches"] == 2 and p["merge_one_pass"]
    assert p["merge_sb"] == 64 and p["merge_sb"] * 16 * p["merge_bd"] <= sm.MERGE_ELEMS
    f = sm.launch_plan(1, 16, 40, cpu, sm.CONFIGS["sm_89"]["h16n16f8"])
    assert f["splits"] == 8 and f["tiles_per_split"] == 5 and f["fused"] and f["launches"] == 1
    # TP=1: 4 head blocks, each merged by its own last arriver (never one program for the token)
    f64 = sm.launch_plan(1, 64, 40, cpu, sm.CONFIGS["sm_89"]["h16n16f8"])
    assert f64["head_blocks"] == 4 and f64["fused"]
    # a large batch needs no split at all: one launch, nothing to merge
    big = sm.launch_plan(256, 16, 40, cpu, sm.CONFIGS["sm_89"]["h16n16f8"])
    assert big["splits"] == 1 and big["launches"] == 1 and not big["fused"] and sms > 0
    # too many splits for one statistics load: the fused row falls back to the two-launch merge
    many = sm.launch_plan(1, 16, 4000, cpu, {**sm.CONFIGS["sm_89"]["h16n16f8"], "MAX_SPLITS": 4000})
    assert not many["fused"] and many["launches"] == 2


@pytest.mark.parametrize("label", ROWS)
def test_rows_t1_boundaries(label):
    # window 127 of 128 and top-k 511 of 512 (the last tile partly valid), 16 heads: the T=1 path
    inp = SPEC.make_inputs({"T": 1, "H": 16, "W": 128, "Kc": 512, "comp_bs": 64}, "random",
                           int(torch.randint(0, 1000, (1,))), DEVICE)
    inp["swa_lens"][:] = 127
    inp["comp_lens"][:] = 511
    out = sm.sparse_mla_decode(**inp, config=sm.CONFIGS["sm_89"][label])
    _ok(out, inp)
    assert _counters_zero()


@pytest.mark.parametrize("case", SPEC.cases)
def test_fused_and_one_pass_adversarial_cases(case):
    # every registry case (boundary lengths, -1 / out-of-cache slots, empty rows, one candidate, peaked
    # scores, +30 / -inf sinks) through the fused merge and the one-pass merge, 24 heads (a partial head
    # block), C128A blocks; SPLITS forced so every row splits (and some splits see nothing valid)
    inp = SPEC.make_inputs({"T": 2, "H": 24, "W": 24, "Kc": 40, "comp_bs": 2}, case, 11, DEVICE)
    for label in ("h16n16f8", "h16n16m1o"):
        cfg = {**sm.CONFIGS["sm_89"][label], "SPLITS": 4}
        out = sm.sparse_mla_decode(**inp, config=cfg)
        _ok(out, inp)
        if label == "h16n16f8":
            assert torch.equal(out, sm.sparse_mla_decode(**inp, config=cfg)), f"{label}: two calls differ"
        assert _counters_zero(), f"{label}: arrival counters left non-zero"


def test_fused_merge_lse_matches_two_launch_merge_and_reference():
    inp = SPEC.make_inputs({"T": 2, "H": 16, "W": 48, "Kc": 64, "comp_bs": 64}, "neg_indices", 5, DEVICE)
    base = {**sm.CONFIGS["sm_89"]["h16n16f8"], "SPLITS": 6}
    out, lse = sm.sparse_mla_decode(**inp, config=base, return_lse=True)
    two, lse2 = sm.sparse_mla_decode(**inp, config={**base, "FUSE": False}, return_lse=True)
    _ok(out, inp)
    _ok(two, inp)
    want = ref.sparse_mla_decode_lse(**{k: v for k, v in inp.items() if k != "attn_sink"})
    fin = torch.isfinite(want)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(want))
    assert torch.allclose(lse.cpu().double()[fin], want[fin], rtol=1e-4, atol=1e-3)
    assert torch.allclose(lse, lse2, rtol=1e-6, atol=1e-6)
    assert _counters_zero()


def test_fused_merge_64_heads_four_head_blocks():
    # TP=1: four head blocks per token, each merged by its own last arriver (its own counter)
    inp = SPEC.make_inputs({"T": 1, "H": 64, "W": 16, "Kc": 32, "comp_bs": 64}, "random", 3, DEVICE)
    out = sm.sparse_mla_decode(**inp, config={**sm.CONFIGS["sm_89"]["h16n16f8"], "SPLITS": 3})
    _ok(out, inp)
    assert _counters_zero()


def test_prefetch_multi_tile_splits_match_unsplit():
    # PREFETCH 2 with 3 tiles per split across the window / compressed seam and lengths that end
    # mid-tile: the prefetched tile after a split's last must never be counted
    inp = SPEC.make_inputs({"T": 2, "H": 16, "W": 40, "Kc": 88, "comp_bs": 2}, "boundary_lens", 7, DEVICE)
    for extra in ({"SPLITS": 3}, {"SPLITS": 1}, {"SPLITS": 3, "STATIC_BOUNDS": True}):
        out = sm.sparse_mla_decode(**inp, config={**sm.CONFIGS["sm_89"]["h16n16p2"], **extra})
        _ok(out, inp)


@pytest.mark.aot
def test_candidate_rows_compile_for_sm89():
    # the T=1 specialisations (one tile per split, 40 splits, fused at 8): 0 spills, shared <= 101,376 B
    code = (
        "from ds4lab.harness import aot\n"
        "from ds4lab.harness.registry import get\n"
        "spec = get('sparse_mla_decode')\n"
        "bad = []\n"
        "for lb in %r:\n"
        "    for shape in ({'T': 1, 'H': 16, 'W': 128, 'Kc': 512, 'comp_bs': 64},):\n"
        "        for r in aot.compile_spec(spec, 'sm_89', lb, shape):\n"
        "            print(lb, r.triton_fn, r.registers, r.shared, r.spill_stores, r.ok, r.why)\n"
        "            bad += [] if r.ok and r.shared <= 101376 and not r.spill_stores else [(lb, r.why)]\n"
        "assert not bad, bad\n" % (ROWS,))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
