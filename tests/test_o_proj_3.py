"""o_proj in 3 launches (issue 20, ``path="unfused3"``): inverse RoPE + quant, the grouped wo_a
product with its split-K summed in the launch and z quantized in the epilogue (or kept bf16 for the
fused-quant wo_b), then wo_b. Numerics on the o_proj spec's adversarial cases, the epilogue's bits
against the standalone kernels, determinism, counters left at zero, launches per call, and the
chunk-grid inverse RoPE byte for byte."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare, compare_exact
from ds4lab.harness.specs import o_proj as spec
from ds4lab.reference import o_proj as ref
from ds4lab_kernels import o_proj as K

pytestmark = pytest.mark.interp

LABELS = K.UNFUSED3_LABELS


def _oproj(T, H, case="random", seed=0, **kw):
    return spec.o_proj_inputs({"T": T, "H": H, "R": 128, "N": 128, "path": "fp8", **kw}, case, seed, DEVICE)


@pytest.mark.parametrize("label,case,fmt,w_fmt", [
    ("unfused3", "outlier_head", "ue8m0", "fp32"),
    ("unfused3_s8", "cache_end", "fp32", "ue8m0"),
    ("unfused3_zbf16", "zero_rows", "pow2", "ue8m0"),
    ("unfused3_zbf16", "outlier_head", "fp32", "fp32"),   # fp32 scales: z quantized in the epilogue instead
])
def test_unfused3_rows_match_the_reference(label, case, fmt, w_fmt):
    """The table's own GPU rows (16x128 tiles, split 16, chunk-grid RoPE, fp8_gemm's decode_16x64)
    on the o_proj spec's adversarial cases, every scale encoding of z and of the weights."""
    inp = _oproj(3, 8, case, seed=11, scale_fmt=fmt, w_fmt=w_fmt)
    out = K.o_proj(**inp, config=K.CONFIGS["sm_89"][label])
    assert out.shape == (3, 128) and out.dtype == torch.bfloat16
    assert compare(out, ref.o_proj(**inp), "bfloat16")


def _x_and_weights(T=3, H=8, case="nan_rows", fmt="ue8m0", seed=3):
    r = spec.rope_inputs({"T": T, "H": H, "scale_fmt": fmt}, case, seed, DEVICE)
    x, xs = K.inv_rope_fp8_quant(**r)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w, ws = spec.block_quant_weight(torch.randn(H // 8, 128, 4096, generator=g, device=DEVICE) / 64.0,
                                    "ue8m0" if fmt == "ue8m0" else "fp32")
    return x, xs, w, ws


@pytest.mark.parametrize("fmt,split", [("ue8m0", 4), ("fp32", 8)])
def test_epilogue_z_quant_is_per_token_group_quant_of_its_bf16_z(fmt, split):
    """Launch 2's last-arriving split sums the fp32 partials in split order, rounds z to bf16 and
    quantizes it: the fp8 bytes and scales equal ``per_token_group_quant_fp8`` of that bf16 z (today's
    quant launch) bit for bit, and z equals the parts' einsum + ``_splitk_reduce_kernel`` at the same
    split (same partial sums, same order) within the bf16 budget (bit for bit on the interpreter)."""
    from ds4lab_kernels.fp8_quant import per_token_group_quant_fp8
    x, xs, w, ws = _x_and_weights(fmt=fmt)
    T, G, Kd = x.shape
    R = w.shape[1]
    cfg = {**K.CONFIGS["sm_89"]["unfused3"]["wo_a"], "SPLIT_K": split}
    z = torch.empty(T, G, R, dtype=torch.bfloat16, device=DEVICE)
    zq = torch.empty(T, G, R, dtype=torch.float8_e4m3fn, device=DEVICE)
    zs = torch.empty(T, G, R // 128, dtype=torch.uint8 if fmt == "ue8m0" else torch.float32, device=DEVICE)
    K._fused_gemm(0, x, xs, w, ws, T, G, R, Kd, cfg, out=z, q=zq, qs=zs, pow2=fmt != "fp32")
    rq, rs = per_token_group_quant_fp8(z.view(T, -1), 128, scale_fmt=fmt)
    assert compare_exact(zq.view(T, -1), rq, "z fp8 bytes") and compare_exact(zs.view(T, -1), rs, "z scales")
    parts = K.fp8_einsum_bhr_hdr_bhd(x, xs, w, ws, config={**K.CONFIGS["sm_89"]["decode"], "BLOCK_N": 128,
                                                           "SPLIT_K": split})
    if DEVICE == "cpu":
        assert compare_exact(z, parts, "z (in-launch reduce vs reduce kernel)")
    finite = ~torch.isnan(parts.float()).any(-1)
    assert torch.equal(torch.isnan(z.float()).any(-1), ~finite)   # the NaN/inf rows of nan_rows stay NaN
    assert compare(z[finite], ref.fp8_einsum_bhr_hdr_bhd(x, xs, w, ws)[finite], "bfloat16")


def test_deterministic_and_counters_left_at_zero():
    """Two calls give the same bits, and every split-K tile counter (o_proj's and fp8_gemm's) is back
    at 0 after a call: the next launch, or a CUDA-graph replay, starts from zero with no memset."""
    from ds4lab_kernels.fp8_gemm import splitk_counters
    dev = torch.device(DEVICE)
    inp = _oproj(1, 8, "outlier_head", seed=5)
    for label in ("unfused3", "unfused3_zbf16"):
        cfg = K.CONFIGS["sm_89"][label]
        a = K.o_proj(**inp, config=cfg)
        b = K.o_proj(**inp, config=cfg)
        assert torch.equal(a, b), label
        assert int(K._counters(dev, 1).abs().sum()) == 0, label
        assert int(splitk_counters(dev, 1).abs().sum()) == 0, label


@pytest.mark.parametrize("label,kernels", [
    ("unfused3", ["_inv_rope_quant_kernel", "_fused_gemm_kernel", "_fp8_gemm_nt_kernel"]),
    ("unfused3_zbf16", ["_inv_rope_quant_kernel", "_fused_gemm_kernel", "_fp8_gemm_nt_kernel"]),
    ("unfused", ["_inv_rope_quant_kernel", "_grouped_gemm_kernel", "_splitk_reduce_kernel",
                 "_per_token_group_quant_fp8_kernel", "_fp8_gemm_nt_kernel"]),
])
def test_launches_per_call(label, kernels, monkeypatch):
    """The kernels one call launches, in order (T=1, one group of 8 heads): 3 for the unfused3 rows (no reduce
    kernel, no z quant kernel), 5 for today's parts."""
    from triton.runtime.interpreter import InterpretedFunction
    import triton.runtime.jit as jit
    launched = []
    if DEVICE == "cpu":
        orig = InterpretedFunction.run

        def run(self, *a, **kw):
            launched.append(self.fn.__name__)
            return orig(self, *a, **kw)
        monkeypatch.setattr(InterpretedFunction, "run", run)
    else:
        orig = jit.JITFunction.run

        def run(self, *a, **kw):
            launched.append(self.fn.__name__)
            return orig(self, *a, **kw)
        monkeypatch.setattr(jit.JITFunction, "run", run)
    inp = _oproj(1, 8, seed=2)
    K.o_proj(**inp, config=K.CONFIGS["sm_89"][label])
    assert launched == kernels


@pytest.mark.parametrize("case,fmt,T,H", [("nan_rows", "fp32", 2, 8), ("outliers", "ue8m0", 1, 16),
                                          ("cache_end", "pow2", 2, 8)])
def test_chunk_grid_inv_rope_is_byte_exact(case, fmt, T, H):
    """``rope_chunk`` (one 128-wide chunk per 1-warp program, the rope branch a runtime one) gives the
    reference's fp8 bytes and scales exactly, as the 4-chunk programs do."""
    r = spec.rope_inputs({"T": T, "H": H, "scale_fmt": fmt}, case, 7, DEVICE)
    q, s = K.inv_rope_fp8_quant(**r, config=K.CONFIGS["sm_89"]["rope_chunk"])
    rq, rs = ref.inv_rope_fp8_quant(**r)
    assert compare_exact(q, rq, "q") and compare_exact(s, rs, "scales")
    b = K.inv_rope_fp8_quant(**{**r, "quantize": False}, config=K.CONFIGS["sm_89"]["rope_chunk"])
    assert compare_exact(b, ref.inv_rope_fp8_quant(**{**r, "quantize": False}), "rotated bf16")


def test_defaults_bad_configs_and_empty():
    """``path="unfused3"`` alone takes ``unfused3_config``; a bad quant_z or tile raises naming the
    config; T=0 returns an empty output; the rule's labels exist in every table."""
    inp = _oproj(2, 8, seed=9)
    assert compare(K.o_proj(**inp, config={"path": "unfused3"}), ref.o_proj(**inp), "bfloat16")
    with pytest.raises(ValueError, match="quant_z='z'"):
        K.o_proj(**inp, config={"path": "unfused3", "quant_z": "z"})
    with pytest.raises(ValueError, match="BLOCK_N=128"):
        K.o_proj(**inp, config={"path": "unfused3", "wo_a": {**K.CONFIGS["sm_89"]["unfused3"]["wo_a"],
                                                               "BLOCK_N": 64}})
    e = {**inp, "o": inp["o"][:0], "positions": inp["positions"][:0]}
    assert K.o_proj(**e, config={"path": "unfused3"}).shape == (0, 128)
    for t in K.CONFIGS.values():
        assert all(t[lab]["path"] == "unfused3" for lab in LABELS)
        assert t["unfused3"]["wo_b_fp8"]["BLOCK_N"] == 64
    assert set(K.DECODE_DEFAULT.values()) <= set(K.OPROJ_LABELS)
    for a, t in K.CONFIGS.items():   # the compile report's sm_120 rows: what the pickers can return
        assert K.DECODE_DEFAULT[a] in K.GPU_DEFAULTS[a] and set(K.GPU_DEFAULTS[a]) <= set(t)


def test_wo_b_takes_the_gemm_pick_at_small_t(monkeypatch):
    """wo_b's launch row (gemv9): fp8_gemm's own pick (None) up to ``WO_B_PICK_MAX_T`` tokens on a GPU, the
    row's ``wo_b_fp8`` above, on the interpreter, and where the row pins ``wo_b_pick_max_t``."""
    row = K.CONFIGS["sm_89"]["unfused3_s8"]
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert K._wo_b_row(row, 1, gpu) is None and K._wo_b_row(row, K.WO_B_PICK_MAX_T, gpu) is None
    assert K._wo_b_row(row, K.WO_B_PICK_MAX_T + 1, gpu) is row["wo_b_fp8"]
    assert K._wo_b_row(row, 1, cpu) is row["wo_b_fp8"]
    assert K._wo_b_row({**row, "wo_b_pick_max_t": 0}, 1, gpu) is row["wo_b_fp8"]
    monkeypatch.setattr(K, "WO_B_PICK_MAX_T", 0)
    assert K._wo_b_row(row, 1, gpu) is row["wo_b_fp8"]


def test_bench_config_filter(monkeypatch):
    """``DS4LAB_OPROJ_BENCH_CONFIGS`` keeps only the named decode candidates (scripts/gpu/oproj.sh);
    an unknown label raises naming the variable."""
    from ds4lab.harness.registry import get
    s = get("o_proj")
    shape = {"T": 1, "path": "fp8"}
    assert s.config_for("sm_89", shape) == list(K.OPROJ_LABELS)
    monkeypatch.setenv("DS4LAB_OPROJ_BENCH_CONFIGS", "unfused3_zbf16,unfused")
    assert s.config_for("sm_89", shape) == ["unfused3_zbf16", "unfused"]
    assert s.config_for("sm_89", {"T": 4096, "path": "fp8"}) == ["prefill"]
    monkeypatch.setenv("DS4LAB_OPROJ_BENCH_CONFIGS", "fused_s8")
    with pytest.raises(ValueError, match="DS4LAB_OPROJ_BENCH_CONFIGS"):
        s.config_for("sm_89", shape)


@pytest.mark.parametrize("arch,cap", [("sm_89", (8, 9)), ("sm_90", (9, 0))])
def test_gpu_defaults_are_what_the_pickers_return(monkeypatch, arch, cap):
    """``GPU_DEFAULTS`` (the rows the compile report builds for sm_120) == the labels the o_proj pickers
    return on a GPU of that table over sizes that cross every threshold (plus the o_proj spec's
    ``prefill`` row, the parts above FUSED_MAX_T)."""
    from ds4lab_kernels import _arch
    monkeypatch.setattr(_arch, "target", lambda device: None if device.type != "cuda" else (10 * cap[0] + cap[1],
                                                                                           _arch.SMEM_LIMIT[arch]))
    monkeypatch.setitem(_arch._SMS, 0, 128)
    dev = torch.device("cuda", 0)
    table = K.CONFIGS[arch]
    cfgs = ([K._pick_rope_config(n, dev) for n in (16, 1024, 1025, 10**5)]
            + [K.pick_einsum_config(t, dev) for t in (1, K.DECODE_MAX_T, K.DECODE_MAX_T + 1)]
            + [K.pick_o_proj_config(t, dev) for t in (1, K.DECODE_DEFAULT_MAX_T)])
    got = {next(lb for lb, c in table.items() if c is cfg) for cfg in cfgs}
    assert K.pick_o_proj_config(K.FUSED_MAX_T + 1, dev) == {"path": "unfused"}
    assert K.pick_o_proj_config(K.DECODE_DEFAULT_MAX_T + 1, dev) == {"path": "unfused"}   # untimed above 32
    assert got | {"unfused"} == set(K.GPU_DEFAULTS[arch]), got
