"""ds4lab.vllm_plugin.spec_decode_fix against the real vLLM 0.32 CommonAttentionMetadata: the stale
token->request map the drafter reused at depth >= 2, and the reset that fixes it."""
import pytest
import torch

pytestmark = pytest.mark.vllm


def _cad(qsl):
    from vllm.v1.attention.backend import CommonAttentionMetadata
    n = len(qsl) - 1
    q = torch.tensor(qsl, dtype=torch.int32)
    return CommonAttentionMetadata(query_start_loc=q, query_start_loc_cpu=q.clone(),
                                   seq_lens=torch.full((n,), 10, dtype=torch.int32), num_reqs=n,
                                   num_actual_tokens=int(qsl[-1]), max_query_len=3, max_seq_len=10,
                                   block_table_tensor=torch.zeros(n, 4, dtype=torch.int32),
                                   slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64))


def test_depth2_step_sees_its_own_requests():
    from ds4lab.vllm_plugin import metadata_ops, spec_decode_fix
    metadata_ops.install()           # torch token->request map (no Triton CPU backend)
    buf = torch.zeros(16, dtype=torch.int32)
    cad = _cad([0, 3, 6, 9, 12])     # verify batch: 4 requests x (k+1 = 3) tokens
    assert cad.token_to_req_indices(buf).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    # what SpecDecodeBaseProposer.propose does before depth 1: one token per request, in place
    cad.query_start_loc = torch.arange(5, dtype=torch.int32)
    cad.query_start_loc_cpu = cad.query_start_loc.clone()
    cad.num_actual_tokens = 4
    assert cad.token_to_req_indices(buf).tolist() == [0, 0, 0, 1]     # vLLM's stale map (the bug)
    spec_decode_fix.reset_step_caches(cad)
    assert cad.token_to_req_indices(buf).tolist() == [0, 1, 2, 3]
    # the installed wrapper resets before each step's update
    assert spec_decode_fix.install() in ([spec_decode_fix._TARGET], [])
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    assert getattr(SpecDecodeBaseProposer._update_positions_dependent_metadata, "_ds4lab_fix", False)
