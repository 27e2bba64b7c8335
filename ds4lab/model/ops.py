"""The primitive-op interface the DeepSeek-V4 composition (:mod:`ds4lab.model.model`) calls.

One composition runs over two op backends with the same methods (:class:`Backend`):

- ``kernel`` (:mod:`ds4lab.model.backend_kernel`): every op a ds4lab Triton launcher where one
  exists, else a torch op labelled as such;
- ``reference`` (:mod:`ds4lab.model.backend_ref`): the reference twin, built only from
  :mod:`ds4lab.reference` (float64 over the dequantized weights, the model's bf16 boundaries kept).

Every op call runs inside :func:`op_group` ``(name, kind)``: ``name`` is the op group of the step
profile (``"attn.wq_b"``, ``"moe.experts"``, ...; the composition passes it), ``kind`` says what
runs it: ``"kernel:<ds4lab launcher>"`` or ``"torch:<what>"`` (a profile can therefore list what
still has no kernel). A module-level hook (:func:`set_hook`, default none) sees every group's
entry and exit, so the step benchmark can record CUDA events or count launches per group::

    class Hook:
        def enter(self, name: str, kind: str) -> None: ...
        def exit(self, name: str, kind: str) -> None: ...

Weights reach the ops as :class:`Linear` (FP8 e4m3 with 128x128 UE8M0 block scales, or bf16) and
:class:`Experts` (packed INT4 W4A16, or bf16 for the tiny checkpoint as vLLM-CPU serves it).
A linear with an FP8 weight quantizes its activation 1x128 (UE8M0 scale) first (vLLM
``W8A8BlockFp8LinearOp``, DeepGEMM ``fp8_gemm_nt``); a bf16 weight multiplies the bf16 input as is.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Hook", "set_hook", "get_hook", "op_group", "Linear", "Experts", "Backend", "GROUP"]

GROUP = 128  # FP8 block / activation group


class Hook(Protocol):
    """What :func:`op_group` calls around every op (both methods must be cheap and sync-free)."""

    def enter(self, name: str, kind: str) -> None: ...

    def exit(self, name: str, kind: str) -> None: ...


_HOOK: Hook | None = None


def set_hook(hook: Hook | None) -> Hook | None:
    """Install ``hook`` (or None to remove it) for every later :func:`op_group`; returns the old one."""
    global _HOOK
    old, _HOOK = _HOOK, hook
    return old


def get_hook() -> Hook | None:
    return _HOOK


@contextlib.contextmanager
def op_group(name: str, kind: str):
    """Run the enclosed op(s) as group ``name`` executed by ``kind`` (``kernel:<launcher>`` or
    ``torch:<what>``); the installed hook (if any) sees ``enter`` before and ``exit`` after."""
    h = _HOOK
    if h is None:
        yield
        return
    h.enter(name, kind)
    try:
        yield
    finally:
        h.exit(name, kind)


@dataclass
class Linear:
    """One linear ``y = x W^T``: ``weight`` ``(N, K)`` float8_e4m3fn with ``scale``
    ``(ceil(N/128), K/128)`` uint8 UE8M0 exponents (``2^(b-127)``), or bfloat16 with ``scale=None``."""
    weight: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.scale is not None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequant(self, dtype=torch.float64) -> torch.Tensor:
        """``(N, K)`` in ``dtype``: bf16 upcast, or e4m3 times its block scale (exact)."""
        w = self.weight.to(dtype)
        if self.scale is None:
            return w
        s = (self.scale.to(torch.int32) << 23).view(torch.float32).to(dtype)
        s = s.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)
        return w * s[: w.shape[0], : w.shape[1]]


@dataclass
class Experts:
    """One layer's routed experts at one rank. INT4 (compressed-tensors pack-quantized, the
    ``moe_w4a16`` layout): ``w13_packed (E, 2I, D/8)`` int32, ``w13_scale (E, 2I, D/128)``,
    ``w2_packed (E, D, I/8)``, ``w2_scale (E, D, I/128)``; or dense bf16 ``w13 (E, 2I, D)``,
    ``w2 (E, D, I)`` (rows ``[0, I)`` of w13 are the gate ``w1``, ``[I, 2I)`` the up ``w3``)."""
    w13_packed: torch.Tensor | None = None
    w13_scale: torch.Tensor | None = None
    w2_packed: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13: torch.Tensor | None = None
    w2: torch.Tensor | None = None

    @property
    def int4(self) -> bool:
        return self.w13_packed is not None

    @property
    def num_experts(self) -> int:
        return (self.w13_packed if self.int4 else self.w13).shape[0]


class Backend:
    """The primitive ops. Shapes: ``T`` tokens of the step, ``D`` hidden, ``H`` local heads,
    ``hd`` = 512 head dim, ``r`` = 64 rope dims (the LAST r of a head, GPT-J interleaved pairs).
    ``cos_sin`` is a ``(max_pos, r)`` float32 table ``cos || sin`` (:mod:`ds4lab.reference.rope`).
    Every method takes ``name`` (its op group) and returns new tensors unless it says "in place".
    """

    name = "abstract"

    # ---- concurrency -----------------------------------------------------------------------
    def branch(self, device, block: str | None = None):
        """A side chain of the step: ``with backend.branch(x.device, "attn") as br:`` the ops issued in the block
        read only what was issued before the block, and nothing issued after it reads their results (or
        writes what they read) until :meth:`join` ``(br)``. This default runs them in issue order: the
        context is a no-op and ``br`` is None. A backend may run the block concurrently with what follows
        (the kernel backend: a second CUDA stream, :data:`ds4lab.model.backend_kernel.BRANCH_STREAMS`).
        ``block``: which fork of the layer this is (``"attn"``: the compressors beside the q chain; ``"moe"``: the
        shared expert beside the router), so that a backend can fork some and not others.

        A branch must not share per-device scratch with what the main chain runs meanwhile: the kernels'
        split-K arrival counters are one buffer per device and launcher family (``fp8_gemm``, ``o_proj``,
        ``moe_w4a16``, ``moe_gate``, ...). Today's forks keep to it: the attention side chain runs bf16 linears
        (torch) and the compressors beside the FP8 q chain; the MoE side chain runs the FP8 shared expert beside
        the router alone. An FP8 linear moved into the attention side chain would share ``fp8_gemm``'s
        counters with ``wqkv_a`` / ``wq_b``."""
        return contextlib.nullcontext()

    def join(self, br) -> None:
        """Make every op issued after this call wait for branch ``br`` (what :meth:`branch` gave; None:
        nothing to wait for). Every branch must be joined before the step ends (a CUDA graph capture
        fails on an unjoined stream)."""

    def step_scope(self, device):
        """The context the composition issues a step's layers in (``with backend.step_scope(x.device):``): ops
        inside read what was issued before it, and what is issued after it may read their results. Default: a
        no-op (the caller's stream). A backend that runs side chains concurrently may issue the main chain on a
        stream of its own there (the kernel backend: a higher-priority stream, ``BRANCH_PRIORITY``)."""
        return contextlib.nullcontext()

    def branch_main_first(self, block: str) -> bool:
        """Whether the composition issues the main chain's first op of fork ``block`` after making the branch
        (``fork = backend.branch(...)``) and before entering it (``with fork as br:``). The branch's fork point
        is where it was made, so the two orders compute the same; a backend that runs branches concurrently
        may prefer one launch order. Default: False (the side chain first)."""
        return False

    # ---- dense glue ------------------------------------------------------------------------
    def embed(self, ids, table, name="embed"):
        """``ids (T,)`` int -> ``table[ids]`` ``(T, D)`` bf16."""
        raise NotImplementedError

    def rmsnorm(self, x, weight, eps, name):
        """``bf16(x rsqrt(mean(x^2) + eps) w)`` over the last dim (fp32/fp64 math)."""
        raise NotImplementedError

    def linear(self, x, lin: Linear, name, out_dtype=torch.bfloat16):
        """``x (T, K)`` bf16 -> ``x W^T`` ``(T, N)`` in ``out_dtype`` (FP8 weight: 1x128 UE8M0
        activation quant + block-scaled GEMM; bf16 weight: bf16 product, fp32 accumulate)."""
        raise NotImplementedError

    def q_kv_norm_rope(self, qkv, q_dim, q_weight, kv_weight, eps, positions, cos_sin, name="attn.q_kv_norm_rope",
                       swa_cache=None, swa_slots=None, swa_block=64):
        """``qkv (T, q_dim + hd)`` bf16 (the ``wqkv_a`` output) -> ``(qr (T, q_dim), kv (T, hd))`` bf16:
        ``qr = rmsnorm(qkv[:, :q_dim], q_weight)``, ``kv = rope(rmsnorm(qkv[:, q_dim:], kv_weight))``
        (each norm's bf16 output kept, as vLLM's ``q_norm`` / ``kv_norm`` modules round there). This
        default runs the three ops (groups ``attn.q_norm``, ``attn.kv_norm``, ``attn.kv_rope``); a
        backend may fuse them. ``swa_cache`` given: the kv goes into that fp8_ds_mla cache at
        ``swa_slots (T,)`` (block ``swa_block``; -1 skips) instead of coming back, and only ``qr`` is
        returned; this default composes :meth:`mla_cache_write` (group ``attn.swa_insert``), a backend
        may write the entries in the producing launch."""
        q = self.rmsnorm(qkv[:, :q_dim], q_weight, eps, "attn.q_norm")
        kv = self.rmsnorm(qkv[:, q_dim:], kv_weight, eps, "attn.kv_norm")
        kv = self.rope(kv, positions, cos_sin, "attn.kv_rope")
        if swa_cache is None:
            return q, kv
        self.mla_cache_write(kv, swa_slots, swa_cache, swa_block, "attn.swa_insert")
        return q

    def q_norm_rope(self, q, positions, cos_sin, eps, name="attn.q_norm_rope"):
        """``q (T, H, hd)`` bf16: per-head weight-free RMSNorm, then forward RoPE on the last r
        dims at ``positions`` -> bf16 (vLLM ``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert``, Q side)."""
        raise NotImplementedError

    def rope(self, x, positions, cos_sin, name):
        """Forward GPT-J RoPE on the last r dims of ``x (T, ..., d)`` at ``positions`` -> bf16."""
        raise NotImplementedError

    # ---- the step's index maps --------------------------------------------------------------
    def index_maps(self, positions, req, window, swa_ring, layers, name="step.maps"):
        """Every index the step's layers need from ``positions, req (T,)`` int64 and the caches'
        static sizes (``layers``: ``Caches.map_sizes()``), once per forward: the dict of
        :func:`ds4lab.reference.step_maps.step_index_maps` (SWA slots / window / lengths, per
        compressed-cache size the write slots, counts, bases and C128 slot lists, per compressor
        state ring the window rows). This default runs that torch reference (~60 small launches)."""
        from ds4lab.reference.step_maps import step_index_maps
        with op_group(name, "torch:index_maps"):
            return step_index_maps(positions, req, window, swa_ring, layers)

    # ---- caches ----------------------------------------------------------------------------
    def mla_cache_write(self, kv, slots, cache, block_size, name):
        """fp8_ds_mla insert of ``kv (T, 512)`` bf16 at ``slots (T,)`` (-1 skips), in place."""
        raise NotImplementedError

    def indexer_cache_write(self, k, slots, cache, name):
        """Indexer K insert of ``k (T, 128)`` bf16 (e4m3 + fp32 pow2 scale), in place."""
        raise NotImplementedError

    def compressor(self, kv_score, positions, state, state_slots, window_slots, window_valid, ape,
                   norm_weight, eps, ratio, cos_sin, name):
        """The DeepSeek-V4 compressor (see :mod:`ds4lab.reference.compressor`): saves each
        token's ``(kv, score + ape[pos % ratio])`` (``kv_score (T, 2*coff*hd)`` fp32) into ``state``
        (in place, rows ``state_slots (T,)``), then for every token compresses the state rows
        ``window_slots (T, coff*ratio)`` (``window_valid`` masks positions < 0) and returns the
        normed, rotated entry ``(T, hd)`` bf16 (meaningful where ``(pos + 1) % ratio == 0``; the
        caller writes only those)."""
        raise NotImplementedError

    def compressor_insert(self, kv_score, positions, state, state_slots, window_slots, window_valid, ape,
                          norm_weight, eps, ratio, cos_sin, name, cache, cache_slots, block_size=None,
                          insert_name=None):
        """:meth:`compressor`, then its entries written into ``cache`` at ``cache_slots (T,)`` (-1 off a
        ratio boundary skips) instead of coming back (returns None): ``hd`` 512 an fp8_ds_mla cache
        (``block_size`` entries per block, :meth:`mla_cache_write`), ``hd`` 128 the indexer K cache
        (:meth:`indexer_cache_write`). This default composes the two (the write as group
        ``insert_name``); a backend may write the entries in the compressing launch."""
        c = self.compressor(kv_score, positions, state, state_slots, window_slots, window_valid, ape, norm_weight,
                            eps, ratio, cos_sin, name)
        if c.shape[1] == 128:
            self.indexer_cache_write(c, cache_slots, cache, insert_name or name + ".insert")
        else:
            self.mla_cache_write(c, cache_slots, cache, block_size, insert_name or name + ".insert")

    # ---- indexer ---------------------------------------------------------------------------
    def indexer_q(self, q, positions, cos_sin, weights, name="indexer.q_quant"):
        """``q (T, 64, 128)`` bf16, ``weights (T, 64)`` -> ``(q_fp8, w fp32)``: RoPE, bf16
        round, per-(token, head) pow2 scale folded into ``w`` with ``128^-0.5 * 64^-0.5``."""
        raise NotImplementedError

    def q_norm_rope_indexer_q(self, q, iq, positions, cos_sin, weights, eps, name="attn.q_norm_rope+indexer.q_quant"):
        """A C4A layer's two q preparations: :meth:`q_norm_rope` of ``q (T, H, hd)`` and :meth:`indexer_q` of
        ``iq (T, 64, 128)`` with ``weights (T, 64)`` -> ``(q_normed bf16, q_fp8, w fp32)``. This default runs
        the two ops (their own groups); a backend may run both in one launch (group ``name``, the same bits)."""
        return (self.q_norm_rope(q, positions, cos_sin, eps),) + tuple(self.indexer_q(iq, positions, cos_sin, weights))

    def indexer_topk(self, q_fp8, w, cache, block_table, req, limits, max_len, topk, name, next_n=None,
                     slot_base=None):
        """Indexer logits over request ``req[t]``'s compressed entries ``j < limits[t]`` and the
        top-``topk`` local indices ``(T, topk)`` int32 (ascending, -1 padded). ``next_n`` (decode
        only): the rows are ``(B, next_n)`` with row ``b*next_n + i`` of request ``b`` (a kernel may
        read each request's cache once for its rows); None: any ``req``. ``slot_base`` ``(T,)`` int32:
        added to every selected index (-1 kept), so the result is compressed-cache slots."""
        raise NotImplementedError

    # ---- attention -------------------------------------------------------------------------
    def sparse_mla(self, q, swa_cache, swa_slots, swa_lens, sink, comp_cache, comp_slots, comp_lens,
                   swa_block, comp_block, scale, name="attn.sparse_mla"):
        """Sparse MLA with sink over the fp8_ds_mla caches -> ``(T, H, 512)`` bf16 (``q``: the bf16 output
        of :meth:`q_norm_rope`)."""
        raise NotImplementedError

    def o_proj(self, o, positions, cos_sin, wo_a: Linear, wo_b: Linear, n_groups, name="attn.o_proj"):
        """Inverse RoPE -> grouped ``wo_a`` -> ``wo_b`` -> ``(T, D)`` bf16."""
        raise NotImplementedError

    def sparse_mla_o_proj(self, q, swa_cache, swa_slots, swa_lens, sink, comp_cache, comp_slots, comp_lens,
                          swa_block, comp_block, scale, positions, cos_sin, wo_a: Linear, wo_b: Linear, n_groups):
        """:meth:`sparse_mla` (group ``attn.sparse_mla``) then :meth:`o_proj` of its output at ``positions``
        (group ``attn.o_proj``) -> ``(T, D)`` bf16. This default composes the two; a backend may write
        o_proj's rotated, quantized input from the attention launch itself (the kernel backend with
        ``FUSE_O_QUANT``: the same bits, one launch fewer)."""
        a = self.sparse_mla(q, swa_cache, swa_slots, swa_lens, sink, comp_cache, comp_slots, comp_lens, swa_block,
                            comp_block, scale)
        return self.o_proj(a, positions, cos_sin, wo_a, wo_b, n_groups)

    # ---- mHC -------------------------------------------------------------------------------
    def mhc_pre(self, residual, fn, scale, base, norm_weight, cfg, name):
        """``(post (T,4,1), comb (T,4,4), layer_input (T, D) bf16)`` (attn/ffn norm fused)."""
        raise NotImplementedError

    def mhc_post(self, x, residual, post, comb, name, x2=None):
        """``new residual (T, 4, D)`` bf16. ``x`` ``(T, D)`` bf16, or fp32 (the MoE's sum from :meth:`experts`
        with ``out``, used as is). ``x2``: optional second sublayer output ``(T, D)`` bf16, summed into ``x``
        as ``(x.float() + x2.float()).to(bf16)`` first (a separate add's rounding)."""
        raise NotImplementedError

    def mhc_post_pre(self, x, residual, post, comb, fn, scale, base, norm_weight, cfg, name, x2=None, prefetch=None):
        """The seam between two sublayers: ``mhc_post`` (``x2`` as there) then ``mhc_pre`` (a backend may
        fuse them) -> ``(new residual (T, 4, D) bf16, post, comb, layer_input)``. ``prefetch``: a tuple of the
        tensors the next ops read (weights), a hint a backend may act on (the kernel backend's L2 prefetch from
        the seam launch, ``SEAM_PREFETCH``); it never changes a result, and this default ignores it."""
        r = self.mhc_post(x, residual, post, comb, name + ".post", x2=x2)
        return (r, *self.mhc_pre(r, fn, scale, base, norm_weight, cfg, name + ".pre"))

    def hc_head(self, residual, fn, scale, base, cfg, name="head.hc_head"):
        """``(T, D)`` bf16 collapse of the 4 streams."""
        raise NotImplementedError

    # ---- MoE -------------------------------------------------------------------------------
    def route(self, logits, bias, topk, scaling, ids, tid2eid, name="moe.route"):
        """sqrtsoftplus (+bias) or hash routing -> ``(weights fp32 (T,k), ids int32 (T,k))``."""
        raise NotImplementedError

    def gate_route(self, x, gate: Linear, bias, topk, scaling, ids, tid2eid, name="moe.gate_route"):
        """The router gate ``x (T, D)`` bf16 -> fp32 logits ``x gate^T`` (``gate (E, D)``), then
        :meth:`route` -> ``(weights fp32 (T,k), ids int32 (T,k))`` (a backend may fuse the two)."""
        lg = self.linear(x, gate, "moe.gate", out_dtype=torch.float32)
        return self.route(lg, bias, topk, scaling, ids, tid2eid)

    def experts(self, x, ex: Experts, weights, ids, limit, name="moe.experts", out=None):
        """Routed experts with the SwiGLU clamp -> ``(T, D)`` bf16. ``out``: a ``(T, D)`` float32 tensor
        holding the shared expert's output (:meth:`linear_swiglu` with ``out_dtype=float32``); the routed
        sum is added into it in place and ``out`` returned, the MoE's output for the mHC post. How the sum
        rounds is the backend's: the kernel backend keeps it in fp32 (the experts kernel's last launch adds
        the routed sum into it); the reference rounds as vLLM does, ``bf16(bf16(routed) + bf16(shared))``."""
        raise NotImplementedError

    def swiglu(self, gu, limit, name):
        """``gu (T, 2I)`` -> ``bf16(silu(min(g, L)) * clamp(u, -L, L))``."""
        raise NotImplementedError

    def linear_swiglu(self, gu, lin: Linear, limit, name, act_name, out_dtype=torch.bfloat16):
        """``linear(swiglu(gu, limit, act_name), lin, name, out_dtype)``: the shared expert's down projection
        of its clamped SwiGLU (``out_dtype`` float32: the buffer the routed experts add into). A backend may
        fuse the two (the kernel backend's one-launch path)."""
        return self.linear(self.swiglu(gu, limit, act_name), lin, name, out_dtype=out_dtype)

    def add(self, a, b, name):
        """``bf16(a + b)``."""
        raise NotImplementedError
