"""The composition's side chains (``Backend.branch`` / ``join``; the kernel backend runs them on a second
CUDA stream with ``backend_kernel.BRANCH_STREAMS``).

On a CPU: the contract the composition must keep for the streams to be safe, checked on the real
composition over the reference twin (every tensor an op returns inside a branch is read by no op issued
after the branch before its join; every branch is joined), and the no-op behaviour without CUDA.
On a GPU: the step's logits with the switch on are bit-identical to the switch off, eager and replayed
from a CUDA graph (same kernels, same inputs; a missing join would show as a race)."""
import dataclasses

import pytest
import torch

from ds4lab.model import backend_kernel as BK
from ds4lab.model.ops import Backend

HAS_CUDA = torch.cuda.is_available()


def _storages(obj, out):
    if isinstance(obj, torch.Tensor):
        out.add(obj.untyped_storage().data_ptr())
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _storages(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _storages(o, out)
    return out


class _BranchAudit:
    """Wraps a backend: records what each op returns inside a branch, and flags an op issued after the
    branch (before its join) that takes one of those tensors (a read the second stream would race)."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.open: dict[int, set] = {}      # branch id -> storages its ops returned
        self.current: int | None = None
        self.violations: list[str] = []
        self.branches = self.joins = 0
        self.blocks: list[str | None] = []

    def branch(self, device, block=None):
        audit = self
        self.blocks.append(block)

        class _Ctx:
            def __enter__(self):
                audit.branches += 1
                self.id = audit.branches
                audit.open[self.id] = set()
                audit.current = self.id
                return self

            def __exit__(self, *exc):
                audit.current = None
                return False
        return _Ctx()

    def join(self, br):
        if br is not None:
            self.joins += 1
            self.open.pop(br.id, None)

    def __getattr__(self, name):
        fn = getattr(self.inner, name)
        if not callable(fn) or name.startswith("_"):
            return fn

        def call(*a, **k):
            if self.current is None:
                pending = set().union(*self.open.values()) if self.open else set()
                hit = _storages((a, k), set()) & pending
                if hit:
                    self.violations.append(f"{name} reads a branch result before its join")
            out = fn(*a, **k)
            if self.current is not None:
                _storages(out, self.open[self.current])
            return out
        return call


def test_every_branch_result_is_read_only_after_its_join():
    """The real composition (tiny checkpoint, reference twin: SWA, C4A and C128A layers, hash and bias
    routing): a decode step opens branches, joins each one, and reads no branch result early."""
    from ds4lab.checkpoint.tiny import TINY_CONFIG as cfg
    from ds4lab.model import build_rank
    from ds4lab.model.weights import load_tiny
    m = build_rank(cfg, 1, 0, load_tiny(), device="cpu", backend="reference")
    audit = _BranchAudit(m.ops)
    m.ops = audit
    C = m.new_caches(2, 16)
    m.decode(torch.tensor([[300], [301]]), torch.tensor([[5], [9]]), C)
    ratios = [r for r in cfg.compress_ratios[:cfg.num_hidden_layers]]
    assert audit.branches == sum(1 for r in ratios if r) + cfg.num_hidden_layers   # attention side chains + MoE
    assert audit.joins == audit.branches and not audit.open
    assert audit.violations == []
    assert set(audit.blocks) == {"attn", "moe"} and audit.blocks.count("moe") == cfg.num_hidden_layers


def test_the_audit_catches_an_early_read():
    """The check above can fail: a result read before the join is reported."""
    class Toy(Backend):
        def add(self, a, b, name):
            return a + b
    audit = _BranchAudit(Toy())
    with audit.branch("cpu") as br:
        y = audit.add(torch.ones(2), torch.ones(2), "side")
    audit.add(y, y, "main")
    audit.join(br)
    assert audit.violations == ["add reads a branch result before its join"]


def test_branch_is_issue_order_without_cuda(monkeypatch):
    monkeypatch.setattr(BK, "BRANCH_STREAMS", True)
    kb = BK.KernelBackend()
    with kb.branch(torch.device("cpu")) as br:
        pass
    assert br is None
    kb.join(None)
    with Backend().branch("cpu") as br2:
        pass
    assert br2 is None


def test_branch_blocks_picks_the_forks(monkeypatch):
    """``BRANCH_BLOCKS`` leaves a fork not named in it in issue order, before any stream is made (so this
    holds on a CUDA device too)."""
    monkeypatch.setattr(BK, "BRANCH_STREAMS", True)
    monkeypatch.setattr(BK, "BRANCH_BLOCKS", ("moe",))
    kb = BK.KernelBackend()
    with kb.branch(torch.device("cuda", 0), "attn") as br:
        pass
    assert br is None and kb._side == {}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (the side stream)")
def test_streams_give_bit_identical_logits_eager_and_in_a_graph(monkeypatch):
    """Real shapes (TP=4 rank 0), the first 4 layers (SWA, SWA, C4A, C128A), random weights and a
    benchmark cache fill: batch 2 decode logits with BRANCH_STREAMS off, then on (eager), then on and
    captured in a CUDA graph and replayed: all equal bit for bit."""
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.model import build_rank
    from ds4lab.model.weights import random_weights
    cfg = dataclasses.replace(DEFAULT_CONFIG, num_hidden_layers=4, compress_ratios=(0, 0, 4, 128, 0))
    m = build_rank(cfg, 4, 0, random_weights(cfg, 4, 0, device="cuda", seed=0), device="cuda", backend="kernel")
    C = m.new_caches(2, 1024)
    m.fill_caches(C, 900)
    tok = torch.tensor([[11], [12]], device="cuda")
    pos = torch.tensor([[900], [900]], device="cuda")
    monkeypatch.setattr(BK, "BRANCH_STREAMS", False)
    ref = m.decode(tok, pos, C).clone()
    monkeypatch.setattr(BK, "BRANCH_STREAMS", True)
    for _ in range(3):
        assert torch.equal(m.decode(tok, pos, C), ref)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m.decode(tok, pos, C)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = m.decode(tok, pos, C)
    for _ in range(5):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
