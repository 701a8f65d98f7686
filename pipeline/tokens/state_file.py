"""A tracker's saved state on disk: where it lives, written atomically, read defensively."""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import stat
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.logs import get_logger

__all__ = [
    "CALIBRATION_FILE",
    "MAX_STATE_BYTES",
    "calibration_path_for",
    "decode_state",
    "encode_state",
    "read_state_file",
    "rewrite_state",
    "write_state",
]

CALIBRATION_FILE = "token-calibration.json"
MAX_STATE_BYTES = 64 * 1024 * 1024
"""A calibration file larger than this is not read (a real one is a few KB, or a few MB with
a very large error window)."""


def calibration_path_for(
    root: str | os.PathLike[str], session_id: str, agent_id: str | None = None
) -> Path:
    """Where a session's tracker state lives: ``<root>/<session>/token-calibration.json``
    (``token-calibration-<agent_id>.json`` for a sub-agent, which has its own tracker)."""
    if agent_id is None:
        return Path(root) / session_id / CALIBRATION_FILE
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", agent_id)  # an id is never a path
    return Path(root) / session_id / f"token-calibration-{safe}.json"


CHECK_KEY = "check"
"""The state's first field: the CRC-32 of its JSON text without it, as 8 hex digits."""
_CHECKED = b'{"check":"'
"""How every checked state begins: a file rewritten in place over one is the same there, so a
read in the middle of the write meets the old check or the new one, never neither."""


def encode_state(state: Mapping[str, Any]) -> bytes:
    """``state`` as compact JSON, its check first (:data:`CHECK_KEY`): a file read while
    another process writes it in place (:func:`rewrite_state`), partly old and partly new but
    valid JSON, is told from either. (A release before states carried a check refuses the key:
    a state written here loads there as a cold start.)"""
    if CHECK_KEY in state:
        raise ValueError(f"a state may not hold the key {CHECK_KEY!r}")
    data = json.dumps(state, separators=(",", ":")).encode("utf-8")
    if not data.startswith(b"{") or data == b"{}":
        return data
    return _CHECKED + f'{zlib.crc32(data):08x}",'.encode() + data[1:]


def decode_state(data: bytes) -> Any:
    """The state in ``data`` (:func:`encode_state`'s bytes, padded with spaces or not);
    ``ValueError`` when it is not JSON or its check does not match its text (written by two
    writers at once, or read in the middle of a write). A state saved before states carried a
    check (one that does not begin with it) is read as it is."""
    state = json.loads(data)
    if not data.startswith(_CHECKED):
        if isinstance(state, dict) and CHECK_KEY in state:
            raise ValueError(f"{CHECK_KEY!r} is not the state's first field")
        return state
    check = state.pop(CHECK_KEY)
    text = json.dumps(state, separators=(",", ":")).encode("utf-8")
    if not isinstance(check, str) or check != f"{zlib.crc32(text):08x}":
        raise ValueError("its check does not match its text (read while it was rewritten?)")
    return state


def write_state(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    durable: bool = True,
    parents: bool = True,
) -> bool:
    """Write ``state`` as JSON to ``path`` atomically (temp file, fsync, rename); False, and a
    warning logged, when it cannot. ``durable=False``: no fsync (still atomic for readers and
    a crash of the process; a machine losing power may leave the old state or none, which a
    load reads as a cold start). ``parents=False``: a directory gone meanwhile (its
    conversation removed) is not made again: False, and nothing written or logged."""
    target = Path(path)
    if not parents and not target.parent.is_dir():
        return False
    data = encode_state(state)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    try:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            # 0600 like the transcript: the state names the session's models and sizes;
            # O_EXCL|O_NOFOLLOW: never through a planted file or link
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, target)  # readers see the old state or the new, never half
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        get_logger().warning("token_calibration.save_failed", path=str(target), error=str(exc))
        return False
    return True


PAD_LIMIT = 64 * 1024
"""A state rewritten in place over a longer one is padded with spaces up to this many bytes
(the file stays valid JSON at every moment); past it, the file is cut to the new length."""


def rewrite_state(path: str | os.PathLike[str], state: Mapping[str, Any]) -> bool | None:
    """Write ``state`` over the file at ``path`` in place: no new directory entry, no fsync.
    None when there is no file of its own there to write over -- none, or one that is not a
    regular file with one name (a link or a FIFO planted there, a hard link): the caller
    writes it anew with :func:`write_state`, which replaces what is there. False, a warning
    logged, when the write fails.

    For a writer that must leave nothing behind once it returns (``wrap``'s caller: a program
    that removes its root right after a call). A longer old state is padded over with spaces
    (JSON ignores them): a crash, or a reader in another process at that very moment, sees
    the old state, the new one, or, at worst, a mix, whose check (:func:`encode_state`) fails:
    a load reads it as a cold start."""
    data = encode_state(state)
    target = os.fspath(path)
    try:
        # O_NOFOLLOW: a link is never written through; O_NONBLOCK: a FIFO never blocks
        fd = os.open(target, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link, a FIFO nobody reads
            return None
        get_logger().warning("token_calibration.save_failed", path=target, error=str(exc))
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return None
        gap = st.st_size - len(data)
        if 0 < gap <= PAD_LIMIT:
            data += b" " * gap
        view = memoryview(data)
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], written)
        if gap > PAD_LIMIT:
            os.ftruncate(fd, len(data))
    except OSError as exc:
        get_logger().warning("token_calibration.save_failed", path=target, error=str(exc))
        return False
    finally:
        os.close(fd)
    return True


def read_state_file(path: Path) -> bytes:
    """The bytes of a calibration file; ``ValueError`` when it is not a regular file of at
    most :data:`MAX_STATE_BYTES` (a FIFO would block the resume, ``/dev/zero`` never ends)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = f.read(MAX_STATE_BYTES + 1)
    if len(data) > MAX_STATE_BYTES:
        raise ValueError(f"larger than {MAX_STATE_BYTES} bytes")
    return data
