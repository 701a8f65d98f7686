"""Every name sluicegate traces under -- span names, attribute keys, decisions, reasons -- and the
tracer and structlog glue.

(``get_logger`` and ``add_trace_ids`` live in :mod:`pipeline.logs`; they are re-exported here.)

Names are constants here and nowhere else (as ``opentelemetry.semconv`` does): a stage imports
:data:`ATTR`, :class:`Decision` and :class:`Reason` rather than spelling a key. One quantity has
one key and one type across stages. The library depends on ``opentelemetry-api`` only: with no
SDK installed (or none configured) every span is a no-op. No span attribute ever holds message
content.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from contextlib import AbstractContextManager
from enum import StrEnum
from typing import Any

from opentelemetry import trace

from pipeline.logs import add_trace_ids, get_logger

__all__ = [
    "ATTR",
    "METRIC",
    "SPAN_AGENT_INVOKE",
    "SPAN_AGENT_TURN",
    "SPAN_BUDGET_DECISION",
    "SPAN_BUDGET_GROUP",
    "SPAN_PIPELINE_RUN",
    "SPAN_REPLAY",
    "SPAN_REPLAY_CALL",
    "SPAN_TOOL_EXECUTE",
    "SPAN_WIRE_REQUEST",
    "SPAN_WIRE_UPSTREAM",
    "TRACER_NAME",
    "AttributeValue",
    "Decision",
    "GroupOutcome",
    "Reason",
    "add_trace_ids",
    "agent_span_name",
    "bounded_attribute",
    "decision_span_name",
    "emit_decision",
    "get_logger",
    "get_tracer",
    "limit_attribute",
    "size_facts",
    "span_if",
    "stage_span_name",
    "start_current_span",
    "tool_span_name",
]

TRACER_NAME = "sluicegate"

AttributeValue = str | int | float | bool

# -- span names ---------------------------------------------------------------------------------

SPAN_PIPELINE_RUN = "pipeline.run"
"""One pipeline pass (a child span per stage, see :func:`stage_span_name`)."""
SPAN_REPLAY = "replay.session"
"""One replayed session, its own trace, carrying the totals; each call links to it."""
SPAN_REPLAY_CALL = "replay.call"
"""One replayed call: the root of its own trace (a few dozen spans), linked to the session."""
SPAN_AGENT_INVOKE = "invoke_agent"
"""The GenAI operation name of one agent run (see :func:`agent_span_name`)."""
SPAN_BUDGET_GROUP = "tool_result_budget.group"
"""One API-level user message the budget evaluated."""
SPAN_BUDGET_DECISION = "tool_result_budget.decision"
"""Former name of the budget's decision spans; they are now named after the decision
(:func:`decision_span_name`: ``tool_result_budget.persist``, ``tool_result_budget.keep``...)."""
SPAN_AGENT_TURN = "agent.turn"
"""One model call of the agent loop and the tool calls it asked for."""
SPAN_WIRE_REQUEST = "wire.request"
"""One Messages request from a client (``wrap`` or the proxy): its ``pipeline.run`` is a child."""
SPAN_WIRE_UPSTREAM = "wire.upstream"
"""The upstream call of one Messages request, a child of its ``wire.request``: from sending the
request to the end of its response (a streamed one included)."""
SPAN_TOOL_EXECUTE = "execute_tool"
"""The GenAI operation name of a tool execution (see :func:`tool_span_name`)."""


def stage_span_name(stage_name: str) -> str:
    """The span of one stage's pass: ``stage.<name>``."""
    return f"stage.{stage_name}"


def decision_span_name(stage_name: str, decision: str) -> str:
    """The span of one decision of a stage, "not now" included, named so that a trace tree
    shows what happened: ``<stage>.<decision>`` (``tool_result_budget.persist``,
    ``microcompact.skip``...)."""
    return f"{stage_name}.{decision}"


def agent_span_name(agent_name: str) -> str:
    """The span of one agent run (GenAI convention): ``invoke_agent <name>``."""
    return f"{SPAN_AGENT_INVOKE} {agent_name}"


def tool_span_name(tool_name: str) -> str:
    """The span of one tool execution (GenAI convention): ``execute_tool <name>``."""
    return f"{SPAN_TOOL_EXECUTE} {bounded_attribute(tool_name)}"


MAX_ATTRIBUTE_CHARS = 256
"""Longest id or name a span carries: ids and tool names come from outside (a transcript, a
model's response) and a megabyte one must not become a megabyte attribute."""


def limit_attribute(limit: float) -> int | None:
    """A limit as a span attribute: an integer count of characters; ``None`` (leave it out)
    for no limit (a tool that never persists)."""
    return int(limit) if math.isfinite(limit) else None


def size_facts(
    chars: int,
    limit: int | None,
    *,
    over: int | None = None,
    replacement_chars: int | None = None,
) -> dict[str, AttributeValue]:
    """The sizes behind a decision on one tool result, as span attributes: its ``chars``, the
    ``limit`` that drove it, how far ``over`` that limit it was (default: ``chars - limit``; a
    per-message decision passes its message's excess) and, for a persist, what the model sees
    instead and how much that freed."""
    facts: dict[str, AttributeValue] = {ATTR.CHARS: chars}
    if limit is not None:
        facts[ATTR.LIMIT] = limit
        facts[ATTR.CHARS_OVER] = max(0, chars - limit if over is None else over)
    if replacement_chars is not None:
        facts[ATTR.REPLACEMENT_CHARS] = replacement_chars
        facts[ATTR.CHARS_FREED] = max(0, chars - replacement_chars)
    return facts


def bounded_attribute(value: str) -> str:
    """``value`` cut to :data:`MAX_ATTRIBUTE_CHARS` (an ellipsis marks the cut)."""
    if len(value) <= MAX_ATTRIBUTE_CHARS:
        return value
    return value[: MAX_ATTRIBUTE_CHARS - 1] + "…"


# -- attribute keys -----------------------------------------------------------------------------


class ATTR:
    """Span attribute keys: the OpenTelemetry GenAI ones where one exists, else ``sluicegate.*``.

    Counts are ints, sizes are ints (characters or tokens, as the name says), limits are
    floats (a limit may be infinite), flags are bools.
    """

    # GenAI semantic conventions
    CONVERSATION_ID = "gen_ai.conversation.id"
    AGENT_NAME = "gen_ai.agent.name"
    PROVIDER_NAME = "gen_ai.provider.name"
    TOOL_TYPE = "gen_ai.tool.type"
    OPERATION_NAME = "gen_ai.operation.name"
    REQUEST_MODEL = "gen_ai.request.model"
    REQUEST_STREAM = "gen_ai.request.stream"
    RESPONSE_ID = "gen_ai.response.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    TOOL_NAME = "gen_ai.tool.name"
    TOOL_CALL_ID = "gen_ai.tool.call.id"
    TOKEN_TYPE = "gen_ai.token.type"
    USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
    USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    USAGE_CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"
    USAGE_CACHE_WRITE_TOKENS = "gen_ai.usage.cache_creation.input_tokens"
    COMPACTION_INPUT_TOKENS = "sluicegate.compaction.input_tokens"
    """Input tokens of the API's server-side compaction in this call (its ``compaction`` usage
    iterations; the API leaves them out of the top-level usage)."""
    COMPACTION_OUTPUT_TOKENS = "sluicegate.compaction.output_tokens"
    """Output tokens (the summary) of the API's server-side compaction in this call."""

    # HTTP and general semantic conventions
    HTTP_METHOD = "http.request.method"
    HTTP_ROUTE = "http.route"
    ERROR_TYPE = "error.type"

    # one client request at the wire
    TENANT = "sluicegate.tenant"
    UPSTREAM_MS = "sluicegate.upstream.duration_ms"
    """From sending the request upstream to the end of its response, in milliseconds."""
    PIPELINE_MS = "sluicegate.pipeline.duration_ms"
    CHARS_IN = "sluicegate.request.chars_in"
    """The request as the client sent it, in characters of its JSON body (the proxy)."""
    CHARS_OUT = "sluicegate.request.chars_out"
    """The request as it went upstream, in characters of its JSON body."""
    APPLIED_EDITS = "sluicegate.context_management.applied_edits"
    """The server-side context edits the API reports it applied (their types)."""

    # a pass and its stages
    CALL = "sluicegate.call"
    """The call's number in its session (0-based): on every span of a replayed call or an
    agent turn."""
    CALLS = "sluicegate.calls"
    INPUT_SIDE_TOKENS = "sluicegate.usage.input_side_tokens"
    """The response's input + cache tokens (the SDK's own span reports the GenAI usage)."""
    MESSAGES_IN = "sluicegate.messages.in"
    MESSAGES_OUT = "sluicegate.messages.out"
    TOKENS_BEFORE = "sluicegate.tokens.estimated_before"
    TOKENS_AFTER = "sluicegate.tokens.estimated_after"
    STAGE = "sluicegate.stage"
    STAGE_CHANGED = "sluicegate.stage.changed"
    BREAKS_CACHE = "sluicegate.stage.may_break_cache"
    STRATEGY = "sluicegate.strategy"

    # every decision
    DECISION = "sluicegate.decision"
    REASON = "sluicegate.reason"
    REAPPLIED = "sluicegate.reapplied"
    """How many earlier decisions (replacements, clears, removed records) this pass re-applied."""
    TOKENS_FREED = "sluicegate.tokens.freed"
    """Tokens the last response's usage counted that this pass no longer sends."""
    TRIGGER_TOKENS = "sluicegate.trigger_tokens"
    """The estimated size at which the stage acts."""
    TARGET_TOKENS = "sluicegate.target_tokens"
    FAILURES = "sluicegate.failures"
    """Consecutive failed or discarded summaries (a circuit opens at the stage's maximum)."""
    ERROR = "sluicegate.error"
    HTTP_STATUS = "http.response.status_code"
    MESSAGES = "sluicegate.messages"
    """The type of an exception that was handled (never its message)."""

    # the tool-result budget and the per-tool gate
    CHARS = "sluicegate.chars"
    LIMIT = "sluicegate.limit"
    """The limit that drove this decision (the per-tool threshold or the per-message budget)."""
    LIMIT_PER_TOOL = "sluicegate.limit.per_tool"
    LIMIT_PER_MESSAGE = "sluicegate.limit.per_message"
    GROUP_CHARS = "sluicegate.group.chars"
    """All tool-result characters of the API-level user message the result is in."""
    REPLACEMENT_CHARS = "sluicegate.replacement_chars"
    """What the model sees instead of a persisted result: the replacement's length."""
    PREVIEW_CHARS = "sluicegate.preview_chars"
    EXECUTED_IN_CALL = "sluicegate.executed_in_call"
    """The call whose response asked for this tool result (the agent's turn number)."""
    PATH = "sluicegate.path"
    SPOOLED = "sluicegate.spooled"
    """True on a persist whose result waits in the worker's local spool: the store did not
    answer, and it is written there when it does (absent when the store took it)."""
    PERSISTED = "sluicegate.persisted"
    PERSIST_FAILED = "sluicegate.persist_failed"
    CHARS_OVER = "sluicegate.chars_over"
    """How far over the limit that drove the decision the result (per-tool) or its message's
    results (per-message) were, in characters; 0 when not over."""
    CHARS_FREED = "sluicegate.chars_freed"
    """Characters a persist took off the request: the result's size less its replacement's
    (on a group and a pass: the sum)."""
    KEPT_OFF_WIRE = "sluicegate.chars.kept_off_wire"
    """Characters of tool results a pass sent as replacements instead (new and re-applied)."""
    GROUP_INDEX = "sluicegate.group.index"
    GROUP_CANDIDATES = "sluicegate.group.candidates"
    FROZEN_CHARS = "sluicegate.group.frozen_chars"
    FRESH_CHARS = "sluicegate.group.fresh_chars"
    OUTCOME = "sluicegate.group.outcome"

    # clearing old results
    CLEARED = "sluicegate.cleared"
    KEPT = "sluicegate.kept"
    ELIGIBLE = "sluicegate.eligible"
    RECLAIMABLE_TOKENS = "sluicegate.reclaimable_tokens"
    CACHE_REWRITE_TOKENS = "sluicegate.cache_rewrite_tokens"
    TRIGGER = "sluicegate.trigger"
    IDLE_GAP_MINUTES = "sluicegate.idle_gap_minutes"
    KEEP = "sluicegate.keep"
    CLEAR_AT_LEAST = "sluicegate.clear_at_least"
    OVER_TRIGGER = "sluicegate.over_trigger"
    SERVER_COMPACTIONS = "sluicegate.server_compactions"
    """How many server compaction blocks the history holds."""

    # removing and summarising rounds
    REMOVED_NEW = "sluicegate.removed.new"
    REMOVED_TOTAL = "sluicegate.removed.total"
    COMMITS_ACTIVE = "sluicegate.commits.active"
    COMMITS_TOTAL = "sluicegate.commits.total"
    SPAN_MESSAGES = "sluicegate.span.messages"
    SPAN_TOKENS = "sluicegate.span.tokens"
    SUMMARY_TOKENS = "sluicegate.summary_tokens"
    RETRIES = "sluicegate.retries"
    WARNING_TOKENS = "sluicegate.warning_tokens"
    BLOCKING_TOKENS = "sluicegate.blocking_tokens"
    CAUSE = "sluicegate.cause"
    """The reason a compaction would have had, when blocking overrode it."""


class METRIC:
    """Metric names: the OpenTelemetry HTTP and GenAI ones where one exists, else
    ``sluicegate.*`` (see :mod:`pipeline.dropin.metrics`)."""

    HTTP_SERVER_DURATION = "http.server.request.duration"
    GENAI_OPERATION_DURATION = "gen_ai.client.operation.duration"
    GENAI_TOKEN_USAGE = "gen_ai.client.token.usage"
    GENAI_CACHE_READ = "gen_ai.client.inference.usage.cache_read.input_tokens"
    GENAI_CACHE_WRITE = "gen_ai.client.inference.usage.cache_write.input_tokens"
    PIPELINE_DURATION = "sluicegate.pipeline.duration"
    PERSISTED = "sluicegate.tool_results.persisted"
    KEPT_OFF_WIRE = "sluicegate.chars.kept_off_wire"
    CONVERSATIONS_HELD = "sluicegate.conversations.held"
    CONVERSATIONS_HELD_SIZE = "sluicegate.conversations.held.size"


# -- decisions and reasons ----------------------------------------------------------------------


class Decision(StrEnum):
    """What a stage did (``sluicegate.decision``): one verb per kind of act, across stages."""

    # on one tool result (the budget, the per-tool gate)
    PERSIST = "persist"
    KEEP = "keep"
    PERSIST_FAILED = "persist_failed"
    SKIP_UNBOUNDED_TOOL = "skip_unbounded_tool"
    FILL_EMPTY = "fill_empty"
    # on a pass
    SKIP = "skip"
    """Nothing done and nothing to re-apply."""
    REAPPLY = "reapply"
    """Nothing new decided; earlier decisions re-applied byte for byte."""
    CLEAR = "clear"
    SNIP = "snip"
    COLLAPSE = "collapse"
    COMPACT = "compact"
    TRUNCATE = "truncate"
    DELEGATE = "delegate"
    WARN = "warn"
    BLOCK = "block"
    DISCARD = "discard"
    """A summary came back empty or not smaller than what it would replace."""
    FAIL = "fail"
    """A summary request failed."""


class Reason(StrEnum):
    """Why (``sluicegate.reason``): the limit or state that drove the decision."""

    # the budget and the gate: the limit that decided (over it: persisted; at or under: kept)
    PER_TOOL = "per_tool"
    """The result's own size against its tool's limit (``sluicegate.limit.per_tool``)."""
    PER_MESSAGE = "per_message"
    """Its API-level user message's results together against the per-message budget."""
    NO_FRESH_RESULTS = "no_fresh_results"
    """A pass of the budget with no result to decide: every one was decided by an earlier pass
    (its decisions re-applied, if any)."""
    NEVER_PERSIST = "never_persist"
    """A tool that bounds its own output (``Read``): never persisted."""
    EMPTY = "empty"
    IMAGE = "image"
    NOT_PERSISTABLE = "not_persistable"
    ALREADY_REPLACED = "already_replaced"
    # triggers
    BELOW_TRIGGER = "below_trigger"
    OVER_TRIGGER = "over_trigger"
    IDLE_GAP = "idle_gap"
    CACHE_WARM = "cache_warm"
    BELOW_MIN_RECLAIM = "below_min_reclaim"
    NOTHING_ELIGIBLE = "nothing_eligible"
    DELEGATED = "delegated"
    SERVER_COMPACTED = "server_compacted"
    """The API compacted the context on the server: the history holds a compaction block it
    did not hold on the last pass."""
    BELOW_WARNING = "below_warning"
    OVER_WARNING = "over_warning"
    OVER_BLOCKING = "over_blocking"
    SUPPRESSED_BY_COLLAPSE = "suppressed_by_collapse"
    # summaries
    NO_SUMMARIZER = "no_summarizer"
    CIRCUIT_OPEN = "circuit_open"
    PROMPT_TOO_LONG = "prompt_too_long"
    SUMMARY_ERROR = "summary_error"
    SUMMARY_EMPTY = "summary_empty"
    SUMMARY_NOT_SMALLER = "summary_not_smaller"


class GroupOutcome(StrEnum):
    """How one API-level user message ended up (``sluicegate.group.outcome``)."""

    UNDER_BUDGET = "under_budget"
    PERSISTED = "persisted"
    """Over the budget; enough fresh results were persisted to fit."""
    FROZEN_OVER_BUDGET = "frozen_over_budget"
    """Results the model already saw whole exceed the budget alone: accepted as they are."""
    OVER_BUDGET = "over_budget"
    """Still over: a persist failed or what is left cannot be persisted."""


_NOT_RECORDED = contextlib.nullcontext(trace.INVALID_SPAN)


def span_if(
    recording: bool, tracer: trace.Tracer, name: str, **kwargs: Any
) -> AbstractContextManager[trace.Span]:
    """``tracer.start_as_current_span(name, **kwargs)`` when the pass records; else a context
    that yields the invalid span (every call on it a no-op) and costs nothing -- a pass makes
    a dozen spans, and even no-op ones cost microseconds each. Unless told otherwise, an
    exception is neither recorded nor made the span's status (its text may quote content)."""
    if recording:
        # exception text may quote content: the stage's own span reports the failure's type
        kwargs.setdefault("record_exception", False)
        kwargs.setdefault("set_status_on_exception", False)
        return tracer.start_as_current_span(name, **kwargs)
    return _NOT_RECORDED


def start_current_span(
    tracer: trace.Tracer,
    name: str,
    *,
    record_exception: bool = True,
    set_status_on_exception: bool = True,
    **kwargs: Any,
) -> AbstractContextManager[trace.Span]:
    """``tracer.start_as_current_span(name, ...)``, but a span that no SDK stands behind (not
    recording and of no valid context: the API's no-op tracer) is not made current when it
    would change nothing a span or a log line could see: with no ``context`` given, an invalid
    span means the current one is invalid too. That saves a context attach and detach per
    pass. A span started in a given ``context`` is always made current, so that what runs
    inside does not see the caller's span. The exception settings default as the API's do:
    pass ``record_exception=False`` for a span around content (see :mod:`pipeline.spans`)."""
    span = tracer.start_span(
        name,
        record_exception=record_exception,
        set_status_on_exception=set_status_on_exception,
        **kwargs,
    )
    if "context" not in kwargs and not span.is_recording() and not span.get_span_context().is_valid:
        return contextlib.nullcontext(span)
    return trace.use_span(
        span,
        end_on_exit=True,
        record_exception=record_exception,
        set_status_on_exception=set_status_on_exception,
    )


def emit_decision(
    tracer: trace.Tracer,
    stage_name: str,
    *,
    conversation_id: str,
    decision: Decision,
    reason: Reason,
    tokens_before: int | None = None,
    tokens_after: int | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
    call: int | None = None,
) -> None:
    """Emit one decision span (a child of the current span): :func:`decision_span_name`, with
    the decision, its reason, token counts and ``attributes`` (keys from :class:`ATTR`; never
    content)."""
    attrs: dict[str, AttributeValue] = {
        ATTR.CONVERSATION_ID: conversation_id,
        ATTR.STAGE: stage_name,
        ATTR.DECISION: str(decision),
        ATTR.REASON: str(reason),
    }
    if tokens_before is not None:
        attrs[ATTR.TOKENS_BEFORE] = tokens_before
    if tokens_after is not None:
        attrs[ATTR.TOKENS_AFTER] = tokens_after
    if call is not None:
        attrs[ATTR.CALL] = call
    if attributes:
        attrs.update(attributes)
    tracer.start_span(decision_span_name(stage_name, str(decision)), attributes=attrs).end()


# -- tracer and logger --------------------------------------------------------------------------


def get_tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """The ``sluicegate`` tracer from ``provider`` (default: the global provider)."""
    return trace.get_tracer(TRACER_NAME, tracer_provider=provider)
