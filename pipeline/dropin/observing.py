"""What a conversation's responses do to it: the part of
:class:`~pipeline.dropin.adapter.WireSession` that observes each response and makes what it
wrote durable.

- **Observed.** A response's id and usage are kept for the message that will answer it in the
  next request, its record is appended (the digests of the messages it answered with it, so
  another worker or a new process places it), and the token tracker learns from its usage.
- **In order, off the response's path.** ``observe_async(..., defer=True)`` leaves what need
  not come before the client has the response (the learning; on a store of this process
  alone, the record) to :meth:`ResponseObserving.catch_up`, which the next pass, the next
  observation and :meth:`ResponseObserving.settle` call first.
- **Answers out.** A JSON answer the proxy passes on before reading it
  (:meth:`ResponseObserving.answer_out`) holds the conversation's next pass until it is read,
  at most :data:`ANSWER_WAIT` seconds.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from pipeline.context import SessionContext
from pipeline.dropin.group_sync import GroupSync
from pipeline.dropin.inheritance import Inherited
from pipeline.dropin.session_log import RESPONSE_RECORD, Responses, response_record
from pipeline.dropin.session_writes import SessionWrites
from pipeline.dropin.thread_sync import ThreadSync
from pipeline.kept_list import shared_start
from pipeline.messages import Message, Usage, usage_compacted
from pipeline.store.records import append_where_it_belongs, appends_block
from pipeline.store.sessions import SessionStorage

__all__ = ["ANSWER_WAIT", "Call", "ResponseObserving"]

ANSWER_WAIT = 30.0
"""Seconds a conversation's next pass waits at most for an answer its client already has to
be read (:meth:`ResponseObserving.answer_out`); then it goes on without it (logged)."""


@dataclass(frozen=True, slots=True)
class Call:
    """One prepared request, as its response is to be recorded: where the answer will stand
    and the digests of the request's messages (taken when it was prepared, so that a request of
    the same conversation prepared meanwhile changes neither: the session's list of them at
    that time, which is never changed -- a later request gets a list of its own)."""

    index: int
    chain: Sequence[bytes]


class ResponseObserving:
    """The responses of one conversation (a mixin of
    :class:`~pipeline.dropin.adapter.WireSession`, which sets every attribute below)."""

    ctx: SessionContext
    storage: SessionStorage
    writes: SessionWrites
    sync_lock: threading.Lock
    last_call: Call | None
    chain: list[bytes]
    _observing: anyio.Lock
    _params: list[Any]
    _projected: list[Message]
    _disk_chain: Sequence[bytes]
    _pending: Inherited | None
    _responses: Responses
    _unwritten: tuple[dict[str, Any], Sequence[bytes]] | None
    _unlearned: list[tuple[Usage, str, bool]]
    _unread: dict[object, None]
    _read: anyio.Event | None

    def answer_out(self) -> object:
        """A response of this session goes to its client before it is observed (the proxy
        reads a JSON answer once its client has it): the session's next pass waits until
        :meth:`answer_read` is given the token returned here, so that it knows the answer and
        writes its records after the answer's. On the session's event loop."""
        token = object()
        self._unread[token] = None
        if self._read is None:
            self._read = anyio.Event()
        return token

    @property
    def records_wait(self) -> bool:
        """Whether a response's record may be written after its client has the response: on
        a local store whose appends are page-cache writes (made durable later; another writer
        sharing the directory finds the record as news once it is written); not on an object
        store (another worker must find it first) nor where each record is to be durable
        before the proxy goes on (``fsync_each``)."""
        return not self.storage.shared and not appends_block(self.ctx.transcript)

    @property
    def answers_out(self) -> bool:
        """Whether a response :meth:`answer_out` told of is still to be read (the
        conversation is then not let go from memory: its next request must find it here)."""
        return bool(self._unread)

    def answer_read(self, token: object) -> None:
        """The response :meth:`answer_out` gave ``token`` for was observed (or will not be);
        one given up on already (:data:`ANSWER_WAIT`) is nothing more."""
        self._unread.pop(token, None)
        if not self._unread:
            self._answers_all_in()

    def _answers_all_in(self) -> None:
        read, self._read = self._read, None
        if read is not None:
            read.set()

    async def _answers_in(self) -> None:
        if self._read is None:
            return
        # bounded: an answer is read once its bytes are handed to the server, which does not
        # wait for the client to take them; past the bound the pass goes on without those
        # answers, as for answers the conversation never saw, and no later pass waits for them
        with anyio.move_on_after(ANSWER_WAIT) as waited:
            while (read := self._read) is not None:
                await read.wait()
        if waited.cancelled_caught:
            self.ctx.logger.warning(
                "wire_session.answer_not_read", answers=len(self._unread), seconds=ANSWER_WAIT
            )
            self._unread.clear()
            self._answers_all_in()

    def observe(
        self,
        response_id: str,
        usage: Mapping[str, Any] | None,
        model: str,
        *,
        call: Call | None = None,
    ) -> None:
        """The response to a prepared request (``call``, default :attr:`last_call`): its usage
        feeds the token tracker, and the message that answers it in the next request carries
        its id and usage. The record and the calibration are written inline (blocking): on an
        event loop, use :meth:`observe_async`. Takes :attr:`sync_lock` (another thread may be
        preparing a call of the same conversation)."""
        with self.sync_lock:
            self.catch_up_sync()
            parsed, data, chain = self._response(response_id, usage, call)
            if self._append_response(data):
                self._written(data, chain)
            if parsed is not None:
                self._learn(parsed, model, usage_compacted(usage or {}))
                if state := self.writes.learned():
                    self.writes.saves.write(state)  # a new process starts warm

    async def observe_async(
        self,
        response_id: str,
        usage: Mapping[str, Any] | None,
        model: str,
        *,
        call: Call | None = None,
        defer: bool = False,
    ) -> None:
        """:meth:`observe` with the writes in a worker thread. It returns once the record is
        written (or has failed, logged): a caller that holds the response back until then
        knows that another worker serving the next call will find it.

        ``defer``: for a caller that holds the response back until this returns and calls
        :meth:`settle` once the client has it (the proxy). What need not come first waits for
        :meth:`catch_up` (which :meth:`settle`, the session's next pass and its next
        observation call first): the token tracker's learning, and, on a store no other
        worker writes to whose appends are page-cache writes (made durable by :meth:`settle`
        anyway), the response's record -- kept in order before any later record."""
        await self.catch_up()  # an earlier response's, in the order they came
        async with self._observing:  # one record at a time: each builds on the last one's chain
            parsed, data, chain = self._response(response_id, usage, call)
            if defer and self.records_wait:
                self._unwritten = (data, chain)
            elif await append_where_it_belongs(self.ctx.transcript, self._append_response, data):
                self._written(data, chain)
        if parsed is not None:
            # after any other's observed meanwhile (its record written in a worker thread)
            self._unlearned.append((parsed, model, usage_compacted(usage or {})))
            if not defer:
                await self.catch_up()

    async def catch_up(self) -> None:
        """Do what :meth:`observe_async` with ``defer`` left for later, unless done: write the
        response's record, then let the token tracker learn from its usage (the calibration
        written in a worker thread when no :meth:`settle` writes it)."""
        if self._unwritten is None and not self._unlearned:
            return
        if self.catch_up_sync() and (state := self.writes.learned()):
            await anyio.to_thread.run_sync(self.writes.saves.write, state)  # else by settle()

    def catch_up_sync(self) -> bool:
        """:meth:`catch_up`'s record and learning, blocking (an append to a local file: nothing
        is held back for any other store), the calibration left to the caller; whether the
        tracker learned. What it refuses to learn from (``ValueError``: content nested past
        what it can measure) leaves it as it was. For a conversation let go from memory too,
        whose next request loads it from its records."""
        unwritten, self._unwritten = self._unwritten, None
        if unwritten is not None and self._append_response(unwritten[0]):
            self._written(*unwritten)
        else:
            self.writes.flush_held()  # what the pass held back goes with the next write anyway
        unlearned, self._unlearned = self._unlearned, []
        learned = False
        for usage, model, compacted in unlearned:
            try:
                self._learn(usage, model, compacted)
            except ValueError:
                continue
            learned = True
        return learned

    async def save_calibration(self) -> None:
        """Write the token calibration now if it learned since its last write (a worker
        thread writes it). For a server shutting down or a conversation loaded again: writes
        are spaced :data:`~pipeline.dropin.calibration.CALIBRATION_EVERY` apart otherwise."""
        await self.catch_up()
        self.writes.flush_held()  # what a pass held back, when no response came to go with it
        await self.writes.save_calibration()

    async def settle(self, group: GroupSync | None = None) -> None:
        """Make what this session wrote so far durable, off the response's path: its records
        (a local store opened with ``fsync_each=False``: one ``fsync`` for the call's appends)
        and the token calibration (:mod:`pipeline.dropin.calibration`); and, on an object
        store, write what its spool holds (results persisted while it was down) and the
        call's records as a snapshot (:mod:`pipeline.store.object_snapshots`). Nothing to do
        on a local store whose appends were each durable. A failure is logged, never raised
        (the response has gone). ``group``: when the records' ``fsync`` is all there is to
        do and the group runs, it joins the group's (:mod:`pipeline.dropin.group_sync`) and
        this returns. What the last response left for later is done first
        (:meth:`catch_up`)."""
        await self.catch_up()
        await self.writes.settle(group)

    def settle_sync(self) -> None:
        """:meth:`settle`, blocking (the synchronous client's path)."""
        self.writes.settle_sync()

    def settle_in(self, syncer: ThreadSync) -> bool:
        """:meth:`settle` for a caller that returns the response at once (``wrap``), the
        records' ``fsync`` handed to ``syncer``'s thread: True when that was all there was to
        wait for (a local store; the calibration, when due, is written here), False when the
        caller must still settle (an object store)."""
        self.catch_up_sync()
        return self.writes.settle_in(syncer)

    def _response(
        self, response_id: str, usage: Mapping[str, Any] | None, call: Call | None
    ) -> tuple[Usage | None, dict[str, Any], Sequence[bytes]]:
        """Remember a response for the message that will answer it; its usage (None when it
        has none, or usage the tracker refuses: a float, a negative -- the response is
        recorded without it, logged), the record to append and the chain that record leaves
        on disk."""
        try:
            parsed = Usage.from_mapping(usage) if usage is not None else None
        except ValueError as exc:
            # the field and the rule, never the value (an upstream's to send)
            reason = str(exc).split(", got", 1)[0][:200]
            self.ctx.logger.warning("wire_session.usage_refused", error=reason)
            parsed, usage = None, None
        call = call or self.last_call or Call(len(self._params), self.chain)
        self._responses[call.index] = (response_id, parsed)
        # the call's own list (never changed): the records' chain once written, not a copy
        chain, disk = call.chain, self._disk_chain
        start: int | None = shared_start(chain, disk)
        if start == len(chain) == len(disk):
            start = None  # the records hold this very chain
        # the fork record could not be written: this record carries what it holds
        fork = self._pending.to_record() if self._pending is not None else None
        data = response_record(call.index, response_id, usage, chain, start, fork)
        return parsed, data, chain

    def _written(self, data: Mapping[str, Any], chain: Sequence[bytes]) -> None:
        self._disk_chain = chain
        if "fork" in data:
            self._pending = None

    def _append_response(self, data: dict[str, Any]) -> bool:
        """Whether the record was written (a failure is logged: the response was delivered;
        only another worker or a new process would miss its id and usage)."""
        return self.writes.appended(RESPONSE_RECORD, data)

    def _learn(self, usage: Usage, model: str, compacted: bool) -> None:
        self.ctx.token_tracker.observe(
            self._projected,
            usage,
            model=model,
            tokens_freed=self.ctx.report.tokens_freed,
            compacted=compacted,
        )
