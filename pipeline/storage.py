"""Where persisted tool results live: a one-method protocol and the local file store.

The file store writes ``<root>/<session>/tool-results/<id>.<ext>``: created exclusively (an
existing file for the id counts as success: same id ⇒ same content), via a private temp file that
is hard-linked into place, so a crash never leaves a partial file under a final name. Files are
0600, directories 0700. A tool_use_id outside ``[A-Za-z0-9_-]{1,128}`` never reaches the file
system as is: it is mapped to ``unsafe.<sha256>``, which no safe id can equal.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import anyio.to_thread

__all__ = [
    "FileOps",
    "FileToolResultStore",
    "OsFileOps",
    "StoreError",
    "ToolResultStore",
    "safe_file_stem",
    "validate_session_id",
]

TOOL_RESULTS_SUBDIR = "tool-results"
_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_SAFE_SESSION = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class StoreError(OSError):
    """A persist that did not happen; the caller keeps the original content."""


@runtime_checkable
class ToolResultStore(Protocol):
    """Somewhere to put a tool result the model will not see whole."""

    async def persist(self, tool_use_id: str, text: str, ext: str) -> str:
        """Store ``text`` for ``tool_use_id`` and return the path the model can read it back by.

        ``ext`` is ``"txt"`` or ``"json"``. Storing the same id twice must succeed and keep the
        first copy. Raise (any exception) when it was not stored.
        """
        ...


def safe_file_stem(tool_use_id: str) -> str:
    """The file name stem for an id: the id itself when safe, else ``unsafe.<sha256 hex>``."""
    if _SAFE_ID.fullmatch(tool_use_id):
        return tool_use_id
    digest = hashlib.sha256(tool_use_id.encode("utf-8", errors="surrogatepass")).hexdigest()
    return f"unsafe.{digest}"


def validate_session_id(session_id: str) -> str:
    """A session id becomes a directory name: refuse anything path-like."""
    if (
        not isinstance(session_id, str)
        or not _SAFE_SESSION.fullmatch(session_id)
        or session_id in (".", "..")
    ):
        raise ValueError(
            f"session_id must match [A-Za-z0-9_.-]{{1,128}} and not be '.' or '..', "
            f"got {session_id!r}"
        )
    return session_id


class FileOps(Protocol):
    """The operating-system calls one persist makes, in this order: ``makedirs`` (the root),
    ``mkdir`` (the session, then its ``tool-results``), ``lstat`` (each directory, then the
    target), ``open`` (a private temp file), ``write`` (until all is written), ``fsync``,
    ``close``, ``link`` (temp to target), ``unlink`` (the temp).

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

    def open(self, path: Path, flags: int, mode: int) -> int:
        """``os.open``."""
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

    def open(self, path: Path, flags: int, mode: int) -> int:
        return os.open(path, flags, mode)

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


_OS = OsFileOps()


class FileToolResultStore:
    """Persisted tool results as files under ``<root>/<session_id>/tool-results/``.

    ``file_ops``: the file operations each persist uses, given its target path (default: the
    real ones); see :class:`FileOps`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        session_id: str,
        *,
        file_ops: Callable[[Path], FileOps] | None = None,
    ) -> None:
        self.root = Path(root)
        self.session_id = validate_session_id(session_id)
        self.directory = self.root / self.session_id / TOOL_RESULTS_SUBDIR
        self._file_ops: Callable[[Path], FileOps] = file_ops or (lambda _target: _OS)

    def path_for(self, tool_use_id: str, ext: str) -> Path:
        """Where the result of ``tool_use_id`` goes."""
        if ext not in ("txt", "json"):
            raise ValueError(f"unsupported extension {ext!r}")
        return self.directory / f"{safe_file_stem(tool_use_id)}.{ext}"

    async def persist(self, tool_use_id: str, text: str, ext: str) -> str:
        """Write ``text`` (UTF-8) exclusively and atomically; return the absolute path."""
        target = self.path_for(tool_use_id, ext)
        data = text.encode("utf-8", errors="surrogatepass")
        await anyio.to_thread.run_sync(self._write, target, data)
        return str(target.absolute())

    # -- blocking part, run in a worker thread ----------------------------------------------
    def _ensure_directory(self, ops: FileOps) -> None:
        ops.makedirs(self.root, 0o700)
        for d in (self.root / self.session_id, self.directory):
            with contextlib.suppress(FileExistsError):
                ops.mkdir(d, 0o700)
            if not stat.S_ISDIR(ops.lstat(d).st_mode):
                # a symlink planted in place of a store directory would redirect our writes
                raise StoreError(errno.ENOTDIR, "store directory is not a real directory", str(d))

    def _write(self, target: Path, data: bytes) -> None:
        ops = self._file_ops(target)
        self._ensure_directory(ops)
        if _exists_as_file(ops, target):
            return
        tmp = target.with_name(f".tmp-{secrets.token_hex(8)}-{target.name}")
        fd = ops.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            try:
                view = memoryview(data)
                while view:
                    written = ops.write(fd, view)
                    view = view[written:]
                ops.fsync(fd)
            finally:
                ops.close(fd)
            try:
                ops.link(tmp, target)
            except FileExistsError:
                if not _exists_as_file(ops, target):
                    raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                ops.unlink(tmp)


def _exists_as_file(ops: FileOps, target: Path) -> bool:
    try:
        st = ops.lstat(target)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(errno.EEXIST, "a non-file is in the way of a result", str(target))
    return True
