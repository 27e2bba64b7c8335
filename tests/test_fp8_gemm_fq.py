"""The fused-quant decode rows of issue 20 / m16 (``fq_16x32``, ``fq_16x64``) and the hardware-cast quant
prologue (``Q_CVT``): the exactness precondition of the cast (exhaustive over bf16 and fp16), bit-identity of
every fused path to quant + GEMM at 4..32 tokens on adversarial rows (zero, 1e-30, bf16-subnormal, NaN, ±inf,
values at the e4m3 and UE8M0 limits, M not a multiple of the tile), the split rule ``SPLIT_BELOW`` and the
fused launch's picks at the TP=4 shapes, bad configs naming ``config``, and the compile on sm_89 / sm_90 /
sm_120 without spills at the real shapes."""
import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.numerics import compare_exact
from ds4lab.harness.specs import fp8_gemm as S
from ds4lab_kernels import fp8_gemm as G
from ds4lab_kernels import fp8_quant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T89 = G.CONFIGS["sm_89"]
E4M3 = torch.float8_e4m3fn


def _rz_f16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp16 rounded toward zero (sm_89's ``cvt.rz.f16.f32``, the first step of Triton's fp32 ->
    e4m3 cast there), from torch's RNE cast: step back one fp16 ulp where RNE went away from zero."""
    h = x.half()
    away = h.float().abs() > x.abs()
    bits = h.view(torch.int16)
    return torch.where(away & torch.isfinite(x), (bits - 1).view(torch.float16), h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hardware_cast_is_exact_for_16_bit_activations(dtype):
    """``Q_CVT``'s precondition (``_fp8.quant_rows_e4m3_pow2``): for every finite bf16 / fp16 value v and
    every power-of-two scale with |v / s| <= 448, e4m3(rz_f16(v / s)) == e4m3(v / s) (RNE from the exact
    value), i.e. the sm_89 cast through fp16 does no double rounding; sm_90 / sm_120 cast fp32 directly.
    The same route is NOT exact for fp32 values (the launcher keeps to_e4m3 there): shown on a sample."""
    v = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).float()
    v = v[torch.isfinite(v)]
    for e in range(-140, 141, 1):
        x = v * 2.0 ** e                      # exact in fp32 (the kernel's x * (1 / s)), or fp32-subnormal/0
        x = x[x.abs() <= 448.0]
        assert torch.equal(_rz_f16(x).to(E4M3).view(torch.uint8), x.to(E4M3).view(torch.uint8)), (dtype, e)
    g = torch.Generator().manual_seed(0)
    f = torch.randn(1 << 16, generator=g) * 4
    assert not torch.equal(_rz_f16(f).to(E4M3).view(torch.uint8), f.to(E4M3).view(torch.uint8))


def _adversarial_x(M, K, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 3
    x[0, :128] = 0.0                                   # an all-zero group (eps floor)
    x[M - 1, 128:256] = 1e-30                          # below bf16 normal range
    x[min(1, M - 1), 256:384] = 2.0 ** -130            # bf16 subnormals
    x[M // 2, 400] = 448.0 * 2.0 ** 100                # scale near the UE8M0 top
    x[M // 2, 401] = -448.0 * 2.0 ** 99
    x[min(2, M - 1), 128:256] = 448.0                  # exactly the e4m3 max: scale 1
    if M > 3:
        x[3, 5] = float("nan")
        x[M - 2, 300] = float("-inf")
    return x.bfloat16()


@pytest.mark.interp
@pytest.mark.parametrize("label,M,split", [
    ("fq_16x64", 4, 1), ("fq_16x64", 5, 2), ("fq_16x32", 16, 3), ("fq_16x64", 17, 1), ("fq_16x32", 32, 2),
    ("decode", 8, 2), ("decode_16x64", 1, 2),
])
def test_fused_rows_are_bit_identical_to_quant_then_gemm(label, M, split):
    """The fq rows (and the older fused rows, which Q_CVT now also takes) == quant kernel + GEMM on fp8 A at
    the same config, bit for bit, with and without the hardware-cast quant; NaN / inf rows NaN, others not."""
    K, N = 512, 80
    x = _adversarial_x(M, K, 11 + M).to(DEVICE)
    w = S.make_linear_inputs({"M": 1, "N": N, "K": K, "b_fmt": "ue8m0"}, "random", 3, DEVICE)
    cfg = {**T89[label], "SPLIT_K": split}
    q, s = fp8_quant.per_token_group_quant_fp8(x, 128, scale_fmt="ue8m0")
    two = G.fp8_gemm_nt(q, s, w["weight"], w["weight_scale"], config=cfg)
    for qc in (1, 0):
        fused = G.w8a8_block_fp8_linear(x, w["weight"], w["weight_scale"], config={**cfg, "Q_CVT": qc}, fused=True)
        assert compare_exact(fused, two, f"{label} M={M} Q_CVT={qc} fused vs quant+gemm")
    bad = torch.isnan(x.float()).any(1) | torch.isinf(x.float()).any(1)
    assert torch.equal(two.isnan().all(1), bad.to(two.device)) and not two[~bad.to(two.device)].isnan().any()
    inputs = {"a": q, "a_scale": s, "b": w["weight"], "b_scale": w["weight_scale"]}
    reps = S.check(two, S.R.fp8_gemm_nt(**inputs), inputs)
    assert all(reps), [r.summary() for r in reps]


@pytest.mark.interp
def test_fused_rows_detect_a_broken_quant():
    """The bit-identity check has teeth: a fused result from a quant one e4m3 step off in one group fails."""
    K, N, M = 512, 64, 4
    x = _adversarial_x(M, K, 2).to(DEVICE)
    w = S.make_linear_inputs({"M": 1, "N": N, "K": K, "b_fmt": "ue8m0"}, "random", 4, DEVICE)
    q, s = fp8_quant.per_token_group_quant_fp8(x, 128, scale_fmt="ue8m0")
    fused = G.w8a8_block_fp8_linear(x, w["weight"], w["weight_scale"], config=T89["fq_16x64"], fused=True)
    qb = q.view(torch.uint8).clone()
    qb[1, 130] += 1
    broken = G.fp8_gemm_nt(qb.view(E4M3), s, w["weight"], w["weight_scale"], config=T89["fq_16x64"])
    assert not compare_exact(fused, broken, "mutated quant")


@pytest.mark.interp
@pytest.mark.parametrize("M", [3, 16])
def test_swiglu_prologue_fq_row_is_bit_identical(M):
    """The clamped-SwiGLU prologue on the fq row (hardware-cast quant of the bf16-rounded activation) ==
    swiglu_clamp + quant + GEMM, incl. gate/up beyond the clamp and NaN."""
    K, N, L = 256, 48, 10.0
    g = torch.Generator().manual_seed(M)
    gu = torch.randn(M, 2 * K, generator=g) * 8
    gu[0, 3], gu[0, K + 7] = 60.0, -60.0
    gu[M - 1, 10] = float("nan")
    gu = gu.bfloat16().to(DEVICE)
    w = S.make_linear_inputs({"M": 1, "N": N, "K": K, "b_fmt": "ue8m0"}, "random", 6, DEVICE)
    kw = dict(config={**T89["fq_16x64"], "SPLIT_K": 2}, act="swiglu_clamp", act_limit=L)
    fused = G.w8a8_block_fp8_linear(gu, w["weight"], w["weight_scale"], fused=True, **kw)
    two = G.w8a8_block_fp8_linear(gu, w["weight"], w["weight_scale"], fused=False, **kw)
    assert compare_exact(fused, two, "fq act fused vs swiglu + quant + gemm")
    assert fused[M - 1].isnan().all() and not fused[0].isnan().any()


def test_fused_picks_and_split_rule_at_the_tp4_shapes():
    """On a 132-SM H200: the fused launch takes gemv_w8 / gemv (FUSED_M2_LABEL) at 1 / 2 tokens and fq_16x64
    at 3..32 (sm_89; sm_90 decode_16x64 then fq_16x64); fq_16x64 leaves wq_b (128 tiles) and shared_down (4
    k-blocks) unsplit and splits the narrow N shapes in-launch; quant + GEMM keeps pick_config's rows; every
    label a picker returns is a GPU default (the compile report builds those)."""
    assert [G.fused_config_label(m, "sm_89") for m in (1, 2, 3, 16, 32)] == \
        ["gemv_w8", "gemv", "fq_16x64", "fq_16x64", "fq_16x64"]
    assert [G.fused_config_label(m, "sm_90") for m in (1, 2, 3, 32)] == ["decode_16x64"] * 2 + ["fq_16x64"] * 2
    assert G.fused_config_label(32, "interp") == "decode"
    for arch in ("sm_89", "sm_90"):
        picked = {G.fused_config_label(m, arch) for m in range(1, G.FUSED_MAX_M + 1)}
        picked |= {G.config_label(m, arch) for m in (1, 2, 3, 16, 17, 64, 65, 256, 257, 8192)}
        assert None not in picked and set(G.GPU_DEFAULTS[arch]) >= picked, (arch, picked - set(G.GPU_DEFAULTS[arch]))
    dev = torch.device("cpu")
    c = T89["fq_16x64"]
    with mock.patch.object(G, "num_sms", lambda d: 132):
        split = {op: G._split_k(c, (N + 63) // 64, K // 128, dev) for op, N, K in (
            ("wq_a_wkv", 1536, 4096), ("wq_b", 8192, 1024), ("wo_b", 4096, 2048), ("shared_gate_up", 1024, 4096),
            ("shared_down", 4096, 512))}
        assert split == {"wq_a_wkv": 8, "wq_b": 1, "wo_b": 4, "shared_gate_up": 8, "shared_down": 1}, split
        assert G._split_k({**c, "SPLIT_BELOW": 1.0}, 128, 8, dev) == 2      # the default rule would split wq_b
        assert G._split_k(T89["fq_16x32"], 256, 8, dev) == 1


def test_the_backend_fuse_bounds_stay_within_the_launcher():
    """The backend may fuse at most what the launcher's fused rows take (FUSED_MAX_M = 32); the m16 rows
    make 32 possible, the timed bounds stay 2 until the H200 says more (NOTES.md "m16")."""
    from ds4lab.model import backend_kernel as BK
    assert G.FUSED_MAX_M == 32
    assert 1 <= BK.FUSE_SHARED_ACT_MAX_M <= BK.FUSE_ACT_QUANT_MAX_M <= G.FUSED_MAX_M
    assert G.CONFIGS["sm_89"]["fq_16x64"]["Q_CVT"] == 1 and "Q_CVT" not in G.CONFIGS["sm_89"]["gemv_w8"]


@pytest.mark.interp
@pytest.mark.parametrize("extra,match", [
    ({"SPLIT_BELOW": 0}, "SPLIT_BELOW"), ({"SPLIT_BELOW": "half"}, "SPLIT_BELOW"), ({"SPLIT_BELOW": True}, "SPLIT_BELOW"),
    ({"Q_CVT": 2}, "Q_CVT"),
])
def test_bad_fq_config_names_config(extra, match):
    w = S.make_linear_inputs({"M": 1, "N": 32, "K": 256, "b_fmt": "ue8m0"}, "random", 1, DEVICE)
    x = torch.zeros(4, 256, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=f"config=.*{match}"):
        G.w8a8_block_fp8_linear(x, w["weight"], w["weight_scale"], config={**T89["fq_16x64"], **extra})


@pytest.mark.aot
def test_fq_rows_compile_without_spills_on_every_arch():
    """fq_16x32 / fq_16x64 at the real TP=4 shapes and token counts they serve (the quant prologue with the
    hardware cast, the SwiGLU prologue at shared_down, split and unsplit): sm_89, sm_90a and sm_120, no
    spills, within each arch's shared memory (the registry's single compile shape misses the act and M
    variants)."""
    code = r'''
import json
from ds4lab.harness import aot
from ds4lab.harness.specs import fp8_gemm as S
from ds4lab_kernels import fp8_gemm as G
from ds4lab_kernels._arch import SMEM_LIMIT
import torch
rows = []
for arch in ("sm_89", "sm_90", "sm_120"):
    T = G.CONFIGS[aot.table_of(arch)]
    for label in ("fq_16x32", "fq_16x64"):
        for M, N, K, act in ((4, 8192, 1024, None), (16, 1536, 4096, None), (32, 4096, 2048, None),
                             (16, 4096, 512, "swiglu_clamp")):
            w = S.make_linear_inputs({"M": 1, "N": N, "K": K, "b_fmt": "ue8m0"}, "random", 0, "cpu")
            x = torch.zeros(M, 2 * K if act else K, dtype=torch.bfloat16)
            with aot.capture_compiles(arch) as cap:
                G.w8a8_block_fp8_linear(x, w["weight"], w["weight_scale"], config=T[label], fused=True, act=act,
                                        act_limit=10.0 if act else None)
            for f, c in cap:
                rows.append({"arch": arch, "label": label, "M": M, "K": K, "act": act, "limit": SMEM_LIMIT[arch],
                             **aot._inspect(c, arch)})
print(json.dumps(rows))
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(rows) == 24, rows
    for r in rows:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["local"] == 0, r
        assert r["shared"] <= r["limit"], r
