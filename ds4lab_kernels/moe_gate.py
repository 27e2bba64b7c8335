"""DeepSeek-V4 router in one launch: the gate GEMM (bf16 hidden states x bf16 gate weight -> fp32
logits) fused with the sqrtsoftplus + bias top-k (or hash) routing of :mod:`.moe_routing`.

Semantics: vLLM 0.32 ``models/deepseek_v4/nvidia/model.py`` ``DeepseekV4MoE``: ``self.gate`` is a
``GateLinear(hidden_size, n_routed_experts, bias=False, out_dtype=torch.float32)`` whose weight is
stored in the model dtype (bf16); its router GEMM multiplies bf16 by bf16 with fp32 accumulation
and returns fp32 ``router_logits``, which ``fused_topk_bias`` routes (``sqrtsoftplus`` scores,
``e_score_correction_bias`` for the selection only, renormalised, times
``routed_scaling_factor``; hash layers ``tid2eid[input_ids]``). bf16 x bf16 products are exact in
fp32, so the logits equal ``F.linear(x.float(), W.float())`` up to fp32 summation order.

How one launch does it (grid ``(cdiv(E, BLOCK_E), SPLIT_K, cdiv(T, BLOCK_T))``): each program
computes a ``[BLOCK_T, BLOCK_E]`` fp32 partial product over its ``K / SPLIT_K`` slice with
``tl.dot`` and stores it to a workspace ``(SPLIT_K, T, E)`` (with ``SPLIT_K == 1`` that workspace
is the logits output itself). Then it takes a ticket from the token block's arrival counter
(``atomic_add``, acq_rel, after a CTA barrier so every thread's stores are released). The program
that draws the last ticket sums the partials in split order 0, 1, ... (deterministic: the same
logits bit for bit on every run, whatever the arrival order), writes the logits, routes the
block's tokens (``moe_routing.route_tile``) and resets the counter to 0, so the next launch (or
CUDA-graph replay) finds it zeroed: no memset launch, no host sync. The counter buffer is
allocated once per device and shared by every call: calls on one device must not run
concurrently on two streams (pass ``arrivals`` of your own there).
"""
import torch
import triton
import triton.language as tl

from . import _checks as check
from ._arch import arch_of
from .moe_routing import route_tile


@triton.jit(do_not_specialize=["T"])   # one build serves every token count (decode: 1, 2, 16, 32)
def _gate_topk_kernel(
    x_ptr, wg_ptr, part_ptr, lg_ptr, cnt_ptr, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr,
    T, E, K, k_per_split, vocab, stride_xt, stride_we, stride_tv, scaling,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, E_P2: tl.constexpr, TAIL_T: tl.constexpr,
    ONE_PART: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
):
    """Grid ``(cdiv(E, BLOCK_E), SPLIT_K, cdiv(T, BLOCK_T))``.
    One program: the ``[BLOCK_T, BLOCK_E]`` partial logits of its K slice; the last of the token
    block's ``cdiv(E, BLOCK_E) * SPLIT_K`` programs to arrive also reduces and routes the block,
    ``TAIL_T`` tokens at a time (``ONE_PART``: a single program per block, no counter)."""
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
    TE = T * E
    tl.store(part_ptr + pid_k.to(tl.int64) * TE + rows.to(tl.int64)[:, None] * E + ecols[None, :], acc,
             mask=rmask[:, None] & emask[None, :])
    if ONE_PART:
        tl.debug_barrier()   # the tail reads what the other threads of this program stored
        _reduce_route(part_ptr, lg_ptr, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, pid_t, T, E, vocab,
                      stride_tv, scaling, TOPK, TOPK_P2, BLOCK_T, SPLIT_K, E_P2, TAIL_T, HAS_BIAS, HASH)
    else:
        tl.debug_barrier()   # every thread's partial stores happen before the ticket (release)
        ticket = tl.atomic_add(cnt_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) * SPLIT_K - 1:
            _reduce_route(part_ptr, lg_ptr, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, pid_t, T, E, vocab,
                          stride_tv, scaling, TOPK, TOPK_P2, BLOCK_T, SPLIT_K, E_P2, TAIL_T, HAS_BIAS, HASH)
            tl.atomic_xchg(cnt_ptr + pid_t, 0)   # zeroed for the next launch / graph replay


@triton.jit
def _reduce_route(part_ptr, lg_ptr, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, pid_t, T, E, vocab,
                  stride_tv, scaling, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_T: tl.constexpr,
                  SPLIT_K: tl.constexpr, E_P2: tl.constexpr, TAIL_T: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HASH: tl.constexpr):
    """Token block ``pid_t``, ``TAIL_T`` rows at a time: logits = partial 0 + partial 1 + ... (split
    order), stored when ``SPLIT_K > 1`` (else the partial is the logits), then routed."""
    cols = tl.arange(0, E_P2)
    cmask = cols < E
    TE = T * E
    for r0 in tl.static_range(0, BLOCK_T, TAIL_T):
        if pid_t * BLOCK_T + r0 < T:
            trows = pid_t * BLOCK_T + r0 + tl.arange(0, TAIL_T)
            tmask = trows < T
            off = trows.to(tl.int64)[:, None] * E + cols[None, :]
            m2 = tmask[:, None] & cmask[None, :]
            lg = tl.load(part_ptr + off, mask=m2, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT_K):   # a loop, not unrolled: 15 hoisted tile loads spilled on sm_89
                lg += tl.load(part_ptr + s * TE + off, mask=m2, other=0.0, cache_modifier=".cg")
            if SPLIT_K > 1:
                tl.store(lg_ptr + off, lg, mask=m2)
            route_tile(lg, trows, tmask, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, E, vocab, stride_tv,
                       scaling, TOPK, TOPK_P2, E_P2, HAS_BIAS, HASH)


_ARRIVALS: dict = {}


def _arrivals(device: torch.device, n: int) -> torch.Tensor:
    """The per-device zeroed int32 arrival counters (grown, never shrunk; the kernel re-zeroes them)."""
    key = (device.type, device.index)
    buf = _ARRIVALS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _ARRIVALS[key] = buf
    return buf


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
        arrivals: optional int32 zeroed counter buffer with ``>= cdiv(num_tokens, BLOCK_T)`` entries
            (default: one shared buffer per device; give your own for concurrent streams). The
            kernel leaves it zeroed.
        config: a row of ``CONFIGS`` (``BLOCK_T, BLOCK_E, BLOCK_K, SPLIT_K, TAIL_T, num_warps,
            num_stages``); default by size (:func:`pick_config`).

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
    hashed = tid2eid is not None or input_ids is not None
    if hashed:
        if tid2eid is None or input_ids is None:
            raise ValueError("input_ids and tid2eid: give both (hash layer) or neither")
        check.tensor("input_ids", input_ids, (torch.int32, torch.int64))
        check.tensor("tid2eid", tid2eid, (torch.int32, torch.int64))
        check.same_device("hidden_states", hidden_states, input_ids=input_ids, tid2eid=tid2eid)
        if input_ids.shape != (T,) or (T and input_ids.stride(0) != 1):
            raise ValueError(f"input_ids: shape {tuple(input_ids.shape)}, expected contiguous ({T},)")
        if tid2eid.dim() != 2 or tid2eid.shape[1] != topk or tid2eid.stride(1) != 1:
            raise ValueError(f"tid2eid: expected a (vocab, topk={topk}) table with contiguous rows, "
                             f"got shape {tuple(tid2eid.shape)} strides {tuple(tid2eid.stride())}")
    b = e_score_correction_bias
    if b is not None:
        check.tensor("e_score_correction_bias", b, (torch.float32, torch.bfloat16, torch.float16))
        if b.shape != (E,) or b.stride(0) != 1:
            raise ValueError(f"e_score_correction_bias: shape {tuple(b.shape)}, expected contiguous ({E},)")
        check.same_device("hidden_states", hidden_states, e_score_correction_bias=b)
    cfg = config or pick_config(T, dev)
    BT, BE, BK, SK = cfg["BLOCK_T"], cfg["BLOCK_E"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    BE = min(BE, max(16, triton.next_power_of_2(E)))
    n_tb = triton.cdiv(T, BT)
    w = torch.empty((T, topk), dtype=torch.float32, device=dev)
    ids = torch.empty((T, topk), dtype=torch.int32, device=dev)
    logits = torch.empty((T, E), dtype=torch.float32, device=dev)
    if not T:
        return w, ids, logits
    # K slice per split: a multiple of BLOCK_K; splits past K get an empty slice (partials of 0)
    k_per_split = triton.cdiv(triton.cdiv(K, SK), BK) * BK
    one_part = SK == 1 and BE >= E
    if arrivals is None:
        arrivals = _arrivals(dev, n_tb) if not one_part else logits
    else:
        check.tensor("arrivals", arrivals, torch.int32, ndim=1)
        check.same_device("hidden_states", hidden_states, arrivals=arrivals)
        if arrivals.numel() < n_tb or arrivals.stride(0) != 1:
            raise ValueError(f"arrivals: needs >= {n_tb} contiguous entries, got shape {tuple(arrivals.shape)}")
    part = logits if SK == 1 else torch.empty((SK, T, E), dtype=torch.float32, device=dev)
    dummy = logits
    _gate_topk_kernel[(triton.cdiv(E, BE), SK, n_tb)](
        hidden_states, gate_weight, part, logits, arrivals, b if b is not None else dummy,
        input_ids if hashed else dummy, tid2eid if hashed else dummy, w, ids,
        T, E, K, k_per_split, tid2eid.shape[0] if hashed else 0, hidden_states.stride(0), gate_weight.stride(0),
        tid2eid.stride(0) if hashed else 0, scaling,
        TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), BLOCK_T=BT, BLOCK_E=BE, BLOCK_K=BK, SPLIT_K=SK,
        E_P2=triton.next_power_of_2(E), TAIL_T=min(cfg["TAIL_T"], BT), ONE_PART=one_part, HAS_BIAS=b is not None,
        HASH=hashed, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return w, ids, logits


# ---- config table ------------------------------------------------------------------------------
# Decode (T <= 32): the 2 MiB bf16 gate weight (256 x 4096) is the whole cost; ~128 programs each
# stream a [BLOCK_E, K/SPLIT_K] slice (16 KiB) so every SM pulls weight at once. BLOCK_T=16 is the
# smallest mma M tile (rows past T are masked). The last program then reads SPLIT_K x T x E fp32
# partials from L2 (16 KiB at T=1, SPLIT_K=16). Prefill: no split, 128 experts per program.
# Shared memory (sm_89 <= 101,376 B): per stage BLOCK_T*BLOCK_K*2 + BLOCK_E*BLOCK_K*2 bytes
# (decode: 16*128*2 + 32*128*2 = 12 KiB x 2 stages; prefill: 64*64*2 + 128*64*2 = 24 KiB x 3) plus
# the tail's reduction scratch. The tail routes TAIL_T tokens at a time (4: a [4, 256] tile per
# step keeps the 6-pass selection in registers, 239 -> fewer regs than a [16, 256] tile) and skips
# chunks past T (T=1 runs one chunk).
_TABLE = {
    "e32k16": {"BLOCK_T": 16, "BLOCK_E": 32, "BLOCK_K": 128, "SPLIT_K": 16, "TAIL_T": 4, "num_warps": 4,
               "num_stages": 2},
    "e16k8": {"BLOCK_T": 16, "BLOCK_E": 16, "BLOCK_K": 128, "SPLIT_K": 8, "TAIL_T": 4, "num_warps": 4,
              "num_stages": 2},
    "e64k32": {"BLOCK_T": 16, "BLOCK_E": 64, "BLOCK_K": 128, "SPLIT_K": 32, "TAIL_T": 4, "num_warps": 8,
               "num_stages": 1},
    "t32e32k8": {"BLOCK_T": 32, "BLOCK_E": 32, "BLOCK_K": 128, "SPLIT_K": 8, "TAIL_T": 4, "num_warps": 4,
                 "num_stages": 2},
    "prefill": {"BLOCK_T": 64, "BLOCK_E": 128, "BLOCK_K": 64, "SPLIT_K": 1, "TAIL_T": 8, "num_warps": 8,
                "num_stages": 3},
    # the interpreter: programs run one by one in Python, fewest is fastest
    "interp": {"BLOCK_T": 16, "BLOCK_E": 256, "BLOCK_K": 64, "SPLIT_K": 1, "TAIL_T": 16, "num_warps": 4,
               "num_stages": 1},
}
CONFIGS = {"sm_89": dict(_TABLE), "sm_90": {k: dict(v) for k, v in _TABLE.items()}}

# the rows pick_config can return on a GPU (the rest are benchmark candidates or interpreter sizes)
GPU_DEFAULTS = {"sm_89": ("e32k16", "t32e32k8", "prefill"), "sm_90": ("e32k16", "t32e32k8", "prefill")}


def pick_config(T: int, device: torch.device) -> dict:
    table = CONFIGS[arch_of(device)]
    if device.type != "cuda":
        return table["interp"]
    if T <= 16:
        return table["e32k16"]
    return table["t32e32k8"] if T <= 64 else table["prefill"]
