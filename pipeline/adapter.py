"""A conversation as it arrives at the wire: a Messages request in, the request to send out.

A client that already has its loop (the SDK, a proxy in front of any program) re-sends its own,
unmodified history on every call. :class:`WireSession` turns each request's ``messages`` into
records, runs the pipeline with the conversation's :class:`~pipeline.context.SessionContext`
and gives back the ``messages`` to send. It is the layer ``wrap`` and the proxy stand on;
which conversation a request belongs to is :mod:`pipeline.conversations`' business.

- **Stable records.** A message equal to the one at the same position in the last request is
  the same record object (the stages' incremental passes rest on identity); a new one gets a
  uuid derived from its position and content (breakpoints aside), so the same history gives
  the same records in another process and in a conversation that went another way from this
  one. Assistant messages carry no id on the wire: the response id and usage the session
  observed are attached to the message that answered it.
- **Decisions stay.** Earlier decisions are re-applied byte for byte (prefix-stable); they are
  recorded in ``<root>/<session>/decisions.jsonl`` (replacement and stage records, responses,
  the digests of the messages the conversation sent), or wherever the session's ``storage``
  keeps records (an object store shared by a fleet:
  :func:`~pipeline.session_storage.open_session_state`), so a new process continues with the
  same decisions.
- **A conversation that goes another way** from a point of this one (a client's fork, an edit,
  a rewind) starts from this one's decisions: :meth:`WireSession.inherit` gives them, and a
  session made with them (``inherited=``) sends the same bytes for the part they share; they are
  written as the first record of its own log, so it is whole on its own.
- **Cost.** Per call: one equality check per message (C-level) plus the new messages; the
  pipeline and the request building are incremental as in the agent loop.
- **Off the event loop.** :meth:`WireSession.open` loads the recorded decisions in a worker
  thread and :meth:`WireSession.observe_async` appends in one (an object store's request, a
  file's fsync); the stages' own appends already run there. The constructor and
  :meth:`WireSession.observe` do the same inline, for synchronous callers.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import threading
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from pipeline.caching import add_cache_breakpoint
from pipeline.context import SessionContext
from pipeline.core import Pipeline
from pipeline.event_stream import EventStreamUsage  # public here before it had a module
from pipeline.messages import Message, Usage
from pipeline.replacement import (
    DECIDED_RECORD_STAGE,
    ReplacementRecord,
    ReplacementState,
    decided_in,
    decided_record,
    tool_use_id_of,
)
from pipeline.session_storage import DECISIONS_FILE, SessionStorage, open_session_state
from pipeline.spans import content_safe_span
from pipeline.storage import validate_session_id
from pipeline.tokens import TokenTracker, calibration_path_for
from pipeline.tracing import ATTR, SPAN_WIRE_REQUEST
from pipeline.transcript import StageRecord, Transcript
from pipeline.wire_cache import WireCache

if TYPE_CHECKING:
    from anthropic.types import MessageParam
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

__all__ = [
    "DECISIONS_FILE",
    "FORK_RECORD",
    "EventStreamUsage",
    "Inherited",
    "WireSession",
    "beta_header",
]

RESPONSE_RECORD = "wire_session.response"
"""The stage record of an observed response: where its answer stands, its id and usage, and
the digests of the request's messages from where they changed (``chain_from``, ``chain``)."""
FORK_RECORD = "wire_session.fork"
"""The first record of a conversation that went another way from another: what it inherited."""
_NAMESPACE = uuid.UUID("5b2f0e6c-3d1a-4c7e-9a41-7e0c2d9b6f13")


def beta_header(given: str | None, betas: Iterable[str]) -> str:
    """An ``anthropic-beta`` value holding the client's betas and the ones a stage asked for."""
    return ",".join(sorted({*betas, *filter(None, (given or "").split(","))}))


class _Load(enum.Enum):
    NOW = "now"
    """Load the recorded decisions in the constructor (blocking)."""


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _without_breakpoints(content: Any) -> Any:
    """Content less its blocks' ``cache_control`` (a client moves its breakpoints)."""
    if not isinstance(content, list):
        return content
    return [
        {k: v for k, v in b.items() if k != "cache_control"}
        if isinstance(b, Mapping) and "cache_control" in b
        else b
        for b in content
    ]


@dataclass(slots=True)
class Inherited:
    """What a conversation that went another way from another starts from: the other's
    decisions (replacement records, stage records, the responses it observed before the point
    they share), its token tracker's state and the digests of the messages they share."""

    parent: str
    at: int
    """How many messages the two share."""
    replacement_records: list[ReplacementRecord] = field(default_factory=list)
    stage_records: list[StageRecord] = field(default_factory=list)
    chain: list[bytes] = field(default_factory=list)
    tracker: dict[str, Any] | None = None

    def to_record(self) -> dict[str, Any]:
        """The data of the :data:`FORK_RECORD` that makes a log whole on its own."""
        return {
            "parent": self.parent,
            "at": self.at,
            "replacements": [r.to_json() for r in self.replacement_records],
            "stages": [[r.stage, dict(r.data)] for r in self.stage_records],
            "chain": [c.hex() for c in self.chain],
        }

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> Inherited:
        """Parse a :data:`FORK_RECORD`'s data; ``ValueError`` naming what is wrong."""
        parent, at = data.get("parent"), data.get("at")
        replacements, stages, chain = (
            data.get("replacements"),
            data.get("stages"),
            data.get("chain"),
        )
        if not isinstance(parent, str) or not isinstance(at, int) or isinstance(at, bool):
            raise ValueError("fork record: bad parent or position")
        if not (isinstance(replacements, list) and isinstance(stages, list)):
            raise ValueError("fork record: replacements and stages must be lists")
        if not isinstance(chain, list) or not all(isinstance(c, str) for c in chain):
            raise ValueError("fork record: chain must be a list of hex digests")
        records = [ReplacementRecord.from_json(r) for r in replacements if isinstance(r, Mapping)]
        stage_records = [
            StageRecord(s[0], s[1])
            for s in stages
            if isinstance(s, list) and len(s) == 2 and isinstance(s[0], str)
            and isinstance(s[1], Mapping) and s[0] != FORK_RECORD
        ]  # fmt: skip
        try:
            digests = [bytes.fromhex(c) for c in chain]
        except ValueError:
            raise ValueError("fork record: chain holds a digest that is not hex") from None
        return cls(parent, at, records, stage_records, digests)


class WireSession:
    """One conversation seen at the wire (see the module docstring).

    ``cache_breakpoint``: for a client that sets no ``cache_control`` itself, put one on the
    last block (a client's own breakpoints are always left alone). ``storage``: where the
    session's results and decisions live -- a :class:`~pipeline.session_storage.SessionStorage`
    or a location for :func:`~pipeline.session_storage.open_session_state` (``s3://...``);
    by default the files under ``root``. ``root`` also holds the token calibration (always a
    local directory: each host learns its own). ``loaded``: the records ``storage.load()``
    returned, when the caller has loaded them (:meth:`open` does so off the event loop); by
    default the constructor loads them. ``inherited``: the decisions of the conversation this
    one went another way from (:meth:`inherit`): written as the first record of this session's
    log on its first call, unless its log already holds records (another worker made it).
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
        **context: Any,
    ) -> None:
        self.session_id = validate_session_id(session_id)
        self.pipeline = pipeline
        self.cache_breakpoint = cache_breakpoint
        self.storage = self._storage_for(self.session_id, root, storage)
        if isinstance(loaded, _Load):
            loaded = None if inherited is not None else self.storage.load()
        self.chain: list[bytes] = []
        """The digests of the messages of the last request this conversation was routed
        (see :mod:`pipeline.conversations`)."""
        self._chain_dirty = 0
        """From where :attr:`chain` differs from what the records hold."""
        self._chain_on_disk = 0
        """How long the chain the records hold is."""
        self._pending: Inherited | None = None
        if loaded is None and inherited is not None:
            self._pending = inherited
            loaded = Transcript(
                path=Path(self.storage.location),
                messages=[],
                replacement_records=list(inherited.replacement_records),
                stage_records=list(inherited.stage_records),
            )
            self.chain = list(inherited.chain)
            self._chain_dirty = self._chain_on_disk = len(self.chain)  # its fork record holds it
        elif loaded is not None:
            loaded = self._expand(loaded)
        self._calibration = calibration_path_for(root, self.storage.session_id, self.storage.branch)
        if "token_tracker" not in context:
            if inherited is not None and inherited.tracker is not None:
                context["token_tracker"] = TokenTracker.from_state_dict(inherited.tracker)
            else:
                context["token_tracker"] = TokenTracker.load(self._calibration)
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
        self._restored = loaded
        self._responses: dict[int, tuple[str, Usage | None]] = {}
        if loaded is not None:
            self._restore_responses(loaded.stage_records)
        self._params: list[Any] = []
        self._records: list[Message] = []
        self._wire = WireCache()
        self._projected: list[Message] = []
        self._calls = 0

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
        ``OSError`` (:class:`~pipeline.storage.StoreError`) when the store cannot be read."""
        sid = validate_session_id(session_id)
        resolved = cls._storage_for(sid, root, storage)
        loaded = await anyio.to_thread.run_sync(resolved.load)
        if "token_tracker" not in options:  # a local file, but a read all the same
            path = calibration_path_for(root, resolved.session_id, resolved.branch)
            options["token_tracker"] = await anyio.to_thread.run_sync(TokenTracker.load, path)
        return cls(sid, root, pipeline, storage=resolved, loaded=loaded, **options)

    @staticmethod
    def _storage_for(
        session_id: str, root: str | Path, storage: SessionStorage | str | None
    ) -> SessionStorage:
        if not isinstance(storage, SessionStorage):
            # a root is a directory, whatever it looks like: a URL must come as ``storage``
            where = Path(root) if storage is None else storage
            return open_session_state(where, session_id)
        named = (
            storage.session_id
            if storage.branch is None
            else f"{storage.session_id}.{storage.branch}"
        )
        if named != session_id:
            raise ValueError(f"storage is for session {named!r}, not {session_id!r}")
        return storage

    def _expand(self, loaded: Transcript) -> Transcript:
        """``loaded`` with what a fork record at its start inherited put in its place, and the
        chain of the messages it recorded sending (the inherited part, then its own calls')."""
        records = loaded.stage_records
        fork = next((r for r in records if r.stage == FORK_RECORD), None)
        own = [r for r in records if r.stage != FORK_RECORD]
        if fork is not None:
            try:
                got = Inherited.from_record(fork.data)
            except ValueError as exc:
                got = None
                self._log_unreadable(str(exc))
            if got is not None:
                loaded = dataclasses.replace(
                    loaded,
                    replacement_records=[*got.replacement_records, *loaded.replacement_records],
                    stage_records=[*got.stage_records, *own],
                )
                self.chain = list(got.chain)
            else:
                loaded = dataclasses.replace(loaded, stage_records=own)
        for record in own:
            if record.stage == RESPONSE_RECORD:
                self._restore_chain(record.data)
        self._chain_dirty = self._chain_on_disk = len(self.chain)
        return loaded

    def _log_unreadable(self, reason: str) -> None:
        from pipeline.logs import get_logger

        get_logger(session_id=self.session_id).warning(
            "wire_session.record_unreadable", record=FORK_RECORD, reason=reason[:200]
        )

    def _restore_chain(self, data: Mapping[str, Any]) -> None:
        start, digests = data.get("chain_from"), data.get("chain")
        if not isinstance(start, int) or isinstance(start, bool) or not isinstance(digests, list):
            return
        if not 0 <= start <= len(self.chain):
            return
        try:
            parsed = [bytes.fromhex(d) for d in digests if isinstance(d, str)]
        except ValueError:
            return
        self.chain[start:] = parsed

    def set_chain(self, chain: list[bytes], changed_from: int) -> None:
        """The digests of the request being routed here (see :mod:`pipeline.conversations`);
        ``changed_from``: the first position that differs from :attr:`chain`. Recorded with
        the request's response."""
        self.chain = chain
        self._chain_dirty = min(self._chain_dirty, changed_from, len(chain))

    # -- a conversation that goes another way ------------------------------------------------
    def inherit(self, at: int, results: Collection[str] | None = None) -> Inherited:
        """What a conversation that shares this one's first ``at`` messages, then goes another
        way, starts from: this one's decisions on the results it holds (``results``: their
        ledger keys, :func:`~pipeline.replacement.result_key`; default all; a decision applies
        only to the output it was made on), the responses this one observed for the shared part
        and its token tracker's state. A copy: nothing of it changes with this session."""
        restored = self._restored
        if restored is not None:  # loaded, not yet rebuilt: its records are the ledger
            replacements = list(restored.replacement_records)
            decided: list[StageRecord] = []
        else:
            state = self.ctx.replacement_state
            replacements = [
                ReplacementRecord(tid, text, digest=key[len(tid) + 1 :] or None)
                for key, text in state.replacements.items()
                for tid in (tool_use_id_of(key),)
            ]
            seen = state.seen_ids if results is None else state.seen_ids & set(results)
            decided = [StageRecord(DECIDED_RECORD_STAGE, decided_record(seen))] if seen else []
        if results is not None:
            keep = set(results)
            ids = {tool_use_id_of(k) for k in keep}
            replacements = [
                r for r in replacements if (r.key in keep if r.digest else r.tool_use_id in ids)
            ]
        stages = [
            r
            for r in self.ctx.stage_records
            if r.stage != FORK_RECORD
            and not (r.stage == RESPONSE_RECORD and _index_of(r.data) >= at)
        ]
        return Inherited(
            parent=self.session_id,
            at=at,
            replacement_records=replacements,
            stage_records=[*stages, *decided],
            chain=self.chain[:at],
            tracker=self.ctx.token_tracker.state_dict(),
        )

    def _write_pending(self) -> None:
        """Make this session's log whole on its own before anything else goes into it: the
        fork record of what it inherited -- unless its log already holds records (another
        worker made the same conversation first), which then win."""
        pending, self._pending = self._pending, None
        if pending is None or self.ctx.transcript is None:
            return
        try:
            found = self.storage.load()
        except OSError:
            found = None
        if found is not None and (found.stage_records or found.replacement_records):
            current = self.chain
            self._restored = self._expand(found)
            self.ctx.stage_records = list(self._restored.stage_records)
            self._responses.clear()
            self._restore_responses(self._restored.stage_records)
            self.chain, self._chain_dirty = current, 0  # recorded again, whole
            return
        try:
            self.ctx.transcript.append_stage_record(FORK_RECORD, pending.to_record())
        except OSError as exc:
            self.ctx.logger.error(
                "stage_record.write_failed", stage=FORK_RECORD, error=type(exc).__name__
            )

    # -- per call ---------------------------------------------------------------------------
    async def prepare(self, messages: Sequence[MessageParam]) -> list[MessageParam]:
        """The ``messages`` to send for a request whose own are ``messages``."""
        if self._pending is not None:
            async with self.ctx.lock:  # once, before any other record of this session
                if self._pending is not None:
                    await anyio.to_thread.run_sync(self._write_pending)
        records = self._sync(messages)
        if self._restored is not None:
            # a new process, or a conversation that went another way: the ledger from the
            # recorded decisions and this history
            self.ctx.replacement_state = ReplacementState.reconstruct(
                records,
                self._restored.replacement_records,
                decided=decided_in(self._restored.stage_records),
            )
            self._restored = None
        self._projected = await self.pipeline.run(records, self.ctx)
        request = self._wire.to_api(self._projected)
        if self.cache_breakpoint and not self._wire.breakpoints:
            add_cache_breakpoint(request)  # the client set none: ask for the prefix cache
        return request

    def request_span(
        self, messages: int, *, context: Context | None = None
    ) -> AbstractContextManager[Span]:
        """The span of one client request (its pipeline pass becomes a child), numbered within
        the session as this process saw it; ``context``: the one to start it in (default: the
        current one)."""
        self.ctx.call = self._calls
        self._calls += 1
        return content_safe_span(
            self.ctx.tracer,
            SPAN_WIRE_REQUEST,
            context=context,
            attributes={**self.ctx.span_attributes(), ATTR.MESSAGES: messages},
        )

    async def prepare_request(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``body`` with its ``messages`` prepared (everything else as it was); its system
        prompt and tools are counted by the token tracker."""
        self.ctx.token_tracker.set_request(system=body.get("system"), tools=body.get("tools"))
        return {**body, "messages": await self.prepare(body.get("messages") or [])}

    def observe(self, response_id: str, usage: Mapping[str, Any] | None, model: str) -> None:
        """The response to the last prepared request: its usage feeds the token tracker, and
        the message that answers it in the next request carries its id and usage. The record
        and the calibration are written inline (blocking): on an event loop, use
        :meth:`observe_async`. Takes :attr:`sync_lock` (another thread may be preparing a
        call of the same conversation)."""
        with self.sync_lock:
            parsed, data = self._response(response_id, usage)
            self._append_response(data)
            if parsed is not None:
                self._learn(parsed, model)
                self.ctx.token_tracker.save(self._calibration)  # a new process starts warm

    async def observe_async(
        self, response_id: str, usage: Mapping[str, Any] | None, model: str
    ) -> None:
        """:meth:`observe` with the writes in a worker thread. It returns once the record is
        written (or has failed, logged): a caller that holds the response back until then
        knows that another worker serving the next call will find it."""
        parsed, data = self._response(response_id, usage)
        await anyio.to_thread.run_sync(self._append_response, data)
        if parsed is not None:
            self._learn(parsed, model)
            # the snapshot taken here: the tracker is not to be read from another thread
            state = self.ctx.token_tracker.state_dict()
            await anyio.to_thread.run_sync(TokenTracker.save_state, self._calibration, state)

    def _response(
        self, response_id: str, usage: Mapping[str, Any] | None
    ) -> tuple[Usage | None, dict[str, Any]]:
        """Remember a response for the message that will answer it; its usage (``ValueError``
        when malformed) and the record to append."""
        parsed = Usage.from_mapping(usage) if usage is not None else None
        index = len(self._params)  # where the answer stands in the next request
        self._responses[index] = (response_id, parsed)
        data: dict[str, Any] = {"index": index, "id": response_id}
        if usage is not None:
            data["usage"] = dict(usage)
        start = self._chain_dirty
        if start < len(self.chain) or start < self._chain_on_disk:
            # the messages this conversation sent, for a new process or another worker to
            # know it by (see pipeline.conversations)
            data["chain_from"] = start
            data["chain"] = [c.hex() for c in self.chain[start:]]
            self._chain_dirty = self._chain_on_disk = len(self.chain)
        return parsed, data

    def _append_response(self, data: dict[str, Any]) -> None:
        if self.ctx.transcript is None:
            return
        try:
            self.ctx.transcript.append_stage_record(RESPONSE_RECORD, data)
        except OSError as exc:
            # the response was delivered: only another worker or a new process would miss its
            # id and usage
            self.ctx.logger.error(
                "stage_record.write_failed", stage=RESPONSE_RECORD, error=type(exc).__name__
            )

    def _learn(self, usage: Usage, model: str) -> None:
        self.ctx.token_tracker.observe(
            self._projected, usage, model=model, tokens_freed=self.ctx.report.tokens_freed
        )

    # -- records ----------------------------------------------------------------------------
    def _sync(self, messages: Sequence[Any]) -> list[Message]:
        prev, records = self._params, self._records
        out: list[Message] = []
        for i, param in enumerate(messages):
            if i < len(prev) and prev[i] == param:
                out.append(records[i])  # the same record: the stages' work on it stands
            else:
                out.append(self._record(i, param))
        self._params, self._records = list(messages), out
        return out

    def _record(self, index: int, param: Any) -> Message:
        try:
            record = Message.from_param(param)
        except ValueError as exc:
            raise ValueError(f"messages[{index}]: {exc}") from None
        digest = _digest([record.type, _without_breakpoints(record.content)])
        # position and content only: the same in a new process, and in a conversation that
        # went another way from this one (stages' decisions name records by uuid)
        uid = str(uuid.uuid5(_NAMESPACE, f"{index}\x00{digest}"))
        if record.type == "user":
            return dataclasses.replace(record, uuid=uid)
        # an answer this session did not observe: an id of its own place, so that two equal
        # answers (a model repeating a call with the same id) stay two messages
        unseen = f"msg_wire_{uid.replace('-', '')[:24]}"
        response_id, usage = self._responses.get(index, (unseen, None))
        return dataclasses.replace(record, uuid=uid, message_id=response_id, usage=usage)

    def _restore_responses(self, records: Iterable[StageRecord]) -> None:
        for record in records:
            if record.stage == RESPONSE_RECORD:
                self._restore_response(record.data)

    def _restore_response(self, data: Mapping[str, Any]) -> None:
        index, rid, usage = data.get("index"), data.get("id"), data.get("usage")
        if not isinstance(index, int) or not isinstance(rid, str):
            return
        try:
            parsed = Usage.from_mapping(usage) if isinstance(usage, Mapping) else None
        except ValueError:
            parsed = None
        self._responses[index] = (rid, parsed)


def _index_of(data: Mapping[str, Any]) -> int:
    index = data.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else -1
