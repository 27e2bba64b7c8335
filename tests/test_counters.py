"""The one home of the kernels' ticket counters (ds4lab_kernels._counters): zeroed on first use, one buffer per
(owner, device), grown and never shrunk, and the check GPU scripts run after CUDA-graph replays."""
import torch

from ds4lab_kernels import _counters as C


def test_zeroed_per_owner_grown_never_shrunk():
    a = C.zeroed_counters("test.a", "cpu", 10, min_slots=16)
    assert a.dtype == torch.int32 and a.numel() == 16 and not a.any()
    assert C.zeroed_counters("test.a", torch.device("cpu"), 12) is a          # the same buffer while it fits
    b = C.zeroed_counters("test.b", "cpu", 10, min_slots=16)
    assert b is not a                                                       # owners never share counters
    a[3] = 2
    assert C.left_nonzero("test.a") == 2 and C.left_nonzero("test.b") == 0
    assert C.left_nonzero() >= 2
    big = C.zeroed_counters("test.a", "cpu", 40, min_slots=16)
    assert big.numel() == 40 and not big.any()                              # grown (a fresh zeroed buffer)
    assert C.zeroed_counters("test.a", "cpu", 8) is big                     # never shrunk
    big.zero_()
