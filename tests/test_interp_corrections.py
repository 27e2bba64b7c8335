"""Prove that ds4lab.interp's corrections make the Triton interpreter bit-match torch, and that
without them the interpreter is wrong (so these tests can fail)."""
import pytest
import torch

from conftest import HAS_CUDA
from ds4lab import interp
from ds4lab_kernels._fp8 import to_e4m3  # noqa: F401  (global of the jit function below)

pytestmark = [pytest.mark.interp,
              pytest.mark.skipif(HAS_CUDA, reason="interpreter lane (CPU machines only)")]


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def cast_fp8(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        tl.store(y_ptr + o, tl.load(x_ptr + o, mask=m).to(tl.float8e4nv), mask=m)

    @triton.jit
    def cast_bf16(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        tl.store(y_ptr + o, tl.load(x_ptr + o, mask=m).to(tl.bfloat16), mask=m)

    @triton.jit
    def dot_bf16(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        a = tl.load(a_ptr + r[:, None] * N + r[None, :])
        b = tl.load(b_ptr + r[:, None] * N + r[None, :])
        tl.store(c_ptr + r[:, None] * N + r[None, :], tl.dot(a, b))

    return cast_fp8, cast_bf16, dot_bf16


def _specials():
    g = torch.Generator().manual_seed(1)
    x = torch.cat([
        torch.randn(4096, generator=g) * 100,                      # normals, some > 448
        torch.randn(1024, generator=g) * 1e-3,                     # e4m3 subnormal range
        torch.tensor([1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -11, 448.0, 464.0, 1e9,
                      float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 240.0, 232.0]),
    ])
    return x.float()


def _run_fp8(x):
    cast_fp8, _, _ = _kernels()
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    cast_fp8[(triton_cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256)
    return y


def triton_cdiv(a, b):
    return -(-a // b)


def _want_fp8(x):
    return x.double().clamp(-448, 448).to(torch.float8_e4m3fn)  # cvt.rn.satfinite


def test_fp8_cast_corrected_bit_matches_torch():
    interp.install()
    x = _specials()
    assert torch.equal(_run_fp8(x).view(torch.uint8), _want_fp8(x).view(torch.uint8))


def test_fp8_cast_uncorrected_is_wrong():
    x = _specials()
    interp.uninstall()
    try:
        got = _run_fp8(x)
    finally:
        interp.install()
    assert not torch.equal(got.view(torch.uint8), _want_fp8(x).view(torch.uint8))


def _run_bf16(x):
    _, cast_bf16, _ = _kernels()
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    cast_bf16[(triton_cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256)
    return y


def test_bf16_cast_corrected_and_uncorrected():
    x = _specials()
    want = x.to(torch.bfloat16).view(torch.int16)
    interp.install()
    assert torch.equal(_run_bf16(x).view(torch.int16), want)
    interp.uninstall()
    try:
        bad = _run_bf16(x).view(torch.int16)
    finally:
        interp.install()
    assert not torch.equal(bad, want)  # truncation differs from round-to-nearest-even


def _run_dot(a, b):
    _, _, dot_bf16 = _kernels()
    c = torch.empty(a.shape, dtype=torch.float32)
    dot_bf16[(1,)](a, b, c, N=a.shape[0])
    return c


def test_bf16_dot_corrected_and_uncorrected():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(16, 16, generator=g).bfloat16()
    b = torch.randn(16, 16, generator=g).bfloat16()
    want = a.float() @ b.float()
    interp.install()
    assert torch.allclose(_run_dot(a, b), want, rtol=1e-6, atol=1e-5)
    interp.uninstall()
    try:
        bad = _run_dot(a, b)
    finally:
        interp.install()
    assert not torch.allclose(bad, want, rtol=1e-2, atol=1e-2)


def test_fp8_dot_nan_corrected_and_uncorrected():
    """An e4m3fn NaN operand makes its dot products NaN (as on the GPU), not a product with 480."""
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(16, 16, generator=g) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(16, 16, generator=g) * 8).to(torch.float8_e4m3fn)
    a.view(torch.uint8)[2, 5] = 0x7F  # NaN
    want = a.float() @ b.float()
    assert want[2].isnan().all() and want[:2].isfinite().all()
    interp.install()
    got = _run_dot(a, b)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[:2], want[:2])
    interp.uninstall()
    try:
        bad = _run_dot(a, b)
    finally:
        interp.install()
    assert not bad[2].isnan().any()


def test_kernel_rounding_helper_is_exact_without_corrections():
    """kernels/_fp8.to_e4m3 pre-rounds on the e4m3 grid, so it is exact for every non-NaN input
    even on the uncorrected interpreter (and on sm_89, where Triton's cast rounds twice through
    fp16); the uncorrected interpreter still mangles NaN payloads, the corrected one does not."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        tl.store(y_ptr + o, to_e4m3(tl.load(x_ptr + o, mask=m)), mask=m)

    x = _specials()
    want = _want_fp8(x).view(torch.uint8)
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    interp.uninstall()
    try:
        k[(triton_cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256)
    finally:
        interp.install()
    keep = ~x.isnan()
    assert torch.equal(y.view(torch.uint8)[keep], want[keep])
    k[(triton_cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256)
    assert torch.equal(y.view(torch.uint8), want)
