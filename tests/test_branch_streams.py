"""The composition's side chains (``Backend.branch`` / ``join``; the kernel backend runs them on a second
CUDA stream with ``backend_kernel.BRANCH_STREAMS``).

On a CPU: the contract the composition must keep for the streams to be safe, checked on the real
composition over the reference twin (every tensor an op returns or writes in place inside a branch is read
by no op issued after the branch before its join, and nothing the branch reads is overwritten then; every
branch is joined), and the no-op behaviour without CUDA.
On a GPU: the step's logits with the switch on are bit-identical to the switch off, eager and replayed
from a CUDA graph (same kernels, same inputs; a missing join would show as a race)."""
import dataclasses

import pytest
import torch

from ds4lab.model import backend_kernel as BK
from ds4lab.model.ops import Backend

HAS_CUDA = torch.cuda.is_available()


def _tensors(obj, out=None):
    """Every tensor in ``obj`` (nested lists / tuples / dicts / dataclasses such as the caches)."""
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _tensors(getattr(obj, f.name), out)
    return out


def _storages(obj, out=None):
    out = set() if out is None else out
    out.update(t.untyped_storage().data_ptr() for t in _tensors(obj))
    return out


class _BranchAudit:
    """Wraps a backend. Inside a branch it records what each op returns and every input it writes in place
    (a cache insert: its ``_version`` moves) as the branch's results, and every input as the branch's
    reads. Between a branch and its join it flags an op that takes a branch result (a read the second
    stream would race) or writes in place what the branch reads (a write it would race)."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.open: dict[int, set] = {}      # branch id -> storages its ops returned or wrote
        self.reads: dict[int, set] = {}     # branch id -> storages its ops took
        self.current: int | None = None
        self.violations: list[str] = []
        self.branches = self.joins = 0
        self.blocks: list[str | None] = []
        self.order: list[str] = []          # every op issued, "method" or "method:first string argument"

    def branch(self, device, block=None):
        audit = self
        self.blocks.append(block)

        class _Ctx:
            def __enter__(self):
                audit.branches += 1
                self.id = audit.branches
                audit.open[self.id], audit.reads[self.id] = set(), set()
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
            self.reads.pop(br.id, None)

    def __getattr__(self, name):
        fn = getattr(self.inner, name)
        if not callable(fn) or name.startswith("_"):
            return fn

        def call(*a, **k):
            label = next((v for v in a if isinstance(v, str)), None)
            self.order.append(f"{name}:{label}" if label else name)
            args = _tensors((a, k))
            before = [t._version for t in args]
            taken = _storages(args)
            if self.current is None and self.open:
                if taken & set().union(*self.open.values()):
                    self.violations.append(f"{name} reads a branch result before its join")
            out = fn(*a, **k)
            written = {t.untyped_storage().data_ptr() for t, v in zip(args, before) if t._version != v}
            if self.current is not None:
                self.open[self.current] |= _storages(out) | written
                self.reads[self.current] |= taken
            elif self.reads and written & set().union(*self.reads.values()):
                self.violations.append(f"{name} writes what a branch reads before its join")
            return out
        return call


@pytest.mark.parametrize("main_first", [False, True], ids=["side_first", "main_first"])
def test_every_branch_result_is_read_only_after_its_join(main_first):
    """The real composition (tiny checkpoint, reference twin: SWA, C4A and C128A layers, hash and bias
    routing), decoding at compressor boundaries (positions 127 and 131: both requests close a ratio-4
    window, the first also a ratio-128 one, so the compressors write the cache entries the attention then
    reads): the step opens branches, joins each one, reads no branch result and overwrites nothing a branch
    reads before the join."""
    from ds4lab.checkpoint.tiny import TINY_CONFIG as cfg
    from ds4lab.model import build_rank
    from ds4lab.model.weights import load_tiny
    m = build_rank(cfg, 1, 0, load_tiny(), device="cpu", backend="reference")
    if main_first:      # each fork's main-chain head (wqkv_a, the router) issued between the fork and the branch
        m.ops.branch_main_first = lambda block: True
    audit = _BranchAudit(m.ops)
    m.ops = audit
    C = m.new_caches(2, 136)
    comp = [L.comp for L in C.layers if L.comp is not None]
    versions = [t._version for t in comp]
    m.decode(torch.tensor([[300], [301]]), torch.tensor([[127], [131]]), C)
    assert all(t._version != v for t, v in zip(comp, versions))   # the boundary entries were written
    ratios = [r for r in cfg.compress_ratios[:cfg.num_hidden_layers]]
    assert audit.branches == sum(1 for r in ratios if r) + cfg.num_hidden_layers   # attention side chains + MoE
    assert audit.joins == audit.branches and not audit.open
    assert audit.violations == []
    assert set(audit.blocks) == {"attn", "moe"} and audit.blocks.count("moe") == cfg.num_hidden_layers
    # the order of each fork's first side op and the main chain's head (the first layer with a compressor)
    side_attn = next(k for k, n in enumerate(audit.order) if n in ("linear:attn.x_proj", "linear:attn.compressor.wkv_gate"))
    seam = max(k for k in range(side_attn) if audit.order[k].startswith("mhc_"))    # the layer's input
    assert ("linear:attn.wqkv_a" in audit.order[seam:side_attn]) == main_first
    assert (audit.order.index("gate_route") < audit.order.index("linear:moe.shared_w13")) == main_first


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


def test_the_audit_catches_a_cache_written_in_a_branch_and_read_early():
    """An in-place write inside a branch (a cache insert returns nothing) is a branch result too; and a
    main-chain op that overwrites what a branch reads before the join is flagged."""
    class Toy(Backend):
        def insert(self, cache, v, name):
            cache[0] = v

        def read(self, cache, name):
            return cache.sum()

    cache, other = torch.zeros(4), torch.zeros(4)
    audit = _BranchAudit(Toy())
    with audit.branch("cpu") as br:
        audit.insert(cache, 1.0, "side")
        audit.read(other, "side")
    audit.read(cache, "main")
    audit.insert(other, 2.0, "main")
    audit.join(br)
    audit.read(cache, "main")
    assert audit.violations == ["read reads a branch result before its join",
                                "insert writes what a branch reads before its join"]


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


def test_step_scope_is_the_callers_stream_without_cuda(monkeypatch):
    """``BRANCH_PRIORITY`` on a CPU device: no stream is made, the scope is a no-op."""
    monkeypatch.setattr(BK, "BRANCH_STREAMS", True)
    monkeypatch.setattr(BK, "BRANCH_PRIORITY", True)
    kb = BK.KernelBackend()
    with kb.step_scope(torch.device("cpu")) as sc:
        pass
    assert sc is None and kb._main == {}


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
@pytest.mark.parametrize("main_first, priority", [((), False), (("attn", "moe"), False), ((), True)],
                         ids=["side_first", "main_first", "priority"])
def test_streams_give_bit_identical_logits_eager_and_in_a_graph(monkeypatch, main_first, priority):
    """Real shapes (TP=4 rank 0), the first 4 layers (SWA, SWA, C4A, C128A), random weights and a
    benchmark cache fill to 1,023 tokens, decoding position 1,023: both compressors close a window there
    and write the entry the attention then reads, so a late join would read the entry's stale bytes. Every
    run starts from the same cache bytes; batch 2 decode logits with BRANCH_STREAMS off, then on (eager),
    then on and captured in a CUDA graph and replayed: all equal bit for bit; with each fork's main-chain
    head issued before or after its side chain (``BRANCH_MAIN_FIRST``); with the main chain on a high-priority
    stream (``BRANCH_PRIORITY``)."""
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.model import build_rank
    from ds4lab.model.weights import random_weights
    cfg = dataclasses.replace(DEFAULT_CONFIG, num_hidden_layers=4, compress_ratios=(0, 0, 4, 128, 0))
    m = build_rank(cfg, 4, 0, random_weights(cfg, 4, 0, device="cuda", seed=0), device="cuda", backend="kernel")
    C = m.new_caches(2, 1024)
    m.fill_caches(C, 1023)
    cache_tensors = _tensors(C)
    pristine = [t.clone() for t in cache_tensors]

    def reset():
        for t, s0 in zip(cache_tensors, pristine):
            t.copy_(s0)
    tok = torch.tensor([[11], [12]], device="cuda")
    pos = torch.tensor([[1023], [1023]], device="cuda")
    monkeypatch.setattr(BK, "BRANCH_STREAMS", False)
    reset()
    ref = m.decode(tok, pos, C).clone()
    monkeypatch.setattr(BK, "BRANCH_STREAMS", True)
    monkeypatch.setattr(BK, "BRANCH_MAIN_FIRST", main_first)
    monkeypatch.setattr(BK, "BRANCH_PRIORITY", priority)
    for _ in range(3):
        reset()
        assert torch.equal(m.decode(tok, pos, C), ref)
    reset()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m.decode(tok, pos, C)
    torch.cuda.current_stream().wait_stream(s)
    reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = m.decode(tok, pos, C)
    for _ in range(5):
        reset()
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
