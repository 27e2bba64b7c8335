import pytest
import torch

from ds4lab.harness import numerics as nm


def test_compare_passes_rounding_and_reports_figures():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 64, generator=g, dtype=torch.float64)
    out = ref.to(torch.bfloat16)
    r = nm.compare(out, ref)
    assert r.ok and 0 < r.max_rel <= 2 ** -8 and 0 < r.diff < 1e-4 and r.rms_rel < 4e-3


def test_compare_fails_and_locates():
    ref = torch.ones(4, 5)
    out = ref.clone()
    out[2, 3] = 1.5
    r = nm.compare(out, ref)
    assert not r.ok and r.n_fail == 1 and r.first_fail[0][0] == (2, 3)
    assert "FAIL" in r.summary()


def test_compare_nan_inf_must_match():
    ref = torch.tensor([1.0, float("nan"), float("-inf")])
    assert nm.compare(ref.clone(), ref).ok
    assert not nm.compare(torch.tensor([1.0, 0.0, float("-inf")]), ref).ok
    assert not nm.compare(torch.tensor([1.0, float("nan"), float("inf")]), ref).ok
    r = nm.compare(torch.tensor([1.0, float("nan"), float("-inf")]), torch.tensor([1.0, 2.0, float("-inf")]))
    assert not r.ok and r.nan_out == 1 and r.nan_ref == 0


def test_similarity_budget_catches_systematic_scale_error():
    ref = torch.randn(1000, dtype=torch.float64)
    out = (ref * 1.01).float()  # within rtol elementwise? no: 1% > 1e-4; use loose tol to isolate diff
    r = nm.compare(out, ref, nm.Tolerance(atol=1, rtol=1, max_diff=1e-6))
    assert r.n_fail == 0 and not r.ok and "similarity" in r.note


def test_exact_and_fp8_bytes():
    a = torch.tensor([1.0, 2.0, -448.0]).to(torch.float8_e4m3fn)
    b = a.clone()
    assert nm.compare_exact(a, b).ok
    b2 = torch.tensor([1.0, 2.25, -448.0]).to(torch.float8_e4m3fn)
    assert not nm.compare_exact(a, b2).ok
    assert nm.compare_fp8_bytes(a, b2, max_ulp=1).ok
    assert not nm.compare_fp8_bytes(a, torch.tensor([1.0, 2.5, -448.0]).to(torch.float8_e4m3fn), max_ulp=1).ok
    with pytest.raises(TypeError):
        nm.compare_exact(a, a.float())
    with pytest.raises(ValueError):
        nm.compare(torch.ones(2), torch.ones(3))


def test_mask_and_topk_multiset():
    inf = float("-inf")
    assert nm.compare_mask(torch.tensor([1.0, inf]), torch.tensor([2.0, inf])).ok
    assert not nm.compare_mask(torch.tensor([1.0, 0.0]), torch.tensor([2.0, inf])).ok
    scores = torch.tensor([[3.0, 1.0, 3.0, 0.0, inf], [inf, inf, inf, inf, inf]])
    # ties: index 0 or 2 are both right for k=1
    assert nm.compare_topk(torch.tensor([[2, -1], [-1, -1]])[:, :2], scores, 2).ok is False  # row0 needs 2
    assert nm.compare_topk(torch.tensor([[2, 0], [-1, -1]]), scores, 2).ok
    assert nm.compare_topk(torch.tensor([[0, 2], [-1, -1]]), scores, 2).ok
    assert not nm.compare_topk(torch.tensor([[0, 1], [-1, -1]]), scores, 2).ok      # 1.0 is not top-2
    assert not nm.compare_topk(torch.tensor([[0, 0], [-1, -1]]), scores, 2).ok      # duplicate
    assert not nm.compare_topk(torch.tensor([[0, 2], [0, -1]]), scores, 2).ok       # -inf row selects
    lens = torch.tensor([2, 5])
    assert not nm.compare_topk(torch.tensor([[0, 2], [-1, -1]]), scores, 2, lens).ok  # 2 >= len
    assert nm.compare_topk(torch.tensor([[0, 1], [-1, -1]]), scores, 2, lens).ok


def test_exact_treats_any_nan_as_nan():
    a = torch.tensor([float("nan"), 1.0]).to(torch.float8_e4m3fn)
    b = a.view(torch.uint8).clone()
    b[0] = 0xFF  # negative NaN encoding, as GPUs produce
    assert nm.compare_exact(a, b.view(torch.float8_e4m3fn)).ok
    b[1] = 0x39
    assert not nm.compare_exact(a, b.view(torch.float8_e4m3fn)).ok


def test_fp8_mma_emulated_truncates_each_k_step_to_acc_bits():
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(3, 16, 128, generator=g) * 4).to(torch.float8_e4m3fn).double()
    b = (torch.randn(3, 40, 128, generator=g) * 4).to(torch.float8_e4m3fn).double()
    exact = a @ b.mT
    assert torch.equal(nm.fp8_mma_emulated(a, b, acc_bits=52), exact)  # products and sums exact in fp64
    emu = nm.fp8_mma_emulated(a, b, acc_bits=13)
    m, _ = torch.frexp(emu)
    assert torch.equal(m * 2.0 ** 14, torch.trunc(m * 2.0 ** 14))  # 14 significant bits
    one = nm.fp8_mma_emulated(a[..., :32], b[..., :32], acc_bits=13)  # one step: truncation toward zero
    assert (one.abs() <= (a[..., :32] @ b[..., :32].mT).abs()).all()
    rel = ((emu - exact).norm() / exact.norm()).item()
    assert 2.0 ** -16 < rel < 2.0 ** -11, rel  # ~2^-13 relative: the hardware's accumulation error
