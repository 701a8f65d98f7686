"""One process per session: an exclusive lock on the session's transcript.

Two agents appending to one transcript interleave their records into a history that pairs
nowhere, and a session resumed by two processes at once would decide its results twice. The
lock is ``flock`` on the transcript file itself -- wherever it lives and whatever store root a
process was given -- released by the kernel when the process dies, so a crash never leaves a
session locked.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["SessionBusyError", "session_lock"]


class SessionBusyError(RuntimeError):
    """Another process holds the session's lock."""


@contextmanager
def session_lock(transcript: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the exclusive lock of the session whose transcript is ``transcript`` for the
    ``with`` block; :class:`SessionBusyError` at once when another process holds it (no
    waiting). Creates the transcript (empty, 0600) and its directory (0700) if missing; refuses
    (``OSError``) a transcript or directory that is a symlink, as the transcript writer does.

    Where ``fcntl`` does not exist (Windows) no lock is taken.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        yield
        return
    path = Path(transcript)
    directory = path.parent
    if directory.is_symlink():
        raise OSError(f"{directory} is a symlink: refused for a session directory")
    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the store root: private
    directory.mkdir(mode=0o700, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SessionBusyError(f"the session of {path} is in use by another process") from None
        yield
    finally:
        os.close(fd)  # closing releases the lock
