"""Every span name and attribute key sluicegate emits, the tracer, and the structlog glue.

The library depends on ``opentelemetry-api`` only: with no SDK installed (or none configured)
every span is a no-op. No span attribute ever holds message content.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

import structlog
from opentelemetry import trace

__all__ = [
    "ATTR",
    "SPAN_AGENT_TURN",
    "SPAN_BUDGET_DECISION",
    "SPAN_BUDGET_GROUP",
    "SPAN_PIPELINE_RUN",
    "SPAN_REPLAY",
    "SPAN_TOOL_EXECUTE",
    "SPAN_TOOL_GATE",
    "TRACER_NAME",
    "add_trace_ids",
    "decision_span_name",
    "emit_decision",
    "get_logger",
    "get_tracer",
    "stage_span_name",
    "tool_span_name",
]

TRACER_NAME = "sluicegate"

SPAN_PIPELINE_RUN = "pipeline.run"
SPAN_REPLAY = "replay.session"
SPAN_BUDGET_GROUP = "tool_result_budget.group"
SPAN_BUDGET_DECISION = "tool_result_budget.decision"
SPAN_TOOL_GATE = "tool_result_gate"
SPAN_AGENT_TURN = "agent.turn"
SPAN_TOOL_EXECUTE = "execute_tool"


def tool_span_name(tool_name: str) -> str:
    """The span of one tool execution (gen_ai convention): ``execute_tool <name>``."""
    return f"{SPAN_TOOL_EXECUTE} {tool_name}"


def decision_span_name(stage_name: str) -> str:
    """The span of one decision of a stage, "not now" included: ``<stage>.decision``."""
    return f"{stage_name}.decision"


def emit_decision(
    tracer: trace.Tracer,
    stage_name: str,
    *,
    conversation_id: str,
    decision: str,
    reason: str,
    tokens_before: int | None = None,
    tokens_after: int | None = None,
    **attributes: str | int | float | bool,
) -> None:
    """Emit one decision span (a child of the current span) with reason code and token counts.

    ``attributes`` are added under ``sluicegate.<key>``. Never pass content.
    """
    attrs: dict[str, str | int | float | bool] = {
        ATTR.CONVERSATION_ID: conversation_id,
        ATTR.STAGE: stage_name,
        ATTR.DECISION: decision,
        ATTR.REASON: reason,
    }
    if tokens_before is not None:
        attrs[ATTR.TOKENS_BEFORE] = tokens_before
    if tokens_after is not None:
        attrs[ATTR.TOKENS_AFTER] = tokens_after
    for key, value in attributes.items():
        attrs[f"sluicegate.{key}"] = value
    tracer.start_span(decision_span_name(stage_name), attributes=attrs).end()


def stage_span_name(stage_name: str) -> str:
    """The span of one stage's pass: ``stage.<name>``."""
    return f"stage.{stage_name}"


class ATTR:
    """Span attribute keys (OpenTelemetry gen_ai conventions where one exists)."""

    CONVERSATION_ID = "gen_ai.conversation.id"
    TOOL_NAME = "gen_ai.tool.name"
    TOOL_CALL_ID = "gen_ai.tool.call.id"
    MESSAGES_IN = "sluicegate.messages.in"
    MESSAGES_OUT = "sluicegate.messages.out"
    TOKENS_BEFORE = "sluicegate.tokens.estimated_before"
    TOKENS_AFTER = "sluicegate.tokens.estimated_after"
    STAGE = "sluicegate.stage"
    STAGE_CHANGED = "sluicegate.stage.changed"
    BREAKS_CACHE = "sluicegate.stage.may_break_cache"
    DECISION = "sluicegate.decision"
    REASON = "sluicegate.reason"
    CHARS = "sluicegate.chars"
    LIMIT = "sluicegate.limit"
    PATH = "sluicegate.path"
    ERROR = "sluicegate.error"
    GROUP_INDEX = "sluicegate.group.index"
    GROUP_CANDIDATES = "sluicegate.group.candidates"
    FROZEN_CHARS = "sluicegate.group.frozen_chars"
    FRESH_CHARS = "sluicegate.group.fresh_chars"
    OUTCOME = "sluicegate.group.outcome"
    REAPPLIED = "sluicegate.budget.reapplied"
    PERSISTED = "sluicegate.budget.persisted"


def get_tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """The ``sluicegate`` tracer from ``provider`` (default: the global provider)."""
    return trace.get_tracer(TRACER_NAME, tracer_provider=provider)


def add_trace_ids(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: add ``trace_id``/``span_id`` of the current span, if any."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    return event_dict


def get_logger(**initial: Any) -> Any:
    """A structlog logger whose events carry the current trace and span ids.

    The processor is bound to this logger, so it works whatever the app's structlog setup is.
    An app that configured structlog gets its own levels and output; an app that did not gets
    warnings and errors only — a library must not fill stdout with per-decision debug lines.
    """
    extra: dict[str, Any] = {}
    if not structlog.is_configured():
        extra["wrapper_class"] = structlog.make_filtering_bound_logger(logging.WARNING)
    return structlog.wrap_logger(
        None, processors=[add_trace_ids, *structlog.get_config()["processors"]], **extra
    ).bind(**initial)
