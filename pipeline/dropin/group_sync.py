"""Local records made durable in groups (:class:`GroupSync`).

The proxy writes each record of a local store as it goes (a crash of the process loses none)
and makes a call's records durable after its response has gone by: one ``fsync``. Done per
call, that is a worker thread's hop and a ``fsync`` for every request, ~0.6 ms of CPU -- as
much as the whole pass of a 100-message conversation. Grouped, the conversations whose calls
ended in the same short window (:data:`GROUP_WINDOW`) are synced together, in one hop, each
file once however many of its calls the window holds. A machine that loses power loses at
most the records of that window's calls (per call, it was the last call's); a process that
crashes loses none. A server shutting down syncs what is left (:meth:`GroupSync.flush`).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.to_thread

from pipeline.logs import get_logger

__all__ = ["GROUP_WINDOW", "GroupSync", "sync_each"]

GROUP_WINDOW = 0.1
"""Seconds from the first call of a group that ends to the group's ``fsync``."""


class GroupSync:
    """Syncs run together, each once per group, at most ``window`` seconds after the first
    was added, one after another in one worker thread. :meth:`run` is the task that does it,
    for the server's lifetime (one per event loop): while it does not run (an app served
    without its lifespan), :attr:`running` is False and callers sync on their own.
    :meth:`flush` syncs what waits at once. A sync that raises is logged
    (``group_sync.failed``) and the others of its group run all the same."""

    def __init__(self, window: float = GROUP_WINDOW) -> None:
        if not window >= 0:  # NaN too
            raise ValueError(f"window must be 0 or more seconds, got {window}")
        self.window = window
        self._waiting: dict[Callable[[], None], None] = {}
        """The syncs of the next group, in order, each once (a session's bound method is
        equal to itself however often it is taken)."""
        self._wake: anyio.Event | None = None
        """Set when a sync is added: made by :meth:`run` (an event belongs to a loop)."""
        self.running = False
        """Whether :meth:`run` is running: what is added will be synced."""
        self.groups = 0
        """Groups synced so far."""

    def add(self, sync: Callable[[], None]) -> None:
        """Run ``sync`` (blocking: it runs in a worker thread) with the next group."""
        self._waiting[sync] = None
        if self._wake is not None:
            self._wake.set()

    @property
    def waiting(self) -> int:
        """How many syncs wait for the next group."""
        return len(self._waiting)

    async def run(self) -> None:
        """Sync the groups as they come, until cancelled."""
        self.running = True
        try:
            while True:
                if not self._waiting:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                await anyio.sleep(self.window)
                await self.flush()
        finally:
            self.running = False

    async def flush(self) -> None:
        """Sync what waits now, in a worker thread (a cancellation waits for it to end)."""
        group, self._waiting = list(self._waiting), {}
        if group:
            self.groups += 1
            await anyio.to_thread.run_sync(sync_each, group)


def sync_each(group: list[Callable[[], None]]) -> None:
    """Run each of ``group``'s syncs (blocking); one that raises is logged
    (``group_sync.failed``, its type alone) and the others run all the same."""
    for sync in group:
        try:
            sync()
        except Exception as exc:  # the group's other files, and the groups after, go on
            get_logger().error("group_sync.failed", error=type(exc).__name__)
