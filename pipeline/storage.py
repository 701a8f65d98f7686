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
from pathlib import Path
from typing import Protocol, runtime_checkable

import anyio.to_thread

__all__ = [
    "FileToolResultStore",
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


class FileToolResultStore:
    """Persisted tool results as files under ``<root>/<session_id>/tool-results/``."""

    def __init__(self, root: str | os.PathLike[str], session_id: str) -> None:
        self.root = Path(root)
        self.session_id = validate_session_id(session_id)
        self.directory = self.root / self.session_id / TOOL_RESULTS_SUBDIR

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
    def _ensure_directory(self) -> None:
        os.makedirs(self.root, 0o700, exist_ok=True)
        for d in (self.root / self.session_id, self.directory):
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, 0o700)
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                # a symlink planted in place of a store directory would redirect our writes
                raise StoreError(errno.ENOTDIR, "store directory is not a real directory", str(d))

    def _write(self, target: Path, data: bytes) -> None:
        self._ensure_directory()
        if self._exists_as_file(target):
            return
        tmp = target.with_name(f".tmp-{secrets.token_hex(8)}-{target.name}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, target)
            except FileExistsError:
                if not self._exists_as_file(target):
                    raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    @staticmethod
    def _exists_as_file(target: Path) -> bool:
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            raise StoreError(errno.EEXIST, "a non-file is in the way of a result", str(target))
        return True
