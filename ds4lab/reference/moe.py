"""Torch references for DeepSeek-V4 routed MoE: sqrtsoftplus routing and the W4A16 INT4 experts.

Semantics:
- Routing: vLLM ``fused_moe/router/dsv4_topk.py`` (``_dsv4_topk_kernel``) and the CPU
  ``_sqrtsoftplus_bias_topk`` (hash layers: ``hash_topk``). ``s = sqrt(softplus(logit))``; the top-k
  experts by ``s + e_score_correction_bias`` (the bias steers selection only, "noaux_tc"); ties go
  to the lowest expert id; a NaN selection score ranks below every number; the weights are the
  unbiased ``s`` of the chosen experts divided by their sum (a zero sum divides by 1) times
  ``routed_scaling_factor`` (1.5). Hash layers take the ids from ``tid2eid[input_ids]`` instead.
- Experts: compressed-tensors ``pack-quantized`` INT4 (``compressed_tensors.compressors.
  pack_quantized.helpers.unpack_from_int32``): 8 nibbles per int32 along K, nibble ``j`` (bits
  ``4j..4j+3``) is element ``8c + j``, value ``nibble - 8`` (uint4b8, symmetric), one scale per
  128 K-elements. gate_up ``w13 [E, 2I, D/8]`` (rows ``[0, I)`` gate = checkpoint ``w1``, rows
  ``[I, 2I)`` up = ``w3``), down ``w2 [E, D, I/8]``. Activation (vLLM ``SiluAndMulWithClamp``):
  ``silu(min(g, limit)) * clamp(u, -limit, limit)``. Output: ``sum_j w[t,j] * down_e(act(gate_up_e(x_t)))``.
This reference dequantizes to float64 and multiplies; it is written for clarity, not speed.
"""
from __future__ import annotations

import torch

GROUP = 128
PACK = 8


# ---- routing ------------------------------------------------------------------------------------
def sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    """``sqrt(softplus(x))`` in float64 (``softplus(x) = log1p(exp(x))``, exact for large x)."""
    x = logits.double()
    return torch.sqrt(torch.where(x > 30, x, torch.log1p(torch.exp(torch.clamp(x, max=30)))))


def select_topk(sel: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries per row, descending, ties to the lowest index, NaN last
    (after -inf, lowest index first). ``sel`` ``[T, E]`` float64 -> ``[T, k]`` int64."""
    T, E = sel.shape
    key = torch.where(sel.isnan(), torch.full_like(sel, float("-inf")), sel)
    nan_rank = sel.isnan().to(torch.int64)                     # 0 for numbers, 1 for NaN
    # lexicographic (nan_rank asc, key desc, index asc) via two stable sorts
    order = torch.sort(-key, dim=1, stable=True).indices
    order = torch.gather(order, 1, torch.sort(torch.gather(nan_rank, 1, order), dim=1, stable=True).indices)
    return order[:, :k]


def renormalize(w: torch.Tensor, routed_scaling_factor: float) -> torch.Tensor:
    s = w.sum(dim=-1, keepdim=True)
    return w / torch.where(s > 0, s, torch.ones_like(s)) * routed_scaling_factor


def sqrtsoftplus_topk(router_logits: torch.Tensor, e_score_correction_bias: torch.Tensor | None = None,
                      topk: int = 6, routed_scaling_factor: float = 1.5, input_ids: torch.Tensor | None = None,
                      tid2eid: torch.Tensor | None = None, config=None):
    """Reference of ``ds4lab_kernels.moe_routing.sqrtsoftplus_topk``: ``(weights fp32 [T,k], ids int32 [T,k])``.

    With ``tid2eid`` the ids are ``tid2eid[input_ids]``; a token id outside the table or an entry
    outside ``[0, E)`` gives id -1 and weight 0 (the kernels skip it)."""
    T, E = router_logits.shape
    s = sqrt_softplus(router_logits.cpu())
    if tid2eid is not None:
        tok = input_ids.cpu().long()
        tok_ok = (tok >= 0) & (tok < tid2eid.shape[0])
        ids = tid2eid.cpu().long()[tok.clamp(0, tid2eid.shape[0] - 1)]
        ids = torch.where(tok_ok[:, None], ids, torch.full_like(ids, -1))
        ok = (ids >= 0) & (ids < E)
        w = torch.where(ok, torch.gather(s, 1, ids.clamp(0, E - 1)), torch.zeros((), dtype=s.dtype))
        ids = torch.where(ok, ids, torch.full_like(ids, -1))
    else:
        bias = torch.zeros(E, dtype=torch.float64) if e_score_correction_bias is None else \
            e_score_correction_bias.cpu().double()
        ids = select_topk(s + bias, topk)
        w = torch.gather(s, 1, ids)
    w = renormalize(w, routed_scaling_factor)
    dev = router_logits.device
    return w.float().to(dev), ids.to(torch.int32).to(dev)


def gate_sqrtsoftplus_topk(hidden_states: torch.Tensor, gate_weight: torch.Tensor,
                           e_score_correction_bias: torch.Tensor | None = None, topk: int = 6,
                           routed_scaling_factor: float = 1.5, input_ids: torch.Tensor | None = None,
                           tid2eid: torch.Tensor | None = None, config=None, **_):
    """Reference of ``ds4lab_kernels.moe_gate.gate_sqrtsoftplus_topk``: the gate GEMM in float64
    (vLLM ``GateLinear``: bf16 x bf16, fp32 logits), then :func:`sqrtsoftplus_topk` on the float64
    logits. Returns ``(weights fp32 [T,k], ids int32 [T,k], router_logits fp32 [T,E])``."""
    lg = hidden_states.cpu().double() @ gate_weight.cpu().double().T
    w, ids = sqrtsoftplus_topk(lg, e_score_correction_bias, topk, routed_scaling_factor, input_ids, tid2eid)
    dev = hidden_states.device
    return w.to(dev), ids.to(dev), lg.float().to(dev)


# ---- INT4 pack-quantized weights ---------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed int4 values ``[..., K]`` in [-8, 7] -> int32 ``[..., K/8]`` (compressed-tensors
    ``pack_to_int32``, num_bits=4, packed_dim=1: nibble j of word c holds element 8c+j, value+8)."""
    u = (q.to(torch.int64) + 8) & 0xF
    u = u.reshape(*q.shape[:-1], q.shape[-1] // PACK, PACK)
    word = (u << (4 * torch.arange(PACK, dtype=torch.int64, device=q.device))).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 ``[..., K/8]`` -> int8 ``[..., K]`` in [-8, 7]."""
    v = p.to(torch.int64) & 0xFFFFFFFF
    nib = (v[..., None] >> (4 * torch.arange(PACK, dtype=torch.int64, device=p.device))) & 0xF
    return (nib - 8).reshape(*p.shape[:-1], p.shape[-1] * PACK).to(torch.int8)


def dequant_int4(packed: torch.Tensor, scale: torch.Tensor, group_size: int = GROUP) -> torch.Tensor:
    """``[..., N, K/8]`` int32 + ``[..., N, K/group]`` scales -> float64 ``[..., N, K]``."""
    q = unpack_int4(packed).double()
    s = scale.double().repeat_interleave(group_size, dim=-1)
    return q * s


def swiglu_clamp(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(g, limit)) * clamp(u, -limit, limit)`` (NaN propagates as in torch.clamp)."""
    g = torch.where(g > limit, torch.full_like(g, limit), g)
    u = torch.where(u > limit, torch.full_like(u, limit), torch.where(u < -limit, torch.full_like(u, -limit), u))
    return g * torch.sigmoid(g) * u


def fused_moe_w4a16(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor,
                    w2_packed: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, swiglu_limit: float = 10.0, config=None, out=None,
                    accumulate: bool = False, **_unused):
    """Reference of ``ds4lab_kernels.moe_w4a16.fused_moe_w4a16``: bf16 ``[T, D]``; with ``accumulate``
    float64 ``out + routed`` (``out`` float ``[T, D]``, not modified; no rounding of the sum).

    Only the experts some token picked are dequantized (an untouched expert's weights are never
    read, so NaN there cannot reach the output); ids < 0 contribute nothing. Runs in float64 on
    the inputs' device."""
    T, D = x.shape
    ids = topk_ids.long()
    w = topk_weights.double()
    xf = x.double()
    I = w13_packed.shape[1] // 2
    acc = torch.zeros(T, D, dtype=torch.float64, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        w13 = dequant_int4(w13_packed[e], w13_scale[e])
        w2 = dequant_int4(w2_packed[e], w2_scale[e])
        gu = xf[rows] @ w13.T
        h = swiglu_clamp(gu[:, :I], gu[:, I:], swiglu_limit)
        acc.index_add_(0, rows, (h @ w2.T) * w[rows, slots][:, None])
    if accumulate:
        return out.double() + acc
    return acc.to(torch.bfloat16)


def dequant_bf16_moe(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids,
                     swiglu_limit: float = 10.0, **_unused):
    """The benchmark's torch baseline on any device: dequantize the touched experts to bf16 and
    run the same math with bf16 matmuls (what a fallback without a W4A16 kernel does)."""
    T, D = x.shape
    I = w13_packed.shape[1] // 2
    ids = topk_ids.long()
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    shifts = 4 * torch.arange(PACK, device=x.device, dtype=torch.int32)

    def deq(p, s):
        q = ((p[..., None] >> shifts) & 0xF).reshape(*p.shape[:-1], p.shape[-1] * PACK) - 8
        return (q.to(torch.bfloat16).reshape(*s.shape, GROUP) * s[..., None].to(torch.bfloat16)).reshape(q.shape)

    for e in torch.unique(ids[ids >= 0]).tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        gu = (x[rows] @ deq(w13_packed[e], w13_scale[e]).T).float()
        h = swiglu_clamp(gu[:, :I], gu[:, I:], swiglu_limit).to(torch.bfloat16)
        y = (h @ deq(w2_packed[e], w2_scale[e]).T).float() * topk_weights[rows, slots][:, None]
        out.index_add_(0, rows, y)
    return out.to(torch.bfloat16)
