"""A server's log file: a new unique file per run, an incremental reader, and a size cap.

- :func:`new_log_path`: ``<dir>/ds4lab-serve-<profile>-<label>-XXXXXXXX.log`` by :func:`tempfile.mkstemp`,
  so concurrent runs never share, truncate or misread each other's log.
- :class:`LogTail`: reads what a running server appended, feeds whole lines to a parser, keeps the last N.
- :func:`cap_log`: keeps a log under ``cap`` bytes by dropping its middle: the head (how the server
  started) and the tail (what it does now) stay, with one marker line saying how much went. The
  server writes through an ``O_APPEND`` descriptor (the launcher opens the file ``"ab"``), so after
  the file is rewritten shorter its next write lands at the new end. A chatty or looping server once
  wrote 109 MB in a minute; the watchdog (:mod:`ds4lab.serve._watchdog`) calls this every 0.2 s for
  the server's whole life.
"""
from __future__ import annotations

import collections
import os
import tempfile
from pathlib import Path
from typing import Protocol

__all__ = ["new_log_path", "LogTail", "cap_log", "DEFAULT_LOG_CAP", "MARKER"]

#: default size cap of a server log (bytes); head and tail get half each
DEFAULT_LOG_CAP = 64 << 20
#: first bytes of the line that replaces a dropped middle
MARKER = b"[ds4lab: log capped: "


def new_log_path(profile: str, label: str, log_dir: str | os.PathLike | None = None) -> str:
    """A new, empty log file ``<log_dir>/ds4lab-serve-<profile>-<label>-XXXXXXXX.log`` created with
    :func:`tempfile.mkstemp` (``log_dir`` default: the system temp folder), so no other run can
    have the same name."""
    fd, path = tempfile.mkstemp(prefix=f"ds4lab-serve-{profile}-{label}-", suffix=".log", dir=log_dir)
    os.close(fd)
    return path


def cap_log(path: str | os.PathLike, cap: int = DEFAULT_LOG_CAP) -> int:
    """If ``path`` is over ``cap`` bytes, keep its first and last ``cap // 2`` bytes (cut at line
    ends) around one marker line naming the bytes dropped. Returns the bytes dropped (0: under the
    cap or unreadable). Bytes the server appends while this runs may be lost (the marker's count
    covers what was read)."""
    if cap < 4096:
        raise ValueError(f"cap={cap}: must be >= 4096 bytes")
    try:
        size = os.path.getsize(path)
        if size <= cap:
            return 0
        half = cap // 2
        with open(path, "r+b") as f:
            head = f.read(half)
            if MARKER in head:   # capped before: the old marker and what followed it go too
                head = head[: head.index(MARKER)]
            else:
                head = head[: head.rfind(b"\n") + 1 or len(head)]
            f.seek(max(size - half, len(head)))
            tail = f.read()
            nl = tail.find(b"\n")
            tail = tail[nl + 1:] if 0 <= nl < len(tail) - 1 else tail
            dropped = size - len(head) - len(tail)
            if not head.endswith(b"\n") and head:
                head += b"\n"
            f.seek(len(head))
            f.write(MARKER + f"{dropped} bytes of the middle dropped to stay under {cap} bytes]\n".encode()
                    + tail)
            f.truncate()
        return dropped
    except OSError:
        return 0


class _Parser(Protocol):
    def feed(self, line: str) -> None: ...


class LogTail:
    """Incremental reader of a growing log file: feeds whole lines to a parser, keeps the last N.
    A file that got shorter (capped by :func:`cap_log`) is re-read from its marker on."""

    def __init__(self, path: Path, parser: _Parser, keep: int = 200):
        self.path, self.parser = Path(path), parser
        self.pos = 0
        self.buf = b""
        self.last: collections.deque[str] = collections.deque(maxlen=keep)

    def poll(self, chunk_bytes: int = 8 << 20, max_chunks: int = 32) -> None:
        """Read what was appended since the last call (up to ``max_chunks`` x ``chunk_bytes``)."""
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.pos:   # capped meanwhile: continue after the marker line
                    head = f.read(min(size, DEFAULT_LOG_CAP))
                    i = head.find(MARKER)
                    self.pos = head.index(b"\n", i) + 1 if i >= 0 and b"\n" in head[i:] else size
                    self.buf = b""
                f.seek(self.pos)
                for _ in range(max_chunks):
                    chunk = f.read(chunk_bytes)
                    self.pos += len(chunk)
                    self._lines(chunk)
                    if len(chunk) < chunk_bytes:
                        break
        except OSError:
            return

    def _lines(self, chunk: bytes) -> None:
        data = self.buf + chunk
        lines = data.split(b"\n")
        self.buf = lines.pop()
        if len(self.buf) > 1 << 16:  # a giant line without newline: do not keep growing
            lines.append(self.buf)
            self.buf = b""
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            # tqdm bars use \r: the last state is what matters
            line = line.rsplit("\r", 1)[-1] if "\r" in line else line
            self.last.append(line)
            self.parser.feed(line)
