"""ds4lab.model.backend_kernel's decode thresholds pick the launcher they document:
FUSE_ACT_QUANT_MAX_M (FP8 linear: fused-quant prologue up to M tokens, quant + GEMM above) and
GATE_FUSED_MAX_T (router: the one-launch gate + top-k up to T tokens, the unfused pair above).
The launchers are the real ones (interpreter), only wrapped to record which ran."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.model import backend_kernel as BK
from ds4lab.model.ops import Linear

pytestmark = pytest.mark.interp


def _fp8_linear(N=128, K=256):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(N, K, generator=g) * 0.1).to(torch.float8_e4m3fn)
    scale = torch.full((N // 128, K // 128), 127, dtype=torch.uint8)   # 2^0
    return Linear(w.to(DEVICE), scale.to(DEVICE))


def test_fp8_linear_fuses_the_quant_only_up_to_fuse_act_quant_max_m(monkeypatch):
    be = BK.KernelBackend()
    seen = []
    real = be.k["gemm"].w8a8_block_fp8_linear

    class Spy:   # the module stays the real one; only the launcher is wrapped
        def __getattr__(self, n):
            return getattr(mod, n)
    mod = be.k["gemm"]
    spy = Spy()
    spy.w8a8_block_fp8_linear = lambda *a, fused, **kw: seen.append(fused) or real(*a, fused=fused, **kw)
    be.k["gemm"] = spy
    lin = _fp8_linear()
    n = BK.FUSE_ACT_QUANT_MAX_M
    x = torch.randn(n + 1, 256).to(torch.bfloat16).to(DEVICE)
    y1 = be.linear(x[:n], lin, "t")
    y2 = be.linear(x, lin, "t")
    assert seen == [True, False] and n == 32            # session 7: fused up to fp8_gemm.FUSED_MAX_M
    assert torch.equal(y1, y2[:n])                      # fused prologue: the pair's bits (documented)
    monkeypatch.setattr(BK, "FUSE_ACT_QUANT_MAX_M", 0)
    be.linear(x[:1], lin, "t")
    assert seen[-1] is False


def test_gate_route_is_fused_only_up_to_gate_fused_max_t(monkeypatch):
    be = BK.KernelBackend()
    calls = []
    real_gate, real_route = be.k["gate"].gate_sqrtsoftplus_topk, be.k["route"].sqrtsoftplus_topk

    class Mod:
        def __init__(self, mod, name, fn):
            self._m, self._n, self._f = mod, name, fn

        def __getattr__(self, n):
            return self._f if n == self._n else getattr(self._m, n)
    be.k["gate"] = Mod(be.k["gate"], "gate_sqrtsoftplus_topk",
                       lambda *a, **kw: calls.append("fused") or real_gate(*a, **kw))
    be.k["route"] = Mod(be.k["route"], "sqrtsoftplus_topk",
                        lambda *a, **kw: calls.append("route") or real_route(*a, **kw))
    g = torch.Generator().manual_seed(1)
    E, D, T = 256, 128, BK.GATE_FUSED_MAX_T + 1
    gate = Linear(torch.randn(E, D, generator=g).to(torch.bfloat16).to(DEVICE))
    bias = torch.randn(E, generator=g).float().to(DEVICE)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).to(DEVICE)
    w_f, e_f = be.gate_route(x[:T - 1], gate, bias, 6, 1.5, None, None)
    w_u, e_u = be.gate_route(x, gate, bias, 6, 1.5, None, None)
    assert calls == ["fused", "route"], calls
    assert torch.equal(e_f, e_u[:T - 1])                 # same routing either side of the threshold
