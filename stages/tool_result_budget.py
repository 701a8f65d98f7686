"""The ``tool_result_budget`` stage: bound tool output per result and per API-level user message.

Runs first, before every model call (SPEC §1–§3):

1. Re-apply every earlier replacement byte for byte (no I/O).
2. For results no pass has seen ("fresh"): a result over its tool's threshold is persisted and
   replaced (the per-tool gate, for results the agent loop did not gate itself).
3. Per API-level user message (a group): if frozen + fresh chars exceed the limit, persist the
   largest fresh results until the rest fits. Results the model saw whole stay whole.

Every decision is frozen in ``ctx.replacement_state`` and recorded in the transcript, so the
prompt-cache prefix never changes once the model has seen it, across turns and across resume.

Incremental passes
------------------
A long session reaches thousands of messages, and the stage runs before every call. So that a
pass costs what is new rather than the whole history, each session keeps a cache in
``ctx.stage_state["tool_result_budget"]`` (stage objects are shared by sessions; the cache is
not): the grouping scan as one undoable step per message, candidate sizes and classes, the
tool-name map, the replacement map and the patched messages of the output.

Each pass compares the new input with the input of the previous pass, position by position: a
position is unchanged when it holds the same message object or an equal one (``==``; CPython
compares identical objects without calling ``__eq__``, so a history that only grew costs one
C-level sweep). From the first changed position on, the cached steps are undone in reverse and
the rest is scanned again. Results that depend on a tool_use_id anywhere in the history (the
replacement map) are recomputed for every id the changed part touches, and older messages that
carry such an id are patched again. So replacing, inserting, deleting, truncating or reordering
messages, or passing a different list, gives the same output as a from-scratch pass
(``tests/test_incremental.py`` proves it, byte for byte, state included).

What a pass costs: Python work for the new (or changed) messages and for the groups they
touch, C-level sweeps over the history (comparing the message lists, copying the output list
the stage must return, checking the ledger: tens of nanoseconds per message or result), and
one step per message that carries a replacement. At 5,000 messages a pass costs about 2% of a
from-scratch pass (``tests/benchmarks/bench_pipeline.py``).

The contract that makes the cache safe:

- Messages are immutable. Replacing a message (a new object, e.g. ``with_content``) is
  supported; mutating a message's content list or a block dict in place is NOT (an equal-looking
  old object cannot be told from a changed one without re-reading all content every pass).
- The ledger (``ctx.replacement_state``) may change between passes in any way -- replaced by
  another object, ids added, removed or rewritten: each pass checks, completely, that the
  replacements are the ones the cache knows and that every candidate it scanned is still seen,
  and starts from scratch otherwise. (Ids added to ``seen_ids`` are harmless and kept.)
- A pass that raises (including cancellation) drops the cache: the next pass starts from scratch.
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
from pipeline.incremental import InputLog
from pipeline.policies import MAX_TOOL_RESULTS_PER_MESSAGE_CHARS
from pipeline.replacement import (
    ReplacementRecord,
    ReplacementState,
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
class _Undo:
    """What one message added to the scan, so that a rollback can take exactly that back."""

    closed_group: bool = False
    """An assistant with a new id closed the open group."""
    assistant_id: str | None = None
    """The response id this message was the first to show."""
    names: list[tuple[str, str | None]] | None = None
    """(tool_use_id, the name it had before or None) for every tool_use, in order."""
    candidates: int = 0
    """Candidates appended to the open group."""
    empties: list[tuple[str, str | None]] | None = None
    """(tool_use_id, the placeholder it had before or None) for every empty result, in order."""
    unaddressable: int = 0
    malformed: int = 0
    tids: tuple[str, ...] = ()
    """tool_use_ids of every tool_result block (what the output patch of this message reads)."""


class _Scan:
    """The grouping scan of SPEC §2.1 as one undoable step per message.

    A group is a maximal run of user messages not separated by an assistant message with an id
    not seen before: same-id fragments (streaming, interleaved streams) merge back into one wire
    message, and progress / attachment / system records never split a group. Alongside: tool
    names by id, the placeholders of empty results, and per id where it first occurs and how
    many candidates carry it.
    """

    def __init__(self) -> None:
        self.undo: list[_Undo | None] = []
        self.closed: list[list[Candidate]] = []
        self.current: list[Candidate] = []
        self.tool_names: dict[str, str] = {}
        self.assistant_ids: set[str] = set()
        self.empty_ids: dict[str, str] = {}
        """tool_use_id -> placeholder of its last empty result."""
        self.unaddressable = 0
        """tool_result blocks without a usable string id."""
        self.malformed = 0
        """Non-mapping items in user content lists (the output patch cannot read them)."""
        self.first_pos: dict[str, int] = {}
        self.cand_count: dict[str, int] = {}
        self.reapplied = 0
        """Candidates whose id the ledger had replaced when they were counted (see push/pop)."""

    @property
    def groups(self) -> list[list[Candidate]]:
        """Every group with at least one candidate, in order."""
        return [*self.closed, self.current] if self.current else list(self.closed)

    def push(
        self, index: int, m: Message, replacements: Mapping[str, str], touched: set[str]
    ) -> None:
        """Scan message ``index``; add the ids of its tool_results to ``touched``."""
        if m.type == "assistant":
            self.undo.append(self._push_assistant(m))
            return
        if m.type != "user" or not isinstance(m.content, list):
            self.undo.append(None)
            return
        u = _Undo()
        tids: list[str] = []
        for b in m.content:
            if not isinstance(b, Mapping):
                u.malformed += 1
                continue
            if b.get("type") != "tool_result":
                continue
            tid = b.get("tool_use_id")
            if not isinstance(tid, str):
                u.unaddressable += 1
                continue
            tids.append(tid)
            self.first_pos.setdefault(tid, index)
            content = b.get("content")
            if content_is_empty(content):
                if u.empties is None:
                    u.empties = []
                u.empties.append((tid, self.empty_ids.get(tid)))
                self.empty_ids[tid] = empty_result_text(self.tool_names.get(tid))
                continue
            if not is_candidate(b):
                continue
            self.current.append(
                Candidate(
                    msg_index=index,
                    tool_use_id=tid,
                    tool_name=self.tool_names.get(tid),
                    content=content,
                    size=candidate_size(content),
                    persistable=is_persistable(content),
                )
            )
            u.candidates += 1
            self.cand_count[tid] = self.cand_count.get(tid, 0) + 1
            if tid in replacements:
                self.reapplied += 1
        if not (tids or u.unaddressable or u.malformed):
            self.undo.append(None)  # nothing to undo: share None rather than keep an object
            return
        u.tids = tuple(tids)
        touched.update(tids)
        self.unaddressable += u.unaddressable
        self.malformed += u.malformed
        self.undo.append(u)

    def _push_assistant(self, m: Message) -> _Undo | None:
        u: _Undo | None = None
        if m.message_id is None or m.message_id not in self.assistant_ids:
            u = _Undo()
            if self.current:
                self.closed.append(self.current)
                self.current = []
                u.closed_group = True
            if m.message_id is not None:
                self.assistant_ids.add(m.message_id)
                u.assistant_id = m.message_id
        if isinstance(m.content, list):
            for b in m.content:
                if not isinstance(b, Mapping):  # hostile input: not a block, not a tool_use
                    continue
                if b.get("type") == "tool_use" and isinstance(b.get("id"), str):
                    tid, name = b["id"], b.get("name")
                    if u is None:
                        u = _Undo()
                    if u.names is None:
                        u.names = []
                    u.names.append((tid, self.tool_names.get(tid)))
                    self.tool_names[tid] = name if isinstance(name, str) else ""
        return u

    def pop(self, index: int, replacements: Mapping[str, str], touched: set[str]) -> None:
        """Undo the last step (message ``index``); add the ids it touched to ``touched``."""
        u = self.undo.pop()
        if u is None:
            return
        for _ in range(u.candidates):
            tid = self.current.pop().tool_use_id
            touched.add(tid)
            n = self.cand_count[tid] - 1
            if n:
                self.cand_count[tid] = n
            else:
                del self.cand_count[tid]
            if tid in replacements:
                self.reapplied -= 1
        if u.empties is not None:
            for tid, previous in reversed(u.empties):
                _restore(self.empty_ids, tid, previous)
        for tid in u.tids:
            touched.add(tid)
            if self.first_pos.get(tid) == index:
                del self.first_pos[tid]
        self.unaddressable -= u.unaddressable
        self.malformed -= u.malformed
        if u.names is not None:
            for tid, previous in reversed(u.names):
                _restore(self.tool_names, tid, previous)
        if u.assistant_id is not None:
            self.assistant_ids.discard(u.assistant_id)
        if u.closed_group:
            # everything scanned after this message is undone, so the open group is empty
            self.current = self.closed.pop()


def _restore(d: dict[str, str], key: str, previous: str | None) -> None:
    if previous is None:
        d.pop(key, None)
    else:
        d[key] = previous


def collect_groups(messages: Sequence[Message]) -> list[list[Candidate]]:
    """Candidates grouped by the API-level user message they will be sent in (SPEC §2.1)."""
    scan = _Scan()
    scratch: set[str] = set()
    for index, m in enumerate(messages):
        scan.push(index, m, {}, scratch)
    return scan.groups


class _SessionCache:
    """One session's memory of earlier passes (see the module docstring for the contract)."""

    def __init__(self, state: ReplacementState) -> None:
        self.log = InputLog()
        """The input of the last pass, to find where this one first differs."""
        self.scan = _Scan()
        self.apply: dict[str, str] = {}
        """tool_use_id -> the text its tool_results are sent with: the ledger's replacement if
        the id is a candidate somewhere, else the placeholder of its last empty result."""
        self.patches: dict[int, Message] = {}
        """position -> the message sent there in place of the input's (only changed ones)."""
        self.busy = False
        self._replaced = dict(state.replacements)
        """The ledger's replacements as the last pass left them (values: the same objects)."""

    def fits(self, state: ReplacementState) -> bool:
        """Nothing this cache relies on changed in the ledger since the last pass.

        It relies on the replacements (the texts it patched in, the re-applied count) and on
        every candidate it scanned being seen (so that no earlier group needs a decision). Ids
        added to ``seen_ids`` change nothing cached: new results are classified when decided.
        Both checks are C-level sweeps with no copy (about 35 ns per scanned result id), and
        complete: any removal, rewrite or addition that matters is caught, also when the sizes
        stay the same; a ledger replaced by an equal one keeps the cache.
        """
        return (
            self._replaced == state.replacements and self.scan.cand_count.keys() <= state.seen_ids
        )

    def seal(self, replaced_now: Mapping[str, str]) -> None:
        """Take in the replacements this pass made (the only change a pass makes to them)."""
        self._replaced.update(replaced_now)

    def sync(
        self, messages: list[Message], replacements: Mapping[str, str]
    ) -> tuple[int, int, set[str]]:
        """Undo the scan back to the first change and scan the rest.

        Returns the first rescanned position, the index of the group that was open there (no
        earlier group holds a rescanned message) and the tool_use_ids the change touched.
        """
        scan = self.scan
        scanned = len(scan.undo)
        start = self.log.take(messages)
        touched: set[str] = set()
        if start < scanned:
            for index in range(scanned - 1, start - 1, -1):
                scan.pop(index, replacements, touched)
            for p in [p for p in self.patches if p >= start]:
                del self.patches[p]
        first_group = len(scan.closed)
        for index in range(start, len(messages)):
            scan.push(index, messages[index], replacements, touched)
        return start, first_group, touched

    def update_output(
        self,
        messages: list[Message],
        start: int,
        touched: set[str],
        replacements: Mapping[str, str],
    ) -> None:
        """Bring the replacement map and the patched messages up to date after this pass."""
        scan = self.scan
        stale: set[str] = set()  # ids whose text changed and that occur before ``start``
        stale_from = start
        for tid in touched:
            text = replacements.get(tid) if tid in scan.cand_count else None
            if text is None:
                text = scan.empty_ids.get(tid)
            old = self.apply.get(tid)
            if text == old:
                continue
            if text is None:
                del self.apply[tid]
            else:
                self.apply[tid] = text
            first = scan.first_pos.get(tid)
            if first is not None and first < start:
                stale.add(tid)
                stale_from = min(stale_from, first)
        if stale:  # rare: an id reused across the edit point, or an edit that removed one
            for index in range(stale_from, start):
                u = scan.undo[index]
                if u is not None and not stale.isdisjoint(u.tids):
                    self._patch(index, messages[index])
        for index in range(start, len(messages)):
            u = scan.undo[index]
            if u is not None and u.tids:
                self._patch(index, messages[index])

    def _patch(self, index: int, m: Message) -> None:
        patched = _patch_message(m, self.apply)
        if patched is m:
            self.patches.pop(index, None)
        else:
            self.patches[index] = patched

    def output(self, messages: list[Message]) -> list[Message]:
        """The projected list: the input itself when nothing changed (SPEC §2.4 step 6)."""
        if not self.patches:
            return messages
        out = list(messages)
        for index, m in self.patches.items():
            out[index] = m
        return out


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
    never changed, a replacement once made is re-applied byte for byte. A pass costs what is new
    since the last pass of the same session (see the module docstring for the cache contract);
    ``incremental=False`` turns the per-session cache off.
    """

    name = "tool_result_budget"
    may_break_cache = False

    def __init__(
        self, limit: float = MAX_TOOL_RESULTS_PER_MESSAGE_CHARS, *, incremental: bool = True
    ) -> None:
        # ``incremental=False`` computes every pass from scratch (same results, the cost of the
        # whole history): for measuring the cache, or to rule it out when chasing a problem.
        self.incremental = incremental
        if isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0:
            raise ValueError(f"per-message limit must be a number > 0, got {limit!r}")
        self.limit = limit

    def __repr__(self) -> str:
        off = "" if self.incremental else ", incremental=False"
        return f"ToolResultBudget(limit={self.limit!r}{off})"

    def _cache_for(self, ctx: SessionContext) -> tuple[_SessionCache, bool]:
        """This session's cache, or a new one; and whether it is (to be) kept."""
        state = ctx.replacement_state
        if not self.incremental:
            return _SessionCache(state), False
        cache = ctx.stage_state.get(self.name)
        if isinstance(cache, _SessionCache) and cache.busy:
            # a second pass of the same session while one is running (a caller bypassing
            # Pipeline.run's lock): work from scratch and leave the running pass's cache alone
            return _SessionCache(state), False
        if not isinstance(cache, _SessionCache) or not cache.fits(state):
            cache = _SessionCache(state)
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
        self, messages: list[Message], ctx: SessionContext, cache: _SessionCache
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
        groups = scan.closed[first_group:]
        if scan.current:
            groups.append(scan.current)
        already_replaced = {
            c.tool_use_id for g in groups for c in g if c.tool_use_id in state.replacements
        }
        new_records: list[ReplacementRecord] = []
        replaced_now: dict[str, str] = {}
        for index, group in enumerate(groups, start=first_group):
            if any(c.tool_use_id not in state.seen_ids for c in group):
                new_records += await self._decide_group(index, group, ctx, replaced_now)

        if new_records and ctx.transcript is not None:
            try:
                await anyio.to_thread.run_sync(ctx.transcript.append_replacements, new_records)
            except OSError as exc:
                # the decisions stand (they are in the state); only resume would lose them
                ctx.logger.error("replacement_record_write_failed", error=type(exc).__name__)
        stage_span.set_attribute(ATTR.PERSISTED, len(new_records))

        if scan.malformed:
            # A non-mapping item in a user content list: take the from-scratch output path, which
            # fails (or not) on it exactly as it always has; __call__ drops the cache afterwards.
            apply = dict(scan.empty_ids)
            for tid in scan.cand_count:
                text = state.replacements.get(tid)
                if text is not None:
                    apply[tid] = text
            return _apply_replacements(messages, apply)

        # from the next pass on, the candidates of newly replaced ids count as re-applied
        for tid in replaced_now:
            if tid not in already_replaced:
                scan.reapplied += scan.cand_count.get(tid, 0)
        touched.update(replaced_now)
        cache.update_output(messages, start, touched, state.replacements)
        cache.seal(replaced_now)
        return cache.output(messages)

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


def _patch_message(m: Message, apply: Mapping[str, str]) -> Message:
    """``m`` with its tool_results named in ``apply`` carrying that text; ``m`` if none changes.

    Every other block field (``tool_use_id``, ``is_error``, ``cache_control``) is kept.
    """
    if m.type != "user" or not isinstance(m.content, list):
        return m
    new_blocks: list[dict[str, Any]] | None = None
    for j, b in enumerate(m.content):
        if not isinstance(b, Mapping) or b.get("type") != "tool_result":
            continue
        tid = b.get("tool_use_id")
        replacement = apply.get(tid) if isinstance(tid, str) else None
        if replacement is None or b.get("content") == replacement:
            continue
        if new_blocks is None:
            new_blocks = list(m.content)
        new_blocks[j] = {**b, "content": replacement}
    return m if new_blocks is None else m.with_content(new_blocks)


def _apply_replacements(messages: list[Message], apply: Mapping[str, str]) -> list[Message]:
    """A new list where tool_results named in ``apply`` carry the replacement text.

    The from-scratch form of the output step: messages that need no change are the same
    objects; if nothing changed, the input list itself.
    """
    if not apply:
        return messages
    out: list[Message] | None = None
    for i, m in enumerate(messages):
        patched = _patch_message(m, apply)
        if patched is not m:
            if out is None:
                out = list(messages)
            out[i] = patched
    return messages if out is None else out
