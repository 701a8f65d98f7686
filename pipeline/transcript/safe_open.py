"""Opening a transcript without following a symbolic link (:func:`open_transcript`): its
directory opened first, without following one, and the file relative to it, so that no link
at either place is ever followed, even one planted between two appends."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

__all__ = ["TranscriptPathError", "open_to_append", "open_transcript"]


class TranscriptPathError(OSError):
    """The transcript cannot be written safely where it was asked for: the file or its
    directory is a symbolic link, or not a regular file / a real directory. Nothing is written
    there (following a planted link would append the conversation to another file)."""


def open_to_append(path: Path) -> int:
    """:func:`open_transcript` to append, the file and its directories made if missing."""
    return open_transcript(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)


def _make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and any missing parent 0700 (``Path.mkdir(parents=True)`` would
    give the parents the default mode, 0755 under the usual umask)."""
    missing: list[Path] = []
    d = directory
    while not os.path.lexists(d) and d != d.parent:
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        # made meanwhile (another writer): what it is gets checked on opening it
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)


def open_transcript(path: Path, flags: int) -> int:
    """A descriptor for the transcript at ``path``, opened relative to its directory, which
    itself is opened without following a link: no symbolic link at either place is ever
    followed, even one planted between two appends. ``O_CREAT`` in ``flags`` creates what is
    missing (the file 0600, directories 0700)."""
    directory = path.parent
    if flags & os.O_CREAT:
        _make_private_dirs(directory)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise TranscriptPathError(
                errno.ENOTDIR,
                "refusing the transcript's directory: it is a symbolic link or not a directory "
                "(give the real path)",
                str(directory),
            ) from None
        raise
    try:
        fd = os.open(
            path.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
        )
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TranscriptPathError(
                errno.ELOOP,
                "refusing to write the transcript through a symbolic link (give the real path)",
                str(path),
            ) from None
        raise
    finally:
        os.close(dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise TranscriptPathError(errno.EINVAL, "the transcript is not a regular file", str(path))
    os.set_blocking(fd, True)
    return fd
