"""Which conversation a request belongs to: its tenant, then the conversation whose messages it
begins with.

A drop-in (``wrap``, the proxy) is handed requests, not conversations. Each request is placed
by what it holds, never by a name alone:

- **Tenant.** The request's credential decides whose conversations it may join
  (:mod:`pipeline.dropin.tenancy`): another key's conversations are never found, whatever the
  request names. Every conversation's records and results live under its tenant:
  ``<root>/<tenant>/<conversation>/``.
- **Family.** A conversation opens with a system prompt and a first message. Requests that
  open alike, with the same hint, form a family: the hint is the caller's explicit id
  (``wrap(session_id=...)``, the ``x-sluicegate-session`` header), else Claude Code's session
  (``metadata.user_id``), else none. What a client moves between calls does not count:
  ``cache_control`` anywhere, and Claude Code's billing-header line in the system prompt.
- **Prefix.** Within a family, each message is known by a digest of itself and every message
  before it (a chain). A request continues the conversation whose last request it extends
  (its messages begin with all of that request's), unless the message that follows was sent
  by another conversation (a fork of that one repeats its messages): it is then placed by
  that one's, so it goes out as that one sent it; a request that shares only part of one
  goes another way from it -- a fork, an edit, a rewind -- and becomes a conversation of its
  own, a *branch*, which starts from the other's decisions (:meth:`WireSession.inherit`), so
  the part they share goes out as the other sent it. A request that sends again what a
  conversation sent before (a retry) is that conversation's. Two requests that open alike
  stay one conversation only while one extends the other.

Finding the conversation costs one comparison per message with the last request of the most
recent one (C-level), and a digest per new message (a request with many, a long
conversation's first, is digested in a worker thread by :meth:`Conversations.route`, away
from the event loop: :data:`OFF_LOOP_MESSAGES`); the digests are kept with each
conversation's records (``chain`` in its response records), so a new process, or another
worker on the same object store, places requests as this one would. A branch's name is the
family's, then ``.f`` and 16 hex of the digest of the first message in which it went its own
way: every worker names the same branch alike.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from pipeline.dropin.adapter import WireSession
from pipeline.dropin.branching import FamilyDecisions
from pipeline.dropin.families import Branch, Family, named, new_to
from pipeline.dropin.family_loading import load_family, records_of
from pipeline.dropin.held_families import MAX_BRANCHES, MAX_HELD, MAX_HELD_BYTES, HeldFamilies
from pipeline.dropin.naming import SESSION_HEADER, conversation_hint, family_name
from pipeline.dropin.placing import Placing
from pipeline.dropin.store_news import StoreNews
from pipeline.dropin.tenancy import Tenancy
from pipeline.logs import get_logger
from pipeline.store.sessions import SessionStates, SessionStorage
from pipeline.transcript import Transcript
from pipeline.wire.digests import OpeningMemo, chain_of, opening_digest

if TYPE_CHECKING:
    import os

    from pipeline.core import Pipeline

__all__ = [
    "DIGESTS_AT_ONCE",
    "MAX_HELD",
    "MAX_HELD_BYTES",
    "OFF_LOOP_MESSAGES",
    "SESSION_HEADER",
    "Branch",
    "Conversations",
    "conversation_hint",
]

OFF_LOOP_MESSAGES = 200
"""Messages new to their family from which :meth:`Conversations.route` digests a request in a
worker thread (~3 µs a message), away from the event loop."""
DIGESTS_AT_ONCE = 2
"""Requests digested in worker threads at once (they share the interpreter: more would only
keep the threads that load conversations from the store waiting)."""

T = TypeVar("T")


def _call(fn: Callable[[], T]) -> T:
    return fn()


_READS_BEFORE = 3
"""Reads of conversations not held one async request makes in worker threads before it is
placed (each read may find the index changed, asking for another); past them, inline."""

_OPENINGS_KEPT = 64
"""Recent requests whose system prompt and first message are remembered with their digest."""


class Conversations(StoreNews, Placing):
    """Every conversation a drop-in serves, found by tenant and prefix (see the module).

    ``pipeline``: a factory of each conversation's stages; ``storage``: where their state lives
    (a :class:`~pipeline.store.sessions.SessionStates` or a location for one; default the
    files under ``root``); ``root``: where each host keeps its token calibration (under the
    tenant's directory); ``tenancy``: how requests are told apart (default: by credential, under
    the store's secret; ``Tenancy(single=True)`` for one tenant); ``context``: keyword
    arguments of each session (``cache_breakpoint``, tool policies, a tracer, a logger).
    :meth:`route` (async) and :meth:`route_sync` place a request; both are safe from many
    tasks or threads at once (the index is guarded by a lock never held across I/O).

    ``max_held``: how many conversations are held in memory (default
    :data:`~pipeline.dropin.held_families.MAX_HELD`; None: no bound); ``max_held_bytes``:
    what their last requests may come to, in the sizes the caller gives :meth:`route`
    (``size``: the proxy gives each body's bytes and 2 KiB a message; default
    :data:`~pipeline.dropin.held_families.MAX_HELD_BYTES`; None: no bound). Past either, the
    families least recently routed to are let go (:mod:`pipeline.dropin.held_families`).
    ``on_let_go``: told of each conversation let go (what a caller keeps of it can go too),
    where routing runs (the proxy: its event loop). ``max_branches``: how many conversations
    one family holds (default :data:`~pipeline.dropin.held_families.MAX_BRANCHES`; no more
    than ``max_held``): past it, its least recently routed are let go, never its first.
    """

    def __init__(
        self,
        *,
        pipeline: Callable[[], Pipeline],
        root: str | os.PathLike[str] = ".sluicegate",
        storage: SessionStates | str | os.PathLike[str] | None = None,
        tenancy: Tenancy | None = None,
        max_held: int | None = MAX_HELD,
        max_held_bytes: int | None = MAX_HELD_BYTES,
        on_let_go: Callable[[Branch], None] | None = None,
        max_branches: int = MAX_BRANCHES,
        **context: Any,
    ) -> None:
        self._holding = HeldFamilies(max_held, max_held_bytes, on_let_go, max_branches)
        self.root = Path(root)
        self.states = (
            storage if isinstance(storage, SessionStates) else SessionStates(storage or root)
        )
        self.pipeline = pipeline
        self.context = context
        self._tenancy = tenancy
        # the objects it holds for as many conversations at most as are held
        self._openings = OpeningMemo(min(_OPENINGS_KEPT, max_held or _OPENINGS_KEPT))
        self.off_loop = 0
        """Requests :meth:`route` digested off its event loop so far."""
        self._digests = anyio.CapacityLimiter(DIGESTS_AT_ONCE)
        self._lock = threading.Lock()

    # -- the way in --------------------------------------------------------------------------
    async def route(
        self,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        *,
        explicit: str | None = None,
        unchanging: bool = False,
        hold: bool = False,
        size: int | None = None,
    ) -> Branch:
        """The conversation of a request (``body``: its JSON; ``headers``: its HTTP headers),
        a new one made if it continues none. Loads from the store in a worker thread.
        ``size``: the request's size as :attr:`max_held_bytes` counts it (the proxy's:
        :func:`~pipeline.dropin.held_families.held_size`); None leaves the conversation's as
        it was. ``unchanging``: the body's values are never changed in place (a
        :class:`~pipeline.wire.body_reader.BodyReader`'s parse), so a system prompt and first
        message that are an earlier request's very objects need no new digest. ``hold``: a
        caller that takes no :attr:`~Branch.call_lock` counts its call in :attr:`Branch.calls`
        until :meth:`done` (its family is not let go meanwhile).
        ``ValueError`` for a bad hint or a request without a ``messages`` list; ``OSError``
        when the store cannot be read."""
        tenancy = self._tenancy
        if tenancy is None:
            tenancy = await anyio.to_thread.run_sync(self._make_tenancy)
        tenant, name, messages, opening = self._key(
            tenancy, body, headers, explicit, unchanging=unchanging
        )
        family = await self._family(tenant, name, opening)
        full = None
        if new_to(family, messages) >= OFF_LOOP_MESSAGES:  # digested off the event loop
            self.off_loop += 1
            digest = functools.partial(chain_of, messages, opening=opening)
            full = await anyio.to_thread.run_sync(digest, limiter=self._digests)
            if not family.unsure:  # (one the store could not give is held by no index)
                # let go meanwhile, it is loaded again (the chain holds: it is the messages')
                family = await self._family(tenant, name, opening)
        # placed with no await since the family was found: it cannot be let go in between;
        # what a fork not held sent is read first, in a worker thread (a store may be remote)
        read: dict[str, Transcript | None] = {}
        while True:
            inline = len(read) >= _READS_BEFORE  # the index kept changing under the reads
            placed = self._place(
                family,
                messages,
                opening,
                build=_call,
                hold=hold,
                full=full,
                size=size,
                read=None if inline else read,
                owned=unchanging,
            )
            if isinstance(placed, Branch):
                return placed
            read[placed] = await anyio.to_thread.run_sync(records_of, family, placed)
            family = await self._family(tenant, name, opening)  # (let go meanwhile: loaded)

    async def _family(self, tenant: str, name: str, opening: bytes) -> Family:
        family = self._holding.families.get((tenant, name))
        if family is not None:
            return family
        return await anyio.to_thread.run_sync(self._family_sync, tenant, name, opening)

    def _family_sync(
        self,
        tenant: str,
        name: str,
        opening: bytes,
        run: Callable[[Callable[[], Family]], Family] = _call,
    ) -> Family:
        """The family held under ``tenant`` and ``name``, else loaded (by ``run``: blocking, a
        listing and every branch's records) and held; an unsure one where a shared store
        cannot give it."""
        family = self._holding.families.get((tenant, name))
        if family is not None:
            return family
        try:
            loaded = run(functools.partial(self._load_family, tenant, name, opening))
        except OSError:
            if not self.states.shared:
                raise  # a local store that cannot be read is not a view of a fleet's
            loaded = self._unsure(tenant, name, opening)
        return self._hold((tenant, name), loaded)

    def route_sync(
        self,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        *,
        explicit: str | None = None,
        build: Callable[[Callable[[], Any]], Any] | None = None,
        hold: bool = False,
        size: int | None = None,
    ) -> Branch:
        """:meth:`route` for a synchronous caller (blocking I/O inline). ``build``: how to run
        the making of a new session (the sync ``wrap`` makes them in a worker thread, away
        from whatever event loop the caller runs); a branch's parent is read under its
        :attr:`~pipeline.dropin.adapter.WireSession.sync_lock`."""
        run = build or _call
        tenancy = self._tenancy or self._make_tenancy()
        tenant, name, messages, opening = self._key(tenancy, body, headers, explicit)
        family = self._family_sync(tenant, name, opening, run)
        placed = self._place(family, messages, opening, build=run, sync=True, hold=hold, size=size)
        assert isinstance(placed, Branch)  # (without ``read``, what it reads it reads inline)
        return placed

    def done(self, branch: Branch) -> None:
        """A call routed with ``hold`` is through its pass."""
        with self._lock:
            branch.calls -= 1

    @property
    def max_held(self) -> int | None:
        """How many conversations may be held in memory (None: no bound)."""
        return self._holding.max_held

    @property
    def max_held_bytes(self) -> int | None:
        """What their last requests may come to (None: no bound)."""
        return self._holding.max_held_bytes

    @property
    def held(self) -> int:
        """How many conversations are held in memory now."""
        return self._holding.count

    @property
    def held_bytes(self) -> int:
        """What the last requests of the conversations held come to (:attr:`Branch.size`)."""
        return self._holding.size

    def branches(self) -> list[Branch]:
        """Every conversation held in memory."""
        with self._lock:
            return self._holding.branches()

    def _unsure(self, tenant: str, name: str, opening: bytes) -> Family:
        """The family of a request whose records a shared store could not give (it is down):
        one without records whose conversations decide every result no record tells them of
        as the fleet decided it (:attr:`WireSession.rederive`), held for this request only --
        the next loads again."""
        get_logger().warning("conversations.load_failed", rederive=True)
        states = self.states.within(tenant)
        return Family(tenant, name, opening, states, self.root / tenant, unsure=True)

    def _hold(self, key: tuple[str, str], loaded: Family) -> Family:
        """The family of ``key``: ``loaded``, unless another caller's load got there first.
        A family whose records could not be read is not held: the next request loads it."""
        if loaded.unsure:
            return loaded
        with self._lock:
            return self._holding.hold(key, loaded)

    # -- placing -------------------------------------------------------------------------------
    def _make_tenancy(self) -> Tenancy:
        made = Tenancy(self.states.secret())
        with self._lock:
            if self._tenancy is None:
                self._tenancy = made
            return self._tenancy

    def _key(
        self,
        tenancy: Tenancy,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        explicit: str | None,
        *,
        unchanging: bool = False,
    ) -> tuple[str, str, list[Any], bytes]:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise ValueError("a Messages request needs a 'messages' list")
        hint = conversation_hint(body, explicit=explicit, headers=headers)
        tenant = tenancy.tenant_of(headers)
        digest = self._openings.digest if unchanging else opening_digest
        opening = digest(body.get("system"), hint, messages[0] if messages else None)
        return tenant, family_name(hint, opening), messages, opening

    def _load_family(self, tenant: str, name: str, opening: bytes) -> Family:
        """The family as its records leave it (blocking: :func:`load_family`)."""
        states, calibration_root = self.states.within(tenant), self.root / tenant
        key, bound = (tenant, name, opening), self._holding.max_branches
        return load_family(states, calibration_root, key, bound, self._session)

    def _session(
        self, family: Family, name: str | None, storage: SessionStorage, **options: Any
    ) -> WireSession:
        session = WireSession(
            named(family.name, name),
            family.calibration_root,
            self.pipeline(),
            storage=storage,
            opening=family.opening,
            **options,
            **self.context,
        )
        session.elsewhere = FamilyDecisions(self._lock, family, name)
        return session
