"""Stale per-request metadata in vLLM 0.32's multi-step drafter (MTP k >= 2 drafts at depth >= 2).

``vllm/v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer.propose`` drafts position 0
from the verify batch (``query_start_loc`` = each request's k+1 tokens), then, for positions
1..k-1, mutates the *same* ``CommonAttentionMetadata`` in place to one token per request
(``query_start_loc = arange``, ``num_actual_tokens = batch``; ``seq_lens`` += 1 per step in
``_update_positions_dependent_metadata``) and rebuilds the attention metadata. But
``CommonAttentionMetadata.token_to_req_indices`` (``vllm/v1/attention/backend.py``) caches its
first answer in ``_token_to_req_indices_cache`` (and ``compute_num_computed_tokens`` in
``_num_computed_tokens_cache``); nothing resets them. DeepSeek-V4's sparse SWA builder
(``v1/attention/backends/mla/sparse_swa.py``) reads that map, so at depth >= 2 the draft token of
request r looks up the seq_len / block table / window of request ``r // (k+1)``: the draft
attends another request's KV. With one request the map is right (all zeros); the agree-heads
tiny model mostly drafts right anyway, so it surfaced as ~1 of 85 position-1 drafts rejected
at 4-8 concurrent requests (issue 23 item 4; NOTES.md has the reproduction).

:func:`install` wraps ``_update_positions_dependent_metadata`` (called at the top of every
depth >= 1 step, before the rebuild) to drop both caches first, so each step's map is built from
that step's ``query_start_loc``. Platform-neutral: the GPU path has the same code.
"""
from __future__ import annotations

import functools

__all__ = ["install", "reset_step_caches"]

_TARGET = "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer._update_positions_dependent_metadata"


def reset_step_caches(common_attn_metadata) -> None:
    """Forget what ``common_attn_metadata`` cached from an earlier query layout
    (``_token_to_req_indices_cache``, ``_num_computed_tokens_cache``)."""
    common_attn_metadata._token_to_req_indices_cache = None
    common_attn_metadata._num_computed_tokens_cache = None


def install() -> list[str]:
    """Patch the proposer step (idempotent); returns the patched symbol names."""
    from vllm.v1.spec_decode import llm_base_proposer as m

    cls = m.SpecDecodeBaseProposer
    orig = cls._update_positions_dependent_metadata
    if getattr(orig, "_ds4lab_fix", False):
        return []

    @functools.wraps(orig)
    def _update_positions_dependent_metadata(self, positions, common_attn_metadata, *args, **kwargs):
        reset_step_caches(common_attn_metadata)
        return orig(self, positions, common_attn_metadata, *args, **kwargs)

    _update_positions_dependent_metadata._ds4lab_fix = True
    cls._update_positions_dependent_metadata = _update_positions_dependent_metadata
    return [_TARGET]
