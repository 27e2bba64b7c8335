"""The API key of a server that listens beyond loopback (vLLM's ``VLLM_API_KEY``).

vLLM's key (``--api-key`` / ``VLLM_API_KEY``, ``entrypoints/serve/middleware/authenticate.py``)
guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``: ``/health``, ``/metrics``,
``/ping``, ``/version``, ``/tokenize`` and ``/detokenize`` stay open to anyone who can reach the port.
The key lives in a file of mode 0600 (:func:`write_api_key`, created by the artefacts step); the
launcher reads it (:func:`read_api_key`) and hands it to vLLM through the environment, never in argv
(visible in ``ps``) or in the log.
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import stat

__all__ = ["is_loopback", "read_api_key", "write_api_key", "API_KEY_FILE"]

#: the key file's name inside an artefacts folder
API_KEY_FILE = "api-key"


def is_loopback(host: str) -> bool:
    """``host`` is reachable only from this machine (127.0.0.0/8, ::1, ``localhost``)."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False   # a host name or 0.0.0.0 / :: (every interface)


def read_api_key(path: str | os.PathLike) -> str:
    """The key in ``path``: ValueError naming the file when it is missing, empty, or readable by
    group or others (mode must be 0600 or stricter)."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise ValueError(f"api_key_file={p!r}: no such file (`ds4lab serve --artifacts DIR` writes "
                         f"DIR/{API_KEY_FILE} with mode 0600)") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"api_key_file={p!r}: mode {stat.S_IMODE(st.st_mode):04o} lets others read the key; "
                         f"chmod 600 {p}")
    with open(p) as f:
        key = f.read().strip()
    if not key:
        raise ValueError(f"api_key_file={p!r}: empty")
    return key


def write_api_key(path: str | os.PathLike) -> bool:
    """Create ``path`` with a new random key (``secrets.token_urlsafe(32)``), mode 0600 from the
    start (``os.open`` with ``O_EXCL``). An existing file is kept (a key already handed to clients);
    returns whether a new key was written."""
    try:
        fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return True
