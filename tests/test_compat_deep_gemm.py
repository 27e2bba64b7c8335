"""ds4lab_kernels.compat.deep_gemm at the DeepGEMM API boundary (the calls vLLM 0.32's
vllm/utils/deep_gemm.py wrappers make), on the interpreter, against ds4lab's references: scale
layouts as DeepGEMM's transform_sf_into_required_layout / get_mn_major_tma_aligned_(packed_ue8m0_)tensor
make them (MN-major, TMA-aligned, packed UE8M0), the grouped o-projection einsum, ragged and paged
indexer logits with next_n 1 and 2 and the 2-D context lengths vLLM passes, the mHC pre-norm GEMM, and
the refusals (NotImplementedError naming the argument)."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.specs import fp8_gemm as gemm_spec
from ds4lab.harness.specs import indexer as idx_spec
from ds4lab.harness.specs import mhc as mhc_spec
from ds4lab.harness.specs import o_proj as o_spec
from ds4lab.reference import fp8_gemm as R_gemm
from ds4lab.reference import indexer as R_idx
from ds4lab.reference import mhc as R_mhc
from ds4lab.reference import o_proj as R_o
from ds4lab_kernels.compat import deep_gemm as dg

pytestmark = pytest.mark.interp


def _seed():
    return torch.randint(0, 2**31, (1,)).item()


def test_layout_helpers_match_deepgemm_layouts():
    sf = torch.rand(37, 5) + 0.5
    t = dg.get_mn_major_tma_aligned_tensor(sf)
    assert torch.equal(t, sf) and t.stride() == (1, 40)               # 37 rounded up to 16 B of fp32
    assert dg.get_mn_major_tma_aligned_tensor(t) is t
    g3 = dg.get_mn_major_tma_aligned_tensor(torch.rand(3, 6, 2))
    assert g3.stride() == (16, 1, 8)
    p2 = torch.exp2(torch.randint(-20, 5, (9, 6)).float())
    pk = dg.get_mn_major_tma_aligned_packed_ue8m0_tensor(p2)
    assert pk.dtype == torch.int32 and pk.shape == (9, 2) and pk.stride() == (1, 12)
    from ds4lab.reference.quant import unpack_ue8m0, decode_ue8m0
    assert torch.equal(decode_ue8m0(unpack_ue8m0(pk.contiguous(), 6)), p2)
    # transform: SM90 semantics (fp32 stays fp32; 1x128 -> MN-major TMA-aligned; 128x128 unchanged)
    sfa = torch.rand(70, 4)
    out = dg.transform_sf_into_required_layout(sfa, 70, 512, (1, 128, 128), is_sfa=True)
    assert torch.equal(out, sfa) and out.stride() == (1, 72)
    sfb = torch.rand(3, 4)
    assert dg.transform_sf_into_required_layout(sfb, 300, 512, (1, 128, 128), is_sfa=False) is sfb
    with pytest.raises(NotImplementedError, match="recipe"):
        dg.transform_sf_into_required_layout(sfb, 300, 512, (1, 1, 32))
    with pytest.raises(ValueError, match="sf: trailing shape"):
        dg.transform_sf_into_required_layout(sfb, 600, 512, (1, 128, 128))


@pytest.mark.parametrize("layout", ["fp32_mn_major", "packed_ue8m0_mn_major"])
def test_fp8_gemm_nt_scale_layouts(layout):
    M, N, K = 33, 200, 640
    fmt = "fp32" if layout == "fp32_mn_major" else "ue8m0"
    inp = gemm_spec.make_inputs({"M": M, "N": N, "K": K, "a_fmt": "pow2", "b_fmt": "pow2"}, seed=_seed(), device=DEVICE)
    sa, sb = inp["a_scale"], inp["b_scale"]                          # fp32 power-of-two
    if fmt == "fp32":
        sa_dg = dg.transform_sf_into_required_layout(sa, M, K, (1, 128, 128), is_sfa=True)
        sb_dg = dg.transform_sf_into_required_layout(sb, N, K, (1, 128, 128), is_sfa=False)
    else:                                                            # what SM100's transform makes
        sa_dg = dg.get_mn_major_tma_aligned_packed_ue8m0_tensor(sa)
        sb_dg = dg.get_mn_major_tma_aligned_packed_ue8m0_tensor(sb)
    assert sa_dg.stride(0) == 1
    d = torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)
    assert dg.fp8_gemm_nt((inp["a"], sa_dg), (inp["b"], sb_dg), d) is None
    r = R_gemm.fp8_gemm_nt(inp["a"], sa, inp["b"], sb)
    reps = gemm_spec.check(d, r, {**inp})
    assert all(reps), [str(x) for x in reps]
    # refusals: accumulation, fp32 out, other recipes, SM100 per-row packed weight scales
    with pytest.raises(NotImplementedError, match="c:"):
        dg.fp8_gemm_nt((inp["a"], sa_dg), (inp["b"], sb_dg), d, c=d)
    with pytest.raises(NotImplementedError, match="d: float32"):
        dg.fp8_gemm_nt((inp["a"], sa_dg), (inp["b"], sb_dg), d.float())
    with pytest.raises(NotImplementedError, match="recipe"):
        dg.fp8_gemm_nt((inp["a"], sa_dg), (inp["b"], sb_dg), d, recipe=(1, 1, 128))
    per_row = dg.get_mn_major_tma_aligned_packed_ue8m0_tensor(sb.repeat_interleave(128, 0)[:N])
    with pytest.raises(NotImplementedError, match="sfb"):
        dg.fp8_gemm_nt((inp["a"], sa_dg), (inp["b"], per_row), d)


@pytest.mark.parametrize("case", ["random", "strided"])
def test_fp8_einsum_o_proj(case):
    inp = o_spec.einsum_inputs({"T": 5, "G": 2, "N": 256, "K": 512, "x_fmt": "fp32", "w_fmt": "fp32"}, case,
                               seed=_seed(), device=DEVICE)
    z = torch.empty(5, 2, 256, dtype=torch.bfloat16, device=DEVICE)
    w2d = inp["wo_a"].reshape(-1, 512)                               # vLLM's 2-D wo_a.weight is accepted too
    assert dg.fp8_einsum("bhr,hdr->bhd", (inp["x"], inp["x_s"]), (w2d, inp["wo_a_s"]), z, recipe=(1, 128, 128)) is None
    assert all(o_spec.einsum_check(z, R_o.fp8_einsum_bhr_hdr_bhd(**inp), inp))
    with pytest.raises(NotImplementedError, match="expr"):
        dg.fp8_einsum("bhd,hdr->bhr", (inp["x"], inp["x_s"]), (inp["wo_a"], inp["wo_a_s"]), z)


def test_fp8_fp4_mqa_logits_ragged():
    inp = idx_spec.make_mqa_inputs({"M": 6, "N": 150, "H": 64}, "ragged", seed=_seed(), device=DEVICE)
    out = dg.fp8_fp4_mqa_logits((inp["q"], None), inp["kv"], inp["weights"], inp["cu_seqlen_ks"],
                                inp["cu_seqlen_ke"], clean_logits=True)
    assert all(idx_spec.check_logits(out, R_idx.fp8_mqa_logits(**inp), inp))
    with pytest.raises(NotImplementedError, match="FP4"):
        dg.fp8_fp4_mqa_logits((inp["q"], inp["weights"]), inp["kv"], inp["weights"], inp["cu_seqlen_ks"],
                              inp["cu_seqlen_ke"], clean_logits=False)


@pytest.mark.parametrize("next_n,case", [(1, "ctx_1d"), (2, "decode"), (2, "short_contexts")])
def test_fp8_fp4_paged_mqa_logits_next_n_and_2d_context_lens(next_n, case):
    inp = idx_spec.make_paged_inputs({"B": 3, "next_n": next_n, "ctx": 130, "H": 64}, case, seed=_seed(), device=DEVICE)
    cl = inp["context_lens"]
    assert cl.dim() == (1 if case == "ctx_1d" else 2)                # vLLM passes (B, next_n) for native MTP rows
    meta = dg.get_paged_mqa_logits_metadata(cl, 64, dg.get_num_sms())
    assert meta.shape == (dg.get_num_sms() + 1, 2) and meta.dtype == torch.int32
    kv4 = inp["kv_cache"].unsqueeze(2)                               # (num_blocks, 64, 1, 132) as vLLM passes it
    out = dg.fp8_fp4_paged_mqa_logits((inp["q"], None), kv4, inp["weights"], cl, inp["block_table"], meta,
                                      inp["max_context_len"], clean_logits=False)
    assert all(idx_spec.check_logits(out, R_idx.fp8_paged_mqa_logits(**inp), inp))
    with pytest.raises(NotImplementedError, match="indices"):
        dg.fp8_fp4_paged_mqa_logits((inp["q"], None), kv4, inp["weights"], cl, inp["block_table"], meta,
                                    inp["max_context_len"], indices=torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("num_splits", [None, 4])
def test_tf32_hc_prenorm_gemm(num_splits):
    inp = mhc_spec.make_inputs({"T": 3, "D": 256, "hc": 4}, seed=_seed(), device=DEVICE, kind="gemm")
    x, fn = inp["x"], inp["fn"]
    S = num_splits or 1
    shape_d = (x.shape[0], fn.shape[0]) if num_splits is None else (S, x.shape[0], fn.shape[0])
    d = torch.full(shape_d, float("nan"), device=DEVICE)
    sq = torch.full(shape_d[:-1], float("nan"), device=DEVICE)
    assert dg.tf32_hc_prenorm_gemm(x, fn, d, sq, num_splits) is None
    d3, s2 = (d[None], sq[None]) if num_splits is None else (d, sq)
    assert all(mhc_spec.check_gemm((d3, s2), R_mhc.hc_prenorm_gemm(x, fn, S), inp))
    with pytest.raises(ValueError, match="sqr_sum"):
        dg.tf32_hc_prenorm_gemm(x, fn, d, sq[..., :1], num_splits)


def test_sm_count_helpers():
    n = dg.get_num_sms()
    dg.set_num_sms(7)
    try:
        assert dg.get_num_sms() == 7
    finally:
        dg._NUM_SMS = None
    assert dg.get_num_sms() == n
    with pytest.raises(ValueError, match="num_sms"):
        dg.set_num_sms(0)
