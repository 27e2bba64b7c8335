"""Issue 20, session 19: sparse MLA decode with its split merge in the split launch (``"FUSE_MERGE": True``; row
``h16n16m1f``, and ``h16n16`` with the key): the last programs of each (token, head block) to arrive merge its
partials, so the decode is one launch where it was two (split + merge).

What is proven here (interpreter; the cross-program wait itself runs only on a GPU):
- bit for bit the two-launch path's output in every output mode the launcher has: bf16 ``o``, ``return_lse``
  statistics, the fused q norm, and o_proj's fp8 input (``o_fp8``, positions outside the table included), on the
  spec's adversarial cases, T = 1..3, a partial head block (24 heads), more and fewer splits than merge tiles;
- against the float64 reference, where a broken output fails the same check;
- one kernel per call, and every counter back to 0 after it (CUDA-graph replays need zeroed counters);
- the worker count's deadlock bound.
"""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.specs.sparse_mla import check, make_decode_inputs
from ds4lab.reference import sparse_mla as ref
from ds4lab.reference.rope import cos_sin_cache
from ds4lab_kernels import _counters
from ds4lab_kernels.sparse_mla import CONFIGS, fused_merge_workers, sparse_mla_decode

pytestmark = pytest.mark.interp

ROWS = {**CONFIGS["sm_89"], "h16n16f": {**CONFIGS["sm_89"]["h16n16"], "FUSE_MERGE": True}}


def _launched(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction
    import triton.runtime.jit as jit
    names = []
    cls = InterpretedFunction if DEVICE == "cpu" else jit.JITFunction
    orig = cls.run

    def run(self, *a, **kw):
        names.append(self.fn.__name__)
        return orig(self, *a, **kw)
    monkeypatch.setattr(cls, "run", run)
    return names


def _pair(label, **extra):
    """(two-launch config, fused config) of a row, with ``extra`` (SPLITS...) on both."""
    two = {k: v for k, v in ROWS[label].items() if k != "FUSE_MERGE"}
    return {**two, **extra}, {**ROWS[label], **extra}


def _o_fp8_args(T, g):
    p = torch.randint(0, 64, (T,), generator=g, dtype=torch.int64)
    p[0] = 63
    if T > 2:
        p[2] = 64            # outside the table: NaN for that token, as the two-launch path writes
    return {"o_fp8": True, "positions": p.to(DEVICE),
            "cos_sin": cos_sin_cache(64, 64, 160000.0, 16.0, 65536).to(DEVICE)}


@pytest.mark.parametrize("mode,label,shape,case,splits", [
    ("bf16", "h16n16f", {"T": 3, "H": 16, "W": 20, "Kc": 37, "comp_bs": 2}, "neg_indices", 3),
    ("bf16", "h16n16m1f", {"T": 1, "H": 16, "W": 20, "Kc": 37, "comp_bs": 64}, "peaked", 5),
    ("bf16", "h16n16f", {"T": 2, "H": 24, "W": 16, "Kc": 24, "comp_bs": 2}, "all_invalid", 2),   # partial block
    ("lse", "h16n16m1f", {"T": 2, "H": 16, "W": 20, "Kc": 37, "comp_bs": 64}, "sink_extremes", 4),
    ("q_norm", "h16n16m1f", {"T": 2, "H": 16, "W": 20, "Kc": 37, "comp_bs": 64, "q_norm": True}, "random", 3),
    ("o_fp8", "h16n16m1f", {"T": 3, "H": 16, "W": 20, "Kc": 37, "comp_bs": 64}, "boundary_lens", 4),
    ("o_fp8", "h16n16m1f", {"T": 1, "H": 16, "W": 20, "Kc": 37, "comp_bs": 64}, "one_valid", 40),  # > 32 tiles
])
def test_fused_merge_bit_equals_the_merge_launch(mode, label, shape, case, splits, monkeypatch):
    inp = make_decode_inputs(shape, case, 7, DEVICE)
    kw = {}
    if mode == "lse":
        kw["return_lse"] = True
    elif mode == "o_fp8":
        kw = _o_fp8_args(shape["T"], torch.Generator().manual_seed(3))
    two, fused = _pair(label, SPLITS=splits)
    names = _launched(monkeypatch)
    want = sparse_mla_decode(**inp, config=two, **kw)
    assert names == ["_sparse_mla_split_kernel", "_sparse_mla_merge_kernel"], names
    names.clear()
    got = sparse_mla_decode(**inp, config=fused, **kw)
    assert names == ["_sparse_mla_split_kernel"], names
    assert _counters.left_nonzero("sparse_mla") == 0
    flat = lambda r: [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in
                      (r if isinstance(r, tuple) else (r,)) for t in (t if isinstance(t, tuple) else (t,))]
    for a, b in zip(flat(got), flat(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.nan_to_num(1.5) if a.is_floating_point() else a,
                           b.nan_to_num(1.5) if b.is_floating_point() else b)


def test_fused_merge_against_the_reference_and_a_broken_output_fails():
    inp = make_decode_inputs({"T": 2, "H": 16, "W": 20, "Kc": 37, "comp_bs": 64}, "random", 11, DEVICE)
    got = sparse_mla_decode(**inp, config={**ROWS["h16n16m1f"], "SPLITS": 4})
    want = ref.sparse_mla_decode(**inp)
    assert all(check(got, want, inp))
    bad = got.clone()
    bad[1, 3, 128:256] = 0          # one head's merge tile left unwritten
    assert not all(check(bad, want, inp))


def test_one_split_runs_no_merge():
    inp = make_decode_inputs({"T": 2, "H": 16, "W": 20, "Kc": 0}, "random", 5, DEVICE)
    two, fused = _pair("h16n16f", SPLITS=1)
    assert torch.equal(sparse_mla_decode(**inp, config=fused), sparse_mla_decode(**inp, config=two))


def test_worker_count_bound():
    assert fused_merge_workers(32, 40, 1, 1) == 1              # the interpreter: the last arrival alone
    assert fused_merge_workers(32, 40, 1, 132) == 32           # T=1 on an H200: one merge tile a worker
    assert fused_merge_workers(32, 20, 1, 128) == 20           # fewer splits than tiles: workers loop
    assert fused_merge_workers(32, 8, 16, 128) == 8            # T=16: 16 x 7 = 112 spinning < 128 SMs
    w = fused_merge_workers(32, 40, 16, 128)
    assert 16 * (w - 1) < 128 and w == 8
    assert fused_merge_workers(4, 4, 200, 128) == 1            # more groups than SMs: only the last arrival merges
