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


def test_env_var_error_names_the_variable_and_the_vllm_folder_gets_a_hint(tmp_path, monkeypatch):
    monkeypatch.setenv(peers.ENV, str(tmp_path))
    with pytest.raises(peers.PeerUnavailable, match=r"\$DS4LAB_PEER_SRC="):
        peers.peer_root()
    monkeypatch.delenv(peers.ENV)
    peers.copy_source(tmp_path / "p")
    with pytest.raises(peers.PeerUnavailable, match="pass its parent"):
        peers.peer_root(tmp_path / "p" / "vllm")


def test_renamed_function_lists_the_files_jit_functions(tmp_path):
    peers.copy_source(tmp_path / "p")
    f = tmp_path / "p" / peers.VLLM_BLOCK_FP8[0]
    f.write_text(f.read_text().replace(peers.VLLM_BLOCK_FP8[1], "_w8a8_block_mm_v2"))
    with pytest.raises(peers.PeerUnavailable, match=r"@triton.jit functions: .*_w8a8_block_mm_v2.*--peer-src"):
        peers.load_peer_jit(*peers.VLLM_BLOCK_FP8, peer_src=tmp_path / "p")


def test_unwritable_cache_is_a_peer_error_naming_the_variable(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(peers.CACHE_ENV, str(tmp_path / "file" / "cache"))   # under a file: never writable
    with pytest.raises(peers.PeerUnavailable, match="DS4LAB_PEER_CACHE.*writable"):
        peers.load_peer_jit(*peers.VLLM_BLOCK_FP8)


def test_a_copy_without_version_file_is_not_labelled_with_the_installed_version(tmp_path):
    peers.copy_source(tmp_path / "p")
    (tmp_path / "p" / "vllm" / "_version.py").unlink()
    assert peers.load_peer_jit(*peers.VLLM_BLOCK_FP8, peer_src=tmp_path / "p").version == "unknown"
    assert peers.peer_version(peers.peer_root()) != "unknown"      # the installed package: its metadata


def test_cli_bad_peer_src_exits_2_before_any_gpu_work(tmp_path, capsys):
    from ds4lab.harness import bench, gemm_sweep, moe_bench
    import argparse
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    assert bench.main(ap.parse_args(["fp8_gemm_nt", "--peer-src", str(tmp_path)])) == 2
    assert gemm_sweep.main(["--peer-src", str(tmp_path)]) == 2
    assert moe_bench.main(["--peer-src", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("--peer-src: peer_src=") == 3 and "no 'vllm' folder" in err
    assert peers.main(["--copy-to", str(tmp_path / "f" / "x"), "--peer-src", str(tmp_path)]) == 2


def _fake_tree(root, body):
    f = root / "vllm" / peers.VLLM_BLOCK_FP8[0].split("vllm/", 1)[1]
    f.parent.mkdir(parents=True)
    f.write_text(body)
    return root


def test_a_name_imported_by_the_peer_file_is_refused_at_load_time(tmp_path):
    body = ("import triton\nfrom somewhere import helper\n\n@triton.jit\n"
            "def _w8a8_triton_block_scaled_mm(a, b):\n    x = helper(a)\n    return [y for y in (x, b)]\n")
    root = _fake_tree(tmp_path / "t", body)
    with pytest.raises(peers.PeerUnavailable, match="names defined outside its file \\(helper\\)"):
        peers.load_peer_jit(*peers.VLLM_BLOCK_FP8, peer_src=root)


def test_two_copies_of_one_source_share_one_cache_file(tmp_path, monkeypatch):
    monkeypatch.setenv(peers.CACHE_ENV, str(tmp_path / "cache"))
    a = peers.load_peer_jit(*peers.VLLM_MOE_W4A16, peer_src=peers.copy_source(tmp_path / "a") and tmp_path / "a")
    b = peers.load_peer_jit(*peers.VLLM_MOE_W4A16, peer_src=peers.copy_source(tmp_path / "b") and tmp_path / "b")
    assert a.source != b.source
    assert len(list((tmp_path / "cache").glob("*.py"))) == 1
