"""``SessionContext``: the state every stage of one session shares."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from opentelemetry import trace

from pipeline.incremental import ThreadStart
from pipeline.logs import get_logger
from pipeline.messages import Message, Usage
from pipeline.policies import ToolPolicies
from pipeline.replacement import ReplacementState
from pipeline.store.files import FileToolResultStore, ToolResultStore, validate_session_id
from pipeline.store.records import RecordLog
from pipeline.tokens import TokenTracker, find_anchor
from pipeline.tracing import (
    ATTR,
    AttributeValue,
    Decision,
    Reason,
    emit_decision,
    get_tracer,
)
from pipeline.transcript.read import StageRecord

__all__ = ["Held", "PassReport", "PersistedResult", "SessionContext", "StageDecision"]


@dataclass(frozen=True, slots=True)
class PersistedResult:
    """A tool result newly written to the store in this pass."""

    tool_use_id: str
    tool_name: str | None
    chars: int
    path: str
    reason: str
    """Which limit it was over: ``"per_tool"`` (its tool's) or ``"per_message"`` (the
    budget of its API-level user message)."""
    limit: int | None = None
    """That limit, in characters."""
    group_results: int | None = None
    """How many tool results the API-level user message held (the budget's group)."""
    group_chars: int | None = None
    """Their characters together, before anything in it was persisted."""


@dataclass(frozen=True, slots=True)
class StageDecision:
    """One stage's decision in a pass, as its span tells it (:meth:`SessionContext.decide`)."""

    decision: Decision
    reason: Reason
    tokens_before: int | None = None
    tokens_after: int | None = None
    facts: Mapping[str, AttributeValue] = field(default_factory=dict)
    """The span's other attributes, by their keys in :class:`pipeline.tracing.ATTR`."""


@dataclass(slots=True)
class PassReport:
    """What the stages did in the latest pipeline pass (reset at the start of each pass)."""

    persisted: list[PersistedResult] = field(default_factory=list)
    reapplied: int = 0
    chars_kept_off: int = 0
    """Characters of tool output this pass's request does not carry because a replacement
    stands in for it (new and re-applied replacements; the replacements' own length
    subtracted)."""
    persist_failed: list[str] = field(default_factory=list)
    """tool_use_ids whose persist failed (original content kept)."""
    estimated_tokens: int = 0
    """The tracker's estimate of the pass's output (what the request will hold)."""
    tokens_freed: int = 0
    """Tokens that stages removed in this pass from content the last response's usage counted.

    The token estimate anchors on that usage, so later stages subtract this to see the size the
    request will really have (history snip and microcompact add to it)."""
    request_extras: dict[str, Any] = field(default_factory=dict)
    """Extra top-level request fields a stage asks for (e.g. ``context_management``)."""
    betas: list[str] = field(default_factory=list)
    """Beta features those extras need (sent as the ``anthropic-beta`` header)."""
    suppress_autocompact: bool = False
    """Set by a stage that manages the window itself this pass (context collapse)."""
    recording: bool = True
    """Whether this pass's spans are recorded (the pipeline's span is); when not, stages skip
    making spans nobody will see."""
    decisions: dict[str, StageDecision] = field(default_factory=dict)
    """Each stage's decision in this pass, by stage name."""
    anchor: Usage | None = None
    """The usage of the last real response in the pass's input (what ``tokens_freed`` counts
    against); None when unknown or when there is none."""


_MAX_TOOL_SPANS = 4_096


class Held:
    """A pass's output held across an await (see :meth:`SessionContext.hold`)."""

    __slots__ = ("_ctx", "messages")

    def __init__(self, ctx: SessionContext, messages: list[Message]) -> None:
        self._ctx = ctx
        self.messages = messages
        """The list as it was when held: the list itself, or the copy the next pass made."""

    def release(self) -> None:
        """Done with it: a later pass copies nothing for it."""
        held = self._ctx._held
        if self in held:
            held.remove(self)


class SessionContext:
    """One session's shared state: replacement ledger, token tracker, store, transcript,
    per-tool policies, tracer and logger.

    A session's turns are serialised: :meth:`pipeline.core.Pipeline.run` holds ``lock`` for the
    whole pass. Many sessions (many contexts) may run concurrently in one process.
    """

    def __init__(
        self,
        session_id: str,
        root: str | os.PathLike[str] = ".sluicegate",
        *,
        store: ToolResultStore | None = None,
        replacement_state: ReplacementState | None = None,
        token_tracker: TokenTracker | None = None,
        transcript: RecordLog | None = None,
        tool_policies: ToolPolicies | None = None,
        tracer: trace.Tracer | None = None,
        logger: Any = None,
        agent_id: str | None = None,
        stage_records: Sequence[StageRecord] = (),
    ) -> None:
        self.session_id = validate_session_id(session_id)
        self.root = Path(root)
        self.agent_id = agent_id
        self.store: ToolResultStore = store or FileToolResultStore(self.root, self.session_id)
        self.replacement_state = replacement_state or ReplacementState()
        self.token_tracker = token_tracker or TokenTracker()
        self.transcript = transcript
        self.tool_policies = tool_policies or ToolPolicies()
        self.tracer = tracer or get_tracer()
        self.logger = logger or get_logger(session_id=self.session_id)
        self.stage_state: dict[str, Any] = {}
        """Per-session state of stages, by stage name: stage objects are shared by sessions,
        so whatever a stage remembers about one session lives here."""
        self.stage_records: list[StageRecord] = list(stage_records)
        """Records a resumed session's stages restore their decisions from."""
        # an uncontended pass takes the lock without a trip through the event loop
        self.lock = anyio.Lock(fast_acquire=True)
        self.report = PassReport()
        self.call: int | None = None
        """The number of the call being prepared (0-based; set by a replay and by the agent
        loop): every span of its pass carries it (``sluicegate.call``)."""
        self.tool_spans: dict[str, tuple[trace.SpanContext, int | None]] = {}
        """tool_use_id -> the span that executed it and its call number (the agent loop fills
        it): a decision on that result in a later pass links to it. The latest 4,096."""
        self.thread_start = ThreadStart()
        """Where the part of a pass's input the API sees begins (after the last compaction):
        the stages see only that part, as the API does."""
        self._held: list[Held] = []

    def hold(self, messages: list[Message]) -> Held:
        """Keep ``messages`` (a pass's output, ``Pipeline.run(..., shared=True)``) as they are
        for a caller that reads them after an await during which another pass on this context
        may run: that pass copies them before its stages bring their lists up to date in place.
        So the holder pays a copy of the history only when a pass overlaps, not every call.
        :meth:`Held.release` when done."""
        held = Held(self, messages)
        self._held.append(held)
        return held

    def copy_held(self) -> None:
        """Give every holder its own copy of what it holds and let them go; called by the
        pipeline at the start of every run, before anything changes a list in place."""
        for held in self._held:
            held.messages = list(held.messages)
        self._held.clear()

    def begin_pass(self, messages: Sequence[Message] = ()) -> PassReport:
        """Start a new pass report for a pass over ``messages``; called by the pipeline at the
        start of every run."""
        self.report = PassReport()
        anchor = find_anchor(messages)
        if anchor is not None:
            self.report.anchor = anchor[1]
        return self.report

    def size_of(self, messages: Sequence[Message], *, also_freed: int = 0) -> int:
        """Tokens ``messages`` would hold if sent now, after what the stages freed this pass.

        The tracker's estimate starts from the last response's usage, which still counts what
        stages removed from before it (``report.tokens_freed``, plus ``also_freed`` that a stage
        has yet to report): that is taken off -- unless the last usage in ``messages`` is no
        longer the pass's (a summary replaced that response), when it is no longer part of the
        estimate. Never below 0.
        """
        estimate = self.token_tracker.estimate(messages)
        freed = self.report.tokens_freed + also_freed
        if freed and self.report.anchor is not None:
            anchor = find_anchor(messages)
            if anchor is None or anchor[1] is not self.report.anchor:
                freed = 0
        return max(0, estimate - freed)

    def span_attributes(self) -> dict[str, AttributeValue]:
        """What every span of this session's passes carries: its conversation id and, within
        a numbered call, the call number."""
        attrs: dict[str, AttributeValue] = {ATTR.CONVERSATION_ID: self.session_id}
        if self.call is not None:
            attrs[ATTR.CALL] = self.call
        return attrs

    def remember_tool_span(self, tool_use_id: str, span: trace.Span) -> None:
        """Keep the span that executed ``tool_use_id`` (see :attr:`tool_spans`)."""
        context = span.get_span_context()
        if not context.is_valid:
            return
        spans = self.tool_spans
        spans[tool_use_id] = (context, self.call)
        if len(spans) > _MAX_TOOL_SPANS:
            del spans[next(iter(spans))]  # the oldest: dicts keep insertion order

    def decide(
        self,
        stage: str,
        decision: Decision,
        reason: Reason,
        *,
        tokens_before: int | None = None,
        tokens_after: int | None = None,
        facts: Mapping[str, AttributeValue] | None = None,
    ) -> StageDecision:
        """Record a stage's decision for this pass: its decision span (``<stage>.<decision>``)
        and ``report.decisions[stage]``. ``facts`` are span attributes (keys from
        :class:`pipeline.tracing.ATTR`); never content."""
        made = StageDecision(decision, reason, tokens_before, tokens_after, dict(facts or {}))
        self.report.decisions[stage] = made
        if not self.report.recording:
            return made
        emit_decision(
            self.tracer,
            stage,
            conversation_id=self.session_id,
            decision=decision,
            reason=reason,
            tokens_before=tokens_before,
            tokens_after=tokens_after,
            attributes=made.facts,
            call=self.call,
        )
        return made

    def records_for(self, stage: str) -> list[Mapping[str, Any]]:
        """The data of every restored record of stage ``stage``, in transcript order."""
        return [r.data for r in self.stage_records if r.stage == stage]

    def record(self, stage: str, data: Mapping[str, Any]) -> None:
        """Keep a stage decision for resume: in memory and, when there is one, the transcript."""
        record = StageRecord(stage, dict(data))
        self.stage_records.append(record)
        if self.transcript is not None:
            self.transcript.append_stage_record(stage, record.data)

    def for_subagent(self, agent_id: str, transcript: RecordLog | None = None) -> SessionContext:
        """A context for a sub-agent: same session, store and policies; a COPY of the ledger."""
        return SessionContext(
            self.session_id,
            self.root,
            store=self.store,
            replacement_state=self.replacement_state.copy(),
            token_tracker=self.token_tracker.for_subagent(),
            transcript=transcript,
            tool_policies=self.tool_policies,
            tracer=self.tracer,
            logger=self.logger.bind(agent_id=agent_id),
            agent_id=agent_id,
        )

    def __repr__(self) -> str:
        return f"SessionContext(session_id={self.session_id!r}, root={str(self.root)!r})"
