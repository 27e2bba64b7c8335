"""kernels/_arch.arch_of: which config table a launcher reads (device capability, the interpreter,
and TRITON_OVERRIDE_ARCH for the sm_89 build on an H200)."""
import pytest
import torch

from ds4lab_kernels._arch import arch_of


@pytest.mark.parametrize("cap,override,want", [
    ((9, 0), None, "sm_90"), ((8, 9), None, "sm_89"), ((10, 0), None, "sm_90"),
    ((9, 0), "sm89", "sm_89"),      # bench --arch sm89 on the H200: every launcher reads the Ada table
    ((8, 9), "sm90", "sm_90"), ((9, 0), "sm90a", "sm_90"),
])
def test_cuda_capability_and_override(monkeypatch, cap, override, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    if override:
        monkeypatch.setenv("TRITON_OVERRIDE_ARCH", override)
    else:
        monkeypatch.delenv("TRITON_OVERRIDE_ARCH", raising=False)
    assert arch_of(torch.device("cuda", 0)) == want


def test_cpu_is_the_ada_table_and_bad_override_is_named(monkeypatch):
    monkeypatch.setenv("TRITON_OVERRIDE_ARCH", "sm90")
    assert arch_of(torch.device("cpu")) == "sm_89"   # the interpreter runs on CPU tensors
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("TRITON_OVERRIDE_ARCH", "hopper")
    with pytest.raises(ValueError, match="TRITON_OVERRIDE_ARCH"):
        arch_of(torch.device("cuda", 0))
