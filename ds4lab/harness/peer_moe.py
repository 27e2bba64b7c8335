"""The real W4A16 MoE peer: vLLM 0.32's Triton ``fused_moe_kernel_gptq_awq``, launched the way
vLLM launches it, on ds4lab's own expert weights.

What a vLLM decode step runs for a compressed-tensors W4A16 MoE on the Triton path
(``fused_moe.fused_experts_impl`` with ``use_int4_w4a16``; ``invoke_fused_moe_wna16_triton_kernel``):

1. ``moe_align_block_size`` (a C++ op in vLLM): here :func:`align_block_size`, torch, built once per
   input set OUTSIDE the timed region;
2. GEMM 1, ``fused_moe_kernel_gptq_awq`` on ``w13``: ``C1 [T, topk, 2I]`` bf16;
3. the activation (vLLM ``silu_and_mul_with_clamp``, one CUDA kernel): here ds4lab's one-launch
   ``norm_rope.swiglu_clamp`` (same math, bf16 in and out), INSIDE the timed region;
4. GEMM 2 on ``w2`` with ``MUL_ROUTED_WEIGHT``, ``top_k=1``: ``C3 [T*topk, 1, D]`` bf16;
5. ``moe_sum`` (for topk=6 vLLM's C++ op falls back to ``at::sum_out(.., dim=1)``): ``C3.sum(1)``,
   INSIDE the timed region.
So a timed peer call is 4 launches (2 peer GEMMs + activation + sum). :func:`peer_gemms_only`
times the two peer launches alone (the activation input precomputed), the stricter bar.

Weights: the peer reads ``B [E, N, K/2]`` uint8 with element ``k`` in byte ``k // 2`` at bit
``(k % 2) * 4`` (``b_shifter``), value ``nibble - 8`` (``b_zp_num = 8``, no zero points), and
``B_scale [E, N, K/group]``. ds4lab's compressed-tensors int32 words hold element ``8c + j`` at bits
``4j..4j+3`` of word ``c``; on a little-endian device byte ``b`` of word ``c`` is byte ``4c + b``
and holds elements ``8c + 2b`` (low) and ``8c + 2b + 1`` (high), which is exactly the peer's
layout. So the "repack" is a zero-copy ``.view(torch.uint8)`` (:func:`peer_weights`; the numerics
check against ds4lab's float64 reference proves it).

Config: vLLM's own choice for the shape is :func:`vllm_config` (``get_default_config`` for
``int4_w4a16``: ``BLOCK_SIZE_M`` 16 for M <= 20, 32 for M <= 40, else 64; then
``get_moe_wna16_block_config``: ``BLOCK_SIZE_N`` 32 / ``BLOCK_SIZE_K`` 64 at batch 1, else 64 / 32;
num_warps / num_stages left to Triton's defaults, 4 / 3). :data:`SWEEP` adds decode configs.
On CUDA, vLLM 0.32 would pick its CUDA ``moe_wna16_gemm`` for these shapes
(``should_moe_wna16_use_cuda``) and Marlin on a real Ada card; the Triton kernel is the peer here
because it is the one that runs from source on any machine.
"""
from __future__ import annotations

import torch

from ds4lab.harness import peers

__all__ = ["align_block_size", "peer_weights", "vllm_config", "SWEEP", "PeerMoE", "load_peer"]

GROUP = 128

#: small decode sweep (label -> launch config); "vllm" is added per shape by :func:`sweep_for`
SWEEP = {
    "m16n32k64w4s4": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "num_warps": 4, "num_stages": 4},
    "m16n32k128w4s4": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 128, "num_warps": 4, "num_stages": 4},
    "m16n64k64w4s3": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "num_warps": 4, "num_stages": 3},
    "m16n64k128w4s3": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "num_warps": 4, "num_stages": 3},
    "m16n128k128w4s3": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "num_warps": 4, "num_stages": 3},
    "m16n32k64w2s4": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "num_warps": 2, "num_stages": 4},
}


def vllm_config(num_tokens: int, topk: int) -> dict:
    """vLLM 0.32's config for ``num_tokens`` tokens (``get_default_config`` int4_w4a16 branch on the
    Triton path + ``get_moe_wna16_block_config(use_moe_wna16_cuda=False)``), no tuned file."""
    M = num_tokens
    bm = 16 if M <= 20 else 32 if M <= 40 else 64
    cfg = {"BLOCK_SIZE_M": bm, "GROUP_SIZE_M": 1, "SPLIT_K": 1}
    cfg.update({"BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64} if num_tokens == 1 else {"BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32})
    return cfg


def sweep_for(num_tokens: int, topk: int) -> dict:
    """``{"vllm": vllm_config(..), **SWEEP}`` with ``GROUP_SIZE_M`` / ``SPLIT_K`` filled in."""
    out = {"vllm": vllm_config(num_tokens, topk)}
    for k, v in SWEEP.items():
        out[k] = {"GROUP_SIZE_M": 1, "SPLIT_K": 1, **v}
    return out


def align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """vLLM's ``moe_align_block_size`` (``ignore_invalid_experts=True``, no expert map) in torch.

    Args:
        topk_ids: ``(T, topk)`` integer expert ids; ids outside ``[0, num_experts)`` are ignored
            (their pairs are in no block).
        block_size: ``BLOCK_SIZE_M``.

    Returns:
        ``sorted_token_ids`` int32 ``(max_num_tokens_padded,)``: flat pair indices ``t*topk + j``
        grouped by expert, each expert's run padded to a multiple of ``block_size`` with the
        sentinel ``T*topk``; ``expert_ids`` int32 ``(cdiv(max_num_tokens_padded, block_size),)``:
        the expert of each block (-1 past the used blocks, which the kernel never reads);
        ``num_tokens_post_padded`` int32 ``(1,)``. ``max_num_tokens_padded = T*topk +
        E*(block_size-1)``, capped at ``T*topk*block_size`` when ``T*topk < E`` (vLLM's sizes).
        Within an expert pairs are in ascending order (vLLM's CUDA op uses atomics, so its order
        is arbitrary; each row is independent, so the output does not depend on it).
    """
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    P, E, bm = flat.numel(), int(num_experts), int(block_size)
    max_pad = P + E * (bm - 1)
    if P < E:
        max_pad = min(P * bm, max_pad)
    valid = (flat >= 0) & (flat < E)
    key = torch.where(valid, flat, torch.full_like(flat, E))
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:E]
    padded = (counts + bm - 1) // bm * bm
    pad_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.sort(key, stable=True).indices
    ks = key[order]
    ok = ks < E
    kc = ks.clamp(max=E - 1)
    rank = torch.arange(P, device=dev) - start[kc]
    dest = pad_start[kc] + rank
    sorted_ids = torch.full((max_pad,), P, dtype=torch.int32, device=dev)
    sorted_ids[dest[ok]] = order[ok].to(torch.int32)
    nblk = -(-max_pad // bm)
    b0 = torch.arange(nblk, device=dev) * bm
    ends = torch.cumsum(padded, 0)
    ex = torch.searchsorted(ends, b0, right=True)
    total = padded.sum()
    expert_ids = torch.where(b0 < total, ex, torch.full_like(ex, -1)).to(torch.int32)
    return sorted_ids, expert_ids, total.reshape(1).to(torch.int32)


def peer_weights(packed: torch.Tensor) -> torch.Tensor:
    """ds4lab ``(E, N, K/8)`` int32 -> the peer's ``(E, N, K/2)`` uint8 (a view; see module doc)."""
    if packed.dtype != torch.int32 or packed.stride(-1) != 1:
        raise ValueError("packed: expected int32 with a contiguous last dim")
    return packed.view(torch.uint8)


def load_peer(peer_src=None):
    """The peer :class:`ds4lab.harness.peers.PeerKernel` (raises ``PeerUnavailable``)."""
    return peers.load_peer_jit(*peers.VLLM_MOE_W4A16, peer_src=peer_src)


def _invoke(fn, A, B, C, B_scale, topk_weights, sorted_ids, expert_ids, ntpp, mul_routed_weight, top_k, config):
    """``invoke_fused_moe_wna16_triton_kernel`` (vLLM 0.32) with ``B_zp=None``, group 128, bf16."""
    import triton
    import triton.language as tl
    M = A.size(0)
    num_tokens = M * top_k
    EM = sorted_ids.size(0)
    if A.size(0) < config["BLOCK_SIZE_M"]:
        EM = min(sorted_ids.size(0), A.size(0) * top_k * config["BLOCK_SIZE_M"])
    grid = (triton.cdiv(EM, config["BLOCK_SIZE_M"]) * triton.cdiv(B.size(1), config["BLOCK_SIZE_N"]),)
    fn[grid](
        A, B, C, B_scale, None, topk_weights, sorted_ids, expert_ids, ntpp,
        B.size(1), A.size(1), EM, num_tokens,
        A.stride(0), A.stride(1), B.stride(0), B.stride(2), B.stride(1), C.stride(1), C.stride(2),
        B_scale.stride(0), B_scale.stride(2), B_scale.stride(1), 0, 0, 0,
        block_k_diviable=A.size(1) % config["BLOCK_SIZE_K"] == 0, group_size=GROUP,
        MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=tl.bfloat16, has_zp=False,
        use_int4_w4a16=True, use_int8_w8a16=False, **config)


class PeerMoE:
    """One input set bound to the peer: metadata, weight views and buffers made at construction
    (outside any timed region); :meth:`__call__` runs what a vLLM step runs (4 launches) and returns
    ``(T, D)`` bf16; :meth:`gemms` runs only the two peer GEMMs (on a precomputed activation).

    Args: the ``fused_moe_w4a16`` inputs (``make_moe_inputs``), a peer kernel, a config dict
    (``BLOCK_SIZE_M/N/K``, ``GROUP_SIZE_M``, ``SPLIT_K``, optional ``num_warps``/``num_stages``)."""

    def __init__(self, kernel, x, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids,
                 swiglu_limit=10.0, config=None, **_unused):
        from ds4lab_kernels.norm_rope import swiglu_clamp
        self.fn = getattr(kernel, "fn", kernel)
        self._act = swiglu_clamp
        T, D = x.shape
        E, N2 = w13_packed.shape[:2]
        self.T, self.D, self.I, self.K = T, D, N2 // 2, topk_ids.shape[1]
        self.cfg = dict(config or vllm_config(T, self.K))
        self.limit = float(swiglu_limit)
        self.x = x.contiguous()
        self.w13, self.w2 = peer_weights(w13_packed), peer_weights(w2_packed)
        self.s13, self.s2 = w13_scale, w2_scale
        self.tw = topk_weights.contiguous()
        self.meta = align_block_size(topk_ids, self.cfg["BLOCK_SIZE_M"], E)
        dev = x.device
        self.c1 = torch.empty((T, self.K, N2), dtype=torch.bfloat16, device=dev)
        self.c3 = torch.zeros((T * self.K, 1, D), dtype=torch.bfloat16, device=dev)  # invalid pairs stay 0
        self.out = torch.empty((T, D), dtype=torch.bfloat16, device=dev)
        self.act = None

    def gemm1(self):
        _invoke(self.fn, self.x, self.w13, self.c1, self.s13, self.tw, *self.meta, False, self.K, self.cfg)

    def gemm2(self, act):
        _invoke(self.fn, act, self.w2, self.c3, self.s2, self.tw, *self.meta, True, 1, self.cfg)

    def __call__(self):
        self.gemm1()
        act = self._act(self.c1.view(-1, 2 * self.I), self.limit)
        self.gemm2(act)
        torch.sum(self.c3.view(self.T, self.K, self.D), dim=1, out=self.out)
        return self.out

    def gemms(self):
        """The two peer launches only; the activation input is made once on first use."""
        if self.act is None:
            self.gemm1()
            self.act = self._act(self.c1.view(-1, 2 * self.I), self.limit)
        self.gemm1()
        self.gemm2(self.act)
        return self.c3
