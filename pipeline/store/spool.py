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
written to a temporary name, fsync'd and renamed: a crash leaves an object whole or absent.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from pipeline.logs import get_logger

__all__ = ["MAX_SPOOLED_BYTES", "SPOOL_DIR", "Spool"]

SPOOL_DIR = "spool"
"""The spool's directory under a worker's local root (the proxy's ``--state``/``root``)."""

MAX_SPOOLED_BYTES = 1 << 30
"""What a spool holds at most by default (1 GiB): past it, a result is not spooled (it is sent
whole, as without a spool) -- a long outage must not fill the worker's disk."""


class Spool:
    """Result objects waiting for their store, in ``directory`` (made on first use);
    ``max_bytes``: what it holds at most. Thread-safe."""

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int = MAX_SPOOLED_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: int | None = None
        """Bytes spooled (None: not counted yet, the directory not read)."""

    def _paths(self, key: str) -> tuple[Path, Path]:
        name = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        return self.directory / f"{name}.txt", self.directory / f"{name}.key"

    def _count(self) -> int:
        if self._held is None:
            self._held = sum(p.stat().st_size for p in self.directory.glob("*.txt") if p.is_file())
        return self._held

    def put(self, key: str, data: bytes) -> bool:
        """Spool ``data`` for ``key``: True once it is durable here; False when the spool is
        full (``max_bytes``). ``OSError`` when the local disk fails."""
        body, name = self._paths(key)
        with self._lock:
            if body.exists() and name.exists():
                return True  # the same key holds the same bytes: content-named
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self._count() + len(data) > self.max_bytes:
                return False
            _write_durably(name, key.encode("utf-8", "surrogatepass"))
            _write_durably(body, data)
            _fsync_dir(self.directory)
            self._held = self._count() + len(data)
        get_logger().warning("store.spooled", bytes=len(data))
        return True

    def path_of(self, key: str) -> Path | None:
        """The local file holding ``key``'s spooled bytes, None when it is not spooled."""
        body, name = self._paths(key)
        return body if body.is_file() and name.is_file() else None

    def waiting(self) -> bool:
        """Whether anything is spooled (counted once from the directory, then kept)."""
        with self._lock:
            if not self.directory.is_dir():
                return False
            return self._count() > 0

    def __len__(self) -> int:
        """How many objects wait."""
        return sum(1 for _ in self._entries())

    def _entries(self) -> Iterator[tuple[str, Path, Path]]:
        if not self.directory.is_dir():
            return
        for name in sorted(self.directory.glob("*.key")):
            body = name.with_suffix(".txt")
            if not body.is_file():
                continue
            try:
                key = name.read_bytes().decode("utf-8", "surrogatepass")
            except (OSError, UnicodeDecodeError):
                continue
            yield key, body, name

    def drain(self, place: Callable[[str, bytes], bool]) -> tuple[int, int]:
        """Write every spooled object with ``place(key, data)`` (True: the store holds those
        bytes at ``key`` now; False: other bytes are there), oldest key first; stops at the
        first error (the store is still down). Returns (written, left). A key whose object
        holds other bytes is logged (``store.spool_conflict``) and dropped: only this
        worker's read-back could still show it, and it must not shadow the store's."""
        written = 0
        log = get_logger()
        for key, body, name in list(self._entries()):
            try:
                data = body.read_bytes()
            except OSError:
                continue
            try:
                placed = place(key, data)
            except Exception as exc:  # still down (or denied): the rest waits too
                log.info("store.spool_waiting", error=type(exc).__name__)
                break
            if not placed:
                log.error("store.spool_conflict", bytes=len(data))
            with self._lock:
                for path in (body, name):
                    path.unlink(missing_ok=True)
                if self._held is not None:
                    self._held = max(0, self._held - len(data))
            written += placed
        return written, len(self)


def _write_durably(path: Path, data: bytes) -> None:
    """``data`` at ``path`` (private to this user), whole or not at all."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    try:
        with os.fdopen(os.open(tmp, flags, 0o600), "wb") as f:
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
