"""History snip (``snip-middle``): trigger, protections, pairing, frozen removals, resume."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from pipeline import (
    Message,
    Pipeline,
    SessionContext,
    TokenTracker,
    TranscriptWriter,
    load_transcript,
    stage,
    to_api,
)
from pipeline.testing import assert_same_messages
from pipeline.tokens import rough_tokens_for_messages
from pipeline.tracing import ATTR
from pipeline.transcript.read import StageRecord
from stages import HistorySnip
from stages.history_snip import snip_marker_text
from tests.builders import tool_result, tool_use
from tests.rounds_support import (
    PROPERTY,
    Spans,
    agentic,
    answered,
    dump,
    histories,
    make_ctx,
    run,
    wire_ok,
)

# --------------------------------------------------------------------------------------------
# Helpers (also used by the context collapse tests)
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Trigger and protections
# --------------------------------------------------------------------------------------------


def small_snip(**kw: Any) -> HistorySnip:
    kw.setdefault("keep_recent_rounds", 4)
    return HistorySnip(context_window=10_000, **kw)  # trigger 8,000, target 6,000


@pytest.mark.asyncio
async def test_below_the_trigger_nothing_changes_and_the_span_says_why(tmp_path: Path) -> None:
    spans = Spans()
    history = agentic(20)  # ~6,000 tokens
    ctx = make_ctx(tmp_path, spans)
    assert await small_snip()(history, ctx) is history
    [d] = spans.decisions("history_snip")
    assert (d[ATTR.DECISION], d[ATTR.REASON]) == ("skip", "below_trigger")
    assert d[ATTR.TOKENS_BEFORE] == ctx.token_tracker.estimate(history) < 8_000
    assert d[ATTR.STRATEGY] == "snip-middle"


@pytest.mark.asyncio
async def test_the_default_instance_leaves_a_long_ordinary_session_alone(tmp_path: Path) -> None:
    history = agentic(150, chars=2_000)  # ~ 80,000 tokens: long, but far below the window
    for tracker in (TokenTracker("reference"), TokenTracker()):  # and whatever the default is
        assert 60_000 < tracker.estimate(history) < 100_000
        ctx = make_ctx(tmp_path, token_tracker=tracker)
        assert await HistorySnip()(history, ctx) is history


@pytest.mark.asyncio
async def test_over_the_trigger_oldest_middle_rounds_go(tmp_path: Path) -> None:
    spans = Spans()
    history = agentic(34)  # ~ 9,000 tokens
    ctx = make_ctx(tmp_path, spans)
    before = ctx.token_tracker.estimate(history)
    assert before >= 8_000
    out = await run(small_snip(), history, ctx)

    kept = {m.uuid for m in out}
    assert out[0] is history[0]  # the task
    assert all(m in out for m in history[-8:])  # the last 4 rounds, untouched objects
    gone = [m.uuid for m in history if m.uuid not in kept]
    # whole rounds, oldest first: a0 r0 a1 r1 ...
    k = len(gone) // 2
    assert gone == [u for n in range(k) for u in (f"a{n}", f"r{n}")]
    assert out[1].content == snip_marker_text(2 * k) and out[1].is_meta
    assert out[2] is history[1 + 2 * k]
    assert wire_ok(out)

    [d] = spans.decisions("history_snip")
    assert (d[ATTR.DECISION], d[ATTR.REASON]) == ("snip", "over_trigger")
    # what the anchor's usage counted and is gone now, less the marker that replaces it
    freed = rough_tokens_for_messages(history[1 : 1 + 2 * k]) - rough_tokens_for_messages(out[1:2])
    assert ctx.report.tokens_freed == d[ATTR.TOKENS_FREED] == freed > 0
    assert d[ATTR.TOKENS_AFTER] == before - ctx.report.tokens_freed <= 6_000
    assert d[ATTR.REMOVED_NEW] == 2 * k
    assert ctx.records_for("history_snip") == [
        {"strategy": "snip-middle", "removed": gone, "anchor": history[-2].uuid}
    ]


@pytest.mark.asyncio
async def test_the_round_holding_the_latest_prompt_stays(tmp_path: Path) -> None:
    history = agentic(34)
    prompt = Message.user("Now also update the changelog.", uuid="prompt")
    history.insert(7, prompt)  # after r2: the user part of round 2
    out = await run(small_snip(), history, make_ctx(tmp_path))
    assert out is not history
    assert prompt in out and history[5] in out  # a2, its round's response, stays with it
    assert "a1" not in {m.uuid for m in out} and "a3" not in {m.uuid for m in out}
    assert sum(m.is_meta for m in out) == 2  # two runs, two markers
    assert wire_ok(out)


@pytest.mark.asyncio
async def test_nothing_removable_when_every_round_is_protected(tmp_path: Path) -> None:
    spans = Spans()
    history = agentic(4, chars=9_000)  # huge, but only the 4 protected rounds
    ctx = make_ctx(tmp_path, spans)
    assert await small_snip()(history, ctx) is history
    [d] = spans.decisions("history_snip")
    assert (d[ATTR.DECISION], d[ATTR.REASON]) == ("skip", "nothing_eligible")


@pytest.mark.asyncio
async def test_interleaved_fragments_and_parallel_results_are_never_split(tmp_path: Path) -> None:
    """Parallel tool calls streamed as fragments with results between them: one round."""
    history = [Message.user("go", uuid="first")]
    for n in range(30):
        for j in range(3):
            history.append(
                Message.assistant([tool_use(f"t{n}.{j}")], message_id=f"m{n}", uuid=f"a{n}.{j}")
            )
            history.append(Message(type="progress", uuid=f"p{n}.{j}"))
            history.append(Message.user([tool_result(f"t{n}.{j}", "y" * 400)], uuid=f"r{n}.{j}"))
    assert wire_ok(history)
    out = await small_snip(keep_recent_rounds=2)(history, make_ctx(tmp_path))
    assert out is not history and wire_ok(out)
    kept = {m.uuid for m in out}
    for n in range(30):  # a response and all its fragments, results and progress go together
        present = {u in kept for j in range(3) for u in (f"a{n}.{j}", f"p{n}.{j}", f"r{n}.{j}")}
        assert len(present) == 1


# --------------------------------------------------------------------------------------------
# Frozen removals: re-applied byte for byte, tokens freed once, resume
# --------------------------------------------------------------------------------------------


async def live_session(
    stage: HistorySnip, ctx: SessionContext, turns: int, writer: TranscriptWriter | None = None
) -> tuple[list[Message], list[str], list[int]]:
    """Run ``turns`` model calls; return the final history, each request, each pass's freed."""
    history = [Message.user("Fix the failing tests.", uuid="first")]
    if writer is not None:
        writer.append_messages(history)
    requests, freed = [], []
    for n in range(turns):
        out = await run(stage, history, ctx)
        requests.append(dump(out))
        freed.append(ctx.report.tokens_freed)
        grown = answered(history, out, n, 1_000)
        if writer is not None:
            writer.append_messages(grown[len(history) :])
        history = grown
    return history, requests, freed


@pytest.mark.asyncio
async def test_after_a_snip_every_request_extends_the_previous_one(tmp_path: Path) -> None:
    stage = small_snip()
    ctx = make_ctx(tmp_path)
    history, requests, freed = await live_session(stage, ctx, 60)
    snips = [k for k, f in enumerate(freed) if f]
    assert len(snips) >= 2  # it fired, and fired again as the session kept growing
    assert len(ctx.records_for("history_snip")) == len(snips)
    for k in range(len(requests) - 1):
        prev, nxt = json.loads(requests[k]), json.loads(requests[k + 1])
        if k + 1 in snips:  # the task stays; the marker joins the user message before the cut
            task = {"type": "text", "text": "Fix the failing tests.\n"}
            assert nxt[0]["content"][0] == task and "History snipped" in json.dumps(nxt[0])
            continue
        # cache prefix: request k+1 starts with request k minus its last message
        assert nxt[: len(prev) - 1] == prev[:-1]
    # the same history and state give the same request, byte for byte
    assert dump(await run(stage, history, ctx)) == dump(await run(stage, history, ctx))


@pytest.mark.asyncio
async def test_the_kept_output_names_its_removals_by_the_state_s_own_set(tmp_path: Path) -> None:
    """The output a pass keeps for the next reads which uuids the removals name from the
    stage's state itself: a copy of them cost a held conversation ~0.03x of its wire text
    once snip had removed most of its history."""
    stage = small_snip()
    ctx = make_ctx(tmp_path)
    await live_session(stage, ctx, 60)
    state = ctx.stage_state["history_snip"]
    members = state.last.members
    assert set(members) == set(state.removed) and len(members) > 10
    state.removed["later"] = None
    assert "later" in members


@pytest.mark.asyncio
async def test_tokens_freed_count_once_per_usage_anchor(tmp_path: Path) -> None:
    spans = Spans()
    stage = small_snip()
    ctx = make_ctx(tmp_path, spans)
    history = agentic(34)
    first = await run(stage, history, ctx)
    freed = ctx.report.tokens_freed
    assert freed > 0
    # a retry before any new response: the anchor's usage still counts the removed rounds
    again = await run(stage, history, ctx)
    assert again == first and ctx.report.tokens_freed == freed
    decisions = spans.decisions("history_snip")
    assert [(d[ATTR.DECISION], d[ATTR.REASON]) for d in decisions] == [
        ("snip", "over_trigger"),
        ("reapply", "below_trigger"),
    ]
    assert decisions[0][ATTR.TOKENS_AFTER] == decisions[1][ATTR.TOKENS_BEFORE]
    # the next response's usage no longer counts them: nothing more to subtract
    later = answered(history, first, 99, 100)
    out = await run(stage, later, ctx)
    assert ctx.report.tokens_freed == 0 and out[: len(first)] == first
    assert spans.decisions("history_snip")[-1][ATTR.DECISION] == "reapply"


@pytest.mark.asyncio
async def test_a_resumed_session_sends_the_same_requests(tmp_path: Path) -> None:
    stage = small_snip()  # one stage object shared by both sessions, as in a server
    path = tmp_path / "s1.jsonl"
    writer = TranscriptWriter(path, "s1")
    live = make_ctx(tmp_path, transcript=writer)
    history, _, freed = await live_session(stage, live, 45, writer)
    assert any(freed)

    loaded = load_transcript(path)
    assert [m.uuid for m in loaded.messages] == [m.uuid for m in history]
    resumed = make_ctx(tmp_path, stage_records=loaded.stage_records)
    assert dump(await run(stage, loaded.messages, resumed)) == dump(await run(stage, history, live))
    assert resumed.report.tokens_freed == live.report.tokens_freed == 0
    # and they stay in step as the session goes on
    grown = answered(history, await run(stage, history, live), 45, 1_000)
    assert dump(await run(stage, grown, resumed)) == dump(await run(stage, grown, live))


MALFORMED_SNIPS: list[dict[str, Any]] = [
    {"removed": 5},
    {"removed": "a0"},
    {"removed": [1, 2]},
    {"removed": [["a0"]]},
    {"removed": []},
    {"removed": None},
    {},
    {"removed": ["a0", "r0"], "anchor": 7},
    {"strategy": "another", "removed": ["a0", "r0"]},
]


@pytest.mark.parametrize("data", MALFORMED_SNIPS, ids=[json.dumps(d) for d in MALFORMED_SNIPS])
@pytest.mark.asyncio
async def test_a_malformed_record_is_ignored_with_a_warning(
    tmp_path: Path, data: dict[str, Any]
) -> None:
    history = agentic(34)
    fresh = await run(small_snip(), history, make_ctx(tmp_path, session_id="fresh"))
    with structlog.testing.capture_logs() as logs:  # (a context logs as it was made)
        resumed = make_ctx(tmp_path, stage_records=[StageRecord("history_snip", data)])
        out = await run(small_snip(), history, resumed)  # no StageError
    assert dump(out) == dump(fresh)  # as if the record had never been written
    [event] = [e for e in logs if e["event"] == "stage_record.ignored"]
    assert event["stage"] == "history_snip" and event["record"] == 0
    assert event["log_level"] == "warning"


def _forged(history: list[Message]) -> dict[str, list[str]]:
    every = [m.uuid for m in history]
    return {
        "everything": every,
        "the-task-and-first-rounds": every[:7],
        "the-recent-rounds": every[-8:],
        "a-middle-round-and-the-latest": [*every[5:7], *every[-2:]],
    }


@pytest.mark.parametrize(
    "forgery",
    [
        "everything",
        "the-task-and-first-rounds",
        "the-recent-rounds",
        "a-middle-round-and-the-latest",
    ],
)
@pytest.mark.asyncio
async def test_a_forged_removal_never_takes_what_snip_keeps(tmp_path: Path, forgery: str) -> None:
    history = agentic(20)  # below the trigger: nothing of its own to snip
    removed = _forged(history)[forgery]
    with structlog.testing.capture_logs() as logs:
        record = StageRecord("history_snip", {"removed": removed})
        resumed = make_ctx(tmp_path, stage_records=[record])
        out = await run(small_snip(), history, resumed)
    assert out[0] is history[0]  # the first user message, verbatim
    assert all(m in out for m in history[-8:])  # the last 4 rounds
    assert out == history and wire_ok(out)
    assert [e["event"] for e in logs].count("stage_record.ignored") == 1


@pytest.mark.asyncio
async def test_a_bad_record_costs_only_itself(tmp_path: Path) -> None:
    """The valid records around a damaged one still restore the session byte for byte."""
    stage = small_snip()
    live = make_ctx(tmp_path)
    history, _, freed = await live_session(stage, live, 45)
    assert sum(1 for f in freed if f) >= 1
    records = [
        StageRecord("history_snip", {"removed": 5}),
        *live.stage_records,
        StageRecord("history_snip", {"removed": ["first"]}),
    ]
    resumed = make_ctx(tmp_path, stage_records=records)
    assert dump(await run(stage, history, resumed)) == dump(await run(stage, history, live))


@pytest.mark.asyncio
async def test_a_malformed_record_in_the_transcript_does_not_stop_a_resume(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s1.jsonl"
    writer = TranscriptWriter(path, "s1")
    history = agentic(34)
    writer.append_messages(history)
    writer.append_stage_record("history_snip", {"removed": 5})
    writer.append_stage_record("history_snip", {"removed": [m.uuid for m in history]})
    loaded = load_transcript(path)  # the loader only checks that ``data`` is an object
    assert len(loaded.stage_records) == 2
    resumed = make_ctx(tmp_path, stage_records=loaded.stage_records)
    out = await run(small_snip(), loaded.messages, resumed)
    fresh = await run(small_snip(), history, make_ctx(tmp_path, session_id="fresh"))
    assert dump(out) == dump(fresh) and out[0].uuid == "first"


@pytest.mark.asyncio
async def test_after_a_compact_boundary_old_removals_change_nothing(tmp_path: Path) -> None:
    stage = small_snip()
    ctx = make_ctx(tmp_path)
    history = agentic(34)
    assert await run(stage, history, ctx) != history
    compacted = [
        *history,
        Message(type="system", subtype="compact_boundary", content="compacted", uuid="b"),
        Message.user("Summary of the work so far.", uuid="s", is_compact_summary=True),
    ]
    ctx.begin_pass()
    out = await stage(compacted, ctx)
    assert out is compacted and ctx.report.tokens_freed == 0  # nothing sent was removed


@pytest.mark.asyncio
async def test_state_is_per_session(tmp_path: Path) -> None:
    stage = small_snip()
    history = agentic(34)
    one, two = make_ctx(tmp_path), make_ctx(tmp_path, session_id="s2")
    assert await run(stage, history, one) != history
    small = agentic(3)
    assert await run(stage, small, two) == small
    assert two.records_for("history_snip") == []


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"context_window": 0}, "context_window"),
        ({"context_window": True}, "context_window"),
        ({"trigger_fraction": 1.5}, "trigger_fraction"),
        ({"target_fraction": 0}, "target_fraction"),
        ({"target_fraction": 0.9, "trigger_fraction": 0.8}, "target_fraction"),
        ({"keep_recent_rounds": 0}, "keep_recent_rounds"),
        ({"keep_recent_rounds": "4"}, "keep_recent_rounds"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        HistorySnip(**kwargs)


def test_simple_keyword_construction() -> None:
    stage = HistorySnip(keep_recent_rounds=4, context_window=1_000_000)
    assert (stage.name, stage.strategy, stage.may_break_cache) == (
        "history_snip",
        "snip-middle",
        True,
    )
    assert (stage.trigger_tokens, stage.target_tokens) == (800_000, 600_000)


# --------------------------------------------------------------------------------------------
# Property: random well-formed histories
# --------------------------------------------------------------------------------------------


@PROPERTY
@given(
    history=histories(),
    window=st.integers(200, 6_000),
    keep=st.integers(1, 4),
    reference=st.booleans(),
)
def test_snip_keeps_pairing_alternation_and_is_idempotent(
    tmp_path_factory: pytest.TempPathFactory,
    history: list[Message],
    window: int,
    keep: int,
    reference: bool,
) -> None:
    import anyio

    async def body() -> None:
        root = tmp_path_factory.mktemp("snip")
        stage = HistorySnip(context_window=window, keep_recent_rounds=keep)
        ctx = make_ctx(
            root, token_tracker=TokenTracker("reference") if reference else TokenTracker()
        )
        out = await run(stage, history, ctx)
        assert wire_ok(out)
        assert not out or out[0] is history[0]
        originals = {id(m) for m in history}
        assert all(id(m) in originals or m.is_meta for m in out)
        # each marker counts the API messages of the run it stands for
        j = 0
        for pos, m in enumerate(out):
            if id(m) in originals:
                j = next(k for k in range(j, len(history)) if history[k] is m) + 1
                continue
            nxt = out[pos + 1] if pos + 1 < len(out) else None
            end = next(k for k in range(j, len(history)) if history[k] is nxt)
            assert m.content == snip_marker_text(len(to_api(history[j:end])))
            j = end
        # the last ``keep`` responses and everything after them are untouched
        ids = [m.message_id for m in history if m.type == "assistant"]
        recent = list(dict.fromkeys(reversed(ids)))[:keep]
        if recent:
            start = min(i for i, m in enumerate(history) if m.message_id in recent)
            assert_same_messages(out[len(out) - (len(history) - start) :], history[start:])
        # idempotent, and a resumed context repeats it
        assert_same_messages(await run(stage, history, ctx), out)
        resumed = make_ctx(root, stage_records=ctx.stage_records, token_tracker=ctx.token_tracker)
        assert_same_messages(await run(stage, history, resumed), out)

    anyio.run(body)


@pytest.mark.asyncio
async def test_a_stage_that_copies_the_anchor_record_keeps_what_was_freed(tmp_path: Path) -> None:
    """What a stage freed from before the anchor stays subtracted when a later stage hands
    the anchor's record on as a copy (say, one that redacts assistant text): the usage it
    carries is the same."""

    @stage("copy_assistants")
    async def copy_assistants(messages: list[Message], ctx: SessionContext) -> list[Message]:
        return [dataclasses.replace(m) if m.type == "assistant" else m for m in messages]

    history = agentic(34)
    plain = make_ctx(tmp_path, session_id="plain")
    await Pipeline([small_snip()]).run(history, plain)
    copying = make_ctx(tmp_path, session_id="copying")
    await Pipeline([small_snip(), copy_assistants]).run(history, copying)
    assert plain.report.tokens_freed > 0
    assert copying.report.tokens_freed == plain.report.tokens_freed
    assert copying.report.estimated_tokens == plain.report.estimated_tokens
