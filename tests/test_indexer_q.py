"""Indexer q in one launch (``indexer.indexer_q_rope_quant``) beyond the registry sweep: bit for bit the
glue it replaces (torch fp32 RoPE + bf16 + ``per_token_group_quant_fp8(pow2, eps=1e-4)`` + the weight
product) on realistic and adversarial inputs (zero heads, values near the bf16 max, NaN / inf),
strided q, out-of-table positions (NaN, never a wrong angle), bad inputs; the backend's op."""
import pytest
import torch

from conftest import DEVICE, op_kinds
from ds4lab.harness.numerics import compare_exact
from ds4lab.harness.specs import indexer_q as SQ
from ds4lab_kernels.indexer import indexer_q_rope_quant

pytestmark = pytest.mark.interp
SHAPE = {"T": 3, "H": 8, "D": 128, "max_pos": 512}


def _same(a, b):
    return bool(compare_exact(a[0], b[0], "q")) and bool(compare_exact(a[1], b[1], "w"))


@pytest.mark.parametrize("case", SQ.Q_CASES)
def test_bit_identical_to_the_glue(case):
    inp = SQ.make_q_inputs(SHAPE, case, 3, DEVICE)
    out = indexer_q_rope_quant(**inp)
    assert _same(out, SQ.indexer_q_glue(**inp))
    if case == "zeros":   # zero heads: the 1e-4 floor, scale 2^-22 (1e-4/448 rounded up), q 0
        s = out[1].cpu() / (inp["weights"].float().cpu() * (128 ** -0.5 * 8 ** -0.5))
        assert (s[:, ::3] == 2.0 ** -22).all() and (out[0].cpu()[:, ::3].float() == 0).all()
    if case == "nonfinite":
        assert out[1].cpu()[0, 1].isnan() and out[1].cpu()[0, 3].isnan() and out[1].cpu()[-1, 2].isinf()


def test_strided_q_and_fp32_weights():
    inp = SQ.make_q_inputs(SHAPE, "random", 4, DEVICE)
    big = torch.zeros(3, 16, 128, dtype=torch.bfloat16, device=DEVICE)
    big[:, ::2] = inp["q"]
    q = big[:, ::2]                       # head stride 256: the launcher reads strides
    assert not q.is_contiguous()
    out = indexer_q_rope_quant(q, inp["positions"], inp["cos_sin"], inp["weights"].float())
    assert _same(out, SQ.indexer_q_glue(**inp))


def test_out_of_table_position_gives_nan_for_that_token_only():
    inp = SQ.make_q_inputs(SHAPE, "random", 5, DEVICE)
    pos = inp["positions"].clone()
    pos[1] = 512
    q8, w = indexer_q_rope_quant(inp["q"], pos, inp["cos_sin"], inp["weights"])
    assert w.cpu()[1].isnan().all() and not w.cpu()[[0, 2]].isnan().any()


def test_bad_inputs():
    inp = SQ.make_q_inputs(SHAPE, "random", 6, DEVICE)
    q, p, cs, w = inp["q"], inp["positions"], inp["cos_sin"], inp["weights"]
    with pytest.raises(TypeError, match="q"):
        indexer_q_rope_quant(q.float(), p, cs, w)
    with pytest.raises(ValueError, match="q"):
        indexer_q_rope_quant(q[..., :96], p, cs, w)
    with pytest.raises(ValueError, match="positions"):
        indexer_q_rope_quant(q, p[:2], cs, w)
    with pytest.raises(TypeError, match="cos_sin"):
        indexer_q_rope_quant(q, p, cs.double(), w)
    with pytest.raises(ValueError, match="cos_sin"):
        indexer_q_rope_quant(q, p, cs[:, :48].contiguous(), w)
    with pytest.raises(ValueError, match="weights"):
        indexer_q_rope_quant(q, p, cs, w[:, :4])
    with pytest.raises(TypeError, match="positions"):
        indexer_q_rope_quant(q, p.float(), cs, w)


def test_backend_indexer_q_is_one_kernel_and_matches_the_twin():
    from ds4lab.model.backend_kernel import KernelBackend
    from ds4lab.model.backend_ref import ReferenceBackend
    inp = SQ.make_q_inputs({"T": 2, "H": 64, "D": 128, "max_pos": 256}, "random", 7, DEVICE)
    # as the model passes them: column slices of the fused projections' outputs (no copies made)
    T = inp["q"].shape[0]
    wide_q = torch.zeros(T, 64 * 128 + 96, dtype=torch.bfloat16, device=DEVICE)
    wide_q[:, 32:32 + 64 * 128] = inp["q"].reshape(T, -1)
    wide_w = torch.zeros(T, 64 + 40, dtype=inp["weights"].dtype, device=DEVICE)
    wide_w[:, 40:] = inp["weights"]
    q_view, w_view = wide_q[:, 32:32 + 64 * 128].reshape(T, 64, 128), wide_w[:, 40:]
    assert not q_view.is_contiguous() and not w_view.is_contiguous()
    (q8, w), seen = op_kinds(KernelBackend().indexer_q, q_view, inp["positions"], inp["cos_sin"], w_view)
    assert seen == [("indexer.q_quant", "kernel:indexer.indexer_q_rope_quant")]
    assert _same((q8, w), SQ.indexer_q_glue(**inp))
    # the twin (float64 RoPE): e4m3 bytes within one step, weights equal where the scale agrees
    r8, rw = ReferenceBackend().indexer_q(*(inp[k].cpu() for k in ("q", "positions", "cos_sin", "weights")))
    d = (q8.cpu().view(torch.uint8).int() - r8.view(torch.uint8).int()).abs()
    assert (d <= 1).float().mean() > 0.999
    assert torch.allclose(w.cpu(), rw, rtol=1e-6, atol=0)
