"""The descriptors that transcript writers keep open between appends, bounded per process.

Opening a transcript safely (its directory without following a link, then the file relative to
it, then checking what was opened) takes about ten system calls; a conversation appends one or
two records a call. A writer made with ``hold_open=True`` keeps its descriptor and, on each
append, only checks that the path still names the file it holds. :class:`OpenFiles` bounds how
many are held at once: past :data:`MAX_OPEN`, the writer that appended least recently closes
its descriptor (it opens the file again on its next append).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

__all__ = ["MAX_OPEN", "OPEN_FILES", "HeldFile", "Holder", "OpenFiles"]

MAX_OPEN = 64
"""Descriptors held open at once by the writers of one process (the default)."""


class Holder(Protocol):
    """A writer holding a descriptor: ``release()`` closes it unless the writer is using it
    (then it returns False)."""

    def release(self) -> bool: ...  # pragma: no cover - a protocol


class OpenFiles:
    """The writers holding a descriptor, least recently used first, at most ``limit`` of them
    (a writer in the middle of an append is passed over and closed later). Thread-safe."""

    def __init__(self, limit: int = MAX_OPEN) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        self._held: OrderedDict[int, weakref.ref[Holder]] = OrderedDict()
        # a forked child may find the lock held by a thread it does not have; its writers
        # let the parent's descriptors go themselves (pipeline.transcript.writer)
        os.register_at_fork(after_in_child=self._after_fork)

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for ref in self._held.values() if ref() is not None)

    def used(self, holder: Holder) -> None:
        """``holder`` holds a descriptor and just used it: the most recent; past the limit,
        the least recently used others release theirs."""
        key = id(holder)
        with self._lock:
            held = self._held
            ref = held.get(key)
            if ref is not None and ref() is holder:
                held.move_to_end(key)
            else:
                held[key] = weakref.ref(holder)
            busy: list[tuple[int, weakref.ref[Holder]]] = []
            while len(held) > self.limit:
                old_key, old_ref = held.popitem(last=False)
                old = old_ref()
                if old is None:
                    continue  # gone: its descriptor was closed with it
                if old is holder or not old.release():
                    busy.append((old_key, old_ref))  # appending now: it goes another time
            for old_key, old_ref in reversed(busy):
                held[old_key] = old_ref
                held.move_to_end(old_key, last=False)

    def dropped(self, holder: Holder) -> None:
        """``holder`` no longer holds a descriptor."""
        with self._lock:
            ref = self._held.get(id(holder))
            if ref is not None and ref() is holder:
                del self._held[id(holder)]

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._held = OrderedDict()


OPEN_FILES = OpenFiles()
"""The process's bound on the descriptors transcript writers hold."""


class HeldFile:
    """One writer's file, kept open between appends: :meth:`descriptor` hands the descriptor
    while ``path`` still names the file it is (linked, the same device and inode), else
    ``opener(path)``'s (safely) again. ``lock``: the writer's, held around every use of the
    descriptor (:meth:`release`, which ``open_files`` calls from any thread, only tries it).
    The descriptor is closed when this is collected, never at the interpreter's exit (what
    runs then, a sync thread's last group, may still append through it)."""

    def __init__(
        self,
        path: Path,
        opener: Callable[[Path], int],
        lock: threading.Lock,
        open_files: OpenFiles = OPEN_FILES,
    ) -> None:
        self.path, self.lock = path, lock
        self._opener, self._open_files = opener, open_files
        self.fd: int | None = None
        self._closer: weakref.finalize[Any, Any] | None = None

    def descriptor(self) -> tuple[int, int]:
        """The descriptor and the file's size (under ``lock``)."""
        fd = self.fd
        if fd is not None:
            now = os.fstat(fd)
            try:
                named = os.lstat(self.path)
            except OSError:  # gone, its directory too, or unreadable: opened again below
                named = None
            if (
                named is not None
                and now.st_nlink
                and (named.st_dev, named.st_ino) == (now.st_dev, now.st_ino)
            ):
                return fd, now.st_size
            self.close()  # removed, replaced (a link planted there) or moved away
        fd = self.fd = self._opener(self.path)
        self._closer = weakref.finalize(self, os.close, fd)
        self._closer.atexit = False
        return fd, os.fstat(fd).st_size

    def used(self) -> None:
        """An append went through it (outside ``lock``): counted as the most recent."""
        self._open_files.used(self)

    def close(self) -> None:
        """Close the descriptor, if one is held (under ``lock``)."""
        if self._close():
            self._open_files.dropped(self)

    def release(self) -> bool:
        """Close the descriptor unless an append is using it (then False)."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self._close()
            return True
        finally:
            self.lock.release()

    def forget_after_fork(self, lock: threading.Lock) -> None:
        """In a forked child: the parent's descriptor is the parent's; ``lock`` is the writer's
        new one. The next append opens the file again."""
        self.lock = lock
        fd, closer = self.fd, self._closer
        self.fd = self._closer = None
        if closer is not None:
            closer.detach()
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # the child's copy; the parent's stays open

    def _close(self) -> bool:
        fd, closer = self.fd, self._closer
        self.fd = self._closer = None
        if fd is None:
            return False
        if closer is not None and closer.alive:
            with contextlib.suppress(OSError):
                closer()  # closes it, once
        return True
