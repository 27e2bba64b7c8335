"""ds4lab_kernels/_fp8: the one UE8M0 decoder (OCP MX v1.0 E8M0: ``2^(b-127)``, 0xFF is NaN; byte 0 is
decoded as 0.0, as DeepGEMM's ``b << 23`` and ds4lab.reference.quant do) and its users."""
import math

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from ds4lab.reference.quant import decode_ue8m0
from ds4lab_kernels._fp8 import ue8m0_to_fp32

pytestmark = pytest.mark.interp

BYTES = [0, 1, 126, 127, 128, 254, 255]
WANT = {0: 0.0, 1: 2.0 ** -126, 126: 0.5, 127: 1.0, 128: 2.0, 254: 2.0 ** 127, 255: math.nan}


@triton.jit
def _decode_kernel(b_ptr, out_ptr, N: tl.constexpr):
    """Grid (1,): one program decodes all ``N`` bytes (uint8 or int32 holding 0..255)."""
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, ue8m0_to_fp32(tl.load(b_ptr + offs)))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32])
def test_bytes_0_127_254_255(dtype):
    b = torch.tensor(BYTES + [127] * (8 - len(BYTES)), dtype=dtype, device=DEVICE)
    out = torch.empty(8, dtype=torch.float32, device=DEVICE)
    _decode_kernel[(1,)](b, out, N=8)
    got = out.cpu().tolist()[:len(BYTES)]
    for byte, g in zip(BYTES, got):
        w = WANT[byte]
        assert (math.isnan(g) if math.isnan(w) else g == w), (byte, g, w)
    # the torch reference agrees bit for bit (NaN with NaN)
    ref = decode_ue8m0(torch.tensor(BYTES, dtype=torch.uint8))
    assert torch.equal(torch.tensor(got).isnan(), ref.isnan())
    assert torch.equal(torch.tensor(got).nan_to_num(7.0), ref.nan_to_num(7.0))


def test_one_decoder_for_every_family():
    """fp8_gemm, o_proj and sparse_mla decode with _fp8.ue8m0_to_fp32 (there used to be three
    decoders, one of which turned 255 into inf)."""
    from ds4lab_kernels import fp8_gemm, o_proj, sparse_mla
    for mod in (fp8_gemm, o_proj, sparse_mla):
        assert mod.ue8m0_to_fp32 is ue8m0_to_fp32, mod.__name__
    assert not hasattr(fp8_gemm, "_ue8m0_decode")


def test_byte_255_is_nan_through_the_gemm():
    """A 255 activation scale makes its row NaN in fp8_gemm_nt (uint8 and packed int32 layouts)."""
    from ds4lab_kernels.fp8_gemm import fp8_gemm_nt
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(2, 256, generator=g) * 10).to(torch.float8_e4m3fn)
    b = (torch.randn(64, 256, generator=g) * 10).to(torch.float8_e4m3fn)
    sa = torch.full((2, 2), 127, dtype=torch.uint8)
    sa[1, 1] = 255
    sb = torch.full((1, 2), 127, dtype=torch.uint8)
    packed = (sa[:, 0].int() | (sa[:, 1].int() << 8))[:, None]
    for scale in (sa, packed):
        out = fp8_gemm_nt(a.to(DEVICE), scale.to(DEVICE), b.to(DEVICE), sb.to(DEVICE)).float().cpu()
        assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()
