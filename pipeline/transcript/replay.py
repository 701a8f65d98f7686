"""Replay a recorded session through a pipeline, call by call, as a live loop would have run it.

For each API call in the transcript (each distinct assistant response id, in order) the
conversation as it stood just before that call is run through the pipeline with ONE session
context carried across calls, then normalised to wire form. The call's recorded usage is then
fed to the session's token tracker, as a live loop would, and to a reference tracker, so the
replay measures both estimators on the recorded calls.

The recorded usage counts what the recorded session sent. Once the pipeline has removed
content the recording kept (history snip, microcompact, a collapse), a live session would have
reported less: so that the size-triggered stages see the context they would have seen live
(instead of acting again on every call), each later response's usage is replayed less the
tokens the pipeline has removed so far (``CallResult.removed_tokens``; taken from cache reads
first, then cache writes, then input). The growth from one call to the next stays the recorded
one, so the estimators are still measured on every call whose pass removed nothing new.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import anyio.lowlevel
from opentelemetry import context as otel_context
from opentelemetry import trace
from structlog.contextvars import bound_contextvars

from pipeline.context import PersistedResult, SessionContext
from pipeline.core import Pipeline, rereading_stages
from pipeline.kept_list import KeptList
from pipeline.messages import Message, Usage, holds_compaction
from pipeline.spans import content_safe_span
from pipeline.tokens import Observation, TokenTracker
from pipeline.tracing import ATTR, SPAN_REPLAY_CALL, bounded_attribute
from pipeline.transcript.recorded import RecordedRequest
from pipeline.wire.cache import WireCache, request_chars
from pipeline.wire.deferred import DeferredText, defer, deferred_in, fill
from pipeline.wire.harness import REMINDER_OPEN
from pipeline.wire.pairing import PairingProblem

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic.types import MessageParam

__all__ = [
    "Call",
    "CallResult",
    "find_calls",
    "less_usage",
    "replay_messages",
    "request_chars",
]

_YIELD_EVERY = 0.02  # seconds


@dataclass(frozen=True, slots=True)
class Call:
    """One API call found in a transcript."""

    number: int
    message_id: str
    index: int
    """Index of the response's first record: the call saw ``messages[:index]``."""
    usage: Usage | None
    """The response's usage (its last record's), None if no record carried any."""
    model: str | None = None
    """The model that served the call (its first record's)."""


@dataclass(slots=True)
class CallResult:
    """What the pipeline sent for one call."""

    call: Call
    request: list[MessageParam]
    """The messages as sent (``replay_messages(shared=True)``: valid until the next result)."""
    estimated_tokens: int
    persisted: list[PersistedResult] = field(default_factory=list)
    reapplied: int = 0
    persist_failed: list[str] = field(default_factory=list)
    removed_tokens: int = 0
    """Tokens of recorded content this request lacks (removed by this pass or earlier ones,
    counted against the usage the pass anchored on): its replayed usage is the recorded one
    less this."""
    pairing_problems: list[PairingProblem] = field(default_factory=list)
    """What in the request the API would reject for broken tool pairing (see
    :func:`~pipeline.wire.pairing.check_pairing`; kept up to date at the cost of what changed)."""
    observations: dict[str, Observation] = field(default_factory=dict)
    """The recorded call's usage against each estimator (``"default"``: the session's tracker,
    ``"reference"``: the fixed rough count), each estimating the projected request before
    learning from it.
    Not in the JSON line: the summary reports them."""

    @property
    def actual_tokens(self) -> int | None:
        """Input + cache_creation + cache_read tokens the API reported for this call."""
        return self.call.usage.input_side if self.call.usage is not None else None

    chars: int | None = None
    """Characters of visible text in the request, when the replay counted them."""
    request_tokens: int | None = None
    """Tokens of the system prompt and tools the estimate counted (None: not recorded)."""

    @property
    def request_chars(self) -> int:
        """Characters of visible text in the request (see :func:`request_chars`)."""
        return request_chars(self.request) if self.chars is None else self.chars

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` line of the CLI contract."""
        return {
            "call": self.call.number,
            "message_id": self.call.message_id,
            "estimated_tokens": self.estimated_tokens,
            "actual_tokens": self.actual_tokens,
            "persisted": [
                {"tool_use_id": p.tool_use_id, "chars": p.chars, "path": p.path}
                for p in self.persisted
            ],
            "reapplied": self.reapplied,
            "request_chars": self.request_chars,
        }


def find_calls(messages: Sequence[Message]) -> list[Call]:
    """Every distinct assistant response id, in order of first appearance.

    Synthetic assistant records (no API call made them) and records without an id are not calls.
    Streaming writes one record per content block; their usage snapshots grow, so the last
    record's usage is the response's.
    """
    first: dict[str, int] = {}
    usage: dict[str, Usage] = {}
    for i, m in enumerate(messages):
        if m.type != "assistant" or m.message_id is None or m.is_synthetic:
            continue
        first.setdefault(m.message_id, i)
        if m.usage is not None:
            usage[m.message_id] = m.usage
    return [
        Call(number=n, message_id=mid, index=idx, usage=usage.get(mid), model=messages[idx].model)
        for n, (mid, idx) in enumerate(sorted(first.items(), key=lambda kv: kv[1]))
    ]


def less_usage(usage: Usage, tokens: int) -> Usage:
    """``usage`` with ``tokens`` fewer on the input side: cache reads first (the stable prefix
    is what stages shrink), then cache writes, then input; never below zero."""
    read = min(usage.cache_read_input_tokens, tokens)
    write = min(usage.cache_creation_input_tokens, tokens - read)
    fresh = min(usage.input_tokens, tokens - read - write)
    return replace(
        usage,
        cache_read_input_tokens=usage.cache_read_input_tokens - read,
        cache_creation_input_tokens=usage.cache_creation_input_tokens - write,
        input_tokens=usage.input_tokens - fresh,
    )


async def replay_messages(
    messages: Sequence[Message],
    pipeline: Pipeline,
    ctx: SessionContext,
    *,
    requests: Sequence[RecordedRequest] = (),
    shared: bool = False,
    release: bool = False,
) -> AsyncIterator[CallResult]:
    """Yield, call by call, what ``pipeline`` would have sent for the recorded session.

    Each call's pass is traced as its own trace (a ``replay.call`` root span, linked to the
    span current when the replay runs, and the call number on every span).

    After each call the tracker of ``ctx`` observes the call's usage (the recorded one, less
    what the pipeline has removed so far), so its estimates for the next calls and the stages'
    decisions use what a live loop would have learned. ``requests`` (a 2.1 transcript's
    ``Transcript.requests``): each call's system prompt and tools are given to that tracker
    (:meth:`~pipeline.tokens.TokenTracker.set_request`), so its estimates count them.

    ``shared=True``: each result's :attr:`~CallResult.request` is a list the replay keeps and
    brings up to date for the next call (valid until the loop asks for the next result), not
    a new list per call; the CLI reads each call before the next. A long session's replay then
    costs what changed per call, not a list of its whole history.

    Tool outputs a loader left in the file (``load_transcript(defer_texts=...)``) are read into
    their blocks as the replay reaches their records. ``release=True`` (with ``shared=True``)
    puts each back in the file once no later request can carry it: the request that first had it
    previewed (the budget's decision is frozen), or the first request that no longer carries it
    (cleared, snipped). That rests on every stage of ``pipeline`` declaring that it never reads
    an output again once it has met it (``rereads_outputs = False``:
    :func:`~pipeline.core.rereading_stages` names those that do not, and ``ValueError`` refuses
    them); in a session that gives two tool calls or two results one id, no output is put back,
    nor one that carries harness text (a ``<system-reminder>``). The replay then holds the
    outputs its requests carry, not every output of the session; the records' blocks change in
    place, and a list of ``messages`` gets the responses with their replayed usage: the messages
    are the replay's until it ends (a second copy of each response would cost what the outputs
    saved).
    """
    if release and not shared:
        raise ValueError("release=True needs shared=True: each request read before the next")
    rereading = rereading_stages(pipeline) if release else []
    if rereading:
        raise ValueError(
            f"release=True: stage(s) {', '.join(rereading)} may read an output again "
            "(rereads_outputs is not False)"
        )
    if release and _reuses_an_id(messages):
        # a stage that pairs, clears or snips by id may give back what it took when an id
        # comes again (a snipped run whose pair now crosses the cut): every output stays
        release = False
    reference = TokenTracker("reference")
    # responses get their replayed usage here, never in ``messages`` unless they are the
    # replay's
    history = messages if release and isinstance(messages, list) else list(messages)
    calls = find_calls(messages)
    calls.reverse()  # taken from the end as they come: a call replayed is let go
    fragments: dict[str, int | list[int]] = {}
    """Where each response's records with usage are: one index, as most are, or several."""
    for i, m in enumerate(messages):
        if m.type == "assistant" and m.message_id is not None and m.usage is not None:
            at = fragments.setdefault(m.message_id, i)
            if at != i:
                fragments[m.message_id] = [*at, i] if isinstance(at, list) else [at, i]
    wire = WireCache(track_dropped=release)
    live: dict[int, tuple[dict[str, Any], DeferredText]] = {}
    """Outputs read back from the file and not yet put back, by their block's id."""
    anchored = 0  # removed tokens already taken off the usage the pipeline anchors on
    # One list grown call by call, as a live loop grows its history: a fresh slice per call
    # would copy the whole history every call.
    sent: KeptList[Message] = KeptList()  # the stages' logs ask it where it changed
    recorded = sorted(requests, key=lambda r: r.position)
    k = 0
    yielded = time.monotonic()
    while calls:
        call = calls.pop()
        if time.monotonic() - yielded >= _YIELD_EVERY:
            # a pass takes no trip through the event loop: a long replay gives other tasks
            # (and the cancellation a Ctrl-C becomes) a turn now and then, not every call
            await anyio.lowlevel.checkpoint()
            yielded = time.monotonic()
        if call.index < len(sent):
            del sent[call.index :]
        reached = history[len(sent) : call.index]
        read = _read_back(reached)
        if release:
            live.update((id(b), (b, h)) for b, h in read if REMINDER_OPEN not in b["content"])
        sent.extend(reached)
        while k < len(recorded) and recorded[k].position <= call.index:
            k += 1  # the call's own request: the last one recorded before its response
        if k:
            ctx.token_tracker.set_request(
                system=recorded[k - 1].system, tools=recorded[k - 1].tools
            )
        ctx.call = call.number
        # each call its own trace (a replay of thousands of calls is no single readable tree),
        # linked to the span the replay runs under (the session's, with its totals)
        session = trace.get_current_span().get_span_context()
        with (
            # every log line of the pass says its call (where the logger merges context
            # variables, as the library's own does); never across a yield, where the caller runs
            bound_contextvars(call=call.number),
            content_safe_span(
                ctx.tracer,
                SPAN_REPLAY_CALL,
                context=otel_context.Context(),
                links=[trace.Link(session)] if session.is_valid else (),
                attributes={
                    **ctx.span_attributes(),
                    ATTR.RESPONSE_ID: bounded_attribute(call.message_id),
                },
            ),
        ):
            projected = await pipeline.run(sent, ctx, shared=True)  # read before the next
        report = ctx.report
        # tokens_freed counts against that anchored usage: what it lacks beyond ``anchored``
        removed = anchored + report.tokens_freed
        result = CallResult(
            call=call,
            request=wire.to_api(projected, shared=shared),
            estimated_tokens=report.estimated_tokens,
            persisted=list(report.persisted),
            reapplied=report.reapplied,
            persist_failed=list(report.persist_failed),
            removed_tokens=removed,
            chars=wire.chars,
            pairing_problems=wire.pairing.problems,
            request_tokens=ctx.token_tracker.request_tokens,
        )
        if live:
            _put_back(live, wire.dropped, report.persisted, read)
        if call.usage is not None:
            usage = less_usage(call.usage, removed) if removed else call.usage
            # as a live loop: the request as projected is what the usage is paired with; a
            # pass whose stages removed anchored content is neither learned from nor measured
            freed = report.tokens_freed
            compacted = holds_compaction(messages[call.index])  # its usage: the compacted context
            result.observations = {
                name: tracker.observe(
                    projected, usage, model=call.model, tokens_freed=freed, compacted=compacted
                )
                for name, tracker in (("default", ctx.token_tracker), ("reference", reference))
            }
            at = fragments.get(call.message_id, [])
            if removed:
                for i in (at,) if isinstance(at, int) else at:
                    m = history[i]
                    if m.usage is not None:
                        history[i] = replace(m, usage=less_usage(m.usage, removed))
                        if i < len(sent):
                            sent[i] = history[i]
            anchored = removed
        yield result


def _read_back(records: Sequence[Message]) -> list[tuple[dict[str, Any], DeferredText]]:
    """Read the deferred outputs of ``records`` into their blocks: (block, handle) each."""
    read = []
    for m in records:
        if m.type == "user":
            for b in deferred_in(m.content):
                handle = fill(b)
                assert handle is not None
                read.append((b, handle))
    return read


def _put_back(
    live: dict[int, tuple[dict[str, Any], DeferredText]],
    dropped: Sequence[Any],
    persisted: Sequence[PersistedResult],
    read: Sequence[tuple[dict[str, Any], DeferredText]],
) -> None:
    """Put back the outputs no later request can carry: those ``dropped`` from the request,
    and those of this call's records the budget ``persisted`` (sent as a preview from the
    start)."""
    for b in dropped:
        entry = live.pop(id(b), None)
        if entry is not None:
            defer(*entry)
    if persisted:
        previewed = {p.tool_use_id for p in persisted}
        for b, h in read:
            if h.tool_use_id in previewed and live.pop(id(b), None) is not None:
                defer(b, h)


def _reuses_an_id(messages: Sequence[Message]) -> bool:
    """Whether two tool calls of ``messages``, or two tool results, share an id."""
    uses: set[str] = set()
    results: set[str] = set()
    for m in messages:
        if m.type not in ("user", "assistant"):
            continue
        for b in m.blocks:
            if not isinstance(b, dict):
                continue
            kind = b.get("type")
            tid = b.get("id") if kind == "tool_use" else b.get("tool_use_id")
            seen = uses if kind == "tool_use" else results if kind == "tool_result" else None
            if seen is None or not isinstance(tid, str):
                continue
            if tid in seen:
                return True
            seen.add(tid)
    return False
