"""One process per session: an exclusive lock on the session directory.

Two agents appending to one transcript interleave their records into a history that pairs
nowhere, and a session resumed by two processes at once would decide its results twice. The
lock is ``flock`` on ``<session dir>/.lock``: released by the kernel when the process dies, so a
crash never leaves a session locked.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["SessionBusyError", "session_lock"]

LOCK_NAME = ".lock"


class SessionBusyError(RuntimeError):
    """Another process holds the session's lock."""


@contextmanager
def session_lock(session_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the session's exclusive lock for the ``with`` block; :class:`SessionBusyError` at
    once when another process holds it (no waiting). Creates the directory and its parent
    (0700) if needed.

    Where ``fcntl`` does not exist (Windows) no lock is taken.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        yield
        return
    directory = Path(session_dir)
    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the store root: private
    directory.mkdir(mode=0o700, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(directory / LOCK_NAME, flags, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SessionBusyError(
                f"session {directory.name!r} is in use by another process"
            ) from None
        yield
    finally:
        os.close(fd)  # closing releases the lock
