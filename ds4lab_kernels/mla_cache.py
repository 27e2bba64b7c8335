"""fp8_ds_mla KV-cache writer (DeepSeek-V4 latent KV insert, SPEC.md §2 item 10 and §3).

Semantics: vLLM ``quantize_and_insert_k_cache`` (models/deepseek_v4/common/ops/cache_utils.py) with
``is_ue8m0=True``: for each token ``t`` with ``slot = slot_mapping[t] >= 0``, entry
``pos = slot % block_size`` of block ``blk = slot // block_size`` receives

* bytes ``[pos*576, pos*576 + 448)``: the 448 NoPE dims as float8_e4m3fn, ``q = rtne(x / s_g)``
  with one power-of-two scale per 64-dim tile ``g`` (7 tiles),
  ``s_g = 2^ceil(log2(max(amax_g, 1e-4) / 448))``;
* bytes ``[pos*576 + 448, pos*576 + 576)``: the 64 RoPE dims (already rotated) as raw bf16;
* bytes ``[block_size*576 + pos*8, +8)``: the 7 UE8M0 exponent bytes ``log2(s_g) + 127`` and one
  zero pad byte.

Blocks are ``block_stride`` bytes apart (the tensor's ``stride(0)``; vLLM pads each block to a
multiple of 576 B), so the writer never assumes ``block_size * 584``.
"""
import torch
import triton
import triton.language as tl

from . import _checks as check
from ._arch import arch_of, require_fp8
from ._fp8 import ceil_pow2, fp32_pow2_to_ue8m0, to_e4m3

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
TILE = 64                      # UE8M0 quant tile (dims per scale)
N_TILES = NOPE_DIM // TILE     # 7 scales per entry
ENTRY_BYTES = NOPE_DIM + 2 * ROPE_DIM   # 576: token data bytes
SCALE_BYTES = 8                # 7 UE8M0 + 1 pad per entry
AMAX_FLOOR = 1e-4              # vLLM: fmaxf(amax, 1e-4)

# byte offsets the kernels rely on (asserted, SPEC.md §3)
assert ENTRY_BYTES == 576 and N_TILES == 7 and ENTRY_BYTES + SCALE_BYTES == 584


@triton.jit
def fp8_ds_mla_pack(c_u8_ptr, c_f8_ptr, c_bf16_ptr, slot, n_slots, stride_blk, x, BLOCK_SIZE: tl.constexpr):
    """Write one fp8_ds_mla entry (the layout's one home: every writer of the cache calls this).

    ``x``: the entry's 512-dim latent row as an ``(8, 64)`` bfloat16 tile (rows 0..6 the 7 NoPE
    tiles, row 7 the 64 rotated RoPE dims); ``slot`` int64 global slot ``block * BLOCK_SIZE + pos``,
    nothing written outside ``[0, n_slots)``. Writes the 448 e4m3 bytes (one pow2 scale per tile,
    ``2^ceil(log2(max(amax, 1e-4) / 448))``, RTNE), the raw bf16 RoPE dims, and the 7 UE8M0 bytes +
    a zero pad byte; ``stride_blk`` is the block stride in bytes."""
    if (slot >= 0) & (slot < n_slots):
        g = tl.arange(0, 8)                # 7 NoPE tiles + the RoPE tile
        c = tl.arange(0, 64)
        blk = slot // BLOCK_SIZE
        pos = slot - blk * BLOCK_SIZE
        base = blk * stride_blk                            # bytes
        ent = base + pos * 576
        sc = base + BLOCK_SIZE * 576 + pos * 8
        nope = g[:, None] < 7
        xf = tl.where(nope, x.to(tl.float32), 0.0)
        amax = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-4)
        s = ceil_pow2(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
        q = to_e4m3(tl.math.div_rn(xf, s[:, None]))
        tl.store(c_f8_ptr + ent + g[:, None] * 64 + c[None, :], q, mask=nope)
        # 7 exponent bytes + a zero pad byte
        b = tl.where(g < 7, fp32_pow2_to_ue8m0(s), 0).to(tl.uint8)
        tl.store(c_u8_ptr + sc + g, b)
        # RoPE dims: raw bf16 copy (bytes 448..575 of the entry; entry offsets are even); only row 7 stores
        tl.store(c_bf16_ptr + (ent + 448) // 2 + (g[:, None] * 0 + c[None, :]), x, mask=g[:, None] == 7)


@triton.jit
def _fp8_ds_mla_insert_kernel(
    kv_ptr, slot_ptr, c_u8_ptr, c_f8_ptr, c_bf16_ptr,
    stride_kv, stride_blk, n_slots,
    BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr,
):
    """Grid ``(num_tokens // TOKENS,)``.
    One program: TOKENS consecutive tokens: each token's 576-byte entry and its 8 scale bytes."""
    pid = tl.program_id(0)
    g = tl.arange(0, 8)
    c = tl.arange(0, 64)
    for i in tl.static_range(TOKENS):
        t = pid * TOKENS + i
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if (slot >= 0) & (slot < n_slots):
            row = kv_ptr + t.to(tl.int64) * stride_kv
            x = tl.load(row + g[:, None] * 64 + c[None, :])
            fp8_ds_mla_pack(c_u8_ptr, c_f8_ptr, c_bf16_ptr, slot, n_slots, stride_blk, x, BLOCK_SIZE)


def check_cache(name: str, cache: torch.Tensor, block_size: int) -> int:
    """Validate an fp8_ds_mla cache tensor (the writer's and the readers' one check, e.g.
    ``sparse_mla``); return its block stride in bytes.

    Raises:
        TypeError: not a uint8 tensor. ValueError: rank, ``block_size``, non-contiguous block
        bytes, blocks smaller than ``block_size * 584``, odd strides or storage offset.
    """
    check.tensor(name, cache, torch.uint8)
    if cache.dim() < 2:
        raise ValueError(f"{name}: expected (num_blocks, block_bytes) or (num_blocks, block_size, 584), "
                         f"got shape {tuple(cache.shape)}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{name}: block_size={block_size!r} must be a positive int")
    inner = cache[0] if cache.shape[0] else cache.new_empty(cache.shape[1:])
    if not inner.is_contiguous():
        raise ValueError(f"{name}: the bytes of one block must be contiguous, got strides {tuple(cache.stride())}")
    if cache.dim() == 3 and cache.shape[1] != block_size:
        raise ValueError(f"{name}: shape {tuple(cache.shape)} has {cache.shape[1]} entries per block, "
                         f"block_size={block_size}")
    block_bytes = inner.numel()
    need = block_size * (ENTRY_BYTES + SCALE_BYTES)
    if block_bytes < need:
        raise ValueError(f"{name}: {block_bytes} bytes per block < block_size*584 = {need}")
    stride = cache.stride(0) if cache.shape[0] > 1 else block_bytes
    if stride < block_bytes or stride % 2 or block_bytes % 2:
        raise ValueError(f"{name}: block stride {stride} B and block bytes {block_bytes} B must be even, "
                         f"stride >= block bytes")
    if cache.storage_offset() % 2:
        raise ValueError(f"{name}: storage offset {cache.storage_offset()} must be even (bf16 RoPE dims)")
    return stride


def flat_views(cache: torch.Tensor, stride: int):
    """uint8 / fp8 / bf16 1-D views over the bytes of a cache that passed :func:`check_cache`
    (``stride`` its block stride; indexed in bytes, bytes, bf16 elements)."""
    n = (cache.shape[0] - 1) * stride + cache[0].numel()
    u8 = torch.as_strided(cache, (n,), (1,))
    return u8, u8.view(torch.float8_e4m3fn), u8.view(torch.bfloat16)


def writer_args(cache_name: str, kv_cache: torch.Tensor, block_size: int, slots_name: str,
                slot_mapping: torch.Tensor, who: str, **others):
    """The checks every writer of this layout runs (the insert and the producers that write their
    entries in the same launch, e.g. ``norm_rope.q_kv_rmsnorm_rope(swa_cache=...)``), named after the
    writer's own arguments; ``others`` (name=tensor) must share the cache's device. Returns ``(u8, f8, bf16 views, block stride bytes, n_slots, slots)``.

    Raises:
        TypeError / ValueError: as :func:`check_cache`; ``slots_name`` not int32/int64 1-D, devices
        that differ, a device without FP8."""
    check.tensor(slots_name, slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.dim() != 1:
        raise ValueError(f"{slots_name}: expected shape (num_tokens,), got {tuple(slot_mapping.shape)}")
    stride = check_cache(cache_name, kv_cache, block_size)
    check.same_device(cache_name, kv_cache, **{slots_name: slot_mapping}, **others)
    require_fp8(cache_name, kv_cache.device, who)
    u8, f8, bf = flat_views(kv_cache, stride) if kv_cache.shape[0] else (kv_cache,) * 3
    return u8, f8, bf, stride, kv_cache.shape[0] * block_size, slot_mapping.contiguous()


def fp8_ds_mla_insert(kv: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor,
                      block_size: int = 64, config: dict | None = None) -> torch.Tensor:
    """Quantize latent KV rows and write them into an fp8_ds_mla paged cache, in place.

    Args:
        kv: ``(num_tokens, 512)`` bfloat16 latent KV (448 NoPE dims then 64 RoPE dims, RoPE already
            applied), last dim contiguous.
        slot_mapping: ``(num_tokens,)`` int32 or int64 global slots ``block * block_size + pos``;
            ``-1`` (and any slot outside the cache) skips the token. Slots must be distinct.
        kv_cache: uint8 ``(num_blocks, block_bytes)`` or ``(num_blocks, block_size, 584)`` view
            whose per-block bytes are contiguous; ``block_bytes >= block_size * 584``; the block
            stride is read from ``kv_cache.stride(0)`` (vLLM pads blocks to a multiple of 576 B).
        block_size: entries per block: 64 (SWA, C4 caches) or 2 (C128 cache at block 256).
        config: a row of ``CONFIGS`` to force; default picks by arch.

    Returns:
        ``kv_cache`` itself (written in place). Bytes outside the written entries and their
        8 scale bytes are untouched. Non-finite ``kv`` values are not supported (their tile's bytes
        are unspecified).

    Raises:
        TypeError: wrong dtypes. ValueError: wrong shapes/strides, too-small blocks, a device without
        FP8 (compute capability < 8.9).

    Semantics: vLLM ``quantize_and_insert_k_cache`` (fp8_ds_mla, UE8M0), DeepSeek-V4 / FlashMLA
    sparse FP8 KV layout.
    """
    check.tensor("kv", kv, torch.bfloat16)
    if kv.dim() != 2 or kv.shape[1] != HEAD_DIM:
        raise ValueError(f"kv: expected shape (num_tokens, {HEAD_DIM}), got {tuple(kv.shape)}")
    check.last_dim_contiguous("kv", kv)
    check.tensor("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > kv.shape[0]:
        raise ValueError(f"slot_mapping: expected shape (num_tokens,) with num_tokens <= {kv.shape[0]}, "
                         f"got {tuple(slot_mapping.shape)}")
    u8, f8, bf, stride, n_slots, slot_mapping = writer_args("kv_cache", kv_cache, block_size, "slot_mapping",
                                                            slot_mapping, "fp8_ds_mla_insert", kv=kv)
    T = slot_mapping.shape[0]  # vLLM: DP padding may leave kv longer than slot_mapping
    if T == 0 or kv_cache.shape[0] == 0:
        return kv_cache
    cfg = config or pick_config(T, kv_cache.device)
    tokens = cfg["TOKENS"]
    if T % tokens:
        tokens = 1
    _fp8_ds_mla_insert_kernel[(T // tokens,)](
        kv, slot_mapping, u8, f8, bf, kv.stride(0), stride, n_slots,
        BLOCK_SIZE=block_size, TOKENS=tokens, num_warps=cfg["num_warps"], num_stages=1)
    return kv_cache


# ---- config table ------------------------------------------------------------------------------
# One program per token (1.1 KB in, 584 B out): pure bandwidth, no shared memory beyond the tile
# reductions. Large batches take 4 tokens per program to amortise the slot/offset math.
CONFIGS = {
    "sm_89": {"tok1": {"TOKENS": 1, "num_warps": 2}, "tok4": {"TOKENS": 4, "num_warps": 4}},
    "sm_90": {"tok1": {"TOKENS": 1, "num_warps": 2}, "tok4": {"TOKENS": 4, "num_warps": 4}},
}


def pick_config(num_tokens: int, device: torch.device) -> dict:
    table = CONFIGS[arch_of(device)]
    return table["tok4"] if num_tokens >= 1024 and num_tokens % 4 == 0 else table["tok1"]
