"""Producer quant (issue 20, ``pq``): ``q_kv_rmsnorm_rope(q_fp8=True)`` writes the q rows' 1x128 FP8
copy byte for byte as ``per_token_group_quant_fp8(q, 128, "ue8m0")`` (the quant the FP8 linear's
prologue runs), and the kernel backend's ``wq_b`` on that copy (``fp8_gemm_nt``) equals the fused-quant
linear on the bf16 q bit for bit (interpreter lane)."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.model.cache import mla_block_bytes
from ds4lab.reference.rope import cos_sin_cache
from ds4lab_kernels.fp8_quant import per_token_group_quant_fp8
from ds4lab_kernels.norm_rope import q_kv_rmsnorm_rope

pytestmark = pytest.mark.interp

CS = cos_sin_cache(64, 64, 10000.0)


def _inputs(T, q_dim, case, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, q_dim + 512, generator=g)
    if case == "huge":                       # 1e4-magnitude rows with a few outliers
        x = x * 1e4
        x[:, 5] = 3e4
    elif case == "zero_group":               # a whole 128-group of zeros (the eps floor): zero bytes
        x[:, 128:256] = 0.0
    elif case == "tiny":                     # values below the least e4m3 subnormal after scaling
        x[:, :q_dim] *= 1e-30
        x[:, 0] = 1.0
    elif case == "midpoints":                # e4m3 rounding midpoints after the pow2 scale
        x[:, :q_dim] = (torch.arange(q_dim) % 16 + 0.5).float() * 0.0625 * (1 + (torch.arange(q_dim) % 3))
    wq = (1 + 0.3 * torch.randn(q_dim, generator=g)).to(torch.bfloat16)
    wkv = (1 + 0.3 * torch.randn(512, generator=g)).to(torch.bfloat16)
    pos = torch.randint(0, CS.shape[0], (T,), generator=g, dtype=torch.int32)
    return x.to(torch.bfloat16).to(DEVICE), wq.to(DEVICE), wkv.to(DEVICE), pos.to(DEVICE)


@pytest.mark.parametrize("T,q_dim", [(1, 1024), (3, 1536), (2, 128), (5, 256)])
@pytest.mark.parametrize("case", ["random", "huge", "zero_group", "tiny", "midpoints"])
def test_q_fp8_copy_is_the_linear_prologue_quant_byte_for_byte(T, q_dim, case):
    x, wq, wkv, pos = _inputs(T, q_dim, case, 7 + T)
    q0, kv0 = q_kv_rmsnorm_rope(x, wq, wkv, q_dim, 1e-6, pos, CS.to(DEVICE))
    (q, q8, qs), kv = q_kv_rmsnorm_rope(x, wq, wkv, q_dim, 1e-6, pos, CS.to(DEVICE), q_fp8=True)
    assert torch.equal(q, q0) and torch.equal(kv, kv0)           # the bf16 outputs unchanged
    r8, rs = per_token_group_quant_fp8(q0, 128, scale_fmt="ue8m0")
    assert q8.dtype == torch.float8_e4m3fn and qs.dtype == torch.uint8
    assert q8.shape == (T, q_dim) and qs.shape == (T, q_dim // 128)
    assert torch.equal(q8.view(torch.uint8), r8.view(torch.uint8))
    assert torch.equal(qs, rs)


def test_q_fp8_nan_row_gets_the_nan_scale_byte():
    x, wq, wkv, pos = _inputs(2, 256, "random", 3)
    x[1, 200] = float("nan")                                       # token 1's second q group
    (q, q8, qs), _ = q_kv_rmsnorm_rope(x, wq, wkv, 256, 1e-6, pos, CS.to(DEVICE), q_fp8=True)
    r8, rs = per_token_group_quant_fp8(q, 128, scale_fmt="ue8m0")
    assert torch.equal(qs, rs) and qs[1].tolist() == [255, 255]    # the norm spreads the NaN over the row
    assert torch.equal(q8[0].view(torch.uint8), r8[0].view(torch.uint8))


def test_q_fp8_with_the_swa_insert_and_empty_batch():
    x, wq, wkv, pos = _inputs(3, 1024, "random", 5)
    cache = torch.zeros(2, mla_block_bytes(64), dtype=torch.uint8, device=DEVICE)
    slots = torch.tensor([0, 65, 7], dtype=torch.int32, device=DEVICE)
    c0, c1 = cache.clone(), cache.clone()
    q0 = q_kv_rmsnorm_rope(x, wq, wkv, 1024, 1e-6, pos, CS.to(DEVICE), kv_cache=c0, slot_mapping=slots)
    q, q8, qs = q_kv_rmsnorm_rope(x, wq, wkv, 1024, 1e-6, pos, CS.to(DEVICE), kv_cache=c1, slot_mapping=slots,
                                  q_fp8=True)
    assert torch.equal(q, q0) and torch.equal(c0, c1)
    r8, rs = per_token_group_quant_fp8(q0, 128, scale_fmt="ue8m0")
    assert torch.equal(q8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(qs, rs)
    (q, q8, qs), kv = q_kv_rmsnorm_rope(x[:0], wq, wkv, 1024, 1e-6, pos[:0], CS.to(DEVICE), q_fp8=True)
    assert q8.shape == (0, 1024) and qs.shape == (0, 8) and kv.shape == (0, 512)


@pytest.mark.parametrize("q_dim,q_fp8,err,arg", [(192, True, ValueError, "q_fp8"), (128, 1, TypeError, "q_fp8")])
def test_q_fp8_errors_name_the_argument(q_dim, q_fp8, err, arg):
    x, wq, wkv, pos = _inputs(2, q_dim, "random", 1)
    with pytest.raises(err, match=arg):
        q_kv_rmsnorm_rope(x, wq, wkv, q_dim, 1e-6, pos, CS.to(DEVICE), q_fp8=q_fp8)


@pytest.mark.parametrize("T", [1, 2, 5])
def test_backend_linear_on_the_copy_equals_the_fused_quant_linear(T):
    """The backend's wq_b on the producer's FP8 copy == the fused-quant linear on the bf16 q (bit for bit:
    the same quant bytes, the same GEMM tiles), and the op group says which ran."""
    from ds4lab.model import backend_kernel as bk
    from ds4lab.model.ops import Linear
    g = torch.Generator().manual_seed(T)
    w8 = (torch.randn(256, 1024, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.randint(118, 126, (2, 8), generator=g, dtype=torch.uint8)   # UE8M0 per 128x128 block
    lin = Linear(w8.to(DEVICE), ws.to(DEVICE))
    x, wq, wkv, pos = _inputs(T, 1024, "random", 11)
    be = bk.KernelBackend()
    q = be.q_kv_norm_rope(x, 1024, wq, wkv, 1e-6, pos, CS.to(DEVICE),
                          swa_cache=torch.zeros(1, mla_block_bytes(64), dtype=torch.uint8, device=DEVICE),
                          swa_slots=torch.full((T,), -1, dtype=torch.int32, device=DEVICE))
    assert getattr(q, bk.FP8_COPY, None) is not None               # PRODUCER_QUANT_INTERP is on
    y = be.linear(q, lin, "attn.wq_b")
    plain = q.clone()                                              # no copy: the fused-quant launch
    assert getattr(plain, bk.FP8_COPY, None) is None
    assert torch.equal(y, be.linear(plain, lin, "attn.wq_b"))
