"""A conversation as it arrives at the wire: a Messages request in, the request to send out.

A client that already has its loop (the SDK, a proxy in front of any program) re-sends its own,
unmodified history on every call. :class:`WireSession` turns each request's ``messages`` into
records, runs the pipeline with the conversation's :class:`~pipeline.context.SessionContext`
and gives back the ``messages`` to send. It is the layer ``wrap`` and the proxy stand on;
which conversation a request belongs to is :mod:`pipeline.dropin.conversations`' business.

- **Stable records.** While a request repeats the last one, message by message, each message
  is the same record object as before (the stages' incremental passes rest on identity); from
  the first that differs on, each gets a uuid derived from the digest of it and every message
  before it (:mod:`pipeline.wire.digests`), so the same history gives the same records in another
  process, and a stage's decision on a record never applies to one that follows other messages
  (in a conversation that went another way from this one). Assistant messages carry no id on
  the wire: the response id and usage the session observed are attached to the message that
  answered it.
- **Decisions stay.** Earlier decisions are re-applied byte for byte (prefix-stable); they are
  recorded in ``<root>/<session>/decisions.jsonl`` (replacement and stage records, responses,
  the digests of the messages the conversation sent), or wherever the session's ``storage``
  keeps records (an object store shared by a fleet:
  :func:`~pipeline.store.sessions.open_session_state`), so a new process continues with the
  same decisions.
- **A conversation that goes another way** from a point of this one (a client's fork, an edit,
  a rewind) starts from this one's decisions: :meth:`WireSession.inherit` gives them
  (:mod:`pipeline.dropin.inheritance`), and a session made with them (``inherited=``) sends the same
  bytes for the part they share; they are written as the first record of its own log, so it is
  whole on its own.
- **Cost.** Per call: one equality check per message (C-level) plus the new messages; the
  pipeline and the request building are incremental as in the agent loop.
- **Off the event loop.** :meth:`WireSession.open` loads the recorded decisions in a worker
  thread and :meth:`WireSession.observe_async` appends in one (an object store's request, a
  file's fsync); the stages' own appends already run there. The constructor and
  :meth:`WireSession.observe` do the same inline, for synchronous callers.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from pipeline.context import SessionContext
from pipeline.core import Pipeline
from pipeline.dropin.calibration import CalibrationSaves, load_calibration
from pipeline.dropin.event_stream import EventStreamUsage  # public here before it had a module
from pipeline.dropin.family_placement import Decided, FamilyPlacement
from pipeline.dropin.inheritance import FORK_RECORD, Inherited
from pipeline.dropin.observing import ANSWER_WAIT, Call, ResponseObserving
from pipeline.dropin.request_records import RequestRecords, Routed, UnreadableMessage
from pipeline.dropin.session_log import (
    expand,
    rebuild,
    responses_in,
)
from pipeline.dropin.session_writes import SessionWrites
from pipeline.messages import Message, Usage
from pipeline.results.reading import answered_results
from pipeline.spans import content_safe_span
from pipeline.store.files import validate_session_id
from pipeline.store.sessions import DECISIONS_FILE, SessionStorage, open_session_state
from pipeline.tokens import TokenTracker, calibration_path_for
from pipeline.tracing import ATTR, SPAN_WIRE_REQUEST
from pipeline.transcript.read import Transcript
from pipeline.wire.cache import WireCache
from pipeline.wire.caching import add_cache_breakpoint, marked_outside_messages
from pipeline.wire.message_fields import MessageFields
from pipeline.wire.request_fields import merge_betas as beta_header

if TYPE_CHECKING:
    from anthropic.types import MessageParam
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

__all__ = [
    "ANSWER_WAIT",
    "DECISIONS_FILE",
    "FORK_RECORD",
    "Call",
    "EventStreamUsage",
    "Inherited",
    "UnreadableMessage",
    "WireSession",
    "beta_header",
]


class _Load(enum.Enum):
    NOW = "now"
    """Load the recorded decisions in the constructor (blocking)."""


class WireSession(ResponseObserving, FamilyPlacement, RequestRecords):
    """One conversation seen at the wire (see the module docstring).

    ``cache_breakpoint``: for a client that sets no ``cache_control`` itself, put one on the
    last block (a client's own breakpoints are always left alone). ``storage``: where the
    session's results and decisions live -- a :class:`~pipeline.store.sessions.SessionStorage`
    or a location for :func:`~pipeline.store.sessions.open_session_state` (``s3://...``);
    by default the files under ``root``. ``root`` also holds the token calibration (always a
    local directory: each host learns its own). ``loaded``: the records ``storage.load()``
    returned, when the caller has loaded them (:meth:`open` does so off the event loop); by
    default the constructor loads them. ``inherited``: the decisions of the conversation this
    one went another way from (:meth:`inherit`): written as the first record of this session's
    log before anything else of it (tried again on each call until written), unless its log
    already holds records (another worker made it).
    ``prepare(messages)`` gives the messages to send; ``observe(...)`` takes the response's id
    and usage (the token tracker learns from it, and the next request's answering message
    carries them). Calls of one session must not overlap (the pipeline serialises them; a
    synchronous caller with threads holds :attr:`sync_lock` around each call's pass).
    """

    def __init__(
        self,
        session_id: str,
        root: str | Path,
        pipeline: Pipeline,
        *,
        cache_breakpoint: bool = False,
        storage: SessionStorage | str | None = None,
        loaded: Transcript | _Load | None = _Load.NOW,
        inherited: Inherited | None = None,
        opening: bytes | None = None,
        **context: Any,
    ) -> None:
        self.session_id = validate_session_id(session_id)
        self.opening = opening
        """The first link of this conversation's chain
        (:func:`~pipeline.wire.digests.opening_digest`:
        its system prompt and hint in it); None: the first message's alone."""
        self._routed: Routed | None = None
        self.pipeline = pipeline
        self.cache_breakpoint = cache_breakpoint
        self.storage = self._storage_for(self.session_id, root, storage)
        if isinstance(loaded, _Load):
            loaded = None if inherited is not None else self.storage.load()
        self.chain: list[bytes] = []
        """The digests of the messages of the last request prepared (:mod:`pipeline.wire.digests`),
        as loaded from the records until the first."""
        self._disk_chain: Sequence[bytes] = []
        """The chain as the records hold it."""
        self._pending: Inherited | None = None
        self._served = False
        """Whether the loaded records hold a response of this conversation's own."""
        if loaded is None and inherited is not None:
            self._pending = inherited
            loaded = Transcript(
                path=Path(self.storage.location),
                messages=[],
                replacement_records=list(inherited.replacement_records),
                stage_records=list(inherited.stage_records),
            )
            self.chain = list(inherited.chain)
        elif loaded is not None:
            expanded = expand(loaded, self.session_id)
            loaded, self.chain, self._served = expanded.transcript, expanded.chain, expanded.served
            self._disk_chain = list(self.chain)
        else:
            # a conversation new to the store: its first request may hold results the model
            # answered after (a client's history from before this layer): rebuilt by where
            # they stand, as a new process would, they go as they were sent -- whole
            loaded = Transcript(path=Path(self.storage.location), messages=[])
        self._calibration = calibration_path_for(root, self.storage.session_id, self.storage.branch)
        if "token_tracker" not in context:
            # a branch made again by its name (let go, then asked for) has its own calibration
            own = inherited is None or inherited.tracker is None or self._calibration.exists()
            if own:
                context["token_tracker"] = load_calibration(self._calibration)
            else:
                assert inherited is not None and inherited.tracker is not None
                context["token_tracker"] = TokenTracker.from_state_dict(inherited.tracker)
        context.setdefault("store", self.storage.store)
        self.ctx = SessionContext(
            self.session_id,
            root,
            transcript=self.storage.records,
            stage_records=loaded.stage_records if loaded is not None else (),
            **context,
        )
        self.sync_lock = threading.Lock()
        """Held by a synchronous caller around each call's pass and observation (threads of
        one client may share a conversation)."""
        self._observing = anyio.Lock(fast_acquire=True)
        # the context, not the session: a session in a reference cycle of its own waits for the
        # collector when it is let go, with everything it holds
        ctx = self.ctx
        saves = CalibrationSaves(self._calibration, lambda: ctx.token_tracker.state_dict())
        self.writes = SessionWrites(self.storage, saves, self.ctx)
        """What it writes and makes durable (:mod:`pipeline.dropin.session_writes`)."""
        self._restored: Transcript | None = loaded
        self._responses = responses_in(loaded.stage_records) if loaded is not None else {}
        self._params: list[Any] = []
        self._records: list[Message] = []
        self._first_new = 0
        """Where the last request prepared stopped repeating the one before."""
        self._wire = WireCache()
        self._fields = MessageFields()
        self._projected: list[Message] = []
        self._unwritten: tuple[dict[str, Any], Sequence[bytes]] | None = None
        """A response's record (and the chain it leaves) held back by ``observe_async(...,
        defer=True)``: see :meth:`catch_up`."""
        self._unlearned: list[tuple[Usage, str, bool]] = []
        """Responses' usage observed with ``defer``, not yet learned from, in their order."""
        self._unread: dict[object, None] = {}
        self._read: anyio.Event | None = None
        """Responses gone to their client before they were observed (:meth:`answer_out`), and
        what the next pass waits on while there are any."""
        self._calls = 0
        self.last_call: Call | None = None
        """The request :meth:`prepare` prepared last (what :meth:`observe` records by
        default)."""
        self.rederive = self.storage.shared and self.storage.drain is not None and self._served
        """Whether a result the model answered after that no record decided is decided again
        by the budget (as whoever served its call decided it: the decision depends on the
        result and its message alone), rather than counted as sent whole. True for a
        conversation of a shared store with a spool (where a persist never falls back to
        sending a result whole, which a later decision would then contradict) whose records
        show it served calls (a gap in them is a
        record another worker could not write, not a result sent before this layer) and for
        one whose records could not be read (set by the caller); False otherwise: a
        conversation new to the store (or a branch's first request) may carry results the
        model saw whole before this layer."""
        self.elsewhere: Decided | None = None
        """How the other conversations of this one's family decided results (their ledger
        keys): set by :class:`~pipeline.dropin.conversations.Conversations`; None alone."""

    @classmethod
    async def open(
        cls,
        session_id: str,
        root: str | Path,
        pipeline: Pipeline,
        *,
        storage: SessionStorage | str | None = None,
        **options: Any,
    ) -> WireSession:
        """A session as the constructor makes it, its recorded decisions loaded in a worker
        thread (an object store's listing and reads must not hold up the event loop).
        ``OSError`` (:class:`~pipeline.store.files.StoreError`) when the store cannot be read."""
        sid = validate_session_id(session_id)
        resolved = cls._storage_for(sid, root, storage)
        loaded = await anyio.to_thread.run_sync(resolved.load)
        if "token_tracker" not in options:  # a local file, but a read all the same
            path = calibration_path_for(root, resolved.session_id, resolved.branch)
            options["token_tracker"] = await anyio.to_thread.run_sync(load_calibration, path)
        return cls(sid, root, pipeline, storage=resolved, loaded=loaded, **options)

    @staticmethod
    def _storage_for(
        session_id: str, root: str | Path, storage: SessionStorage | str | None
    ) -> SessionStorage:
        if not isinstance(storage, SessionStorage):
            # a root is a directory, whatever it looks like: a URL must come as ``storage``
            where = Path(root) if storage is None else storage
            return open_session_state(where, session_id)
        named = storage.session_id
        if storage.branch is not None:
            named = f"{named}.{storage.branch}"
        if named != session_id:
            raise ValueError(f"storage is for session {named!r}, not {session_id!r}")
        return storage

    # -- per call ---------------------------------------------------------------------------
    async def prepare(self, messages: Sequence[MessageParam]) -> list[MessageParam]:
        """The ``messages`` to send for a request whose own are ``messages``."""
        return (await self._prepare(messages))[0]

    async def _prepare(
        self, messages: Sequence[MessageParam], marked: bool = False
    ) -> tuple[list[MessageParam], Call]:
        await self._answers_in()
        await self.catch_up()  # what the last response left for later, first
        if self._pending is not None:
            async with self.ctx.lock:  # before any other record of this session
                if self._pending is not None:
                    await anyio.to_thread.run_sync(self._write_pending)
        records = self._sync(messages)
        call = self.last_call
        assert call is not None
        rebuilt = False
        if self._restored is not None:
            async with self.ctx.lock:  # one rebuild, whatever other call of it runs
                restored = self._restored
                if restored is not None:
                    # off the event loop: a long conversation's records are many
                    state, placed = await anyio.to_thread.run_sync(rebuild, records, restored)
                    self.ctx.replacement_state = state
                    self._restored = None
                    rebuilt = True
                    if placed:
                        await self._place_answered(placed)
        # a result new to this conversation that stands before the model's last answer was
        # sent before (by the conversation this request also belongs to, or the client before
        # this layer): as a new process would, it goes whole -- a fresh decision here would
        # send what the model never saw in that form
        state = self.ctx.replacement_state
        # just rebuilt, the ledger holds what the thread answered -- unless a re-derivation
        # left some fresh, to be looked up again
        rebuilt = rebuilt and not self.rederive
        placed = answered_results(records, self._first_new, rebuilt=rebuilt) - state.seen_ids
        placed -= state.replacements.keys()
        if placed:
            await self._place_answered(placed)
        self._projected = await self.pipeline.run(records, self.ctx)
        # the new messages the client sent as they are: their own dicts
        request = self._wire.to_api(
            self._projected, given=messages[self._first_new :], fields=self._fields.by_name
        )
        if self.cache_breakpoint and not marked and not self._wire.breakpoints:
            add_cache_breakpoint(request)  # the client set none: ask for the prefix cache
        return request, call

    def request_span(
        self, messages: int, *, context: Context | None = None
    ) -> AbstractContextManager[Span]:
        """The span of one client request (its pipeline pass becomes a child), numbered within
        the session as this process saw it, current while the ``with`` lasts; ``context``: the
        one to start it in (default: the current one). :class:`~pipeline.dropin.wire_request.
        WireRequest` keeps one open until the response has gone by."""
        self.ctx.call = self._calls
        self._calls += 1
        return content_safe_span(
            self.ctx.tracer,
            SPAN_WIRE_REQUEST,
            context=context,
            attributes={**self.ctx.span_attributes(), ATTR.MESSAGES: messages},
        )

    def start_request_span(self, messages: int, *, context: Context | None = None) -> Span:
        """:meth:`request_span`, started and not made current (the caller ends it)."""
        self.ctx.call = self._calls
        self._calls += 1
        return self.ctx.tracer.start_span(
            SPAN_WIRE_REQUEST,
            context=context,
            attributes={**self.ctx.span_attributes(), ATTR.MESSAGES: messages},
            record_exception=False,
            set_status_on_exception=False,
        )

    def first_pass(self, body: Mapping[str, Any]) -> int:
        """How many messages this session's first pass in this process would take for ``body``
        (a conversation met first, or resumed after a restart: all of them); 0 once it has
        prepared a request -- then an observation of its last response may still be under way,
        which a pass run on another thread must not overlap."""
        messages = body.get("messages")
        if not isinstance(messages, list) or self._params or self._unread:
            return 0  # (an answer to read: the pass waits for it on this loop)
        return len(messages)

    async def prepare_request(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``body`` with its ``messages`` prepared (everything else as it was); its system
        prompt and tools are counted by the token tracker. Its :class:`Call` is
        :attr:`last_call` once prepared."""
        return (await self.prepare_call(body))[0]

    async def prepare_call(self, body: Mapping[str, Any]) -> tuple[dict[str, Any], Call]:
        """:meth:`prepare_request`, and the :class:`Call` its response is to be observed with
        (``observe(..., call=...)``), whatever other request of this session is prepared
        meanwhile."""
        await self._answers_in()  # the last response read, then learned from under its request
        await self.catch_up()
        self.ctx.token_tracker.set_request(system=body.get("system"), tools=body.get("tools"))
        marked = self.cache_breakpoint and marked_outside_messages(body)
        messages, call = await self._prepare(body.get("messages") or [], marked)
        return {**body, "messages": messages}, call
