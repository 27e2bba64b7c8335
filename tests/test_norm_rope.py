"""norm_rope family: the fused RMSNorm + RoPE and clamped SwiGLU launchers (interpreter lane).
Numerics over every case live in test_kernels_registry.py; here: the errors naming the argument,
the out-of-table position, and equality with the torch glue the kernel backend used to run."""
import pytest
import torch

from ds4lab.reference.rope import apply_rope, cos_sin_cache
from ds4lab_kernels.norm_rope import rmsnorm_rope, swiglu_clamp

pytestmark = pytest.mark.interp

CS = cos_sin_cache(32, 64, 10000.0)


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def test_q_norm_rope_matches_the_fp32_glue_it_replaced():
    q, pos = _x(3, 4, 512), torch.tensor([0, 7, 31], dtype=torch.int32)
    qf = q.float()
    glue = apply_rope(qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + 1e-6), pos, CS,
                      dtype=torch.float32).to(torch.bfloat16)
    out = rmsnorm_rope(q, None, 1e-6, pos, CS)
    # same fp32 math, one rounding: at most one bf16 ulp apart (the rsqrt is approximate)
    ulp = (glue.float().abs() * 2 ** -7).clamp_min(1e-30)
    assert ((out.float() - glue.float()).abs() <= ulp).all()
    # the NoPE dims are only normed; the rope dims moved
    assert not torch.equal(out[..., -64:], (qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + 1e-6)
                                            ).to(torch.bfloat16)[..., -64:])


def test_rope_at_position_zero_is_identity_and_outside_table_is_nan():
    x = _x(2, 512)
    out = rmsnorm_rope(x, None, 0.0, torch.tensor([0, 32]), CS, norm=False)
    assert torch.equal(out[0], x[0])
    assert torch.equal(out[1, :448], x[1, :448]) and out[1, 448:].isnan().all()


@pytest.mark.parametrize("kwargs,arg", [
    (dict(x=torch.zeros(2, 8)), "x"),
    (dict(x=_x(2, 4, 8, 8)), "x"),
    (dict(x=_x(8, 2).t()), "x"),
    (dict(x=_x(2, 8), weight=torch.ones(4, dtype=torch.bfloat16)), "weight"),
    (dict(x=_x(2, 8), weight=torch.ones(8, dtype=torch.bfloat16), norm=False, positions=torch.zeros(2, dtype=torch.int32),
          cos_sin=cos_sin_cache(4, 4, 10000.0)), "weight"),
    (dict(x=_x(2, 64), positions=torch.zeros(3, dtype=torch.int32), cos_sin=CS), "positions"),
    (dict(x=_x(2, 64), positions=torch.zeros(2)), "positions"),
    (dict(x=_x(2, 64), positions=torch.zeros(2, dtype=torch.int32)), "cos_sin"),
    (dict(x=_x(2, 32), positions=torch.zeros(2, dtype=torch.int32), cos_sin=CS), "cos_sin"),
    (dict(x=_x(2, 64), positions=torch.zeros(2, dtype=torch.int32), cos_sin=CS.double()), "cos_sin"),
    (dict(x=_x(2, 64), norm=False), "positions"),
    (dict(x=_x(2, 64), eps=-1.0), "eps"),
])
def test_rmsnorm_rope_errors_name_the_argument(kwargs, arg):
    with pytest.raises((TypeError, ValueError), match=arg):
        rmsnorm_rope(**kwargs)


@pytest.mark.parametrize("gu,limit,arg", [
    (torch.zeros(2, 8), 10.0, "gu"), (_x(2, 7), 10.0, "gu"), (_x(2, 8, 2), 10.0, "gu"),
    (_x(16, 4).t(), 10.0, "gu"), (_x(2, 8), 0.0, "limit"),
])
def test_swiglu_errors_name_the_argument(gu, limit, arg):
    with pytest.raises((TypeError, ValueError), match=arg):
        swiglu_clamp(gu, limit)


def test_swiglu_matches_the_torch_glue_it_replaced():
    gu = (_x(3, 2 * 700).float() * 9).to(torch.bfloat16)
    g, u = gu.float()[:, :700], gu.float()[:, 700:]
    glue = (torch.nn.functional.silu(g.clamp(max=10.0)) * u.clamp(-10.0, 10.0)).to(torch.bfloat16)
    out = swiglu_clamp(gu, 10.0)
    assert out.shape == (3, 700)
    ulp = (glue.float().abs() * 2 ** -7).clamp_min(1e-30)
    assert ((out.float() - glue.float()).abs() <= ulp).all()


def test_empty_inputs():
    assert rmsnorm_rope(_x(0, 64), None, 1e-6).shape == (0, 64)
    assert swiglu_clamp(_x(0, 8), 10.0).shape == (0, 4)


def test_rmsnorm_rope_reads_a_column_slice_of_a_wider_row():
    """q straight from the fused ``wq_b | indexer wq_b`` GEMM output: token stride != H*D."""
    wide, pos = _x(3, 3 * 512), torch.tensor([0, 5, 31], dtype=torch.int32)
    q = wide[:, 512:].reshape(3, 2, 512)
    assert not q.is_contiguous()
    assert torch.equal(rmsnorm_rope(q, None, 1e-6, pos, CS), rmsnorm_rope(q.contiguous(), None, 1e-6, pos, CS))


def test_q_kv_norm_rope_equals_the_three_launches_it_replaced():
    """q_norm, kv_norm (bf16 out) then kv rope, bit for bit, from a strided (T, q_dim + 512) row."""
    from ds4lab_kernels.norm_rope import q_kv_rmsnorm_rope
    big, pos = _x(4, 640 + 16), torch.tensor([0, 3, 17, 31], dtype=torch.int32)
    x = big[:, 16:]
    wq = (1 + 0.3 * _x(128).float()).to(torch.bfloat16)
    wkv = (1 + 0.3 * _x(512).float()).float()
    q, kv = q_kv_rmsnorm_rope(x, wq, wkv, 128, 1e-6, pos, CS)
    assert q.is_contiguous() and kv.is_contiguous()
    assert torch.equal(q, rmsnorm_rope(x[:, :128].contiguous(), wq, 1e-6))
    kv3 = rmsnorm_rope(rmsnorm_rope(x[:, 128:].contiguous(), wkv, 1e-6), None, 0.0, pos, CS, norm=False)
    assert torch.equal(kv, kv3)
    # position outside the table: NaN in that token's kv rope dims only
    q2, kv2 = q_kv_rmsnorm_rope(x, wq, wkv, 128, 1e-6, torch.tensor([0, 3, 17, 32]), CS)
    assert torch.equal(q2, q) and kv2[3, -64:].isnan().all() and torch.equal(kv2[:3], kv[:3])


_QX = _x(2, 640)
_W128, _W512 = torch.ones(128, dtype=torch.bfloat16), torch.ones(512, dtype=torch.bfloat16)
_P2 = torch.zeros(2, dtype=torch.int32)


@pytest.mark.parametrize("kwargs,arg", [
    (dict(x=_QX.float()), "x"),
    (dict(x=_QX[None]), "x"),
    (dict(x=_x(640, 2).t()), "x"),
    (dict(q_dim=640), "q_dim"),
    (dict(q_dim=0), "q_dim"),
    (dict(q_dim=128.0), "q_dim"),
    (dict(q_weight=_W512), "q_weight"),
    (dict(kv_weight=_W128), "kv_weight"),
    (dict(kv_weight=_W512.int()), "kv_weight"),
    (dict(positions=torch.zeros(3, dtype=torch.int32)), "positions"),
    (dict(positions=torch.zeros(2)), "positions"),
    (dict(cos_sin=CS.double()), "cos_sin"),
    (dict(cos_sin=cos_sin_cache(4, 48, 10000.0)), "cos_sin"),
    (dict(eps=-1.0), "eps"),
])
def test_q_kv_norm_rope_errors_name_the_argument(kwargs, arg):
    from ds4lab_kernels.norm_rope import q_kv_rmsnorm_rope
    a = dict(x=_QX, q_weight=_W128, kv_weight=_W512, q_dim=128, eps=1e-6, positions=_P2, cos_sin=CS)
    a.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=arg):
        q_kv_rmsnorm_rope(**a)
