"""The ``context_collapse`` stage: replaces spans of old rounds with summaries (SPEC §5).

Strategy ``summarize-spans``, a read-time projection (the history is never edited). When the
estimate reaches ``commit_fraction`` (90%) of ``context_window``, the oldest not-yet-collapsed
whole rounds (a response, its tool_results, whatever follows up to the next response) go to a
:class:`~pipeline.summarizer.Summarizer` in wire form: enough to reach ``target_fraction``, at
most ``max_span_fraction`` of the window. Kept: the first user message (verbatim task), the round
holding the latest prompt, the anchor's round and the last ``keep_recent_rounds``. Every pass
replaces each committed span by one user text ``SUMMARY_HEADER + summary``: after a user part
(to_api merges it there, after the tool_results) or between responses, then a response — roles
alternate, no pair splits. Active commits set ``suppress_autocompact``; commits are recorded
(``{"uuids", "summary", "anchor"}``) so a resumed session restores them.

Decision span per pass: ``skip``/``reapplied`` × ``no_summarizer``/``below_trigger``/
``nothing_collapsible``/``circuit_open`` (``max_failures`` failed or discarded summaries in a
row: stop paying for them); ``committed``/``over_trigger``; ``summary_failed``/
``prompt_too_long``/``summary_error``; ``discarded``/``empty_summary``/``summary_not_smaller``.
"""

from __future__ import annotations

import uuid as _uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, partial

import anyio.to_thread

from pipeline import Message, SessionContext, to_api
from pipeline.incremental import AppendWatch, Projection
from pipeline.messages import block_type, stable_uuid, thread_start
from pipeline.summarizer import Summarizer, SummaryPromptTooLong
from pipeline.tracing import emit_decision
from stages._shared.args import check_bool, check_fraction, check_int
from stages._shared.rounds import (
    Price,
    anchor_uuid,
    api_rounds,
    freed_before_anchor,
    protected_rounds,
    safe_cuts,
)

__all__ = ["SUMMARY_HEADER", "ContextCollapse"]

SUMMARY_HEADER = "[Summary of earlier conversation]\n"
_SUMMARY_NAMESPACE = _uuid.UUID("0d9c1b4e-7f3a-4e2b-8c65-2a9e5d7f1b38")


@dataclass(frozen=True, slots=True)
class _Commit:
    uuids: tuple[str, ...]
    summary: str
    anchor: str | None  # usage anchor when committed: freed tokens count against its usage


@dataclass(slots=True)
class _CollapseState:
    commits: list[_Commit] = field(default_factory=list)
    failures: int = 0  # consecutive failed or discarded summaries
    span_cap: int | None = None  # halved after a prompt-too-long reply
    watch: AppendWatch = field(default_factory=AppendWatch)
    last: Projection | None = None
    """The previous pass's output (``applied``: commits active), while it can be extended."""


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
    out: list[Message] = []
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
    ``keep_recent_rounds`` rounds (8); stop after ``max_failures`` (3) failures in a row.
    ``incremental=False`` re-derives everything from the whole history on every pass (same
    results, the cost of a full rescan: a baseline for benchmarks).
    """

    name = "context_collapse"
    strategy = "summarize-spans"
    may_break_cache = True
    implemented = True

    def __init__(
        self,
        summarizer: Summarizer | None = None,
        *,
        context_window: int = 200_000,
        commit_fraction: float = 0.9,
        target_fraction: float = 0.6,
        max_span_fraction: float = 0.5,
        keep_recent_rounds: int = 8,
        max_failures: int = 3,
        incremental: bool = True,
    ) -> None:
        if summarizer is not None and not callable(getattr(summarizer, "summarize", None)):
            raise ValueError(f"summarizer needs an async summarize(messages), got {summarizer!r}")
        self.summarizer = summarizer
        self.context_window = check_int("context_window", context_window, minimum=1)
        self.commit_fraction = check_fraction("commit_fraction", commit_fraction)
        self.target_fraction = check_fraction("target_fraction", target_fraction)
        self.max_span_fraction = check_fraction("max_span_fraction", max_span_fraction)
        self.keep_recent_rounds = check_int("keep_recent_rounds", keep_recent_rounds, minimum=1)
        self.max_failures = check_int("max_failures", max_failures, minimum=1)
        self.incremental = check_bool("incremental", incremental)
        if not self.target_fraction < self.commit_fraction:
            raise ValueError(
                f"target_fraction ({target_fraction!r}) must be below commit_fraction "
                f"({commit_fraction!r})"
            )

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

    def _state(self, ctx: SessionContext) -> _CollapseState:
        state = ctx.stage_state.get(self.name)
        if not isinstance(state, _CollapseState):
            state = _CollapseState()
            for data in ctx.records_for(self.name):  # resume: repeat every recorded commit
                uuids, summary, anchor = data.get("uuids"), data.get("summary"), data.get("anchor")
                if isinstance(uuids, list) and uuids and isinstance(summary, str):
                    anchor = anchor if isinstance(anchor, str) else None
                    state.commits.append(_Commit(tuple(map(str, uuids)), summary, anchor))
            ctx.stage_state[self.name] = state
        return state

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        state = self._state(ctx)
        state.last, last = None, state.last  # a pass that fails midway leaves nothing to reuse
        price: Price = ctx.token_tracker.tokens_for_messages
        ok = cache(partial(safe_cuts, messages))  # cut points, read only if needed

        anchor = anchor_uuid(messages)
        out, active = self._reapply(messages, state, last, ok)
        # commits made since the anchor's response are not in its usage (a retried pass)
        older = [c for c in state.commits if anchor is None or c.anchor != anchor]
        then = out if len(older) == len(state.commits) else _project(messages, older, ok())[0]
        freed = freed_before_anchor(price, then, out, anchor)
        before = ctx.token_tracker.estimate(out) - ctx.report.tokens_freed - freed

        attrs: dict[str, int] = {}
        decision = "reapplied" if active else "skip"
        if self.summarizer is None:
            reason = "no_summarizer"
        elif before < self.commit_tokens:
            reason = "below_trigger"
        elif state.failures >= self.max_failures:
            reason = "circuit_open"
        elif not (span := self._select(messages, ok(), state, before, price)):
            reason = "nothing_collapsible"
        else:
            decision, reason, commit = await self._summarize(span, anchor, ctx, state, attrs, price)
            if commit is not None:
                await self._commit(ctx, state, commit)
                out, active = _project(messages, state.commits, ok())
                freed = freed_before_anchor(price, then, out, anchor)
        commits = state.commits
        state.last = Projection.remember(
            last, len(commits), lambda: (u for c in commits for u in c.uuids), out, active
        )

        ctx.report.tokens_freed += freed
        if active:
            ctx.report.suppress_autocompact = True
        attrs.update(commits_active=active, commits_total=len(state.commits), tokens_freed=freed)
        attrs.update(commit_tokens=self.commit_tokens, failures=state.failures)
        ctx.report.notes[self.name] = dict(attrs)
        emit_decision(
            ctx.tracer,
            self.name,
            conversation_id=ctx.session_id,
            decision=decision,
            reason=reason,
            tokens_before=before,
            tokens_after=ctx.token_tracker.estimate(out) - ctx.report.tokens_freed,
            strategy=self.strategy,
            **attrs,
        )
        return out

    def _reapply(
        self,
        messages: list[Message],
        state: _CollapseState,
        last: Projection | None,
        ok: Callable[[], list[bool]],
    ) -> tuple[list[Message], int]:
        """The commits projected over ``messages``: the last pass's output plus the new records
        when the history only grew by records that reach nothing older and belong to no commit
        (then every span applies as it did); else from scratch."""
        grown = state.watch.advance(messages, reuse=self.incremental)
        if not state.commits:
            return messages, 0
        extended = last.extend(messages, grown, len(state.commits)) if last else None
        return extended or _project(messages, state.commits, ok())

    def _select(
        self,
        messages: list[Message],
        ok: Sequence[bool],
        state: _CollapseState,
        before: int,
        price: Price,
    ) -> list[Message]:
        """The oldest run of collapsible rounds covering the excess over the target, capped."""
        rounds = api_rounds(messages, ok)
        keep = protected_rounds(messages, rounds, self.keep_recent_rounds)
        done = {u for c in state.commits for u in c.uuids}
        cap = state.span_cap or int(self.context_window * self.max_span_fraction)
        excess = before - int(self.context_window * self.target_fraction)
        span: list[Message] = []
        size = 0
        for r, (s, e) in enumerate(rounds):
            if r in keep or any(m.uuid in done for m in messages[s:e]):
                if span:
                    break  # a span is contiguous
                continue
            tokens = price(messages[s:e])
            if span and (size + tokens > cap or size >= excess):
                break
            span += messages[s:e]
            size += tokens
        return span

    async def _summarize(
        self,
        span: list[Message],
        anchor: str | None,
        ctx: SessionContext,
        state: _CollapseState,
        attrs: dict[str, int],
        price: Price,
    ) -> tuple[str, str, _Commit | None]:
        """Ask for a summary of ``span``; a failure or a useless summary never fails the turn."""
        assert self.summarizer is not None
        span_tokens = price(span)
        attrs.update(span_messages=len(span), span_tokens=span_tokens)
        try:
            text = (await self.summarizer.summarize(to_api(span))).strip()
        except SummaryPromptTooLong:
            state.failures += 1
            state.span_cap = max(1, (state.span_cap or span_tokens) // 2)  # ask for less next time
            return "summary_failed", "prompt_too_long", None
        except Exception as exc:  # any summariser failure: the turn goes on uncollapsed
            state.failures += 1
            ctx.logger.warning("context_collapse.summary_failed", error=type(exc).__name__)
            return "summary_failed", "summary_error", None
        commit = _Commit(tuple(m.uuid for m in span), text, anchor)
        summary_tokens = price([_summary_message(commit)])
        attrs.update(summary_tokens=summary_tokens)
        if not text or summary_tokens >= span_tokens:
            state.failures += 1
            return "discarded", "empty_summary" if not text else "summary_not_smaller", None
        state.failures = 0
        return "committed", "over_trigger", commit

    async def _commit(self, ctx: SessionContext, state: _CollapseState, commit: _Commit) -> None:
        state.commits.append(commit)
        data = {
            "strategy": self.strategy,
            "uuids": list(commit.uuids),
            "summary": commit.summary,
            "anchor": commit.anchor,
        }
        try:
            await anyio.to_thread.run_sync(ctx.record, self.name, data)
        except OSError as exc:
            # the commit stands (it is in the state); only a resume would lose it
            ctx.logger.error("context_collapse_record_write_failed", error=type(exc).__name__)
        ctx.logger.info("context_collapse.committed", messages=len(commit.uuids))
