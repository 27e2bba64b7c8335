"""l2pf (issue 20): the mHC seam launch prefetches the next ops' weights into L2
(``mhc_fused_post_pre(prefetch=...)``, ``ds4lab_kernels/_l2.py``, ``backend_kernel.SEAM_PREFETCH``).

The interpreter runs no inline PTX, so there the prefetch is a no-op by construction; what it can run is
proven here: the line offsets each part issues cover every line of a region (any base alignment) and stay
inside it, the sync's arrival ranks give the waiters distinct parts, the outputs of the seamr / seam1 rows
are bit-identical with and without ``prefetch``, bad arguments are refused naming ``prefetch``, and the
kernel backend passes the composition's tensors only with the switch on, with the tiny model's logits
unchanged. The sm_89 build (no GPU needed) proves the PTX: ``prefetch.global.L2::evict_last`` in the
seamr / seam1 kernels with ``prefetch``, none without, no spills."""
import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from ds4lab.harness.specs import mhc as S
from ds4lab.model import backend_kernel as BK
from ds4lab_kernels import _l2
from ds4lab_kernels import mhc as K

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = K.CONFIGS["sm_89"]


@triton.jit
def _offsets_kernel(out_ptr, ok_ptr, nbytes, n_parts, width, BLOCK: tl.constexpr):
    """Grid ``(n_parts + 1,)``.
    One program writes the byte offsets and mask :func:`_l2.prefetch_offsets` gives part ``program_id`` (the
    last program: a part past ``n_parts``, which must own none), loop step after loop step as ``prefetch_l2``."""
    part = tl.program_id(0)
    nlines = tl.where(nbytes > 0, (nbytes + 127) // 128 + 1, 0)
    per = tl.cdiv(nlines, n_parts)
    for off in range(0, per, BLOCK):
        byte, ok = _l2.prefetch_offsets(nbytes, part, n_parts, off, BLOCK)
        i = off + tl.arange(0, BLOCK)
        tl.store(out_ptr + part * width + i, byte, mask=i < width)
        tl.store(ok_ptr + part * width + i, ok.to(tl.int8), mask=i < width)


@pytest.mark.interp
@pytest.mark.parametrize("nbytes,n_parts", [(1, 1), (127, 3), (128, 1), (129, 63), (12_345, 7), (1_572_864, 63),
                                            (4_194_560, 63), (96, 127)])
def test_parts_cover_every_line_of_a_region_and_stay_inside_it(nbytes, n_parts):
    """The parts' offsets lie in ``[0, nbytes)``, each part issues at most ``cdiv(lines, n_parts)``, a part past
    ``n_parts`` none, and for a base at any offset within its line (0, 64, 127 bytes) the lines they touch are
    exactly the lines of the region's bytes (the clamped last offset reaches the last byte's line)."""
    lines = (nbytes + 127) // 128 + 1
    per = -(-lines // n_parts)
    width = max(per, 1) + 256
    off = torch.full((n_parts + 1, width), -1, dtype=torch.int64, device=DEVICE)
    ok = torch.zeros((n_parts + 1, width), dtype=torch.int8, device=DEVICE)
    _offsets_kernel[(n_parts + 1,)](off, ok, nbytes, n_parts, width, BLOCK=256)
    off, ok = off.cpu(), ok.cpu().bool()
    assert not ok[n_parts].any()
    assert int(ok.sum(1).max()) <= per
    got = off[ok]
    assert int(got.min()) >= 0 and int(got.max()) <= nbytes - 1
    for a in (0, 64, 127):
        touched = set(((got + a) // 128).tolist())
        assert touched == set(range(a // 128, (a + nbytes - 1) // 128 + 1)), (a, nbytes, n_parts)


@triton.jit
def _rank_kernel(old_ptr, out_ptr, n, n_programs, STEP: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(1,)``.
    One program maps ``n`` counter values returned to the sync's adds to arrival ranks (:func:`mhc._arrival_rank`)."""
    i = tl.arange(0, BLOCK)
    old = tl.load(old_ptr + i, mask=i < n, other=0)
    tl.store(out_ptr + i, K._arrival_rank(old, n_programs, STEP), mask=i < n)


@pytest.mark.interp
@pytest.mark.parametrize("n", [2, 3, 64, 128])
def test_arrival_ranks_are_the_arrival_order(n):
    """The ``_count_sync`` counter (program 0 adds ``STEP - (n - 1)``, the others 1, from a multiple of STEP,
    across the int32 wrap too): the rank each program derives from the value its add returned is its place in the
    arrival order, whatever that order; the last arriver has ``n - 1`` (the waiters own the parts 0..n-2)."""
    step = K.SEAM1_STEP
    g = torch.Generator().manual_seed(n)
    for c0 in (0, 7 * step, -2**31, 2**31 - step):
        order = torch.randperm(n, generator=g).tolist()
        olds, c = [], c0
        for p in order:
            olds.append(c)
            c += step - (n - 1) if p == 0 else 1
            c = (c + 2**31) % 2**32 - 2**31               # int32 wrap-around
        assert c % step == c0 % step
        old = torch.tensor(olds, dtype=torch.int32, device=DEVICE)
        out = torch.empty_like(old)
        _rank_kernel[(1,)](old, out, n, n, STEP=step, BLOCK=triton.next_power_of_2(n))
        assert out.cpu().tolist() == list(range(n)), (c0, order)


def _inputs(T, D=256, case="random", quant_out=False):
    inp = S.make_inputs({"T": T, "D": D}, case, int(torch.randint(0, 2**31, (1,))), DEVICE, kind="fused")
    if quant_out:
        inp["quant_out"] = True
    return inp


@pytest.mark.interp
@pytest.mark.parametrize("label,T,case,q8", [("seamr_d64", 1, "random", True), ("seamr_d64", 1, "x2", False),
                                             ("seam1_d64", 2, "x2", True), ("seam1_d64", 4, "sharp_comb", False),
                                             ("decode", 1, "random", False)])
def test_outputs_bit_identical_with_prefetch(label, T, case, q8):
    """The step's rows (seamr_d64 at T=1, seam1_d64 at 2-4, quant_out on and off) and one row that ignores the
    argument (the two-pass ``decode``): every output bit-identical with the 8 prefetch regions the step passes."""
    inp = _inputs(T, case=case, quant_out=q8)
    pf = S.prefetch_tensors(256, DEVICE)
    a = K.mhc_fused_post_pre(**inp, config=TABLE[label])
    b = K.mhc_fused_post_pre(**inp, config=TABLE[label], prefetch=pf)
    c = K.mhc_fused_post_pre(**inp, config=TABLE[label], prefetch=list(pf[:2]))
    flat = lambda r: [t for x in r for t in (x if isinstance(x, tuple) else (x,))]   # noqa: E731
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(flat(a), flat(b), flat(c)))


@pytest.mark.interp
def test_bad_prefetch_arguments_name_it():
    inp = _inputs(1)
    cfg = TABLE["seamr_d64"]
    w = torch.zeros(8, 8, device=DEVICE)
    cases = [(w, TypeError, "prefetch: expected None or a tuple/list"),
             ((w, "fn"), TypeError, r"prefetch\[1\]: expected a tensor"),
             ((w,) * (_l2.MAX_REGIONS + 1), ValueError, "prefetch: 9 tensors, at most 8"),
             ((w.t(),), ValueError, r"prefetch\[0\]: must be contiguous"),
             ((w, torch.zeros(4, device="meta")), ValueError, r"prefetch\[1\]: on meta")]
    for bad, err, msg in cases:
        with pytest.raises(err, match=msg):
            K.mhc_fused_post_pre(**inp, config=cfg, prefetch=bad)
    # empty tensors and an empty tuple are fine (nothing to prefetch)
    K.mhc_fused_post_pre(**inp, config=cfg, prefetch=(torch.zeros(0, device=DEVICE),))
    K.mhc_fused_post_pre(**inp, config=cfg, prefetch=())


def test_prefetch_kwargs_and_where_the_seam_issues_it(monkeypatch):
    """No kernel arguments on the interpreter or without regions (the kernels keep their defaults: the build of
    today); on a GPU ``PF`` regions, 2 lines a thread a loop step, the eviction policy read per launch; the seam
    prefetches only with at least 2 column programs (the waiters issue it) and in one launch's sync (two
    launches: the second); which rows issue it at which token counts."""
    regions = list(S.prefetch_tensors(256))
    assert _l2.prefetch_kwargs(regions, False, 4) == {} and _l2.prefetch_kwargs([], True, 4) == {}
    kw = _l2.prefetch_kwargs(regions, True, 4)
    assert (kw["PF"], kw["PF_BLOCK"], kw["PF_EVICT_LAST"]) == (8, 256, True)
    assert kw["pf_bytes"] == (256 * 256 * 2, 1024, 1024 * 256, 16, 24 * 1024 * 4, 12, 96, 512)
    monkeypatch.setattr(_l2, "PREFETCH_EVICT", "evict_normal")
    assert _l2.prefetch_kwargs(regions, True, 8)["PF_EVICT_LAST"] is False
    monkeypatch.setattr(_l2, "PREFETCH_EVICT", "evict_first")
    with pytest.raises(ValueError, match="PREFETCH_EVICT"):
        _l2.prefetch_kwargs(regions, True, 4)
    monkeypatch.setattr(_l2, "PREFETCH_EVICT", "evict_last")
    assert K._seam_prefetch(regions, 64, 1, 4) == ({}, {})            # the interpreter
    monkeypatch.setattr(K, "_interpreting", lambda: False)
    one, two = K._seam_prefetch(regions, 64, 1, 4)
    assert one["PF"] == 8 and two == {}
    one, two = K._seam_prefetch(regions, 64, 2, 4)
    assert one == {} and two["PF"] == 8
    assert K._seam_prefetch(regions, 1, 1, 4) == ({}, {})             # one program: no waiter
    assert K._seam_prefetch(regions, 513, 1, 4) == ({}, {})           # ranks ambiguous past STEP / 2
    assert K.prefetch_issued(1, TABLE["seamr_d64"]) and not K.prefetch_issued(4, TABLE["seamr_d64"])
    assert K.prefetch_issued(2, TABLE["seam1_d64"]) and K.prefetch_issued(4, TABLE["seam1_d64"])
    assert not K.prefetch_issued(8, TABLE["decode"]) and not K.prefetch_issued(1, TABLE["seam_d64"])


class _SeamSpy:
    """Stands in for ``ds4lab_kernels.mhc`` in a KernelBackend: records ``prefetch`` and the op-group kind."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def mhc_fused_post_pre(self, *a, prefetch=None, **k):
        self.calls.append(prefetch)
        return self.real.mhc_fused_post_pre(*a, prefetch=prefetch, **k)


@pytest.mark.interp
def test_backend_passes_prefetch_only_with_the_switch(monkeypatch):
    """``SEAM_PREFETCH`` off: the launcher gets None whatever the composition passes; on: the contiguous tensors on
    the call's device, in order (a weight elsewhere or strided is skipped, not an error), at most 8."""
    from ds4lab.checkpoint.tiny import TINY_CONFIG as cfg
    kb = BK.KernelBackend()
    spy = kb.k["mhc"] = _SeamSpy(kb.k["mhc"])
    inp = _inputs(1)
    args = (inp["x"], inp["residual"], inp["post_mix"], inp["comb_mix"], inp["fn"], inp["hc_scale"], inp["hc_base"],
            inp["norm_weight"], cfg, "mhc.test")
    w = torch.zeros(16, 16, device=DEVICE)
    pf = (w, w.t(), torch.zeros(3, device="meta"), None, torch.zeros(0, device=DEVICE)) + (w,) * 9
    monkeypatch.setattr(BK, "SEAM_PREFETCH", False)
    off = kb.mhc_post_pre(*args, prefetch=pf)
    monkeypatch.setattr(BK, "SEAM_PREFETCH", True)
    on = kb.mhc_post_pre(*args, prefetch=pf)
    kb.mhc_post_pre(*args)
    assert spy.calls[0] is None and spy.calls[2] is None
    assert len(spy.calls[1]) == 8 and all(t is w for t in spy.calls[1])
    assert all(torch.equal(a, b) for a, b in zip(off, on))


@pytest.mark.interp
def test_tiny_model_logits_bit_identical_with_seam_prefetch(monkeypatch):
    """The real composition (tiny checkpoint, kernel backend on the interpreter; its first two blocks, to keep
    it cheap: the seams do not depend on the attention kind): decode logits with ``SEAM_PREFETCH`` on equal those
    with it off, and every seam hands the backend the tensors ``RankModel`` lists for it (the last block's
    first seam, with no next seam: the router gate, the shared expert's w13 and its scale)."""
    from ds4lab.checkpoint.tiny import TINY_CONFIG as cfg
    from ds4lab.model import build_rank
    from ds4lab.model.weights import load_tiny
    torch.set_num_threads(1)
    m = build_rank(cfg, 1, 0, load_tiny(quantize=True), device=DEVICE, backend="kernel")
    m.layers = m.layers[:2]
    spy = m.ops.k["mhc"] = _SeamSpy(m.ops.k["mhc"])
    out, calls = {}, {}
    for on in (False, True):
        monkeypatch.setattr(BK, "SEAM_PREFETCH", on)
        spy.calls.clear()
        out[on] = m.decode(torch.tensor([[5]]), torch.tensor([[3]]), m.new_caches(1, 16))
        calls[on] = list(spy.calls)
    assert torch.equal(out[False], out[True])
    assert calls[False] == [None] * 3
    L0, L1 = m.layers
    want = [m._prefetch_moe(L0, L1), m._prefetch_attn(L1), (L1["gate"].weight,) + m._linear_tensors(L1["shared_w13"])]
    assert [len(p) for p in calls[True]] == [7, 8, 3]          # hash layers: no router bias
    assert all(a is b for got, w in zip(calls[True], want) for a, b in zip(got, w))
    assert want[1][0] is L1["wqkv_a"].weight and want[0][3] is L1["hc_attn_fn"]


_AOT = r"""
import json, re, subprocess, os, tempfile
from ds4lab.harness import aot
from ds4lab.harness.specs import mhc as S
from ds4lab_kernels import _l2, mhc as K
out = {}
def build(tag, label, shape, evict="evict_last"):
    _l2.PREFETCH_EVICT = evict
    inp = S.make_inputs(shape, "random", 0, "cpu", kind="fused")
    with aot.capture_compiles("sm_89") as cap:
        K.mhc_fused_post_pre(**inp, config=K.CONFIGS["sm_89"][label])
    (fn, c), = cap
    info = aot._inspect(c, "sm_89")
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.cubin"), "wb").write(c.asm["cubin"])
        sass = subprocess.run([aot._tool("cuobjdump"), "-sass", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True).stdout
    ptx = c.asm["ptx"]
    info.update(fn=fn.__name__, last=ptx.count("prefetch.global.L2::evict_last"),
                normal=ptx.count("prefetch.global.L2::evict_normal"), any=ptx.count("prefetch."),
                pml2=len(re.findall(r"CCTL\.E\.PML2", sass)), pf2=len(re.findall(r"CCTL\.E\.PF2", sass)))
    out[tag] = info
for sh in S.AOT_SHAPES_PREFETCH:
    label = S.step_row(sh["T"])
    build(f"on:{label}:T{sh['T']}", label, sh)
    build(f"off:{label}:T{sh['T']}", label, {k: v for k, v in sh.items() if k != "prefetch"})
sh = S.AOT_SHAPES_PREFETCH[0]
build("normal:seamr_d64:T1", "seamr_d64", sh, "evict_normal")
build("on:seamr_d64:T4", "seamr_d64", dict(sh, T=4))     # 4-token blocks: the launcher leaves it out
print("JSON" + json.dumps(out))
"""


@pytest.mark.aot
def test_sm89_build_issues_the_prefetch_only_with_it():
    """sm_89 PTX of the step's rows with the step's 8 regions: 2 ``prefetch.global.L2::evict_last`` a region (a
    loop step: 256 lines over 128 threads), assembled to ``CCTL.E.PML2``; none without ``prefetch`` (and none in
    the 4-token seamr block, which the launcher leaves out); ``_l2.PREFETCH_EVICT = "evict_normal"`` gives
    ``::evict_normal`` (``CCTL.E.PF2``). No spills; within 2 programs a SM."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", _AOT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    got = json.loads(p.stdout.split("JSON", 1)[1])
    issued = {"on:seamr_d64:T1": 16, "on:seam1_d64:T2": 16, "on:seam1_d64:T4": 16, "on:seamr_d64:T4": 0}
    assert set(issued) <= set(got)
    for tag, r in got.items():
        print(tag, r["fn"], "regs", r["registers"], "smem", r["shared"], "spill", r["spill_stores"], r["spill_loads"])
        assert r["spill_stores"] == r["spill_loads"] == r["local"] == 0, (tag, r)
        assert -(-r["registers"] // 8) * 8 * 32 * r["num_warps"] * K.resident_per_sm(r["num_warps"]) <= 65536, (tag, r)
        if tag.startswith("normal:"):
            assert (r["last"], r["normal"], r["pf2"], r["pml2"]) == (0, 16, 16, 0), (tag, r)
        else:
            n = issued.get(tag, 0)
            assert (r["last"], r["any"], r["pml2"], r["pf2"]) == (n, n, n, 0), (tag, r)


HAS_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (the prefetch is inline PTX)")
def test_gpu_prefetch_is_bit_identical_in_the_kernel_and_the_step(monkeypatch):
    """On a GPU the prefetch runs: the seam at D=4096 (T = 1, 2, 4: the rows that issue it) gives the same bits
    with the step's 8 regions as without; and the real step (TP=4 rank 0, the first 4 layers, a benchmark cache
    fill to 1,022 tokens, decoding position 1,022, or 1,022-1,023 at next_n 2) gives bit-identical logits with
    ``SEAM_PREFETCH`` on and off, at batch 1 (seamr) and next_n 2 (seam1), eager and replayed from a CUDA graph."""
    import dataclasses
    from ds4lab.geometry import DEFAULT_CONFIG
    from ds4lab.model import build_rank
    from ds4lab.model.weights import random_weights
    for T in (1, 2, 4):
        inp = S.make_inputs({"T": T, "D": 4096}, "x2", T, "cuda", kind="fused")
        cfg = K.pick_config(T, torch.device("cuda"), fused=True)
        assert K.prefetch_issued(T, cfg)
        pf = S.prefetch_tensors(4096, "cuda")
        a = K.mhc_fused_post_pre(**inp, quant_out=True)
        b = K.mhc_fused_post_pre(**inp, quant_out=True, prefetch=pf)
        assert all(torch.equal(x, y) for x, y in zip(a[:4] + a[4], b[:4] + b[4])), T
    mcfg = dataclasses.replace(DEFAULT_CONFIG, num_hidden_layers=4, compress_ratios=(0, 0, 4, 128, 0))
    m = build_rank(mcfg, 4, 0, random_weights(mcfg, 4, 0, device="cuda", seed=0), device="cuda", backend="kernel")
    from test_branch_streams import _tensors
    C = m.new_caches(1, 1024)
    m.fill_caches(C, 1022)
    cache_tensors = _tensors(C)
    pristine = [t.clone() for t in cache_tensors]

    def reset():
        for t, s0 in zip(cache_tensors, pristine):
            t.copy_(s0)
    for tok, pos in (([[11]], [[1022]]), ([[11, 12]], [[1022, 1023]])):
        tok, pos = torch.tensor(tok, device="cuda"), torch.tensor(pos, device="cuda")
        monkeypatch.setattr(BK, "SEAM_PREFETCH", False)
        reset()
        ref = m.decode(tok, pos, C).clone()
        monkeypatch.setattr(BK, "SEAM_PREFETCH", True)
        for _ in range(2):
            reset()
            assert torch.equal(m.decode(tok, pos, C), ref)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            reset()
            m.decode(tok, pos, C)
        torch.cuda.current_stream().wait_stream(s)
        reset()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = m.decode(tok, pos, C)
        for _ in range(3):
            reset()
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref)
