"""DeepSeek-V4 MoE routing: sqrt(softplus) scores, top-k by score + bias, renormalised weights.

Semantics: vLLM ``fused_moe/router/dsv4_topk.py`` (``_dsv4_topk_kernel``, "noaux_tc": the
correction bias steers the selection only) and, for the first ``num_hash_layers`` layers, the hash
router (``topk_hash_softplus_sqrt`` / ``hash_topk_cpu``): ids ``tid2eid[input_ids]``, weights the
scores of those experts. Weights are renormalised to sum 1 (the sum taken in slot order,
:func:`slot_sum`) and multiplied by ``routed_scaling_factor`` (1.5).
"""
import torch
import triton
import triton.language as tl

from . import _checks as check
from ._arch import arch_of


@triton.jit
def _sqrt_softplus(x):
    """``sqrt(softplus(x))`` in fp32 without libdevice (DeepSeek-V4 router score)."""
    # softplus(x) = max(x, 0) + log1p(exp(-|x|)); log1p through Goldberg's trick
    # (log(u) * z / (u - 1), u = 1 + z) keeps full fp32 accuracy for tiny z without libdevice.
    # NaN stays NaN; +inf -> inf; -inf -> 0.
    z = tl.exp(-tl.abs(x))
    u = 1.0 + z
    l1p = tl.where(u == 1.0, z, tl.log(u) * (z / (u - 1.0)))
    sp = tl.where(x > 0, x, 0.0) + l1p
    return tl.sqrt_rn(sp)


@triton.jit
def slot_sum(w, TOPK: tl.constexpr):
    """``w [rows, TOPK_P2]`` -> ``w[:, 0] + w[:, 1] + ... + w[:, TOPK-1]`` in that order (a fixed
    sum order whatever the register layout, so every router kernel renormalises to the same bits)."""
    slots = tl.arange(0, w.shape[1])
    tot = tl.sum(tl.where(slots[None, :] == 0, w, 0.0), axis=1)
    for j in tl.static_range(1, TOPK):
        tot = tot + tl.sum(tl.where(slots[None, :] == j, w, 0.0), axis=1)
    return tot


@triton.jit
def route_tile(lg, rows, rmask, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, E, vocab, stride_tv, scaling,
               TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_E: tl.constexpr,
               HAS_BIAS: tl.constexpr, HASH: tl.constexpr):
    """The router on a register tile: ``lg`` fp32 ``[BLOCK_T, BLOCK_E]`` logits of tokens ``rows``
    (columns ``>= E`` and rows off ``rmask`` are ignored) -> the scores, the top-k selection (or
    the hash lookup) and the renormalised weights, stored at ``w_ptr`` / ``ids_ptr`` rows
    ``rows * TOPK``. Shared by :func:`sqrtsoftplus_topk` and the fused gate (``moe_gate``)."""
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    slots = tl.arange(0, TOPK_P2)
    out_off = rows.to(tl.int64)[:, None] * TOPK + slots[None, :]
    omask = rmask[:, None] & (slots[None, :] < TOPK)
    s = _sqrt_softplus(lg)
    if HASH:
        tok = tl.load(ids_in_ptr + rows, mask=rmask, other=-1).to(tl.int64)
        tok_ok = (tok >= 0) & (tok < vocab)
        eid = tl.load(tid2eid_ptr + tok[:, None] * stride_tv + slots[None, :],
                      mask=omask & tok_ok[:, None], other=-1).to(tl.int64)
        ok = (eid >= 0) & (eid < E) & omask
        w = tl.zeros([lg.shape[0], TOPK_P2], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            # the tile's score of slot j's expert (a gather from registers: one column hit)
            ej = tl.sum(tl.where(slots[None, :] == j, eid, 0), axis=1)
            sj = tl.sum(tl.where(cols[None, :] == ej[:, None], s, 0.0), axis=1)
            w = tl.where(slots[None, :] == j, sj[:, None], w)
        w = tl.where(ok, w, 0.0)
        sel_ids = tl.where(ok, eid, -1).to(tl.int32)
    else:
        sel = s
        if HAS_BIAS:
            sel = s + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        avail = (rmask[:, None] & cmask[None, :])
        w = tl.zeros([lg.shape[0], TOPK_P2], dtype=tl.float32)
        sel_ids = tl.zeros([lg.shape[0], TOPK_P2], dtype=tl.int32)
        for j in tl.static_range(TOPK):
            # numbers first (max, ties to the lowest id); NaN scores only once no number is left
            num = avail & (sel == sel)
            m = tl.max(tl.where(num, sel, float("-inf")), axis=1)
            any_num = tl.sum(num.to(tl.int32), axis=1) > 0
            cand = tl.where(any_num[:, None], num & (sel == m[:, None]), avail)
            eid = tl.min(tl.where(cand, cols[None, :], BLOCK_E), axis=1)
            hit = cols[None, :] == eid[:, None]
            wj = tl.sum(tl.where(hit, s, 0.0), axis=1)
            avail = avail & (~hit)
            w = tl.where(slots[None, :] == j, wj[:, None], w)
            sel_ids = tl.where(slots[None, :] == j, eid[:, None], sel_ids)
    tot = slot_sum(w, TOPK)
    w = w / tl.where(tot > 0, tot, 1.0)[:, None] * scaling
    tl.store(w_ptr + out_off, w, mask=omask)
    tl.store(ids_ptr + out_off, sel_ids, mask=omask)


@triton.jit
def _sqrtsoftplus_topk_kernel(
    logits_ptr, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr,
    T, E, vocab, stride_lt, stride_tv, scaling,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens, BLOCK_T),)``.
    One program: BLOCK_T tokens x all experts: scores, the top-k selection (or hash lookup) and weights."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cols = tl.arange(0, BLOCK_E)
    lg = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + cols[None, :],
                 mask=rmask[:, None] & (cols < E)[None, :], other=0.0).to(tl.float32)
    route_tile(lg, rows, rmask, bias_ptr, ids_in_ptr, tid2eid_ptr, w_ptr, ids_ptr, E, vocab, stride_tv, scaling,
               TOPK, TOPK_P2, BLOCK_E, HAS_BIAS, HASH)


def sqrtsoftplus_topk(router_logits: torch.Tensor, e_score_correction_bias: torch.Tensor | None = None,
                      topk: int = 6, routed_scaling_factor: float = 1.5,
                      input_ids: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
                      config: dict | None = None):
    """DeepSeek-V4 router: ``(topk_weights, topk_ids)`` from the gate's logits.

    Args:
        router_logits: ``(num_tokens, num_experts)`` float32 (bf16/fp16 accepted), last dim
            contiguous; ``num_experts <= 1024``.
        e_score_correction_bias: ``(num_experts,)`` float32 or None; added to the scores for the
            selection only ("noaux_tc").
        topk: experts per token (6), at most ``min(num_experts, 16)``.
        routed_scaling_factor: multiplies the renormalised weights (1.5); a positive normal float32.
        input_ids, tid2eid: hash layers: ``input_ids`` ``(num_tokens,)`` int32/int64 token ids,
            ``tid2eid`` ``(vocab, topk)`` int32/int64 contiguous; the ids are ``tid2eid[input_ids]``
            (no selection). A token id outside ``[0, vocab)`` or a table entry outside
            ``[0, num_experts)`` gives id -1 with weight 0 (checked in-kernel: no host sync).
        config: a row of ``CONFIGS`` (``BLOCK_T``, ``num_warps``).

    Returns:
        ``topk_weights`` ``(num_tokens, topk)`` float32, ``topk_ids`` ``(num_tokens, topk)`` int32,
        in selection order (descending ``score + bias``; ties to the lowest id). Ids are always
        distinct and in ``[0, num_experts)`` (or -1 on the hash path as above), whatever the logits:
        a NaN score ranks after every number; an all-NaN row picks ids ``0..topk-1`` with NaN
        weights; a ``+inf`` logit makes that row's weights NaN (inf/inf), as in vLLM.

    Raises:
        TypeError / ValueError: dtypes, shapes, strides, devices, or a half-given hash table.
    """
    check.tensor("router_logits", router_logits, (torch.float32, torch.bfloat16, torch.float16))
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits: expected (num_tokens, num_experts), got shape {tuple(router_logits.shape)}")
    T, E = router_logits.shape
    if not 1 <= E <= 1024:
        raise ValueError(f"router_logits: num_experts={E} outside 1..1024")
    if not isinstance(topk, int) or not 1 <= topk <= min(E, 16):
        raise ValueError(f"topk={topk!r}: must be an int in 1..min(num_experts, 16)")
    check.last_dim_contiguous("router_logits", router_logits)
    scaling = check.fp32_scalar("routed_scaling_factor", routed_scaling_factor, positive=True)
    dev = router_logits.device
    hashed = check_routing_args("router_logits", router_logits, T, E, topk, input_ids, tid2eid,
                                e_score_correction_bias)
    w = torch.empty((T, topk), dtype=torch.float32, device=dev)
    ids = torch.empty((T, topk), dtype=torch.int32, device=dev)
    if T:
        cfg = config or pick_config(T, dev)
        dummy = router_logits
        _sqrtsoftplus_topk_kernel[(triton.cdiv(T, cfg["BLOCK_T"]),)](
            router_logits, e_score_correction_bias if e_score_correction_bias is not None else dummy,
            input_ids if hashed else dummy, tid2eid if hashed else dummy, w, ids,
            T, E, tid2eid.shape[0] if hashed else 0, router_logits.stride(0),
            tid2eid.stride(0) if hashed else 0, scaling,
            TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), BLOCK_T=cfg["BLOCK_T"], BLOCK_E=triton.next_power_of_2(E),
            HAS_BIAS=e_score_correction_bias is not None, HASH=hashed, num_warps=cfg["num_warps"])
    return w, ids


# ---- config table ------------------------------------------------------------------------------
# One row of 256 experts is 1 KiB; a program takes BLOCK_T rows. Decode (few rows) wants one row per
# program and one warp; prefill packs rows. Registers only, no shared memory beyond reductions.
CONFIGS = {
    "sm_89": {"row": {"BLOCK_T": 1, "num_warps": 1}, "rows4": {"BLOCK_T": 4, "num_warps": 4},
              "rows16": {"BLOCK_T": 16, "num_warps": 8}},
    # no rows16 on sm_90: with the slot-order sum (slot_sum) ptxas for sm_90a spills 8 B of it (ds4lab aot);
    # it is the interpreter's row (pick_config never returns it on a GPU)
    "sm_90": {"row": {"BLOCK_T": 1, "num_warps": 1}, "rows4": {"BLOCK_T": 4, "num_warps": 4}},
}


# the rows pick_config can return on a GPU (the rest are benchmark candidates or interpreter sizes);
# the compile report builds these for sm_120, tests/test_arch.py sweeps pick_config against them
GPU_DEFAULTS = {"sm_89": ("row", "rows4"), "sm_90": ("row", "rows4")}


def pick_config(T: int, device: torch.device) -> dict:
    table = CONFIGS[arch_of(device)]
    if device.type != "cuda":  # interpreter: fewest programs
        return CONFIGS["sm_89"]["rows16"]
    return table["row"] if T <= 512 else table["rows4"]


def check_routing_args(anchor_name: str, anchor: torch.Tensor, T: int, E: int, topk: int,
                       input_ids: torch.Tensor | None, tid2eid: torch.Tensor | None,
                       e_score_correction_bias: torch.Tensor | None) -> bool:
    """The routing inputs both routers take, checked against ``anchor`` (the logits or the hidden
    states, named ``anchor_name``): a hash layer's ``input_ids (T,)`` int32/int64 contiguous with
    its ``tid2eid (vocab, topk)`` table (both or neither), the ``e_score_correction_bias (E,)``
    fp32/bf16/fp16 contiguous. Returns whether the layer is hashed; raises ``TypeError`` /
    ``ValueError`` naming the argument."""
    hashed = tid2eid is not None or input_ids is not None
    if hashed:
        if tid2eid is None or input_ids is None:
            raise ValueError("input_ids and tid2eid: give both (hash layer) or neither")
        check.tensor("input_ids", input_ids, (torch.int32, torch.int64))
        check.tensor("tid2eid", tid2eid, (torch.int32, torch.int64))
        check.same_device(anchor_name, anchor, input_ids=input_ids, tid2eid=tid2eid)
        if input_ids.shape != (T,) or (T and input_ids.stride(0) != 1):
            raise ValueError(f"input_ids: shape {tuple(input_ids.shape)}, expected contiguous ({T},)")
        if tid2eid.dim() != 2 or tid2eid.shape[1] != topk or tid2eid.stride(1) != 1:
            raise ValueError(f"tid2eid: expected a (vocab, topk={topk}) table with contiguous rows, "
                             f"got shape {tuple(tid2eid.shape)} strides {tuple(tid2eid.stride())}")
    b = e_score_correction_bias
    if b is not None:
        check.tensor("e_score_correction_bias", b, (torch.float32, torch.bfloat16, torch.float16))
        if b.shape != (E,) or (E and b.stride(0) != 1):
            raise ValueError(f"e_score_correction_bias: shape {tuple(b.shape)}, expected contiguous ({E},)")
        check.same_device(anchor_name, anchor, e_score_correction_bias=b)
    return hashed
