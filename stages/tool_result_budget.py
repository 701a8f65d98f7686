"""The ``tool_result_budget`` stage: bound tool output per result and per API-level user message.

Runs first, before every model call:

1. Re-apply every earlier replacement byte for byte (no I/O).
2. For results no pass has seen ("fresh"): a result over its tool's threshold is persisted and
   replaced (the per-tool gate, for results the agent loop did not gate itself).
3. Per API-level user message (a group): if frozen + fresh chars exceed the limit, persist the
   largest fresh results until the rest fits. Results the model saw whole stay whole.

Every decision is frozen in ``ctx.replacement_state`` and recorded in the transcript, so the
prompt-cache prefix never changes once the model has seen it, across turns and across resume.

A pass costs what is new since the last pass of the same session: see
:mod:`stages._budget_scan` for how, and for the contract that makes it safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import anyio
import anyio.to_thread
from opentelemetry import trace

from pipeline import Message, SessionContext
from pipeline.context import PersistedResult
from pipeline.gate import Persisted, describe_error, persist_content
from pipeline.policies import MAX_TOOL_RESULTS_PER_MESSAGE_CHARS
from pipeline.replacement import DECIDED_RECORD_STAGE, ReplacementRecord, decided_record
from pipeline.store.records import hold_back
from pipeline.tracing import (
    ATTR,
    SPAN_BUDGET_GROUP,
    AttributeValue,
    Decision,
    GroupOutcome,
    Reason,
    bounded_attribute,
    decision_span_name,
    limit_attribute,
    size_facts,
    span_if,
)
from stages._budget_scan import BudgetCache, patch_all
from stages._group_scan import Candidate, collect_groups
from stages._shared import write_off_loop
from stages._shared.args import check_bool, check_positive

__all__ = ["Candidate", "ToolResultBudget", "collect_groups", "select_fresh_to_replace"]


def select_fresh_to_replace(
    fresh: Sequence[Candidate], frozen_size: int, limit: float
) -> list[Candidate]:
    """Largest fresh results first (stable) until frozen + the rest fits ``limit`` .

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
    never changed, a replacement once made is re-applied byte for byte. A pass costs what is new
    since the last pass of the same session (see :mod:`stages._budget_scan` for the cache
    contract);
    ``incremental=False`` turns the per-session cache off.
    """

    name = "tool_result_budget"
    strategy = "budget"
    may_break_cache = False
    readonly_input = True

    def __init__(
        self, limit: float = MAX_TOOL_RESULTS_PER_MESSAGE_CHARS, *, incremental: bool = True
    ) -> None:
        self.limit = check_positive("limit", limit)
        # ``incremental=False`` computes every pass from scratch (same results, the cost of the
        # whole history): for measuring the cache, or to rule it out when chasing a problem.
        self.incremental = check_bool("incremental", incremental)

    @property
    def rereads_outputs(self) -> bool:
        """Whether a later pass may read again a tool output (or another long text) it has met
        (:func:`~pipeline.core.rereading_stages`): only when it rescans every pass
        (``incremental=False``); its cache keeps each result's size and key, and lets go of a
        decided output."""
        return not self.incremental

    def __repr__(self) -> str:
        off = "" if self.incremental else ", incremental=False"
        return f"ToolResultBudget(limit={self.limit!r}{off})"

    def _cache_for(self, ctx: SessionContext) -> tuple[BudgetCache, bool]:
        """This session's cache, or a new one; and whether it is (to be) kept."""
        state = ctx.replacement_state
        if not self.incremental:
            return BudgetCache(state), False
        cache = ctx.stage_state.get(self.name)
        if isinstance(cache, BudgetCache) and cache.busy:
            # a second pass of the same session while one is running (a caller bypassing
            # Pipeline.run's lock): work from scratch and leave the running pass's cache alone
            return BudgetCache(state), False
        if not isinstance(cache, BudgetCache) or not cache.fits(state):
            cache = BudgetCache(state)
            ctx.stage_state[self.name] = cache
        return cache, True

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        cache, kept = self._cache_for(ctx)
        cache.busy = True
        try:
            out = await self._run(messages, ctx, cache)
        except BaseException:
            # half-applied work must not be trusted by the next pass
            if ctx.stage_state.get(self.name) is cache:
                del ctx.stage_state[self.name]
            raise
        finally:
            cache.busy = False
        if kept and cache.scan.malformed and ctx.stage_state.get(self.name) is cache:
            del ctx.stage_state[self.name]  # hostile input is not worth caching
        return out

    async def _run(
        self, messages: list[Message], ctx: SessionContext, cache: BudgetCache
    ) -> list[Message]:
        state = ctx.replacement_state
        start, first_group, touched = cache.sync(messages, state.replacements)
        scan = cache.scan
        if scan.unaddressable:
            ctx.logger.warning("tool_result_without_id", count=scan.unaddressable)
        reapplied = scan.reapplied
        ctx.report.reapplied += reapplied
        stage_span = trace.get_current_span()  # the pipeline's span for this stage
        stage_span.set_attribute(ATTR.REAPPLIED, reapplied)

        # Only groups holding a message scanned in this pass can hold a fresh candidate: every
        # candidate an earlier pass scanned was decided (seen) by that pass.
        groups: list[Sequence[Candidate]] = [*scan.closed[first_group:]]
        if scan.current:
            groups.append(scan.current)
        already_replaced = {c.key for g in groups for c in g if c.key in state.replacements}
        new_records: list[ReplacementRecord] = []
        replaced_now: dict[str, str] = {}
        decided: list[str] = []
        for index, group in enumerate(groups, start=first_group):
            if any(c.key not in state.seen_ids for c in group):
                new_records += await self._decide_group(index, group, ctx, replaced_now, decided)

        if decided and ctx.transcript is not None:
            # the decisions stand (they are in the ledger); only a resume would lose them.
            # Results sent whole are recorded too: a resume cannot tell them from results a
            # crash left undecided (those are decided again) by where they stand.
            whole = [t for t in decided if t not in replaced_now]
            if new_records:
                append = partial(ctx.transcript.append_replacements, new_records)
                await write_off_loop(ctx, append, stage=self.name)
            if whole:
                data = decided_record(whole)
                # a crash may lose this one: a new process places a result the model answered
                # after as sent whole, and decides one it never answered again (alike, under
                # the same limits)
                if not hold_back(ctx.transcript, DECIDED_RECORD_STAGE, data):
                    append = partial(ctx.transcript.append_stage_record, DECIDED_RECORD_STAGE, data)
                    await write_off_loop(ctx, append, stage=self.name)
        stage_span.set_attribute(ATTR.PERSISTED, len(new_records))
        kept_off = scan.kept_off(state.replacements)
        ctx.report.chars_kept_off += kept_off
        stage_span.set_attribute(ATTR.KEPT_OFF_WIRE, kept_off)
        if not decided:  # nothing fresh: the pass's decision is to re-apply (or do nothing)
            ctx.decide(
                self.name,
                Decision.REAPPLY if reapplied else Decision.SKIP,
                Reason.NO_FRESH_RESULTS,
                facts={ATTR.REAPPLIED: reapplied, ATTR.KEPT_OFF_WIRE: kept_off},
            )

        if scan.malformed:
            # A non-mapping item in a user content list: take the from-scratch output path, which
            # fails (or not) on it exactly as it always has; __call__ drops the cache afterwards.
            return patch_all(messages, state.replacements)

        # from the next pass on, the candidates of newly replaced results count as re-applied
        for key in replaced_now:
            if key not in already_replaced:
                scan.reapplied += scan.cand_count.get(key, 0)
        touched.update(replaced_now)
        cache.update_output(messages, start, touched, state.replacements)
        scan.settle(first_group)
        cache.seal(state, replaced_now)
        return cache.output(messages)

    async def _decide_group(
        self,
        index: int,
        group: Sequence[Candidate],
        ctx: SessionContext,
        apply: dict[str, str],
        decided: list[str],
    ) -> list[ReplacementRecord]:
        state = ctx.replacement_state
        policies = ctx.tool_policies
        tracer = ctx.tracer
        budget = limit_attribute(self.limit)
        group_facts: dict[str, AttributeValue] = {
            ATTR.GROUP_CANDIDATES: len(group),
            ATTR.GROUP_CHARS: sum(c.size for c in group),
        }
        if budget is not None:
            group_facts[ATTR.LIMIT_PER_MESSAGE] = budget
        with span_if(
            ctx.report.recording,
            tracer,
            SPAN_BUDGET_GROUP,
            attributes={
                **ctx.span_attributes(),
                ATTR.GROUP_INDEX: index,
                **({} if budget is None else {ATTR.LIMIT: budget}),
                **group_facts,
            },
        ) as span:
            # a result may repeat (the same id and output twice); decide each once
            fresh: list[Candidate] = []
            fresh_keys: set[str] = set()
            for c in group:
                if c.key not in state.seen_ids and c.key not in fresh_keys:
                    fresh.append(c)
                    fresh_keys.add(c.key)
                    decided.append(c.key)  # every fresh result is decided below

            # 1. never-persist tools: seen now, out of the sum
            unbounded = [c for c in fresh if policies.never_persist(c.tool_name)]
            unbounded_keys = {c.key for c in unbounded}
            for c in unbounded:
                state.seen_ids.add(c.key)
                skip = Decision.SKIP_UNBOUNDED_TOOL
                self._decision(ctx, c, skip, None, Reason.NEVER_PERSIST, group_facts)

            # 2. the per-tool gate, for results this stage is the first to see
            bounded = [c for c in fresh if not policies.never_persist(c.tool_name)]
            over_tool = [
                c for c in bounded if c.persistable and c.size > policies.threshold(c.tool_name)
            ]
            freed: list[int] = []
            records = await self._persist(
                ctx, over_tool, Reason.PER_TOOL, apply, group_facts, freed
            )

            # 3. the per-message budget over what is left
            eligible = [c for c in bounded if c.key not in state.seen_ids]
            # frozen: seen earlier and sent whole, or a per-tool write that just failed; a
            # never-persist tool's result is out of the sum on every pass, not only its first
            # (how passes split a message must not change what is decided)
            frozen = [
                c
                for c in group
                if c.key in state.seen_ids
                and c.key not in state.replacements
                and c.key not in unbounded_keys
                and not policies.never_persist(c.tool_name)
            ]
            frozen_size = sum(c.size for c in frozen)
            fresh_size = sum(c.size for c in eligible)
            selected = select_fresh_to_replace(eligible, frozen_size, self.limit)
            selected_keys = {c.key for c in selected}
            total = frozen_size + fresh_size  # what the per-message budget weighs
            over = int(total - self.limit) if total > self.limit else 0
            group_facts[ATTR.FROZEN_CHARS] = frozen_size
            group_facts[ATTR.FRESH_CHARS] = fresh_size
            for c in eligible:
                if c.key not in selected_keys:
                    state.seen_ids.add(c.key)
                    why = Reason.PER_MESSAGE if c.persistable else Reason.NOT_PERSISTABLE
                    self._decision(ctx, c, Decision.KEEP, budget, why, group_facts, over=over)
            records += await self._persist(
                ctx, selected, Reason.PER_MESSAGE, apply, group_facts, freed, over=over
            )

            # what the message sends now, its persisted results aside
            visible = frozen_size + sum(c.size for c in eligible if c.key not in state.replacements)
            if visible > self.limit:
                # over by what the model saw whole before this pass alone; a write that just
                # failed is this pass's own excess
                saw = sum(c.size for c in frozen if c.key not in fresh_keys)
                fits = saw > self.limit
                outcome = GroupOutcome.FROZEN_OVER_BUDGET if fits else GroupOutcome.OVER_BUDGET
            else:
                outcome = GroupOutcome.PERSISTED if records else GroupOutcome.UNDER_BUDGET
            span.set_attributes(
                {
                    ATTR.FROZEN_CHARS: frozen_size,
                    ATTR.FRESH_CHARS: fresh_size,
                    ATTR.CHARS_OVER: over,
                    ATTR.CHARS_FREED: sum(freed),
                    ATTR.OUTCOME: str(outcome),
                    ATTR.PERSISTED: len(records),
                }
            )
        return records

    async def _persist(
        self,
        ctx: SessionContext,
        chosen: list[Candidate],
        reason: Reason,
        apply: dict[str, str],
        facts: dict[str, AttributeValue],
        freed: list[int],
        *,
        over: int | None = None,
    ) -> list[ReplacementRecord]:
        """Persist ``chosen`` concurrently; mark each seen together with its replacement (what
        each persist freed is added to ``freed``). ``over``: the message's excess, for a
        per-message decision."""
        if not chosen:
            return []
        results: dict[str, Persisted | BaseException] = {}

        async def one(c: Candidate) -> None:
            try:
                results[c.key] = await persist_content(ctx.store, c.tool_use_id, c.content)
            except Exception as exc:  # a failed write must never fail the turn
                results[c.key] = exc

        async with anyio.create_task_group() as tg:
            for c in chosen:
                tg.start_soon(one, c)

        state = ctx.replacement_state
        records: list[ReplacementRecord] = []
        for c in chosen:
            outcome = results[c.key]
            limit = limit_attribute(
                self.limit
                if reason is Reason.PER_MESSAGE
                else ctx.tool_policies.threshold(c.tool_name)
            )
            if isinstance(outcome, Persisted):
                freed.append(max(0, c.size - len(outcome.replacement)))
                state.record_replacement(c.key, outcome.replacement)
                apply[c.key] = outcome.replacement
                digest = c.key[len(c.tool_use_id) + 1 :]
                records.append(ReplacementRecord(c.tool_use_id, outcome.replacement, digest=digest))
                ctx.report.persisted.append(
                    PersistedResult(
                        c.tool_use_id,
                        c.tool_name,
                        c.size,
                        outcome.path,
                        str(reason),
                        limit=limit,
                        group_results=int(facts[ATTR.GROUP_CANDIDATES]),
                        group_chars=int(facts[ATTR.GROUP_CHARS]),
                    )
                )
                self._decision(
                    ctx, c, Decision.PERSIST, limit, reason, facts, persisted=outcome, over=over
                )
            else:
                # the original is what gets sent, so it is frozen as it is
                state.seen_ids.add(c.key)
                ctx.report.persist_failed.append(c.tool_use_id)
                self._decision(
                    ctx,
                    c,
                    Decision.PERSIST_FAILED,
                    limit,
                    reason,
                    facts,
                    error=describe_error(outcome),
                    over=over,
                )
        return records

    def _decision(
        self,
        ctx: SessionContext,
        c: Candidate,
        decision: Decision,
        limit: int | None,
        reason: Reason,
        facts: dict[str, AttributeValue],
        *,
        persisted: Persisted | None = None,
        error: str | None = None,
        over: int | None = None,
    ) -> None:
        """One decision on one fresh result: its span (``tool_result_budget.<decision>``) says
        what was decided, why, under which limit, the sizes that drove it and, for a persist,
        what the model sees instead; a log event inside it."""
        path = persisted.path if persisted is not None else None
        log = {Decision.PERSIST: ctx.logger.info, Decision.PERSIST_FAILED: ctx.logger.warning}.get(
            decision, ctx.logger.debug
        )
        recording = ctx.report.recording
        links: list[trace.Link] = []
        attributes: dict[str, AttributeValue] = {}
        if recording:
            attributes = {
                **ctx.span_attributes(),
                ATTR.STAGE: self.name,
                ATTR.DECISION: str(decision),
                ATTR.REASON: str(reason),
                ATTR.TOOL_CALL_ID: bounded_attribute(c.tool_use_id),
                ATTR.TOOL_NAME: bounded_attribute(c.tool_name or ""),
                **facts,
                **size_facts(
                    c.size,
                    limit,
                    over=over,
                    replacement_chars=len(persisted.replacement) if persisted else None,
                ),
            }
            per_tool = limit_attribute(ctx.tool_policies.threshold(c.tool_name))
            if per_tool is not None:
                attributes[ATTR.LIMIT_PER_TOOL] = per_tool
            if persisted is not None:
                attributes[ATTR.PATH] = persisted.path
                if persisted.spooled:
                    attributes[ATTR.SPOOLED] = True
            if error is not None:
                attributes[ATTR.ERROR] = error
            executed = ctx.tool_spans.get(c.tool_use_id)
            if executed is not None:  # the tool ran in an earlier turn: its own trace
                links.append(trace.Link(executed[0]))
                if executed[1] is not None:
                    attributes[ATTR.EXECUTED_IN_CALL] = executed[1]
        # log inside the span so the event carries the decision span's id
        name = decision_span_name(self.name, str(decision))
        with span_if(recording, ctx.tracer, name, attributes=attributes, links=links):
            fields = {"limit": limit, "path": path, "error": error}  # only those that apply
            log(
                "tool_result_budget.decision",
                decision=decision,
                reason=reason,
                tool_use_id=bounded_attribute(c.tool_use_id),
                tool_name=c.tool_name and bounded_attribute(c.tool_name),
                chars=c.size,
                **{k: v for k, v in fields.items() if v is not None},
            )
