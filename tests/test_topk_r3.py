"""Top-k three-launch variant (``"VARIANT": "r3"``: P programs per row, two radix levels from summed
chunk histograms, compact candidates, the row's last program selects): indices identical to the
reference tie rule across chunk boundaries, lengths, padding, k != 512, the plateau fallback (more
candidates than CAP), offsets, and the launch count."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.reference.topk import topk_indices as ref
from ds4lab_kernels import topk as topk_mod
from ds4lab_kernels.topk import CONFIGS, topk_indices

pytestmark = pytest.mark.interp


def _masked(x, lens):
    j = torch.arange(x.shape[1])
    return x.masked_fill(j[None, :] >= lens[:, None].long(), float("-inf"))


def _rows(N, g):
    x = torch.full((5, N), -5.0)
    x[0, 100:300] = 2.0
    x[0, 1000:2500] = 0.0                        # the k-th entry sits in a plateau spanning chunks
    x[0, 1500] = -0.0
    x[1] = torch.randint(-2, 3, (N,), generator=g).float()    # massive ties, 5 values
    x[2] = torch.randn(N, generator=g)
    x[2, ::3] = float("nan")
    x[3] = float("-inf")                         # nothing selectable
    x[4] = torch.randn(N, generator=g) * 1e-3 + 20.0          # one binade: level 2 decides
    x[4, -40:] += 1.0                            # clear winners all in the last chunk
    return x


@pytest.mark.parametrize("cfg", [{"BLOCK": 256, "num_warps": 4, "VARIANT": "r3", "P": 5, "CAP": 8192},
                                 {"BLOCK": 256, "num_warps": 4, "VARIANT": "r3", "P": 3, "CAP": 600},
                                 {"BLOCK": 512, "num_warps": 4, "VARIANT": "r3", "P": 64, "CAP": 8192},
                                 CONFIGS["sm_90"]["r3_2048"]])
def test_r3_ties_across_chunks_lengths_padding_and_fallback(cfg):
    g = torch.Generator().manual_seed(7)
    N = 3000
    x = _rows(N, g)
    lens = torch.tensor([N, 2000, 100, N, 2999], dtype=torch.int32)
    out = topk_indices(x.to(DEVICE), 512, config=cfg).cpu()
    assert torch.equal(out, ref(x, 512))
    out = topk_indices(x.to(DEVICE), 512, lens.to(DEVICE), config=cfg).cpu()
    assert torch.equal(out, ref(_masked(x, lens), 512))
    out = topk_indices(x.to(DEVICE), 7, config=cfg).cpu()
    assert torch.equal(out, ref(x, 7))


@pytest.mark.parametrize("label", ["b1024", "r3_1024"])
def test_offsets_added_to_selected_only(label):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 900, generator=g)
    x[1, 300:] = float("-inf")                   # 300 valid: 212 slots of -1 padding stay -1
    off = torch.tensor([0, 5000, 123456], dtype=torch.int32)
    r = ref(x, 512)
    want = torch.where(r >= 0, r + off[:, None], -1)
    got = topk_indices(x.to(DEVICE), 512, config=CONFIGS["sm_89"][label], offsets=off.to(DEVICE)).cpu()
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="offsets"):
        topk_indices(x.to(DEVICE), 512, offsets=off[:2].to(DEVICE))
    with pytest.raises(TypeError, match="offsets"):
        topk_indices(x.to(DEVICE), 512, offsets=off.long().to(DEVICE))


def test_r3_is_three_launches(monkeypatch):
    """At most three kernel launches per call (issue 20), whatever the shape."""
    launched = []
    for name in ("_r3_hist0_kernel", "_r3_hist1_kernel", "_r3_select_kernel", "_topk_kernel"):
        kern = getattr(topk_mod, name)

        class Spy:
            def __init__(self, k, n):
                self.k, self.n = k, n

            def __getitem__(self, grid):
                launched.append(self.n)
                return self.k[grid]
        monkeypatch.setattr(topk_mod, name, Spy(kern, name))
    x = torch.randn(2, 5000)
    out = topk_indices(x.to(DEVICE), 512, config=CONFIGS["sm_90"]["r3_1024"]).cpu()
    assert torch.equal(out, ref(x, 512))
    assert launched == ["_r3_hist0_kernel", "_r3_hist1_kernel", "_r3_select_kernel"]


def test_r3_empty_and_tiny_rows():
    cfg = CONFIGS["sm_90"]["r3_1024p8"]
    out = topk_indices(torch.empty(2, 0).to(DEVICE), 512, config=cfg).cpu()
    assert (out == -1).all()
    x = torch.randn(3, 9)
    assert torch.equal(topk_indices(x.to(DEVICE), 512, config=cfg).cpu(), ref(x, 512))
