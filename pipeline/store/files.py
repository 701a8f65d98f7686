"""Where persisted tool results live: a one-method protocol and the local file store.

The file store writes ``<root>/<session>/tool-results/<id>.<ext>`` via a private temp file that
is hard-linked into place, so a crash never leaves a partial file under a final name. Files are
0600, directories 0700. A tool_use_id outside ``[A-Za-z0-9_-]{1,128}``, or one that Windows
reserves as a device name (``CON``, ``nul``, ``COM1``, ...), never reaches the file system as
is: it is mapped to ``unsafe.<sha256>``, which no safe id can equal.

An existing file under the name is reused only when it provably holds the same bytes (see
:class:`FileToolResultStore`); anything else there sends the content to a distinct name,
``<stem>.<12 hex of its sha256>.<ext>``, so the returned path always holds what was persisted.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import anyio.to_thread

from pipeline.store.fileops import FileOps, OsFileOps

__all__ = [
    "STALE_TEMP_SECONDS",
    "STORE_COOL_DOWN",
    "FileOps",
    "FileToolResultStore",
    "OsFileOps",
    "StoreError",
    "ToolResultStore",
    "is_result_key",
    "safe_file_stem",
    "validate_session_id",
]

TOOL_RESULTS_SUBDIR = "tool-results"
_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_SAFE_SESSION = re.compile(r"[A-Za-z0-9_.-]{1,128}")

# Device names Windows resolves in every directory, whatever the case or extension: a file
# called ``con.txt`` there opens the console. COM0/LPT0 are on Microsoft's current list too.
_WINDOWS_RESERVED = frozenset(
    {"CON", "PRN", "AUX", "NUL"} | {f"{dev}{n}" for dev in ("COM", "LPT") for n in range(10)}
)

STALE_TEMP_SECONDS = 24 * 60 * 60
"""A ``.tmp-*`` file in ``tool-results`` untouched for this long is removed whoever wrote it."""

# .tmp-<pid: 8 hex><host tag: 4 hex><random: 4 hex>-<final name>: the writer's pid and where
# it ran, so a later store can tell a crashed writer's leftovers from a live writer's file.
_TEMP_NAME = re.compile(r"\.tmp-([0-9a-f]{8})([0-9a-f]{4})([0-9a-f]{4})-(.+)")
_TEMP_ATTEMPTS = 16
_READ_CHUNK = 1 << 20
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


STORE_COOL_DOWN = 15.0
"""Seconds an object store that failed is not asked again (then one call probes it): see
:mod:`pipeline.store.breaker`."""


class StoreError(OSError):
    """A persist that did not happen; the caller keeps the original content."""


@runtime_checkable
class ToolResultStore(Protocol):
    """Somewhere to put a tool result the model will not see whole."""

    async def persist(self, tool_use_id: str, text: str, ext: str) -> str:
        """Store ``text`` for ``tool_use_id`` and return the path the model can read it back by.

        ``ext`` is ``"txt"`` or ``"json"``. The path returned must hold exactly ``text``;
        storing the same id and text twice must succeed and should return the same path.
        Raise (any exception) when it was not stored.
        """
        ...


def safe_file_stem(tool_use_id: str) -> str:
    """The file name stem for an id: the id itself when safe, else ``unsafe.<sha256 hex>``.

    Safe: ``[A-Za-z0-9_-]{1,128}`` and not a Windows device name (``CON``, ``aux``, ``COM1``,
    ...), which would open a device there instead of a file.
    """
    if _SAFE_ID.fullmatch(tool_use_id) and tool_use_id.upper() not in _WINDOWS_RESERVED:
        return tool_use_id
    digest = hashlib.sha256(tool_use_id.encode("utf-8", errors="surrogatepass")).hexdigest()
    return f"unsafe.{digest}"


RESULT_NAME = re.compile(
    r"(?:[A-Za-z0-9_-]{1,128}|unsafe\.[0-9a-f]{64})(?:\.[0-9a-f]{12})?\.(?:txt|json)"
)
"""Every name a result store gives a result (:func:`safe_file_stem`, the content's digest
when it goes by that, the extension), and nothing else."""


def is_result_key(key: str) -> bool:
    """Whether an object ``key`` names a tool result: ``.../tool-results/<a result's name>``."""
    head, _, name = key.rpartition("/")
    return head.rpartition("/")[2] == TOOL_RESULTS_SUBDIR and bool(RESULT_NAME.fullmatch(name))


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


_OS = OsFileOps()


class FileToolResultStore:
    """Persisted tool results as files under ``<root>/<session_id>/tool-results/``.

    ``file_ops``: the file operations each persist uses, given its target path (default: the
    real ones); see :class:`FileOps`. ``content_named``: every result goes to its content's
    name, ``<stem>.<first 12 hex of its sha256>.<ext>``, never to ``<stem>.<ext>``: a name
    then only ever holds one content, also once retention has removed it and another result
    with the id comes (a store several conversations share, where ids repeat).

    What is already on disk is checked, not trusted:

    - The session directory and ``tool-results`` must be real directories owned by this
      user; group and other permission bits found on them are removed (0777 becomes 0700).
      A symlink, a non-directory or another user's directory fails the persist
      (:class:`StoreError`).
    - A file already under the result's name is reused, byte for byte (its modification time
      refreshed, so that retention counts from the last use), only
      when it is a regular file owned by this user, has no other hard link (apart from the
      temp-file name of a writer that has linked it and not yet removed that name) and
      holds exactly the bytes being persisted. Any other file there (different content, a
      stale run, another session sharing the root, a planted file, a hard link to a file
      elsewhere, a name a case-insensitive file system folds onto another id's) is left
      alone and the content goes to ``<stem>.<first 12 hex of its sha256>.<ext>`` instead,
      checked the same way; a mismatch there too fails the persist. Persisting the same
      id and content again (a resumed session, a replay) thus finds the same path, and the
      returned path always holds exactly the persisted bytes.
    - A symlink, directory, FIFO or other non-file under the name fails the persist.
    - Temp files of crashed writers are removed on the store's first persist (or by
      :meth:`remove_stale_temps`): those whose writer process, on this host, is gone, and
      any untouched for :data:`STALE_TEMP_SECONDS`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        session_id: str,
        *,
        file_ops: Callable[[Path], FileOps] | None = None,
        content_named: bool = False,
    ) -> None:
        self.root = Path(root)
        self.session_id = validate_session_id(session_id)
        self.content_named = content_named
        self.directory = self.root / self.session_id / TOOL_RESULTS_SUBDIR
        self._file_ops: Callable[[Path], FileOps] = file_ops or (lambda _target: _OS)
        self._swept = False
        self._sweep_lock = threading.Lock()

    def path_for(self, tool_use_id: str, ext: str) -> Path:
        """Where the result of ``tool_use_id`` goes when nothing else is in the way."""
        if ext not in ("txt", "json"):
            raise ValueError(f"unsupported extension {ext!r}")
        return self.directory / f"{safe_file_stem(tool_use_id)}.{ext}"

    async def persist(self, tool_use_id: str, text: str, ext: str) -> str:
        """Write ``text`` (UTF-8) atomically; return the absolute path that holds it.

        That is :meth:`path_for`, or the content-named alternative when a different file is
        already there (see the class docstring).
        """
        target = self.path_for(tool_use_id, ext)
        data = text.encode("utf-8", errors="surrogatepass")
        final = await anyio.to_thread.run_sync(self._write, target, data)
        return str(final.absolute())

    def remove_stale_temps(self) -> list[Path]:
        """Remove temp files crashed writers left in ``tool-results``; return what went.

        A temp file goes when the process that wrote it (its pid and host are in its name)
        is no longer running on this host, or when it has not been modified for
        :data:`STALE_TEMP_SECONDS`. A live writer's temp file is never removed while it is
        younger than that; should one go anyway (another host with the same tag, a writer
        stuck for a day), its link fails and that persist fails cleanly: removing a temp file
        never puts wrong content under a final name. Errors are ignored (best effort).
        Blocking file I/O: from async code, call it in a worker thread.
        """
        ops = self._file_ops(self.directory)
        return self._sweep(ops)

    # -- blocking part, run in a worker thread ----------------------------------------------
    def _ensure_directory(self, ops: FileOps) -> None:
        ops.makedirs(self.root, 0o700)
        for d in (self.root / self.session_id, self.directory):
            with contextlib.suppress(FileExistsError):
                ops.mkdir(d, 0o700)
            st = ops.lstat(d)
            if not stat.S_ISDIR(st.st_mode):
                # a symlink planted in place of a store directory would redirect our writes
                raise StoreError(errno.ENOTDIR, "store directory is not a real directory", str(d))
            if not _owned(st):
                # its owner can read, replace or plant results whatever mode we would set
                raise StoreError(errno.EPERM, "store directory belongs to another user", str(d))
            if stat.S_IMODE(st.st_mode) & ~0o700:
                _tighten_directory(ops, d, st)

    def _write(self, target: Path, data: bytes) -> Path:
        ops = self._file_ops(target)
        self._ensure_directory(ops)
        self._sweep_once(ops)
        if not self.content_named and self._place(ops, target, data):
            return target
        digest = hashlib.sha256(data).hexdigest()[:12]
        stem, ext = target.name.rsplit(".", 1)
        distinct = target.with_name(f"{stem}.{digest}.{ext}")
        if self._place(ops, distinct, data):
            return distinct
        raise StoreError(
            errno.EEXIST, "different files hold both names for this result", str(distinct)
        )

    def _place(self, ops: FileOps, target: Path, data: bytes) -> bool:
        """Make ``target`` hold ``data``: True when it does, False when another file is there."""
        held = _holds(ops, target, data)
        if held:
            # reused: retention counts age from the last use, not the first write
            with contextlib.suppress(OSError):
                os.utime(target, follow_symlinks=False)
        if held is not None:
            return held
        tmp, fd = _open_temp(ops, target)
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
                # another writer got there first: its file counts only if it holds our bytes
                held = _holds(ops, target, data)
                if held is None:
                    raise
                return held
        finally:
            with contextlib.suppress(FileNotFoundError):
                ops.unlink(tmp)
        return True

    def _sweep_once(self, ops: FileOps) -> None:
        # once per store object: a directory listing per persist would cost too much
        with self._sweep_lock:
            if self._swept:
                return
            self._swept = True
        self._sweep(ops)

    def _sweep(self, ops: FileOps) -> list[Path]:
        removed: list[Path] = []
        try:
            names = ops.listdir(self.directory)
        except OSError:
            return removed
        now = time.time()
        for name in names:
            match = _TEMP_NAME.fullmatch(name)
            if match is None:
                continue
            path = self.directory / name
            try:
                st = ops.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    continue
                pid, tag = int(match[1], 16), int(match[2], 16)
                writer_gone = pid > 0 and tag == _host_tag() and not _pid_alive(pid)
                if writer_gone or now - st.st_mtime > STALE_TEMP_SECONDS:
                    ops.unlink(path)
                    removed.append(path)
            except OSError:
                continue
        return removed


def _owned(st: os.stat_result) -> bool:
    return not hasattr(os, "geteuid") or st.st_uid == os.geteuid()


def _tighten_directory(ops: FileOps, d: Path, st: os.stat_result) -> None:
    # through a descriptor opened without following symlinks: a chmod by path could be sent
    # to wherever a symlink swapped in since the lstat points
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | _O_CLOEXEC
    fd = ops.open(d, flags, 0)
    try:
        fst = ops.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or not _owned(fst):
            raise StoreError(errno.EAGAIN, "store directory changed while checked", str(d))
        ops.fchmod(fd, stat.S_IMODE(fst.st_mode) & 0o700)
    finally:
        ops.close(fd)


def _open_temp(ops: FileOps, target: Path) -> tuple[Path, int]:
    """A new private temp file next to ``target``, named after the writer (see ``_TEMP_NAME``)."""
    pid = os.getpid()
    pid_field = pid if 0 < pid <= 0xFFFFFFFF else 0  # 0: unknown writer, removed by age only
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC  # not to children
    for attempt in range(_TEMP_ATTEMPTS):
        token = f"{pid_field:08x}{_host_tag():04x}{secrets.randbits(16):04x}"
        tmp = target.with_name(f".tmp-{token}-{target.name}")
        try:
            return tmp, ops.open(tmp, flags, 0o600)
        except FileExistsError:
            # 16 random bits: a parallel persist of the same name, or a leftover of an
            # earlier process with our pid, may hold this one; draw again
            if attempt == _TEMP_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _holds(ops: FileOps, target: Path, data: bytes) -> bool | None:
    """None: nothing at ``target``. True: a file we can trust holds exactly ``data``. False:
    another file is there. A non-file there raises :class:`StoreError`."""
    try:
        st = ops.lstat(target)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(errno.EEXIST, "a non-file is in the way of a result", str(target))
    if not _owned(st) or st.st_size != len(data):
        return False
    # O_NONBLOCK: should a FIFO be swapped in after the lstat, the open must not wait for
    # a writer; O_NOFOLLOW: nor may a swapped-in symlink be followed
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | _O_CLOEXEC
    try:
        fd = ops.open(target, flags, 0)
    except FileNotFoundError:
        return None
    except PermissionError:
        return False  # a file we cannot read cannot be read back either
    try:
        fst = ops.fstat(fd)
        if not stat.S_ISREG(fst.st_mode):
            raise StoreError(errno.EEXIST, "a non-file is in the way of a result", str(target))
        if not _owned(fst) or fst.st_size != len(data):
            return False
        if fst.st_nlink > 1 and not _only_temp_twins(ops, fd, fst, target):
            # another name for the inode, e.g. outside the store: whoever holds it could
            # change what the model reads back after this check
            return False
        return _same_bytes(ops, fd, data)
    finally:
        ops.close(fd)


def _only_temp_twins(ops: FileOps, fd: int, fst: os.stat_result, target: Path) -> bool:
    """Whether every other link of ``target``'s inode is a writer's temp name for it (a writer
    between its link and its unlink, or one whose unlink failed)."""
    twins = 0
    suffix = f"-{target.name}"
    try:
        names = ops.listdir(target.parent)
    except OSError:
        return False
    for name in names:
        if not (name.endswith(suffix) and _TEMP_NAME.fullmatch(name)):
            continue
        with contextlib.suppress(OSError):
            tst = ops.lstat(target.parent / name)
            if (tst.st_dev, tst.st_ino) == (fst.st_dev, fst.st_ino):
                twins += 1
    # counted after the scan: a twin unlinked meanwhile lowers the count, never raises it
    return ops.fstat(fd).st_nlink <= 1 + twins


def _same_bytes(ops: FileOps, fd: int, data: bytes) -> bool:
    # in chunks: a result can be hundreds of MB, and a mismatch usually shows early
    view = memoryview(data)
    offset = 0
    while True:
        chunk = ops.read(fd, _READ_CHUNK)
        if not chunk:
            return offset == len(view)
        end = offset + len(chunk)
        if end > len(view) or view[offset:end] != chunk:
            return False
        offset = end


@functools.cache
def _host_tag() -> int:
    """16 bits naming this host and pid namespace: a pid means something only where it ran."""
    parts = [socket.gethostname()]
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("")
    digest = hashlib.sha256("\0".join(parts).encode("utf-8", errors="surrogatepass")).digest()
    return int.from_bytes(digest[:2], "big")


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs here; True when that cannot be told (its temp file is kept)."""
    if os.name != "posix":
        return True  # os.kill would terminate the process on Windows, not probe it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # EPERM: it runs, as another user
    return True
