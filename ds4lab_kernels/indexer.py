"""Lightning indexer kernels (DeepSeek-V4 C4A layers): indexer K cache writer, FP8 MQA logits for
ragged prefill and for paged decode.

Semantics:
- cache writer: vLLM ``indexer_k_quant_and_cache`` (DeepSeek-V4, ``scale_fmt="ue8m0"``);
- query prep (``indexer_q_rope_quant``): the DeepSeek-V4 indexer's q side (vLLM ``Indexer``: RoPE
  on the last 64 dims of each head, bf16, ``per_token_group_quant_fp8(q, 128, scale_fmt="ue8m0")``
  math with the scale folded into the head weights ``w * s * D^-0.5 * H^-0.5``), one launch;
- logits: DeepGEMM ``fp8_mqa_logits`` / ``fp8_paged_mqa_logits``:
  ``logit[t, j] = sum_h w[t, h] * relu(q[t, h, :] . k[j, :]) * k_scale[j]``, ``-inf`` outside the row's
  valid range. ``q . k`` is a native fp8 x fp8 ``tl.dot`` with fp32 accumulation (``mma.sync
  m16n8k32 e4m3``, SASS ``QMMA`` on sm_89; wgmma on sm_90);
- decode logits + top-k in one launch (``fp8_paged_mqa_topk``): ``topk.topk_indices`` of the paged
  logits (vLLM ``top_k_per_row``), the last program of each request selecting in-program.

Indexer K cache layout (SPEC.md §3): uint8 ``(num_blocks, block_size, 132)`` (or
``(num_blocks, block_size, 1, 132)``), a byte view only. Block ``b`` starts at byte
``b * stride(0)``; entry ``i``'s 128 e4m3 values at ``+ i*128``; then, planar after all entries, its
fp32 power-of-two scale at ``+ block_size*128 + 4*i``. ``stride(0)`` may exceed
``block_size*132`` (pages padded to a multiple of 576 B: 8,640 B for 64 entries).
"""
import torch
import triton
import triton.language as tl

from . import _checks as check
from . import _arch
from ._counters import zeroed_counters
from ._arch import arch_of, num_sms, require_fp8
from ._fp8 import quant_rows_e4m3
from .o_proj import _mul_once
from .topk import check_select_config, hist0_add, select_topk

# the amax floor of the q quantization (vLLM ``per_token_group_quant_fp8(..., eps=1e-4)`` on the
# indexer q; the same as the K cache writer's)
Q_EPS = 1e-4

HEAD_DIM = 128


# ---- kernels -----------------------------------------------------------------------------------
@triton.jit
def indexer_k_pack(kv8_ptr, kv32_ptr, x, slot, ok, stride_blk8, stride_blk32, D: tl.constexpr, BS: tl.constexpr):
    """Write indexer K entries (the layout's one home: every writer of the cache calls this).

    ``x``: ``(R, D)`` float32 key rows; ``slot`` ``(R,)`` int64 global slots; ``ok`` ``(R,)`` which rows
    to write. Row ``r`` -> e4m3 ``x / s`` (RTNE) at byte ``block*stride + entry*D`` and its fp32
    scale ``s = 2^ceil(log2(max(amax, 1e-4) / 448))`` planar after the block's values
    (``stride_blk8`` bytes, ``stride_blk32`` fp32 words per block)."""
    d = tl.arange(0, D)
    q, s = quant_rows_e4m3(x, 1e-4, True)  # vLLM indexer_k_quant_and_cache, ue8m0 scales
    blk = tl.where(ok, slot // BS, 0)
    ent = tl.where(ok, slot % BS, 0)
    tl.store(kv8_ptr + (blk * stride_blk8 + ent * D)[:, None] + d[None, :], q, mask=ok[:, None])
    tl.store(kv32_ptr + blk * stride_blk32 + (BS * D // 4) + ent, s, mask=ok)


@triton.jit
def _indexer_k_cache_insert_kernel(
    k_ptr, slot_ptr, kv8_ptr, kv32_ptr,
    T, stride_kt, stride_blk8, stride_blk32,
    D: tl.constexpr, BS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens, BLOCK_T),)``.
    One program: BLOCK_T tokens: quantize each key row and write its 128 e4m3 bytes and fp32 scale to its slot."""
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D)
    tmask = t < T
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    ok = tmask & (slot >= 0)
    x = tl.load(k_ptr + t.to(tl.int64)[:, None] * stride_kt + d[None, :], mask=ok[:, None], other=0.0)
    indexer_k_pack(kv8_ptr, kv32_ptr, x.to(tl.float32), slot, ok, stride_blk8, stride_blk32, D, BS)


@triton.jit
def _fp8_mqa_logits_kernel(
    q_ptr, k_ptr, ks_ptr, w_ptr, kstart_ptr, kend_ptr, out_ptr,
    M, N, stride_qm, stride_qh, stride_kn, stride_wm, stride_om,
    H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """Grid ``(cdiv(num_k, BLOCK_N), cdiv(num_q, BLOCK_Q))``.
    One program: one K tile of BLOCK_N keys (loaded once) against BLOCK_Q consecutive query rows: those logits."""
    pid_n = tl.program_id(0)
    pid_q = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    d = tl.arange(0, D)
    h = tl.arange(0, H)
    # the K tile [BLOCK_N, D] (A operand, K-major) is loaded once and reused for BLOCK_Q queries
    k = tl.load(k_ptr + offs_n.to(tl.int64)[:, None] * stride_kn + d[None, :], mask=nmask[:, None], other=0.0)
    ks = tl.load(ks_ptr + offs_n, mask=nmask, other=0.0)
    m_end = tl.minimum(pid_q * BLOCK_Q + BLOCK_Q, M)
    for m in range(pid_q * BLOCK_Q, m_end):
        m64 = tl.cast(m, tl.int64)
        start = tl.load(kstart_ptr + m)
        end = tl.load(kend_ptr + m)
        if (start < n0 + BLOCK_N) & (end > n0) & (start < end):
            # B operand q[m]^T [D, H], D contiguous (K-major)
            qt = tl.load(q_ptr + m64 * stride_qm + h[None, :] * stride_qh + d[:, None])
            s = tl.dot(k, qt)                                           # [BLOCK_N, H] fp32
            s = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL)
            w = tl.load(w_ptr + m64 * stride_wm + h)
            logit = tl.sum(s * w[None, :], axis=1) * ks
            logit = tl.where((offs_n >= start) & (offs_n < end), logit, float("-inf"))
        else:
            logit = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        tl.store(out_ptr + m64 * stride_om + offs_n, logit, mask=nmask)


@triton.jit
def _paged_row(kt, ks, q_ptr, w_ptr, out_ptr, row, lim, offs, omask, stride_qr, stride_qh, stride_wr, stride_or,
               H: tl.constexpr, D: tl.constexpr):
    """One query row against one cache block tile: ``sum_h w[h] relu(k . q[h]) * k_scale``, -inf past ``lim``;
    stored, and returned (the ``[BS]`` fp32 row)."""
    h = tl.arange(0, H)
    d = tl.arange(0, D)
    row64 = row.to(tl.int64)
    qt = tl.load(q_ptr + row64 * stride_qr + h[None, :] * stride_qh + d[:, None])   # [D, H]
    w = tl.load(w_ptr + row64 * stride_wr + h)
    s = tl.dot(kt, qt)                                                                 # [BS, H]
    s = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL)
    logit = tl.sum(s * w[None, :], axis=1) * ks
    logit = tl.where(offs < lim, logit, float("-inf"))
    tl.store(out_ptr + row64 * stride_or + offs, logit, mask=omask)
    return logit


@triton.jit
def _paged_tiles(q_ptr, kv8_ptr, kv32_ptr, w_ptr, lim_ptr, bt_ptr, out_ptr, h0_ptr, b, t_begin, t_stop,
                 max_ctx, num_blocks, bt_width, stride_qr, stride_qh, stride_blk8, stride_blk32, stride_wr,
                 stride_btb, stride_or,
                 NEXT_N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, H0_BITS: tl.constexpr):
    """Cache blocks ``[t_begin, t_stop)`` of request ``b`` for all its next_n query rows: the logits of
    each row's valid entries, ``-inf`` past its limit (up to ``max_ctx``). The one home of the paged
    logits math (``_fp8_paged_mqa_logits_kernel`` and the one-launch ``_fp8_paged_mqa_topk_kernel``).
    ``H0_BITS > 0``: every valid logit is also counted into its row's first-level top-k histogram
    (``topk.hist0_add``: row ``r`` at ``h0_ptr + r * 2^H0_BITS``); the logits are the same bits either way.
    Returns the rows' limits ``(lim0, lim1)`` clamped to ``[0, min(max_ctx, bt_width * BS)]``
    (``lim1 = lim0`` for next_n = 1)."""
    e = tl.arange(0, BS)
    d = tl.arange(0, D)
    row0 = b * NEXT_N
    # valid entries per row, clamped to the output width and to what the block table can address
    cap = tl.minimum(max_ctx, bt_width * BS)
    lim0 = tl.minimum(tl.maximum(tl.load(lim_ptr + row0), 0), cap)
    lim1 = lim0
    lim_max = lim0
    if NEXT_N == 2:
        lim1 = tl.minimum(tl.maximum(tl.load(lim_ptr + row0 + 1), 0), cap)
        lim_max = tl.maximum(lim0, lim1)
    t_end = tl.minimum(t_stop, tl.cdiv(max_ctx, BS))
    t_valid = tl.minimum(t_end, tl.cdiv(lim_max, BS))
    for t in range(t_begin, t_valid):
        phys = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + t).to(tl.int64)
        good = (phys >= 0) & (phys < num_blocks)
        phys = tl.where(good, phys, 0)
        kt = tl.load(kv8_ptr + phys * stride_blk8 + e[:, None] * D + d[None, :])          # [BS, D] e4m3
        ks = tl.load(kv32_ptr + phys * stride_blk32 + (BS * D // 4) + e)                   # [BS] fp32
        ks = tl.where(good, ks, float("nan"))  # a bad block id yields NaN logits, never plausible numbers
        offs = t * BS + e
        omask = offs < max_ctx
        lg0 = _paged_row(kt, ks, q_ptr, w_ptr, out_ptr, row0, lim0, offs, omask, stride_qr, stride_qh, stride_wr,
                         stride_or, H, D)
        if H0_BITS > 0:
            hist0_add(h0_ptr + row0.to(tl.int64) * (1 << H0_BITS), lg0, offs, lim0, H0_BITS)
        if NEXT_N == 2:
            lg1 = _paged_row(kt, ks, q_ptr, w_ptr, out_ptr, row0 + 1, lim1, offs, omask, stride_qr, stride_qh,
                             stride_wr, stride_or, H, D)
            if H0_BITS > 0:
                hist0_add(h0_ptr + (row0 + 1).to(tl.int64) * (1 << H0_BITS), lg1, offs, lim1, H0_BITS)
    ninf = tl.full((BS,), float("-inf"), tl.float32)
    for t in range(tl.maximum(t_valid, t_begin), t_end):
        offs = t * BS + e
        omask = offs < max_ctx
        for i in tl.static_range(NEXT_N):
            tl.store(out_ptr + (row0 + i).to(tl.int64) * stride_or + offs, ninf, mask=omask)
    return lim0, lim1


@triton.jit
def _fp8_paged_mqa_logits_kernel(
    q_ptr, kv8_ptr, kv32_ptr, w_ptr, lim_ptr, bt_ptr, out_ptr,
    max_ctx, num_blocks, bt_width, stride_qr, stride_qh, stride_blk8, stride_blk32, stride_wr, stride_btb,
    stride_or,
    NEXT_N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TILES: tl.constexpr,
):
    """Grid ``(batch, cdiv(cdiv(max_context_len, block_size), TILES))``.
    One program: TILES consecutive cache blocks of one request, for all its next_n query rows (-inf past the limit)."""
    b = tl.program_id(0)
    t_begin = tl.program_id(1) * TILES
    _paged_tiles(q_ptr, kv8_ptr, kv32_ptr, w_ptr, lim_ptr, bt_ptr, out_ptr, out_ptr, b, t_begin, t_begin + TILES,
                 max_ctx, num_blocks, bt_width, stride_qr, stride_qh, stride_blk8, stride_blk32, stride_wr,
                 stride_btb, stride_or, NEXT_N, H, D, BS, 0)


@triton.jit
def _paged_topk_warm(q_ptr, kv8_ptr, kv32_ptr, w_ptr, lim_ptr, bt_ptr, ws_ptr, cnt_ptr, h0_ptr, off_ptr, idx_ptr,
                     max_ctx, num_blocks, bt_width, tiles, stride_qr, stride_qh, stride_blk8, stride_blk32, stride_wr,
                     stride_btb, stride_wsr, stride_ir,
                     NEXT_N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, K: tl.constexpr,
                     KP2: tl.constexpr, HAS_OFF: tl.constexpr, SEL_BLOCK: tl.constexpr, SEL_ROW: tl.constexpr,
                     SEL_BITS: tl.constexpr, H0_BITS: tl.constexpr):
    """The body of ``_fp8_paged_mqa_topk_kernel`` with ``WARM`` (see there): program 0 the code warmer,
    program ``1 + b * P + p`` request ``b``'s logits program ``p``; the warmer and the last arrival reach
    ONE ``select_topk`` call site with their arguments chosen per program."""
    W0: tl.constexpr = H0_BITS if H0_BITS > 0 else SEL_BITS
    WZ: tl.constexpr = KP2 if KP2 > SEL_ROW else SEL_ROW       # the warmer's output scratch (int32)
    WH: tl.constexpr = (1 << W0) if H0_BITS > 0 else 0          # its first-level histogram (zero)
    pid = tl.program_id(0)
    warm = pid == 0
    P = tl.maximum(tl.cdiv(tl.cdiv(max_ctx, BS), tiles), 1)      # logits programs a request (the launcher's)
    g = tl.maximum(pid - 1, 0)
    b = g // P
    t_begin = (g - b * P) * tiles
    h0r_ptr = h0_ptr + (WZ + WH)                                 # the rows' histograms
    lim0 = b * 0
    lim1 = b * 0
    go = warm
    if not warm:
        lim0, lim1 = _paged_tiles(q_ptr, kv8_ptr, kv32_ptr, w_ptr, lim_ptr, bt_ptr, ws_ptr, h0r_ptr, b, t_begin,
                                  t_begin + tiles, max_ctx, num_blocks, bt_width, stride_qr, stride_qh,
                                  stride_blk8, stride_blk32, stride_wr, stride_btb, stride_wsr, NEXT_N, H, D, BS,
                                  H0_BITS)
        tl.debug_barrier()  # every thread's logits are written before the arrival is published
        ticket = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
        go = ticket == P - 1
    if go:
        # the warmer: one row (row 0's workspace, read while it is written), scratch output and histogram;
        # the last arrival: its request's rows. ONE call site either way (a second call would be a second
        # inlined copy of the select code, warming nothing)
        nrows = tl.where(warm, 1, tl.where(lim1 >= -1, NEXT_N, 0))
        lw = tl.where(max_ctx < SEL_ROW, max_ctx, SEL_ROW)
        for i in range(nrows):
            row = (b * NEXT_N + i).to(tl.int64)
            off = 0
            if HAS_OFF:
                off = tl.load(off_ptr + row)
            L = tl.where(warm, lw, tl.where(i == 1, lim1, lim0))
            out_row = tl.where(warm, h0_ptr, idx_ptr + row * stride_ir)
            h0_row = tl.where(warm, h0_ptr + WZ, h0r_ptr + row * (1 << W0))
            select_topk(ws_ptr + row * stride_wsr, out_row, L, off, h0_row, K, KP2, SEL_BLOCK, SEL_ROW, W0,
                        SEL_BITS, H0_BITS > 0)
        if warm:
            tl.debug_barrier()  # the select's stores land before the scratch is re-zeroed (same CTA)
            tl.store(h0_ptr + tl.arange(0, WZ), tl.zeros((WZ,), tl.int32))
        else:
            tl.atomic_xchg(cnt_ptr + b, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["tiles"])
def _fp8_paged_mqa_topk_kernel(
    q_ptr, kv8_ptr, kv32_ptr, w_ptr, lim_ptr, bt_ptr, ws_ptr, cnt_ptr, h0_ptr, off_ptr, idx_ptr,
    max_ctx, num_blocks, bt_width, tiles, stride_qr, stride_qh, stride_blk8, stride_blk32, stride_wr,
    stride_btb, stride_wsr, stride_ir,
    NEXT_N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, K: tl.constexpr,
    KP2: tl.constexpr, HAS_OFF: tl.constexpr, SEL_BLOCK: tl.constexpr, SEL_ROW: tl.constexpr,
    SEL_BITS: tl.constexpr, H0_BITS: tl.constexpr, WARM: tl.constexpr = False,
):
    """Grid ``(batch, P)``, ``P = cdiv(cdiv(max_context_len, block_size), tiles)`` (at least 1).
    One program: ``tiles`` consecutive cache blocks of request ``b``, all its next_n rows, logits into
    the fp32 workspace ``ws`` (``_paged_tiles``; ``H0_BITS > 0``: their top-``H0_BITS``-bit histogram
    into ``h0``, one ``2^H0_BITS``-bin int32 row per query row); then a ticket of the request's counter
    (``atomic_add`` acq_rel, gpu scope, after a CTA barrier so every thread's stores and adds are
    released). The program that draws the last ticket (``P - 1``) selects each row's top-``K`` from the
    workspace (``topk.select_topk``: ``SEL_ROW == 0`` the streaming select, ``SEL_BLOCK`` entries a
    step; else rows of up to ``SEL_ROW`` entries in registers, ``SEL_BITS``-bit radix digits after a
    first level of ``H0_BITS`` bits read from ``h0`` (or ``SEL_BITS`` counted in-program); same tie
    rule and order either way), adds ``offsets[row]``, re-zeroes the rows' histograms and the
    counter for the next launch / CUDA-graph replay. No program waits on another. The launcher runs
    ``SEL_ROW`` (the register select, radix levels as one runtime loop: ``topk.select_topk_regs_loop``,
    NOTES.md "idx10c") only with ``WARM``, whose request rows are a runtime loop too (one copy of the
    select code, not NEXT_N unrolled ones); without ``WARM`` the rows are unrolled (the streaming select).

    ``WARM`` (NOTES.md "idx10w"; needs ``SEL_ROW``): the grid is 1-D, ``(1 + batch * P,)``;
    program ``1 + b * P + p`` is program ``(b, p)`` above and program 0 is a code warmer: it takes no part
    in the logits or the tickets, and at launch runs the SAME select call site (one copy of the select
    code, so the lines it executes are in L2 when the request's last arrival needs them) on row 0 of the
    workspace (arbitrary values while the logits programs write it: NaN / +-inf included), at most
    ``SEL_ROW`` entries, into a scratch of the arrivals buffer: ``h0_ptr`` then points at
    ``WZ = max(KP2, SEL_ROW)`` int32 of output scratch, then (``H0_BITS``) one ``2^H0_BITS``-bin scratch
    histogram (zero: the warmer's descent then runs every level, finds no key and writes only ``-1``
    padding; termination does not depend on the data: each level lowers the shift), then the rows'
    histograms. The warmer re-zeroes its output scratch (after a CTA barrier), so the buffer is left
    zero."""
    if WARM:
        _paged_topk_warm(q_ptr, kv8_ptr, kv32_ptr, w_ptr, lim_ptr, bt_ptr, ws_ptr, cnt_ptr, h0_ptr, off_ptr, idx_ptr,
                         max_ctx, num_blocks, bt_width, tiles, stride_qr, stride_qh, stride_blk8, stride_blk32,
                         stride_wr, stride_btb, stride_wsr, stride_ir, NEXT_N, H, D, BS, K, KP2, HAS_OFF, SEL_BLOCK,
                         SEL_ROW, SEL_BITS, H0_BITS)
        return
    b = tl.program_id(0)
    t_begin = tl.program_id(1) * tiles
    lim0, lim1 = _paged_tiles(q_ptr, kv8_ptr, kv32_ptr, w_ptr, lim_ptr, bt_ptr, ws_ptr, h0_ptr, b, t_begin,
                              t_begin + tiles, max_ctx, num_blocks, bt_width, stride_qr, stride_qh,
                              stride_blk8, stride_blk32, stride_wr, stride_btb, stride_wsr, NEXT_N, H, D, BS,
                              H0_BITS)
    tl.debug_barrier()  # every thread's logits are written before the arrival is published
    ticket = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(1) - 1:
        W0: tl.constexpr = H0_BITS if H0_BITS > 0 else SEL_BITS
        for i in tl.static_range(NEXT_N):
            row = (b * NEXT_N + i).to(tl.int64)
            off = 0
            if HAS_OFF:
                off = tl.load(off_ptr + row)
            L = lim0
            if i == 1:
                L = lim1
            # entries past the row's limit are -inf in the workspace: the select stops at the limit
            select_topk(ws_ptr + row * stride_wsr, idx_ptr + row * stride_ir, L, off, h0_ptr + row * (1 << W0),
                        K, KP2, SEL_BLOCK, SEL_ROW, W0, SEL_BITS, H0_BITS > 0)
        tl.atomic_xchg(cnt_ptr + b, 0, sem="relaxed", scope="gpu")


# ---- launchers ---------------------------------------------------------------------------------
@triton.jit
def indexer_q_rows(
    q_ptr, pos_ptr, cs_ptr, w_ptr, qo_ptr, wo_ptr, pid,
    n_rows, H, max_pos, stride_qt, stride_qh, stride_wt, w_scale, eps,
    D: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr, EXACT: tl.constexpr,
):
    """The indexer q job of program ``pid`` (the body of ``_indexer_q_kernel``, also run by
    ``norm_rope._q_norm_rope_indexer_q_kernel``): ROWS (token, head) rows of D bf16 values: forward
    GPT-J RoPE on the last R dims in fp32 (``x0 c - x1 s``, ``x1 c + x0 s``, as the torch glue
    evaluates them), one bf16 rounding, the pow2 e4m3 quantization of the row and the head weight
    times its scale. The rotation's products must not contract into FMAs with its sum: ``EXACT``
    False in a kernel built with ``enable_fp_fusion=False`` (and on the interpreter), True in one
    built with fusion on (PTX ``mul.rn``, ``o_proj._mul_once``); the rest of the job has no
    multiply-add whose contraction could change a bit (``to_e4m3``'s ``ax * 512 + 2^23`` multiplies
    exactly)."""
    r = pid * ROWS + tl.arange(0, ROWS)
    rmask = r < n_rows
    t = r // H
    h = r - t * H
    cols = tl.arange(0, D)
    base = t.to(tl.int64) * stride_qt + h.to(tl.int64) * stride_qh
    x = tl.load(q_ptr + base[:, None] + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    # each rope dim's pair partner (col ^ 1) and its frequency (col - (D - R)) // 2
    xp = tl.load(q_ptr + base[:, None] + (cols ^ 1)[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    rope = cols >= D - R
    fi = tl.where(rope, (cols - (D - R)) // 2, 0)
    p = tl.load(pos_ptr + t, mask=rmask, other=0).to(tl.int64)
    ok = (p >= 0) & (p < max_pos)            # out-of-table position: NaN, never a wrong angle
    pc = tl.where(ok, p, 0)
    c = tl.load(cs_ptr + pc[:, None] * R + fi[None, :], mask=rmask[:, None] & rope[None, :], other=1.0)
    sn = tl.load(cs_ptr + pc[:, None] * R + R // 2 + fi[None, :], mask=rmask[:, None] & rope[None, :], other=0.0)
    c = tl.where(ok[:, None], c, float("nan"))
    sn = tl.where(ok[:, None], sn, float("nan"))
    even = (cols % 2) == 0
    xc = _mul_once(x, c, EXACT)
    ps = _mul_once(xp, sn, EXACT)
    y = tl.where(even[None, :], xc - ps, xc + ps)
    y = tl.where(rope[None, :], y, x)
    y = y.to(tl.bfloat16).to(tl.float32)
    qv, s = quant_rows_e4m3(y, eps, True)
    tl.store(qo_ptr + r.to(tl.int64)[:, None] * D + cols[None, :], qv, mask=rmask[:, None])
    wv = tl.load(w_ptr + t.to(tl.int64) * stride_wt + h, mask=rmask, other=0.0).to(tl.float32)
    tl.store(wo_ptr + r, wv * s * w_scale, mask=rmask)


@triton.jit(do_not_specialize=["n_rows"])
def _indexer_q_kernel(
    q_ptr, pos_ptr, cs_ptr, w_ptr, qo_ptr, wo_ptr,
    n_rows, H, max_pos, stride_qt, stride_qh, stride_wt, w_scale, eps,
    D: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens * num_heads, ROWS),)``; built with ``enable_fp_fusion=False``.
    One program: ROWS (token, head) rows (:func:`indexer_q_rows`)."""
    indexer_q_rows(q_ptr, pos_ptr, cs_ptr, w_ptr, qo_ptr, wo_ptr, tl.program_id(0), n_rows, H, max_pos, stride_qt,
                   stride_qh, stride_wt, w_scale, eps, D, R, ROWS, False)


def _cache_views(kv_cache: torch.Tensor, head_dim: int = HEAD_DIM):
    """Validate an indexer K cache and return (fp8 view, fp32 view, block stride bytes, block size)."""
    check.tensor("kv_cache", kv_cache, (torch.uint8,), (3, 4))
    if kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1:
            raise ValueError(f"kv_cache: 4-D cache must be (num_blocks, block_size, 1, {head_dim + 4}), "
                             f"got {tuple(kv_cache.shape)}")
        kv_cache = kv_cache.squeeze(2)
    nb, bs, width = kv_cache.shape
    if width != head_dim + 4:
        raise ValueError(f"kv_cache: last dim {width}, expected head_dim + 4 = {head_dim + 4} "
                         "(128 e4m3 bytes + one fp32 scale per entry)")
    if bs not in (16, 32, 64, 128):
        raise ValueError(f"kv_cache: block_size {bs} not supported (16, 32, 64, 128)")
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != width:
        raise ValueError(f"kv_cache: each block must be contiguous (strides (*, {width}, 1)), "
                         f"got {tuple(kv_cache.stride())}")
    if nb > 1 and kv_cache.stride(0) < bs * width:
        raise ValueError(f"kv_cache: block stride {kv_cache.stride(0)} B < block bytes {bs * width}")
    stride = kv_cache.stride(0) if nb > 1 else bs * width
    if stride % 16 or kv_cache.storage_offset() % 16:
        raise ValueError(f"kv_cache: block stride {stride} B and storage offset {kv_cache.storage_offset()} "
                         "must be multiples of 16 B")
    return kv_cache.view(torch.float8_e4m3fn), kv_cache.view(torch.float32), stride, bs


def writer_args(cache_name: str, kv_cache: torch.Tensor, slots_name: str, slot_mapping: torch.Tensor, T: int,
                who: str, **others):
    """The checks every writer of the indexer K cache runs (the insert and the producers that write
    their keys in the same launch, ``compressor.compress_decode(cache=...)``), named after the
    writer's own arguments; ``others`` (name=tensor) must share the cache's device. Returns
    ``(fp8 view, fp32 view, block stride bytes, block size, contiguous slots)``.

    Raises:
        TypeError / ValueError: as :func:`_cache_views`; ``slots_name`` not int32/int64 ``(T,)``;
        devices that differ; a device without FP8; on CPU tensors a slot ``>= num_blocks*block_size``
        (on CUDA that check would need a device sync, so the caller guarantees it)."""
    check.tensor(slots_name, slot_mapping, (torch.int32, torch.int64), 1)
    kv8, kv32, stride, bs = _cache_views(kv_cache)
    check.same_device(cache_name, kv_cache, **{slots_name: slot_mapping}, **others)
    require_fp8(cache_name, kv_cache.device, who)
    if slot_mapping.shape[0] != T:
        raise ValueError(f"{slots_name}: {slot_mapping.shape[0]} slots for {T} tokens")
    if T and slot_mapping.device.type == "cpu":
        mx = int(slot_mapping.max())
        if mx >= kv_cache.shape[0] * bs:
            raise ValueError(f"{slots_name}: slot {mx} >= num_blocks*block_size = {kv_cache.shape[0] * bs}")
    return kv8, kv32, stride, bs, slot_mapping.contiguous()


def indexer_k_cache_insert(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           config: dict | None = None) -> torch.Tensor:
    """Quantize indexer keys to e4m3 with one power-of-two scale each and write them into the paged
    indexer K cache (vLLM ``indexer_k_quant_and_cache``, DeepSeek-V4, ``scale_fmt="ue8m0"``).

    ``s = 2^ceil(log2(max(amax(|k[t]|), 1e-4) / 448))``, values ``e4m3(k[t] / s)`` (RTNE), written to
    slot ``slot_mapping[t]``: block ``slot // block_size``, entry ``slot % block_size``; values at byte
    ``block*stride(0) + entry*128``, scale (fp32) at ``block*stride(0) + block_size*128 + 4*entry``.

    Args:
        k: ``(num_tokens, 128)`` bfloat16/float16/float32, last dim contiguous.
        kv_cache: uint8 ``(num_blocks, block_size, 132)`` or ``(num_blocks, block_size, 1, 132)``, each
            block contiguous, block stride (may be padded, e.g. 8,640 B) a multiple of 16 B. Written
            in place.
        slot_mapping: ``(num_tokens,)`` int32/int64; negative slots are skipped (padding tokens).
            Slots must be ``< num_blocks * block_size`` (checked on the host only for CPU tensors;
            on CUDA that check would need a device sync, so the caller guarantees it).
        config: a row of ``CONFIGS["insert"]``.

    Returns:
        ``kv_cache`` (the same tensor). A token whose ``k`` holds NaN gets a NaN scale and NaN values.

    Raises:
        TypeError / ValueError: naming the offending argument (dtype, shape, strides, device, slots).
    """
    check.tensor("k", k, (torch.bfloat16, torch.float16, torch.float32), 2)
    T, D = k.shape
    if D != HEAD_DIM:
        raise ValueError(f"k: head dim {D}, expected {HEAD_DIM}")
    if T and k.stride(1) != 1:
        raise ValueError(f"k: last dim must be contiguous, strides {tuple(k.stride())}")
    kv8, kv32, stride, bs, slot_mapping = writer_args("kv_cache", kv_cache, "slot_mapping", slot_mapping, T,
                                                      "indexer_k_cache_insert", k=k)
    if T == 0:
        return kv_cache
    cfg = config or CONFIGS["insert"][arch_of(k.device)]["default"]
    grid = (triton.cdiv(T, cfg["BLOCK_T"]),)
    _indexer_k_cache_insert_kernel[grid](
        k, slot_mapping, kv8, kv32, T, k.stride(0), stride, stride // 4,
        D=D, BS=bs, BLOCK_T=cfg["BLOCK_T"], num_warps=cfg["num_warps"])
    return kv_cache


def indexer_q_rope_quant(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                         weights: torch.Tensor, config: dict | None = None):
    """The indexer's query side in one launch: RoPE, bf16, FP8 e4m3 with a pow2 scale per head, the
    scale folded into the head weights.

    For each token ``t`` and head ``h``: ``x = bf16(rope(q[t, h]))`` (GPT-J pairs on the last
    ``R = cos_sin.shape[1]`` dims, fp32 math, ``cos || sin`` row ``positions[t]``), ``s =
    ceil_pow2(max(amax|x|, 1e-4) / 448)``, ``q_fp8[t, h] = e4m3(x / s)``, ``w[t, h] = (weights[t, h]
    * s) * fp32(D^-0.5 * H^-0.5)``. Bit for bit the glue it replaces (``_rope_f32`` + ``bf16`` +
    ``per_token_group_quant_fp8(x, D, scale_fmt="pow2", eps=1e-4)`` + the weight product; the
    kernel is compiled without FMA contraction so the GPU rounds as torch does).

    Args:
        q: ``(num_tokens, H, D)`` bfloat16 (64 heads x 128), last dim contiguous; ``D`` a power of
            two ``<= 1024``.
        positions: ``(num_tokens,)`` int32/int64; a position outside ``[0, max_pos)`` gives NaN
            rope dims, so a NaN scale and weight for all of that token's heads (no host sync).
        cos_sin: float32 ``(max_pos, R)`` contiguous, ``R`` even, a power of two, ``R <= D``.
        weights: ``(num_tokens, H)`` bfloat16/float32 head weights (``weights_proj`` output), last
            dim contiguous.
        config: a row of ``CONFIGS["q"]`` (``ROWS``, ``num_warps``).

    Returns:
        ``(q_fp8 (num_tokens, H, D) float8_e4m3fn, w (num_tokens, H) float32)``, contiguous. A row
        holding NaN gets a NaN scale and weight (its values NaN); an inf gives an inf scale (values
        NaN at the inf, 0 elsewhere), as the glue.

    Raises:
        TypeError / ValueError: dtypes, ranks, shapes, strides, devices; a device without FP8.
    """
    check.tensor("q", q, torch.bfloat16, ndim=3)
    T, H, D = q.shape
    check.last_dim_contiguous("q", q)
    if D < 2 or D & (D - 1) or D > 1024:
        raise ValueError(f"q: head_dim={D} must be a power of two in 2..1024")
    check.tensor("positions", positions, (torch.int32, torch.int64), ndim=1)
    if positions.shape[0] != T:
        raise ValueError(f"positions: shape {tuple(positions.shape)}, expected ({T},)")
    check.tensor("cos_sin", cos_sin, torch.float32, ndim=2)
    R = cos_sin.shape[1]
    if R < 2 or R & (R - 1) or R > D:
        raise ValueError(f"cos_sin: rope_dim={R} must be an even power of two <= head_dim={D}")
    check.contiguous("cos_sin", cos_sin)
    check.tensor("weights", weights, (torch.bfloat16, torch.float32), ndim=2)
    if tuple(weights.shape) != (T, H):
        raise ValueError(f"weights: shape {tuple(weights.shape)}, expected ({T}, {H})")
    check.last_dim_contiguous("weights", weights)
    check.same_device("q", q, positions=positions, cos_sin=cos_sin, weights=weights)
    require_fp8("q", q.device, "indexer_q_rope_quant")
    qo = torch.empty((T, H, D), dtype=torch.float8_e4m3fn, device=q.device)
    wo = torch.empty((T, H), dtype=torch.float32, device=q.device)
    n = T * H
    if not n:
        return qo, wo
    cfg = config or pick_q_config(n, q.device)
    _indexer_q_kernel[(triton.cdiv(n, cfg["ROWS"]),)](
        q, positions, cos_sin, weights, qo, wo, n, H, cos_sin.shape[0], q.stride(0), q.stride(1),
        weights.stride(0), D ** -0.5 * H ** -0.5, Q_EPS, D=D, R=R, ROWS=cfg["ROWS"],
        num_warps=cfg["num_warps"], enable_fp_fusion=False)
    return qo, wo


def _check_q(q, ndim):
    check.tensor("q", q, (torch.float8_e4m3fn,), ndim)
    H, D = q.shape[-2], q.shape[-1]
    if D != HEAD_DIM:
        raise ValueError(f"q: head dim {D}, expected {HEAD_DIM}")
    if H not in (16, 32, 64, 128):
        raise ValueError(f"q: {H} heads not supported (16, 32, 64, 128)")
    if q.numel() and q.stride(-1) != 1:
        raise ValueError(f"q: last dim must be contiguous, strides {tuple(q.stride())}")
    return H, D


def fp8_mqa_logits(q: torch.Tensor, kv: tuple, weights: torch.Tensor, cu_seqlen_ks: torch.Tensor,
                   cu_seqlen_ke: torch.Tensor, out: torch.Tensor | None = None,
                   config: dict | None = None) -> torch.Tensor:
    """FP8 MQA logits over ragged key ranges (prefill; DeepGEMM ``fp8_mqa_logits``).

    ``logits[t, j] = sum_h weights[t, h] * relu(q[t, h, :] . k[j, :]) * k_scale[j]`` for
    ``cu_seqlen_ks[t] <= j < cu_seqlen_ke[t]``, ``-inf`` elsewhere. fp8 x fp8 products accumulated
    in fp32 (``tl.dot``); the weighted head sum in fp32.

    Args:
        q: ``(num_q, num_heads, 128)`` float8_e4m3fn, last dim contiguous (the per-(token, head)
            q scale is folded into ``weights`` by the caller, as in DeepSeek-V4).
        kv: ``(k, k_scale)``: k ``(num_k, 128)`` float8_e4m3fn with contiguous rows; k_scale
            ``(num_k,)`` or ``(num_k, 1)`` float32 (contiguous), positive.
        weights: ``(num_q, num_heads)`` float32, last dim contiguous.
        cu_seqlen_ks, cu_seqlen_ke: ``(num_q,)`` int32, the half-open key range of each query row.
        out: optional ``(num_q, num_k)`` float32 output, last dim contiguous.
        config: a row of ``CONFIGS["mqa"]``.

    Returns:
        float32 ``(num_q, num_k)`` logits.

    Raises:
        TypeError / ValueError: naming the offending argument.
    """
    H, D = _check_q(q, 3)
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise TypeError("kv: expected a (k, k_scale) pair")
    k, ks = kv
    check.tensor("kv[0] (k)", k, (torch.float8_e4m3fn,), 2)
    check.tensor("kv[1] (k_scale)", ks, (torch.float32,), (1, 2))
    check.tensor("weights", weights, (torch.float32,), 2)
    check.tensor("cu_seqlen_ks", cu_seqlen_ks, (torch.int32,), 1)
    check.tensor("cu_seqlen_ke", cu_seqlen_ke, (torch.int32,), 1)
    check.same_device("q", q, k=k, k_scale=ks, weights=weights, cu_seqlen_ks=cu_seqlen_ks, cu_seqlen_ke=cu_seqlen_ke)
    require_fp8("q", q.device, "fp8_mqa_logits")
    M, N = q.shape[0], k.shape[0]
    if k.shape[1] != D:
        raise ValueError(f"kv[0] (k): shape {tuple(k.shape)}, expected ({N}, {D})")
    if N and k.stride(1) != 1:
        raise ValueError(f"kv[0] (k): rows must be contiguous, strides {tuple(k.stride())}")
    if ks.numel() != N or (ks.dim() == 2 and ks.shape[1] != 1):
        raise ValueError(f"kv[1] (k_scale): shape {tuple(ks.shape)}, expected ({N},) or ({N}, 1)")
    ks = ks.reshape(-1)
    if N and ks.stride(0) != 1:
        raise ValueError("kv[1] (k_scale): must be contiguous")
    if tuple(weights.shape) != (M, H):
        raise ValueError(f"weights: shape {tuple(weights.shape)}, expected ({M}, {H})")
    if M and weights.stride(1) != 1:
        raise ValueError(f"weights: last dim must be contiguous, strides {tuple(weights.stride())}")
    for n, t in (("cu_seqlen_ks", cu_seqlen_ks), ("cu_seqlen_ke", cu_seqlen_ke)):
        if t.shape[0] != M:
            raise ValueError(f"{n}: {t.shape[0]} entries for {M} query rows")
    if out is None:
        out = torch.empty((M, N), dtype=torch.float32, device=q.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != (M, N) or (M and N and out.stride(1) != 1):
        raise ValueError(f"out: expected float32 ({M}, {N}) with contiguous rows, got {out.dtype} "
                         f"{tuple(out.shape)} strides {tuple(out.stride())}")
    if M == 0 or N == 0:
        return out
    cfg = config or pick_mqa_config(M, N, q.device)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_Q"]))
    _fp8_mqa_logits_kernel[grid](
        q, k, ks, weights, cu_seqlen_ks.contiguous(), cu_seqlen_ke.contiguous(), out,
        M, N, q.stride(0), q.stride(1), k.stride(0), weights.stride(0), out.stride(0),
        H=H, D=D, BLOCK_N=cfg["BLOCK_N"], BLOCK_Q=cfg["BLOCK_Q"],
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1))
    return out


def _paged_args(q, kv_cache, weights, context_lens, block_table, max_context_len, who):
    """The checks shared by the paged launchers; returns ``(q, kv8, kv32, block stride, block size,
    B, next_n, H, D)`` (``q`` made contiguous per request where its batch stride is not ``next_n``
    rows)."""
    H, D = _check_q(q, 4)
    kv8, kv32, stride, bs = _cache_views(kv_cache)
    check.tensor("weights", weights, (torch.float32,), 2)
    check.tensor("context_lens", context_lens, (torch.int32,), (1, 2))
    check.tensor("block_table", block_table, (torch.int32,), 2)
    check.same_device("q", q, kv_cache=kv_cache, weights=weights, context_lens=context_lens, block_table=block_table)
    require_fp8("q", q.device, who)
    B, nn = q.shape[0], q.shape[1]
    if nn not in (1, 2):
        raise ValueError(f"q: next_n={nn} not supported (1 or 2)")
    if not isinstance(max_context_len, int) or max_context_len < 0:
        raise ValueError(f"max_context_len={max_context_len!r}: expected a non-negative int")
    if tuple(weights.shape) != (B * nn, H):
        raise ValueError(f"weights: shape {tuple(weights.shape)}, expected ({B * nn}, {H})")
    if B and weights.stride(1) != 1:
        raise ValueError(f"weights: last dim must be contiguous, strides {tuple(weights.stride())}")
    if context_lens.shape[0] != B or (context_lens.dim() == 2 and context_lens.shape[1] != nn):
        raise ValueError(f"context_lens: shape {tuple(context_lens.shape)}, expected ({B}, {nn}) or ({B},)")
    if block_table.shape[0] != B or (B and block_table.shape[1] and block_table.stride(1) != 1):
        raise ValueError(f"block_table: shape {tuple(block_table.shape)} strides {tuple(block_table.stride())}, "
                         f"expected ({B}, max_blocks) with a contiguous last dim")
    if q.stride(2) != D and B:
        raise ValueError(f"q: heads must be {D} apart (q[b, i] a contiguous (heads, 128) tile), "
                         f"strides {tuple(q.stride())}")
    if B and q.stride(0) != nn * q.stride(1):
        q = q.contiguous()
    return q, kv8, kv32, stride, bs, B, nn, H, D


def _paged_limits(context_lens, nn, device):
    """``(B, next_n)`` int32 per-row limits (the 1-D DeepGEMM convention expanded)."""
    if context_lens.dim() == 2:
        return context_lens.contiguous()
    # DeepGEMM 1-D convention: row i of request b sees ctx - next_n + i + 1 entries
    lim = context_lens[:, None] - (nn - 1) + torch.arange(nn, device=device, dtype=torch.int32)[None, :]
    return lim.contiguous()


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                         out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """FP8 MQA logits over the paged indexer K cache (decode / MTP verification; DeepGEMM
    ``fp8_paged_mqa_logits``, no schedule metadata needed). CUDA-graph safe: no host syncs, the
    grid depends only on shapes and ``max_context_len``.

    Row ``b*next_n + i`` holds ``logit[j] = sum_h weights[row, h] * relu(q[b, i, h, :] . k_b[j, :]) *
    k_scale_b[j]`` for ``j < limit``, ``-inf`` for ``limit <= j < max_context_len``. Logical entry
    ``j`` of request ``b`` is entry ``j % block_size`` of physical block ``block_table[b, j // block_size]``.
    ``limit`` is ``context_lens[b, i]`` for 2-D ``context_lens`` (the causal bound of that MTP row) or
    DeepGEMM's ``context_lens[b] - next_n + i + 1`` for 1-D; it is clamped to ``[0, max_context_len]``
    and to ``block_table.shape[1] * block_size``. A physical block id outside ``[0, num_blocks)``
    yields NaN logits for its entries (never plausible numbers).

    Args:
        q: ``(batch, next_n, num_heads, 128)`` float8_e4m3fn, next_n in {1, 2}, last dim contiguous.
        kv_cache: the indexer K cache, uint8 ``(num_blocks, block_size, 132)`` or with a singleton
            third axis (see module docstring for the planar layout).
        weights: ``(batch*next_n, num_heads)`` float32, last dim contiguous.
        context_lens: ``(batch, next_n)`` or ``(batch,)`` int32.
        block_table: ``(batch, max_blocks)`` int32, last dim contiguous.
        max_context_len: output width (a host int, e.g. the compressed max model length).
        out: optional ``(batch*next_n, max_context_len)`` float32 output, last dim contiguous.
        config: a row of ``CONFIGS["paged"]``.

    Returns:
        float32 ``(batch*next_n, max_context_len)``.

    Raises:
        TypeError / ValueError: naming the offending argument.
    """
    q, kv8, kv32, stride, bs, B, nn, H, D = _paged_args(q, kv_cache, weights, context_lens, block_table,
                                                         max_context_len, "fp8_paged_mqa_logits")
    M = B * nn
    if out is None:
        out = torch.empty((M, max_context_len), dtype=torch.float32, device=q.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != (M, max_context_len) or \
            (M and max_context_len and out.stride(1) != 1):
        raise ValueError(f"out: expected float32 ({M}, {max_context_len}) with contiguous rows, got "
                         f"{out.dtype} {tuple(out.shape)} strides {tuple(out.stride())}")
    if M == 0 or max_context_len == 0:
        return out
    lim = _paged_limits(context_lens, nn, q.device)
    cfg = config or pick_paged_config(B, max_context_len, q.device)
    n_tiles = triton.cdiv(max_context_len, bs)
    grid = (B, triton.cdiv(n_tiles, cfg["TILES"]))
    _fp8_paged_mqa_logits_kernel[grid](
        q, kv8, kv32, weights, lim, block_table, out,
        max_context_len, kv_cache.shape[0], block_table.shape[1], q.stride(1), q.stride(2), stride, stride // 4,
        weights.stride(0), block_table.stride(0), out.stride(0),
        NEXT_N=nn, H=H, D=D, BS=bs, TILES=cfg["TILES"],
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1))
    return out


# per-request arrival counters of the one-launch logits + top-k, zero between launches (the program
# that draws a request's last ticket resets it); one buffer per device, grown outside CUDA-graph capture
_MIN_ARRIVALS = 1024


def paged_topk_h0_base(batch: int) -> int:
    """Where the first-level histograms of :func:`fp8_paged_mqa_topk` (configs with ``H0_BITS``) start
    in its ``arrivals`` buffer: after the ``batch`` counters, rounded up to 32 int32 (128 B)."""
    return -(-batch // 32) * 32


def paged_topk_arrivals_need(batch: int, next_n: int, k: int, config: dict) -> tuple:
    """``(n, what)``: how many int32 :func:`fp8_paged_mqa_topk` needs in its ``arrivals`` buffer with
    ``config``, and a description of them: ``batch`` counters; with ``H0_BITS`` or ``SEL_WARM`` from
    :func:`paged_topk_h0_base` on: (``SEL_WARM``) the code warmer's output scratch of
    ``max(next_pow2(k), SEL_ROW)`` int32 and (with ``H0_BITS`` too) its ``2^H0_BITS``-bin scratch histogram,
    then (``H0_BITS``) ``batch * next_n`` row histograms of ``2^H0_BITS`` bins. All left zero by every launch."""
    h0_bits = int(config.get("H0_BITS", 0))
    if not (h0_bits or config.get("SEL_WARM")):
        return batch, f"{batch} (one per request)"
    base, parts = paged_topk_h0_base(batch), [f"{batch} counters"]
    n = base
    if config.get("SEL_WARM"):
        wz = max(1 << max(k - 1, 0).bit_length(), int(config.get("SEL_ROW", 0)))
        wh = (1 << h0_bits) if h0_bits else 0
        n += wz + wh
        parts.append(f"{wz + wh} warmer scratch from {base}")
    if h0_bits:
        m = batch * next_n
        parts.append(f"{m} x {1 << h0_bits} histogram bins from {n}")
        n += m << h0_bits
    return n, " + ".join(parts)


def paged_topk_arrivals(device: torch.device, n: int) -> torch.Tensor:
    """The zeroed ``int32`` per-request arrival counters (and, for configs with ``H0_BITS``, the rows'
    first-level histograms after them) of :func:`fp8_paged_mqa_topk` on ``device`` (at least ``n``).
    Allocated once per device and left zero by every launch, so CUDA-graph replays reuse it. Launches
    must not run concurrently on two streams of one device (they share it).

    Raises:
        RuntimeError: the buffer would have to grow while a CUDA graph is being captured (run the
            same call once before capturing, or pass ``arrivals``)."""
    return zeroed_counters("indexer.paged_topk", device, n, _MIN_ARRIVALS)


def fp8_paged_mqa_topk(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                       context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                       k: int = 512, offsets: torch.Tensor | None = None, out: torch.Tensor | None = None,
                       logits: torch.Tensor | None = None, arrivals: torch.Tensor | None = None,
                       config: dict | None = None) -> torch.Tensor:
    """Paged FP8 MQA logits and their top-``k`` in ONE launch (decode / MTP verification): exactly
    ``topk.topk_indices(fp8_paged_mqa_logits(...), k, lengths=limits, offsets=offsets)``, the same
    indices in the same order, for every ``max_context_len`` (the decode step uses it up to
    ``KernelBackend``'s bound: the select runs in one program per request).

    Programs ``(b, p)`` split request ``b``'s cache blocks, write the logits of all its next_n rows
    to an fp32 workspace (``logits``), take a ticket of the request's arrival counter; the last one
    selects each row's top-``k`` in-program (``topk.select_topk``: streaming, or on registers for
    rows up to the config's ``SEL_ROW`` entries, the first radix level optionally counted by the
    logits programs into per-row histograms, ``H0_BITS``) and re-zeroes the counter (and histograms).
    No host sync, no spin-wait; the grid depends only on shapes (CUDA-graph safe).

    Args:
        q, kv_cache, weights, context_lens, block_table, max_context_len: as
            :func:`fp8_paged_mqa_logits` (``q`` ``(batch, next_n, heads, 128)`` e4m3, next_n 1 or 2;
            row ``b*next_n + i``'s limit ``context_lens[b, i]``, or DeepGEMM's 1-D convention).
        k: indices per row (1..4096; 512 for DeepSeek-V4).
        offsets: optional ``(batch*next_n,)`` int32 added to every selected index of its row (``-1``
            padding kept): ``req * n_comp`` makes them compressed-cache slots. The caller keeps
            ``index + offsets`` within int32.
        out: optional ``(batch*next_n, k)`` int32 output, last dim contiguous.
        logits: optional ``(batch*next_n, max_context_len)`` float32 workspace, last dim contiguous;
            afterwards it holds :func:`fp8_paged_mqa_logits`'s output bit for bit.
        arrivals: optional zeroed int32 counters, ``>= batch`` of them, left zero (default
            :func:`paged_topk_arrivals`); a config with ``H0_BITS`` also keeps its rows' histograms
            there: ``>= paged_topk_h0_base(batch) + batch * next_n * 2^H0_BITS`` int32; a config with
            ``SEL_WARM`` also its code warmer's scratch (:func:`paged_topk_arrivals_need` says how many).
        config: a row of ``CONFIGS["paged_topk"]``.

    Returns:
        int32 ``(batch*next_n, k)``: per row ``min(k, #selectable)`` distinct indices ``j < limit``
        (``+ offsets``) in ascending index order, then ``-1``; NaN / -inf logits are never selected;
        ties: the lower index wins (``topk_indices``' rule).

    Raises:
        TypeError / ValueError: naming the offending argument.
    """
    q, kv8, kv32, stride, bs, B, nn, H, D = _paged_args(q, kv_cache, weights, context_lens, block_table,
                                                         max_context_len, "fp8_paged_mqa_topk")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 4096:
        raise ValueError(f"k={k!r}: expected an int in [1, 4096]")
    M, N, dev = B * nn, max_context_len, q.device
    if N >= 2**31 - 1:
        raise ValueError(f"max_context_len={N}: at most 2^31 - 2 supported")
    if offsets is not None:
        check.tensor("offsets", offsets, torch.int32, 1)
        if offsets.shape[0] != M:
            raise ValueError(f"offsets: shape {tuple(offsets.shape)}, expected ({M},)")
        check.same_device("q", q, offsets=offsets)
        offsets = offsets.contiguous()
    if out is None:
        out = torch.empty((M, k), dtype=torch.int32, device=dev)
    elif out.dtype != torch.int32 or tuple(out.shape) != (M, k) or (M and out.stride(1) != 1) or \
            out.device != dev:
        raise ValueError(f"out: expected int32 ({M}, {k}) with a contiguous last dim on {dev}, got {out.dtype} "
                         f"{tuple(out.shape)} strides {tuple(out.stride())} on {out.device}")
    if logits is None:
        logits = torch.empty((M, max(N, 1)), dtype=torch.float32, device=dev)[:, :N]
    elif logits.dtype != torch.float32 or tuple(logits.shape) != (M, N) or (M and N and logits.stride(1) != 1) \
            or logits.device != dev:
        raise ValueError(f"logits: expected float32 ({M}, {N}) with contiguous rows on {dev}, got "
                         f"{logits.dtype} {tuple(logits.shape)} strides {tuple(logits.stride())} on {logits.device}")
    cfg = config or pick_paged_topk_config(B, N, dev)
    h0_bits, sel_row, sel_bits = int(cfg.get("H0_BITS", 0)), int(cfg.get("SEL_ROW", 0)), int(cfg.get("SEL_BITS", 7))
    check_select_config(sel_row, sel_bits, h0_bits or sel_bits, "config SEL_ROW/SEL_BITS/H0_BITS")
    warm = bool(cfg.get("SEL_WARM", False))
    if warm and not (sel_row and cfg.get("SEL_LOOP")):
        raise ValueError("config SEL_WARM: needs SEL_ROW and SEL_LOOP (the warmer runs the loop select's call site)")
    if (sel_row or h0_bits or cfg.get("SEL_LOOP")) and not warm:
        raise ValueError("config SEL_ROW/SEL_LOOP/H0_BITS: need SEL_WARM (the register select runs only in the "
                         "code-warming layout; the unrolled and non-warm loop rows were removed, NOTES.md \"idx10w\")")
    h0_base = paged_topk_h0_base(B)
    n_arr, what = paged_topk_arrivals_need(B, nn, k, cfg)
    if arrivals is None:
        arrivals = paged_topk_arrivals(dev, n_arr)
    else:
        check.tensor("arrivals", arrivals, torch.int32, 1)
        check.same_device("q", q, arrivals=arrivals)
        if arrivals.numel() < n_arr or (B and arrivals.stride(0) != 1):
            raise ValueError(f"arrivals: {arrivals.numel()} contiguous int32, need >= {n_arr}: {what}")
    if M == 0:
        return out
    lim = _paged_limits(context_lens, nn, dev)
    n_tiles = triton.cdiv(N, bs)
    tiles = paged_topk_tiles(cfg, B, n_tiles, dev)
    grid = (B, max(1, triton.cdiv(n_tiles, tiles)))
    if warm:    # program 0 the code warmer, then the (b, p) programs in order (the kernel's WARM layout)
        grid = (1 + grid[0] * grid[1],)
    _fp8_paged_mqa_topk_kernel[grid](
        q, kv8, kv32, weights, lim, block_table, logits, arrivals,
        arrivals[h0_base:] if h0_bits or warm else arrivals,
        offsets if offsets is not None else lim, out,
        N, kv_cache.shape[0], block_table.shape[1], tiles, q.stride(1), q.stride(2), stride, stride // 4,
        weights.stride(0), block_table.stride(0), logits.stride(0), out.stride(0),
        NEXT_N=nn, H=H, D=D, BS=bs, K=k, KP2=triton.next_power_of_2(k), HAS_OFF=offsets is not None,
        SEL_BLOCK=cfg["SEL_BLOCK"], SEL_ROW=sel_row, SEL_BITS=sel_bits, H0_BITS=h0_bits,
        **({"WARM": True} if warm else {}),
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1))
    return out


# ---- config tables -----------------------------------------------------------------------------
# mqa (prefill, compute bound): one program holds a K tile [BLOCK_N, 128] e4m3 (A operand) and loops
#   over BLOCK_Q query rows, each a [BLOCK_N,128]x[128,64] fp8 dot; q comes from L2.
# paged (decode, memory bound): one program per (request, TILES consecutive cache blocks); q of the
#   next_n rows stays in registers; each cache block is one [64,128]x[128,64] fp8 dot per row.
# SEL_BLOCK 512: the select's histogram passes at 4 entries per thread. 1,024 / 2,048 spill 4-8 B
# (next_n 1: sm_89 s1024, sm_120 s2048) and 256 spills 24 B (sm_89, next_n 2): not in the table
# (ds4lab aot on triton 3.7.1; every row below 0 spills on sm_89 / sm_90 / sm_120 at next_n 1 and 2).
_PAGED_TOPK = {
    "p1s512": {"PROGS_PER_SM": 1, "SEL_BLOCK": 512, "num_warps": 4, "num_stages": 3},
    "p2s512": {"PROGS_PER_SM": 2, "SEL_BLOCK": 512, "num_warps": 4, "num_stages": 3},
    "p4s512": {"PROGS_PER_SM": 4, "SEL_BLOCK": 512, "num_warps": 4, "num_stages": 3},
    "t1s512": {"TILES": 1, "SEL_BLOCK": 512, "num_warps": 4, "num_stages": 3},
    "t4s512": {"TILES": 4, "SEL_BLOCK": 512, "num_warps": 4, "num_stages": 3},
    # idx10w (NOTES.md "idx10", "idx10c", "idx10w"): the select on registers for rows of up to SEL_ROW = 2,048
    # entries (longer rows: the s512 streaming select above), radix digits of SEL_BITS bits as one runtime loop
    # (SEL_LOOP, topk.select_topk_regs_loop) after a first level whose 2^H0_BITS-bin histogram the logits
    # programs count (global atomics into the arrivals buffer, re-zeroed by the select); SEL_WARM: one extra
    # program (program 0) runs the select's one call site at launch on throw-away data, so its code is in L2
    # (not DRAM) when the last arrival runs it (the step evicts it between two calls). The sm_89 default (H200
    # session 12, NOTES "idx10w"). The register select runs only in this layout (SEL_ROW, SEL_LOOP, H0_BITS
    # need SEL_WARM); the superseded rows (unrolled p2r2048b6 / p2r2048h11b6, loop p2r2048b6c / p2r2048h11b6c,
    # warm p2r2048b6cw: measured losing) were removed, their code is in git history.
    "p2r2048h11b6cw": {"PROGS_PER_SM": 2, "SEL_BLOCK": 512, "SEL_ROW": 2048, "SEL_BITS": 6, "H0_BITS": 11,
                       "SEL_LOOP": True, "SEL_WARM": True, "num_warps": 4, "num_stages": 3},
}
CONFIGS = {
    # q (decode: T*64 rows of 128): one row per warp; T=1 is 64 rows -> 16-64 programs
    "q": {"sm_89": {"r1": {"ROWS": 1, "num_warps": 1}, "r4": {"ROWS": 4, "num_warps": 4},
                    "r16": {"ROWS": 16, "num_warps": 4}, "interp": {"ROWS": 256, "num_warps": 4}},
          "sm_90": {"r1": {"ROWS": 1, "num_warps": 1}, "r4": {"ROWS": 4, "num_warps": 4},
                    "r16": {"ROWS": 16, "num_warps": 4}, "interp": {"ROWS": 256, "num_warps": 4}}},
    "insert": {"sm_89": {"default": {"BLOCK_T": 4, "num_warps": 4}},
               "sm_90": {"default": {"BLOCK_T": 4, "num_warps": 4}}},
    "mqa": {
        "sm_89": {"n128_q16": {"BLOCK_N": 128, "BLOCK_Q": 16, "num_warps": 4, "num_stages": 1},
                  "n256_q32": {"BLOCK_N": 256, "BLOCK_Q": 32, "num_warps": 8, "num_stages": 1}},
        "sm_90": {"n128_q16": {"BLOCK_N": 128, "BLOCK_Q": 16, "num_warps": 4, "num_stages": 1},
                  "n256_q32": {"BLOCK_N": 256, "BLOCK_Q": 32, "num_warps": 8, "num_stages": 1}},
    },
    "paged": {
        "sm_89": {"t4": {"TILES": 4, "num_warps": 4, "num_stages": 3},
                  "t16": {"TILES": 16, "num_warps": 4, "num_stages": 3}},
        "sm_90": {"t4": {"TILES": 4, "num_warps": 4, "num_stages": 3},
                  "t16": {"TILES": 16, "num_warps": 4, "num_stages": 3}},
    },
    # paged_topk (decode, one launch): the paged rows' logits math at 4 warps (the same dot and head
    #   sum layouts as "paged", so the logits are the same bits), blocks per program from PROGS_PER_SM
    #   (tiles = cdiv(batch * #blocks, PROGS_PER_SM * #SMs)) or a fixed TILES; the last program of a
    #   request streams each row SEL_BLOCK entries per step through the radix passes.
    "paged_topk": {a: dict(_PAGED_TOPK) for a in ("sm_89", "sm_90")},
}


def pick_q_config(n_rows: int, device: torch.device) -> dict:
    t = CONFIGS["q"][arch_of(device)]
    if device.type != "cuda":
        return t["interp"]
    return t["r4"] if n_rows <= 8192 else t["r16"]


def pick_mqa_config(M: int, N: int, device: torch.device) -> dict:
    t = CONFIGS["mqa"][arch_of(device)]
    return t["n256_q32"] if M * N >= (1 << 24) else t["n128_q16"]


def pick_paged_config(B: int, max_context_len: int, device: torch.device) -> dict:
    """Enough programs to fill the GPU (>= ~4 per SM) with as many blocks per program as allowed."""
    t = CONFIGS["paged"][arch_of(device)]
    n_tiles = -(-max_context_len // 64)
    return t["t16"] if B * n_tiles >= 16 * 4 * num_sms(device) else t["t4"]


#: the one-launch logits + top-k row ``pick_paged_topk_config`` returns, by config table, and by compile target
#: where a target's pick differs from its table's (``"sm_120"`` reads the sm_89 table).
#: sm_89: ``p2r2048h11b6cw`` (idx10w, the code-warming register select). H200, sm_89 build, TP=4 rank, ctx 8k,
#: ABBA (session 12 call 1, ``ds4lab step --ab "indexer.PAGED_TOPK_DEFAULT=..." --abba``, NOTES "idx10w"): batch 1
#: 4,732 -> 4,700 us (-32), batch 16 10,262 -> 10,140 (-122); with ``INDEXER_FUSED_MAX_NEXT_N = 2`` MTP 5,962 ->
#: 5,923 (-38); on the step's own inputs with code and data cold (``scripts/gpu/idx_in_step.py --cold``) 15.4 us a
#: call vs ``p2s512`` 16.8 at next_n 1, 23.1 vs 39.2 at next_n 2.
#: sm_120: ``p2s512`` (the warm row spills 28 B there at next_n 2; no sm_120 card timed).
#: sm_90 (the H200's native build): ``p2s512`` until that build is timed with the warm row.
PAGED_TOPK_DEFAULT = {"sm_89": "p2r2048h11b6cw", "sm_90": "p2s512", "sm_120": "p2s512"}
#: the rows each table's pick functions can return on a GPU (``pick_q_config``, ``CONFIGS["insert"]``,
#: ``pick_mqa_config``, ``pick_paged_config``, ``pick_paged_topk_config``), and sm_120's own list (its table is
#: sm_89's, its top-k pick is not): what the compile report builds for sm_120 (candidate rows are built for sm_89
#: and sm_90 only)
GPU_DEFAULTS = {a: ("r4", "r16", "default", "n128_q16", "n256_q32", "t4", "t16", PAGED_TOPK_DEFAULT[a])
                for a in ("sm_89", "sm_90", "sm_120")}


def paged_topk_tiles(cfg: dict, B: int, n_tiles: int, device: torch.device) -> int:
    """Cache blocks per program of the one-launch logits + top-k: ``cfg["TILES"]``, or enough that
    ``B * #programs`` stays within ``PROGS_PER_SM * #SMs`` (at least 1)."""
    if "TILES" in cfg:
        return max(1, int(cfg["TILES"]))
    return max(1, -(-B * n_tiles // (cfg["PROGS_PER_SM"] * num_sms(device))))


def pick_paged_topk_config(B: int, max_context_len: int, device: torch.device) -> dict:
    """The ``PAGED_TOPK_DEFAULT`` row of ``device``'s build: its compile target's entry if it has one (sm_120),
    else its config table's."""
    arch = arch_of(device)
    t = _arch.target(device)
    key = f"sm_{t[0]}" if t is not None and f"sm_{t[0]}" in PAGED_TOPK_DEFAULT else arch
    return CONFIGS["paged_topk"][arch][PAGED_TOPK_DEFAULT[key]]
