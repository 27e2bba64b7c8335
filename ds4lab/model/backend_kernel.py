"""The kernel backend: every op of :class:`ds4lab.model.ops.Backend` through a ds4lab Triton launcher
where one exists, else a torch op whose op-group kind says so (``torch:<what>``).

Op group -> what runs it (the kind each call reports; ``launches`` = kernel launches per call on a
GPU, torch glue counted as the CUDA kernels it issues, approximately):

==========================  =============================================================  ========
op (Backend method)         kind                                                           launches
==========================  =============================================================  ========
linear, FP8 weight, T<=32   ``kernel:fp8_gemm.w8a8_block_fp8_linear(fused quant)``         1
                            (``FUSE_ACT_QUANT_MAX_M``; sm_89 T=1: the GEMV row ``gemv_w8``, T>2 ``fq_16x64``)
linear, FP8 weight, T>32    ``kernel:fp8_quant.per_token_group_quant_fp8+fp8_gemm.fp8_gemm_nt``  2
linear, FP8 input copy      ``kernel:fp8_gemm.fp8_gemm_nt(producer quant)``: the input's producer   1
                            wrote its FP8 copy (``PRODUCER_QUANT``: ``wq_b`` after ``q_kv_norm_rope``;
                            ``SEAM_QUANT``: ``wqkv_a`` / ``shared_w13`` after the mHC seam)
shared down (SwiGLU input)  ``kernel:fp8_gemm.w8a8_block_fp8_linear(fused swiglu_clamp + quant)`` up to
                            ``FUSE_SHARED_ACT_MAX_M`` (32) tokens, else swiglu_clamp + the linear         1
linear, bf16 weight         ``torch:matmul(bf16)`` (router gate: fp32)                         1-2
  (C4A: ``attn.x_proj`` = compressor + indexer-compressor wkv_gate + weights_proj, one GEMM)
mla_cache_write             ``kernel:mla_cache.fp8_ds_mla_insert`` (cache fill, prefill)       1
indexer_cache_write         ``kernel:indexer.indexer_k_cache_insert`` (cache fill, prefill)    1
indexer_q                   ``kernel:indexer.indexer_q_rope_quant``                            1
q_norm_rope_indexer_q (C4A) ``FUSE_Q_INDEXER_Q``: ``kernel:norm_rope.q_norm_rope_indexer_q`` (q norm   1 / 2
                            + rope and indexer q rope + quant, one grid); else q_norm_rope + indexer_q
indexer_topk, decode        ``kernel:indexer.fp8_paged_mqa_topk`` (``max_len <=``               1
                            ``INDEXER_FUSED_MAX_N``, next_n 1, ``<= INDEXER_FUSED_MAX_B``; else the pair)
indexer_topk                ``kernel:indexer.fp8_paged_mqa_logits+topk.topk_indices``          2
sparse_mla                  ``kernel:sparse_mla.sparse_mla_decode`` (split merge: +1)          1-2
o_proj                      ``kernel:o_proj.o_proj``: T <= 32 ``unfused3_s8`` (inv-RoPE+quant, 3
                            wo_a with in-launch split-K + z quant, wo_b); above, the parts (4-6)
sparse_mla_o_proj           ``FUSE_O_QUANT`` (GPU: T <= ``FUSE_O_QUANT_MAX_T``): the merge writes     +0 /
                            o_proj's fp8 input (kind ``...(+o_proj inv-RoPE + fp8 quant)``), then   2
                            ``kernel:o_proj.o_proj_fp8_input`` (wo_a, wo_b); else sparse_mla + o_proj
mhc_pre / mhc_post          ``kernel:mhc.mhc_pre`` / ``kernel:mhc.mhc_post`` (x: the MoE's fp32   2 / 1
                            sum after the MoE)
mhc_post_pre (seam)         ``kernel:mhc.mhc_fused_post_pre`` (``mhc.SEAM_DEFAULTS``: T=1       1 / 2
                            seamr_d64, T<=4 seam1_d64, sm_89 T 5-32 seamt_d32)
                            (``SEAM_QUANT``: ``(+layer input fp8)``, the copy ``wqkv_a`` /
                            ``shared_w13`` read; ``SEAM_PREFETCH``: ``(+L2 prefetch)``, the next
                            ops' weights prefetched into L2 by the seam launch)
hc_head                     ``kernel:mhc.hc_head``                                             2
gate_route (gate + route)   ``kernel:moe_gate.gate_sqrtsoftplus_topk`` (T<=16; above: mm + route) 1 / 2
route (logits given)        ``kernel:moe_routing.sqrtsoftplus_topk``                           1
experts, INT4               ``kernel:moe_w4a16.fused_moe_w4a16`` (adds into the shared expert's  2 (decode)
                            fp32 output in its last launch)                                      / 3 (prefill)
compressor, T <= 64         ``kernel:compressor.compress_decode`` (state write + compress;     2 / 1
                            reads the bf16 GEMM output slice as is; ``COMPRESS_ONE_LAUNCH``: one
                            launch, bit-identical; on since session 7's H200 step A/B)
compressor_insert, T <= 64  ``kernel:compressor.compress_decode(+fp8_ds_mla|indexer K insert)``  2 / 1
                            (the boundary entries written by the compress launch: no insert launch;
                            ``COMPRESS_ONE_LAUNCH`` as above; T > 64: torch compressor + the insert,
                            groups ``name`` + ``insert_name``)
q_kv_norm_rope              ``kernel:norm_rope.q_kv_rmsnorm_rope`` (q_norm + kv_norm + kv rope) 1
                            (``swa_cache=``: ``(+fp8_ds_mla insert)``, the SWA entry in the launch;
                            ``PRODUCER_QUANT``: ``(+fp8_ds_mla insert, q fp8)``, q's FP8 copy too)
rmsnorm / q_norm_rope /     ``kernel:norm_rope.rmsnorm_rope(norm|norm+rope|rope)`` (q: any     1 each
rope / swiglu               token stride) / ``kernel:norm_rope.swiglu_clamp``                    1
index_maps (once a step)    ``kernel:step_maps.step_index_maps`` (all the step's maps)     1
add (bf16 + bf16)           ``torch:add`` (one bf16 add: fp32 math, one rounding)              1
compressor T > 64 / embed   ``torch:compressor`` / ``torch:embedding``
==========================  =============================================================  ========

The composition adds per step, not per layer: ``step.maps`` (``index_maps``:
``kernel:step_maps.step_index_maps``, ONE launch per forward writing the SWA window, compressor
window/state slots per ring size, compressed write slots, counts and C128 slot lists per cache size;
``torch:index_maps``, the reference's ~60 small launches, for a key structure the kernel does not
cover; ``RankModel._maps``) and per C4A layer
``indexer.slots`` (``torch:where``, 3: local top-512 -> global slots). Count them on a CPU with
:func:`ds4lab.model.launches.count_launches`.

Decode is CUDA-graph capturable: no op here reads a device value back to the host for T <= 64
tokens (``compress`` switches to a boundary-only ``nonzero`` path above that, for prefill chunks),
every shape depends only on the step's tensor shapes and the caches' static sizes, and the o_proj
position check (a host sync) is off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ds4lab.model.ops import Backend, Experts, Linear, op_group

BF16 = torch.bfloat16
F32 = torch.float32

#: the fused router gate + top-k kernel up to this many tokens (see ``KernelBackend.gate_route``); above,
#: the cuBLAS mm + route pair. H200, session 7 (results/issue20/s7/call1/gate, `bash scripts/gpu/route.sh
#: --gate`, sm89 build, us): the fused gate at its best row (``moe_gate.DECODE_DEFAULTS``) 5.9 / 6.3 / 6.6 /
#: 7.6 / 9.4 at T = 1 / 2 / 4 / 8 / 16 against the pair's 10.5 / 10.8 / 10.7 / 10.9 / 11.0 (native: 5.9 /
#: 6.4 / 6.6 / 7.7 / 9.6 vs 10.5-11.2): 4 -> 16 (m16's token-spread rows, NOTES.md "m16").
GATE_FUSED_MAX_T = 16

#: up to this many tokens the 1x128 activation quant runs in the FP8 GEMM's prologue
#: (``w8a8_block_fp8_linear(fused=True)``, one launch, bit-identical); above, quant + GEMM (two).
#: H200, TP4 decode shapes, sm_89 build, cold L2 (results/issue20/final/gemm_table.txt): at M=1 the
#: single-row fused prologue 5.2-8.0 us vs quant + GEMM 7.0-11.0 us (every shape); at M=16 the two
#: are within +-1 us either way (fused 5.9-9.8, pair 6.9-9.7), so the pair stays there. Session 5: M=4
#: fused 43.1 us summed over the five TP=4 shapes vs the pair's 44.8, and in the MTP verify step (T=2) the
#: pair's extra launch per linear is ~0.5 us of launch gap each: fused up to 2 tokens (M=2: H200 call 5).
#: m16: 2 -> 32 (= fp8_gemm.FUSED_MAX_M) with the hardware-cast quant prologue (~140 PTX instructions per
#: 16 x 128 k-block, was ~400) and the fused launch's own row ``fq_16x64`` / ``fq_16x32`` at 3..32 tokens.
#: H200 session 7, sm_89 build (results/issue20/s7/call3/gemm, `MS=4,8,16,32 bash scripts/gpu/gemm.sh`):
#: fused vs quant + GEMM, us, at M = 4 / 16 / 32: wq_a_wkv 8.49 / 8.53 / 9.89 vs 9.2 / 9.43 / 15.0; wq_b 8.47 /
#: 7.61 / 9.25 vs 10.4 / 8.17 / 17.6; wo_b 8.57 / 8.5 / 11.5 vs 10.7 / 9.64 / 13.5; shared_gate_up 7.45 / 7.35 /
#: 8.14 vs 8.44 / 8.51 / 14.9 (every shape, both builds). In the step (A/B in one process, `ds4lab step --ab`,
#: sums of the profiled op groups, sm89): batch 16 11,210 -> 11,014 us, MTP batch 16 (T=32) 16,648 -> 15,737;
#: -5 launches a layer at both; batch 1 unchanged (M=1 was fused already). So 2 -> 32.
FUSE_ACT_QUANT_MAX_M = 32

#: the shared expert's clamped SwiGLU in the down projection's prologue
#: (``w8a8_block_fp8_linear(act="swiglu_clamp")``: activation + quant + GEMM in one launch, bit-identical
#: to swiglu_clamp + the linear) up to ``min(this, FUSE_ACT_QUANT_MAX_M)`` tokens. 0 (off) until the H200
#: rows say so: scripts/gpu/gemm.sh times ``ds4lab_fused+act`` against ``ds4lab_act+fused`` at shared_down
#: (NOTES.md "FP8 GEMM decode (issue 20, gemm5)"); set it to 1 if the fused row is lower at M=1.
#: H200 sm_89 build, session 5 (results/issue20/s5/gemm_decode.csv): at M=1 the SwiGLU-prologue launch
#: 3.60 us (gemv_w8) vs swiglu_clamp + the fused linear 6.64 us; at M=4 5.36 vs 8.30 (not used: the
#: fused quant itself stops at FUSE_ACT_QUANT_MAX_M). m16, H200 session 7 (sm_89, same run as above):
#: shared_down act-fused 5.47 / 6.31 / 6.38 us at M = 4 / 16 / 32 vs swiglu_clamp + the linear's 8.53 / 7.92 /
#: 10.5: 2 -> 32 with FUSE_ACT_QUANT_MAX_M (the step rows above include it: moe.shared_act 50 us -> 0).
FUSE_SHARED_ACT_MAX_M = 32

#: decode (``next_n`` rows per request) indexer logits + top-k in ONE launch
#: (``indexer.fp8_paged_mqa_topk``: the last program of a request selects in-program, same indices as the
#: two-launch path) up to this many compressed positions per request (``max_len``; ctx 8k = 2,048), at plain
#: decode (next_n 1) and up to INDEXER_FUSED_MAX_B requests; else ``fp8_paged_mqa_logits`` + ``topk_indices``.
#: H200, session 7 (results/issue20/s7/call1/idx, `OUT=DIR bash scripts/gpu/idx_topk.sh`, sm89 / native, us):
#: N=2,048 one launch vs the pair: B=1 15.3 / 14.5 vs 17.3 / 15.2; B=2 15.8 vs 18.6; B=16 21.5 / 21.0 vs
#: 23.2 / 21.4. It loses at B=32 (26.1 vs 25.0), at next_n 2 (B=1: 27.7 vs 20.9: the select reads both
#: rows serially) and at N=8,192 (44.0 vs 23.1: the one-program select of a long row). 0 turns it off.
#: The bound is the static cache size (``n_comp``: ``ceil(max_ctx / 4)`` rounded up to the 64-entry block),
#: not the live length: the step at ctx 8k (max_ctx 8,200) has n_comp 2,112, so 2,048 never engaged it there.
#: Session 8 (results/issue20/s8/call2, `ds4lab step --ab backend_kernel.INDEXER_FUSED_MAX_N=4096 --abba`,
#: sums of the profiled op groups): batch 1 -133 us (sm89) / -97 (native), batch 16 -20 / -5; next_n 2 does
#: not take it. So 2,048 -> 2,112 (the largest size timed in the step; 8,192 lost at kernel level).
#: The interpreter lane uses INDEXER_FUSED_MAX_N_INTERP at any next_n and batch, so the model's CPU tests
#: keep exercising it.
INDEXER_FUSED_MAX_N = 2112
INDEXER_FUSED_MAX_B = 16
#: the largest ``next_n`` (rows per request) that takes the one-launch path on a GPU, by config table (an int: every
#: table). sm_90: 1 since session 7 (``p2s512``'s select runs the two rows one after the other: 27.7 vs 20.9 us for
#: the pair). sm_89: 2 with the register select ``p2r2048h11b6cw`` (idx10w): H200 session 12 call 1, sm_89 build,
#: ABBA, MTP 5,962 -> 5,923 us with both (-7 with the row alone), on the step's own inputs with code and data cold
#: 23.1 us a call vs 39.2 for ``p2s512`` (NOTES "idx10w")
INDEXER_FUSED_MAX_NEXT_N = {"sm_89": 2, "sm_90": 1}
INDEXER_FUSED_MAX_N_INTERP = 8192

#: decode ``compressor`` / ``compressor_insert`` in ONE launch (``compress_decode``'s ``<name>_1l`` rows: each
#: program writes its own state row and builds the window rows this launch writes from kv_score + ape;
#: bit-identical to the state write + compress pair) when True; False = the pair (2 launches). The H200
#: (session 7): `OUT=DIR bash scripts/gpu/compress_1l.sh` checked it bit-identical (72 + 72 checks, both
#: builds), but its kernel timer is not decisive (rows of 16-55 us with +-10 us between neighbours, while the
#: step's whole compressor group is ~2.6 us a call). The step A/B (`ds4lab step --ab
#: backend_kernel.COMPRESS_ONE_LAUNCH=True`, sums of the profiled op groups, sm89, two runs): attn.compressor
#: 113 -> 77 us, indexer.compressor 50 -> 33, launch gaps -25 to -31; the step's groups -78 to -87 us at batch 1
#: and 16, plain and MTP; -1.4 launches a layer. The model check's layers came out identical with it on.
COMPRESS_ONE_LAUNCH = True
COMPRESS_ONE_LAUNCH_INTERP = True

#: ``sparse_mla_o_proj`` (ofuse, issue 20): o_proj's inverse RoPE + 1x128 FP8 quant written by sparse MLA's
#: merge launch (``sparse_mla_decode(o_fp8=True)``, the bits of ``inv_rope_fp8_quant`` of the bf16 o), then
#: ``o_proj_fp8_input`` (wo_a + wo_b: 2 launches); False = the attention's bf16 o, then o_proj's 3 launches.
#: Up to ``o_proj.DECODE_DEFAULT_MAX_T`` tokens on a GPU (the 3-launch row's range), ``o_proj.FUSED_MAX_T``
#: on the interpreter (on GPUs bounded by ``FUSE_O_QUANT_MAX_T``). History: the session-8 step A/B (results/issue20/s8/call2, --abba, sm89, sums of
#: the profiled op groups) moved the cost, it did not remove it: attn.sparse_mla +68 us at batch 1 (+1.6 us a
#: layer: the 128-dim merge programs with the epilogue), attn.o_proj -69, launch gaps -28 (one launch a layer
#: fewer): batch 1 -37 / MTP -20 us, batch 16 +5 / MTP +30 (sparse_mla +129 / +149); native -31 / -6 / +19 /
#: -28, measured with CUPTI attached (NOTES "cupti"); re-timed cleanly in session 10 (below). The interpreter
#: lane runs it so the model's CPU tests keep exercising it (NOTES.md "ofuse").
FUSE_O_QUANT = True
FUSE_O_QUANT_INTERP = True
#: the largest step (tokens) that takes ``FUSE_O_QUANT`` on a GPU. Session 10 call 2 (clean two-phase timing,
#: sm89, one pass; results/issue20/s10/call2): batch 1 -29 us, batch 1 MTP -42, batch 16 +50, batch 16 MTP +45
#: (the merge's longer epilogue costs more than the launch it saves once 16+ tokens fill the GPU), so 2.
#: Call 3 (ABBA, batch 1 and MTP): batch 1 4,830 / 4,829 -> 4,806 / 4,805 us (-24), MTP 6,304 / 6,297 -> 6,236 /
#: 6,230 (-68), 22.6 -> 21.6 launches a layer (o_proj 2 launches): on since session 10.
FUSE_O_QUANT_MAX_T = 2

#: producer quant (issue 20 "fuse the activation quant into the producer of each linear's input", ``pq``):
#: the op that makes a block-FP8 linear's input also writes its 1x128 FP8 copy (UE8M0 scales, byte for
#: byte the quant ``w8a8_block_fp8_linear`` runs in its prologue), and the linear runs ``fp8_gemm_nt`` on
#: it (no quant in the GEMM, no quant launch). Today: ``q_kv_norm_rope`` for ``wq_b`` (and C4A's fused
#: ``wq_b | indexer wq_b``). The handoff is the attribute :data:`FP8_COPY` on the bf16 output (kept, for
#: any other reader and the model check's op shadow). The H200 kernel rows (session 7, sm89, us, plain vs
#: fused quant, same tiles): wq_b M=1 4.96 vs 6.36 (session 5), M=16 6.11 vs 7.61, M=32 6.94 vs 9.25. The step
#: A/B, session 8 (results/issue20/s8/call2, `ds4lab step --ab backend_kernel.PRODUCER_QUANT=True --abba`, sums
#: of the profiled op groups, us): sm89 batch 1 -134, batch 1 MTP -110, batch 16 -79, batch 16 MTP -133;
#: native -11 / -123 / -105 / -159; the model check (batch 4 x next_n 1) passed with it. ON. The interpreter
#: lane uses PRODUCER_QUANT_INTERP.
PRODUCER_QUANT = True
PRODUCER_QUANT_INTERP = True
#: the same for the mHC seam's layer input (``mhc_fused_post_pre(quant_out=True)``, NOTES.md "pq-mhc"), read by
#: ``wqkv_a`` and ``shared_w13`` (session 5 M=1 plain vs fused quant: 4.42 vs 6.90, 3.76 vs 4.95 us). The step
#: A/B, session 8 (results/issue20/s8/call3, `ds4lab step --ab backend_kernel.SEAM_QUANT=True --abba`, sums of
#: the profiled op groups, us, sm89 / native): batch 1 -307 / -193 (wqkv_a -105, shared_w13 -50, and the two
#: seamr seams -69 / -79 faster), batch 1 MTP +3 / -3 (the seam1 seams +67 each against the linears' -125),
#: batch 16 -73 / -90, batch 16 MTP -94 / -101; the model check (batch 4 x next_n 1) passed with it. ON.
SEAM_QUANT = True
SEAM_QUANT_INTERP = True
#: l2pf (issue 20, session 10): each mHC seam launch also prefetches into L2 (``prefetch.global.L2::evict_last``,
#: ``mhc_fused_post_pre(prefetch=...)``) the weights the next ops on the chain read, which the composition passes
#: (``RankModel._block``): after the attention, the router gate + bias, the shared expert's w13 + scale and the next
#: seam's fn / scale / base / norm weight; after the MoE, the next layer's ``wqkv_a`` + scale, q / kv norm
#: weights and its first seam's fn / scale / base / norm weight. The waiters of the seam's grid sync issue them
#: (T = 1 seamr_d64, T = 2-4 seam1_d64; ignored by seamt_d32 and the two-pass kernels above). Bit-identical (a prefetch writes
#: nothing). The bound (H200 session 10, scripts/gpu/l2warm.py, NOTES "l2warm"): the seam 9.8 -> 7.7 us with a
#: warm L2, wq_a_wkv 8.15 -> 6.90, shared_gate_up 3.8 -> 2.9, the gate 5.65 -> 4.77. OFF until the step A/B
#: (``ds4lab step --ab backend_kernel.SEAM_PREFETCH=True``) says so (NOTES "l2pf"). Read per call; the CPU
#: interpreter lane passes the tensors too when on (the launcher checks them and issues nothing there).
SEAM_PREFETCH = False
K_L2_PREFETCH = "(+L2 prefetch)"
#: the attribute a producer sets on its bf16 output: ``(x_fp8 (T, K) float8_e4m3fn, x_scale (T, K/128) uint8)``
FP8_COPY = "ds4lab_fp8_copy"

#: graph-level concurrency (issue 20, ``streams``): the composition's side chains (:meth:`Backend.branch`: a
#: layer's compressor GEMM + compressors beside ``wqkv_a -> q/kv norm -> wq_b -> q norm``, the shared expert
#: beside the router) run on a second CUDA stream, forked after the layer input and joined right before the
#: first reader (the indexer / the attention; the routed experts, which add into the shared expert's output).
#: The same kernels on the same inputs: the numbers are bit-identical; what changes is that the short
#: latency-bound launches of the two chains overlap (vLLM's shared-expert stream does the same for its MoE).
#: H200, sm_89 build, TP=4 rank, ctx 8k, ``ds4lab step --ab backend_kernel.BRANCH_STREAMS=False --abba`` with
#: every p50 timed before any profiling (session 9, NOTES "streams", "cupti"): on vs off -388 us at batch 1,
#: -182 at batch 1 MTP, -167 at batch 16, -386 at batch 16 MTP; logits bit-identical, eager and replayed
#: (tests/test_branch_streams.py on the H200). A no-op on a CPU (no streams).
BRANCH_STREAMS = True
#: the forks :data:`BRANCH_STREAMS` runs on the side stream (``Backend.branch``'s ``block``): ``"attn"`` (the
#: compressors beside the q chain), ``"moe"`` (the shared expert beside the router); ``ds4lab step --ab
#: "backend_kernel.BRANCH_BLOCKS=['moe']"`` times one alone
BRANCH_BLOCKS = ("attn", "moe")
#: the forks whose main-chain head is issued BEFORE the side chain (both still depend only on the fork point):
#: ``"attn"``: ``wqkv_a`` before the compressors' GEMM; ``"moe"``: the router before the shared expert. In a CUDA
#: graph the two chains are independent either way; what changes is the order the launches reach the GPU, so
#: which kernel's CTAs take the SMs first: side first, ``wqkv_a`` ran at ~8.7 us a call beside the bf16 ``x_proj``
#: (~4 with the streams off) and the router ~1.5 us slower beside the shared expert. H200, sm_89 build, TP=4, ctx 8k,
#: ABBA (session 11 call 2, ``ds4lab step --ab "backend_kernel.BRANCH_MAIN_FIRST=('attn','moe')" --abba``, NOTES
#: "order11"): batch 1 4,755 -> 4,716 us (-39), MTP 6,145 -> 5,941 (-204), batch 16 10,304 -> 10,287 (-17), batch 16
#: MTP 14,625 -> 14,543 (-82); op groups: wqkv_a -201 / -241, gate_route -63 / -243 at batch 1 / MTP, the side
#: chain's kernels (hidden) slower. Bit-identical (tests/test_branch_streams.py on the H200).
#: Also issuing the q/kv norm before the side chain (session 12 call 1, ABBA) measured equal: +10 / 0 / -7 / -8 us.
BRANCH_MAIN_FIRST = ("attn", "moe")
#: with :data:`BRANCH_STREAMS`: the step's main chain runs on a stream of the device's greatest priority (forked
#: from, and joined back into, the caller's stream around the layers: ``Backend.step_scope``) and the side chains
#: on the default-priority side stream, so that when both chains' CTAs wait for an SM the block scheduler takes
#: the main chain's first. A CUDA graph keeps it: kernel nodes take their capture stream's priority, and torch
#: instantiates graphs with ``cudaGraphInstantiateFlagUseNodePriority``. Same kernels, same inputs: bit-identical.
#: Measured (session 11 call 2, ABBA, before BRANCH_MAIN_FIRST was on) the same as issuing the main chain first:
#: batch 1 -23 us, MTP -192, batch 16 -10, batch 16 MTP -99 (both on: -23 / -185 / -18 / -101); off, as the simpler
#: of the two (no extra stream). Kept as a switch: another GPU's block scheduler may tell them apart.
BRANCH_PRIORITY = False

#: qidx (issue 20): at C4A layers the attention q's per-head RMSNorm + RoPE (``rmsnorm_rope``, group
#: ``attn.q_norm_rope``) and the indexer q's RoPE + FP8 quant (``indexer_q_rope_quant``, ``indexer.q_quant``)
#: in ONE launch (``norm_rope.q_norm_rope_indexer_q``, group ``attn.q_norm_rope+indexer.q_quant``): the same
#: bits, one launch a C4A layer fewer (21 a step). H200, sm_89 build, TP=4, ctx 8k, ABBA (session 11 call 1,
#: ``ds4lab step --ab backend_kernel.FUSE_Q_INDEXER_Q=True --abba``, NOTES "qidx"): batch 1 4,804 -> 4,756 us (-48;
#: predicted -35..45), MTP 6,209 -> 6,176 (-33), 21.6 -> 21.1 launches a layer; the model check passes with it on.
#: Read per call, on the interpreter too.
FUSE_Q_INDEXER_Q = True

#: above this many tokens a step is a prefill chunk: the compressor computes boundary rows only
#: (one ``nonzero``, a host sync that a decode step never takes)
DECODE_MAX_T = 64

K_LINEAR_FP8 = "kernel:fp8_quant.per_token_group_quant_fp8+fp8_gemm.fp8_gemm_nt"
K_LINEAR_FP8_FUSED = "kernel:fp8_gemm.w8a8_block_fp8_linear(fused quant)"
K_LINEAR_FP8_FUSED_ACT = "kernel:fp8_gemm.w8a8_block_fp8_linear(fused swiglu_clamp + quant)"
K_LINEAR_FP8_PRODUCER = "kernel:fp8_gemm.fp8_gemm_nt(producer quant)"
K_INDEXER_TOPK_FUSED = "kernel:indexer.fp8_paged_mqa_topk"
K_INDEXER_TOPK = "kernel:indexer.fp8_paged_mqa_logits+topk.topk_indices"
K_NORM = "kernel:norm_rope.rmsnorm_rope(norm)"
K_NORM_ROPE = "kernel:norm_rope.rmsnorm_rope(norm+rope)"
K_ROPE = "kernel:norm_rope.rmsnorm_rope(rope)"
K_Q_KV_NORM_ROPE = "kernel:norm_rope.q_kv_rmsnorm_rope"
K_Q_NORM_ROPE_INDEXER_Q = "kernel:norm_rope.q_norm_rope_indexer_q"
K_STEP_MAPS = "kernel:step_maps.step_index_maps"
K_Q_KV_NORM_ROPE_INSERT = "kernel:norm_rope.q_kv_rmsnorm_rope(+fp8_ds_mla insert)"
K_Q_KV_NORM_ROPE_INSERT_Q8 = "kernel:norm_rope.q_kv_rmsnorm_rope(+fp8_ds_mla insert, q fp8)"
#: [fp8_ds_mla (hd 512), indexer K (hd 128)]
K_COMPRESS_INSERT = ("kernel:compressor.compress_decode(+fp8_ds_mla insert)",
                     "kernel:compressor.compress_decode(+indexer K insert)")
K_SPARSE_MLA = "kernel:sparse_mla.sparse_mla_decode"
#: appended to the attention's kind when its merge writes o_proj's fp8 input (FUSE_O_QUANT)
K_O_QUANT = "(+o_proj inv-RoPE + fp8 quant)"
K_O_PROJ_FP8_INPUT = "kernel:o_proj.o_proj_fp8_input"
K_MHC_SEAM = "kernel:mhc.mhc_fused_post_pre"
K_MHC_SEAM_Q8 = "kernel:mhc.mhc_fused_post_pre(+layer input fp8)"


def _interp_gemm_config(M: int) -> dict:
    """The Triton CPU interpreter runs programs one by one in Python: fewest, widest tiles, no split
    (the GPU path keeps the launchers' own tables)."""
    return {"BLOCK_M": min(64, max(16, 1 << (max(M, 1) - 1).bit_length())), "BLOCK_N": 256, "GROUP_M": 1,
            "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}


def _rope_f32(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Forward GPT-J RoPE on the last ``r`` dims of ``x (T, ..., d)`` (fp32 math) -> fp32 copy."""
    R = cos_sin.shape[1]
    y = x.float().clone()
    cs = cos_sin[positions.long()]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (R // 2,)
    cos, sin = cs[:, : R // 2].reshape(shape), cs[:, R // 2:].reshape(shape)
    ev, od = y[..., -R::2].clone(), y[..., -R + 1::2].clone()
    y[..., -R::2] = ev * cos - od * sin
    y[..., -R + 1::2] = od * cos + ev * sin
    return y


def _per_table(setting, x: torch.Tensor):
    """A switch given per config table (``{"sm_89": ..., "sm_90": ...}``) -> its value for ``x``'s device; any
    other value is every table's."""
    if isinstance(setting, dict):
        from ds4lab_kernels._arch import arch_of
        return setting[arch_of(x.device)]
    return setting


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


class _StreamBranch:
    """One side chain on ``stream``: entering waits for everything the current stream issued so far, then
    makes ``stream`` current; :meth:`join` makes the stream current at that time wait for the chain (a
    fork / join pair of events, which a CUDA graph capture records as graph edges).

    Memory (eager runs; torch's caching allocator reuses a freed block only for allocations on the stream
    that made it): a side-stream block is reused only inside a later branch, after that branch's fork has
    made the side stream wait for every main-stream read issued before it; a main-stream block the chain
    reads (the layer input) is freed after the join. So no ``record_stream`` is needed, as long as the
    model allocates on the side stream only inside ``branch`` blocks and joins each before the tensors it
    read are dropped (``Backend.branch``'s contract)."""

    def __init__(self, stream):
        # the fork point is where the branch is made, not where it is entered: ops issued on the main
        # stream in between (``Backend.branch_main_first``) do not hold the side chain back
        self.stream = stream
        self.main = torch.cuda.current_stream(stream.device)
        self.stream.wait_stream(self.main)
        self._ctx = None

    def __enter__(self):
        self._ctx = torch.cuda.stream(self.stream)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)

    def join(self):
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


class _StreamScope:
    """``step_scope``'s context: the block's ops go to ``stream``, which first waits for the current stream;
    on exit the current stream waits for it (the same caching-allocator reasoning as :class:`_StreamBranch`:
    the block allocates on ``stream`` only inside the scope, and the caller's later work is ordered after it)."""

    def __init__(self, stream):
        self.stream = stream
        self.outer = None
        self._ctx = None

    def __enter__(self):
        self.outer = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(self.outer)
        self._ctx = torch.cuda.stream(self.stream)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self.outer.wait_stream(self.stream)
        return False


class KernelBackend(Backend):
    """Every op through ``ds4lab_kernels`` where a launcher exists (see the module table).

    ``mhc_precision``: ``"tf32"`` (DeepGEMM's and vLLM's choice, default) or ``"ieee"`` for the
    mHC pre-norm GEMM."""

    name = "kernel"

    def __init__(self, mhc_precision: str = "tf32"):
        import ds4lab_kernels.compressor as comp
        import ds4lab_kernels.fp8_gemm as gemm
        import ds4lab_kernels.fp8_quant as quant
        import ds4lab_kernels.indexer as idx
        import ds4lab_kernels.mhc as mhc
        import ds4lab_kernels.mla_cache as mla
        import ds4lab_kernels.moe_gate as gate
        import ds4lab_kernels.moe_routing as route
        import ds4lab_kernels.moe_w4a16 as moe
        import ds4lab_kernels.norm_rope as nr
        import ds4lab_kernels.o_proj as oproj
        import ds4lab_kernels.sparse_mla as smla
        import ds4lab_kernels.step_maps as maps
        import ds4lab_kernels.topk as topk
        self.k = dict(comp=comp, gemm=gemm, quant=quant, idx=idx, mhc=mhc, mla=mla, route=route, moe=moe,
                      oproj=oproj, smla=smla, topk=topk, nr=nr, gate=gate, maps=maps)
        self.mhc_precision = mhc_precision
        self._side: dict[int, torch.cuda.Stream] = {}
        self._main: dict[int, torch.cuda.Stream] = {}     # BRANCH_PRIORITY's main-chain streams

    # ---- concurrency -----------------------------------------------------------------------
    def branch(self, device, block: str | None = None):
        """With :data:`BRANCH_STREAMS` on a CUDA ``device`` (and ``block`` None or in :data:`BRANCH_BLOCKS`): the
        block's launches go to this backend's side stream of that device (forked from, and joined back into,
        the current stream; see :class:`_StreamBranch`). Otherwise issue order (None)."""
        device = torch.device(device)
        if not BRANCH_STREAMS or device.type != "cuda" or (block is not None and block not in BRANCH_BLOCKS):
            return super().branch(device, block)
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self._side.get(idx)
        if s is None:
            s = self._side[idx] = torch.cuda.Stream(device=idx)
        return _StreamBranch(s)

    def join(self, br) -> None:
        if br is not None:
            br.join()

    def step_scope(self, device):
        """With :data:`BRANCH_STREAMS` and :data:`BRANCH_PRIORITY` on a CUDA ``device``: the block runs on this
        backend's high-priority stream of that device (forked from the current stream on entry, joined back on
        exit); otherwise the caller's stream."""
        device = torch.device(device)
        if not (BRANCH_STREAMS and BRANCH_PRIORITY) or device.type != "cuda":
            return super().step_scope(device)
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self._main.get(idx)
        if s is None:
            # the greatest priority torch's stream pools offer (it clamps a lower number to the highest pool)
            s = self._main[idx] = torch.cuda.Stream(device=idx, priority=-100)
        return _StreamScope(s)

    def branch_main_first(self, block: str) -> bool:
        """:data:`BRANCH_MAIN_FIRST` (with :data:`BRANCH_STREAMS`; on a CPU it only changes the issue order)."""
        return BRANCH_STREAMS and block in BRANCH_MAIN_FIRST

    # ---- dense glue ------------------------------------------------------------------------
    def embed(self, ids, table, name="embed"):
        with op_group(name, "torch:embedding"):
            return F.embedding(ids.long(), table)

    def rmsnorm(self, x, weight, eps, name):
        with op_group(name, K_NORM):
            x2 = x.reshape(-1, x.shape[-1]).contiguous().to(BF16)
            return self.k["nr"].rmsnorm_rope(x2, weight, eps).reshape(x.shape)

    def linear(self, x, lin: Linear, name, out_dtype=BF16):
        x2 = x.reshape(-1, x.shape[-1])
        copy = getattr(x, FP8_COPY, None)
        if lin.fp8 and copy is not None:
            return self._linear_fp8_copy(x, copy, lin, name, out_dtype)
        if lin.fp8:
            # up to FUSE_ACT_QUANT_MAX_M tokens the quant runs in the GEMM's prologue (1 launch,
            # bit-identical); above, quant + GEMM (2 launches)
            fused = x2.shape[0] <= min(FUSE_ACT_QUANT_MAX_M, self.k["gemm"].FUSED_MAX_M)
            with op_group(name, K_LINEAR_FP8_FUSED if fused else K_LINEAR_FP8):
                cfg = None if x2.is_cuda else _interp_gemm_config(x2.shape[0])
                # bf16 or fp32 stored by the GEMM itself (fp32: the unrounded accumulator)
                od = out_dtype if out_dtype in (BF16, F32) else BF16
                y = self.k["gemm"].w8a8_block_fp8_linear(x2.contiguous(), lin.weight, lin.scale, config=cfg,
                                                         fused=fused, out_dtype=od)
                if out_dtype != od:
                    y = y.to(out_dtype)
        elif out_dtype == F32:
            with op_group(name, "torch:matmul(fp32)"):
                y = F.linear(x2.float(), lin.weight.float())
        else:
            with op_group(name, "torch:matmul(bf16)"):
                y = F.linear(x2.to(lin.weight.dtype), lin.weight).to(out_dtype)
        return y.reshape(*x.shape[:-1], -1)

    def _linear_fp8_copy(self, x, copy, lin: Linear, name, out_dtype):
        """The linear on its input's FP8 copy (``PRODUCER_QUANT`` / ``SEAM_QUANT``): ``fp8_gemm_nt`` alone, at
        ``fp8_gemm.linear_config(a_quantized=True)``: the plain row up to ``fp8_gemm.PLAIN_PICK_MAX_M`` tokens
        (the GEMV at M <= 2 on sm_89), the tiles ``w8a8_block_fp8_linear`` would take above."""
        q8, qs = copy
        M = q8.shape[0]
        g = self.k["gemm"]
        cfg = g.linear_config(M, x.device, a_quantized=True) if x.is_cuda else _interp_gemm_config(M)
        od = out_dtype if out_dtype in (BF16, F32) else BF16
        with op_group(name, K_LINEAR_FP8_PRODUCER):
            out = torch.empty((M, lin.weight.shape[0]), dtype=od, device=x.device)
            y = g.fp8_gemm_nt(q8, qs, lin.weight, lin.scale, out=out, config=cfg)
            if out_dtype != od:
                y = y.to(out_dtype)
        return y.reshape(*x.shape[:-1], -1)

    def q_kv_norm_rope(self, qkv, q_dim, q_weight, kv_weight, eps, positions, cos_sin, name="attn.q_kv_norm_rope",
                       swa_cache=None, swa_slots=None, swa_block=64):
        """``swa_cache`` given: the kv's fp8_ds_mla entry is written in the same launch (any T: one
        program per token segment either way), only ``q`` comes back."""
        if swa_cache is None:
            with op_group(name, K_Q_KV_NORM_ROPE):
                return self.k["nr"].q_kv_rmsnorm_rope(qkv.to(BF16), q_weight, kv_weight, q_dim, eps, positions,
                                                      cos_sin)
        q8 = (PRODUCER_QUANT if qkv.is_cuda else PRODUCER_QUANT_INTERP) and q_dim % 128 == 0
        with op_group(name, K_Q_KV_NORM_ROPE_INSERT_Q8 if q8 else K_Q_KV_NORM_ROPE_INSERT):
            q = self.k["nr"].q_kv_rmsnorm_rope(qkv.to(BF16), q_weight, kv_weight, q_dim, eps, positions, cos_sin,
                                               kv_cache=swa_cache, slot_mapping=swa_slots, block_size=swa_block,
                                               q_fp8=q8)
        if q8:     # wq_b reads the FP8 copy (see PRODUCER_QUANT); q itself stays for any other reader
            q, qf, qs = q
            setattr(q, FP8_COPY, (qf, qs))
        return q

    def q_norm_rope(self, q, positions, cos_sin, eps, name="attn.q_norm_rope"):
        with op_group(name, K_NORM_ROPE):      # q may be a column slice of a fused GEMM output (row stride)
            return self.k["nr"].rmsnorm_rope(q.to(BF16), None, eps, positions, cos_sin)

    def rope(self, x, positions, cos_sin, name):
        with op_group(name, K_ROPE):
            return self.k["nr"].rmsnorm_rope(x.contiguous().to(BF16), None, 0.0, positions, cos_sin, norm=False)

    # ---- the step's index maps --------------------------------------------------------------
    def index_maps(self, positions, req, window, swa_ring, layers, name="step.maps"):
        """One launch (``step_maps.step_index_maps``) where the kernel covers the caches' key structure
        (``step_maps.covers``: one size per ratio 4 / 128); any other structure keeps the torch reference."""
        if not self.k["maps"].covers(layers):
            return super().index_maps(positions, req, window, swa_ring, layers, name)
        with op_group(name, K_STEP_MAPS):
            return self.k["maps"].step_index_maps(positions.long(), req.long(), window, swa_ring, layers)

    # ---- caches ----------------------------------------------------------------------------
    def mla_cache_write(self, kv, slots, cache, block_size, name):
        with op_group(name, "kernel:mla_cache.fp8_ds_mla_insert"):
            self.k["mla"].fp8_ds_mla_insert(kv.contiguous(), slots, cache, block_size)

    def indexer_cache_write(self, k, slots, cache, name):
        with op_group(name, "kernel:indexer.indexer_k_cache_insert"):
            self.k["idx"].indexer_k_cache_insert(k.contiguous(), cache, slots)

    def compressor(self, kv_score, positions, state, state_slots, window_slots, window_valid, ape,
                   norm_weight, eps, ratio, cos_sin, name):
        if kv_score.shape[0] <= DECODE_MAX_T:
            with op_group(name, "kernel:compressor.compress_decode"):
                return self.k["comp"].compress_decode(kv_score, positions, state, state_slots,
                                                      window_slots, window_valid, ape, norm_weight, eps, ratio,
                                                      cos_sin, config=self._compress_config(kv_score, ratio))
        with op_group(name, "torch:compressor"):       # prefill chunks: boundary rows only
            return compress(kv_score, positions, state, state_slots, window_slots, window_valid, ape,
                            norm_weight, eps, ratio, cos_sin)

    def compressor_insert(self, kv_score, positions, state, state_slots, window_slots, window_valid, ape,
                          norm_weight, eps, ratio, cos_sin, name, cache, cache_slots, block_size=None,
                          insert_name=None):
        """Up to :data:`DECODE_MAX_T` tokens: ``compress_decode(cache=...)`` writes each boundary row's
        entry in the compress launch (2 launches, 1 with ``COMPRESS_ONE_LAUNCH``; no insert); above (prefill
        chunks): the torch compressor, then the insert (group ``insert_name``)."""
        if kv_score.shape[0] > DECODE_MAX_T:
            return super().compressor_insert(kv_score, positions, state, state_slots, window_slots, window_valid, ape,
                                             norm_weight, eps, ratio, cos_sin, name, cache, cache_slots, block_size,
                                             insert_name)
        hd = kv_score.shape[1] // (4 if ratio == 4 else 2)
        with op_group(name, K_COMPRESS_INSERT[hd == 128]):
            self.k["comp"].compress_decode(kv_score, positions, state, state_slots, window_slots, window_valid, ape,
                                           norm_weight, eps, ratio, cos_sin,
                                           config=self._compress_config(kv_score, ratio), cache=cache,
                                           cache_slots=cache_slots,
                                           block_size=None if hd == 128 else block_size)

    def _compress_config(self, kv_score, ratio):
        """``compress_decode``'s table row: one launch with ``COMPRESS_ONE_LAUNCH`` (GPU) /
        ``COMPRESS_ONE_LAUNCH_INTERP`` (interpreter), else the state write + compress pair."""
        one = COMPRESS_ONE_LAUNCH if kv_score.is_cuda else COMPRESS_ONE_LAUNCH_INTERP
        hd = kv_score.shape[1] // (4 if ratio == 4 else 2)
        return self.k["comp"].pick_config(ratio, hd, kv_score.device, launches=1 if one else 2)

    # ---- indexer ---------------------------------------------------------------------------
    def indexer_q(self, q, positions, cos_sin, weights, name="indexer.q_quant"):
        """One launch: ``q`` and ``weights`` are column slices of the fused projections' outputs
        (row stride > row width at T > 1); the kernel reads their strides, so no copies."""
        with op_group(name, "kernel:indexer.indexer_q_rope_quant"):
            return self.k["idx"].indexer_q_rope_quant(q.to(BF16), positions, cos_sin, weights)

    def q_norm_rope_indexer_q(self, q, iq, positions, cos_sin, weights, eps, name="attn.q_norm_rope+indexer.q_quant"):
        """With :data:`FUSE_Q_INDEXER_Q`: :meth:`q_norm_rope` and :meth:`indexer_q` in one launch
        (``norm_rope.q_norm_rope_indexer_q``, the same bits; ``q``, ``iq`` and ``weights`` read in place,
        column slices as they are); else the two ops (their own groups)."""
        if not FUSE_Q_INDEXER_Q:
            return super().q_norm_rope_indexer_q(q, iq, positions, cos_sin, weights, eps)
        with op_group(name, K_Q_NORM_ROPE_INDEXER_Q):
            return self.k["nr"].q_norm_rope_indexer_q(q.to(BF16), iq.to(BF16), positions, cos_sin, weights, eps)

    def indexer_topk(self, q_fp8, w, cache, block_table, req, limits, max_len, topk, name, next_n=None,
                     slot_base=None):
        """``next_n`` given (decode: rows ``b*next_n + i`` belong to request ``b``): one paged-logits
        row group per request reads its blocks once; else one row per token (prefill chunks).
        ``slot_base`` ``(T,)`` int32 (e.g. ``req * n_comp``, made once per step): added to every
        selected index inside the top-k launch (``-1`` padding kept), so the result is already the
        compressed-cache slots. Decode up to ``INDEXER_FUSED_MAX_N`` compressed positions: logits and
        top-k in one launch (``fp8_paged_mqa_topk``, the same indices; on a GPU up to
        ``INDEXER_FUSED_MAX_NEXT_N`` rows per request and ``INDEXER_FUSED_MAX_B`` rows in all)."""
        T, H, D = q_fp8.shape
        if next_n and (int(max_len) <= INDEXER_FUSED_MAX_N and next_n <= _per_table(INDEXER_FUSED_MAX_NEXT_N, q_fp8)
                       and T <= INDEXER_FUSED_MAX_B
                       if q_fp8.is_cuda else int(max_len) <= INDEXER_FUSED_MAX_N_INTERP):
            with op_group(name, K_INDEXER_TOPK_FUSED):
                lim = limits.to(torch.int32)
                B = T // next_n
                return self.k["idx"].fp8_paged_mqa_topk(
                    q_fp8.reshape(B, next_n, H, D), cache, w, lim.reshape(B, next_n).contiguous(), block_table[:B],
                    int(max_len), topk, offsets=slot_base)
        with op_group(name, K_INDEXER_TOPK):
            lim = limits.to(torch.int32)
            if next_n:
                B = T // next_n
                q4 = q_fp8.reshape(B, next_n, H, D)
                bt, cl = block_table[:B], lim.reshape(B, next_n).contiguous()
            else:
                q4 = q_fp8.reshape(T, 1, H, D)
                bt, cl = block_table[req.long()].contiguous(), lim.reshape(T, 1).contiguous()
            lg = self.k["idx"].fp8_paged_mqa_logits(q4, cache, w, cl, bt, int(max_len))
            return self.k["topk"].topk_indices(lg, topk, lengths=lim.contiguous(), offsets=slot_base)

    # ---- attention -------------------------------------------------------------------------
    def sparse_mla(self, q, swa_cache, swa_slots, swa_lens, sink, comp_cache, comp_slots, comp_lens,
                   swa_block, comp_block, scale, name="attn.sparse_mla", o_quant=None):
        """``o_quant`` ``(positions, cos_sin, heads_per_group)`` (only from :meth:`sparse_mla_o_proj`): returns
        o_proj's UE8M0 fp8 input ``(x, x_s)`` instead of the bf16 o."""
        kw = self._o_quant_kw(o_quant) if o_quant is not None else {}
        with op_group(name, K_SPARSE_MLA + (K_O_QUANT if o_quant else "")):
            return self.k["smla"].sparse_mla_decode(
                q.contiguous().to(BF16), swa_cache, swa_slots.to(torch.int32).contiguous(), swa_lens.to(torch.int32),
                sink, comp_cache, None if comp_slots is None else comp_slots.to(torch.int32).contiguous(),
                None if comp_lens is None else comp_lens.to(torch.int32).contiguous(), swa_block, comp_block, scale,
                **kw)

    def o_proj(self, o, positions, cos_sin, wo_a: Linear, wo_b: Linear, n_groups, name="attn.o_proj"):
        """FP8 ``wo_a``/``wo_b`` at decode: ``o_proj.pick_o_proj_config`` (``DECODE_DEFAULT`` on a GPU: the
        parts until a fused 2-launch row beats them; the fused path on the interpreter); no position check (a host sync), so the step stays capturable."""
        with op_group(name, "kernel:o_proj.o_proj"):
            H = o.shape[1]
            # the interpreter: the parts' wo_b (T > 64, or a bf16 wo_a) on interpreter-sized tiles
            cfg = None if o.is_cuda else {"wo_b_fp8": _interp_gemm_config(o.shape[0])}
            return self.k["oproj"].o_proj(o.contiguous(), positions, cos_sin, wo_a.weight, wo_b.weight, wo_a.scale,
                                          wo_b.scale, heads_per_group=H // n_groups, scale_fmt="ue8m0",
                                          check_positions=False, config=cfg)

    @staticmethod
    def _o_quant_kw(o_quant):
        positions, cos_sin, hpg = o_quant
        return {"o_fp8": True, "positions": positions, "cos_sin": cos_sin, "heads_per_group": hpg,
                "scale_fmt": "ue8m0"}

    def sparse_mla_o_proj(self, q, swa_cache, swa_slots, swa_lens, sink, comp_cache, comp_slots, comp_lens,
                          swa_block, comp_block, scale, positions, cos_sin, wo_a: Linear, wo_b: Linear, n_groups):
        """With ``FUSE_O_QUANT`` (GPU) / ``FUSE_O_QUANT_INTERP`` (interpreter), FP8 ``wo_a``/``wo_b`` and a
        decode-sized step: the attention launch writes o_proj's rotated, quantized input (group
        ``attn.sparse_mla``, kind ``... (+o_proj inv-RoPE + fp8 quant)``), then ``o_proj_fp8_input`` runs wo_a
        and wo_b (group ``attn.o_proj``, 2 launches); else the default composition (:meth:`sparse_mla`, then
        :meth:`o_proj`)."""
        on = FUSE_O_QUANT if q.is_cuda else FUSE_O_QUANT_INTERP
        oproj = self.k["oproj"]
        max_t = min(oproj.DECODE_DEFAULT_MAX_T, FUSE_O_QUANT_MAX_T) if q.is_cuda else oproj.FUSED_MAX_T
        if not (on and wo_a.fp8 and wo_b.fp8 and q.shape[0] <= max_t):
            return super().sparse_mla_o_proj(q, swa_cache, swa_slots, swa_lens, sink, comp_cache, comp_slots,
                                             comp_lens, swa_block, comp_block, scale, positions, cos_sin, wo_a, wo_b,
                                             n_groups)
        x, xs = self.sparse_mla(q, swa_cache, swa_slots, swa_lens, sink, comp_cache, comp_slots, comp_lens, swa_block,
                                comp_block, scale, o_quant=(positions, cos_sin, q.shape[1] // n_groups))
        with op_group("attn.o_proj", K_O_PROJ_FP8_INPUT):
            cfg = None if q.is_cuda else {"wo_b_fp8": _interp_gemm_config(q.shape[0])}
            return oproj.o_proj_fp8_input(x, xs, wo_a.weight, wo_b.weight, wo_a.scale, wo_b.scale, scale_fmt="ue8m0",
                                          config=cfg)

    # ---- mHC -------------------------------------------------------------------------------
    def _hc_args(self, cfg):
        return dict(rms_eps=cfg.rms_norm_eps, hc_pre_eps=cfg.hc_eps, hc_sinkhorn_eps=cfg.hc_eps, hc_post_mult=2.0,
                    sinkhorn_iters=cfg.hc_sinkhorn_iters, norm_eps=cfg.rms_norm_eps, precision=self.mhc_precision)

    def mhc_pre(self, residual, fn, scale, base, norm_weight, cfg, name):
        with op_group(name, "kernel:mhc.mhc_pre"):
            return self.k["mhc"].mhc_pre(residual.contiguous(), fn, scale, base, norm_weight, **self._hc_args(cfg))

    def mhc_post(self, x, residual, post, comb, name, x2=None):
        with op_group(name, "kernel:mhc.mhc_post"):
            return self.k["mhc"].mhc_post(x.contiguous(), residual.contiguous(), post.contiguous(), comb.contiguous(),
                                          x2=None if x2 is None else x2.contiguous())

    def mhc_post_pre(self, x, residual, post, comb, fn, scale, base, norm_weight, cfg, name, x2=None, prefetch=None):
        """With ``SEAM_QUANT`` (GPU) / ``SEAM_QUANT_INTERP``: the seam also writes the layer input's
        FP8 copy (``quant_out=True``, in the launch that writes the layer input on the decode paths) for the
        next FP8 linear (``wqkv_a`` / ``shared_w13``; the bf16 readers keep the bf16 layer input). With
        ``SEAM_PREFETCH``: the launch also prefetches ``prefetch``'s tensors into L2 (:meth:`_seam_prefetch`; kind
        ``... (+L2 prefetch)`` where the seam's path issues it)."""
        q8 = (SEAM_QUANT if x.is_cuda else SEAM_QUANT_INTERP) and x.shape[-1] % 128 == 0
        pf = self._seam_prefetch(x, prefetch)
        mhc = self.k["mhc"]
        kind = K_MHC_SEAM_Q8 if q8 else K_MHC_SEAM
        if pf and x.is_cuda and mhc.prefetch_issued(x.shape[0], mhc.pick_config(x.shape[0], x.device, fused=True)):
            kind += K_L2_PREFETCH
        with op_group(name, kind):
            r = mhc.mhc_fused_post_pre(x.contiguous(), residual.contiguous(), post.contiguous(), comb.contiguous(), fn,
                                       scale, base, norm_weight, x2=None if x2 is None else x2.contiguous(),
                                       quant_out=q8, prefetch=pf, **self._hc_args(cfg))
        if q8:
            r, copy = r[:4], r[4]
            setattr(r[3], FP8_COPY, copy)
        return r

    @staticmethod
    def _seam_prefetch(x, prefetch):
        """The tensors of ``prefetch`` the seam launch prefetches with :data:`SEAM_PREFETCH` on: those on ``x``'s
        device (CUDA; the interpreter lane's CPU) and contiguous, at most ``_l2.MAX_REGIONS``, in order; None when
        off or none (a hint: a weight elsewhere is skipped, never an error)."""
        if not SEAM_PREFETCH or not prefetch:
            return None
        from ds4lab_kernels._l2 import MAX_REGIONS
        pf = tuple(t for t in prefetch if isinstance(t, torch.Tensor) and t.device == x.device and t.is_contiguous()
                   and t.numel())
        return pf[:MAX_REGIONS] or None

    def hc_head(self, residual, fn, scale, base, cfg, name="head.hc_head"):
        with op_group(name, "kernel:mhc.hc_head"):
            return self.k["mhc"].hc_head(residual.contiguous(), fn, scale, base, rms_eps=cfg.rms_norm_eps,
                                         hc_eps=cfg.hc_eps, precision=self.mhc_precision)

    # ---- MoE -------------------------------------------------------------------------------
    def gate_route(self, x, gate: Linear, bias, topk, scaling, ids, tid2eid, name="moe.gate_route"):
        """Up to :data:`GATE_FUSED_MAX_T` tokens: the gate GEMV + routing in one launch
        (``moe_gate.gate_sqrtsoftplus_topk``); above, vLLM's cuBLAS tier (bf16 x bf16 -> fp32
        ``torch.mm``) then ``sqrtsoftplus_topk`` (H200, TP4 batch 16: the fused kernel's single
        reducing program made it 50 us a call against ~23 us for the unfused pair; m16's token-spread
        rows path serves up to 16 tokens)."""
        if gate.fp8:   # an FP8 gate (no DeepSeek-V4 checkpoint has one): the unfused pair
            return super().gate_route(x, gate, bias, topk, scaling, ids, tid2eid, name)
        if x.shape[0] > GATE_FUSED_MAX_T:
            if not x.is_cuda:   # mm(out_dtype=) is a CUDA op: the interpreter takes the fp32 linear
                return super().gate_route(x, gate, bias, topk, scaling, ids, tid2eid, name)
            with op_group("moe.gate", "torch:mm(bf16->fp32)"):
                lg = torch.mm(x.reshape(-1, x.shape[-1]).to(BF16), gate.weight.to(BF16).t(), out_dtype=F32)
            return self.route(lg, bias, topk, scaling, ids, tid2eid)
        with op_group(name, "kernel:moe_gate.gate_sqrtsoftplus_topk"):
            hashed = tid2eid is not None
            w, e, _ = self.k["gate"].gate_sqrtsoftplus_topk(x.contiguous().to(BF16), gate.weight.to(BF16), bias, topk,
                                                            scaling, ids if hashed else None,
                                                            tid2eid if hashed else None)
            return w, e

    def route(self, logits, bias, topk, scaling, ids, tid2eid, name="moe.route"):
        with op_group(name, "kernel:moe_routing.sqrtsoftplus_topk"):
            hashed = tid2eid is not None
            return self.k["route"].sqrtsoftplus_topk(logits.float().contiguous(), bias, topk, scaling,
                                                     ids if hashed else None, tid2eid if hashed else None)

    def experts(self, x, ex: Experts, weights, ids, limit, name="moe.experts", out=None):
        """INT4: ``fused_moe_w4a16``; with ``out`` (fp32, the shared expert's output) ``accumulate=True``:
        the routed experts are added into it in the kernel's last launch (no bf16 store of the routed
        output, no separate add)."""
        if ex.int4:
            with op_group(name, "kernel:moe_w4a16.fused_moe_w4a16"):
                return self.k["moe"].fused_moe_w4a16(x.contiguous(), ex.w13_packed, ex.w13_scale, ex.w2_packed,
                                                     ex.w2_scale, weights.contiguous(), ids.contiguous(), limit,
                                                     out=out, accumulate=out is not None)
        with op_group(name, "torch:bf16_experts(gather)"):
            # bf16 experts (the tiny checkpoint unquantized): per (token, slot) gathered weights, no sync
            T, D = x.shape
            k = ids.shape[1]
            I = ex.w13.shape[1] // 2
            e = ids.long().clamp(0, ex.w13.shape[0] - 1).reshape(-1)
            xs = x.float().repeat_interleave(k, 0)
            gu = torch.bmm(ex.w13[e].float(), xs[:, :, None])[..., 0].to(BF16).float()
            h = _swiglu(gu[:, :I], gu[:, I:], limit).to(BF16).float()
            y = torch.bmm(ex.w2[e].float(), h[:, :, None])[..., 0]
            wt = torch.where(ids.reshape(-1) >= 0, weights.reshape(-1), torch.zeros_like(weights.reshape(-1)))
            r = (y * wt[:, None]).reshape(T, k, D).sum(1)
            return r.to(BF16) if out is None else out.add_(r)

    def swiglu(self, gu, limit, name):
        with op_group(name, "kernel:norm_rope.swiglu_clamp"):
            return self.k["nr"].swiglu_clamp(gu.to(BF16), float(limit))

    def linear_swiglu(self, gu, lin: Linear, limit, name, act_name, out_dtype=BF16):
        gu2 = gu.reshape(-1, gu.shape[-1])
        if not (lin.fp8 and gu2.is_cuda and gu2.shape[0] <= min(FUSE_SHARED_ACT_MAX_M, FUSE_ACT_QUANT_MAX_M)
                and out_dtype in (BF16, F32)):
            return super().linear_swiglu(gu, lin, limit, name, act_name, out_dtype=out_dtype)
        with op_group(name, K_LINEAR_FP8_FUSED_ACT):
            y = self.k["gemm"].w8a8_block_fp8_linear(gu2.to(BF16).contiguous(), lin.weight, lin.scale, fused=True,
                                                     act="swiglu_clamp", act_limit=float(limit), out_dtype=out_dtype)
        return y.reshape(*gu.shape[:-1], -1)

    def add(self, a, b, name):
        with op_group(name, "torch:add"):
            if a.dtype == b.dtype == BF16:
                return torch.add(a, b)       # one launch: torch's bf16 add computes in fp32, rounds once
            return (a.float() + b.float()).to(BF16)


def _swiglu(g, u, limit):
    return F.silu(torch.clamp(g, max=limit)) * torch.clamp(u, -limit, limit)


def compress(kv_score, positions, state, state_slots, window_slots, window_valid, ape, norm_weight, eps, ratio,
             cos_sin):
    """The DeepSeek-V4 compressor in torch fp32 (semantics: :mod:`ds4lab.reference.compressor`).

    Saves every token's state row ``kv || score + ape[pos % ratio]`` into ``state[state_slots]``
    (in place), then compresses each row's window ``window_slots (T, coff*ratio)`` (softmax over
    the window per dim, masked by ``window_valid``), RMSNorm, RoPE at ``(pos // ratio) * ratio``.
    Returns ``(T, hd)`` bf16 (rows off a ratio boundary are zeros). Up to :data:`DECODE_MAX_T`
    tokens every row is computed (static shapes, no sync); above, only the boundary rows."""
    T, width2 = kv_score.shape
    coff = 2 if ratio == 4 else 1
    width = width2 // 2
    hd = width // coff
    a = ape.float()[positions.long() % ratio]
    rows = torch.cat([kv_score[:, :width].float(), kv_score[:, width:].float() + a], dim=-1)
    state[state_slots.long()] = rows.to(state.dtype)
    out = torch.zeros(T, hd, dtype=BF16, device=kv_score.device)
    boundary = (positions + 1) % ratio == 0
    if T <= DECODE_MAX_T:
        b = None
        ws, wv, pos = window_slots, window_valid, positions
    else:
        b = boundary.nonzero().squeeze(1)
        if not len(b):
            return out
        ws, wv, pos = window_slots[b], window_valid[b], positions[b]
    st = state[ws.long().clamp_min(0)].float()                    # (n, W, 2*coff*hd)
    W = coff * ratio
    second = (torch.arange(W, device=st.device) >= ratio)[None, :, None]
    if coff == 2:
        kv = torch.where(second, st[..., hd:2 * hd], st[..., :hd])
        sc = torch.where(second, st[..., width + hd:width + 2 * hd], st[..., width:width + hd])
    else:
        kv, sc = st[..., :hd], st[..., width:width + hd]
    sc = sc.masked_fill(~wv[..., None], float("-inf"))
    p = torch.softmax(sc, dim=1)
    c = (p * kv.masked_fill(~wv[..., None], 0.0)).sum(1)
    n = _rms(c, eps) * norm_weight.float()
    y = _rope_f32(n, (pos.long() // ratio) * ratio, cos_sin).to(BF16)
    if b is None:
        return torch.where(boundary[:, None], y, out)
    out[b] = y
    return out
