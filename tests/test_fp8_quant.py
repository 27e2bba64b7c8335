"""FP8 activation quant: specifics beyond the registry sweep (encodings, eps, errors)."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.reference import quant as ref
from ds4lab_kernels.fp8_quant import per_token_group_quant_fp8 as quant

pytestmark = pytest.mark.interp


def _x(M=5, K=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g) * 3).bfloat16().to(DEVICE)


def test_three_encodings_agree():
    x = _x()
    q1, s_pow2 = quant(x, scale_fmt="pow2")
    q2, s_b = quant(x, scale_fmt="ue8m0")
    q3, s_p = quant(x, scale_fmt="ue8m0_packed")
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(q1.view(torch.uint8), q3.view(torch.uint8))
    assert torch.equal(ref.decode_ue8m0(s_b.cpu()), s_pow2.cpu())
    assert torch.equal(ref.unpack_ue8m0(s_p.cpu(), 4), s_b.cpu())
    assert s_p.dtype == torch.int32 and s_p.shape == (5, 1)
    # power-of-two scales are never smaller than the exact fp32 scale (no overflow past 448)
    _, s_fp32 = quant(x, scale_fmt="fp32")
    assert torch.all(s_pow2 >= s_fp32) and torch.all(s_pow2 < 2 * s_fp32)


def test_constant_fill_is_exact():
    x = torch.full((3, 256), 2.0, dtype=torch.bfloat16, device=DEVICE)
    q, s = quant(x)
    assert torch.all(q.float() == 448.0)
    assert torch.all(s == torch.tensor(2.0 / 448.0))
    deq = ref.dequant(q.cpu(), s.cpu())
    assert torch.allclose(deq, torch.full((3, 256), 2.0), rtol=1e-6)


def test_zero_and_tiny_groups_give_zeros_not_nan():
    x = torch.zeros(2, 256, dtype=torch.bfloat16, device=DEVICE)
    x[1, 128:] = 1e-30
    q, s = quant(x, eps=1e-10)
    assert not torch.isnan(q.float()).any() and not torch.isnan(s).any()
    assert torch.all(q.float() == 0)
    assert torch.all(s == torch.tensor(1e-10 / 448.0))


def test_nan_group_is_flagged():
    x = _x(2, 256)
    x[0, 5] = float("nan")
    q, s = quant(x, scale_fmt="ue8m0")
    assert s[0, 0].item() == 255 and s[0, 1].item() != 255
    assert torch.isnan(q[0, :128].float()).all() and not torch.isnan(q[0, 128:].float()).any()


def test_empty_and_strided_rows():
    q, s = quant(torch.empty(0, 256, dtype=torch.bfloat16, device=DEVICE))
    assert q.shape == (0, 256) and s.shape == (0, 2)
    big = _x(4, 768)
    view = big[:, 128:640]  # row stride 768, last dim contiguous
    q1, s1 = quant(view)
    q2, s2 = quant(view.contiguous())
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)


@pytest.mark.parametrize("bad,kw,exc,match", [
    (lambda: torch.zeros(2, 256, dtype=torch.int32), {}, TypeError, "x: dtype"),
    (lambda: torch.zeros(2, 200, dtype=torch.bfloat16), {}, ValueError, "multiple of group_size"),
    (lambda: torch.zeros(256, dtype=torch.bfloat16), {}, ValueError, "2 dims"),
    (lambda: torch.zeros(256, 4, dtype=torch.bfloat16).t(), {}, ValueError, "stride"),
    (lambda: torch.zeros(2, 256, dtype=torch.bfloat16), {"scale_fmt": "e8m0"}, ValueError, "scale_fmt"),
    (lambda: torch.zeros(2, 256, dtype=torch.bfloat16), {"eps": 0.0}, ValueError, "eps"),
    (lambda: torch.zeros(2, 256, dtype=torch.bfloat16), {"group_size": 100}, ValueError, "group_size"),
])
def test_bad_inputs_raise_naming_the_argument(bad, kw, exc, match):
    with pytest.raises(exc, match=match):
        quant(bad().to(DEVICE), **kw)


def test_ue8m0_scales_are_not_zero_filled(monkeypatch):
    """ue8m0 writes every scale byte, so no torch.zeros (a fill kernel: the third launch per FP8
    linear in the decode step); packed with padding columns still zero-fills."""
    calls = []
    real = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: calls.append(a) or real(*a, **k))
    x = torch.randn(3, 640).bfloat16().to(DEVICE)
    q, s = quant(x, 128, scale_fmt="ue8m0")
    assert calls == []
    _, ref_s = ref.per_token_group_quant_fp8(x, 128, "ue8m0")
    assert torch.equal(s.cpu(), ref_s.cpu())
    _, sp = quant(x, 128, scale_fmt="ue8m0_packed")   # 5 groups -> 3 pad bytes
    assert len(calls) == 1 and int((sp.view(torch.uint8)[:, 5:]).abs().sum()) == 0
