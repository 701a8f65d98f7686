"""The later stages' per-session reuse can never go stale.

``HistorySnip``, ``Microcompact`` and ``ContextCollapse`` keep their last output and, when the
history only grew by records that reach nothing older (``pipeline/incremental.py``), redo only
the new part. The property runs random multi-turn sessions -- with the same edits to old
messages as the budget's property (replace, insert, delete, truncate, swap, feed the output
back, a new list) and thresholds low enough that every stage acts -- through
``tool_result_budget → history_snip → microcompact → context_collapse`` and checks every pass
against a from-scratch pass: fresh stage objects with ``incremental=False`` (every pass from
the whole history) and a fresh context restored from the stage records and the ledger as they
stood before the pass (the resume path). Compared: the output
(as messages and ``json.dumps(to_api(...))``), which input objects pass through by reference,
every stage's decision with its facts, ``tokens_freed``, the stage records the pass wrote
and the ledger.

Deterministic tests then count what a pass reads (no timing) and pin the fallbacks.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import pytest
from anthropic.types import MessageParam
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pipeline import Message, Pipeline, SessionContext, TokenTracker, Usage, to_api
from pipeline.incremental import AppendWatch
from pipeline.testing import MemoryStore, QuietLogger, RecordReads, assert_same_messages
from pipeline.tracing import ATTR, Decision
from stages import ContextCollapse, HistorySnip, Microcompact, ToolResultBudget
from stages._shared.records import RoundRecord
from stages.context_collapse import _CollapseState, _commit_of
from stages.history_snip import _SnipState
from tests.builders import assistant, results, tool_result, tool_use, user_text
from tests.edit_support import Gen, edit_history, records, run_sessions, start_history

SID = "incremental-stages"
EXAMPLES = 600


class TinySummarizer:
    """A deterministic summary, always far smaller than what it replaces."""

    async def summarize(self, messages: Sequence[MessageParam]) -> str:
        return f"s{len(messages)}"


def _stages(incremental: bool = True) -> list[Any]:
    return [
        ToolResultBudget(900, incremental=incremental),
        HistorySnip(context_window=2_500, keep_recent_rounds=2, incremental=incremental),
        Microcompact(
            keep=2,
            idle_minutes=0,
            trigger_tokens=700,
            min_reclaim_tokens=60,
            incremental=incremental,
        ),
        ContextCollapse(
            TinySummarizer(), context_window=3_000, keep_recent_rounds=2, incremental=incremental
        ),
    ]


def _ctx(store: MemoryStore, **kw: Any) -> SessionContext:
    return SessionContext(
        SID,
        "/nonexistent-root",  # the memory store never touches it
        store=store,
        token_tracker=TokenTracker("reference"),
        logger=QuietLogger(),
        **kw,
    )


class UsageGen(Gen):
    """The budget property's generator, plus usage on some responses (so the estimate has an
    anchor that moves, as in a live session)."""

    tokens = 0

    def turn(self) -> list[Message]:
        out = super().turn()
        if self.one_in(2):
            self.tokens += 40 + self.below(400)
            usage = Usage(input_tokens=self.tokens, output_tokens=10)
            out = [
                Message.assistant(
                    m.content, message_id=m.message_id, usage=usage, model=m.model, uuid=m.uuid
                )
                if m.type == "assistant"
                else m
                for m in out
            ]
        return out


class Twin:
    """The incremental session and the from-scratch reference, pass by pass."""

    def __init__(self) -> None:
        self.store = MemoryStore(frozenset())
        self.pipeline = Pipeline(_stages())  # one set of stage objects for every pass
        self.ctx = _ctx(self.store)
        self.passes = 0

    async def check_pass(self, history: list[Message]) -> list[Message]:
        records = list(self.ctx.stage_records)
        ledger = self.ctx.replacement_state.copy()
        collapse = self.ctx.stage_state.get("context_collapse")
        breaker = (collapse.failures, collapse.span_cap) if collapse is not None else None
        snapshot = list(history)
        out = await self.pipeline.run(history, self.ctx)

        ref_ctx = _ctx(self.store, replacement_state=ledger, stage_records=records)
        fresh = _stages(incremental=False)  # every pass from the whole history
        # Restored from the records, without the check that a record never takes what the
        # stage keeps: a caller's edit (an insert at the front, a truncation) moves what is
        # kept, so the check would refuse records the continuing session goes on applying.
        removals = [
            RoundRecord(tuple(data["removed"]), data.get("anchor"))
            for data in ref_ctx.records_for("history_snip")
        ]
        ref_ctx.stage_state["history_snip"] = _SnipState.restore(removals)
        commits = [
            _commit_of(RoundRecord(tuple(data["uuids"]), data.get("anchor")), data)
            for data in ref_ctx.records_for("context_collapse")
        ]
        restored = _CollapseState.restore(commits)
        if breaker is not None:  # the circuit breaker is never recorded: carried over by hand
            restored.failures, restored.span_cap = breaker
        ref_ctx.stage_state["context_collapse"] = restored
        ref = await Pipeline(fresh).run(history, ref_ctx)
        self.passes += 1
        where = f"pass {self.passes}"
        assert history == snapshot, where
        assert json.dumps(to_api(out)) == json.dumps(to_api(ref)), where
        assert_same_messages(out, ref)
        assert (out is history) == (ref is history), where
        assert [a is b for a, b in zip(out, history, strict=False)] == [
            a is b for a, b in zip(ref, history, strict=False)
        ], where
        assert self.ctx.report.decisions == ref_ctx.report.decisions, where
        assert self.ctx.report.tokens_freed == ref_ctx.report.tokens_freed, where
        assert self.ctx.report.suppress_autocompact == ref_ctx.report.suppress_autocompact, where
        assert self.ctx.stage_records[len(records) :] == ref_ctx.stage_records[len(records) :]
        assert self.ctx.replacement_state == ref_ctx.replacement_state, where
        for name, made in self.ctx.report.decisions.items():
            if made.decision in (Decision.CLEAR, Decision.SNIP, Decision.COLLAPSE):
                event(f"{name} acted")
        return out


async def run_session(tape: bytes) -> None:
    gen = UsageGen(tape)
    twin = Twin()
    history = start_history(gen, user_text("start"))
    last_out: list[Message] = history
    returned: list[tuple[list[Message], list[Message]]] = []  # (what run returned, a copy)
    for _ in range(4 + gen.below(24)):
        op = gen.pick(
            ("turn",) * 10
            + ("mark_moved",) * 4
            + ("replace", "insert", "delete", "truncate", "swap")
        )
        if gen.one_in(8):
            op = gen.pick(("feed_back", "new_list"))
        history = edit_history(gen, history, last_out, op) or history
        event(f"op: {op}")
        if not gen.one_in(4):
            last_out = await twin.check_pass(history)
            # the caller owns what run returns: later passes never change it (the stages
            # extend their own kept lists in place), and the caller may change it
            for out, copy in returned:
                assert out == copy
            if last_out is not history:  # (the caller's own history it edits in place)
                if gen.one_in(5):
                    event("caller edits the returned list")
                    last_out.reverse()
                returned.append((last_out, list(last_out)))
    await twin.check_pass(history)
    await twin.check_pass(history)


@pytest.mark.slow
def test_later_stages_incremental_equal_from_scratch_over_edited_histories() -> None:
    run_sessions(run_session, EXAMPLES)


# --------------------------------------------------------------------------------------------
# What the reuse buys, counted (no timing)
# --------------------------------------------------------------------------------------------


def _turn(t: int, size: int = 3_000, usage: int | None = None) -> list[Message]:
    u = Usage(input_tokens=usage, output_tokens=5) if usage is not None else None
    return [
        assistant(f"r{t}", tool_use(f"t{t}", "Read"), usage=u),
        results(tool_result(f"t{t}", f"{t}:" + "x" * size)),
    ]


STEADY = {
    "history_snip": lambda: HistorySnip(context_window=2_500, keep_recent_rounds=2),
    "microcompact": lambda: Microcompact(
        keep=2, idle_minutes=0, trigger_tokens=5_000, min_reclaim_tokens=60
    ),
    "context_collapse": lambda: ContextCollapse(
        TinySummarizer(), context_window=20_000, keep_recent_rounds=2
    ),
}


IDLE = {
    "history_snip": (
        lambda: HistorySnip(context_window=40_000, keep_recent_rounds=2),
        Decision.SNIP,
    ),
    "context_collapse": (
        lambda: ContextCollapse(TinySummarizer(), context_window=40_000, keep_recent_rounds=2),
        Decision.COLLAPSE,
    ),
    "microcompact": (
        lambda: Microcompact(keep=2, idle_minutes=0, trigger_tokens=20_000, min_reclaim_tokens=60),
        Decision.CLEAR,
    ),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(IDLE))
async def test_an_idle_stage_keeps_no_view_and_acts_later_as_a_fresh_pass(name: str) -> None:
    """A later stage that has decided nothing and is below its trigger sends its input as it
    came without following the history (its watch never takes a record in); the pass
    that first acts -- after old messages were edited while it idled -- gives what a fresh
    stage gives."""
    make, acted = IDLE[name]
    ctx = _ctx(MemoryStore(frozenset()))
    stage = make()
    pipe = Pipeline([stage])
    history: list[Message] = [user_text("start")]
    t = 0
    while True:
        history += _turn(t, usage=1_000 + 1_100 * t)
        t += 1
        if t == 12:  # an edit of old records while the stage idles: a new object, a removal
            history[3] = dataclasses.replace(history[3], uuid="edited")
            del history[5:7]
        out = await pipe.run(history, ctx)
        decision = ctx.report.decisions[name].decision
        if decision != Decision.SKIP:
            break
        assert out is history
        assert ctx.stage_state[name].watch.tool_names == {}  # nothing taken in
        assert t < 60, "the stage never acted"
    assert decision == acted and t > 12
    fresh = _ctx(MemoryStore(frozenset()))
    assert_same_messages(await Pipeline([make()]).run(history, fresh), out)
    assert ctx.report.decisions[name] == fresh.report.decisions[name]
    # and from then on it follows the history: the next pass extends this one
    history += _turn(t, size=10, usage=ctx.report.estimated_tokens + 20)
    again = await pipe.run(history, ctx)
    assert ctx.stage_state[name].watch.tool_names
    fresh = _ctx(MemoryStore(frozenset()), stage_records=ctx.stage_records)
    assert_same_messages(await Pipeline([make()]).run(history, fresh), again)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(STEADY))
async def test_a_steady_pass_reads_only_the_new_records(name: str) -> None:
    """After a stage acted, passes on a history that grows a turn at a time (usage as a live
    session reports it: the size of what was sent) re-apply its decisions from the last output:
    no record older than the newest turn is read again."""
    reads = RecordReads()
    ctx = _ctx(MemoryStore(frozenset()))
    pipe = Pipeline([STEADY[name]()])
    history: list[Message] = [user_text("start")]
    for t in range(40):
        history += _turn(t, usage=1_000 + 450 * t)
    history = reads.watch(history)
    out = await pipe.run(history, ctx)
    assert len(out) != len(history) or any(a is not b for a, b in zip(out, history, strict=True))
    assert reads.records == len(history)  # it acted: the first pass read everything

    for t in range(40, 50):
        reads.reset()
        old = len(history)
        history += reads.watch(_turn(t, size=10, usage=ctx.report.estimated_tokens + 20))
        out = await pipe.run(history, ctx)
        assert out is not history
        # the new turn and at most the one before it (microcompact's newest-turn region)
        assert reads.records <= len(history) - old + 2, (t, reads.records)
    assert ctx.stage_records  # the decision of the first pass, and no other
    assert len(ctx.stage_records) == 1
    fresh = _ctx(MemoryStore(frozenset()), stage_records=ctx.stage_records)
    assert_same_messages(await Pipeline([STEADY[name]()]).run(history, fresh), out)


def _unmarked(m: Message) -> Message:
    """``m`` as the next request sends it once its ``cache_control`` mark has moved on: a new
    object (with a new uuid, as the wire names a changed message)."""
    content = [{k: v for k, v in b.items() if k != "cache_control"} for b in m.blocks]
    return dataclasses.replace(m, content=content, uuid=f"{m.uuid}-moved")


def _marked(turn: list[Message]) -> list[Message]:
    last = turn[-1]
    blocks = [*last.blocks[:-1], {**last.blocks[-1], "cache_control": {"type": "ephemeral"}}]
    return [*turn[:-1], dataclasses.replace(last, content=blocks)]


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(STEADY))
async def test_a_moving_cache_mark_costs_a_pass_the_records_it_touched(name: str) -> None:
    """Claude Code marks its last message with ``cache_control``: each call, the message that
    held the mark comes again without it (another object), then the new turn. After a stage
    acted, a pass reads the changed message, the new turn and the few records its pairs
    reach, not the history; and its output is a fresh pass's."""
    reads = RecordReads()
    ctx = _ctx(MemoryStore(frozenset()))
    pipe = Pipeline([STEADY[name]()])
    history: list[Message] = [user_text("start")]
    for t in range(40):
        history += _marked(_turn(t, usage=1_000 + 450 * t)) if t == 39 else _turn(t)
        if t < 39:
            history[-2] = dataclasses.replace(history[-2], usage=Usage(1_000 + 450 * t, 5))
    history = reads.watch(history)
    out = await pipe.run(history, ctx)
    assert len(out) != len(history) or any(a is not b for a, b in zip(out, history, strict=True))
    for t in range(40, 50):
        reads.reset()
        old = len(history)
        history = [
            *history[:-1],
            *reads.watch([_unmarked(history[-1])]),
            *reads.watch(_marked(_turn(t, size=10, usage=ctx.report.estimated_tokens + 20))),
        ]
        out = await pipe.run(history, ctx)
        assert out is not history
        # the changed message, the new turn, and at most the two records before it
        assert reads.records <= len(history) - old + 1 + 2, (t, reads.records)
    fresh = _ctx(MemoryStore(frozenset()), stage_records=ctx.stage_records)
    assert_same_messages(await Pipeline([STEADY[name]()]).run(history, fresh), out)


@pytest.mark.asyncio
async def test_a_clear_pass_on_a_grown_history_reads_only_the_recent_records() -> None:
    """Microcompact keeps the results of the settled history (before the newest turn and the
    usage anchor) across passes: a pass that clears reads the records since the last pass and
    the ones it clears, not the whole history."""
    reads = RecordReads()
    ctx = _ctx(MemoryStore(frozenset()))
    stage = Microcompact(keep=2, idle_minutes=0, trigger_tokens=500, min_reclaim_tokens=60)
    pipe = Pipeline([stage])
    history: list[Message] = [user_text("start")]
    for t in range(60):
        history += _turn(t, usage=1_000 + 800 * t)
    history = reads.watch(history)
    await pipe.run(history, ctx)
    assert ctx.report.decisions["microcompact"].decision == Decision.CLEAR
    assert reads.records == len(history)  # the first pass read everything
    clears = 0
    for t in range(60, 70):
        reads.reset()
        history += reads.watch(_turn(t, usage=ctx.report.estimated_tokens + 20))
        await pipe.run(history, ctx)
        made = ctx.report.decisions["microcompact"]
        assert made.decision == Decision.CLEAR, t  # each turn's result two turns back
        clears += 1
        # the new turn, the one it clears (two turns back) and what lies between
        assert reads.records <= 6, (t, reads.records, len(history))
    assert clears == 10
    fresh = _ctx(MemoryStore(frozenset()), stage_records=ctx.stage_records)
    ref = Microcompact(
        keep=2, idle_minutes=0, trigger_tokens=500, min_reclaim_tokens=60, incremental=False
    )
    assert_same_messages(
        await Pipeline([ref]).run(history, fresh), await Pipeline([stage]).run(history, ctx)
    )


@pytest.mark.asyncio
async def test_a_new_record_that_reaches_back_rebuilds() -> None:
    """A tool_result for an old tool_use, a reused uuid, a compact boundary: each makes every
    stage start over (and the result is the from-scratch one)."""
    watch = AppendWatch()
    history: list[Message] = [user_text("start"), *_turn(0), *_turn(1)]
    assert watch.advance(history) is None  # first sight: built
    grown = [*history, *_turn(2)]
    assert watch.advance(grown) == len(history)
    assert watch.tool_names == {"t0": "Read", "t1": "Read", "t2": "Read"}
    late = [*grown, results(tool_result("t0", "late answer"))]
    assert watch.advance(late) is None
    twin = [*late, Message.user("again", uuid=late[0].uuid)]
    assert watch.advance(twin) is None
    boundary = [*twin, Message(type="system", subtype="compact_boundary"), user_text("summary")]
    assert watch.advance(boundary) is None
    assert watch.start == len(twin) + 1
    edited = [boundary[0], user_text("edited"), *boundary[2:]]
    assert watch.advance(edited) is None
    assert watch.advance(edited[:-3]) is None  # shorter: rebuilt
    assert watch.advance(list(edited[:-3])) == len(edited) - 3  # an equal list: nothing new


# --------------------------------------------------------------------------------------------
# Edges a review found (each once diverged from a from-scratch pass)
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_full_rescan_pass_in_between_leaves_nothing_to_misreuse() -> None:
    """An ``incremental=False`` pass over an edited copy of the same length, then an
    incremental pass over the original grown by a turn: the last must not reuse the output
    built for the edited copy."""
    ctx = _ctx(MemoryStore(frozenset()))
    snip = HistorySnip(context_window=2_500, keep_recent_rounds=2)
    history: list[Message] = [user_text("start")]
    for t in range(20):
        history += _turn(t, usage=1_000 + 450 * t)
    await Pipeline([snip]).run(history, ctx)
    edited = [Message.user("EDITED", uuid=history[0].uuid), *history[1:]]
    rescan = HistorySnip(context_window=2_500, keep_recent_rounds=2, incremental=False)
    await Pipeline([rescan]).run(edited, ctx)
    grown = [*history, *_turn(20, size=10, usage=ctx.report.estimated_tokens + 20)]
    records = list(ctx.stage_records)
    out = await Pipeline([snip]).run(grown, ctx)
    ref = await Pipeline([HistorySnip(context_window=2_500, keep_recent_rounds=2)]).run(
        grown, _ctx(MemoryStore(frozenset()), stage_records=records)
    )
    assert out[0].content == "start"
    assert json.dumps(to_api(out)) == json.dumps(to_api(ref))


@pytest.mark.asyncio
async def test_a_microcompact_swapped_for_another_tool_set_reapplies_by_its_own() -> None:
    """``exclude_tools`` always wins, also over earlier clears: a stage swapped in with Read
    excluded sends Read results whole again, at once (not after the next rebuild)."""

    def make(**kw: Any) -> Microcompact:
        return Microcompact(
            keep=2, idle_minutes=0, trigger_tokens=5_000, min_reclaim_tokens=60, **kw
        )

    ctx = _ctx(MemoryStore(frozenset()))
    history: list[Message] = [user_text("start")]
    for t in range(8):
        history += _turn(t, usage=1_000 + 500 * t)
    pipe = Pipeline([make()])
    assert "cleared" in json.dumps(to_api(await pipe.run(history, ctx)))
    pipe = pipe.replace("microcompact", make(exclude_tools=("Read",)))
    history += _turn(8, size=10, usage=1_500)
    out = await pipe.run(history, ctx)
    assert "[Old tool result content cleared]" not in json.dumps(to_api(out))
    assert ctx.report.decisions["microcompact"].facts[ATTR.REAPPLIED] == 0


@pytest.mark.asyncio
async def test_an_equal_copy_that_serialises_otherwise_is_sent_as_given() -> None:
    """``{"a": 1, "b": 2} == {"b": 2, "a": 1}``: an equal copy is still a new object, so every
    stage starts over and the request carries the new object's bytes."""
    ctx = _ctx(MemoryStore(frozenset()))
    pipe = Pipeline(_stages()[1:])
    history: list[Message] = [user_text("start")]
    for t in range(20):
        history += _turn(t, usage=1_000 + 450 * t)
    await pipe.run(history, ctx)
    i = len(history) - 1
    block = history[i].blocks[0]
    reordered = {k: block[k] for k in reversed(list(block))}
    copy = [*history[:i], history[i].with_content([reordered])]
    assert copy[i].content == history[i].content  # equal values ...
    assert json.dumps(copy[i].content) != json.dumps(history[i].content)  # ... other bytes
    out = await pipe.run(copy, ctx)
    assert json.dumps(to_api(out)[-1]) == json.dumps(to_api(copy)[-1])


@settings(max_examples=300, deadline=None)
@given(records(), st.lists(st.integers(0, 6), min_size=1, max_size=10), st.data())
def test_an_append_watch_follows_edits_as_a_fresh_one_would(
    history: list[Message], steps: list[int], data: st.DataObject
) -> None:
    """Whatever the edits, the watch's views equal a fresh watch's on the same input, and it
    judges the next record (new, or sharing a key with an old one) as a fresh watch does."""
    watch = AppendWatch()
    view: list[Message] = []
    gone: list[Message] = []  # records edited away: their keys are free again
    for step in steps:
        view = view + history[len(view) : data.draw(st.integers(len(view), len(history)))]
        if step == 0 and view:
            i = data.draw(st.integers(0, len(view) - 1))
            gone.append(view[i])
            view[i] = user_text("edited")
        elif step == 1 and view:
            gone.append(view.pop(data.draw(st.integers(0, len(view) - 1))))
        elif step == 2 and len(view) > 1:
            view[0], view[-1] = view[-1], view[0]
        elif step in (3, 4) and view:  # in place, the uuid kept: results cleared or re-keyed
            i = data.draw(st.integers(0, len(view) - 1))
            if isinstance(view[i].content, list):
                key = "content" if step == 3 else "tool_use_id"
                gone.append(view[i])
                view[i] = view[i].with_content(
                    [
                        {**b, key: f"{b.get(key)}'"}
                        if isinstance(b, dict) and b.get("type") == "tool_result"
                        else b
                        for b in view[i].content
                    ]
                )
        watch.advance(view)
        fresh = AppendWatch()
        fresh.advance(view)
        assert (watch.start, watch.tool_names) == (fresh.start, fresh.tool_names)
        if view:
            echo = dataclasses.replace(view[data.draw(st.integers(0, len(view) - 1))])
            again = [dataclasses.replace(m) for m in gone[-1:]]  # keys no longer in the input
            # a new record that answers an id alone: one of the input's, or one edited away
            ids = [
                str(b.get("tool_use_id"))
                for m in [*gone[-1:], echo]
                if isinstance(m.content, list)
                for b in m.content
                if isinstance(b, dict) and b.get("type") == "tool_result"
            ]
            answers = [[results(tool_result(tid, "x"))] for tid in ids]
            for nxt in ([user_text("brand new")], [echo], again, *answers):  # echo: an old uuid
                assert watch.advance([*view, *nxt]) == fresh.advance([*view, *nxt])
                watch.advance(view)
                fresh.advance(view)
