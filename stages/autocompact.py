"""The ``autocompact`` stage: summarise the older conversation when it nears the window.

Compaction is a projection, never an edit of the history: everything before a kept tail becomes
``[compact_boundary, summary]`` (Claude Code's shapes); the tail starts at a round boundary at or
before the latest user request, kept verbatim with all that follows it. The projection is kept per
session and recorded in the transcript, and re-applied byte for byte on every later pass and after
resume, so the new cached prefix stays stable. A later compaction summarises the previous summary
together with the messages after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from pipeline import Message, PipelineHalt, SessionContext, to_api
from pipeline.messages import context_start, new_uuid
from pipeline.summarizer import (
    SUMMARY_TIMEOUT,
    Summarizer,
    SummaryPromptTooLong,
    ask_summary,
)
from pipeline.tokens import find_anchor
from pipeline.tracing import ATTR, AttributeValue, Decision, Reason
from stages._shared import (
    DEFAULT_CONTEXT_WINDOW,
    cut_indices,
    is_prompt,
    record_decision,
    session_state,
)
from stages._shared.args import check_bool, check_int, check_seconds, check_summarizer

if TYPE_CHECKING:  # the SDK is slow to import: its types only here
    from anthropic.types import MessageParam

__all__ = ["SUMMARY_PREFIX", "Autocompact", "ContextWindowExceeded", "Thresholds"]

SUMMARY_PREFIX = (
    "This session is being continued from a previous conversation that ran out of context. "
    "The summary below covers the earlier portion of the conversation.\n\n"
)
"""Claude Code's opening of a compact summary message (read from its transcripts)."""
BOUNDARY_TEXT = "Conversation compacted"
RETRY_MARKER = "[earlier conversation truncated for compaction retry]"
MAX_OUTPUT_RESERVE = 20_000  # window kept for the reply: at most this much of max_output_tokens
WARNING_BUFFER = 20_000  # warn this far below the compact threshold
BLOCKING_BUFFER = 3_000  # block this close to the effective window


class ContextWindowExceeded(PipelineHalt):
    """The context is at or over the blocking limit and compaction could not bring it below.

    Raised by :class:`Autocompact` (``block=True``) instead of sending a request the API would
    reject; it is a ``PipelineHalt``, so the pipeline passes it through unwrapped.
    """

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            f"context is ~{size} tokens (estimated), at or over the blocking limit of {limit}, "
            "and compaction could not bring it below"
        )


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The token levels of one configuration."""

    effective: int
    compact: int
    warning: int
    blocking: int


@dataclass(frozen=True, slots=True)
class _Projection:
    """One compaction, as recorded: everything needed to rebuild it byte for byte."""

    summary: str  # the full summary message text, prefix included
    first_kept_uuid: str
    last_summarized_uuid: str
    anchor_uuid: str | None  # the usage anchor at compaction time: stale afterwards
    boundary_uuid: str
    summary_uuid: str

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> _Projection | None:
        """The projection a record describes, or None for a malformed record."""
        values = {f.name: data.get(f.name) for f in dataclasses.fields(cls)}
        ok = all(
            isinstance(v, str) or (v is None and k == "anchor_uuid") for k, v in values.items()
        )
        return cls(**values) if ok else None  # type: ignore[arg-type]  # checked just above


@dataclass(slots=True)
class _State:
    projection: _Projection | None = None
    head: list[Message] = dataclasses.field(default_factory=list)  # the same objects every pass
    failures: int = 0  # consecutive; in memory only, so a resumed session gets a fresh chance

    @classmethod
    def restore(cls, records: list[Mapping[str, Any]]) -> _State:
        """A resumed session's state: the latest recorded projection that parses."""
        state = cls()
        for data in reversed(records):
            p = _Projection.from_record(data)
            if p is not None:
                state.adopt(p)
                break
        return state

    def adopt(self, p: _Projection | None) -> None:
        self.projection, self.head = p, []
        if p is not None:
            self.head = [
                Message("system", BOUNDARY_TEXT, p.boundary_uuid, subtype="compact_boundary"),
                Message.user(p.summary, uuid=p.summary_uuid, is_compact_summary=True),
            ]


class Autocompact:
    """Stage: near the window limit, summarise all but the latest request and what follows it.

    - Size: the token tracker's estimate minus ``ctx.report.tokens_freed``. Right after a
      compaction the last response's usage counted the uncompacted conversation, so until a
      new response arrives the projection is estimated from its content alone.
    - ``summarizer``: any object with ``async summarize(wire_messages) -> str`` (see
      ``pipeline.summarizer``); it gets the span in wire form (``to_api``). Without one the
      stage never compacts but still warns and blocks. On "prompt too long" the oldest rounds
      are dropped from the request (a previous summary is kept), at most ``max_retries`` times.
    - A summary is discarded when empty or not smaller, in the token tracker's estimate (the
      one the thresholds use), than the span it replaces. A summary that is not text, or that
      takes longer than ``summary_timeout`` seconds (600; ``math.inf``: no limit), is an
      error (``summary_error``). Errors and discards count as
      failures; after ``max_failures`` in a row the session stops trying (``circuit_open``);
      a success resets the count.
    - ``block=True``: raise :class:`ContextWindowExceeded` when the size is still at the
      blocking limit after this pass (compaction impossible or failed); never while context
      collapse has suppressed this stage. Off by default: the request goes and the API decides.
    - Every pass emits one ``autocompact.<decision>`` span, the decision ``skip`` or ``reapply``
      (with ``below_warning``, ``suppressed_by_collapse``, ``no_summarizer``, ``circuit_open`` or
      ``nothing_eligible``), ``warn`` (``over_warning``), ``compact`` (``over_trigger``), ``fail``
      (``prompt_too_long``, ``summary_error``), ``discard`` (``summary_empty``,
      ``summary_not_smaller``) or ``block`` (``over_blocking``); never content.
    """

    name = "autocompact"
    may_break_cache = True
    readonly_input = True
    strategy = "summarize"

    def __init__(
        self,
        summarizer: Summarizer | None = None,
        *,
        context_window: int = DEFAULT_CONTEXT_WINDOW,
        max_output_tokens: int = 32_000,
        buffer_tokens: int = 13_000,
        max_failures: int = 3,
        max_retries: int = 3,
        block: bool = False,
        summary_timeout: float = SUMMARY_TIMEOUT,
    ) -> None:
        self.summary_timeout = check_seconds("summary_timeout", summary_timeout)
        check_int("context_window", context_window, minimum=1)
        check_int("max_output_tokens", max_output_tokens)
        check_int("buffer_tokens", buffer_tokens, minimum=BLOCKING_BUFFER)  # compact first
        self.max_failures = check_int("max_failures", max_failures, minimum=1)
        self.max_retries = check_int("max_retries", max_retries)
        self.block = check_bool("block", block)
        self.summarizer = check_summarizer(summarizer)
        effective = context_window - min(max_output_tokens, MAX_OUTPUT_RESERVE)
        compact = effective - buffer_tokens
        if compact <= 0:
            raise ValueError(f"context_window {context_window} leaves no room to compact")
        warning = max(0, compact - WARNING_BUFFER)
        self.thresholds = Thresholds(effective, compact, warning, effective - BLOCKING_BUFFER)

    @property
    def rereads_outputs(self) -> bool:
        """Whether a later pass may read again a tool output (or another long text) it has met
        (:func:`~pipeline.core.rereading_stages`): a summariser may be given what it
        summarised before."""
        return self.summarizer is not None

    def __repr__(self) -> str:
        return f"Autocompact(summarizer={self.summarizer!r}, thresholds={self.thresholds})"

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        st = session_state(ctx, self.name, _State, _State.restore)
        view = self._project(messages, st, ctx)
        size = before = self._size(view, st, ctx)
        th = self.thresholds
        suppressed = ctx.report.suppress_autocompact
        decision = Decision.REAPPLY if view is not messages else Decision.SKIP
        facts: dict[str, AttributeValue] = {}
        if suppressed:
            reason = Reason.SUPPRESSED_BY_COLLAPSE
        elif size < th.warning:
            reason = Reason.BELOW_WARNING
        elif size < th.compact:
            decision, reason = Decision.WARN, Reason.OVER_WARNING
        elif self.summarizer is None:
            reason = Reason.NO_SUMMARIZER
        elif st.failures >= self.max_failures:
            reason = Reason.CIRCUIT_OPEN
        else:
            decision, reason = await self._compact(view, st, ctx, self.summarizer, facts)
            if decision is Decision.COMPACT:
                view = self._project(messages, st, ctx)
                size = self._size(view, st, ctx)
        blocked = self.block and not suppressed and size >= th.blocking
        if blocked:
            facts[ATTR.CAUSE] = str(reason)
            decision, reason = Decision.BLOCK, Reason.OVER_BLOCKING
        facts[ATTR.TRIGGER_TOKENS] = th.compact
        facts[ATTR.WARNING_TOKENS] = th.warning
        facts[ATTR.BLOCKING_TOKENS] = th.blocking
        facts[ATTR.REAPPLIED] = int(view is not messages)
        facts[ATTR.FAILURES] = st.failures
        ctx.decide(
            self.name, decision, reason, tokens_before=before, tokens_after=size, facts=facts
        )
        if reason is not Reason.BELOW_WARNING:
            ctx.logger.info("autocompact.decision", decision=decision, reason=reason, tokens=size)
        if blocked:
            raise ContextWindowExceeded(size, th.blocking)
        return view

    # -- state and projection ----------------------------------------------------------------
    def _project(self, messages: list[Message], st: _State, ctx: SessionContext) -> list[Message]:
        """``[boundary, summary, *kept tail]``; the input itself when nothing is compacted."""
        p = st.projection
        if p is None:
            return messages
        uuids = [m.uuid for m in messages]
        if p.first_kept_uuid in uuids:
            return [*st.head, *messages[uuids.index(p.first_kept_uuid) :]]
        if p.last_summarized_uuid in uuids:  # the kept head was removed by an earlier stage
            return [*st.head, *messages[uuids.index(p.last_summarized_uuid) + 1 :]]
        # neither end of the cut is left: the projection cannot be placed; send what there is
        ctx.logger.warning("autocompact.projection_lost")
        st.adopt(None)
        return messages

    def _size(self, view: list[Message], st: _State, ctx: SessionContext) -> int:
        anchor = find_anchor(view)
        p = st.projection
        if p is not None and (anchor is None or view[anchor[0]].uuid == p.anchor_uuid):
            # that usage counted the conversation before compaction: price the projection itself
            return ctx.token_tracker.estimate(_without_usage(view))
        return ctx.size_of(view)

    # -- compaction --------------------------------------------------------------------------
    async def _compact(
        self,
        view: list[Message],
        st: _State,
        ctx: SessionContext,
        summarizer: Summarizer,
        facts: dict[str, AttributeValue],
    ) -> tuple[Decision, Reason]:
        # from the server's compaction block on, if there is one: the API reads nothing before
        start = context_start(view)
        cuts = cut_indices(view, start)
        limit = _latest_request(view, start)
        limit = len(view) - 1 if limit is None else limit
        real = [i for i in range(start, limit) if _summarisable(view[i])]
        # summarise something besides a previous summary; keep the latest request
        usable = [c for c in cuts if real and real[0] < c <= limit]
        if not usable:
            return Decision.SKIP, Reason.NOTHING_ELIGIBLE
        cut = usable[-1]
        span = view[start:cut]
        try:
            text, retries = await self._summarize(summarizer, view, start, cut, cuts)
        except Exception as exc:  # a failed summary must never fail the turn
            st.failures += 1
            facts[ATTR.ERROR] = type(exc).__name__
            too_long = isinstance(exc, SummaryPromptTooLong)
            return Decision.FAIL, Reason.PROMPT_TOO_LONG if too_long else Reason.SUMMARY_ERROR
        summary = SUMMARY_PREFIX + text.strip()
        # in the tracker's units, both priced alike (no anchor): the summary must save something
        replaced = ctx.token_tracker.estimate(_without_usage(span))
        if not text.strip() or ctx.token_tracker.estimate([Message.user(summary)]) >= replaced:
            st.failures += 1
            reason = Reason.SUMMARY_NOT_SMALLER if text.strip() else Reason.SUMMARY_EMPTY
            return Decision.DISCARD, reason
        anchor = find_anchor(view)
        p = _Projection(
            summary=summary,
            first_kept_uuid=view[cut].uuid,
            last_summarized_uuid=view[cut - 1].uuid,
            anchor_uuid=view[anchor[0]].uuid if anchor is not None else None,
            boundary_uuid=new_uuid(),
            summary_uuid=new_uuid(),
        )
        st.adopt(p)
        st.failures = 0
        await record_decision(ctx, self.name, dataclasses.asdict(p))
        facts[ATTR.RETRIES] = retries
        facts[ATTR.SPAN_TOKENS] = replaced
        return Decision.COMPACT, Reason.OVER_TRIGGER

    async def _summarize(
        self, summarizer: Summarizer, view: list[Message], start: int, cut: int, cuts: list[int]
    ) -> tuple[str, int]:
        """The summary of ``view[start:cut]``, and how many "prompt too long" retries it took.

        Each retry drops the oldest rounds; a previous summary at the head is kept, as it stands
        for everything older still.
        """
        head = view[start : start + 1] if view[start].is_compact_summary else []
        begin = start + len(head)
        for retry in range(self.max_retries + 1):
            wire = to_api([*head, *view[begin:cut]])
            if wire and wire[0]["role"] == "assistant":
                wire.insert(0, cast("MessageParam", {"role": "user", "content": RETRY_MARKER}))
            try:
                text = await ask_summary(summarizer, wire, self.summary_timeout)
            except SummaryPromptTooLong:
                later = [c for c in cuts if begin < c < cut]
                if retry == self.max_retries or not later:
                    raise
                # drop at least one round, a fifth of what is left (reference: 20%)
                begin = later[max(1, len(later) // 5) - 1]
                continue
            return text, retry
        raise AssertionError("unreachable")  # the loop returns or raises


def _without_usage(messages: Sequence[Message]) -> list[Message]:
    """``messages`` with no usage: the tracker then estimates every message (no anchor)."""
    return [dataclasses.replace(m, usage=None) if m.usage is not None else m for m in messages]


def _summarisable(m: Message) -> bool:
    return m.type in ("user", "assistant") and not m.is_compact_summary


def _latest_request(view: Sequence[Message], start: int) -> int | None:
    """Index of the last user message that is a request: not only tool_results, not meta."""
    for i in range(len(view) - 1, start - 1, -1):
        if is_prompt(view[i]) and not view[i].is_compact_summary:
            return i
    return None
