"""The operating-system calls the file store makes, as a seam: :class:`FileOps` and the real
:class:`OsFileOps` (tests put a fault at each step of one persist through it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

__all__ = ["FileOps", "OsFileOps"]


class FileOps(Protocol):
    """The operating-system calls one persist makes.

    In the usual order: ``makedirs`` (the root), ``mkdir`` (the session, then its
    ``tool-results``), ``lstat`` (each directory), ``listdir`` and ``lstat``/``unlink`` of
    stale temp files (once per store), ``lstat`` (the target), ``open`` (a private temp file),
    ``write`` (until all is written), ``fsync``, ``close``, ``link`` (temp to target),
    ``unlink`` (the temp). Only when something is already there: ``open``, ``fstat``,
    ``read`` and ``close`` of the existing target (its bytes are compared), and for a store
    directory with group or other permission bits ``open``, ``fstat``, ``fchmod``, ``close``.

    The store asks for one object per persist (``file_ops=`` takes ``target -> FileOps``), so
    a wrapper knows which result each call serves: that is how the tests put a fault at each
    step of one persist while its neighbours succeed.
    """

    def makedirs(self, path: Path, mode: int) -> None:
        """``os.makedirs(path, mode, exist_ok=True)``."""
        ...

    def mkdir(self, path: Path, mode: int) -> None:
        """``os.mkdir``."""
        ...

    def lstat(self, path: Path) -> os.stat_result:
        """``os.lstat``."""
        ...

    def listdir(self, path: Path) -> list[str]:
        """``os.listdir``."""
        ...

    def open(self, path: Path, flags: int, mode: int) -> int:
        """``os.open``."""
        ...

    def fstat(self, fd: int) -> os.stat_result:
        """``os.fstat``."""
        ...

    def fchmod(self, fd: int, mode: int) -> None:
        """``os.fchmod``."""
        ...

    def read(self, fd: int, size: int) -> bytes:
        """``os.read``: at most ``size`` bytes, empty at the end of the file."""
        ...

    def write(self, fd: int, data: memoryview) -> int:
        """``os.write``: how many bytes were written."""
        ...

    def fsync(self, fd: int) -> None:
        """``os.fsync``."""
        ...

    def close(self, fd: int) -> None:
        """``os.close``."""
        ...

    def link(self, src: Path, dst: Path) -> None:
        """``os.link``."""
        ...

    def unlink(self, path: Path) -> None:
        """``os.unlink``."""
        ...


class OsFileOps:
    """:class:`FileOps` on the real file system."""

    def makedirs(self, path: Path, mode: int) -> None:
        os.makedirs(path, mode, exist_ok=True)

    def mkdir(self, path: Path, mode: int) -> None:
        os.mkdir(path, mode)

    def lstat(self, path: Path) -> os.stat_result:
        return os.lstat(path)

    def listdir(self, path: Path) -> list[str]:
        return os.listdir(path)

    def open(self, path: Path, flags: int, mode: int) -> int:
        return os.open(path, flags, mode)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def fchmod(self, fd: int, mode: int) -> None:
        os.fchmod(fd, mode)

    def read(self, fd: int, size: int) -> bytes:
        return os.read(fd, size)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def link(self, src: Path, dst: Path) -> None:
        os.link(src, dst)

    def unlink(self, path: Path) -> None:
        os.unlink(path)
