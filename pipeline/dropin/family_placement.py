"""Where a conversation stands in its family: the part of
:class:`~pipeline.dropin.adapter.WireSession` that gives a conversation going another way
what it starts from (:meth:`FamilyPlacement.inherit`), writes what it inherited as the first
record of its own log, and places the results the model answered after that no record of
this conversation decided (what another conversation of the family sent each as, else whole).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import anyio.to_thread

from pipeline.context import SessionContext
from pipeline.dropin.inheritance import FORK_RECORD, Inherited
from pipeline.dropin.session_log import (
    Responses,
    carried_records,
    decisions,
    expand,
    holds_fork,
    responses_in,
)
from pipeline.dropin.session_writes import SessionWrites
from pipeline.replacement import DECIDED_RECORD_STAGE, ReplacementRecord, decided_record
from pipeline.store.records import append_where_it_belongs
from pipeline.store.sessions import SessionStorage
from pipeline.transcript.read import Transcript

__all__ = ["REPLACEMENT_RECORD", "Decided", "FamilyPlacement"]

REPLACEMENT_RECORD = "content-replacement"
"""What a failure to append replacement records is logged as (the transcript's own type)."""


class Decided(Protocol):
    """How a conversation's family decided results elsewhere."""

    def __call__(self, keys: Collection[str]) -> tuple[list[ReplacementRecord], set[str]]:
        """How results were decided (their ledger keys): replacement records, keys sent whole
        (blocking)."""

    def alone(self) -> bool:
        """Whether there is no other conversation to ask (nothing was decided elsewhere)."""


class FamilyPlacement:
    """A conversation within its family (a mixin of
    :class:`~pipeline.dropin.adapter.WireSession`, which sets every attribute below)."""

    session_id: str
    ctx: SessionContext
    storage: SessionStorage
    writes: SessionWrites
    chain: list[bytes]
    rederive: bool
    elsewhere: Decided | None
    _responses: Responses
    _restored: Transcript | None
    _disk_chain: Sequence[bytes]
    _pending: Inherited | None
    _served: bool

    # -- a conversation that goes another way ------------------------------------------------
    def inherit(self, at: int, results: Collection[str] | None = None) -> Inherited:
        """What a conversation that shares this one's first ``at`` messages, then goes another
        way, starts from: this one's decisions on the results it holds (``results``: their
        ledger keys, :func:`~pipeline.results.keys.result_key`; default all; a decision applies
        only to the output it was made on), this one's other stage records (they name records
        by the digest of all before them: they apply only to what the two share), the responses
        this one observed for the shared part and its token tracker's state. A copy, taken
        without waiting for a pass of this session that may be running: its decisions on the
        shared part were made before (the part is older than the pass), and each is bound to
        its output."""
        # whole-object copies first: each is made in one step, whatever another thread does
        stage_records, responses = list(self.ctx.stage_records), dict(self._responses)
        tracker = self.ctx.token_tracker.state_dict()
        records, seen = self.decisions_on(results)
        kept = carried_records(stage_records, responses, seen, at)
        return Inherited(self.session_id, at, records, kept, self.chain[:at], tracker)

    def decisions_on(
        self, results: Collection[str] | None = None
    ) -> tuple[list[ReplacementRecord], set[str]]:
        """This session's decisions on the results whose ledger keys are ``results`` (default
        all): their replacement records, and the keys of those it sent whole. Each lookup is
        one step, whatever another thread does; with ``results``, only those are looked up
        (never a copy of the whole ledger)."""
        return decisions(self._restored, self.ctx.replacement_state, results)

    def _write_pending(self) -> None:
        """Make this session's log whole on its own before anything else goes into it: the
        fork record of what it inherited -- unless its log already holds records (another
        worker made the same conversation first), which then win. A write that fails is tried
        again on the next call."""
        pending = self._pending
        if pending is None or self.ctx.transcript is None:
            self._pending = None
            return
        try:
            found = self.storage.load()
        except OSError:
            found = None
        if found is not None and holds_fork(found):  # another worker made it: its records win
            expanded = expand(found, self.session_id)
            self._restored, self._disk_chain = expanded.transcript, expanded.chain
            self._served = expanded.served
            self.ctx.stage_records = list(self._restored.stage_records)
            self._responses = responses_in(self._restored.stage_records)
            self._pending = None
            return
        if not self.writes.appended(FORK_RECORD, pending.to_record()):
            return
        self._pending = None
        self._disk_chain = list(pending.chain)

    def store_unread(self) -> None:
        """The store could not be read for this conversation (its records may miss calls
        another worker served): from now on it decides what no record tells it of again
        (:attr:`rederive`), where its store has a spool."""
        if self.storage.shared and self.storage.drain is not None:
            self.rederive = True

    async def _place_answered(self, keys: set[str]) -> None:
        """Results the model answered after, that this conversation never decided: what
        another conversation of its family sent each as (:attr:`elsewhere`: a replacement
        bound to the same output -- this client's own, whose request no record placed here),
        else whole (or, with :attr:`rederive`, decided again by the budget). Either way
        recorded, so a new process decides alike."""
        state = self.ctx.replacement_state
        adopted: list[ReplacementRecord] = []
        sent_whole: set[str] = set()
        if self.elsewhere is not None and not self.elsewhere.alone():
            found, sent_whole = await anyio.to_thread.run_sync(self.elsewhere, keys)
            adopted = [r for r in found if r.key in keys and r.key not in state.replacements]
        for record in adopted:
            state.record_replacement(record.key, record.replacement)
        whole = keys - {r.key for r in adopted}
        if self.rederive:
            # left fresh: the budget decides them in this pass, as it did where they were new
            # (what another conversation of the family sent whole stays whole)
            fresh = whole - sent_whole
            state.seen_ids.difference_update(fresh)
            whole -= fresh
        state.seen_ids |= whole
        if adopted:
            await append_where_it_belongs(
                self.ctx.transcript, self.writes.appended, REPLACEMENT_RECORD, adopted
            )
        if whole:
            data = decided_record(sorted(whole))
            await append_where_it_belongs(
                self.ctx.transcript, self.writes.appended, DECIDED_RECORD_STAGE, data
            )
