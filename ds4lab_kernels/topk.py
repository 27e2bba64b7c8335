"""Top-k indices per row (DeepSeek-V4 lightning indexer, k = 512; vLLM ``top_k_per_row``).

Exact radix select, one program per row: the fp32 scores are mapped to order-preserving int32
keys (NaN and -inf are not selectable; -0.0 is folded onto +0.0); up to four 256-bin histogram
passes (``tl.histogram``), one per key byte from the top, find the exact k-th largest key ``T``
and how many entries equal to ``T`` must be taken; a last pass writes the indices with a running
prefix sum. A pass is skipped as soon as the k-th entry's bin is taken whole. Every pass streams
the row once (2 to 5 reads of the row; rows up to 2^31 - 2 entries).

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
def _descend(h, need, prefix, T, need_eq, done, LVL: tl.constexpr):
    """One radix level from its histogram ``h``: the k-th entry's bin extends ``prefix`` by one byte.

    When that bin is taken whole (``need == cnt``), every key >= its lowest key is selected
    (``T = prefix << SHIFT``, ``need_eq`` unbounded); at the last level ``T`` is the exact k-th key
    and ``need_eq`` entries equal to it are taken. Either way ``done`` becomes true, in the caller's
    dtype (int1 in the one-program kernel, the int32 state flag in the split select kernel)."""
    SHIFT: tl.constexpr = 24 - 8 * LVL
    b, cnt, above = _select_bin(h, need, 256)
    if LVL == 0:
        prefix = b - 128                      # signed top byte
    else:
        prefix = (prefix << 8) | b
    need = need - above
    if need == cnt:                           # the whole bin is taken: keys >= its lowest key
        T = prefix << SHIFT
        need_eq = need * 0 + 2147483647
        done = (need == need).to(done.dtype)
    elif LVL == 3:                            # exact key: take `need` of the entries equal to it
        T = prefix
        need_eq = need
        done = (need == need).to(done.dtype)
    return prefix, need, T, need_eq, done


@triton.jit
def _write_selected(row_ptr, out_row, lane, lo, hi, T, need_eq, n_sel, n_eq, BLOCK: tl.constexpr):
    """Output pass over entries ``[lo, hi)``: the indices of the keys ``> T`` and of the first
    ``need_eq`` keys ``== T`` of the row (``n_eq`` equal keys come before ``lo``), stored in ascending
    index order from output slot ``n_sel``; ``lane`` is ``tl.arange(0, BLOCK)``."""
    for c in range(lo, hi, BLOCK):
        offs = c + lane
        key, valid = _load_keys(row_ptr, offs, hi)
        gt = valid & (key > T)
        eq = valid & (key == T)
        eq_rank = n_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        take = gt | (eq & (eq_rank < need_eq))
        pos = n_sel + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out_row + pos, offs, mask=take)
        n_sel += tl.sum(take.to(tl.int32), 0)
        n_eq += tl.sum(eq.to(tl.int32), 0)


@triton.jit
def _pad_tail(out_row, k_eff, K: tl.constexpr, KP2: tl.constexpr):
    """``-1`` in output slots ``[k_eff, K)``."""
    q = tl.arange(0, KP2)
    tl.store(out_row + q, tl.full((KP2,), -1, tl.int32), mask=(q >= k_eff) & (q < K))


@triton.jit
def _topk_kernel(x_ptr, len_ptr, out_ptr, N, stride_xr, stride_or,
                 K: tl.constexpr, KP2: tl.constexpr, HAS_LEN: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(num_rows,)``.
    One program: one whole row (4 radix passes, then the output pass)."""
    r = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + r * stride_xr
    out_row = out_ptr + r * stride_or
    L = _row_len(len_ptr, r, N, HAS_LEN)
    lane = tl.arange(0, BLOCK)
    # pass 0 counts the selectable entries together with the top-digit histogram
    h = _digit_hist(tl.zeros((256,), tl.int32), row_ptr, lane, 0, L, 0, 0, BLOCK)
    k_eff = tl.minimum(tl.sum(h, 0), K)
    # find the threshold key T: everything > T is taken, plus the first need_eq entries == T
    T = k_eff * 0 + 2147483647
    need_eq = k_eff * 0
    done = k_eff == 0
    need = k_eff
    prefix = k_eff * 0
    for lvl in tl.static_range(4):
        if not done:
            if lvl > 0:
                h = _digit_hist(tl.zeros((256,), tl.int32), row_ptr, lane, 0, L, prefix, lvl, BLOCK)
            prefix, need, T, need_eq, done = _descend(h, need, prefix, T, need_eq, done, lvl)
    # output pass: ascending index order, ties on T resolved by lower index
    _write_selected(row_ptr, out_row, lane, 0, L, T, need_eq, k_eff * 0, k_eff * 0, BLOCK)
    _pad_tail(out_row, k_eff, K, KP2)


# ---- split variant: P programs per row (config key "SPLIT": True) -------------------------------
# state row (int32): [k_eff, need, prefix, done, T, need_eq, 0, 0]; the histogram of pass `lvl` is
# summed over the row's P chunks by a one-program-per-row select kernel (4 x (hist, select), then
# count + write). Launch count and workspace sizes depend on shapes only (CUDA-graph safe).
@triton.jit
def _split_hist_kernel(x_ptr, len_ptr, hist_ptr, state_ptr, N, stride_xr, chunk, P,
                       LVL: tl.constexpr, HAS_LEN: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(num_rows, P)``.
    One program: one chunk of one row: its 256-bin histogram of radix level LVL."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    row_ptr = x_ptr + r * stride_xr
    L = _row_len(len_ptr, r, N, HAS_LEN)
    lo = p * chunk
    hi = tl.minimum(lo + chunk, L)
    lane = tl.arange(0, BLOCK)
    h = tl.zeros((256,), tl.int32)
    if LVL == 0:
        h = _digit_hist(h, row_ptr, lane, lo, hi, 0, LVL, BLOCK)
    else:
        done = tl.load(state_ptr + r * 8 + 3)
        prefix = tl.load(state_ptr + r * 8 + 2)
        if done == 0:
            h = _digit_hist(h, row_ptr, lane, lo, hi, prefix, LVL, BLOCK)
    tl.store(hist_ptr + (r * P + p) * 256 + tl.arange(0, 256), h)


@triton.jit
def _split_select_kernel(hist_ptr, state_ptr, P, K: tl.constexpr, LVL: tl.constexpr):
    """Grid ``(num_rows,)``.
    One program: one row: merges the P chunk histograms and advances that row's radix state."""
    r = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, 256)
    h = tl.zeros((256,), tl.int32)
    for p in range(0, P):
        h += tl.load(hist_ptr + (r * P + p) * 256 + bins)
    sp = state_ptr + r * 8
    if LVL == 0:
        k_eff = tl.minimum(tl.sum(h, 0), K)
        need = k_eff
        prefix = k_eff * 0
        done = (k_eff == 0).to(tl.int32)
        T = k_eff * 0 + 2147483647
        need_eq = k_eff * 0
        tl.store(sp + 0, k_eff)
    else:
        need = tl.load(sp + 1)
        prefix = tl.load(sp + 2)
        done = tl.load(sp + 3)
        T = tl.load(sp + 4)
        need_eq = tl.load(sp + 5)
    if done == 0:
        prefix, need, T, need_eq, done = _descend(h, need, prefix, T, need_eq, done, LVL)
    tl.store(sp + 1, need)
    tl.store(sp + 2, prefix)
    tl.store(sp + 3, done)
    tl.store(sp + 4, T)
    tl.store(sp + 5, need_eq)


@triton.jit
def _split_count_kernel(x_ptr, len_ptr, cnt_ptr, state_ptr, N, stride_xr, chunk, P,
                        HAS_LEN: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(num_rows, P)``.
    One program: one chunk of one row: how many of its keys are > and == the row's threshold."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    row_ptr = x_ptr + r * stride_xr
    L = _row_len(len_ptr, r, N, HAS_LEN)
    lo = p * chunk
    hi = tl.minimum(lo + chunk, L)
    lane = tl.arange(0, BLOCK)
    T = tl.load(state_ptr + r * 8 + 4)
    n_gt = tl.zeros((BLOCK,), tl.int32)
    n_eq = tl.zeros((BLOCK,), tl.int32)
    for c in range(lo, hi, BLOCK):
        key, valid = _load_keys(row_ptr, c + lane, hi)
        n_gt += (valid & (key > T)).to(tl.int32)
        n_eq += (valid & (key == T)).to(tl.int32)
    tl.store(cnt_ptr + (r * P + p) * 2, tl.sum(n_gt, 0))
    tl.store(cnt_ptr + (r * P + p) * 2 + 1, tl.sum(n_eq, 0))


@triton.jit
def _split_write_kernel(x_ptr, len_ptr, out_ptr, cnt_ptr, state_ptr, N, stride_xr, stride_or, chunk, P,
                        K: tl.constexpr, KP2: tl.constexpr, PP2: tl.constexpr, HAS_LEN: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Grid ``(num_rows, P)``.
    One program: one chunk of one row: writes its selected indices at the chunk's output offset."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    row_ptr = x_ptr + r * stride_xr
    out_row = out_ptr + r * stride_or
    L = _row_len(len_ptr, r, N, HAS_LEN)
    lo = p * chunk
    hi = tl.minimum(lo + chunk, L)
    lane = tl.arange(0, BLOCK)
    k_eff = tl.load(state_ptr + r * 8)
    T = tl.load(state_ptr + r * 8 + 4)
    need_eq = tl.load(state_ptr + r * 8 + 5)
    pp = tl.arange(0, PP2)
    before = pp < p
    gt_before = tl.sum(tl.load(cnt_ptr + (r * P + pp) * 2, mask=before, other=0), 0)
    eq_before = tl.sum(tl.load(cnt_ptr + (r * P + pp) * 2 + 1, mask=before, other=0), 0)
    _write_selected(row_ptr, out_row, lane, lo, hi, T, need_eq, gt_before + tl.minimum(eq_before, need_eq),
                    eq_before, BLOCK)
    if p == 0:
        _pad_tail(out_row, k_eff, K, KP2)


def _launch_split(logits, lengths, out, k, cfg):
    R, N = logits.shape
    BLOCK = cfg["BLOCK"]
    n_blk = max(1, triton.cdiv(N, BLOCK))
    P = cfg.get("P") or triton.cdiv(cfg.get("PROGS_PER_SM", 4) * num_sms(logits.device), R)
    P = max(1, min(P, n_blk, 64))
    chunk = triton.cdiv(n_blk, P) * BLOCK
    P = triton.cdiv(n_blk * BLOCK, chunk)
    dev = logits.device
    hist = torch.empty((R, P, 256), dtype=torch.int32, device=dev)
    state = torch.empty((R, 8), dtype=torch.int32, device=dev)
    cnt = torch.empty((R, P, 2), dtype=torch.int32, device=dev)
    lens = lengths if lengths is not None else logits
    has_len = lengths is not None
    w = cfg["num_warps"]
    for lvl in range(4):
        _split_hist_kernel[(R, P)](logits, lens, hist, state, N, logits.stride(0), chunk, P,
                                   LVL=lvl, HAS_LEN=has_len, BLOCK=BLOCK, num_warps=w)
        _split_select_kernel[(R,)](hist, state, P, K=k, LVL=lvl, num_warps=4)
    _split_count_kernel[(R, P)](logits, lens, cnt, state, N, logits.stride(0), chunk, P,
                                HAS_LEN=has_len, BLOCK=BLOCK, num_warps=w)
    _split_write_kernel[(R, P)](logits, lens, out, cnt, state, N, logits.stride(0), out.stride(0), chunk, P,
                                K=k, KP2=triton.next_power_of_2(k), PP2=triton.next_power_of_2(P),
                                HAS_LEN=has_len, BLOCK=BLOCK, num_warps=w)
    return out


def topk_indices(logits: torch.Tensor, k: int = 512, lengths: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
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

    Returns:
        int32 ``(num_rows, k)``: ``min(k, #selectable)`` distinct indices in ``[0, length)`` in
        ascending index order, then ``-1``. Ties: the lower index wins (deterministic).

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
    if out is None:
        out = torch.empty((R, k), dtype=torch.int32, device=logits.device)
    elif out.dtype != torch.int32 or tuple(out.shape) != (R, k) or (R and out.stride(1) != 1):
        raise ValueError(f"out: expected int32 ({R}, {k}) with a contiguous last dim, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if R == 0:
        return out
    cfg = config or pick_config(N, logits.device)
    if cfg.get("SPLIT"):
        return _launch_split(logits, lengths, out, k, cfg)
    _topk_kernel[(R,)](
        logits, lengths if lengths is not None else logits, out, N, logits.stride(0), out.stride(0),
        K=k, KP2=triton.next_power_of_2(k), HAS_LEN=lengths is not None, BLOCK=cfg["BLOCK"],
        num_warps=cfg["num_warps"])
    return out


# ---- config table ------------------------------------------------------------------------------
# One program per row; BLOCK entries per step of each streaming pass. The histograms (4096 bins)
# (256 bins) are a few registers per thread; larger BLOCK means fewer loop trips and more loads in flight per SM.
# "SPLIT": True -> P programs per row (about PROGS_PER_SM programs per SM), 10 launches; candidates
# for R < #SMs, benchmarked next to the one-program-per-row defaults (see NOTES.md).
_SPLIT = {"s2048": {"BLOCK": 2048, "num_warps": 4, "SPLIT": True, "PROGS_PER_SM": 4},
          "s4096": {"BLOCK": 4096, "num_warps": 8, "SPLIT": True, "PROGS_PER_SM": 2}}
CONFIGS = {
    "sm_89": {"b1024": {"BLOCK": 1024, "num_warps": 4}, "b4096": {"BLOCK": 4096, "num_warps": 8}, **_SPLIT},
    "sm_90": {"b1024": {"BLOCK": 1024, "num_warps": 4}, "b4096": {"BLOCK": 4096, "num_warps": 8}, **_SPLIT},
}


# the rows pick_config can return on a GPU (the rest are benchmark candidates or interpreter sizes);
# the compile report builds these for sm_120, tests/test_arch.py sweeps pick_config against them
GPU_DEFAULTS = {"sm_89": ("b1024", "s2048"), "sm_90": ("b1024", "b4096")}


def pick_config(N: int, device: torch.device) -> dict:
    arch = arch_of(device)
    t = CONFIGS[arch]
    if arch == "sm_89" and device.type == "cuda" and N >= 16384:
        # sm_89 build on the H200 (run 4): the split variant 111 us vs b4096 217 us at 64 x 65,536
        return t["s2048"]
    return t["b4096"] if N >= 16384 else t["b1024"]
