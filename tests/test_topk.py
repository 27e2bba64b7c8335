"""Top-512 selection: tie rule, NaN/-inf handling, padding, lengths, bad inputs (beyond the sweep)."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare_topk
from ds4lab.reference.topk import topk_indices as ref
from ds4lab_kernels.topk import topk_indices

pytestmark = pytest.mark.interp
SMALL = {"BLOCK": 1024, "num_warps": 4}


def test_zero_plateau_across_the_boundary_lower_index_wins():
    N, k = 3000, 512
    x = torch.full((1, N), -5.0)
    x[0, 100:300] = 2.0          # 200 clear winners
    x[0, 1000:2500] = 0.0        # 1500 zeros: 312 of them are taken, the lowest indices
    x[0, 1500] = -0.0            # -0.0 ties with +0.0
    out = topk_indices(x.to(DEVICE), k, config=SMALL).cpu()
    want = torch.cat([torch.arange(100, 300), torch.arange(1000, 1312)]).int()
    assert torch.equal(out[0], want)
    assert torch.equal(out, ref(x, k))


def test_short_rows_nan_and_neginf_pad_with_minus_one():
    x = torch.randn(4, 800)
    x[0, 10:] = float("-inf")             # 10 valid
    x[1] = float("nan")                   # nothing valid
    x[2, ::2] = float("nan")              # 400 valid
    lens = torch.tensor([800, 800, 800, 1], dtype=torch.int32)
    out = topk_indices(x.to(DEVICE), 512, lens.to(DEVICE), config=SMALL).cpu()
    assert (out[0, :10] == torch.arange(10)).all() and (out[0, 10:] == -1).all()
    assert (out[1] == -1).all()
    assert (out[2, :400] == torch.arange(1, 800, 2)).all() and (out[2, 400:] == -1).all()
    assert out[3, 0] == 0 and (out[3, 1:] == -1).all()
    assert compare_topk(out, x, 512, lens)


def test_extreme_values_and_large_row():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 70_000, generator=g) * 1e30
    x[0, :600] = -3.0e38                 # most negative finite bin: taken whole when nothing else is valid
    x[0, 600:] = float("-inf")
    x[1, 5] = float("inf")
    out = topk_indices(x.to(DEVICE), 512, config={"BLOCK": 4096, "num_warps": 8}).cpu()
    assert torch.equal(out[0], torch.arange(512).int())
    assert torch.equal(out, ref(x, 512))


def test_k_other_than_512_and_out_buffer(device):
    x = torch.randn(3, 257)
    # the buffer must live on the kernel's device: `out.to("cuda")` would hand the kernel a copy and
    # leave the checked CPU tensor uninitialised
    out = torch.full((3, 7), -2, dtype=torch.int32, device=device)
    got = topk_indices(x.to(device), 7, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out.cpu(), ref(x, 7))


@pytest.mark.parametrize("kw,exc,match", [
    ({"logits": torch.zeros(2, 8, dtype=torch.float64)}, TypeError, "logits: dtype"),
    ({"logits": torch.zeros(8)}, ValueError, "logits: expected 2 dims"),
    ({"logits": torch.zeros(8, 2).t()}, ValueError, "contiguous"),
    ({"k": 0}, ValueError, "k=0"),
    ({"lengths": torch.zeros(2, dtype=torch.int64)}, TypeError, "lengths"),
    ({"lengths": torch.zeros(3, dtype=torch.int32)}, ValueError, "lengths: shape"),
])
def test_bad_inputs(kw, exc, match):
    args = {"logits": torch.zeros(2, 8), "k": 4, **kw}
    with pytest.raises(exc, match=match):
        topk_indices(**args)
