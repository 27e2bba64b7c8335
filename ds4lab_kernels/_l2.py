"""L2 prefetch from inside a kernel (issue 20, l2pf): a launch that is latency-bound (idle DRAM slots)
issues non-blocking ``prefetch.global.L2`` requests for the bytes the NEXT kernels on the chain will
read, so those find them in L2 instead of paying a DRAM round trip in their first load wave.

One home for it: the host side checks a launcher's ``prefetch=`` argument (:func:`prefetch_regions`)
and turns the checked regions into the kernel's keyword arguments (:func:`prefetch_kwargs`); the device
side (:func:`prefetch_regions_l2`) prefetches part ``part`` of ``n_parts`` of every region, one PTX
``prefetch`` per 128-byte line. A kernel takes ``PF: tl.constexpr = 0`` (regions), ``PF_BLOCK``,
``PF_EVICT_LAST`` and ``pf_ptrs=None, pf_bytes=None`` (tuples): with ``PF = 0`` none of it is traced
and the kernel compiles as without it (the None arguments are constexprs, not parameters).

The CPU interpreter runs no inline PTX: launchers pass nothing there (:func:`prefetch_kwargs` with
``enabled=False``), so the prefetch is a no-op and the outputs are unchanged by construction (a
prefetch moves no data into registers or memory; only the L2's contents change).
"""
import torch
import triton
import triton.language as tl

LINE = 128  # bytes per L2 line: one prefetch each (the device code's literal 128)
#: regions one launch prefetches at most: the big weights of the next ops and the small tensors their
#: first loads read next to them (scales, biases, norm weights: each its own allocation, each a cold DRAM
#: round trip on the consumer's critical path if left out)
MAX_REGIONS = 8
#: the L2 eviction priority of the prefetched lines: ``"evict_last"`` (SASS ``CCTL.E.PML2``: evicted after
#: ``evict_normal`` lines, so the weights streamed between the prefetch and its consumer go first) or
#: ``"evict_normal"`` (``CCTL.E.PF2``, a plain prefetch). Read per launch: ``ds4lab step --ab
#: "_l2.PREFETCH_EVICT='evict_normal'"`` times the other one.
PREFETCH_EVICT = "evict_last"
EVICT_POLICIES = ("evict_last", "evict_normal")

_PF_LAST = tl.constexpr("{ .reg .pred %pfp; setp.ne.b32 %pfp, $2, 0; "
                        "@%pfp prefetch.global.L2::evict_last [$1]; mov.b32 $0, 0; }")
_PF_NORMAL = tl.constexpr("{ .reg .pred %pfp; setp.ne.b32 %pfp, $2, 0; "
                          "@%pfp prefetch.global.L2::evict_normal [$1]; mov.b32 $0, 0; }")


@triton.jit
def _prefetch_lines(addr, on, EVICT_LAST: tl.constexpr):
    """One predicated ``prefetch.global.L2::evict_last`` (or ``::evict_normal``) per element: the line
    holding ``addr`` where ``on != 0``. ``is_pure=False``: kept although its dummy result is unused."""
    if EVICT_LAST:
        return tl.inline_asm_elementwise(_PF_LAST, "=r,l,r", [addr, on], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise(_PF_NORMAL, "=r,l,r", [addr, on], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_offsets(nbytes, part, n_parts, off, BLOCK: tl.constexpr):
    """Byte offsets (int64) and mask of lines ``off .. off + BLOCK`` of part ``part`` of ``n_parts`` of a region of
    ``nbytes`` bytes. The region's ``cdiv(nbytes, 128) + 1`` lines are offsets ``i * 128`` clamped to ``nbytes - 1``
    (steps of at most 128 bytes from the first byte to the last: every line they span, whatever the base's
    alignment; an aligned region repeats its last line once); part ``p`` owns the
    ``cdiv(lines, n_parts)`` lines from ``p * cdiv(lines, n_parts)``; a part ``>= n_parts`` owns none. Pure integer
    math (the interpreter runs it: tests/test_seam_prefetch.py checks the parts cover every line once)."""
    nlines = tl.where(nbytes > 0, (nbytes + 127) // 128 + 1, 0)
    per = tl.cdiv(nlines, n_parts)
    i = off + tl.arange(0, BLOCK)
    line = part * per + i
    ok = (i < per) & (line < nlines) & (part < n_parts)
    return tl.minimum(line.to(tl.int64) * 128, nbytes - 1), ok


@triton.jit
def prefetch_l2(base, nbytes, part, n_parts, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Prefetch part ``part`` of ``n_parts`` of the ``nbytes`` bytes at ``base`` (a pointer of any element type)
    into L2, ``BLOCK`` lines per loop step (``BLOCK`` = the program's threads times the lines each issues a
    step): :func:`prefetch_offsets`, one :func:`_prefetch_lines` per line. Non-blocking: nothing waits on it."""
    p8 = base.to(tl.pointer_type(tl.int8))
    nlines = tl.where(nbytes > 0, (nbytes + 127) // 128 + 1, 0)
    per = tl.cdiv(nlines, n_parts)
    for off in range(0, per, BLOCK):
        byte, ok = prefetch_offsets(nbytes, part, n_parts, off, BLOCK)
        _prefetch_lines(p8 + byte, ok.to(tl.int32), EVICT_LAST)


@triton.jit
def prefetch_regions_l2(part, n_parts, pf_ptrs, pf_bytes, PF: tl.constexpr, BLOCK: tl.constexpr,
                        EVICT_LAST: tl.constexpr):
    """:func:`prefetch_l2` of part ``part`` of ``n_parts`` of each of the ``PF`` regions ``(pf_ptrs[r],
    pf_bytes[r])``, region 0 first (the launcher's order: the soonest consumer first)."""
    for r in tl.static_range(PF):
        prefetch_l2(pf_ptrs[r], pf_bytes[r], part, n_parts, BLOCK, EVICT_LAST)


# ---- host side -----------------------------------------------------------------------------------
def prefetch_regions(prefetch, device: torch.device, name: str = "prefetch") -> list:
    """Check a launcher's ``prefetch`` argument: None, or a tuple / list of up to :data:`MAX_REGIONS`
    contiguous tensors (any dtype) on ``device``. Returns the non-empty ones, in order.

    Raises:
        TypeError: ``prefetch`` not None / a tuple / a list, or an entry not a tensor.
        ValueError: more than :data:`MAX_REGIONS` entries, an entry on another device, not contiguous or of 2 GiB
            or more (the device code counts bytes in int32).
    """
    if prefetch is None:
        return []
    if not isinstance(prefetch, (tuple, list)):
        raise TypeError(f"{name}: expected None or a tuple/list of up to {MAX_REGIONS} tensors, got "
                        f"{type(prefetch).__name__}")
    if len(prefetch) > MAX_REGIONS:
        raise ValueError(f"{name}: {len(prefetch)} tensors, at most {MAX_REGIONS} regions a launch")
    out = []
    for i, t in enumerate(prefetch):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}]: expected a tensor, got {type(t).__name__}")
        if t.device != torch.device(device):
            raise ValueError(f"{name}[{i}]: on {t.device}, expected the call's device {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}]: must be contiguous (its bytes are prefetched as one range), got shape "
                             f"{tuple(t.shape)} strides {tuple(t.stride())}")
        if t.numel() * t.element_size() >= 2**31 - LINE:
            raise ValueError(f"{name}[{i}]: {t.numel() * t.element_size()} bytes, a region must stay below 2 GiB")
        if t.numel():
            out.append(t)
    return out


def prefetch_kwargs(regions: list, enabled: bool, num_warps: int, lines_per_thread: int = 2) -> dict:
    """The kernel keyword arguments for ``regions`` (:func:`prefetch_regions`): ``{}`` (the kernel's
    defaults: no prefetch traced) when not ``enabled`` (the interpreter) or no region, else ``PF``,
    ``PF_BLOCK`` (``lines_per_thread`` lines per thread per loop step), ``PF_EVICT_LAST`` (from
    :data:`PREFETCH_EVICT`, read now) and the ``pf_ptrs`` / ``pf_bytes`` tuples."""
    if not enabled or not regions:
        return {}
    if PREFETCH_EVICT not in EVICT_POLICIES:
        raise ValueError(f"PREFETCH_EVICT={PREFETCH_EVICT!r}: expected one of {EVICT_POLICIES}")
    return {"PF": len(regions), "PF_BLOCK": lines_per_thread * 32 * num_warps,
            "PF_EVICT_LAST": PREFETCH_EVICT == "evict_last", "pf_ptrs": tuple(regions),
            "pf_bytes": tuple(t.numel() * t.element_size() for t in regions)}
