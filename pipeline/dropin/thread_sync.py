"""Local records made durable in groups by a thread of the process (:class:`ThreadSync`).

:class:`~pipeline.dropin.group_sync.GroupSync` groups the proxy's syncs on the server's event
loop, for as long as the server runs. ``wrap`` has no such loop: a synchronous client's calls
come from the caller's threads, an asynchronous one's from whatever loop the caller runs, and
none lives as long as the process. Its calls ended with an ``fsync`` of the conversation's log
before the response was returned: ~1.4 ms of a call on this machine's disk, more than half of
what ``wrap`` adds, more on a disk without a write cache. A :class:`ThreadSync` does that work
in a daemon thread of its own instead, the syncs added within :data:`GROUP_WINDOW` of the
first together, each once: a call returns once its records are written (a crash of the
process loses none); a machine that loses power in that moment may lose them. What waits when
the interpreter exits is synced then (``atexit``), and a forked child starts a thread of its
own at its first sync.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable

from pipeline.dropin.group_sync import GROUP_WINDOW, sync_each

__all__ = ["SYNCS", "ThreadSync"]


class ThreadSync:
    """Syncs run together in a daemon thread, each once per group, ``window`` seconds after
    the first of the group was added. :meth:`add` is safe from any thread; :meth:`flush`
    runs what waits at once (blocking), as the interpreter's exit does. A sync that raises is
    logged (``group_sync.failed``) and the others of its group run all the same."""

    def __init__(self, window: float = GROUP_WINDOW) -> None:
        if not window >= 0:  # NaN too
            raise ValueError(f"window must be 0 or more seconds, got {window}")
        self.window = window
        self.groups = 0
        """Groups synced so far."""
        self._reset()
        atexit.register(self.flush)
        # a forked child has no thread of this one's, and its locks may be held by one
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._waiting: dict[Callable[[], None], None] = {}
        """The syncs of the next group, in order, each once (a session's bound method is equal
        to itself however often it is taken)."""
        self._flushing = threading.Lock()
        """Held while a group syncs: groups run one after another, whoever runs them."""
        self._thread: threading.Thread | None = None

    def add(self, sync: Callable[[], None]) -> None:
        """Run ``sync`` (blocking) with the next group, in this object's thread."""
        with self._changed:
            self._waiting[sync] = None
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="sluicegate-sync", daemon=True
                )
                self._thread.start()
            self._changed.notify()

    @property
    def waiting(self) -> int:
        """How many syncs wait for the next group."""
        with self._changed:
            return len(self._waiting)

    def flush(self) -> None:
        """Sync what waits now, here (blocking; after a group another thread is syncing)."""
        with self._flushing:
            with self._changed:
                group, self._waiting = list(self._waiting), {}
            if group:
                self.groups += 1
                sync_each(group)

    def _serve(self) -> None:
        changed = self._changed
        while True:
            with changed:
                while not self._waiting:
                    changed.wait()
            if self.window:
                time.sleep(self.window)  # the group's window: others join it
            self.flush()


SYNCS = ThreadSync()
"""Where every wrapped client's local records are made durable after its calls, in groups
(``pipeline.dropin.wrap.SYNCS`` too); ``SYNCS.flush()`` makes what waits durable now."""
