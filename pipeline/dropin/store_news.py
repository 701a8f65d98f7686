"""Held conversations kept as their store leaves them (:class:`StoreNews`, a mixin of
:class:`~pipeline.dropin.conversations.Conversations`).

A conversation held in memory may be moved on by another writer of its store: another worker
of a fleet on an object store, another proxy or ``wrap``ped client on the same local files.
Before each call the proxy and ``wrap`` ask the store for news (an object store: one ``HEAD``,
in a worker thread; a local log: its length, one ``lstat``, inline) and, when there is some,
load the conversation again from its records, so that it sends what its records say.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread

from pipeline.core import Pipeline
from pipeline.dropin.adapter import WireSession
from pipeline.dropin.branching import FamilyDecisions
from pipeline.dropin.families import Branch
from pipeline.store.sessions import SessionStates

__all__ = ["PLACE_ATTEMPTS", "StoreNews"]

PLACE_ATTEMPTS = 3
"""How many times a request is placed at most while another writer of the store keeps moving
its conversation on (the proxy's and ``wrap``'s: the last goes as placed)."""


class StoreNews:
    """What an index of conversations does to keep each as its store leaves it (see the
    module); the index gives the attributes below."""

    states: SessionStates
    pipeline: Callable[[], Pipeline]
    context: dict[str, Any]
    _lock: threading.Lock

    async def current(self, branch: Branch) -> bool:
        """Whether ``branch`` is as its records leave it. When another writer recorded calls
        of it since (another worker of a shared store, another client or program on the same
        files), it is loaded again: False, place the request again. Asking an object store is
        a request, made in a worker thread; a local file's length is read inline. A store that
        cannot be asked or read: True, and from then on the conversation decides again what
        no record tells it of (:meth:`WireSession.store_unread`)."""
        session = branch.session
        try:
            changed = session.storage.changed_elsewhere
            moved = await anyio.to_thread.run_sync(changed) if self.states.shared else changed()
            if moved:
                await self.reload(branch)
        except OSError as exc:
            self._unread(session, exc)
            return True
        return not moved

    def current_sync(
        self, branch: Branch, run: Callable[[Callable[[], Awaitable[None]]], None]
    ) -> bool:
        """:meth:`current` for a synchronous caller: the store asked inline, a load by ``run``
        (which runs a coroutine to its end: the sync ``wrap``'s own loop)."""
        session = branch.session
        try:
            moved = session.storage.changed_elsewhere()
            if moved:
                run(lambda: self.reload(branch))
        except OSError as exc:
            self._unread(session, exc)
            return True
        return not moved

    @staticmethod
    def still_moving(branch: Branch) -> None:
        """The last of :data:`PLACE_ATTEMPTS`: the store still had news the last load did not
        bring (another writer kept moving the conversation on, or records that list are not
        readable yet). The request goes as placed -- not loaded again, which would leave the
        session that serves it unplaced -- and, on a store with a spool (a fleet's), its
        conversation decides again what no record tells it of
        (:meth:`WireSession.store_unread`), as a worker that cannot read does; elsewhere on
        the conversation as last loaded."""
        session = branch.session
        session.ctx.logger.warning("wire_session.still_moving", session_id=session.session_id)
        session.store_unread()

    @staticmethod
    def _unread(session: WireSession, exc: OSError) -> None:
        session.ctx.logger.warning("wire_session.refresh_failed", error=type(exc).__name__)
        # another worker may have served calls this one cannot read of: what it decided on
        # their results is decided again here, alike, rather than taken as sent whole
        session.store_unread()

    async def reload(self, branch: Branch) -> None:
        """Load ``branch``'s session again from its records (another worker served it), in a
        worker thread; the index learns what its records say it sent. ``OSError`` when the
        store cannot be read."""
        family = branch.family
        await branch.session.save_calibration()  # what it learned since its last save
        storage = branch.session.storage
        if not storage.shared:
            # a writer of its own: what the session it replaces still writes (a response
            # recorded late) is then news to it, not its own (an object store's log is kept,
            # which a new one would read whole again)
            storage = family.states.open(family.name, branch=branch.name, content_named=True)
        session = await WireSession.open(
            branch.conversation_id,
            family.calibration_root,
            self.pipeline(),
            storage=storage,
            opening=family.opening,
            **self.context,
        )
        session.elsewhere = FamilyDecisions(self._lock, family, branch.name)
        with self._lock:
            branch.session = session
            branch.params = []
            family.register(branch, list(session.chain))
