"""Offline HF-cache resolution, asked of huggingface_hub itself (never re-implemented).

vLLM 0.32 resolves an HF repo id offline with ``huggingface_hub.snapshot_download(repo_id,
revision=..., local_files_only=True, ignore_patterns="*")``
(``vllm/transformers_utils/repo_utils.py::get_model_path``). The hub reads ``refs/<revision>``
verbatim (no strip: a ``refs/main`` written by ``echo $SHA > refs/main`` names the folder
``snapshots/<sha>\\n``, which does not exist) and raises ``LocalEntryNotFoundError``. So "does it load
offline?" is answered by that same call (:func:`hub_resolution`), and ``config.json`` inside the
snapshot by ``huggingface_hub.try_to_load_from_cache``. ``scan_cache_dir`` warnings about the repo
(a ref naming a missing commit) are kept as evidence.

Used by ``ds4lab doctor`` (the ``hf-offline`` row), ``ds4lab serve``
(``serve.snapshot.resolve_hf_snapshot``) and the generated ``serve.sh``
(``"$PYTHON" -m ds4lab.hf_snapshot MODEL``: prints the snapshot folder, the note on stderr, exit 1
with the reason when there is none).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["HubResolution", "SnapshotError", "hub_resolution", "local_snapshot", "main"]


class SnapshotError(LookupError):
    """No usable local snapshot of the repo (not cached, or no snapshot with a ``config.json``)."""


@dataclass
class HubResolution:
    """What huggingface_hub makes of ``repo_id@revision`` in ``cache_dir`` with the network off.

    ``snapshot``: the folder ``snapshot_download(local_files_only=True)`` returns (what vLLM loads),
    else None and ``error`` holds the hub's exception (``"LocalEntryNotFoundError: ..."``);
    ``has_config``: ``try_to_load_from_cache(repo_id, "config.json")`` found the file there;
    ``ref_text``: the raw bytes-as-text of ``refs/<revision>`` (None without the file), for the
    diagnosis only; ``complete``: every ``snapshots/<sha>`` holding a ``config.json``;
    ``scan_warnings``: ``scan_cache_dir`` warnings naming this repo's folder."""
    repo_id: str
    revision: str
    cache_dir: Path
    repo_dir: Path
    cached: bool
    snapshot: Path | None = None
    has_config: bool = False
    error: str | None = None
    ref_text: str | None = None
    complete: dict[str, Path] = field(default_factory=dict)
    scan_warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """huggingface_hub (so vLLM) resolves it offline, and the snapshot has a config.json."""
        return self.snapshot is not None and self.has_config

    def diagnosis(self) -> str:
        """Why the hub does not resolve it, in one phrase (empty when :attr:`ok`)."""
        if self.ok:
            return ""
        if not self.cached:
            return f"{self.repo_id} is not in the cache {self.cache_dir}"
        ref = self.ref_text
        if self.snapshot is not None:
            return f"snapshot {self.snapshot.name} has no config.json (an incomplete download)"
        if ref is None:
            return f"no refs/{self.revision} and {self.revision!r} is not a snapshot on disk"
        if ref != ref.strip() and ref.strip() in self.complete:
            return (f"refs/{self.revision} holds {ref!r}: huggingface_hub reads it verbatim (no strip), so the "
                    f"trailing whitespace names a snapshot folder that does not exist")
        return f"refs/{self.revision} -> {ref.strip() or '(empty)'} is not on disk"


def hub_resolution(repo_id: str, revision: str = "main",
                   cache_dir: str | os.PathLike | None = None) -> HubResolution:
    """Ask huggingface_hub how ``repo_id@revision`` resolves offline in ``cache_dir`` (default: the
    hub's own ``HF_HUB_CACHE`` resolution). Never touches the network, never raises for a bad
    cache: the answer is in the returned :class:`HubResolution`."""
    from huggingface_hub import constants, scan_cache_dir, snapshot_download, try_to_load_from_cache
    from huggingface_hub.file_download import repo_folder_name

    cache = Path(os.path.expanduser(os.fspath(cache_dir))) if cache_dir else Path(constants.HF_HUB_CACHE)
    repo_dir = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    res = HubResolution(repo_id, revision, cache, repo_dir, cached=repo_dir.is_dir())
    if not res.cached:
        res.error = f"{repo_id} not in {cache}"
        return res
    ref_file = repo_dir / "refs" / revision
    if ref_file.is_file():
        res.ref_text = ref_file.read_text()
    for p in sorted((repo_dir / "snapshots").glob("*")):
        if (p / "config.json").is_file():
            res.complete[p.name] = p
    try:
        res.snapshot = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                              local_files_only=True, ignore_patterns="*"))
    except Exception as e:  # noqa: BLE001 - the hub's own verdict, reported
        res.error = f"{type(e).__name__}: {' '.join(str(e).split())}"
    else:
        cfg = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=revision)
        res.has_config = isinstance(cfg, str) and os.path.isfile(cfg)
    try:
        res.scan_warnings = [str(w) for w in scan_cache_dir(cache).warnings if str(repo_dir) in str(w)]
    except Exception as e:  # noqa: BLE001 - evidence only
        res.scan_warnings = [f"scan_cache_dir failed: {e!r}"]
    return res


def local_snapshot(repo_id: str, cache_dir: str | os.PathLike | None = None,
                   revision: str = "main") -> tuple[Path, str | None]:
    """The local snapshot folder to serve ``repo_id`` from offline, and a note when it is not the one
    huggingface_hub resolves.

    The hub's answer (:func:`hub_resolution`) is used when it resolves to a snapshot with a
    ``config.json`` (note None). Otherwise (a dangling ``refs/main``, one with a trailing newline, an
    incomplete snapshot) the newest complete snapshot is chosen and the note says why; pass that
    folder to vLLM as ``--model`` and the ref no longer matters. :class:`SnapshotError` when the repo
    is not cached or has no complete snapshot."""
    res = hub_resolution(repo_id, revision, cache_dir)
    if not res.cached:
        raise SnapshotError(f"{repo_id}: not in the HF cache {res.cache_dir} (offline; download it first "
                            f"with `hf download {repo_id}`)")
    if res.ok:
        return res.snapshot, None
    if not res.complete:
        ref = (res.ref_text or "").strip()
        raise SnapshotError(f"{repo_id}: no complete snapshot (with config.json) under "
                            f"{res.repo_dir / 'snapshots'}" + (f"; refs/{revision} -> {ref}" if ref else ""))
    newest = max(res.complete.values(), key=lambda p: (p / "config.json").stat().st_mtime)
    scan = f". HF cache scan: {' | '.join(res.scan_warnings)}" if res.scan_warnings else ""
    return newest, (f"{repo_id}: {res.diagnosis()}; using snapshot {newest.name} (newest complete of "
                    f"{len(res.complete)}){scan}")


def main(argv: list[str] | None = None) -> int:
    """``python -m ds4lab.hf_snapshot REPO_ID [--revision R] [--cache-dir D]``: the folder on stdout
    (a note on stderr when it is not the hub's own answer); exit 1 naming the reason otherwise."""
    p = argparse.ArgumentParser(prog="python -m ds4lab.hf_snapshot", description=main.__doc__.split(":")[0])
    p.add_argument("repo_id", help="HF repo id, e.g. deepseek-ai/DeepSeek-V4-Flash")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    p.add_argument("--cache-dir", default=None, help="hub cache folder (default: huggingface_hub's HF_HUB_CACHE)")
    a = p.parse_args(argv)
    try:
        snap, note = local_snapshot(a.repo_id, a.cache_dir, a.revision)
    except SnapshotError as e:
        print(f"ds4lab.hf_snapshot: {e}", file=sys.stderr)
        return 1
    if note:
        print(f"ds4lab.hf_snapshot: {note}", file=sys.stderr)
    print(snap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
