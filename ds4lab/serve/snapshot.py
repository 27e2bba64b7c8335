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
