"""The ``autocompact`` stage: thresholds, decisions, the summary projection, retries, the circuit
breaker, cache stability, resume, and the Anthropic summariser over the real SDK."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from anthropic.types import MessageParam

from pipeline import (
    Message,
    Pipeline,
    SessionContext,
    TokenTracker,
    TranscriptWriter,
    Usage,
    load_transcript,
    to_api,
)
from pipeline.summarizer import (
    DEFAULT_SUMMARY_PROMPT,
    AnthropicSummarizer,
    SummaryError,
    SummaryPromptTooLong,
)
from pipeline.testing import Reply, ScriptedMessagesServer, ScriptError, SpanRecorder
from pipeline.tokens import rough_tokens_for_messages, rough_tokens_for_text
from pipeline.transcript.read import StageRecord
from pipeline.wire.pairing import check_pairing
from stages.autocompact import SUMMARY_PREFIX, Autocompact, ContextWindowExceeded, Thresholds
from tests.builders import (
    HostileSummarizer,
    assistant,
    results,
    tool_result,
    tool_use,
    user_text,
)
from tests.sdk_support import sdk_client

# A small window keeps the numbers readable: effective 52,000, compact at 39,000, warn at
# 19,000, block at 49,000. Sizes come from the usage of the last response.
SMALL: dict[str, Any] = {"context_window": 60_000, "max_output_tokens": 8_000}
BELOW, WARN, OVER, BLOCKING = 10_000, 25_000, 40_000, 50_000
REQ = rough_tokens_for_text("now fix the parser")  # what the default request adds to the usage


class FakeSummarizer:
    """Replays ``outcomes`` (the last one repeats) and records every request it gets."""

    def __init__(self, *outcomes: str | BaseException) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[list[Any]] = []  # plain dicts, as sent

    async def summarize(self, messages: Sequence[MessageParam]) -> str:
        self.calls.append(copy.deepcopy(list(messages)))
        out = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]
        if isinstance(out, BaseException):
            raise out
        return out


class Exploding:
    """A summariser that must never be asked."""

    async def summarize(self, messages: Sequence[MessageParam]) -> str:
        raise AssertionError("the summariser was called")


@pytest.fixture
def exporter() -> SpanRecorder:
    return SpanRecorder()


def make_ctx(tmp_path: Path, exporter: SpanRecorder, **kw: Any) -> SessionContext:
    """A context whose spans land in ``exporter``; the reference token estimate unless a
    tracker is given, so the numbers below are exact."""
    kw.setdefault("token_tracker", TokenTracker("reference"))
    return SessionContext("s1", tmp_path / "store", tracer=exporter.tracer, **kw)


def decisions(exporter: SpanRecorder) -> list[dict[str, Any]]:
    """The attributes of every autocompact decision span, short keys, in order."""
    return [
        {k.removeprefix("sluicegate.").replace("tokens.estimated_", "tokens_"): v for k, v in attrs}
        for attrs in ((s.attributes or {}).items() for s in exporter.decisions("autocompact"))
    ]


def rounds(n: int, *, first: int = 0, usage: int | None = None) -> list[Message]:
    """``n`` request → tool call → result → answer rounds; the last answer carries ``usage``."""
    out: list[Message] = []
    for r in range(first, first + n):
        out += [
            user_text(f"request {r}: please look at the logs " + "and the traces " * 20),
            assistant(f"m{r}a", {"type": "text", "text": "Looking."}, tool_use(f"t{r}")),
            results(tool_result(f"t{r}", f"log line {r}\n" * 40)),
            assistant(f"m{r}b", {"type": "text", "text": f"Round {r} done."}),
        ]
    if usage is not None:
        last = out[-1]
        out[-1] = Message.assistant(
            last.content, message_id=last.message_id, usage=Usage(input_tokens=usage), model="m"
        )
    return out


def conversation(usage: int, n: int = 3, request: str = "now fix the parser") -> list[Message]:
    return [*rounds(n, usage=usage), user_text(request)]


def dumps(request: Any) -> str:
    return json.dumps(request, sort_keys=True)


# --------------------------------------------------------------------------------------------
# Thresholds and decisions
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, Thresholds(180_000, 167_000, 147_000, 177_000)),
        ({"max_output_tokens": 8_000}, Thresholds(192_000, 179_000, 159_000, 189_000)),
        (
            {"context_window": 1_000_000, "max_output_tokens": 64_000},
            Thresholds(980_000, 967_000, 947_000, 977_000),
        ),
        (SMALL, Thresholds(52_000, 39_000, 19_000, 49_000)),
        (
            {"context_window": 30_000, "max_output_tokens": 4_000},
            Thresholds(26_000, 13_000, 0, 23_000),
        ),
        ({"buffer_tokens": 5_000}, Thresholds(180_000, 175_000, 155_000, 177_000)),
    ],
)
def test_threshold_arithmetic(kwargs: dict[str, Any], expected: Thresholds) -> None:
    assert Autocompact(**kwargs).thresholds == expected


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"context_window": 0}, "context_window"),
        ({"context_window": 30_000}, "context_window"),  # 30,000 − 20,000 − 13,000 < 0
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"buffer_tokens": 2_000}, "buffer_tokens"),  # compacting after blocking is useless
        ({"max_failures": 0}, "max_failures"),
        ({"max_retries": True}, "max_retries"),
        ({"block": "yes"}, "block"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Autocompact(**kwargs)


def test_a_summarizer_needs_a_summarize_method() -> None:
    with pytest.raises(ValueError, match="summarizer"):
        Autocompact(object())  # type: ignore[arg-type]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("usage", "decision", "reason"),
    [
        (BELOW, "skip", "below_warning"),
        (WARN, "warn", "over_warning"),
        (OVER, "compact", "over_trigger"),
        (BLOCKING, "compact", "over_trigger"),  # compaction brings it back under the limit
    ],
)
async def test_decision_by_size(
    tmp_path: Path, exporter: SpanRecorder, usage: int, decision: str, reason: str
) -> None:
    msgs = conversation(usage)
    out = await Autocompact(FakeSummarizer("Short summary."), **SMALL)(
        msgs, make_ctx(tmp_path, exporter)
    )
    [d] = decisions(exporter)
    assert (d["decision"], d["reason"]) == (decision, reason)
    assert (d["trigger_tokens"], d["warning_tokens"], d["blocking_tokens"]) == (
        39_000,
        19_000,
        49_000,
    )
    assert d["tokens_before"] == usage + REQ
    assert d["gen_ai.conversation.id"] == "s1"
    assert (out is msgs) == (decision != "compact")


@pytest.mark.asyncio
async def test_without_summarizer_it_never_compacts_but_blocks(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    ctx = make_ctx(tmp_path, exporter)
    over = conversation(OVER)
    assert await Autocompact(block=True, **SMALL)(over, ctx) is over
    with pytest.raises(ContextWindowExceeded) as err:
        await Autocompact(block=True, **SMALL)(conversation(BLOCKING), ctx)
    assert (err.value.size, err.value.limit) == (BLOCKING + REQ, 49_000)
    blocking = conversation(BLOCKING)
    assert await Autocompact(block=False, **SMALL)(blocking, ctx) is blocking
    got = [(d["decision"], d["reason"], d.get("cause")) for d in decisions(exporter)]
    assert got == [
        ("skip", "no_summarizer", None),
        ("block", "over_blocking", "no_summarizer"),
        ("skip", "no_summarizer", None),
    ]


@pytest.mark.asyncio
async def test_a_blocking_instance_warns_and_blocks_through_the_pipeline(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    ctx = make_ctx(tmp_path, exporter)
    default = conversation(177_000)
    assert await Pipeline([Autocompact()]).run(default, ctx) is default  # never blocks
    exporter.clear()
    pipe = Pipeline([Autocompact(block=True)])
    warned = conversation(150_000)
    assert await pipe.run(warned, ctx) is warned
    with pytest.raises(ContextWindowExceeded) as err:  # unwrapped: a PipelineHalt
        await pipe.run(conversation(177_000), ctx)
    assert err.value.limit == 177_000
    assert [d["reason"] for d in decisions(exporter)] == ["over_warning", "over_blocking"]


@pytest.mark.asyncio
async def test_suppressed_by_collapse(tmp_path: Path, exporter: SpanRecorder) -> None:
    ctx = make_ctx(tmp_path, exporter)
    ctx.report.suppress_autocompact = True
    msgs = conversation(BLOCKING)
    assert (
        await Autocompact(Exploding(), **SMALL)(msgs, ctx) is msgs
    )  # and no ContextWindowExceeded
    [d] = decisions(exporter)
    assert (d["decision"], d["reason"]) == ("skip", "suppressed_by_collapse")


@pytest.mark.asyncio
async def test_tokens_freed_by_earlier_stages_count(tmp_path: Path, exporter: SpanRecorder) -> None:
    ctx = make_ctx(tmp_path, exporter)
    ctx.report.tokens_freed = 2_000
    msgs = conversation(OVER)
    assert await Autocompact(Exploding(), **SMALL)(msgs, ctx) is msgs
    [d] = decisions(exporter)
    assert (d["reason"], d["tokens_before"]) == ("over_warning", OVER + REQ - 2_000)


# --------------------------------------------------------------------------------------------
# The projection
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_compaction_projects_boundary_summary_and_kept_request(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    ctx = make_ctx(tmp_path, exporter)
    summarizer = FakeSummarizer("  The user asked for logs; all three were read.  ")
    msgs = conversation(OVER)
    before = list(msgs)
    out = await Autocompact(summarizer, **SMALL)(msgs, ctx)

    assert msgs == before and all(
        a is b for a, b in zip(msgs, before, strict=True)
    )  # input untouched
    assert summarizer.calls == [to_api(msgs[:-1])]  # the span, in wire form
    boundary, summary, *tail = out
    assert boundary.is_compact_boundary and boundary.type == "system"
    text = SUMMARY_PREFIX + "The user asked for logs; all three were read."
    assert summary.is_compact_summary and summary.type == "user" and summary.content == text
    assert tail[0] is msgs[-1]  # the latest request, the very object
    assert to_api(out) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text + "\n"},
                {"type": "text", "text": "now fix the parser"},
            ],
        }
    ]
    [record] = ctx.records_for("autocompact")
    assert record["summary"] == text and record["first_kept_uuid"] == msgs[-1].uuid
    [d] = decisions(exporter)
    assert (d["decision"], d["reason"], d["retries"]) == ("compact", "over_trigger", 0)
    assert d["tokens_after"] == rough_tokens_for_messages(out) < d["span.tokens"]


@pytest.mark.asyncio
async def test_the_latest_request_and_all_after_it_are_kept_verbatim(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    request = user_text("now fix the parser")
    after = [
        assistant("w1", tool_use("x1", "Read"), tool_use("x2", "Read")),
        results(tool_result("x1", "a" * 400)),
        results(tool_result("x2", "b" * 400)),
        assistant("w2", tool_use("x3"), usage=Usage(input_tokens=OVER)),
        results(tool_result("x3", "c" * 400)),
    ]
    msgs = [*rounds(3), request, *after]
    out = await Autocompact(FakeSummarizer("S."), **SMALL)(msgs, make_ctx(tmp_path, exporter))
    assert out[2:] == [request, *after] and all(
        a is b for a, b in zip(out[2:], msgs[12:], strict=True)
    )
    assert check_pairing(to_api(out)) == []


@pytest.mark.asyncio
async def test_a_cut_never_splits_a_tool_pair_or_a_response(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    # the last message with text also answers t9: cutting right before it would orphan t9
    mixed = Message.user([tool_result("t9", "nine"), {"type": "text", "text": "and now stop"}])
    call = assistant("m9", tool_use("t9"))
    msgs = [*rounds(3), call, mixed, assistant("m10", {"type": "text", "text": "ok"})]
    msgs[-1] = Message.assistant(msgs[-1].content, message_id="m10", usage=Usage(input_tokens=OVER))
    out = await Autocompact(FakeSummarizer("S."), **SMALL)(msgs, make_ctx(tmp_path, exporter))
    assert out[2] is call and check_pairing(to_api(out)) == []

    # a request between two fragments of one response: the cut goes before the first fragment
    frag1 = assistant("mX", tool_use("a1"))
    request = user_text("also check b")
    frag2 = assistant("mX", {"type": "text", "text": "checking"}, usage=Usage(input_tokens=OVER))
    msgs = [*rounds(3), frag1, results(tool_result("a1", "A")), request, frag2]
    out = await Autocompact(FakeSummarizer("S."), **SMALL)(msgs, make_ctx(tmp_path, exporter))
    assert out[2] is frag1 and request in out


def random_conversation(rng: random.Random, usage: int) -> list[Message]:
    """Rounds with parallel tool calls, streamed fragments and interleaved results."""
    msgs: list[Message] = []
    tid = 0
    for r in range(rng.randint(2, 8)):
        if r == 0 or rng.random() < 0.5:
            msgs.append(user_text(f"request {r} " + "words " * rng.randint(5, 60)))
        for k in range(rng.randint(1, 4)):
            mid = f"r{r}k{k}"
            ids = [f"u{tid + i}" for i in range(rng.randint(0, 3))]
            tid += len(ids)
            if not ids:
                msgs.append(assistant(mid, {"type": "text", "text": "thinking " * 30}))
                continue
            for i in ids:  # one fragment per tool_use, each followed by its result (streaming)
                msgs.append(assistant(mid, tool_use(i)))
                msgs.append(results(tool_result(i, "out " * rng.randint(10, 200))))
    last = len(msgs) - 1 - next(i for i, m in enumerate(reversed(msgs)) if m.type == "assistant")
    msgs[last] = Message.assistant(
        msgs[last].content, message_id=msgs[last].message_id, usage=Usage(input_tokens=usage)
    )
    return msgs


@pytest.mark.asyncio
async def test_pairing_holds_on_random_conversations(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    compacted = 0
    for seed in range(60):
        rng = random.Random(seed)
        msgs = random_conversation(rng, OVER)
        assert check_pairing(to_api(msgs)) == []
        ctx = make_ctx(tmp_path, exporter)
        out = await Autocompact(FakeSummarizer("S."), **SMALL)(msgs, ctx)
        assert check_pairing(to_api(out)) == [], seed
        if out is msgs:
            assert decisions(exporter)[-1]["reason"] in ("nothing_eligible", "summary_not_smaller")
            continue
        compacted += 1
        first_kept = msgs.index(out[2])
        assert out[2:] == msgs[first_kept:]
        latest = max(i for i, m in enumerate(msgs) if isinstance(m.content, str))
        assert latest >= first_kept, seed  # the latest request is kept
    assert compacted > 30


# --------------------------------------------------------------------------------------------
# Discards, retries, the circuit breaker
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("summary", "reason"), [("  \n ", "summary_empty"), ("x" * 20_000, "summary_not_smaller")]
)
async def test_useless_summaries_are_discarded(
    tmp_path: Path, exporter: SpanRecorder, summary: str, reason: str
) -> None:
    ctx = make_ctx(tmp_path, exporter)
    msgs = conversation(OVER)
    assert await Autocompact(FakeSummarizer(summary), **SMALL)(msgs, ctx) is msgs
    [d] = decisions(exporter)
    assert (d["decision"], d["reason"], d["failures"]) == ("discard", reason, 1)
    assert ctx.records_for("autocompact") == []


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("summarizer", "error"),
    [
        (HostileSummarizer(b"bytes"), "SummaryError"),
        (HostileSummarizer(hang=True), "SummaryTimeout"),
    ],
    ids=["bytes", "hang"],
)
async def test_a_summary_that_is_not_text_or_never_comes_is_a_failure(
    tmp_path: Path, exporter: SpanRecorder, summarizer: HostileSummarizer, error: str
) -> None:
    ctx = make_ctx(tmp_path, exporter)
    msgs = conversation(OVER)
    stage = Autocompact(summarizer, summary_timeout=0.05, max_failures=2, **SMALL)
    for _ in range(3):
        assert await stage(msgs, ctx) is msgs
    found = [(d["decision"], d["reason"], d.get("error")) for d in decisions(exporter)]
    assert found == [
        ("fail", "summary_error", error),
        ("fail", "summary_error", error),
        ("skip", "circuit_open", None),
    ]
    assert summarizer.asked == 2


@pytest.mark.asyncio
async def test_prompt_too_long_drops_the_oldest_rounds(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    too_long = SummaryPromptTooLong("too long")
    summarizer = FakeSummarizer(too_long, too_long, "S.")
    msgs = conversation(OVER, n=10)
    out = await Autocompact(summarizer, **SMALL)(msgs, make_ctx(tmp_path, exporter))
    assert out[1].content == SUMMARY_PREFIX + "S."
    full, second, third = summarizer.calls
    assert full == to_api(msgs[:-1])
    for longer, shorter in [(full, second), (second, third)]:
        body = (
            shorter[1:]
            if shorter[0]["content"] == "[earlier conversation truncated for compaction retry]"
            else shorter
        )
        assert len(body) < len(longer) and longer[-len(body) :] == body  # oldest dropped
        assert shorter[0]["role"] == "user"
    [d] = decisions(exporter)
    assert (d["decision"], d["reason"], d["retries"]) == ("compact", "over_trigger", 2)


@pytest.mark.asyncio
async def test_prompt_too_long_gives_up_after_max_retries(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    summarizer = FakeSummarizer(SummaryPromptTooLong("too long"))
    msgs = conversation(OVER, n=10)
    out = await Autocompact(summarizer, max_retries=2, **SMALL)(msgs, make_ctx(tmp_path, exporter))
    assert out is msgs and len(summarizer.calls) == 3
    assert [len(c) for c in summarizer.calls] == sorted(
        {len(c) for c in summarizer.calls}, reverse=True
    )
    [d] = decisions(exporter)
    assert (d["decision"], d["reason"], d["error"]) == (
        "fail",
        "prompt_too_long",
        "SummaryPromptTooLong",
    )


@pytest.mark.asyncio
async def test_circuit_breaker_opens_after_three_failures_and_success_resets_it(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    err = SummaryError("boom")
    summarizer = FakeSummarizer(err, ValueError("bug"), "S1.", err, err, err, "never")
    stage = Autocompact(summarizer, **SMALL)
    ctx = make_ctx(tmp_path, exporter)
    first = conversation(OVER)
    for _ in range(3):
        ctx.begin_pass()
        await stage(first, ctx)
    later = [
        *first,
        assistant("n1", {"type": "text", "text": "ok"}, usage=Usage(input_tokens=OVER)),
        user_text("next"),
    ]
    for _ in range(4):
        ctx.begin_pass()
        out = await stage(later, ctx)
    got = [(d["reason"], d["failures"]) for d in decisions(exporter)]
    assert got == [
        ("summary_error", 1),
        ("summary_error", 2),
        ("over_trigger", 0),  # a success resets the count
        ("summary_error", 1),
        ("summary_error", 2),
        ("summary_error", 3),
        ("circuit_open", 3),
    ]
    assert len(summarizer.calls) == 6
    assert out[1].content == SUMMARY_PREFIX + "S1."  # the earlier projection still stands


# --------------------------------------------------------------------------------------------
# Cache stability, second compaction, resume
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_projection_is_reapplied_byte_identically(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    summarizer = FakeSummarizer("S1.", "never")
    stage = Autocompact(summarizer, **SMALL)
    ctx = make_ctx(tmp_path, exporter)
    request = user_text("now fix the parser")
    tail = [
        request,
        assistant("w1", tool_use("x1")),
        results(tool_result("x1", "a" * 400)),
        assistant("w2", tool_use("x2"), usage=Usage(input_tokens=OVER)),
        results(tool_result("x2", "b" * 400)),
    ]
    msgs = [*rounds(3), *tail]
    first = await stage(msgs, ctx)
    assert first[2:] == tail
    # the same history again: the last usage (w2, kept) counted the uncompacted conversation,
    # so it is stale; the projection is estimated instead and nothing is compacted again
    again = await stage(list(msgs), ctx)
    assert again == first and again[0] is first[0] and again[1] is first[1]
    more = [
        *msgs,
        assistant("n1", tool_use("z1"), usage=Usage(input_tokens=2_000)),
        results(tool_result("z1", "fine")),
    ]
    later = await stage(more, ctx)
    wire1, wire3 = to_api(first), to_api(later)
    assert len(wire3) == len(wire1) + 2 and dumps(wire3[: len(wire1)]) == dumps(wire1)
    assert later[2:] == more[12:] and len(summarizer.calls) == 1
    compacted, repeated, extended = decisions(exporter)
    assert repeated["decision"] == extended["decision"] == "reapply"
    assert (
        repeated["tokens_before"] == compacted["tokens_after"] == rough_tokens_for_messages(first)
    )
    assert extended["tokens_before"] == 2_000 + rough_tokens_for_text("fine")  # the new usage


@pytest.mark.asyncio
async def test_a_retry_keeps_the_previous_summary(tmp_path: Path, exporter: SpanRecorder) -> None:
    summarizer = FakeSummarizer("S1.", SummaryPromptTooLong("too long"), "S2.")
    stage = Autocompact(summarizer, **SMALL)
    ctx = make_ctx(tmp_path, exporter)
    msgs = conversation(OVER, request="request A")
    await stage(msgs, ctx)
    newer = [*rounds(8, first=10, usage=OVER), user_text("request B")]
    out = await stage([*msgs, *newer], ctx)
    assert out[1].content == SUMMARY_PREFIX + "S2."
    full, retry = summarizer.calls[1:]
    assert (
        full[0]["content"][0]["text"] == retry[0]["content"][0]["text"] == SUMMARY_PREFIX + "S1.\n"
    )
    assert "request A" in dumps(full) and "request A" not in dumps(retry)  # oldest dropped
    assert "request 17" in dumps(retry) and len(retry) < len(full)


@pytest.mark.asyncio
async def test_second_compaction_summarises_previous_summary_and_newer_messages(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    summarizer = FakeSummarizer("S1.", "S2.")
    stage = Autocompact(summarizer, **SMALL)
    ctx = make_ctx(tmp_path, exporter)
    msgs = conversation(OVER, request="request A")
    first = await stage(msgs, ctx)
    newer = [*rounds(2, first=10, usage=OVER), user_text("request B")]
    second = await stage([*msgs, *newer], ctx)

    span = [first[1], msgs[-1], *newer[:-1]]  # previous summary, request A, the newer rounds
    assert summarizer.calls[1] == to_api(span)
    assert summarizer.calls[1][0]["content"][0]["text"] == SUMMARY_PREFIX + "S1.\n"
    assert "request 0" not in dumps(summarizer.calls[1])  # the old rounds are in S1 only
    assert second[1].content == SUMMARY_PREFIX + "S2." and second[2:] == [newer[-1]]
    assert second[0].uuid != first[0].uuid and second[1].uuid != first[1].uuid
    assert [r["summary"] for r in ctx.records_for("autocompact")] == [
        SUMMARY_PREFIX + "S1.",
        SUMMARY_PREFIX + "S2.",
    ]


@pytest.mark.asyncio
async def test_resume_gives_byte_identical_requests(tmp_path: Path, exporter: SpanRecorder) -> None:
    path = tmp_path / "s1.jsonl"
    writer = TranscriptWriter(path, "s1")
    live = make_ctx(tmp_path, exporter, transcript=writer)
    stage = Autocompact(FakeSummarizer("S1.", "S2."), **SMALL)
    history = conversation(OVER, request="request A")
    writer.append_messages(history)
    await stage(history, live)
    newer = [*rounds(2, first=10, usage=OVER), user_text("request B")]
    writer.append_messages(newer)
    history += newer
    await stage(history, live)  # a second compaction: the latest record must win on resume
    turn = [
        assistant("n1", tool_use("z1"), usage=Usage(input_tokens=3_000)),
        results(tool_result("z1", "ok")),
    ]
    writer.append_messages(turn)
    history += turn
    live_out = await stage(history, live)

    loaded = load_transcript(path)
    resumed = make_ctx(tmp_path, exporter, stage_records=loaded.stage_records)
    resumed_out = await Autocompact(Exploding(), **SMALL)(loaded.messages, resumed)
    assert dumps(to_api(resumed_out)) == dumps(to_api(live_out))
    assert [(m.uuid, m.content) for m in resumed_out[:2]] == [
        (m.uuid, m.content) for m in live_out[:2]
    ]
    assert decisions(exporter)[-1]["decision"] == "reapply"


@pytest.mark.asyncio
async def test_projection_survives_an_earlier_stage_dropping_the_cut(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    stage = Autocompact(FakeSummarizer("S."), **SMALL)
    ctx = make_ctx(tmp_path, exporter)
    msgs = conversation(OVER)
    first = await stage(msgs, ctx)
    later = [*msgs, assistant("n1", {"type": "text", "text": "ok"}), user_text("more")]
    without_first_kept = later[:12] + later[13:]  # the kept request is gone: cut after m2b
    assert (await stage(without_first_kept, ctx))[:2] == first[:2]
    assert (await stage(without_first_kept, ctx))[2:] == later[13:]
    lost = later[:11] + later[13:]  # neither side of the cut is left: send what there is
    assert await stage(lost, ctx) is lost


@pytest.mark.asyncio
async def test_without_a_request_the_last_round_is_kept(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    meta = Message.user("<system-reminder>context</system-reminder>", is_meta=True)
    body = [m for m in rounds(3, usage=OVER) if not isinstance(m.content, str)]
    msgs = [meta, *body]  # no message the user typed
    out = await Autocompact(FakeSummarizer("S."), **SMALL)(msgs, make_ctx(tmp_path, exporter))
    assert out[2:] == msgs[-1:]  # the last answer; its tool pair stays whole in the summary
    assert check_pairing(to_api(out)) == []


@pytest.mark.asyncio
async def test_malformed_records_are_ignored(tmp_path: Path, exporter: SpanRecorder) -> None:
    bad = [StageRecord("autocompact", {"summary": 1}), StageRecord("autocompact", {})]
    msgs = conversation(BELOW)
    ctx = make_ctx(tmp_path, exporter, stage_records=bad)
    assert await Autocompact(**SMALL)(msgs, ctx) is msgs


@pytest.mark.asyncio
async def test_sessions_sharing_the_stage_are_isolated(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    stage = Autocompact(FakeSummarizer("S."), **SMALL)
    a, b = make_ctx(tmp_path, exporter), make_ctx(tmp_path, exporter)
    assert (await stage(conversation(OVER), a))[0].is_compact_boundary
    mine = conversation(BELOW)
    assert await stage(mine, b) is mine


@pytest.mark.asyncio
async def test_decision_spans_carry_no_content(tmp_path: Path, exporter: SpanRecorder) -> None:
    msgs = conversation(OVER, request="SECRET REQUEST")
    await Autocompact(FakeSummarizer("SECRET SUMMARY"), **SMALL)(msgs, make_ctx(tmp_path, exporter))
    values = [str(v) for d in decisions(exporter) for v in d.values()]
    assert values and not any("SECRET" in v or "logs" in v for v in values)


# --------------------------------------------------------------------------------------------
# The Anthropic summariser over the real SDK
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_anthropic_summarizer_end_to_end(tmp_path: Path, exporter: SpanRecorder) -> None:
    refusals = [1]  # the first summary request is refused as too long

    def script(body: dict[str, Any]) -> Reply | ScriptError:
        if refusals[0]:
            refusals[0] -= 1
            return ScriptError(
                400, "invalid_request_error", "prompt is too long: 212000 tokens > 200000 maximum"
            )
        return Reply([{"type": "text", "text": "  The user wanted the logs read; done.  "}])

    msgs = conversation(OVER, n=6)
    with ScriptedMessagesServer(script) as server:
        client = sdk_client(server.base_url, api_key="x")
        summarizer = AnthropicSummarizer(client, model="claude-test", max_tokens=1_000)
        ctx = make_ctx(tmp_path, exporter, token_tracker=TokenTracker())  # the default tracker
        stage = Autocompact(summarizer, **SMALL)
        out = await stage(msgs, ctx)
        assert await stage(msgs, ctx) == out  # re-applied, not compacted again
        await client.close()
        bodies = server.requests

    assert out[1].content == SUMMARY_PREFIX + "The user wanted the logs read; done."
    assert out[2] is msgs[-1] and check_pairing(to_api(out)) == []
    assert len(bodies) == 2
    for body in bodies:
        wire = body["messages"]
        assert body["model"] == "claude-test" and body["max_tokens"] == 1_000
        assert wire[0]["role"] == "user" and all(a["role"] != b["role"] for a, b in pairwise(wire))
        assert wire[-1] == {"role": "user", "content": DEFAULT_SUMMARY_PROMPT}  # instruction last
    assert bodies[0]["messages"][:-1] == json.loads(json.dumps(to_api(msgs[:-1])))
    first, retry = bodies[0]["messages"][:-1], bodies[1]["messages"][:-1]
    assert len(retry) < len(first) and "request 0" not in dumps(retry)
    assert "request 0" in dumps(first) and "request 5" in dumps(retry)
    d, again = decisions(exporter)
    assert (d["decision"], d["reason"], d["retries"]) == ("compact", "over_trigger", 1)
    assert again["decision"] == "reapply"


@pytest.mark.asyncio
async def test_a_tool_block_without_an_id_does_not_pin_every_cut(
    tmp_path: Path, exporter: SpanRecorder
) -> None:
    """A tool_use or tool_result without a string id pairs with nothing, so it ties no two
    records together: the rounds around it can still be summarised."""
    msgs = conversation(OVER, n=4)
    broken = {"type": "tool_use", "name": "Bash", "input": {}}  # no id
    msgs[1] = msgs[1].with_content([*msgs[1].blocks, broken])
    orphan = {"type": "tool_result", "content": "?"}  # no id either, with the latest request
    msgs[-1] = msgs[-1].with_content([orphan, *msgs[-1].blocks])
    stage = Autocompact(FakeSummarizer("S."), **SMALL)
    out = await stage(msgs, make_ctx(tmp_path, exporter))
    [d] = decisions(exporter)
    assert (d["decision"], d["reason"]) == ("compact", "over_trigger")
    assert out[0].is_compact_boundary and out[2:] == msgs[-1:]  # all but the latest request
