"""Offline HF snapshot resolution for ``ds4lab serve``: huggingface_hub's own resolution, through
:mod:`ds4lab.hf_snapshot` (shared with the doctor and ``serve.sh``)."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SnapshotError", "resolve_hf_snapshot"]


class SnapshotError(RuntimeError):
    """An HF repo id could not be resolved to a complete snapshot on disk (offline)."""



def resolve_hf_snapshot(repo_id: str, cache_dir: str | os.PathLike | None = None,
                        revision: str = "main") -> tuple[Path, str | None]:
    """The local snapshot folder of ``repo_id`` in the HF cache, never trusting a dangling ref.

    The snapshot huggingface_hub itself resolves offline (``snapshot_download(local_files_only=True)``,
    what vLLM's ``get_model_path`` calls) is used when it has a ``config.json``. Otherwise (a
    ``refs/main`` pointing at a snapshot never completed or deleted, or holding a trailing newline
    the hub does not strip) the newest complete snapshot is chosen and the returned note says so,
    with ``scan_cache_dir``'s warning about the repo. :class:`SnapshotError` when there is none.
    One implementation for serve, the doctor and ``serve.sh``: :func:`ds4lab.hf_snapshot.local_snapshot`.
    """
    from ds4lab import hf_snapshot

    try:
        return hf_snapshot.local_snapshot(repo_id, cache_dir, revision)
    except hf_snapshot.SnapshotError as e:
        raise SnapshotError(str(e)) from None


e_hf_snapshot(repo_id: str, cache_dir: str | os.PathLike | None = None,
                        revision: str = "main") -> tuple[Path, str | None]:
    """The local snapshot folder of ``repo_id`` in the HF cache, never trusting a dangling ref.

    ``refs/<revision>`` is used when the snapshot it names is on disk with a ``config.json``.
    Otherwise (a ``refs/main`` left pointing at a snapshot that was never completed or was
    deleted: HF offline mode would then fail or load a partial folder) the newest complete
    snapshot is chosen and the returned note says so. :class:`SnapshotError` when there is none.
    ``huggingface_hub.scan_cache_dir`` reports such a repo as corrupted ("Reference(s) refer to
    missing commit hashes") and drops it, so its warning is read too.
    """
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.file_download import repo_folder_name

    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    repo_path = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    if not repo_path.is_dir():
        raise SnapshotError(f"{repo_id}: not in the HF cache {cache} (offline; download it first "
                            f"with `hf download {repo_id}`)")
    complete: dict[str, Path] = {}
    note = None
    try:
        info = scan_cache_dir(cache)
        for repo in info.repos:
            if repo.repo_id == repo_id and repo.repo_type == "model":
                for rev in repo.revisions:
                    if (rev.snapshot_path / "config.json").is_file():
                        complete[rev.commit_hash] = rev.snapshot_path
        for w in info.warnings:
            if str(repo_path) in str(w):
                note = f"HF cache scan: {w}"
    except Exception as e:  # noqa: BLE001 - the manual listing below is authoritative
        note = f"HF cache scan failed ({e}); listed snapshots directly"
    if not complete:  # scan dropped the repo as corrupted: list the snapshots ourselves
        for p in sorted((repo_path / "snapshots").glob("*")):
            if (p / "config.json").is_file():
                complete[p.name] = p
    ref_file = repo_path / "refs" / revision
    ref = ref_file.read_text().strip() if ref_file.is_file() else None
    if ref and ref in complete:
        return complete[ref], None
    if not complete:
        raise SnapshotError(f"{repo_id}: no complete snapshot (with config.json) under "
                            f"{repo_path / 'snapshots'}" + (f"; refs/{revision} -> {ref}" if ref else ""))
    newest = max(complete.values(), key=lambda p: (p / "config.json").stat().st_mtime)
    why = (f"refs/{revision} -> {ref} is not on disk" if ref else f"no refs/{revision}")
    return newest, (f"{repo_id}: {why}; using snapshot {newest.name} (newest complete of "
                    f"{len(complete)})" + (f". {note}" if note else ""))

