"""The DeepSeek-V4 composition of one TP rank over an op backend (:mod:`ds4lab.model.ops`).

Decode and prefill are one token-level step (``_forward``): the step's tokens (request ``req[t]``,
position ``pos[t]``) first write their SWA entries, compressor states and (at ratio boundaries)
compressed / indexer entries into the caches, then attend causally by position, as vLLM 0.32
does within a step. A decode step is ``B * next_n`` tokens; a prefill chunk is one request's
next ``chunk`` tokens. Every index the step needs (SWA window slots, compressor window and state
rows, compressed write slots, indexer bounds, C128 slot lists) is computed ONCE per forward on the
device from ``positions`` with static shapes (``_maps``: the backend's ``index_maps``, op group
``step.maps``, one Triton launch on the kernel backend; layers of one ratio share one entry), so a
decode step has no host sync on the kernel backend (CUDA-graph capturable) and no per-layer index
glue.

Per layer (vLLM ``models/deepseek_v4/cpu/model.py`` ``DeepseekV4DecoderLayer``,
``attention.py`` ``DeepseekV4Attention``, ``cpu/cpu_sparse.py``):
mHC pre (+attn_norm) -> ``wqkv_a`` -> q_norm, kv_norm + RoPE (one op, ``q_kv_norm_rope``) ->
``wq_b`` (C4A: fused with the indexer's ``wq_b``, one GEMM on ``qr``); the kv's fp8_ds_mla SWA entry
is written by the q/kv norm op -> [compressor (+ indexer compressor; each writes its boundary entries
into its cache), indexer q, logits, top-512); C4A: the three bf16 GEMMs on ``x`` (both compressors'
``wkv_gate``, the indexer's ``weights_proj``) as one, ``attn.x_proj``, its column slices read in place]
-> per-head q RMSNorm + RoPE (``q_norm_rope``; C4A: one op with the indexer q's RoPE + quant,
``q_norm_rope_indexer_q``) and sparse MLA with sink over SWA (+
compressed) -> o_proj (``sparse_mla_o_proj``: the kernel backend may quantize o_proj's input in the attention
launch) -> mHC post -> mHC pre (+ffn_norm) ->
router (hash ``tid2eid`` in layers < num_hash_layers, else sqrtsoftplus + bias) ->
shared expert (SwiGLU clamp; fp32 down projection) + routed experts added into it -> mHC post on the fp32
sum. Then hc_head, final norm, LM head (bf16
logits, as vLLM's bf16 ``lm_head``). MTP (``vllm/models/deepseek_v4/nvidia/mtp.py``):
``x = h_proj(hnorm(h_prev)) + e_proj(enorm(embed(tok) zeroed at pos 0))``, one SWA-only block,
its own hc_head and norm, the shared head.
"""
from __future__ import annotations

import torch

from ds4lab.geometry import ModelConfig
from ds4lab.model.cache import Caches, new_caches
from ds4lab.model.ops import op_group
from ds4lab.reference.rope import layer_cos_sin

__all__ = ["RankModel", "make_backend"]


def make_backend(backend):
    if not isinstance(backend, str):
        return backend
    if backend == "reference":
        from ds4lab.model.backend_ref import ReferenceBackend
        return ReferenceBackend()
    if backend == "kernel":
        from ds4lab.model.backend_kernel import KernelBackend
        return KernelBackend()
    raise ValueError(f"backend={backend!r}: expected 'kernel' or 'reference'")


class RankModel:
    """One rank of DeepSeek-V4 (see the module doc). ``weights``: :mod:`ds4lab.model.weights`."""

    def __init__(self, cfg: ModelConfig, tp: int, rank: int, weights: dict, device="cpu", backend="kernel",
                 max_pos: int | None = None, chunk: int = 256):
        self.cfg, self.tp, self.rank, self.W = cfg, tp, rank, weights
        self.device = torch.device(device)
        self.ops = make_backend(backend)
        self.chunk = chunk
        self.H = cfg.num_attention_heads // tp
        self.G = cfg.o_groups // tp
        self.max_pos = max_pos or min(cfg.max_position_embeddings, 1 << 17)
        self.cos_sin = {r: layer_cos_sin(cfg, r, self.max_pos, device=self.device) for r in (0, 4, 128)}
        self.layers = weights["layers"]
        self.hidden: list | None = None   # set to [] to collect per-layer residuals (checks)

    # ---- caches ----------------------------------------------------------------------------
    def new_caches(self, batch: int, max_ctx: int) -> Caches:
        return new_caches(self.cfg, batch, max_ctx, self.chunk, self.device)

    def fill_caches(self, caches: Caches, ctx: int, seed: int = 0):
        """Benchmark fill: every request holds ``ctx`` tokens of random latents in every layer's
        SWA ring, compressed KV and indexer K cache, written by this backend's own cache writers
        (compressor states: the last window of random rows). See :func:`ds4lab.model.fill.fill_caches`."""
        from ds4lab.model.fill import fill_caches
        return fill_caches(self, caches, ctx, seed)

    # ---- index maps (device, static shapes) --------------------------------------------------
    def _maps(self, pos, req, caches: Caches):
        """Every index the step's layers need that depends only on ``pos``/``req`` and the caches'
        static sizes, computed ONCE per forward by the backend's ``index_maps`` (op group
        ``step.maps``; the kernel backend: one launch): ``{"swa_slots", "swa_idx", "swa_lens",
        "comp": {(ratio, n_comp): ...}, "win": {(ratio, state_ring): ...}}``, see
        :func:`ds4lab.reference.step_maps.step_index_maps`. Layers of one ratio share one entry."""
        return self.ops.index_maps(pos, req, self.cfg.sliding_window, caches.swa_ring, caches.map_sizes())

    # ---- the step ----------------------------------------------------------------------------
    def _attention(self, i, L, x, pos, req, C, maps, ids, next_n=None):
        o, cfg = self.ops, self.cfg
        T = x.shape[0]
        ratio = L["ratio"]
        cs = self.cos_sin[ratio]
        hd, ql = cfg.head_dim, cfg.q_lora_rank
        idx = ratio == 4
        comp_cache = comp_slots = comp_lens = iks = iw = None
        br = qkv = None
        if ratio:
            # the side chain (Backend.branch): the compressors' GEMM on x and the compressors, which write
            # their boundary entries into the compressed / indexer K caches; forked before the q chain so the
            # two overlap, joined before the first reader of those caches (the indexer, the attention)
            cm = maps["comp"][(ratio, C.n_comp)]
            fork = o.branch(x.device, "attn")
            if o.branch_main_first("attn"):
                qkv = o.linear(x, L["wqkv_a"], "attn.wqkv_a")
            with fork as br:
                if idx and "x_cat" in L:            # compressor | indexer compressor | weights_proj: one GEMM on x
                    y = o.linear(x, L["x_cat"], "attn.x_proj")
                    n1, n2, _ = L["x_cat_n"]
                    ks, iks, iw = y[:, :n1], y[:, n1:n1 + n2], y[:, n1 + n2:]
                else:
                    ks = o.linear(x, L["comp"]["wkv_gate"], "attn.compressor.wkv_gate")
                    if idx:
                        iks = o.linear(x, L["idx"]["comp"]["wkv_gate"], "indexer.compressor.wkv_gate")
                        iw = o.linear(x, L["idx"]["weights_proj"], "indexer.weights_proj")
                # each compressor writes its boundary entries into its cache itself (no insert launch at decode)
                self._compress(L["comp"], ks, pos, maps["win"][(ratio, C.state_ring)], C.state, ratio, cs,
                               "attn.compressor", C.comp, cm["comp_w"], C.comp_block, "attn.comp_insert")
                if idx:
                    self._compress(L["idx"]["comp"], iks, pos, maps["win"][(4, C.idx_state_ring)], C.idx_state, 4,
                                   cs, "indexer.compressor", C.idx, cm["comp_w"], None, "indexer.k_insert")
        if qkv is None:
            qkv = o.linear(x, L["wqkv_a"], "attn.wqkv_a")
        # the kv's only use is its SWA entry: written by the norm/rope op itself (no insert launch)
        qr = o.q_kv_norm_rope(qkv, ql, L["q_norm"], L["kv_norm"], cfg.rms_norm_eps, pos, cs, swa_cache=C.swa,
                              swa_slots=maps["swa_slots"], swa_block=64)
        if idx and "wq_b_cat" in L:             # wq_b | indexer wq_b: one GEMM on qr (weights.fuse_layer)
            qq = o.linear(qr, L["wq_b_cat"], "attn.wq_b")     # its bytes: harness.step.GROUP_OPS
            nq = L["wq_b_cat_n"][0]
            q, iq = qq[:, :nq], qq[:, nq:]
        else:
            q = o.linear(qr, L["wq_b"], "attn.wq_b")
            iq = o.linear(qr, L["idx"]["wq_b"], "indexer.wq_b") if idx else None
        q = q.reshape(T, self.H, hd)      # raw (may be a column slice): normed right before the attention
        if not idx:
            q = o.q_norm_rope(q, pos, cs, cfg.rms_norm_eps)    # per-head RMSNorm + RoPE, read in place
        o.join(br)
        if ratio:
            comp_cache = C.comp
            if idx:                         # after the join: iw comes from the side chain's x_proj
                q, qf, wf = o.q_norm_rope_indexer_q(q, iq.reshape(T, cfg.index_n_heads, cfg.index_head_dim), pos,
                                                    cs, iw, cfg.rms_norm_eps)
                # the top-512 comes back as global compressed slots (req * n_comp added in the launch)
                comp_slots = o.indexer_topk(qf, wf, C.idx, C.idx_block_table, req, cm["ncomp"], C.n_comp,
                                            cfg.index_topk, "indexer.logits_topk", next_n=next_n,
                                            slot_base=cm["base"][:, 0])
            else:
                comp_slots, comp_lens = cm["slots"], cm["lens"]
        # the attention and o_proj (kernel backend, FUSE_O_QUANT: o_proj's input quant in the attention launch)
        return o.sparse_mla_o_proj(q, C.swa, maps["swa_idx"], maps["swa_lens"], L["attn_sink"], comp_cache,
                                   comp_slots, comp_lens, 64, C.comp_block, hd ** -0.5, pos, cs, L["wo_a"], L["wo_b"],
                                   self.G)

    def _compress(self, P, ks, pos, win, state, ratio, cs, name, cache, slots, block, insert_name):
        """``ks (T, 2*coff*hd)`` bf16: the ``wkv_gate`` GEMM output (may be a column slice of a
        fused GEMM's output); ``win``: this ring's entry of ``maps["win"]``; the entries go to
        ``cache`` at ``slots`` (-1 off a boundary; ``block``: fp8_ds_mla entries per block)."""
        self.ops.compressor_insert(ks, pos, state, win["sslots"], win["wslots"], win["valid"], P["ape"], P["norm"],
                                   self.cfg.rms_norm_eps, ratio, cs, name, cache, slots, block, insert_name)

    def _moe(self, L, x, ids):
        o, cfg = self.ops, self.cfg
        # the shared expert, its down projection in fp32, as a side chain (Backend.branch) beside the router; the
        # routed experts add into its buffer (the kernel backend: in the experts kernel's last launch), so they
        # join it; the fp32 sum is the mHC post's x (no add launch)
        fork = o.branch(x.device, "moe")
        route = None
        if o.branch_main_first("moe"):
            route = o.gate_route(x, L["gate"], L["bias"], cfg.num_experts_per_tok, cfg.routed_scaling_factor, ids,
                                 L["tid2eid"])
        with fork as br:
            gu = o.linear(x, L["shared_w13"], "moe.shared_w13")
            s = o.linear_swiglu(gu, L["shared_w2"], cfg.swiglu_limit, "moe.shared_w2", "moe.shared_act",
                                out_dtype=torch.float32)
        w, e = route or o.gate_route(x, L["gate"], L["bias"], cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                                     ids, L["tid2eid"])
        o.join(br)
        return o.experts(x, L["experts"], w, e, cfg.swiglu_limit, out=s)

    def _block(self, i, L, resid, ids, pos, req, C, maps, next_n=None, pre=None, nxt=None):
        """One decoder block. ``pre``: this block's ``mhc_pre`` result when the previous block's
        seam already computed it; ``nxt``: the next block's weights (its ``mhc_pre`` is fused into
        this block's last ``mhc_post``). Returns ``(residual, next block's pre or None)``."""
        o, cfg = self.ops, self.cfg
        if pre is None:
            pre = o.mhc_pre(resid, L["hc_attn_fn"], L["hc_attn_scale"], L["hc_attn_base"], L["attn_norm"], cfg,
                            "mhc.pre_attn")
        post, comb, x = pre
        a = self._attention(i, L, x, pos, req, C, maps, ids, next_n)
        resid, post, comb, x = o.mhc_post_pre(a, resid, post, comb, L["hc_ffn_fn"], L["hc_ffn_scale"],
                                              L["hc_ffn_base"], L["ffn_norm"], cfg, "mhc.post_attn+pre_ffn",
                                              prefetch=self._prefetch_moe(L, nxt))
        f = self._moe(L, x, ids)
        if nxt is None:
            return o.mhc_post(f, resid, post, comb, "mhc.post_ffn"), None
        resid, post, comb, x = o.mhc_post_pre(f, resid, post, comb, nxt["hc_attn_fn"], nxt["hc_attn_scale"],
                                              nxt["hc_attn_base"], nxt["attn_norm"], cfg, "mhc.post_ffn+pre_attn",
                                              prefetch=self._prefetch_attn(nxt))
        return resid, (post, comb, x)

    # ---- what each seam hands the backend to prefetch (Backend.mhc_post_pre's hint; l2pf) ------------------
    @staticmethod
    def _linear_tensors(lin):
        return (lin.weight,) if lin.scale is None else (lin.weight, lin.scale)

    def _prefetch_moe(self, L, nxt):
        """The tensors the ops after the ``post_attn+pre_ffn`` seam read first, soonest first: the router gate
        and its bias (hash layers: the gate only; ``tid2eid`` is read one row a token), the shared expert's w13
        and its scale (the side chain), then the ``post_ffn+pre_attn`` seam's fn, scale, base and norm weight
        (``nxt``'s ``hc_attn_*``; none after the last block). The routed experts are not known before routing."""
        out = (L["gate"].weight,) + ((L["bias"],) if L.get("bias") is not None else ())
        out += self._linear_tensors(L["shared_w13"])
        if nxt is not None:
            out += (nxt["hc_attn_fn"], nxt["hc_attn_scale"], nxt["hc_attn_base"], nxt["attn_norm"])
        return out

    def _prefetch_attn(self, nxt):
        """The tensors the next block reads first after the ``post_ffn+pre_attn`` seam, soonest first: ``wqkv_a``
        and its scale, the q / kv norm weights, then its ``post_attn+pre_ffn`` seam's fn, scale, base and norm
        weight (the compressors' bf16 ``x_proj`` on the side chain, ~21 MB at C4A, is left to stream)."""
        return (self._linear_tensors(nxt["wqkv_a"]) + (nxt["q_norm"], nxt["kv_norm"])
                + (nxt["hc_ffn_fn"], nxt["hc_ffn_scale"], nxt["hc_ffn_base"], nxt["ffn_norm"]))

    def forward(self, ids, pos, req, caches: Caches, next_n=None):
        """``ids, pos, req (T,)`` -> the pre-hc_head residual ``(T, 4, D)`` bf16 after the last layer.
        ``next_n``: decode rows grouped ``(B, next_n)`` by request (see ``Backend.indexer_topk``)."""
        o = self.ops
        ids, pos, req = (t.to(self.device).long() for t in (ids, pos, req))
        maps = self._maps(pos, req, caches)
        x = o.embed(ids, self.W["embed"])
        with op_group("embed.broadcast", "torch:expand"):
            resid = x[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()
        pre, n = None, len(self.layers)
        with o.step_scope(self.device):     # the layers' main chain (a backend may give it its own stream)
            for i, L in enumerate(self.layers):
                nxt = self.layers[i + 1] if i + 1 < n else None
                resid, pre = self._block(i, L, resid, ids, pos, req, caches.layers[i], maps, next_n, pre, nxt)
                if self.hidden is not None:
                    self.hidden.append(resid)
        return resid

    def logits(self, resid, W=None) -> torch.Tensor:
        """``(T, 4, D)`` residual -> float32 ``(T, V/tp)`` logits of this rank's vocab shard."""
        o, W = self.ops, W or self.W
        h = o.hc_head(resid, W["hc_head_fn"], W["hc_head_scale"], W["hc_head_base"], self.cfg)
        h = o.rmsnorm(h, W["norm"], self.cfg.rms_norm_eps, "head.norm")
        return o.linear(h, self.W["head"], "head.lm_head").float()

    def prefill(self, tokens, caches: Caches, req: int = 0, start: int = 0):
        """One request's prompt ``tokens (L,)`` from position ``start``, in chunks of ``self.chunk``.
        Returns ``(last logits (V/tp,) float32, residual (L, 4, D))``."""
        tokens = torch.as_tensor(tokens, device=self.device).long()
        res = []
        for c0 in range(0, len(tokens), self.chunk):
            t = tokens[c0:c0 + self.chunk]
            pos = torch.arange(start + c0, start + c0 + len(t), device=self.device)
            res.append(self.forward(t, pos, torch.full_like(pos, req), caches))
        resid = torch.cat(res)
        return self.logits(resid[-1:])[0], resid

    def decode(self, tokens, positions, caches: Caches, return_hidden: bool = False):
        """``tokens, positions (B, next_n)`` (request b = row b) -> logits ``(B, next_n, V/tp)`` float32."""
        tokens = torch.as_tensor(tokens, device=self.device).long()
        positions = torch.as_tensor(positions, device=self.device).long()
        B, n = tokens.shape
        req = torch.arange(B, device=self.device)[:, None].expand(B, n).reshape(-1)
        resid = self.forward(tokens.reshape(-1), positions.reshape(-1), req, caches, next_n=n)
        lg = self.logits(resid).reshape(B, n, -1)
        return (lg, resid) if return_hidden else lg

    def mtp_draft(self, tokens, positions, prev_resid, caches: Caches, req=None):
        """MTP: ``tokens, positions (T,)`` (the next token of each position's request), the main
        model's pre-hc_head residual ``prev_resid (T, 4, D)`` there -> draft logits ``(T, V/tp)``."""
        o, cfg, M = self.ops, self.cfg, self.W["mtp"]
        ids = torch.as_tensor(tokens, device=self.device).long().reshape(-1)
        pos = torch.as_tensor(positions, device=self.device).long().reshape(-1)
        req = torch.zeros_like(pos) if req is None else torch.as_tensor(req, device=self.device).long().reshape(-1)
        maps = self._maps(pos, req, caches)
        e = o.embed(ids, self.W["embed"], "mtp.embed")
        with op_group("mtp.zero_pos0", "torch:where"):
            e = torch.where(pos[:, None] == 0, torch.zeros_like(e), e)
        e = o.rmsnorm(e, M["enorm"], cfg.rms_norm_eps, "mtp.enorm")
        h = o.rmsnorm(prev_resid, M["hnorm"], cfg.rms_norm_eps, "mtp.hnorm")
        hp = o.linear(h.reshape(-1, cfg.hidden_size), M["h_proj"], "mtp.h_proj").reshape(h.shape)
        ep = o.linear(e, M["e_proj"], "mtp.e_proj")
        resid = o.add(hp, ep[:, None, :].expand_as(hp), "mtp.add")
        with o.step_scope(self.device):
            resid, _ = self._block(cfg.num_hidden_layers, M, resid, ids, pos, req, caches.mtp, maps)
        return self.logits(resid, W=M)
