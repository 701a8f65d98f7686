"""A conversation as it arrives at the wire: a Messages request in, the request to send out.

A client that already has its loop (the SDK, a proxy in front of any program) re-sends its own,
unmodified history on every call. :class:`WireSession` turns each request's ``messages`` into
records, runs the pipeline with the conversation's :class:`~pipeline.context.SessionContext`
and gives back the ``messages`` to send. It is the layer ``wrap`` and the proxy stand on.

- **Stable records.** A message equal to the one at the same position in the last request is
  the same record object (the stages' incremental passes rest on identity); a new one gets a
  uuid derived from the session, its position, role and content, so the same history gives the
  same records in another process. Assistant messages carry no id on the wire: the response
  id and usage the session observed are attached to the message that answered it.
- **Decisions stay.** Earlier decisions are re-applied byte for byte (prefix-stable); they are
  recorded in ``<root>/<session>/decisions.jsonl`` (replacement and stage records, responses),
  or wherever the session's ``storage`` keeps records (an object store shared by a fleet:
  :func:`~pipeline.session_storage.open_session_state`), so a new process continues with the
  same decisions.
- **Cost.** Per call: one equality check per message (C-level) plus the new messages; the
  pipeline and the request building are incremental as in the agent loop.
- **Off the event loop.** :meth:`WireSession.open` loads the recorded decisions in a worker
  thread and :meth:`WireSession.observe_async` appends in one (an object store's request, a
  file's fsync); the stages' own appends already run there. The constructor and
  :meth:`WireSession.observe` do the same inline, for synchronous callers.

Session identity: :func:`session_id_for`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from pipeline.caching import add_cache_breakpoint
from pipeline.context import SessionContext
from pipeline.core import Pipeline
from pipeline.event_stream import EventStreamUsage  # public here before it had a module
from pipeline.messages import Message, Usage
from pipeline.replacement import ReplacementState, decided_in
from pipeline.session_storage import DECISIONS_FILE, SessionStorage, open_session_state
from pipeline.spans import content_safe_span
from pipeline.storage import validate_session_id
from pipeline.tokens import TokenTracker, calibration_path_for
from pipeline.tracing import ATTR, SPAN_WIRE_REQUEST
from pipeline.transcript import Transcript
from pipeline.wire_cache import WireCache

if TYPE_CHECKING:
    from anthropic.types import MessageParam
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

__all__ = [
    "DECISIONS_FILE",
    "SESSION_HEADER",
    "EventStreamUsage",
    "WireSession",
    "beta_header",
    "session_id_for",
]

SESSION_HEADER = "x-sluicegate-session"
"""The request header a proxy reads an explicit session id from."""

_RESPONSE_RECORD = "wire_session.response"
_NAMESPACE = uuid.UUID("5b2f0e6c-3d1a-4c7e-9a41-7e0c2d9b6f13")
_CLAUDE_CODE_SESSION = re.compile(r"_session_([0-9a-fA-F-]{36})$")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def session_id_for(
    body: Mapping[str, Any],
    *,
    explicit: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> str:
    """The session a request belongs to.

    In order: ``explicit`` (an argument of the caller); the ``x-sluicegate-session`` header;
    Claude Code's session (``metadata.user_id``: a JSON object with ``session_id`` in 2.x,
    ``..._session_<uuid>`` before), one per conversation within it -- its main thread, each
    sub-agent and each side request are conversations of their own; else a fingerprint of the
    conversation's start (system prompt and first message), so two conversations never share a
    ledger. ``ValueError`` when an explicit id is not a safe session id.
    """
    chosen = explicit
    if chosen is None and headers is not None:
        chosen = next((v for k, v in headers.items() if k.lower() == SESSION_HEADER), None)
    if chosen is not None:
        return validate_session_id(chosen)
    messages = body.get("messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    fingerprint = _digest({"system": body.get("system"), "first": first})
    claude_code = _claude_code_session(body.get("metadata"))
    if claude_code is not None:
        return f"{claude_code}-{fingerprint[:16]}"
    return "fp-" + fingerprint[:32]


def _claude_code_session(metadata: Any) -> str | None:
    user_id = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    if not isinstance(user_id, str):
        return None
    try:
        parsed = json.loads(user_id)
    except ValueError:
        parsed = None
    session = parsed.get("session_id") if isinstance(parsed, dict) else None
    if session is None:
        found = _CLAUDE_CODE_SESSION.search(user_id)
        session = found.group(1) if found else None
    if isinstance(session, str) and _UUID.fullmatch(session):
        return session.lower()
    return None


def beta_header(given: str | None, betas: Iterable[str]) -> str:
    """An ``anthropic-beta`` value holding the client's betas and the ones a stage asked for."""
    return ",".join(sorted({*betas, *filter(None, (given or "").split(","))}))


class _Load(enum.Enum):
    NOW = "now"
    """Load the recorded decisions in the constructor (blocking)."""


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class WireSession:
    """One conversation seen at the wire (see the module docstring).

    ``cache_breakpoint``: for a client that sets no ``cache_control`` itself, put one on the
    last block (a client's own breakpoints are always left alone). ``storage``: where the
    session's results and decisions live -- a :class:`~pipeline.session_storage.SessionStorage`
    or a location for :func:`~pipeline.session_storage.open_session_state` (``s3://...``);
    by default the files under ``root``. ``root`` also holds the token calibration (always a
    local directory: each host learns its own). ``loaded``: the records ``storage.load()``
    returned, when the caller has loaded them (:meth:`open` does so off the event loop); by
    default the constructor loads them.
    ``prepare(messages)`` gives the messages to send; ``observe(...)`` takes the response's id
    and usage (the token tracker learns from it, and the next request's answering message
    carries them). Calls of one session must not overlap (the pipeline serialises them).
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
        **context: Any,
    ) -> None:
        self.session_id = validate_session_id(session_id)
        self.pipeline = pipeline
        self.cache_breakpoint = cache_breakpoint
        self.storage = self._storage_for(self.session_id, root, storage)
        if isinstance(loaded, _Load):
            loaded = self.storage.load()
        self._calibration = calibration_path_for(root, self.session_id)
        context.setdefault("token_tracker", TokenTracker.load(self._calibration))
        context.setdefault("store", self.storage.store)
        self.ctx = SessionContext(
            self.session_id,
            root,
            transcript=self.storage.records,
            stage_records=loaded.stage_records if loaded is not None else (),
            **context,
        )
        self._restored = loaded
        self._responses: dict[int, tuple[str, Usage | None]] = {}
        if loaded is not None:
            for record in loaded.stage_records:
                if record.stage == _RESPONSE_RECORD:
                    self._restore_response(record.data)
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
            path = calibration_path_for(root, sid)
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
        if storage.session_id != session_id:
            raise ValueError(f"storage is for session {storage.session_id!r}, not {session_id!r}")
        return storage

    # -- per call ---------------------------------------------------------------------------
    async def prepare(self, messages: Sequence[MessageParam]) -> list[MessageParam]:
        """The ``messages`` to send for a request whose own are ``messages``."""
        records = self._sync(messages)
        if self._restored is not None:
            # a new process: the ledger from the recorded decisions and this history
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
        :meth:`observe_async`."""
        parsed, data = self._response(response_id, usage)
        self._append_response(data)
        if parsed is not None:
            self._learn(parsed, model)
            self.ctx.token_tracker.save(self._calibration)  # a new process does not start cold

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
        return parsed, data

    def _append_response(self, data: dict[str, Any]) -> None:
        if self.ctx.transcript is None:
            return
        try:
            self.ctx.transcript.append_stage_record(_RESPONSE_RECORD, data)
        except OSError as exc:
            # the response was delivered: only another worker or a new process would miss its
            # id and usage
            self.ctx.logger.error(
                "stage_record.write_failed", stage=_RESPONSE_RECORD, error=type(exc).__name__
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
        digest = _digest([record.type, record.content])
        uid = str(uuid.uuid5(_NAMESPACE, f"{self.session_id}\x00{index}\x00{digest}"))
        if record.type == "user":
            return dataclasses.replace(record, uuid=uid)
        response_id, usage = self._responses.get(index, (f"msg_wire_{digest[:24]}", None))
        return dataclasses.replace(record, uuid=uid, message_id=response_id, usage=usage)

    def _restore_response(self, data: Mapping[str, Any]) -> None:
        index, rid, usage = data.get("index"), data.get("id"), data.get("usage")
        if not isinstance(index, int) or not isinstance(rid, str):
            return
        try:
            parsed = Usage.from_mapping(usage) if isinstance(usage, Mapping) else None
        except ValueError:
            parsed = None
        self._responses[index] = (rid, parsed)
