"""A local spool for result objects an object store could not take (:class:`Spool`).

A worker of a fleet that persists a result while the store is down (or refuses that write)
would otherwise send the result whole: the model would see it in full once, and a worker that
later decides the same result again (from the request itself, as every worker does for what no
record tells it) sends the replacement -- the result changes form under the model. With a
spool the worker writes the bytes to a local file instead, keyed by the object key it would
have used, and sends the same replacement the store's write would have given. The spooled
objects are written to the store when it answers again (:meth:`Spool.drain`, each write
conditional: an object another worker made first with the same bytes is as good), and until
then the worker's read-back tool reads them from the spool.

What a spool cannot do: another worker cannot read a spooled result back until this worker has
drained it, and a spool lost with its host (a disk gone for good) loses those results; the
replacement in the conversation then points at nothing, and a read-back says so.

Files: ``<directory>/<sha256 of the key>.txt`` holding the result's bytes, and beside it
``.key`` holding the key (written first; a spooled object without both is ignored). Each is
written to a new temporary name (created exclusively), fsync'd and renamed: a crash leaves an
object whole or absent. The directory must be this user's alone (0700, not a symbolic link):
a spool in a directory others can write to is refused, and a ``.key`` whose name is not the
digest of its key, or whose key is not a tool result's, is never written to the store.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pipeline.logs import get_logger
from pipeline.store.files import is_result_key

__all__ = ["MAX_SPOOLED_BYTES", "SPOOL_DIR", "Spool"]

SPOOL_DIR = "spool"
"""The spool's directory under a worker's local root (the proxy's ``--state``/``root``)."""

MAX_SPOOLED_BYTES = 1 << 30
"""What a spool holds at most by default (1 GiB): past it, a result is not spooled (it is sent
whole, as without a spool) -- a long outage must not fill the worker's disk."""


_DRAIN_EVERY = 1.0
"""Seconds between two drains of one spool (each call's settle asks for one)."""
_DRAIN_FAILURES = 3
"""Failures in a row that end a drain (the store is down: the rest waits)."""


class Spool:
    """Result objects waiting for their store, in ``directory`` (made on first use, private);
    ``max_bytes``: what it holds at most. Thread-safe; one drain at a time."""

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int = MAX_SPOOLED_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._draining = threading.Lock()
        self._last_drain = -float("inf")
        self._held: int | None = None
        """Bytes spooled (None: not counted yet, the directory not read)."""

    def _paths(self, key: str) -> tuple[Path, Path]:
        name = _digest(key)
        return self.directory / f"{name}.txt", self.directory / f"{name}.key"

    def _count(self) -> int:
        if self._held is None:
            self._held = sum(size for _key, _body, _name, size in self._entries())
        return self._held

    def _private_directory(self) -> None:
        """Make the directory (0700) or check the one there: a real directory of this user's
        that no one else can write to; ``OSError`` otherwise."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.directory.lstat()
        mine = not hasattr(os, "geteuid") or st.st_uid == os.geteuid()
        if not stat.S_ISDIR(st.st_mode) or not mine or st.st_mode & 0o022:
            raise OSError(
                errno.EPERM,
                "refusing the spool directory: not a directory of this user's alone",
                str(self.directory),
            )

    def put(self, key: str, data: bytes) -> bool:
        """Spool ``data`` for ``key`` (a tool result's object key): True once it is durable
        here; False when the spool is full (``max_bytes``) or ``key`` is not a result's.
        ``OSError`` when the local disk fails or the directory is not private."""
        if not is_result_key(key):
            return False
        body, name = self._paths(key)
        with self._lock:
            self._private_directory()
            if body.exists() and name.exists():
                return True  # the same key holds the same bytes: content-named
            if self._count() + len(data) > self.max_bytes:
                return False
            _write_durably(name, key.encode("utf-8", "surrogatepass"))
            _write_durably(body, data)
            _fsync_dir(self.directory)
            self._held = self._count() + len(data)
        return True

    def path_of(self, key: str) -> Path | None:
        """The local file holding ``key``'s spooled bytes, None when it is not spooled."""
        body, name = self._paths(key)
        return body if body.is_file() and name.is_file() else None

    def waiting(self) -> bool:
        """Whether anything is spooled (counted once from the directory, then kept)."""
        with self._lock:
            return self._count() > 0

    def __len__(self) -> int:
        """How many objects wait."""
        return sum(1 for _ in self._entries())

    def _entries(self) -> Iterator[tuple[str, Path, Path, int]]:
        """(key, body, key file, size) of each whole, well-formed spooled object."""
        try:
            names = sorted(self.directory.glob("*.key"))
        except OSError:
            return
        for name in names:
            body = name.with_suffix(".txt")
            try:
                key = name.read_bytes().decode("utf-8", "surrogatepass")
                size = body.lstat().st_size if stat.S_ISREG(body.lstat().st_mode) else -1
            except (OSError, UnicodeDecodeError):
                continue
            # a key file another hand wrote or changed is never sent to the store
            if size < 0 or name.stem != _digest(key) or not is_result_key(key):
                continue
            yield key, body, name, size

    def drain(self, place: Callable[[str, bytes], bool], *, force: bool = False) -> tuple[int, int]:
        """Write the spooled objects with ``place(key, data)`` (True: the store holds those
        bytes at ``key`` now; False: other bytes are there). One drain at a time, at most one a
        second unless ``force``; an object that fails is passed over, and
        :data:`_DRAIN_FAILURES` failures in a row end the drain (the store is down: the rest
        waits for the next). Returns (written, left). An object whose key holds other bytes
        is logged (``store.spool_conflict``) and dropped: only this worker's read-back could
        still show it, and it must not shadow the store's."""
        if not self._draining.acquire(blocking=False):
            return 0, -1  # another thread drains now
        try:
            now = time.monotonic()
            if not force and now - self._last_drain < _DRAIN_EVERY:
                return 0, -1
            self._last_drain = now
            return self._drain(place)
        finally:
            self._draining.release()

    def _drain(self, place: Callable[[str, bytes], bool]) -> tuple[int, int]:
        written = left = failures = 0
        log = get_logger()
        for key, body, name, size in list(self._entries()):
            if failures >= _DRAIN_FAILURES:
                left += 1
                continue
            try:
                data = body.read_bytes()
                placed = place(key, data)
            except Exception as exc:  # down, denied, or this object refused: it waits
                failures += 1
                left += 1
                log.info("store.spool_waiting", error=type(exc).__name__)
                continue
            failures = 0
            if not placed:
                log.error("store.spool_conflict", bytes=size)
            removed = False
            with self._lock:
                for path in (body, name):
                    try:
                        path.unlink()
                        removed = removed or path is body
                    except FileNotFoundError:
                        pass
                if removed and self._held is not None:
                    self._held = max(0, self._held - size)
            written += placed
        if written:
            log.info("store.spool_drained", written=written, left=left)
        return written, left


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _write_durably(path: Path, data: bytes) -> None:
    """``data`` at ``path`` (private to this user), whole or not at all: written to a new
    temporary file (created exclusively, never through a link), then renamed."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    """Make the renames in ``directory`` durable (where the platform can)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a file system that cannot sync a directory: the files themselves are synced
    finally:
        os.close(fd)
