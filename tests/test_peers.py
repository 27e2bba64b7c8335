"""ds4lab.harness.peers: the vLLM peer kernels load from the installed vLLM or a --peer-src copy."""
import pytest

from ds4lab.harness import peers


def test_installed_vllm_peers_load_as_jit_functions():
    for rel, name in (peers.VLLM_BLOCK_FP8, peers.VLLM_MOE_W4A16):
        k = peers.load_peer_jit(rel, name)
        # a triton.JITFunction (or the interpreter's stand-in under TRITON_INTERPRET=1) around the source
        assert k.fn.fn.__name__ == name and k.version.startswith("0.")


def test_copy_then_load_from_peer_src(tmp_path):
    files = peers.copy_source(tmp_path / "p")
    assert len(files) >= 2
    k = peers.load_peer_jit(*peers.VLLM_MOE_W4A16, peer_src=tmp_path / "p")
    assert str(tmp_path) in k.source
    # the helper it calls came along (transitive top-level references)
    assert "def write_zeros_to_output" in open(k.fn.fn.__code__.co_filename).read()


def test_missing_folder_and_missing_function_name_the_argument(tmp_path):
    with pytest.raises(peers.PeerUnavailable, match="peer_src="):
        peers.peer_root(tmp_path)
    peers.copy_source(tmp_path / "p")
    with pytest.raises(peers.PeerUnavailable, match="no top-level function 'nope'"):
        peers.load_peer_jit(peers.VLLM_BLOCK_FP8[0], "nope", peer_src=tmp_path / "p")


def test_env_var_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv(peers.ENV, str(tmp_path))
    with pytest.raises(peers.PeerUnavailable, match=str(tmp_path)):
        peers.peer_root()
