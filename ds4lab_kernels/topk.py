"""Top-k indices per row (DeepSeek-V4 lightning indexer, k = 512; vLLM ``top_k_per_row``).

Exact radix select, one program per row: the fp32 scores are mapped to order-preserving int32
keys (NaN and -inf are not selectable; -0.0 is folded onto +0.0); up to four 256-bin histogram
passes (``tl.histogram``), one per key byte from the top, find the exact k-th largest key ``T``
and how many entries equal to ``T`` must be taken; a last pass writes the indices with a running
prefix sum. A pass is skipped as soon as the k-th entry's bin is taken whole. Every pass streams
the row once (2 to 5 reads of the row; rows up to 2^31 - 2 entries). Rows of up to a config's ``ROW``
entries can instead be selected on registers (``select_topk_regs_loop``: one read of the row, narrower
radix digits, the same result); ``select_topk`` picks between the two per row.

Tie rule (deterministic): among entries with equal score, the LOWER index wins. Output order:
the selected indices in ascending index order (not sorted by score), then ``-1`` padding.
"""
import torch
import triton
import triton.language as tl

from . import _checks as check
from ._arch import arch_of, num_sms


@triton.jit
def _skey(v):
    """fp32 -> int32 key with the same order as the floats (signed compare); -0.0 -> +0.0."""
    v = tl.where(v == 0.0, 0.0, v)
    bits = v.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _load_keys(row_ptr, offs, L):
    """Order-preserving int32 keys of ``row[offs]`` and which of them are selectable (in range, not NaN/-inf)."""
    m = offs < L
    v = tl.load(row_ptr + offs, mask=m, other=float("-inf"))
    valid = m & (v == v) & (v != float("-inf"))
    return _skey(v), valid


@triton.jit
def _select_bin(hist, need, NB: tl.constexpr):
    """Highest bin whose suffix count reaches ``need``: (bin, count in that bin, count above it)."""
    suffix = tl.cumsum(hist, 0, reverse=True)
    b = tl.sum((suffix >= need).to(tl.int32), 0) - 1
    bins = tl.arange(0, NB)
    in_bin = tl.sum(tl.where(bins == b, hist, 0), 0)
    above = tl.sum(tl.where(bins > b, hist, 0), 0)
    return b, in_bin, above


@triton.jit
def _row_len(len_ptr, r, N, HAS_LEN: tl.constexpr):
    """Entries of row ``r`` to consider: ``lengths[r]`` clamped to ``[0, N]``, or ``N``."""
    L = N
    if HAS_LEN:
        L = tl.minimum(tl.maximum(tl.load(len_ptr + r), 0), N)
    return L


@triton.jit
def _digit_hist(h, row_ptr, lane, lo, hi, prefix, LVL: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram pass ``LVL`` over entries ``[lo, hi)`` of a row, added to ``h`` (256 int32 bins).

    ``LVL == 0``: the top key byte (signed, biased by 128) of every selectable entry; ``LVL > 0``:
    key byte ``3 - LVL`` of the selectable entries whose higher bytes equal ``prefix``. ``lane``:
    ``tl.arange(0, BLOCK)`` from the caller, made outside any branch (made here, inside the split
    kernel's ``done`` branch, it cost one more PTX branch)."""
    SHIFT: tl.constexpr = 24 - 8 * LVL
    for c in range(lo, hi, BLOCK):
        key, valid = _load_keys(row_ptr, c + lane, hi)
        if LVL == 0:
            h += tl.histogram((key >> 24) + 128, 256, mask=valid)
        else:
            sel = valid & ((key >> (SHIFT + 8)) == prefix)
            h += tl.histogram((key >> SHIFT) & 0xFF, 256, mask=sel)
    return h


@triton.jit
def _select_start(k_eff):
    """The radix descent's start for ``k_eff`` entries to take: ``(prefix, need, T, need_eq, done)`` =
    no prefix, all ``k_eff`` needed, threshold key above every key, no ties taken, done iff nothing to take."""
    return k_eff * 0, k_eff, k_eff * 0 + 2147483647, k_eff * 0, k_eff == 0


@triton.jit
def _descend(h, need, prefix, T, need_eq, done, LVL: tl.constexpr):
    """One 8-bit radix level ``LVL`` of the streaming select (``_descend_bits`` with key byte ``3 - LVL``)."""
    return _descend_bits(h, need, prefix, T, need_eq, done, 24 - 8 * LVL, 8, LVL == 0)


@triton.jit
def _pick_bin(hr, need, NB: tl.constexpr):
    """``_select_bin`` for a REVERSED histogram (``hr[NB - 1 - d]`` counts digit ``d``), in one forward
    scan and ONE int32 reduction (``NB <= 4096`` bins, counts ``< 2^15``): (bin, count above it, whether
    that bin is taken whole). The forward prefix of ``hr`` is the suffix count of the digits; the
    k-th entry's digit is the first prefix that reaches ``need`` (``NB - 1 - #{prefix < need}``), the
    entries above it are the bins before it, and it is taken whole iff its own prefix equals ``need``
    (that bin alone has ``prefix - hr < need <= prefix``; the empty bins after it repeat its prefix):
    the three in one packed sum (13 + 1 + 15 bits). (A reverse ``tl.cumsum`` of 4,096 bins costs ~2x
    the forward one in sm_89 SASS: 370 shuffles.) ``need`` in ``[1, sum(hr)]``."""
    pre = tl.cumsum(hr, 0)
    lt = pre < need
    whole = (pre == need) & (pre - hr < need)
    s = tl.sum(tl.where(lt, 1 + (hr << 14), 0) + (whole.to(tl.int32) << 13), 0)
    return NB - 1 - (s & 0x1FFF), s >> 14, ((s >> 13) & 1) != 0


@triton.jit
def _descend_bits(h, need, prefix, T, need_eq, done, SHIFT: tl.constexpr, BITS: tl.constexpr,
                  FIRST: tl.constexpr):
    """One radix level from its ``2^BITS``-bin histogram ``h`` of key bits ``[SHIFT, SHIFT + BITS)``
    (read by ``_select_bin``): the k-th entry's bin extends ``prefix`` by ``BITS`` bits (``FIRST``: the
    top bits, signed, bins biased by ``2^(BITS-1)``).

    When that bin is taken whole, every key >= its lowest key is selected (``T = prefix << SHIFT``,
    ``need_eq`` unbounded); at the last level (``SHIFT == 0``) ``T`` is the exact k-th key and
    ``need_eq`` entries equal to it are taken. Either way ``done`` becomes true, in the caller's dtype
    (int1 in the one-program kernels, the int32 state flag in the split select kernel)."""
    b, cnt, above = _select_bin(h, need, 1 << BITS)
    whole = need - above == cnt
    if FIRST:
        prefix = b - (1 << (BITS - 1))        # signed top bits
    else:
        prefix = (prefix << BITS) | b
    need = need - above
    if whole:                                 # the whole bin is taken: keys >= its lowest key
        T = prefix << SHIFT
        need_eq = need * 0 + 2147483647
        done = (need == need).to(done.dtype)
    elif SHIFT == 0:                          # exact key: take `need` of the entries equal to it
        T = prefix
        need_eq = need
        done = (need == need).to(done.dtype)
    return prefix, need, T, need_eq, done


@triton.jit
def _pad_tail(out_row, k_eff, K: tl.constexpr, KP2: tl.constexpr):
    """``-1`` in output slots ``[k_eff, K)``."""
    q = tl.arange(0, KP2)
    tl.store(out_row + q, tl.full((KP2,), -1, tl.int32), mask=(q >= k_eff) & (q < K))


@triton.jit
def select_topk_row(row_ptr, out_row, L, off, K: tl.constexpr, KP2: tl.constexpr, BLOCK: tl.constexpr):
    """The exact top-``K`` of entries ``[0, L)`` of one fp32 row, in one program (the one home of the
    streaming single-row select: ``_topk_kernel`` and the indexer's one-launch logits + top-k reach it
    through ``select_topk``).

    Up to 4 radix passes (each streams the row ``BLOCK`` entries at a time), then the output pass:
    ``out_row[0 : min(K, #selectable)]`` = the selected indices ``+ off`` in ascending index order
    (ties: the lower index wins), ``-1`` in the slots after them. NaN / -inf are never selected."""
    lane = tl.arange(0, BLOCK)
    # pass 0 counts the selectable entries together with the top-digit histogram
    h = _digit_hist(tl.zeros((256,), tl.int32), row_ptr, lane, 0, L, 0, 0, BLOCK)
    k_eff = tl.minimum(tl.sum(h, 0), K)
    # find the threshold key T: everything > T is taken, plus the first need_eq entries == T
    prefix, need, T, need_eq, done = _select_start(k_eff)
    for lvl in tl.static_range(4):
        if not done:
            if lvl > 0:
                h = _digit_hist(tl.zeros((256,), tl.int32), row_ptr, lane, 0, L, prefix, lvl, BLOCK)
            prefix, need, T, need_eq, done = _descend(h, need, prefix, T, need_eq, done, lvl)
    # output pass: ascending index order, ties on T resolved by lower index
    _write_from(row_ptr, row_ptr, out_row, lane, L, T, need_eq, off, False, BLOCK)
    _pad_tail(out_row, k_eff, K, KP2)


# ---- register-resident select (config key "ROW"; the indexer's "SEL_ROW"): one read of the row ----
# Rows of up to ROW entries: the keys are loaded ONCE into registers (ROW / (32 * num_warps) per thread)
# and every radix level and the output pass run on them. Digits of W bits (after a first level of W0
# bits): a masked ``tl.histogram`` of 2,048 keys on 4 warps costs 24 / 31 / 39 / 56 sm_89 SASS
# instructions per key at 32 / 64 / 128 / 256 bins (1 / 2 / 4 / 8 POPC, a quarter-rate instruction;
# ds4lab aot, triton 3.7.1), so a key bit costs less in narrow digits, while every level adds a
# fixed scan + reduction; 6 bits it is (NOTES.md "idx10"). The first level can come from elsewhere
# (``h0``: the one-launch indexer's logits programs count every score's top W0 bits into a global
# histogram, ``hist0_add``). The histograms are reversed (bin ``2^W - 1 - d`` counts digit ``d``) so a
# forward scan gives the suffix counts the pick needs.
@triton.jit
def hist0_add(h_row, v, offs, lim, BITS: tl.constexpr):
    """Count the fp32 scores ``v`` (``offs``: their row positions; selectable: ``offs < lim``, not
    NaN / -inf) into ``h_row``, the row's int32 histogram of the top ``BITS`` key bits (bin = signed
    top bits, REVERSED as ``_pick_bin`` reads it: bin ``2^(BITS-1) - 1 - (key >> (32 - BITS))``; zero
    before the first add): one relaxed gpu-scope ``atomic_add`` per selectable score, so any number of
    programs can add to one row."""
    valid = (offs < lim) & (v == v) & (v != float("-inf"))
    b = (1 << (BITS - 1)) - 1 - (_skey(v) >> (32 - BITS))
    tl.atomic_add(h_row + b, tl.full(b.shape, 1, tl.int32), mask=valid, sem="relaxed", scope="gpu")


@triton.jit
def _reg_write(key, valid, offs, out_row, T, need_eq, off):
    """The ordered output pass on register keys: keys ``> T`` and the first ``need_eq`` keys
    ``== T`` (lower index first), stored as ``offs + off`` from slot 0 in ascending index order. One
    scan: the inclusive prefix counts of both kinds packed in one int32 (rows < 2^15 entries)."""
    gt = valid & (key > T)
    eq = valid & (key == T)
    c = tl.cumsum(gt.to(tl.int32) | (eq.to(tl.int32) << 16), 0)
    n_gt = (c & 0xFFFF) - gt.to(tl.int32)      # exclusive: entries before this one
    n_eq = (c >> 16) - eq.to(tl.int32)
    take = gt | (eq & (n_eq < need_eq))
    # one int32 tensor carries slot and mask into the store's layout (1 entry per thread: the slots are
    # not contiguous), instead of a 64-bit pointer and a mask (half the shared-memory round trip)
    slot = tl.where(take, n_gt + tl.minimum(n_eq, need_eq), -1)
    tl.store(out_row + slot, offs + off, mask=slot >= 0)


# ---- the compact register select (config key "LOOP" / the indexer's "SEL_LOOP", NOTES.md "idx10c") ----
# idx10's first register select unrolled its radix levels (``tl.static_range``, each level's shift and width
# constexpr): 7-8 K SASS instructions at next_n 1 for ONE program, fetched cold in the decode step where ~40
# other kernels run between two indexer calls (removed after idx10w; it is in git history, NOTES.md "idx10").
# Here the levels are one runtime loop body (``while not done``) on the keys with the sign bit flipped (``ukey``: unsigned order = the float order), so every
# level, the first included, is the same code: fixed ``2^W`` reversed bins, a runtime shift ``lo`` and
# digit width ``sh - lo`` (the bottom level just uses fewer bins: its digits ``d < 2^(sh-lo)`` land in
# reversed bins ``2^W - 1 - d``, the bins before them stay empty, so ``_pick_bin`` returns ``d`` itself).
# The prefix is kept in place (``pfx``: the decided top bits, the rest 0, i.e. the lowest key with that
# prefix) with its mask ``hi``, so a level's stop sets ``T = pfx`` whether its bin is taken whole or it
# was the last level.
@triton.jit
def _regc_levels(ukey, valid, need, pfx, hi, sh, T, need_eq, done, W: tl.constexpr):
    """Radix levels of ``W`` bits (fewer at the bottom) below the top ``32 - sh`` decided bits of
    ``ukey`` (``pfx`` / mask ``hi``), a runtime loop until the k-th entry's bin is taken whole or the
    key is exact: returns ``(T, need_eq)`` in the ``ukey`` domain."""
    NB: tl.constexpr = 1 << W
    while not done:
        lo = tl.maximum(sh - W, 0)
        sel = valid & ((ukey & hi) == pfx)
        h = tl.histogram((NB - 1) - ((ukey >> lo) & ((1 << (sh - lo)) - 1)), NB, mask=sel)   # reversed digits
        b, above, whole = _pick_bin(h, need, NB)
        pfx = pfx | (b << lo)
        need = need - above
        hi = ~((1 << lo) - 1)
        sh = lo
        stop = whole | (lo == 0)
        T = tl.where(stop, pfx, T)
        need_eq = tl.where(whole, 2147483647, need)
        done = stop
    return T, need_eq


@triton.jit
def select_topk_regs_loop(row_ptr, out_row, L, off, h0, K: tl.constexpr, KP2: tl.constexpr, ROW: tl.constexpr,
                          W0: tl.constexpr, W: tl.constexpr, HAS_H0: tl.constexpr):
    """``select_topk_row``'s result (same indices, order, tie rule and ``-1`` padding) for a row of
    ``L <= ROW`` entries, reading the row once: ``ROW`` (a power of two <= 16,384) keys in registers,
    radix levels of ``W`` bits (the last one what is left of 32) in ONE runtime loop (``_regc_levels``),
    each one ``tl.histogram`` + one scan + one reduction on the registers, stopping as soon as the k-th
    entry's bin is taken whole; then one packed scan writes the indices. The code a call executes is the
    load, at most one ``2^W0``-bin pick, one level body and the output pass.

    ``h0``: with ``HAS_H0``, the ``(2^W0,)`` int32 reversed histogram of the first level of ``W0`` bits,
    already counted over the row's selectable entries (``hist0_add``); else ignored (the first level is
    a loop level of ``W`` bits, ``W0`` ignored)."""
    offs = tl.arange(0, ROW)
    key, valid = _load_keys(row_ptr, offs, L)
    ukey = key ^ (-2147483647 - 1)                      # unsigned order of the keys (sign bit flipped)
    k_eff = tl.minimum(tl.sum(valid.to(tl.int32), 0), K)
    _, need, T, need_eq, done = _select_start(k_eff)
    T = T | (-2147483647 - 1)                           # 0xFFFFFFFF: above every key, unsigned
    pfx = k_eff * 0
    hi = k_eff * 0
    sh = k_eff * 0 + 32
    if HAS_H0:
        if not done:
            b, above, whole = _pick_bin(h0, need, 1 << W0)   # h0 reversed over the signed top bits = unsigned
            pfx = b << (32 - W0)
            need = need - above
            hi = ~((1 << (32 - W0)) - 1)
            sh = sh - W0
            if whole:
                T = pfx
                need_eq = need * 0 + 2147483647
                done = whole
    T, need_eq = _regc_levels(ukey, valid, need, pfx, hi, sh, T, need_eq, done, W)
    _reg_write(ukey.to(tl.uint32, bitcast=True), valid, offs, out_row, T.to(tl.uint32, bitcast=True), need_eq, off)
    _pad_tail(out_row, k_eff, K, KP2)


@triton.jit
def select_topk(row_ptr, out_row, L, off, h0_row, K: tl.constexpr, KP2: tl.constexpr, BLOCK: tl.constexpr,
                ROW: tl.constexpr, W0: tl.constexpr, W: tl.constexpr, HAS_H0: tl.constexpr):
    """The one-program select of one row, by config: ``ROW == 0`` the streaming ``select_topk_row``
    (``BLOCK`` entries a step); else ``select_topk_regs_loop`` (registers, a runtime loop of radix
    levels) when ``L <= ROW`` and the streaming select for longer rows (same result either way). ``HAS_H0``: ``h0_row`` holds the row's first-level histogram
    (``hist0_add``, ``2^W0`` int32); it is read, then re-zeroed here (for the next launch)."""
    if ROW == 0:
        select_topk_row(row_ptr, out_row, L, off, K, KP2, BLOCK)
    else:
        bins = tl.arange(0, 1 << W0)
        h0 = tl.zeros((1 << W0,), tl.int32)
        if HAS_H0:
            h0 = tl.load(h0_row + bins)
            tl.store(h0_row + bins, tl.zeros((1 << W0,), tl.int32))   # same threads, same addresses
        if L <= ROW:
            select_topk_regs_loop(row_ptr, out_row, L, off, h0, K, KP2, ROW, W0, W, HAS_H0)
        else:
            select_topk_row(row_ptr, out_row, L, off, K, KP2, BLOCK)


@triton.jit
def _topk_kernel(x_ptr, len_ptr, off_ptr, out_ptr, N, stride_xr, stride_or,
                 K: tl.constexpr, KP2: tl.constexpr, HAS_LEN: tl.constexpr, HAS_OFF: tl.constexpr,
                 BLOCK: tl.constexpr, ROW: tl.constexpr, W: tl.constexpr):
    """Grid ``(num_rows,)``.
    One program: one whole row (``select_topk``: ``ROW == 0`` the streaming select, up to 4 radix passes
    then the output pass; else rows of up to ``ROW`` entries in registers, ``W``-bit digits, the levels
    as one runtime loop)."""
    r = tl.program_id(0).to(tl.int64)
    L = _row_len(len_ptr, r, N, HAS_LEN)
    off = 0
    if HAS_OFF:
        off = tl.load(off_ptr + r)
    select_topk(x_ptr + r * stride_xr, out_ptr + r * stride_or, L, off, x_ptr, K, KP2, BLOCK, ROW, W, W, False)


# ---- three-launch variant (config key "VARIANT": "r3"): P programs per row ---------------------
# L1 (R, P): each chunk's 256-bin histogram of the top key byte -> h0 [R, P, 256]; chunk 0 zeroes the
#     row's arrival counter.
# L2 (R, P): every program sums the row's P top-byte histograms (P x 1 KiB from L2) and descends one
#     radix level (the same decision in every program of the row; chunk 0 stores it); its chunk's counts
#     above / at that bin -> aux; its chunk's histogram of key byte 2 among keys in that bin -> h1.
# L3 (R, P): the second level from the summed h1 gives a 16-bit key prefix; the candidates (keys >=
#     the lowest key of that prefix: every selected entry and every tie of the k-th) are counted per
#     chunk from h0/h1, so each chunk writes its candidates, in index order, at its exclusive prefix
#     offset into a compact per-row list (values + indices, capacity CAP). The last program of the row
#     to finish (atomic arrival counter, acq_rel) selects exactly among the candidates (levels 3 and 4
#     of the radix select, then the ordered write); a row with more than CAP candidates (a plateau of
#     equal keys) is resolved from the row itself instead (slower, same result).
# Three launches; workspaces and grid depend on shapes only (CUDA-graph safe); the counter is zeroed
# in the same call (no state between calls); integer counts only (deterministic).
@triton.jit
def _r3_hist0_kernel(x_ptr, len_ptr, h0_ptr, cnt_ptr, N, stride_xr, chunk, P,
                     HAS_LEN: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(num_rows, P)``.
    One program: one chunk of one row: its top-byte histogram."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    row_ptr = x_ptr + r * stride_xr
    L = _row_len(len_ptr, r, N, HAS_LEN)
    lo = p * chunk
    hi = tl.minimum(lo + chunk, L)
    lane = tl.arange(0, BLOCK)
    h = _digit_hist(tl.zeros((256,), tl.int32), row_ptr, lane, lo, hi, 0, 0, BLOCK)
    tl.store(h0_ptr + (r * P + p) * 256 + tl.arange(0, 256), h)
    if p == 0:
        tl.store(cnt_ptr + r, 0)


@triton.jit
def _sum_chunks(h_ptr, r, P, PB: tl.constexpr):
    """Sum of the row's P chunk histograms ``h[r, :P, :]`` (read PB chunks per load)."""
    pp = tl.arange(0, PB)
    bins = tl.arange(0, 256)
    h = tl.zeros((256,), tl.int32)
    for q0 in range(0, P, PB):
        q = q0 + pp
        h += tl.sum(tl.load(h_ptr + (r * P + q[:, None]) * 256 + bins[None, :], mask=(q < P)[:, None], other=0), 0)
    return h


@triton.jit
def _r3_hist1_kernel(x_ptr, len_ptr, h0_ptr, h1_ptr, aux_ptr, st_ptr, N, stride_xr, chunk, P,
                     K: tl.constexpr, PB: tl.constexpr, HAS_LEN: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(num_rows, P)``.
    One program: the row's first radix level (from all chunks' top-byte histograms), then its own chunk's histogram of byte 2 within the selected top byte."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    row_ptr = x_ptr + r * stride_xr
    L = _row_len(len_ptr, r, N, HAS_LEN)
    lo = p * chunk
    hi = tl.minimum(lo + chunk, L)
    lane = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    h = _sum_chunks(h0_ptr, r, P, PB)
    k_eff = tl.minimum(tl.sum(h, 0), K)
    prefix, need, T, need_eq, done = _select_start(k_eff)
    if not done:
        prefix, need, T, need_eq, done = _descend(h, need, prefix, T, need_eq, done, 0)
    b0 = prefix + 128                                       # the selected top-byte bin (k_eff > 0)
    own = tl.load(h0_ptr + (r * P + p) * 256 + bins)
    gt = tl.sum(tl.where(bins > b0, own, 0), 0)
    ge = tl.sum(tl.where(bins >= b0, own, 0), 0)
    tl.store(aux_ptr + (r * P + p) * 2, tl.where(k_eff > 0, gt, 0))
    tl.store(aux_ptr + (r * P + p) * 2 + 1, tl.where(k_eff > 0, ge, 0))
    h1 = tl.zeros((256,), tl.int32)
    if not done:
        h1 = _digit_hist(h1, row_ptr, lane, lo, hi, prefix, 1, BLOCK)
    tl.store(h1_ptr + (r * P + p) * 256 + bins, h1)
    if p == 0:
        sp = st_ptr + r * 8
        tl.store(sp + 0, k_eff)
        tl.store(sp + 1, need)
        tl.store(sp + 2, prefix)
        tl.store(sp + 3, done.to(tl.int32))
        tl.store(sp + 4, T)
        tl.store(sp + 5, need_eq)


@triton.jit
def _gather(row_ptr, cv_ptr, ci_ptr, lane, lo, hi, lo_key, pos0, BLOCK: tl.constexpr):
    """Entries ``[lo, hi)`` of a row with key >= ``lo_key``, values and indices in index order,
    stored from candidate slot ``pos0``."""
    n = pos0
    for c in range(lo, hi, BLOCK):
        offs = c + lane
        m = offs < hi
        v = tl.load(row_ptr + offs, mask=m, other=float("-inf"))
        valid = m & (v == v) & (v != float("-inf"))
        take = valid & (_skey(v) >= lo_key)
        pos = n + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(cv_ptr + pos, v, mask=take)
        tl.store(ci_ptr + pos, offs, mask=take)
        n += tl.sum(take.to(tl.int32), 0)


@triton.jit
def _write_from(val_ptr, idx_ptr, out_row, lane, n, T, need_eq, off, HAS_IDX: tl.constexpr,
                BLOCK: tl.constexpr):
    """Ordered output pass over ``n`` entries of a list (indices ``idx[j]``, or ``j``): the keys
    ``> T`` and the first ``need_eq`` keys ``== T``, stored as ``index + off`` from slot 0."""
    n_sel = n * 0
    n_eq = n * 0
    for c in range(0, n, BLOCK):
        offs = c + lane
        key, valid = _load_keys(val_ptr, offs, n)
        gt = valid & (key > T)
        eq = valid & (key == T)
        eq_rank = n_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        take = gt | (eq & (eq_rank < need_eq))
        pos = n_sel + tl.cumsum(take.to(tl.int32), 0) - 1
        if HAS_IDX:
            ix = tl.load(idx_ptr + offs, mask=take, other=0)
        else:
            ix = offs
        tl.store(out_row + pos, ix + off, mask=take)
        n_sel += tl.sum(take.to(tl.int32), 0)
        n_eq += tl.sum(eq.to(tl.int32), 0)


@triton.jit
def _finish_levels(val_ptr, lane, n, need, prefix, T, need_eq, done, BLOCK: tl.constexpr):
    """Radix levels 2 and 3 (key bytes 1 and 0) over ``n`` entries of a list."""
    for lvl in tl.static_range(2, 4):
        if not done:
            h = _digit_hist(tl.zeros((256,), tl.int32), val_ptr, lane, 0, n, prefix, lvl, BLOCK)
            prefix, need, T, need_eq, done = _descend(h, need, prefix, T, need_eq, done, lvl)
    return T, need_eq


@triton.jit
def _r3_select_kernel(x_ptr, len_ptr, off_ptr, out_ptr, h1_ptr, aux_ptr, st_ptr, cnt_ptr, cv_ptr, ci_ptr,
                      N, stride_xr, stride_or, chunk, P, CAP,
                      K: tl.constexpr, KP2: tl.constexpr, PB: tl.constexpr, HAS_LEN: tl.constexpr,
                      HAS_OFF: tl.constexpr, BLOCK: tl.constexpr, FBLOCK: tl.constexpr):
    """Grid ``(num_rows, P)``.
    One program: the row's second radix level, its chunk's candidates into the row's compact list; the row's last program to arrive selects exactly and writes the row."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    row_ptr = x_ptr + r * stride_xr
    L = _row_len(len_ptr, r, N, HAS_LEN)
    lo = p * chunk
    hi = tl.minimum(lo + chunk, L)
    lane = tl.arange(0, BLOCK)
    pp = tl.arange(0, PB)
    bins = tl.arange(0, 256)
    sp = st_ptr + r * 8
    k_eff = tl.load(sp + 0)
    need = tl.load(sp + 1)
    prefix = tl.load(sp + 2)
    done0 = tl.load(sp + 3)
    T = tl.load(sp + 4)
    need_eq = tl.load(sp + 5)
    done = done0 != 0
    lo_key = T
    if not done:
        prefix, need, T, need_eq, done = _descend(_sum_chunks(h1_ptr, r, P, PB), need, prefix, T, need_eq,
                                                  done, 1)
        lo_key = prefix << 16
    # per-chunk candidate counts: a row decided at level 0 (whole top-byte bin, or nothing valid)
    # takes its chunks' top bytes >= b0; else a chunk's keys above b0 plus its byte-2 bins >= b1
    b1 = prefix & 0xFF
    M = k_eff * 0
    pos0 = k_eff * 0
    for q0 in range(0, P, PB):
        q = q0 + pp
        qm = q < P
        cnt = tl.load(aux_ptr + (r * P + q) * 2 + 1, mask=qm, other=0)
        if done0 == 0:
            t1 = tl.load(h1_ptr + (r * P + q[:, None]) * 256 + bins[None, :], mask=qm[:, None], other=0)
            cnt = tl.load(aux_ptr + (r * P + q) * 2, mask=qm, other=0) + \
                tl.sum(tl.where(bins[None, :] >= b1, t1, 0), 1)
        M += tl.sum(cnt, 0)
        pos0 += tl.sum(tl.where(q < p, cnt, 0), 0)
    cv_row = cv_ptr + r * CAP
    ci_row = ci_ptr + r * CAP
    if M <= CAP:
        _gather(row_ptr, cv_row, ci_row, lane, lo, hi, lo_key, pos0, BLOCK)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + r, 1, sem="acq_rel", scope="gpu")
    if arrived == P - 1:
        out_row = out_ptr + r * stride_or
        off = 0
        if HAS_OFF:
            off = tl.load(off_ptr + r)
        fl = tl.arange(0, FBLOCK)
        if M <= CAP:
            T, need_eq = _finish_levels(cv_row, fl, M, need, prefix, T, need_eq, done, FBLOCK)
            _write_from(cv_row, ci_row, out_row, fl, M, T, need_eq, off, True, FBLOCK)
        else:
            T, need_eq = _finish_levels(row_ptr, fl, L, need, prefix, T, need_eq, done, FBLOCK)
            _write_from(row_ptr, ci_row, out_row, fl, L, T, need_eq, off, False, FBLOCK)
        _pad_tail(out_row, k_eff, K, KP2)


SELECT_MAX_ROW = 16384      # _reg_write packs two counts in an int32; _pick_bin one of < 2^15
SELECT_MAX_BITS = 12        # _pick_bin packs the bin in 13 bits


def check_select_config(row: int, bits: int, first_bits: int, where: str) -> None:
    """A register-select config: ``row`` 0 (streaming only) or a power of two <= ``SELECT_MAX_ROW``,
    digits of ``bits`` and a first level of ``first_bits``, each in ``[1, SELECT_MAX_BITS]``.

    Raises:
        ValueError: naming ``where`` (the config) and the bad key."""
    if row and (row & (row - 1) or not 0 < row <= SELECT_MAX_ROW):
        raise ValueError(f"{where}: row {row}: expected 0 or a power of two <= {SELECT_MAX_ROW}")
    for name, b in (("bits", bits), ("first-level bits", first_bits)):
        if not 1 <= b <= SELECT_MAX_BITS:
            raise ValueError(f"{where}: {name} {b}: expected 1..{SELECT_MAX_BITS}")


def _launch_r3(logits, lengths, offsets, out, k, cfg):
    R, N = logits.shape
    BLOCK = cfg["BLOCK"]
    n_blk = max(1, triton.cdiv(N, BLOCK))
    P = cfg.get("P") or triton.cdiv(cfg.get("PROGS_PER_SM", 4) * num_sms(logits.device), R)
    P = max(1, min(P, n_blk, 64))
    chunk = triton.cdiv(n_blk, P) * BLOCK
    P = triton.cdiv(n_blk * BLOCK, chunk)
    cap = int(cfg.get("CAP", 8192))
    dev = logits.device
    i32 = torch.int32
    h0 = torch.empty((R, P, 256), dtype=i32, device=dev)
    h1 = torch.empty((R, P, 256), dtype=i32, device=dev)
    aux = torch.empty((R, P, 2), dtype=i32, device=dev)
    st = torch.empty((R, 8), dtype=i32, device=dev)
    cnt = torch.empty((R,), dtype=i32, device=dev)
    cv = torch.empty((R, cap), dtype=torch.float32, device=dev)
    ci = torch.empty((R, cap), dtype=i32, device=dev)
    lens = lengths if lengths is not None else cnt
    offs = offsets if offsets is not None else cnt
    has_len = lengths is not None
    w = cfg["num_warps"]
    PB = 16
    _r3_hist0_kernel[(R, P)](logits, lens, h0, cnt, N, logits.stride(0), chunk, P,
                             HAS_LEN=has_len, BLOCK=BLOCK, num_warps=w)
    _r3_hist1_kernel[(R, P)](logits, lens, h0, h1, aux, st, N, logits.stride(0), chunk, P,
                             K=k, PB=PB, HAS_LEN=has_len, BLOCK=BLOCK, num_warps=w)
    _r3_select_kernel[(R, P)](logits, lens, offs, out, h1, aux, st, cnt, cv, ci, N, logits.stride(0),
                              out.stride(0), chunk, P, cap, K=k, KP2=triton.next_power_of_2(k), PB=PB,
                              HAS_LEN=has_len, HAS_OFF=offsets is not None, BLOCK=BLOCK,
                              FBLOCK=cfg.get("FBLOCK", min(BLOCK, 1024)), num_warps=w)
    return out


def topk_indices(logits: torch.Tensor, k: int = 512, lengths: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, config: dict | None = None,
                 offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the ``k`` largest scores of each row (vLLM ``top_k_per_row`` semantics for the
    DeepSeek-V4 indexer; exact radix select).

    Args:
        logits: ``(num_rows, num_cols)`` float32 scores, last dim contiguous (row stride free).
            NaN counts as ``-inf``; ``-inf`` entries are never selected.
        k: how many to select per row (1..4096; 512 for DeepSeek-V4).
        lengths: optional ``(num_rows,)`` int32: row ``r`` considers ``logits[r, :lengths[r]]``
            (clamped to ``[0, num_cols]``); default all columns.
        out: optional ``(num_rows, k)`` int32 output, last dim contiguous.
        config: a row of ``CONFIGS``.
        offsets: optional ``(num_rows,)`` int32 added to every selected index of row ``r`` (the
            ``-1`` padding stays ``-1``): e.g. ``req * n_comp`` turns a request's local compressed
            positions into global cache slots in the same launch. The caller keeps
            ``index + offsets[r]`` within int32.

    Returns:
        int32 ``(num_rows, k)``: ``min(k, #selectable)`` distinct indices in ``[0, length)`` (plus
        ``offsets[r]``) in ascending index order, then ``-1``. Ties: the lower index wins
        (deterministic).

    Raises:
        TypeError / ValueError: naming the offending argument.
    """
    check.tensor("logits", logits, torch.float32)
    if logits.dim() != 2:
        raise ValueError(f"logits: expected 2 dims (num_rows, num_cols), got shape {tuple(logits.shape)}")
    if not isinstance(k, int) or not 1 <= k <= 4096:
        raise ValueError(f"k={k!r}: expected an int in [1, 4096]")
    R, N = logits.shape
    if N >= 2**31 - 1:
        raise ValueError(f"logits: {N} columns, at most 2^31 - 2 supported")
    check.last_dim_contiguous("logits", logits)
    if lengths is not None:
        check.tensor("lengths", lengths, torch.int32)
        if tuple(lengths.shape) != (R,):
            raise ValueError(f"lengths: shape {tuple(lengths.shape)}, expected ({R},)")
        check.same_device("logits", logits, lengths=lengths)
        lengths = lengths.contiguous()
    if offsets is not None:
        check.tensor("offsets", offsets, torch.int32)
        if tuple(offsets.shape) != (R,):
            raise ValueError(f"offsets: shape {tuple(offsets.shape)}, expected ({R},)")
        check.same_device("logits", logits, offsets=offsets)
        offsets = offsets.contiguous()
    if out is None:
        out = torch.empty((R, k), dtype=torch.int32, device=logits.device)
    elif out.dtype != torch.int32 or tuple(out.shape) != (R, k) or (R and out.stride(1) != 1):
        raise ValueError(f"out: expected int32 ({R}, {k}) with a contiguous last dim, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if R == 0:
        return out
    cfg = config or pick_config(N, logits.device)
    if cfg.get("VARIANT") == "r3":
        return _launch_r3(logits, lengths, offsets, out, k, cfg)
    check_select_config(cfg.get("ROW", 0), cfg.get("BITS", 7), cfg.get("BITS", 7), "config ROW/BITS")
    if cfg.get("ROW") and not cfg.get("LOOP"):
        raise ValueError("config ROW: needs LOOP (the register select is the runtime-loop one; the unrolled "
                         "select was removed, NOTES.md \"idx10c\")")
    _topk_kernel[(R,)](
        logits, lengths if lengths is not None else logits, offsets if offsets is not None else logits, out, N,
        logits.stride(0), out.stride(0), K=k, KP2=triton.next_power_of_2(k), HAS_LEN=lengths is not None,
        HAS_OFF=offsets is not None, BLOCK=cfg["BLOCK"], ROW=cfg.get("ROW", 0), W=cfg.get("BITS", 7),
        num_warps=cfg["num_warps"])
    return out


# ---- config table ------------------------------------------------------------------------------
# One program per row (b*): BLOCK entries per step of each streaming pass, 1 launch, 2-5 reads of the
# row by one SM: only for many rows or short rows. "VARIANT": "r3" (r3_*): the three-launch split,
# P = cdiv(PROGS_PER_SM * #SMs, rows) programs per row (<= 64, BLOCK-aligned chunks), CAP candidates
# per row before the plateau fallback. The 256-bin histograms are a few registers per thread.
_R3 = {"r3_1024": {"BLOCK": 1024, "num_warps": 4, "VARIANT": "r3", "PROGS_PER_SM": 4, "CAP": 8192},
       "r3_2048": {"BLOCK": 2048, "num_warps": 4, "VARIANT": "r3", "PROGS_PER_SM": 4, "CAP": 8192},
       "r3_2048p8": {"BLOCK": 2048, "num_warps": 4, "VARIANT": "r3", "PROGS_PER_SM": 8, "CAP": 8192},
       "r3_1024p8": {"BLOCK": 1024, "num_warps": 4, "VARIANT": "r3", "PROGS_PER_SM": 8, "CAP": 8192}}
# (BLOCK 4096 / 8 warps: the select kernel spills 16 B on sm_90, ds4lab aot on triton 3.7.1)
# b1024r2048c (NOTES.md "idx10c"): rows of up to ROW = 2,048 entries selected on registers (one read of the
# row, BITS-bit radix digits, the levels one runtime loop: select_topk_regs_loop), longer rows as b1024;
# the two-launch baselines of the one-launch indexer bench time it. (Its unrolled twin b1024r2048, NOTES.md
# "idx10", was removed with the unrolled select: git history.) LOOP is required with ROW.
_REGS = {"b1024r2048c": {"BLOCK": 1024, "num_warps": 4, "ROW": 2048, "BITS": 6, "LOOP": True}}
CONFIGS = {
    "sm_89": {"b1024": {"BLOCK": 1024, "num_warps": 4}, "b4096": {"BLOCK": 4096, "num_warps": 8}, **_REGS, **_R3},
    "sm_90": {"b1024": {"BLOCK": 1024, "num_warps": 4}, "b4096": {"BLOCK": 4096, "num_warps": 8}, **_REGS, **_R3},
}

# Defaults per build: ``(max_cols, label)`` rows, the first with ``num_cols <= max_cols`` wins (None:
# any). PROVISIONAL, not yet timed: the r3 variant is new (NOTES.md "top-k in three launches"); the
# H200 sweep `OUT=DIR bash scripts/gpu/attn.sh` times every row of CONFIGS in both builds and
# `python scripts/gpu/attn_pick.py DIR/bench.csv` prints the replacement lines from the winners.
DEFAULTS = {
    "sm_89": ((4095, "b1024"), (None, "r3_2048")),
    # sm_90 above 4095 columns: r3_2048p8 from the H200 native run (issue 20): best or within 1% of
    # the best r3 row at every timed shape (R 1-64, N 8k-262k), b1024 / b4096 2-9x slower
    "sm_90": ((4095, "b1024"), (None, "r3_2048p8")),
}

# the rows pick_config can return on a GPU (the rest are benchmark candidates or interpreter sizes);
# the compile report builds these for sm_120, tests/test_arch.py sweeps pick_config against them
GPU_DEFAULTS = {a: tuple(dict.fromkeys(lb for _, lb in rows)) for a, rows in DEFAULTS.items()}


def pick_config(N: int, device: torch.device) -> dict:
    """The ``DEFAULTS`` row of ``device``'s build for ``N`` columns."""
    arch = arch_of(device)
    for max_cols, label in DEFAULTS[arch]:
        if max_cols is None or N <= max_cols:
            return CONFIGS[arch][label]
    return CONFIGS[arch][DEFAULTS[arch][-1][1]]
