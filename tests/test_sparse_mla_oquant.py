"""ofuse (issue 20): sparse MLA decode writing o_proj's fp8 input (``sparse_mla_decode(o_fp8=True)``: the merge
epilogue rounds o to bf16, rotates its rope dims back and quantizes 1x128) and the 2-launch o_proj on it
(``o_proj_fp8_input``). Every output is compared BIT FOR BIT with the unfused pair it replaces:
``inv_rope_fp8_quant(sparse_mla_decode(...), check_positions=False)`` and ``o_proj(path="unfused3")``, on the
sparse MLA spec's adversarial cases, large magnitudes, positions at 0 / the table's last row / outside it,
T = 1..32, heads_per_group 4 (tiny config) and 8 (DeepSeek-V4), every scale encoding, the one-split fallback;
plus the kernels per call, the bad inputs, and the model backend's switch."""
import pytest
import torch

from conftest import DEVICE, op_kinds
from ds4lab.harness.specs import o_proj as oproj_spec
from ds4lab.harness.specs.sparse_mla import CASES, Q_NORM_MAX_POS, _cache, make_decode_inputs
from ds4lab.reference.rope import cos_sin_cache
from ds4lab_kernels import o_proj as OP
from ds4lab_kernels.sparse_mla import CONFIGS, sparse_mla_decode

pytestmark = pytest.mark.interp

SPLIT3 = {**CONFIGS["sm_89"]["h16n16"], "SPLITS": 3}        # the merge runs (the decode path)
T1ROW = {**CONFIGS["sm_89"]["h16n16m1"], "SPLITS": 4}       # the T=1 row's merge tiles (MERGE_SB 16)


def _table():
    return cos_sin_cache(Q_NORM_MAX_POS, 64, 160000.0, 16.0, 65536).to(DEVICE)


def _positions(T, g, extra=()):
    p = torch.randint(0, Q_NORM_MAX_POS, (T,), generator=g, dtype=torch.int64)
    p[0] = Q_NORM_MAX_POS - 1
    if T > 1:
        p[1] = 0
    for i, v in extra:
        if i < T:
            p[i] = v
    return p.to(DEVICE)


def _unfused(inp, pos, cs, hpg, fmt, config):
    """The pair the fused mode replaces: bf16 o, then inv_rope_fp8_quant without the host check."""
    o = sparse_mla_decode(**inp, config=config)
    return OP.inv_rope_fp8_quant(o, pos, cs, hpg, True, fmt, check_positions=False)


def _same(fused, unfused):
    (x, xs), (x2, xs2) = fused, unfused
    assert x.dtype == x2.dtype == torch.float8_e4m3fn and x.shape == x2.shape and x.is_contiguous()
    assert xs.dtype == xs2.dtype and xs.shape == xs2.shape and xs.is_contiguous()
    assert torch.equal(x.view(torch.uint8), x2.view(torch.uint8)), "x bytes differ"
    assert torch.equal(xs.view(torch.uint8), xs2.view(torch.uint8)), "x_s bytes differ"


def _inputs(shape, case, seed, pos_extra=()):
    inp = make_decode_inputs(shape, case, seed, DEVICE)
    g = torch.Generator().manual_seed(seed + 1)
    if "positions" not in inp:   # with q_norm the table and positions are the q norm's (one table a launch)
        inp["positions"], inp["cos_sin"] = _positions(shape["T"], g, pos_extra), _table()
    return inp


@pytest.mark.parametrize("case", CASES)
def test_bit_identical_on_the_spec_cases(case):
    """Every adversarial case of the sparse MLA spec (empty candidate lists, all -1, one candidate,
    peaked scores, sink +30 / -inf, scattered and out-of-cache slots, boundary lengths), C128A shape,
    T=3, 16 heads (TP=4), heads_per_group 8, UE8M0 scales (the model's)."""
    inp = _inputs({"T": 3, "H": 16, "W": 20, "Kc": 37, "comp_bs": 2}, case, 5)
    pos, cs = inp.pop("positions"), inp.pop("cos_sin")
    fused = sparse_mla_decode(**inp, config=SPLIT3, o_fp8=True, positions=pos, cos_sin=cs)
    _same(fused, _unfused(inp, pos, cs, 8, "ue8m0", SPLIT3))


@pytest.mark.parametrize("T,H,hpg,fmt,Kc,cfg", [
    (1, 16, 8, "ue8m0", 37, T1ROW),      # the T=1 decode row (16 x 2 x 128 merge tiles)
    (2, 8, 4, "pow2", 0, SPLIT3),        # the tiny config's heads (8, 2 groups of 4), SWA-only
    (5, 16, 4, "fp32", 37, None),        # the launcher's own pick (h16n16 at T > 2), fp32 scales
    (32, 16, 8, "ue8m0", 0, None),       # the decode step's largest T (batch 16 x MTP), SWA-only
])
def test_bit_identical_sizes_heads_per_group_and_scale_formats(T, H, hpg, fmt, Kc, cfg):
    inp = _inputs({"T": T, "H": H, "W": 20, "Kc": Kc, "comp_bs": 64}, "random", T)
    pos, cs = inp.pop("positions"), inp.pop("cos_sin")
    fused = sparse_mla_decode(**inp, config=cfg, o_fp8=True, positions=pos, cos_sin=cs, heads_per_group=hpg,
                              scale_fmt=fmt)
    assert fused[0].shape == (T, H // hpg, hpg * 512) and fused[1].shape == (T, H // hpg, hpg * 4)
    _same(fused, _unfused(inp, pos, cs, hpg, fmt, cfg))


def test_positions_at_the_table_ends_and_outside_give_nan_like_inv_rope():
    """Positions 0 and max_pos-1 rotate like the standalone kernel; -1 and max_pos (outside the table,
    check_positions=False) give that token NaN values and NaN scales (255 in UE8M0) in both."""
    inp = _inputs({"T": 4, "H": 16, "W": 20, "Kc": 37, "comp_bs": 2}, "random", 9,
                  pos_extra=((2, -1), (3, Q_NORM_MAX_POS)))
    pos, cs = inp.pop("positions"), inp.pop("cos_sin")
    for fmt in ("ue8m0", "fp32"):
        fused = sparse_mla_decode(**inp, config=SPLIT3, o_fp8=True, positions=pos, cos_sin=cs, scale_fmt=fmt)
        _same(fused, _unfused(inp, pos, cs, 8, fmt, SPLIT3))
        x, xs = fused
        assert torch.isnan(x[2:].float()).all() and not torch.isnan(x[:2].float()).any()
        assert (xs[2:] == 255).all() if fmt == "ue8m0" else torch.isnan(xs[2:]).all()


def test_large_magnitudes():
    """Latents scaled by 2^100 (o ~ 1e30; its UE8M0 scales near the top of the range) and 2^-100."""
    from ds4lab.reference.mla_cache import fp8_ds_mla_insert
    from ds4lab.harness.specs.mla_cache import block_bytes
    for mag in (2.0 ** 100, 2.0 ** -100):
        inp = _inputs({"T": 2, "H": 16, "W": 20, "Kc": 0}, "random", 3)
        g = torch.Generator().manual_seed(4)
        n = inp["swa_cache"].shape[0] * 64
        kv = (torch.randn(n, 512, generator=g) * mag).to(torch.bfloat16)
        inp["swa_cache"] = fp8_ds_mla_insert(kv, torch.arange(n), torch.zeros((n // 64, block_bytes(64)),
                                             dtype=torch.uint8), 64).to(DEVICE)
        pos, cs = inp.pop("positions"), inp.pop("cos_sin")
        fused = sparse_mla_decode(**inp, config=SPLIT3, o_fp8=True, positions=pos, cos_sin=cs)
        _same(fused, _unfused(inp, pos, cs, 8, "ue8m0", SPLIT3))
        assert torch.isfinite(fused[0].float()).all()


def test_with_the_fused_q_norm_and_return_lse():
    """``q_norm_eps`` (qmla6) and ``o_fp8`` together share positions and table; the LSE comes back third."""
    inp = _inputs({"T": 2, "H": 16, "W": 20, "Kc": 37, "comp_bs": 64, "q_norm": 1}, "peaked", 6)
    pos, cs = inp["positions"], inp["cos_sin"]
    x, xs, lse = sparse_mla_decode(**inp, config=SPLIT3, o_fp8=True, return_lse=True)
    o, lse2 = sparse_mla_decode(**inp, config=SPLIT3, return_lse=True)
    _same((x, xs), OP.inv_rope_fp8_quant(o, pos, cs, 8, True, "ue8m0", check_positions=False))
    assert torch.equal(lse, lse2)


def _launched(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction
    import triton.runtime.jit as jit
    names = []
    cls, attr = (InterpretedFunction, "run") if DEVICE == "cpu" else (jit.JITFunction, "run")
    orig = getattr(cls, attr)

    def run(self, *a, **kw):
        names.append(self.fn.__name__)
        return orig(self, *a, **kw)
    monkeypatch.setattr(cls, attr, run)
    return names


def test_one_split_falls_back_to_the_standalone_quant_launch(monkeypatch):
    """SPLITS=1 (the one-split form a large T takes): bf16 o from the split kernel, then
    inv_rope_fp8_quant's launch inside the launcher: 2 kernels, the same bits; the split path: split +
    merge, no quant kernel."""
    inp = _inputs({"T": 3, "H": 16, "W": 20, "Kc": 37, "comp_bs": 2}, "neg_indices", 8)
    pos, cs = inp.pop("positions"), inp.pop("cos_sin")
    one = {**SPLIT3, "SPLITS": 1}
    names = _launched(monkeypatch)
    fused = sparse_mla_decode(**inp, config=one, o_fp8=True, positions=pos, cos_sin=cs)
    assert names == ["_sparse_mla_split_kernel", "_inv_rope_quant_kernel"]
    names.clear()
    split = sparse_mla_decode(**inp, config=SPLIT3, o_fp8=True, positions=pos, cos_sin=cs)
    assert names == ["_sparse_mla_split_kernel", "_sparse_mla_merge_kernel"]
    _same(fused, _unfused(inp, pos, cs, 8, "ue8m0", one))
    _same(split, _unfused(inp, pos, cs, 8, "ue8m0", SPLIT3))


@pytest.mark.parametrize("fmt,w_fmt", [("ue8m0", "ue8m0"), ("fp32", "fp32"), ("pow2", "ue8m0")])
def test_o_proj_fp8_input_equals_the_3_launch_o_proj(fmt, w_fmt, monkeypatch):
    """``o_proj_fp8_input(*inv_rope_fp8_quant(o))`` == ``o_proj(o, path="unfused3")`` bit for bit (same
    wo_a + wo_b launches), in 2 kernels against 3; and the whole chain from sparse MLA's fused output."""
    inp = oproj_spec.o_proj_inputs({"T": 3, "H": 16, "R": 128, "N": 128, "path": "fp8", "scale_fmt": fmt,
                                    "w_fmt": w_fmt}, "outlier_head", 4, DEVICE)
    cfg = OP.CONFIGS["sm_89"]["unfused3_s8"]
    names = _launched(monkeypatch)
    ref = OP.o_proj(**inp, check_positions=False, config=cfg)
    assert names == ["_inv_rope_quant_kernel", "_fused_gemm_kernel", "_fp8_gemm_nt_kernel"]
    x, xs = OP.inv_rope_fp8_quant(inp["o"], inp["positions"], inp["cos_sin_cache"], 8, True, fmt)
    names.clear()
    out = OP.o_proj_fp8_input(x, xs, inp["wo_a"], inp["wo_b"], inp["wo_a_s"], inp["wo_b_s"], scale_fmt=fmt,
                              config=cfg)
    assert names == ["_fused_gemm_kernel", "_fp8_gemm_nt_kernel"]
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape and torch.equal(out, ref)
    # the checkpoint's 2-D wo_a / wo_a_s (what the model backend passes) and the default config
    G, R, K = inp["wo_a"].shape
    wa2, was2 = inp["wo_a"].reshape(G * R, K), inp["wo_a_s"].reshape(G * R // 128, K // 128)
    assert torch.equal(OP.o_proj_fp8_input(x, xs, wa2, inp["wo_b"], was2, inp["wo_b_s"], scale_fmt=fmt),
                       OP.o_proj(**inp, check_positions=False, config={"path": "unfused3"}))


def test_sparse_mla_then_o_proj_in_4_launches_equals_the_5_launch_chain(monkeypatch):
    """split + merge(+quant) + wo_a + wo_b (4) against split + merge + inv-RoPE/quant + wo_a + wo_b (5)."""
    inp = _inputs({"T": 2, "H": 16, "W": 20, "Kc": 37, "comp_bs": 64}, "random", 12)
    pos, cs = inp.pop("positions"), inp.pop("cos_sin")
    w = oproj_spec.o_proj_inputs({"T": 2, "H": 16, "R": 128, "N": 128, "path": "fp8", "w_fmt": "ue8m0"},
                                 "random", 2, DEVICE)
    cfg = OP.CONFIGS["sm_89"]["unfused3_s8"]
    names = _launched(monkeypatch)
    o = sparse_mla_decode(**inp, config=T1ROW)
    ref = OP.o_proj(o, pos, cs, w["wo_a"], w["wo_b"], w["wo_a_s"], w["wo_b_s"], check_positions=False, config=cfg)
    assert len(names) == 5
    names.clear()
    x, xs = sparse_mla_decode(**inp, config=T1ROW, o_fp8=True, positions=pos, cos_sin=cs)
    out = OP.o_proj_fp8_input(x, xs, w["wo_a"], w["wo_b"], w["wo_a_s"], w["wo_b_s"], config=cfg)
    assert names == ["_sparse_mla_split_kernel", "_sparse_mla_merge_kernel", "_fused_gemm_kernel",
                     "_fp8_gemm_nt_kernel"]
    assert torch.equal(out, ref)


def test_bad_inputs_name_the_argument():
    inp = _inputs({"T": 2, "H": 16, "W": 20, "Kc": 0}, "random", 1)
    pos, cs = inp.pop("positions"), inp.pop("cos_sin")
    kw = dict(o_fp8=True, positions=pos, cos_sin=cs)
    cases = [
        (dict(kw, o_fp8=1), TypeError, "o_fp8"),
        (dict(kw, positions=None), ValueError, "positions: required with o_fp8"),
        (dict(kw, cos_sin=None), ValueError, "cos_sin: required with o_fp8"),
        (dict(kw, positions=pos[:1]), ValueError, "positions: expected shape"),
        (dict(kw, positions=pos.float()), TypeError, "positions"),
        (dict(kw, cos_sin=cs[:, :63]), ValueError, "cos_sin: rope_dim=63"),
        (dict(kw, cos_sin=torch.zeros(8, 256, device=DEVICE)), ValueError, "cos_sin: rope_dim=256"),
        (dict(kw, heads_per_group=3), ValueError, "heads_per_group=3"),
        (dict(kw, heads_per_group=0), ValueError, "heads_per_group=0"),
        (dict(kw, scale_fmt="e8m0"), ValueError, "scale_fmt='e8m0'"),
        (dict(kw, out=torch.empty(2, 16, 512, dtype=torch.bfloat16, device=DEVICE)), ValueError, "out: not supported"),
        (dict(positions=pos), ValueError, "positions: given without q_norm_eps or o_fp8"),
    ]
    for extra, exc, match in cases:
        with pytest.raises(exc, match=match):
            sparse_mla_decode(**inp, config=SPLIT3, **extra)

    w = oproj_spec.o_proj_inputs({"T": 2, "H": 16, "R": 128, "N": 128, "path": "fp8", "w_fmt": "ue8m0"},
                                 "random", 2, DEVICE)
    x, xs = sparse_mla_decode(**inp, config=SPLIT3, **kw)
    args = dict(x=x, x_s=xs, wo_a=w["wo_a"], wo_b=w["wo_b"], wo_a_s=w["wo_a_s"], wo_b_s=w["wo_b_s"])
    bad = [
        (dict(x=x.view(torch.uint8)), TypeError, "x: dtype"),
        (dict(x=x[:, 0]), ValueError, "x: expected 3 dims"),
        (dict(x_s=xs.float()), TypeError, "x_s: dtype .* does not match scale_fmt='ue8m0'"),
        (dict(x_s=xs.int()), TypeError, "x_s: dtype"),
        (dict(x_s=xs[:, :, :-1]), ValueError, r"x_s: shape \(2, 2, 31\)"),
        (dict(x=x[:, :, :100].contiguous(), x_s=xs[:, :, :1]), ValueError, "x: K=100"),
        (dict(wo_a_s=None), ValueError, "wo_a_s: required"),
        (dict(wo_b_s=None), ValueError, "wo_b_s: required"),
        (dict(wo_a=w["wo_a"].to(torch.bfloat16)), TypeError, "wo_a: dtype"),
        (dict(wo_a=w["wo_a"][:1]), ValueError, "wo_a: shape"),
        (dict(wo_b=w["wo_b"][:, :128]), ValueError, "wo_b: shape"),
        (dict(wo_a_s=w["wo_a_s"][:, :, :1]), ValueError, "wo_a_s: shape"),
        (dict(scale_fmt="fp8"), ValueError, "scale_fmt='fp8'"),
        (dict(config={"path": "fused"}), ValueError, "config: path='fused'"),
    ]
    for extra, exc, match in bad:
        with pytest.raises(exc, match=match):
            OP.o_proj_fp8_input(**{**args, **extra})


def test_backend_switch_same_output_one_launch_fewer(monkeypatch):
    """``KernelBackend.sparse_mla_o_proj``: with ``FUSE_O_QUANT_INTERP`` (on) the attention group's launches are
    unchanged (its merge writes the fp8 input), o_proj's group runs ``o_proj_fp8_input``'s 2 launches (the GPU
    default it replaces is unfused3_s8's 3; the interpreter's o_proj default is already a 2-launch row), the
    kinds say which ran, and the output equals the switch-off composition bit for bit."""
    import ds4lab.model.backend_kernel as bk
    from ds4lab.model.launches import count_launches
    from ds4lab.model.ops import Linear
    inp = _inputs({"T": 2, "H": 16, "W": 20, "Kc": 37, "comp_bs": 2}, "random", 13)
    pos, cs = inp.pop("positions"), inp.pop("cos_sin")
    w = oproj_spec.o_proj_inputs({"T": 2, "H": 16, "R": 128, "N": 128, "path": "fp8", "w_fmt": "ue8m0"},
                                 "random", 2, DEVICE)
    G, R, K = w["wo_a"].shape
    wo_a = Linear(w["wo_a"].reshape(G * R, K), w["wo_a_s"].reshape(G * R // 128, K // 128))
    wo_b = Linear(w["wo_b"], w["wo_b_s"])
    args = (inp["q"], inp["swa_cache"], inp["swa_indices"], inp["swa_lens"], inp["attn_sink"], inp["comp_cache"],
            inp["comp_indices"], inp["comp_lens"], 64, 2, 512 ** -0.5, pos, cs, wo_a, wo_b, G)
    kb = bk.KernelBackend()

    def kinds_of(call):
        """The op-group kinds ``call`` reports, by group name."""
        return dict(op_kinds(call)[1])
    sw = "FUSE_O_QUANT_INTERP" if DEVICE == "cpu" else "FUSE_O_QUANT"   # the switch this device reads
    monkeypatch.setattr(bk, sw, True)
    kb.sparse_mla_o_proj(*args)       # first call: the split-K counter buffers are allocated (zeroed) once
    fused, n = count_launches(kb.sparse_mla_o_proj, *args)
    monkeypatch.setattr(bk, sw, False)
    kinds = kinds_of(lambda: kb.sparse_mla_o_proj(*args))
    unfused, n2 = count_launches(kb.sparse_mla_o_proj, *args)
    assert torch.equal(fused, unfused)
    if DEVICE == "cpu":   # count_launches sees Triton launches on the interpreter only; the interpreter's
        # o_proj default is the 2-launch "fused" row (on a GPU: unfused3_s8, 3 launches)
        assert n["attn.sparse_mla"] == n2["attn.sparse_mla"] == 2 and n["attn.o_proj"] == n2["attn.o_proj"] == 2, \
            (n, n2)
    assert kinds["attn.o_proj"] == "kernel:o_proj.o_proj" and kinds["attn.sparse_mla"] == bk.K_SPARSE_MLA
    monkeypatch.setattr(bk, sw, True)
    kinds = kinds_of(lambda: kb.sparse_mla_o_proj(*args))
    assert kinds["attn.o_proj"] == bk.K_O_PROJ_FP8_INPUT and kinds["attn.sparse_mla"].endswith(bk.K_O_QUANT)
