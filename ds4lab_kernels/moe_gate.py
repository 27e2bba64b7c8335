"""DeepSeek-V4 router in one launch: the gate GEMM (bf16 hidden states x bf16 gate weight -> fp32
logits) fused with the sqrtsoftplus + bias top-k (or hash) routing of :mod:`.moe_routing`.

Semantics: vLLM 0.32 ``models/deepseek_v4/nvidia/model.py`` ``DeepseekV4MoE``: ``self.gate`` is a
``GateLinear(hidden_size, n_routed_experts, bias=False, out_dtype=torch.float32)`` whose weight is
stored in the model dtype (bf16); its router GEMM multiplies bf16 by bf16 with fp32 accumulation
and returns fp32 ``router_logits``, which ``fused_topk_bias`` routes (``sqrtsoftplus`` scores,
``e_score_correction_bias`` for the selection only, renormalised, times
``routed_scaling_factor``; hash layers ``tid2eid[input_ids]``). bf16 x bf16 products are exact in
fp32, so the logits equal ``F.linear(x.float(), W.float())`` up to fp32 summation order.

How one launch does it (grid ``(n_eb = cdiv(E, BLOCK_E), SPLIT_K, cdiv(T, BLOCK_T))``): each
program computes a ``[BLOCK_T, BLOCK_E]`` fp32 partial product over its ``K / SPLIT_K`` slice with
``tl.dot`` and stores it to a workspace ``(SPLIT_K, T, E)``. The tail is two-level, so no program
walks every partial: (1) each expert block has an arrival counter; the program that draws its
last ticket (``atomic_add``, acq_rel, after a CTA barrier so every thread's stores are released)
sums that block's ``SPLIT_K`` partials in split order 0, 1, ... (all loads in flight at once;
deterministic: the same logits bit for bit on every run, whatever the arrival order) and stores
the block's logits; (2) it then takes a ticket of the token block's counter, and the last of the
``n_eb`` expert-block reducers routes the block: the top-k selection packs score and id into one
int64 key, one max reduction per pick (the hash path runs ``moe_routing.route_tile``). With
``SPLIT_K == 1`` the products are the logits (level 2 only; one expert block: no counter). Each
counter is reset to 0 by the program that drew its last ticket, so the next launch (or CUDA-graph
replay) finds it zeroed: no memset launch, no host sync. The counter buffer is allocated once per
device and shared by every call: calls on one device must not run concurrently on two streams
(pass ``arrivals`` of your own there).
"""
import torch
import triton
import triton.language as tl

from . import _checks as check
from ._counters import zeroed_counters
from ._arch import arch_of
from .moe_routing import _sqrt_softplus, check_routing_args, route_tile, slot_sum


@triton.jit(do_not_specialize=["T"])   # one build serves every token count (decode: 1, 2, 16, 32)
def _gate_topk_kernel(
    x_ptr, wg_ptr, part_ptr, lg_ptr, cnt_ptr, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr,
    T, E, K, k_per_split, vocab, stride_xt, stride_we, stride_tv, scaling,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, E_P2: tl.constexpr, TAIL_T: tl.constexpr,
    RED_T: tl.constexpr, ONE_PART: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
):
    """Grid ``(n_eb = cdiv(E, BLOCK_E), SPLIT_K, cdiv(T, BLOCK_T))``.
    One program: the ``[BLOCK_T, BLOCK_E]`` partial logits of its K slice. Level 1: the last of an
    expert block's ``SPLIT_K`` programs to arrive (counter ``cnt[pid_t, pid_e]``) sums the block's
    partials in split order and stores its logits (``RED_T`` tokens at a time). Level 2: the last
    of the token block's ``n_eb`` level-1 reducers (counter ``cnt[pid_t, n_eb]``) routes the block,
    ``TAIL_T`` tokens at a time. ``ONE_PART``: a single program per token block, no counter."""
    pid_e = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_t = tl.program_id(2)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    ecols = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = ecols < E
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < k_hi
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xt + kk[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(wg_ptr + ecols.to(tl.int64)[None, :] * stride_we + kk[:, None],
                    mask=emask[None, :] & kmask[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
    TE = T.to(tl.int64) * E
    tile = rows.to(tl.int64)[:, None] * E + ecols[None, :]
    tmask2 = rmask[:, None] & emask[None, :]
    n_eb = tl.num_programs(0)
    if SPLIT_K == 1:   # the product is the logits
        tl.store(lg_ptr + tile, acc, mask=tmask2)
        if ONE_PART:
            tl.debug_barrier()   # the tail reads what the other threads of this program stored
            _route_block(lg_ptr, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, pid_t, T, E, vocab, stride_tv,
                         scaling, TOPK, TOPK_P2, BLOCK_T, E_P2, TAIL_T, HAS_BIAS, HASH)
        else:
            _level2(lg_ptr, cnt_ptr, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, pid_t, n_eb, T, E, vocab,
                    stride_tv, scaling, TOPK, TOPK_P2, BLOCK_T, E_P2, TAIL_T, HAS_BIAS, HASH)
    else:
        tl.store(part_ptr + pid_k.to(tl.int64) * TE + tile, acc, mask=tmask2)
        tl.debug_barrier()   # every thread's partial stores happen before the ticket (release)
        c1 = cnt_ptr + pid_t * (n_eb + 1) + pid_e
        ticket = tl.atomic_add(c1, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            # level 1: this expert block's logits = partial 0 + partial 1 + ... (split order)
            for r0 in tl.static_range(0, BLOCK_T, RED_T):
                if pid_t * BLOCK_T + r0 < T:
                    rr = pid_t * BLOCK_T + r0 + tl.arange(0, RED_T)
                    m = (rr < T)[:, None] & emask[None, :]
                    off = rr.to(tl.int64)[:, None] * E + ecols[None, :]
                    lg = tl.load(part_ptr + off, mask=m, other=0.0, cache_modifier=".cg")
                    for s in tl.static_range(1, SPLIT_K):   # independent loads, all in flight; adds in order
                        lg += tl.load(part_ptr + s * TE + off, mask=m, other=0.0, cache_modifier=".cg")
                    tl.store(lg_ptr + off, lg, mask=m)
            tl.atomic_xchg(c1, 0)   # zeroed for the next launch / graph replay
            _level2(lg_ptr, cnt_ptr, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, pid_t, n_eb, T, E, vocab,
                    stride_tv, scaling, TOPK, TOPK_P2, BLOCK_T, E_P2, TAIL_T, HAS_BIAS, HASH)


@triton.jit
def _level2(lg_ptr, cnt_ptr, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, pid_t, n_eb, T, E, vocab, stride_tv,
            scaling, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_T: tl.constexpr, E_P2: tl.constexpr,
            TAIL_T: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr):
    """An expert block's logits are stored: take a ticket of the token block; the last routes it."""
    tl.debug_barrier()   # every thread's logit stores happen before the ticket (release)
    c2 = cnt_ptr + pid_t * (n_eb + 1) + n_eb
    ticket = tl.atomic_add(c2, 1, sem="acq_rel", scope="gpu")
    if ticket == n_eb - 1:
        _route_block(lg_ptr, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, pid_t, T, E, vocab, stride_tv,
                     scaling, TOPK, TOPK_P2, BLOCK_T, E_P2, TAIL_T, HAS_BIAS, HASH)
        tl.atomic_xchg(c2, 0)


@triton.jit
def _route_block(lg_ptr, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, pid_t, T, E, vocab, stride_tv, scaling,
                 TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_T: tl.constexpr, E_P2: tl.constexpr,
                 TAIL_T: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr):
    """Route token block ``pid_t`` from its stored logits, ``TAIL_T`` rows at a time."""
    cols = tl.arange(0, E_P2)
    cmask = cols < E
    for r0 in tl.static_range(0, BLOCK_T, TAIL_T):
        if pid_t * BLOCK_T + r0 < T:
            trows = pid_t * BLOCK_T + r0 + tl.arange(0, TAIL_T)
            tmask = trows < T
            off = trows.to(tl.int64)[:, None] * E + cols[None, :]
            lg = tl.load(lg_ptr + off, mask=tmask[:, None] & cmask[None, :], other=0.0, cache_modifier=".cg")
            if HASH:
                route_tile(lg, trows, tmask, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, E, vocab, stride_tv,
                           scaling, TOPK, TOPK_P2, E_P2, HAS_BIAS, HASH)
            else:
                _topk_keys(lg, lg_ptr, trows, tmask, bias_ptr, w_ptr, ids_ptr, E, scaling, TOPK, TOPK_P2, E_P2,
                           HAS_BIAS)


#: the selection key of a taken or unavailable entry: below every real key
_TAKEN_KEY = tl.constexpr(-4611686018427387904)


@triton.jit
def _select_keys(sel, cols, rmask, cmask):
    """The int64 selection key of every entry of ``sel [rows, E_P2]`` (score + bias): ``ordered(sel) *
    1024 + (1023 - id)``, ``ordered`` the fp32 bits mapped to a signed int with the float order (-0 as
    +0, NaN below -inf), so the max key is the best score at its lowest id; unavailable entries (masked
    rows / columns) get a sentinel below every key."""
    bits = sel.to(tl.int32, bitcast=True)
    bits = tl.where(sel == 0.0, 0, bits)                       # -0 ranks as +0 (they tie)
    k32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)                   # signed order == float order
    k32 = tl.where(sel != sel, -2147483647, k32)               # NaN: below -inf (0x807fffff)
    key = k32.to(tl.int64) * 1024 + (1023 - cols)[None, :]
    return tl.where(rmask[:, None] & cmask[None, :], key, _TAKEN_KEY)


@triton.jit
def _topk_keys(lg, lg_ptr, rows, rmask, bias_ptr, w_ptr, ids_ptr, E, scaling, TOPK: tl.constexpr,
               TOPK_P2: tl.constexpr, E_P2: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``moe_routing.route_tile``'s selection (score + bias, descending, ties to the lowest id, NaN
    after every number) with ONE reduction per pick instead of four: each entry's int64 key is
    ``ordered(score + bias) * 1024 + (1023 - id)`` (``ordered``: the fp32 bits mapped to a signed
    int with the float order, -0 as +0, NaN below -inf; unavailable entries below all), so the
    max key is the best score at its lowest id. The weights are the scores of the picked ids,
    recomputed from the stored logits (the same bits as the tile's), renormalised as route_tile."""
    cols = tl.arange(0, E_P2)
    cmask = cols < E
    slots = tl.arange(0, TOPK_P2)
    sel = _sqrt_softplus(lg)
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    key = _select_keys(sel, cols, rmask, cmask)
    sel_ids = tl.zeros([lg.shape[0], TOPK_P2], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        kmax = tl.max(key, axis=1)
        eid = (1023 - (kmax & 1023)).to(tl.int32)
        key = tl.where(cols[None, :] == eid[:, None], _TAKEN_KEY, key)
        sel_ids = tl.where(slots[None, :] == j, eid[:, None], sel_ids)
    omask = rmask[:, None] & (slots[None, :] < TOPK)
    out_off = rows.to(tl.int64)[:, None] * TOPK + slots[None, :]
    lgs = tl.load(lg_ptr + rows.to(tl.int64)[:, None] * E + sel_ids, mask=omask, other=0.0, cache_modifier=".cg")
    w = tl.where(omask, _sqrt_softplus(lgs), 0.0)
    tot = slot_sum(w, TOPK)
    w = w / tl.where(tot > 0, tot, 1.0)[:, None] * scaling
    tl.store(w_ptr + out_off, w, mask=omask)
    tl.store(ids_ptr + out_off, sel_ids, mask=omask)


@triton.jit
def _keep_max_key(k1, v1, k2, v2):
    """Combine of the top-k pick: the larger int64 key and its payload (keys are distinct)."""
    take1 = k1 > k2
    return tl.where(take1, k1, k2), tl.where(take1, v1, v2)


@triton.jit(do_not_specialize=["T"])
def _gate_rows_kernel(
    x_ptr, wg_ptr, lg_ptr, cnt_ptr, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr,
    T, E, K, vocab, stride_xt, stride_we, stride_tv, scaling,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_T: tl.constexpr, EPP: tl.constexpr,
    BLOCK_K: tl.constexpr, E_P2: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
):
    """Grid ``(cdiv(E, EPP), cdiv(T, BLOCK_T))``.
    One program: ``EPP`` experts' FULL gate rows (no split-K) against ``BLOCK_T`` tokens, the dot
    products as fp32 multiply + tree sum (bf16 x bf16 products are exact in fp32, so FMA
    contraction cannot change a bit), the ``[BLOCK_T, EPP]`` logits stored; the last program of
    the token block to arrive (ONE counter, ``cnt[pid_t]``) routes the block from the stored
    logits with one ``[BLOCK_T, E_P2]`` tile: one max reduction per pick carrying the pick's score
    as payload (no gather reload)."""
    pid_e = tl.program_id(0)
    pid_t = tl.program_id(1)
    n_pe = tl.num_programs(0)
    erow = pid_e * EPP + tl.arange(0, EPP)
    emask = erow < E
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cols = tl.arange(0, E_P2)
    cmask = cols < E
    # the router's correction bias, read by every program at the start (1 KiB): its DRAM latency
    # overlaps the weight stream instead of sitting on the last arriver's tail (cold in a real step)
    bias_v = tl.zeros([E_P2], dtype=tl.float32)
    if HAS_BIAS:
        bias_v = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    lg_tile = tl.zeros([BLOCK_T, EPP], dtype=tl.float32)
    tsel = tl.arange(0, BLOCK_T)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        w = tl.load(wg_ptr + erow.to(tl.int64)[:, None] * stride_we + kk[None, :],
                    mask=emask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        for t in tl.static_range(BLOCK_T):
            row = pid_t * BLOCK_T + t
            xt = tl.load(x_ptr + row.to(tl.int64) * stride_xt + kk, mask=kmask & (row < T), other=0.0)
            part = tl.sum(w * xt.to(tl.float32)[None, :], axis=1)            # [EPP]
            lg_tile = tl.where(tsel[:, None] == t, lg_tile + part[None, :], lg_tile)   # K-step order
    tl.store(lg_ptr + rows.to(tl.int64)[:, None] * E + erow[None, :], lg_tile,
             mask=rmask[:, None] & emask[None, :])
    tl.debug_barrier()   # every thread's logit stores happen before the ticket (release)
    c = cnt_ptr + pid_t
    ticket = tl.atomic_add(c, 1, sem="acq_rel", scope="gpu")
    if ticket == n_pe - 1:
        tl.atomic_xchg(c, 0, sem="relaxed")   # nobody else touches it in this launch: zeroed for the next
        lg = tl.load(lg_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                     other=0.0, cache_modifier=".cg")
        if HASH:
            route_tile(lg, rows, rmask, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, E, vocab, stride_tv,
                       scaling, TOPK, TOPK_P2, E_P2, HAS_BIAS, HASH)
        else:
            _topk_payload(lg, rows, rmask, bias_v, w_ptr, ids_ptr, E, scaling, TOPK, TOPK_P2, E_P2, HAS_BIAS)


@triton.jit
def _topk_payload(lg, rows, rmask, bias_v, w_ptr, ids_ptr, E, scaling, TOPK: tl.constexpr,
                  TOPK_P2: tl.constexpr, E_P2: tl.constexpr, HAS_BIAS: tl.constexpr):
    """:func:`_topk_keys`'s selection (the same int64 keys: ties to the lowest id, NaN after every
    number, -0 as +0) where each pick's max reduction also carries the picked entry's score, so the
    weights need no second load; renormalised as ``route_tile``. ``bias_v``: the ``[E_P2]`` fp32
    correction bias already in registers (0 past ``E``)."""
    cols = tl.arange(0, E_P2)
    cmask = cols < E
    slots = tl.arange(0, TOPK_P2)
    s = _sqrt_softplus(lg)
    sel = s
    if HAS_BIAS:
        sel = s + bias_v[None, :]
    key = _select_keys(sel, cols, rmask, cmask)
    sel_ids = tl.zeros([lg.shape[0], TOPK_P2], dtype=tl.int32)
    w = tl.zeros([lg.shape[0], TOPK_P2], dtype=tl.float32)
    tot = tl.zeros([lg.shape[0]], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        kmax, sj = tl.reduce((key, s), 1, _keep_max_key)
        eid = (1023 - (kmax & 1023)).to(tl.int32)
        key = tl.where(cols[None, :] == eid[:, None], _TAKEN_KEY, key)
        sel_ids = tl.where(slots[None, :] == j, eid[:, None], sel_ids)
        w = tl.where(slots[None, :] == j, sj[:, None], w)
        tot = tot + sj                                         # slot order, as slot_sum
    omask = rmask[:, None] & (slots[None, :] < TOPK)
    w = w / tl.where(tot > 0, tot, 1.0)[:, None] * scaling
    out_off = rows.to(tl.int64)[:, None] * TOPK + slots[None, :]
    tl.store(w_ptr + out_off, w, mask=omask)
    tl.store(ids_ptr + out_off, sel_ids, mask=omask)


def _arrivals(device: torch.device, n: int) -> torch.Tensor:
    """The per-device zeroed int32 arrival counters (grown, never shrunk; the kernel re-zeroes them;
    :func:`ds4lab_kernels._counters.zeroed_counters`)."""
    return zeroed_counters("moe_gate", device, n, 1024)


def gate_sqrtsoftplus_topk(hidden_states: torch.Tensor, gate_weight: torch.Tensor,
                           e_score_correction_bias: torch.Tensor | None = None, topk: int = 6,
                           routed_scaling_factor: float = 1.5, input_ids: torch.Tensor | None = None,
                           tid2eid: torch.Tensor | None = None, arrivals: torch.Tensor | None = None,
                           config: dict | None = None):
    """DeepSeek-V4 router gate + routing in one launch: ``(topk_weights, topk_ids, router_logits)``.

    Args:
        hidden_states: ``(num_tokens, hidden)`` bfloat16, last dim contiguous.
        gate_weight: ``(num_experts, hidden)`` bfloat16 (the checkpoint's ``ffn.gate.weight``), last
            dim contiguous; ``num_experts <= 1024``.
        e_score_correction_bias: ``(num_experts,)`` float32/bf16/fp16 or None (selection only).
        topk: experts per token (6), at most ``min(num_experts, 16)``.
        routed_scaling_factor: a positive normal float32 (1.5).
        input_ids, tid2eid: hash layers, as :func:`ds4lab_kernels.moe_routing.sqrtsoftplus_topk`
            (ids ``tid2eid[input_ids]``; out-of-range token ids or table entries give id -1, weight 0).
        arrivals: optional int32 zeroed counter buffer with ``>= cdiv(num_tokens, BLOCK_T) *
            (cdiv(num_experts, BLOCK_E) + 1)`` entries
            (default: one shared buffer per device; give your own for concurrent streams). The
            kernel leaves it zeroed.
        config: a row of ``CONFIGS`` (``BLOCK_T, BLOCK_E, BLOCK_K, SPLIT_K, TAIL_T, RED_T,
            num_warps, num_stages``); default by size (:func:`pick_config`).

    Returns:
        ``topk_weights`` ``(num_tokens, topk)`` float32, ``topk_ids`` ``(num_tokens, topk)`` int32
        (selection order, ties to the lowest id, NaN scores last: exactly the rules of
        ``sqrtsoftplus_topk`` applied to the returned logits), ``router_logits``
        ``(num_tokens, num_experts)`` float32 (fp32 accumulation; summation order fixed per config).
        A NaN in a token's hidden state makes its logits NaN (ids ``0..topk-1``, NaN weights).

    Raises:
        TypeError / ValueError: dtypes, shapes (hidden mismatch), strides, devices, a half-given
            hash table, a bad ``arrivals`` buffer.
    """
    check.tensor("hidden_states", hidden_states, torch.bfloat16, ndim=2)
    check.tensor("gate_weight", gate_weight, torch.bfloat16, ndim=2)
    T, K = hidden_states.shape
    E = gate_weight.shape[0]
    if gate_weight.shape[1] != K:
        raise ValueError(f"gate_weight: shape {tuple(gate_weight.shape)}, expected (num_experts, hidden={K})")
    if not 1 <= E <= 1024:
        raise ValueError(f"gate_weight: num_experts={E} outside 1..1024")
    if K < 1:
        raise ValueError(f"hidden_states: hidden={K} must be >= 1")
    if not isinstance(topk, int) or not 1 <= topk <= min(E, 16):
        raise ValueError(f"topk={topk!r}: must be an int in 1..min(num_experts, 16)")
    check.last_dim_contiguous("hidden_states", hidden_states)
    check.last_dim_contiguous("gate_weight", gate_weight)
    check.same_device("hidden_states", hidden_states, gate_weight=gate_weight)
    scaling = check.fp32_scalar("routed_scaling_factor", routed_scaling_factor, positive=True)
    dev = hidden_states.device
    hashed = check_routing_args("hidden_states", hidden_states, T, E, topk, input_ids, tid2eid,
                                e_score_correction_bias)
    b = e_score_correction_bias
    cfg = config or pick_config(T, dev)
    if cfg.get("ROWS"):
        return _launch_rows(hidden_states, gate_weight, b, topk, scaling, input_ids, tid2eid, hashed, arrivals, cfg)
    BT, BE, BK, SK = cfg["BLOCK_T"], cfg["BLOCK_E"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    BE = min(BE, max(16, triton.next_power_of_2(E)))
    n_tb = triton.cdiv(T, BT)
    n_eb = triton.cdiv(E, BE)
    n_cnt = n_tb * (n_eb + 1)
    w = torch.empty((T, topk), dtype=torch.float32, device=dev)
    ids = torch.empty((T, topk), dtype=torch.int32, device=dev)
    logits = torch.empty((T, E), dtype=torch.float32, device=dev)
    if not T:
        return w, ids, logits
    # K slice per split: a multiple of BLOCK_K; splits past K get an empty slice (partials of 0)
    k_per_split = triton.cdiv(triton.cdiv(K, SK), BK) * BK
    one_part = SK == 1 and BE >= E
    if arrivals is None:
        arrivals = _arrivals(dev, n_cnt) if not one_part else logits
    else:
        _check_arrivals(hidden_states, arrivals, n_cnt)
    part = logits if SK == 1 else torch.empty((SK, T, E), dtype=torch.float32, device=dev)
    dummy = logits
    _gate_topk_kernel[(n_eb, SK, n_tb)](
        hidden_states, gate_weight, part, logits, arrivals, b if b is not None else dummy,
        input_ids if hashed else dummy, tid2eid if hashed else dummy, w, ids,
        T, E, K, k_per_split, tid2eid.shape[0] if hashed else 0, hidden_states.stride(0), gate_weight.stride(0),
        tid2eid.stride(0) if hashed else 0, scaling,
        TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), BLOCK_T=BT, BLOCK_E=BE, BLOCK_K=BK, SPLIT_K=SK,
        E_P2=triton.next_power_of_2(E), TAIL_T=min(cfg["TAIL_T"], BT),
        RED_T=min(cfg.get("RED_T", BT), BT), ONE_PART=one_part, HAS_BIAS=b is not None,
        HASH=hashed, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return w, ids, logits


def _check_arrivals(hidden_states, arrivals, n_cnt):
    check.tensor("arrivals", arrivals, torch.int32, ndim=1)
    check.same_device("hidden_states", hidden_states, arrivals=arrivals)
    if arrivals.numel() < n_cnt or arrivals.stride(0) != 1:
        raise ValueError(f"arrivals: needs >= {n_cnt} contiguous entries, got shape {tuple(arrivals.shape)}")


def _launch_rows(x, W, b, topk, scaling, input_ids, tid2eid, hashed, arrivals, cfg):
    """The ``ROWS`` path (decode, T <= BLOCK_T): ``cdiv(E, EPP)`` programs of full gate rows, one
    arrival counter per token block (``cdiv(T, BLOCK_T)`` entries of ``arrivals``)."""
    T, K = x.shape
    E = W.shape[0]
    dev = x.device
    BT = min(cfg["BLOCK_T"], triton.next_power_of_2(max(T, 1)))
    EPP = min(cfg["EPP"], triton.next_power_of_2(E))
    BK = min(cfg["BLOCK_K"], triton.next_power_of_2(K))
    n_tb = triton.cdiv(T, BT)
    w = torch.empty((T, topk), dtype=torch.float32, device=dev)
    ids = torch.empty((T, topk), dtype=torch.int32, device=dev)
    logits = torch.empty((T, E), dtype=torch.float32, device=dev)
    if arrivals is None:
        arrivals = _arrivals(dev, n_tb)
    else:
        _check_arrivals(x, arrivals, n_tb)
    if not T:
        return w, ids, logits
    dummy = logits
    _gate_rows_kernel[(triton.cdiv(E, EPP), n_tb)](
        x, W, logits, arrivals, b if b is not None else dummy, input_ids if hashed else dummy,
        tid2eid if hashed else dummy, w, ids, T, E, K, tid2eid.shape[0] if hashed else 0, x.stride(0), W.stride(0),
        tid2eid.stride(0) if hashed else 0, scaling,
        TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), BLOCK_T=BT, EPP=EPP, BLOCK_K=BK,
        E_P2=triton.next_power_of_2(E), HAS_BIAS=b is not None, HASH=hashed,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return w, ids, logits


# ---- config table ------------------------------------------------------------------------------
# Decode (T <= 16): the 2 MiB bf16 gate weight (256 x 4096) is the whole DRAM cost; 128-256
# programs each stream a [BLOCK_E, K/SPLIT_K] slice (8-16 KiB) in ONE K step (BLOCK_K ==
# K/SPLIT_K, num_stages 1: every byte of the slice in flight at once, no pipeline prologue).
# BLOCK_T=16 is the smallest mma M tile (rows past T are masked). Level 1: an expert block's
# reducer loads SPLIT_K [RED_T, BLOCK_E] partials from L2 at once (T=1: 16 x 128 B); level 2 routes
# TAIL_T tokens per step (16: one [16, 256] key tile, 6 reductions for the whole block; 4: a
# smaller tile, 4 steps at T=16). Prefill: no split, 128 experts per program (level 2 only).
# Shared memory (sm_89 <= 101,376 B): per stage BLOCK_T*BLOCK_K*2 + BLOCK_E*BLOCK_K*2 bytes
# (e32k16: 16*256*2 + 32*256*2 = 24 KiB; prefill: 64*64*2 + 128*64*2 = 24 KiB x 3) plus the
# tail's reduction scratch.
_D = {"BLOCK_T": 16, "TAIL_T": 16, "RED_T": 16, "num_warps": 4, "num_stages": 1}
# ROWS (T <= 4, gate5): no split-K, EPP full gate rows per program (EPP * 8 KiB), one arrival
# level; BLOCK_T is the most tokens one program takes (the launcher sizes it to T: 1, 2 or 4).
# Registers: EPP * BLOCK_K / (32 * num_warps) fp32 weights per thread (r2w4: 64) + one token's x.
_R = {"ROWS": True, "BLOCK_T": 4, "BLOCK_K": 4096, "num_stages": 1}
_TABLE = {
    "e32k16": {**_D, "BLOCK_E": 32, "BLOCK_K": 256, "SPLIT_K": 16},                     # 128 programs, 16 KiB
    "e32k16t4": {**_D, "BLOCK_E": 32, "BLOCK_K": 256, "SPLIT_K": 16, "TAIL_T": 4, "RED_T": 4},
    "e32k16w8": {**_D, "BLOCK_E": 32, "BLOCK_K": 256, "SPLIT_K": 16, "num_warps": 8},
    "r2w4": {**_R, "EPP": 2, "num_warps": 4},      # 128 programs, 16 KiB each
    "r2w2": {**_R, "EPP": 2, "num_warps": 2},      # the same at 2 warps: a shorter router tail
    "r1w2": {**_R, "EPP": 1, "num_warps": 2},      # 256 programs, 8 KiB each
    "r4w8": {**_R, "EPP": 4, "num_warps": 8},      # 64 programs, 32 KiB each: fewer arrivals
    "r1w1": {**_R, "EPP": 1, "num_warps": 1},      # 256 programs of one warp: the router never leaves the warp
    # token-spread rows (m16, T = 8..16): BLOCK_T tokens per program, cdiv(T, BLOCK_T) token blocks side by side
    # on the grid's second axis, each routed by its own last arriver (the tails run in parallel)
    "r4w8t2": {**_R, "EPP": 4, "BLOCK_T": 2, "num_warps": 8},   # T=16: 8 token blocks x 64 programs, 2-token tails
    "t32e32k8": {"BLOCK_T": 32, "BLOCK_E": 32, "BLOCK_K": 128, "SPLIT_K": 8, "TAIL_T": 16, "RED_T": 16,
                 "num_warps": 4, "num_stages": 2},
    "prefill": {"BLOCK_T": 64, "BLOCK_E": 128, "BLOCK_K": 64, "SPLIT_K": 1, "TAIL_T": 8, "RED_T": 8, "num_warps": 8,
                "num_stages": 3},
    # the interpreter: programs run one by one in Python, fewest is fastest
    "interp": {"BLOCK_T": 16, "BLOCK_E": 256, "BLOCK_K": 64, "SPLIT_K": 1, "TAIL_T": 16, "RED_T": 16, "num_warps": 4,
               "num_stages": 1},
}
# sm_90 leaves r2w4 out: ptxas for sm_90a spills 8 B of it at the compile report's T=4 shape (ds4lab aot;
# sm_89 builds it without spills); its native H200 rows stay in NOTES.md (T=1 5.76 us, T=2 6.45)
# (m16's r2w4t2, EPP 2 / 2 tokens / 4 warps, is in no table: its hash build spills 8 B at T = 8 / 16 on sm_90a,
# and the clean-clone compile report found 8 B on sm_89 too)
CONFIGS = {"sm_89": dict(_TABLE), "sm_90": {k: dict(v) for k, v in _TABLE.items() if k != "r2w4"}}

# the decode candidates the bench times at T <= 16 (scripts/gpu/route.sh --gate). Dropped after the
# session-4 H200 call (NOTES.md, gate4b): e64k32 (18.6 / 20.1 us at T=1 / 16) and e16k16 (12.8 / 14.0),
# slower than e32k16t4 (10.4) at T <= 2 and e32k16w8 (11.2) at T=16 in both builds.
DECODE_CANDIDATES = ("e32k16t4", "e32k16w8", "r2w4", "r2w2", "r1w2", "r4w8", "r1w1", "r4w8t2")
#: rows path candidates: timed at T <= 4 (and where their build's table has them)
ROWS_CANDIDATES = tuple(lb for lb in DECODE_CANDIDATES if _TABLE[lb].get("ROWS"))
#: the rows candidates also timed at 4 < T <= 16 (token blocks spread over the grid, one tail each; m16).
#: r4w4t2 (EPP 4, 2 tokens, 4 warps: 168 registers) spilled 8 B on sm_90a and is not in the table.
SPREAD_CANDIDATES = ("r4w8t2", "r4w8")
#: pick_config's decode rows: ``[(max T, label)]`` in order (measured: e32k16t4 10.4 vs e32k16 12.7 us
#: at T = 1, 2; e32k16w8 11.2 vs e32k16 13.8 at T=16, both builds; NOTES.md gate5)
# H200, session 5 (results/issue20/s5/gate_*.csv; `bash scripts/gpu/route.sh --gate`), sm_89 build / native, us:
# T=1 r2w4 5.72 / 5.76, T=2 r2w4 6.49 / 6.45 (r4w8 6.42 / 6.47), T=4 r4w8 8.09 / 8.42 (r2w4 10.26 / 10.37),
# vs e32k16t4 10.44 / 10.46 / 10.74 and cuBLAS mm(out fp32) + route 10.45 / 10.58 / 10.67; step-like (L2 and
# TLB thrashed between calls, sm89) T=1 r2w4 5.20 vs e32k16 18.76 (the old default: the step's 17.0) and
# e32k16t4 10.74. T=16: e32k16w8 11.31 vs the cuBLAS pair 10.99 (GATE_FUSED_MAX_T stays 4).
# sm_90 (no r2w4): T=1 r2w2 5.95 us (native), T=2 and 4 r4w8 6.47 / 8.42. The sm_89 table (also read by
# sm_120 cards) keeps e32k16t4 at T = 3, 4: r4w8 (8.09 us there) spills 4 B when ptxas builds it for sm_120.
# m16 (NOTES.md "m16"): 3..16 tokens r4w8t2, the rows path with 2-token blocks side by side (T=16: 8 x 64
# programs, 8 two-token tails in parallel) instead of e32k16t4 / e32k16w8 (the two-level split tail); 0 spills
# at T=16 on sm_89, sm_90a and sm_120 (94 / 95 / 64 registers). H200, session 7 (results/issue20/s7/call1/gate,
# `bash scripts/gpu/route.sh --gate`), sm_89 build / native, us: r4w8t2 T=4 6.58 / 6.63 (e32k16t4 10.77 /
# 10.88, r4w8 8.14 / 8.41), T=8 7.64 / 7.68 (r4w8 8.46 / 8.66, e32k16w8 11.44 / 11.38), T=16 10.65 / 10.77
# (r4w8 9.42 / 9.55, e32k16w8 11.34 / 11.42); the cuBLAS pair 10.7-11.2 at every T. So 3..16 tokens go to
# r4w8t2 on the sm_89 table (r4w8, 1.2 us faster at T=16, spills on sm_120, which reads this table) and to
# r4w8t2 / r4w8 on sm_90; backend_kernel.GATE_FUSED_MAX_T 4 -> 16.
DECODE_DEFAULTS = {"sm_89": [(2, "r2w4"), (16, "r4w8t2")],
                   "sm_90": [(1, "r2w2"), (8, "r4w8t2"), (16, "r4w8")]}
# the rows pick_config can return on a GPU (the rest are benchmark candidates or interpreter sizes)
GPU_DEFAULTS = {a: tuple(lb for _, lb in DECODE_DEFAULTS[a]) + ("t32e32k8", "prefill") for a in DECODE_DEFAULTS}


def pick_config(T: int, device: torch.device) -> dict:
    table = CONFIGS[arch_of(device)]
    if device.type != "cuda":
        return table["interp"]
    for max_t, label in DECODE_DEFAULTS[arch_of(device)]:
        if T <= max_t:
            return table[label]
    return table["t32e32k8"] if T <= 64 else table["prefill"]
