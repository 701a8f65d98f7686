"""The ``tool_result_budget`` stage: bound tool output per result and per API-level user message.

Runs first, before every model call (SPEC §1–§3):

1. Re-apply every earlier replacement byte for byte (no I/O).
2. For results no pass has seen ("fresh"): a result over its tool's threshold is persisted and
   replaced (the per-tool gate, for results the agent loop did not gate itself).
3. Per API-level user message (a group): if frozen + fresh chars exceed the limit, persist the
   largest fresh results until the rest fits. Results the model saw whole stay whole.

Every decision is frozen in ``ctx.replacement_state`` and recorded in the transcript, so the
prompt-cache prefix never changes once the model has seen it, across turns and across resume.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
from opentelemetry import trace

from pipeline import Message, SessionContext
from pipeline.context import PersistedResult
from pipeline.gate import Persisted, empty_result_text, is_persistable, persist_content
from pipeline.policies import MAX_TOOL_RESULTS_PER_MESSAGE_CHARS
from pipeline.replacement import (
    ReplacementRecord,
    candidate_size,
    content_is_empty,
    is_candidate,
)
from pipeline.tracing import ATTR, SPAN_BUDGET_DECISION, SPAN_BUDGET_GROUP

__all__ = ["Candidate", "ToolResultBudget", "collect_groups", "select_fresh_to_replace"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A tool_result the budget may decide on, and where it sits."""

    msg_index: int
    tool_use_id: str
    tool_name: str | None
    content: Any
    size: int
    persistable: bool


@dataclass(slots=True)
class _Scan:
    groups: list[list[Candidate]]
    empty_ids: dict[str, str]  # tool_use_id -> placeholder for empty results
    unaddressable: int  # tool_result blocks without a usable string id


def collect_groups(messages: Sequence[Message]) -> list[list[Candidate]]:
    """Candidates grouped by the API-level user message they will be sent in (SPEC §2.1)."""
    return _scan(messages).groups


def _scan(messages: Sequence[Message]) -> _Scan:
    """One pass over the history: tool names by id, candidate groups, empty results.

    A group is a maximal run of user messages not separated by an assistant message with an id
    not seen before: same-id fragments (streaming, interleaved streams) merge back into one wire
    message, and progress / attachment / system records never split a group.
    """
    groups: list[list[Candidate]] = []
    current: list[Candidate] = []
    tool_names: dict[str, str] = {}
    seen_assistant_ids: set[str] = set()
    empty_ids: dict[str, str] = {}
    unaddressable = 0
    for index, m in enumerate(messages):
        if m.type == "assistant":
            if m.message_id is None or m.message_id not in seen_assistant_ids:
                if current:
                    groups.append(current)
                    current = []
                if m.message_id is not None:
                    seen_assistant_ids.add(m.message_id)
            if isinstance(m.content, list):
                for b in m.content:
                    if b.get("type") == "tool_use" and isinstance(b.get("id"), str):
                        name = b.get("name")
                        tool_names[b["id"]] = name if isinstance(name, str) else ""
            continue
        if m.type != "user" or not isinstance(m.content, list):
            continue
        for b in m.content:
            if not isinstance(b, Mapping) or b.get("type") != "tool_result":
                continue
            tid = b.get("tool_use_id")
            if not isinstance(tid, str):
                unaddressable += 1
                continue
            content = b.get("content")
            if content_is_empty(content):
                empty_ids[tid] = empty_result_text(tool_names.get(tid))
                continue
            if not is_candidate(b):
                continue
            current.append(
                Candidate(
                    msg_index=index,
                    tool_use_id=tid,
                    tool_name=tool_names.get(tid),
                    content=content,
                    size=candidate_size(content),
                    persistable=is_persistable(content),
                )
            )
    if current:
        groups.append(current)
    return _Scan(groups, empty_ids, unaddressable)


def select_fresh_to_replace(
    fresh: Sequence[Candidate], frozen_size: int, limit: float
) -> list[Candidate]:
    """Largest fresh results first (stable) until frozen + the rest fits ``limit`` (SPEC §2.4).

    A candidate that cannot be persisted still counts toward the sum but is passed over. If the
    frozen results alone exceed the limit, the overage is accepted.
    """
    remaining = frozen_size + sum(c.size for c in fresh)
    selected: list[Candidate] = []
    for c in sorted(fresh, key=lambda c: c.size, reverse=True):
        if remaining <= limit:
            break
        if not c.persistable:
            continue
        selected.append(c)
        remaining -= c.size
    return selected


class ToolResultBudget:
    """Stage: bound tool_result size per result and per API-level user message.

    ``limit``: the per-message budget in characters (default 200,000). Per-tool thresholds come
    from ``ctx.tool_policies``. Never breaks the prompt cache: a result the model has seen is
    never changed, a replacement once made is re-applied byte for byte.
    """

    name = "tool_result_budget"
    may_break_cache = False

    def __init__(self, limit: float = MAX_TOOL_RESULTS_PER_MESSAGE_CHARS) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0:
            raise ValueError(f"per-message limit must be a number > 0, got {limit!r}")
        self.limit = limit

    def __repr__(self) -> str:
        return f"ToolResultBudget(limit={self.limit!r})"

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        state = ctx.replacement_state
        scan = _scan(messages)
        if scan.unaddressable:
            ctx.logger.warning("tool_result_without_id", count=scan.unaddressable)
        apply: dict[str, str] = dict(scan.empty_ids)
        reapplied = 0
        for group in scan.groups:
            for c in group:
                replacement = state.replacements.get(c.tool_use_id)
                if replacement is not None:
                    apply[c.tool_use_id] = replacement
                    reapplied += 1
        ctx.report.reapplied += reapplied
        stage_span = trace.get_current_span()  # the pipeline's span for this stage
        stage_span.set_attribute(ATTR.REAPPLIED, reapplied)

        new_records: list[ReplacementRecord] = []
        for index, group in enumerate(scan.groups):
            if any(c.tool_use_id not in state.seen_ids for c in group):
                new_records += await self._decide_group(index, group, ctx, apply)

        if new_records and ctx.transcript is not None:
            try:
                await anyio.to_thread.run_sync(ctx.transcript.append_replacements, new_records)
            except OSError as exc:
                # the decisions stand (they are in the state); only resume would lose them
                ctx.logger.error("replacement_record_write_failed", error=type(exc).__name__)
        stage_span.set_attribute(ATTR.PERSISTED, len(new_records))
        return _apply_replacements(messages, apply)

    async def _decide_group(
        self,
        index: int,
        group: list[Candidate],
        ctx: SessionContext,
        apply: dict[str, str],
    ) -> list[ReplacementRecord]:
        state = ctx.replacement_state
        policies = ctx.tool_policies
        tracer = ctx.tracer
        with tracer.start_as_current_span(
            SPAN_BUDGET_GROUP,
            attributes={
                ATTR.CONVERSATION_ID: ctx.session_id,
                ATTR.GROUP_INDEX: index,
                ATTR.GROUP_CANDIDATES: len(group),
                ATTR.LIMIT: float(self.limit),
            },
        ) as span:
            # ids may repeat in hostile input; decide each id once
            fresh: list[Candidate] = []
            fresh_ids: set[str] = set()
            for c in group:
                if c.tool_use_id not in state.seen_ids and c.tool_use_id not in fresh_ids:
                    fresh.append(c)
                    fresh_ids.add(c.tool_use_id)

            # 1. never-persist tools: seen now, out of the sum
            unbounded = [c for c in fresh if policies.never_persist(c.tool_name)]
            unbounded_ids = {c.tool_use_id for c in unbounded}
            for c in unbounded:
                state.seen_ids.add(c.tool_use_id)
                self._decision(ctx, c, "skip_unbounded_tool", math.inf)

            # 2. the per-tool gate, for results this stage is the first to see
            bounded = [c for c in fresh if not policies.never_persist(c.tool_name)]
            over_tool = [
                c for c in bounded if c.persistable and c.size > policies.threshold(c.tool_name)
            ]
            records = await self._persist(ctx, over_tool, "per_tool", apply)

            # 3. the per-message budget over what is left
            eligible = [c for c in bounded if c.tool_use_id not in state.seen_ids]
            # frozen: seen earlier and sent whole, or a per-tool write that just failed
            frozen_size = sum(
                c.size
                for c in group
                if c.tool_use_id in state.seen_ids
                and c.tool_use_id not in state.replacements
                and c.tool_use_id not in unbounded_ids
            )
            fresh_size = sum(c.size for c in eligible)
            selected = select_fresh_to_replace(eligible, frozen_size, self.limit)
            selected_ids = {c.tool_use_id for c in selected}
            for c in eligible:
                if c.tool_use_id not in selected_ids:
                    state.seen_ids.add(c.tool_use_id)
                    self._decision(ctx, c, "keep", policies.threshold(c.tool_name))
            records += await self._persist(ctx, selected, "per_message", apply)

            if frozen_size + fresh_size <= self.limit:
                outcome = "under_budget"
            elif frozen_size > self.limit:
                outcome = "frozen_over_budget"
            else:
                visible = frozen_size + sum(
                    c.size for c in eligible if c.tool_use_id not in state.replacements
                )
                outcome = "persisted" if visible <= self.limit else "over_budget"
            span.set_attribute(ATTR.FROZEN_CHARS, frozen_size)
            span.set_attribute(ATTR.FRESH_CHARS, fresh_size)
            span.set_attribute(ATTR.OUTCOME, outcome)
            span.set_attribute(ATTR.PERSISTED, len(records))
        return records

    async def _persist(
        self,
        ctx: SessionContext,
        chosen: list[Candidate],
        reason: str,
        apply: dict[str, str],
    ) -> list[ReplacementRecord]:
        """Persist ``chosen`` concurrently; mark each seen together with its replacement."""
        if not chosen:
            return []
        results: dict[str, Persisted | BaseException] = {}

        async def one(c: Candidate) -> None:
            try:
                results[c.tool_use_id] = await persist_content(ctx.store, c.tool_use_id, c.content)
            except Exception as exc:  # a failed write must never fail the turn
                results[c.tool_use_id] = exc

        async with anyio.create_task_group() as tg:
            for c in chosen:
                tg.start_soon(one, c)

        state = ctx.replacement_state
        records: list[ReplacementRecord] = []
        for c in chosen:
            outcome = results[c.tool_use_id]
            threshold = ctx.tool_policies.threshold(c.tool_name)
            if isinstance(outcome, Persisted):
                state.record_replacement(c.tool_use_id, outcome.replacement)
                apply[c.tool_use_id] = outcome.replacement
                records.append(ReplacementRecord(c.tool_use_id, outcome.replacement))
                ctx.report.persisted.append(
                    PersistedResult(c.tool_use_id, c.tool_name, c.size, outcome.path, reason)
                )
                self._decision(ctx, c, "persist", threshold, path=outcome.path, reason=reason)
            else:
                # the original is what gets sent, so it is frozen as it is
                state.seen_ids.add(c.tool_use_id)
                ctx.report.persist_failed.append(c.tool_use_id)
                self._decision(
                    ctx,
                    c,
                    "persist_failed",
                    threshold,
                    reason=reason,
                    error=type(outcome).__name__,
                )
        return records

    def _decision(
        self,
        ctx: SessionContext,
        c: Candidate,
        decision: str,
        threshold: float,
        *,
        path: str | None = None,
        reason: str | None = None,
        error: str | None = None,
    ) -> None:
        attributes: dict[str, str | int | float] = {
            ATTR.CONVERSATION_ID: ctx.session_id,
            ATTR.DECISION: decision,
            ATTR.TOOL_CALL_ID: c.tool_use_id,
            ATTR.TOOL_NAME: c.tool_name or "",
            ATTR.CHARS: c.size,
            ATTR.LIMIT: float(threshold),
        }
        if path is not None:
            attributes[ATTR.PATH] = path
        if reason is not None:
            attributes[ATTR.REASON] = reason
        if error is not None:
            attributes[ATTR.ERROR] = error
        log = {"persist": ctx.logger.info, "persist_failed": ctx.logger.warning}.get(
            decision, ctx.logger.debug
        )
        # log inside the span so the event carries the decision span's id
        with ctx.tracer.start_as_current_span(SPAN_BUDGET_DECISION, attributes=attributes):
            log(
                "tool_result_budget.decision",
                decision=decision,
                tool_use_id=c.tool_use_id,
                tool_name=c.tool_name,
                chars=c.size,
                path=path,
                reason=reason,
                error=error,
            )


def _apply_replacements(messages: list[Message], apply: Mapping[str, str]) -> list[Message]:
    """A new list where tool_results named in ``apply`` carry the replacement text.

    Every other block field (``tool_use_id``, ``is_error``, ``cache_control``) is kept; messages
    that need no change are the same objects; if nothing changed, the input list itself.
    """
    if not apply:
        return messages
    out: list[Message] | None = None
    for i, m in enumerate(messages):
        if m.type != "user" or not isinstance(m.content, list):
            continue
        new_blocks: list[dict[str, Any]] | None = None
        for j, b in enumerate(m.content):
            if b.get("type") != "tool_result":
                continue
            tid = b.get("tool_use_id")
            replacement = apply.get(tid) if isinstance(tid, str) else None
            if replacement is None or b.get("content") == replacement:
                continue
            if new_blocks is None:
                new_blocks = list(m.content)
            new_blocks[j] = {**b, "content": replacement}
        if new_blocks is not None:
            if out is None:
                out = list(messages)
            out[i] = m.with_content(new_blocks)
    return messages if out is None else out
