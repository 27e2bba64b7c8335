"""Top-k split variant (``"SPLIT": True``: P programs per row, per-chunk histograms merged per pass):
indices identical to the reference tie rule across chunk boundaries, lengths, padding, k != 512."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.reference.topk import topk_indices as ref
from ds4lab_kernels.topk import CONFIGS, topk_indices

pytestmark = pytest.mark.interp


def _masked(x, lens):
    j = torch.arange(x.shape[1])
    return x.masked_fill(j[None, :] >= lens[:, None].long(), float("-inf"))


@pytest.mark.parametrize("cfg", [{"BLOCK": 256, "num_warps": 4, "SPLIT": True, "P": 5},
                                 {"BLOCK": 512, "num_warps": 4, "SPLIT": True, "P": 64},
                                 CONFIGS["sm_90"]["s2048"]])
def test_split_ties_across_chunks_lengths_and_padding(cfg):
    g = torch.Generator().manual_seed(7)
    N = 3000
    x = torch.full((4, N), -5.0)
    x[0, 100:300] = 2.0
    x[0, 1000:2500] = 0.0                        # the k-th entry sits in a plateau spanning chunks
    x[0, 1500] = -0.0
    x[1] = torch.randint(-2, 3, (N,), generator=g).float()    # massive ties, 5 values
    x[2] = torch.randn(N, generator=g)
    x[2, ::3] = float("nan")
    x[3] = float("-inf")                         # nothing selectable
    lens = torch.tensor([N, 2000, 100, N], dtype=torch.int32)
    out = topk_indices(x.to(DEVICE), 512, config=cfg).cpu()
    assert torch.equal(out, ref(x, 512))
    out = topk_indices(x.to(DEVICE), 512, lens.to(DEVICE), config=cfg).cpu()
    assert torch.equal(out, ref(_masked(x, lens), 512))
    out = topk_indices(x.to(DEVICE), 7, config=cfg).cpu()
    assert torch.equal(out, ref(x, 7))


def test_split_empty_and_tiny_rows():
    cfg = CONFIGS["sm_90"]["s4096"]
    out = topk_indices(torch.empty(2, 0).to(DEVICE), 512, config=cfg).cpu()
    assert (out == -1).all()
    x = torch.randn(3, 9)
    assert torch.equal(topk_indices(x.to(DEVICE), 512, config=cfg).cpu(), ref(x, 512))
