"""The ``context_collapse`` stage: replaces spans of old rounds with summaries.

Strategy ``summarize-spans``, a read-time projection (the history is never edited). When the
estimate reaches ``commit_fraction`` (90%) of ``context_window``, the oldest not-yet-collapsed
whole rounds (a response, its tool_results, whatever follows up to the next response) go to a
:class:`~pipeline.summarizer.Summarizer` in wire form: enough to reach ``target_fraction``, at
most ``max_span_fraction`` of the window. Kept: the first user message (verbatim task), the round
holding the latest prompt, the anchor's round and the last ``keep_recent_rounds``. Every pass
replaces each committed span by one user text ``SUMMARY_HEADER + summary``: after a user part
(to_api merges it there, after the tool_results) or between responses, then a response — roles
alternate, no pair splits. Active commits set ``suppress_autocompact``; commits are recorded
(``{"uuids", "summary", "anchor"}``) so a resumed session restores them. A record that is
malformed, or whose span names a record collapse keeps, is ignored with a warning
(``stage_record.ignored``).

Decision span per pass (``context_collapse.<decision>``), the decision ``skip`` or ``reapply`` with
``no_summarizer``, ``below_trigger``, ``nothing_eligible`` or ``circuit_open`` (``max_failures``
failed or discarded summaries in a row: stop paying for them); ``collapse`` with
``over_trigger``; ``fail`` with ``prompt_too_long`` or ``summary_error``; ``discard`` with
``summary_empty`` or ``summary_not_smaller``.
"""

from __future__ import annotations

import uuid as _uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline import Message, SessionContext, to_api
from pipeline.kept_list import KeptList
from pipeline.messages import block_type, stable_uuid, thread_start
from pipeline.summarizer import (
    SUMMARY_TIMEOUT,
    Summarizer,
    SummaryPromptTooLong,
    ask_summary,
)
from pipeline.tracing import ATTR, AttributeValue, Decision, Reason
from stages._shared import (
    DEFAULT_CONTEXT_WINDOW,
    ProjectionPass,
    ProjectionState,
    RoundView,
    record_decision,
)
from stages._shared.args import (
    check_below,
    check_bool,
    check_fraction,
    check_int,
    check_seconds,
    check_summarizer,
)
from stages._shared.records import RoundRecord, restore_round_records

__all__ = ["SUMMARY_HEADER", "ContextCollapse"]

SUMMARY_HEADER = "[Summary of earlier conversation]\n"
_SUMMARY_NAMESPACE = _uuid.UUID("0d9c1b4e-7f3a-4e2b-8c65-2a9e5d7f1b38")


@dataclass(frozen=True, slots=True)
class _Commit:
    uuids: tuple[str, ...]
    summary: str
    anchor: str | None  # usage anchor when committed: freed tokens count against its usage


@dataclass(slots=True)
class _CollapseState(ProjectionState[list[_Commit]]):
    commits: list[_Commit] = field(default_factory=list)
    failures: int = 0  # consecutive failed or discarded summaries
    span_cap: int | None = None  # halved after a prompt-too-long reply

    @classmethod
    def restore(cls, commits: Iterable[_Commit]) -> _CollapseState:
        """A resumed session's state: every recorded commit (checked), repeated."""
        return cls(commits=list(commits))

    def decided(self) -> list[_Commit]:
        """Every commit so far."""
        return self.commits

    def decided_count(self) -> int:
        """How many."""
        return len(self.commits)

    def counted(self, anchor: str | None) -> list[_Commit] | None:
        """The commits the anchor's request had: not those made since its response (a
        retried pass)."""
        older = [c for c in self.commits if anchor is None or c.anchor != anchor]
        return None if len(older) == len(self.commits) else older


def _commit_of(span: RoundRecord, data: Mapping[str, Any]) -> _Commit:
    """The commit a checked record holds; ``ValueError`` without a summary."""
    summary = data.get("summary")
    if not isinstance(summary, str) or not summary:
        raise ValueError("'summary' must be a non-empty string")
    return _Commit(span.uuids, summary, span.anchor)


def _summary_message(commit: _Commit) -> Message:
    uid = stable_uuid(_SUMMARY_NAMESPACE, "context_collapse:" + commit.uuids[0])
    return Message.user(SUMMARY_HEADER + commit.summary, uuid=uid, is_meta=True)


def _project(
    messages: list[Message], commits: Sequence[_Commit], ok: Sequence[bool]
) -> tuple[list[Message], int]:
    """Each applicable commit's span replaced by its summary; the input list itself if none
    applies. Returns the list and the number of commits applied.

    A commit applies from its first to its last record still present, if that range is cut-safe,
    follows the last compact boundary, overlaps no other commit and holds nothing else but
    injected user text (a snip marker) or records the wire drops; otherwise the history changed
    under it and the original shows.
    """
    where: dict[str, int] = {}
    for i, m in enumerate(messages):
        where.setdefault(m.uuid, i)
    spans: list[tuple[int, int, _Commit]] = []
    for c in commits:
        found = [where[u] for u in c.uuids if u in where]
        if found:
            spans.append((min(found), max(found), c))
    out: list[Message] = KeptList()  # kept and extended: its readers ask it what changed
    applied, pos = 0, thread_start(messages)  # what precedes a compact boundary is not sent
    out += messages[:pos]
    for s, e, c in sorted(spans, key=lambda t: t[0]):
        members = set(c.uuids)
        inert = all(
            m.uuid in members
            or m.type == "progress"
            or (m.type == "system" and m.subtype != "local_command")
            or (m.type == "user" and m.is_meta and all(block_type(b) == "text" for b in m.blocks))
            for m in messages[s : e + 1]
        )
        if s < pos or not (ok[s] and ok[e + 1] and inert):
            continue
        out += messages[pos:s]
        out.append(_summary_message(c))
        pos, applied = e + 1, applied + 1
    if not applied:
        return messages, 0
    out += messages[pos:]
    return out, applied


class ContextCollapse:
    """Stage: project summaries over spans of old rounds, committing near the window.

    ``summarizer``: where summaries come from (``None``: never commits, and says so).
    ``context_window`` (tokens, default 200,000); commit at ``commit_fraction`` (0.9) of it,
    collapsing enough of the oldest rounds to reach ``target_fraction`` (0.6), at most
    ``max_span_fraction`` (0.5) of the window per summary request; keep the last
    ``keep_recent_rounds`` rounds (8); stop after ``max_failures`` (3) failures in a row. A
    summary that is not text, or that takes longer than ``summary_timeout`` seconds (600;
    ``math.inf``: no limit), is a failure (``summary_error``).
    ``incremental=False`` re-derives everything from the whole history on every pass (same
    results, the cost of a full rescan: a baseline for benchmarks).
    """

    name = "context_collapse"
    strategy = "summarize-spans"
    may_break_cache = True
    readonly_input = True

    def __init__(
        self,
        summarizer: Summarizer | None = None,
        *,
        context_window: int = DEFAULT_CONTEXT_WINDOW,
        commit_fraction: float = 0.9,
        target_fraction: float = 0.6,
        max_span_fraction: float = 0.5,
        keep_recent_rounds: int = 8,
        max_failures: int = 3,
        incremental: bool = True,
        summary_timeout: float = SUMMARY_TIMEOUT,
    ) -> None:
        self.summarizer = check_summarizer(summarizer)
        self.summary_timeout = check_seconds("summary_timeout", summary_timeout)
        self.context_window = check_int("context_window", context_window, minimum=1)
        self.commit_fraction = check_fraction("commit_fraction", commit_fraction)
        self.target_fraction = check_fraction("target_fraction", target_fraction)
        self.max_span_fraction = check_fraction("max_span_fraction", max_span_fraction)
        self.keep_recent_rounds = check_int("keep_recent_rounds", keep_recent_rounds, minimum=1)
        self.max_failures = check_int("max_failures", max_failures, minimum=1)
        self.incremental = check_bool("incremental", incremental)
        check_below(
            "target_fraction", self.target_fraction, "commit_fraction", self.commit_fraction
        )

    @property
    def rereads_outputs(self) -> bool:
        """Whether a later pass may read again a tool output (or another long text) it has met
        (:func:`~pipeline.core.rereading_stages`): a summariser may be given what it
        summarised before; a rescan reads everything."""
        return self.summarizer is not None or not self.incremental

    @property
    def commit_tokens(self) -> int:
        """Commit a new collapse when the estimate reaches this many tokens."""
        return int(self.context_window * self.commit_fraction)

    def __repr__(self) -> str:
        return (
            f"ContextCollapse(summarizer={self.summarizer!r}, "
            f"context_window={self.context_window}, commit_fraction={self.commit_fraction}, "
            f"target_fraction={self.target_fraction})"
        )

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        run = ProjectionPass.open(
            self.name,
            messages,
            ctx,
            _CollapseState,
            self._restore,
            _project,
            reuse=self.incremental,
            acts=lambda tokens: self.summarizer is not None and tokens >= self.commit_tokens,
        )
        view, state, before, freed = run.view, run.state, run.before, run.refreed
        facts: dict[str, AttributeValue] = {ATTR.STRATEGY: self.strategy}
        decision = Decision.REAPPLY if run.applied else Decision.SKIP
        if self.summarizer is None:
            reason = Reason.NO_SUMMARIZER
        elif before < self.commit_tokens:
            reason = Reason.BELOW_TRIGGER
        elif state.failures >= self.max_failures:
            reason = Reason.CIRCUIT_OPEN
        elif not (span := self._select(view, state, before)):
            reason = Reason.NOTHING_ELIGIBLE
        else:
            decision, reason, commit = await self._summarize(span, view, ctx, state, facts)
            if commit is not None:
                await self._commit(ctx, state, commit)
                run.out, run.applied = _project(messages, state.commits, view.ok)
                freed = view.freed(run.then, run.out)
        commits = state.commits
        if run.applied:
            ctx.report.suppress_autocompact = True
        facts[ATTR.COMMITS_ACTIVE] = run.applied
        facts[ATTR.COMMITS_TOTAL] = len(commits)
        facts[ATTR.TOKENS_FREED] = freed
        facts[ATTR.TRIGGER_TOKENS] = self.commit_tokens
        facts[ATTR.FAILURES] = state.failures
        return run.close(
            ctx,
            decision,
            reason,
            count=len(commits),
            members=lambda: frozenset(u for c in commits for u in c.uuids),
            freed=freed,
            facts=facts,
        )

    def _restore(
        self, ctx: SessionContext, view: RoundView, records: list[Mapping[str, Any]]
    ) -> _CollapseState:
        """The state a resumed session's records give, on its first pass. A record that is
        malformed, or whose span holds what collapse keeps (the first user message, the
        latest prompt, the anchor's round, the recent rounds: a forged or damaged record), is
        left out with a warning; the rest are repeated."""
        commits = restore_round_records(
            ctx, self, view, records, uuids_key="uuids", build=_commit_of
        )
        return _CollapseState.restore(commits)

    def _select(self, view: RoundView, state: _CollapseState, before: int) -> list[Message]:
        """The oldest run of collapsible rounds covering the excess over the target, capped."""
        messages = view.messages
        done = {u for c in state.commits for u in c.uuids}
        cap = state.span_cap or int(self.context_window * self.max_span_fraction)
        excess = before - int(self.context_window * self.target_fraction)
        span: list[Message] = []
        size = 0
        for s, e, protected in view.rounds(self.keep_recent_rounds):
            if protected or any(m.uuid in done for m in messages[s:e]):
                if span:
                    break  # a span is contiguous
                continue
            tokens = view.price(messages[s:e])
            if span and (size + tokens > cap or size >= excess):
                break
            span += messages[s:e]
            size += tokens
        return span

    async def _summarize(
        self,
        span: list[Message],
        view: RoundView,
        ctx: SessionContext,
        state: _CollapseState,
        facts: dict[str, AttributeValue],
    ) -> tuple[Decision, Reason, _Commit | None]:
        """Ask for a summary of ``span``; a failure or a useless summary never fails the turn."""
        assert self.summarizer is not None
        span_tokens = view.price(span)
        facts[ATTR.SPAN_MESSAGES] = len(span)
        facts[ATTR.SPAN_TOKENS] = span_tokens
        try:
            summary = ask_summary(self.summarizer, to_api(span), self.summary_timeout)
            text = (await summary).strip()
        except SummaryPromptTooLong:
            state.failures += 1
            state.span_cap = max(1, (state.span_cap or span_tokens) // 2)  # ask for less next time
            return Decision.FAIL, Reason.PROMPT_TOO_LONG, None
        except Exception as exc:  # any summariser failure: the turn goes on uncollapsed
            state.failures += 1
            ctx.logger.warning("context_collapse.summary_failed", error=type(exc).__name__)
            return Decision.FAIL, Reason.SUMMARY_ERROR, None
        commit = _Commit(tuple(m.uuid for m in span), text, view.anchor)
        summary_tokens = view.price([_summary_message(commit)])
        facts[ATTR.SUMMARY_TOKENS] = summary_tokens
        if not text or summary_tokens >= span_tokens:
            state.failures += 1
            reason = Reason.SUMMARY_EMPTY if not text else Reason.SUMMARY_NOT_SMALLER
            return Decision.DISCARD, reason, None
        state.failures = 0
        return Decision.COLLAPSE, Reason.OVER_TRIGGER, commit

    async def _commit(self, ctx: SessionContext, state: _CollapseState, commit: _Commit) -> None:
        state.commits.append(commit)
        data = {
            "strategy": self.strategy,
            "uuids": list(commit.uuids),
            "summary": commit.summary,
            "anchor": commit.anchor,
        }
        await record_decision(ctx, self.name, data)
        ctx.logger.info("context_collapse.committed", messages=len(commit.uuids))
