"""Decode compressor kernel vs the float64 reference and the model's torch path: every registry
case at hd 512/128, ratio 4 (overlap) and 128; state rows written; errors name the argument."""
import pytest
import torch

from conftest import DEVICE
from ds4lab.harness.specs.compressor import CASES, check, make_inputs
from ds4lab.model.backend_kernel import compress as torch_path
from ds4lab.reference.compressor import compress_decode as ref
from ds4lab_kernels.compressor import compress_decode

pytestmark = pytest.mark.interp

SHAPES = [{"T": 3, "ratio": 4, "hd": 512}, {"T": 2, "ratio": 128, "hd": 512},
          {"T": 3, "ratio": 4, "hd": 128}, {"T": 2, "ratio": 128, "hd": 128}]


def _clone(d):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"c{s['ratio']}_hd{s['hd']}")
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_and_torch_path(shape, case):
    inp = make_inputs(shape, case, seed=3, device=DEVICE)
    r_in, t_in = _clone(inp), _clone(inp)
    out = compress_decode(**inp)
    want = ref(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in r_in.items()})
    rep = check(out.cpu(), want, inp)[0]
    assert rep, rep
    boundary = ((inp["positions"].cpu() + 1) % shape["ratio"] == 0)
    assert boundary.any()
    assert torch.all(out.cpu()[~boundary] == 0)
    assert out.cpu()[boundary].abs().amax() > 0
    # the state ring holds exactly the rows the model's torch path writes; same entries (bf16)
    tp = torch_path(**t_in)
    assert torch.equal(inp["state"], t_in["state"])
    assert (out.float() - tp.float()).abs().amax() <= 2 ** -6 * tp.float().abs().amax()


def test_masked_first_window_ignores_ring_garbage():
    """Window positions < 0 are masked: whatever their (clamped) ring rows hold must not matter."""
    inp = make_inputs({"T": 2, "ratio": 4, "hd": 128}, "first_window", seed=5, device=DEVICE)
    a = compress_decode(**_clone(inp))
    poisoned = _clone(inp)
    used = set(inp["window_slots"][inp["window_valid"]].tolist()) | set(inp["state_slots"].tolist())
    for s in range(inp["state"].shape[0]):
        if s not in used:
            poisoned["state"][s] = 1e30
    assert torch.equal(compress_decode(**poisoned), a)


@pytest.mark.parametrize("field,value,err,msg", [
    ("kv_score", "half", TypeError, "kv_score"),
    ("ratio", 8, ValueError, "ratio"),
    ("window_valid", "int", TypeError, "window_valid"),
    ("window_slots", "short", ValueError, "window_slots"),
    ("norm_weight", "long", ValueError, "norm_weight"),
    ("ape", "short", ValueError, "ape"),
])
def test_bad_input_names_the_argument(field, value, err, msg):
    inp = make_inputs({"T": 2, "ratio": 4, "hd": 128}, "random", seed=0, device=DEVICE)
    v = inp[field]
    inp[field] = {"half": lambda: v.half(), "int": lambda: v.int(), "short": lambda: v[:, :-1],
                  "long": lambda: torch.cat([v, v])}.get(value, lambda: value)()
    with pytest.raises(err, match=msg):
        compress_decode(**inp)


def test_bf16_gemm_output_slice_equals_its_fp32_copy():
    """The model hands the bf16 ``wkv_gate`` GEMM output (a column slice of the fused C4A GEMM) to
    the kernel as is: same state rows and entries as the fp32 contiguous copy it used to convert."""
    inp = make_inputs({"T": 3, "ratio": 4, "hd": 128}, "random", seed=7, device=DEVICE)
    ks = inp["kv_score"].to(torch.bfloat16)
    wide = torch.cat([torch.randn(3, 64, device=DEVICE).to(torch.bfloat16), ks,
                      torch.randn(3, 32, device=DEVICE).to(torch.bfloat16)], 1)
    a, b = _clone(inp), _clone(inp)
    a["kv_score"], b["kv_score"] = wide[:, 64:64 + ks.shape[1]], ks.float()
    assert a["kv_score"].stride(0) != a["kv_score"].shape[1]
    assert torch.equal(compress_decode(**a), compress_decode(**b))
    assert torch.equal(a["state"], b["state"])
