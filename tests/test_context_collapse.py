"""Context collapse (``summarize-spans``): commits at 90%, a stable projection, failures that
never fail the turn, resume, and the Anthropic summariser against the local scripted server."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from anthropic.types import MessageParam
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pipeline import (
    Message,
    Pipeline,
    TokenTracker,
    TranscriptWriter,
    load_transcript,
    to_api,
)
from pipeline.summarizer import (
    DEFAULT_SUMMARY_PROMPT,
    AnthropicSummarizer,
    SummaryError,
    SummaryPromptTooLong,
)
from pipeline.testing import Reply, ScriptedMessagesServer, ScriptError, assert_same_messages
from pipeline.tokens import rough_tokens_for_messages
from pipeline.tracing import ATTR
from pipeline.transcript.read import StageRecord
from stages import ContextCollapse, HistorySnip, default_stages
from stages.context_collapse import SUMMARY_HEADER
from tests.builders import HostileSummarizer
from tests.rounds_support import (
    PROPERTY,
    Spans,
    agentic,
    answered,
    dump,
    histories,
    make_ctx,
    roles_alternate,
    run,
    wire_ok,
)
from tests.sdk_support import sdk_client

SUMMARY = "Tests in a.py fixed; b.py still fails on an import."


class FakeSummarizer:
    """A :class:`~pipeline.summarizer.Summarizer`: records what it was asked, answers ``reply``
    (text, or an exception to raise)."""

    def __init__(self, reply: str | Exception = SUMMARY) -> None:
        self.reply = reply
        self.requests: list[list[MessageParam]] = []

    async def summarize(self, messages: Sequence[MessageParam]) -> str:
        self.requests.append(list(messages))
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply


def collapse(summarizer: Any = None, **kw: Any) -> ContextCollapse:
    kw.setdefault("keep_recent_rounds", 4)
    return ContextCollapse(summarizer, context_window=10_000, **kw)  # commit at 9,000


def over_commit() -> list[Message]:
    history = agentic(36)
    assert TokenTracker("reference").estimate(history) >= 9_000
    return history


def decision(spans: Spans, index: int = -1) -> tuple[Any, Any]:
    d = spans.decisions("context_collapse")[index]
    return d[ATTR.DECISION], d[ATTR.REASON]


# --------------------------------------------------------------------------------------------
# When it commits, and what it sends
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_without_a_summarizer_it_never_commits_and_says_so(tmp_path: Path) -> None:
    spans = Spans()
    history = over_commit()
    ctx = make_ctx(tmp_path, spans)
    assert await collapse()(history, ctx) is history
    assert decision(spans) == ("skip", "no_summarizer")
    assert not ctx.report.suppress_autocompact
    assert ContextCollapse().summarizer is None  # what default_stages() builds
    assert "context_collapse" in Pipeline(default_stages()).names


@pytest.mark.asyncio
async def test_commits_when_the_estimate_reaches_ninety_percent(tmp_path: Path) -> None:
    spans = Spans()
    tracker = TokenTracker("reference")
    n = max(k for k in range(60) if tracker.estimate(agentic(k)) < 9_000)
    below, above = agentic(n), agentic(n + 1)
    fake = FakeSummarizer()
    stage = collapse(fake)
    ctx = make_ctx(tmp_path, spans)
    assert await stage(below, ctx) is below and fake.requests == []
    assert decision(spans) == ("skip", "below_trigger")

    ctx = make_ctx(tmp_path, spans, session_id="s2")
    before = ctx.token_tracker.estimate(above)
    out = await run(stage, above, ctx)
    assert decision(spans) == ("collapse", "over_trigger")
    # the oldest rounds, in wire form, ending with the tool_result of the last one
    [request] = fake.requests
    k = (len(above) - len(out) + 1) // 2
    assert k >= 1 and request == to_api(above[1 : 1 + 2 * k])
    assert request[0]["role"] == "assistant" and roles_alternate(request)
    assert out[0] is above[0]  # the task stays verbatim
    assert out[1].content == SUMMARY_HEADER + SUMMARY and out[1].type == "user"
    assert out[2:] == above[1 + 2 * k :] and all(
        a is b for a, b in zip(out[2:], above[1 + 2 * k :], strict=True)
    )
    assert wire_ok(out)
    assert ctx.report.suppress_autocompact
    freed = rough_tokens_for_messages(above[1 : 1 + 2 * k]) - rough_tokens_for_messages(out[1:2])
    assert ctx.report.tokens_freed == freed > 0
    d = spans.decisions("context_collapse")[-1]
    assert d[ATTR.TOKENS_BEFORE] == before and d[ATTR.TOKENS_AFTER] == before - freed < 9_000
    assert ctx.records_for("context_collapse") == [
        {
            "strategy": "summarize-spans",
            "uuids": [m.uuid for m in above[1 : 1 + 2 * k]],
            "summary": SUMMARY,
            "anchor": above[-2].uuid,
        }
    ]
    # decision spans carry counts and codes, never content
    assert not any(SUMMARY in str(v) or "xxxx" in str(v) for v in d.values())


@pytest.mark.asyncio
async def test_the_projection_is_stable_across_passes(tmp_path: Path) -> None:
    fake = FakeSummarizer()
    stage = collapse(fake)
    ctx = make_ctx(tmp_path)
    history = over_commit()
    requests, suppressed = [], []
    for n in range(36, 46):
        out = await run(stage, history, ctx)
        requests.append(dump(out))
        suppressed.append(ctx.report.suppress_autocompact)
        assert wire_ok(out)
        history = answered(history, out, n, 1_000)
    assert len(fake.requests) == 1 and all(suppressed)
    for prev, nxt in itertools.pairwise(requests):
        a, b = json.loads(prev), json.loads(nxt)
        assert b[: len(a) - 1] == a[:-1]  # request k+1 starts with request k minus its last
    # same input and state, same bytes
    assert dump(await run(stage, history, ctx)) == dump(await run(stage, history, ctx))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("reply", "reason"),
    [("", "summary_empty"), ("  \n ", "summary_empty"), ("x" * 40_000, "summary_not_smaller")],
)
async def test_useless_summaries_are_discarded(tmp_path: Path, reply: str, reason: str) -> None:
    spans = Spans()
    fake = FakeSummarizer(reply)
    stage = collapse(fake, max_failures=2)
    ctx = make_ctx(tmp_path, spans)
    history = over_commit()
    for _ in range(3):
        out = await run(stage, history, ctx)
        assert out == history and not ctx.report.suppress_autocompact
    assert [decision(spans, i) for i in range(3)] == [
        ("discard", reason),
        ("discard", reason),
        ("skip", "circuit_open"),  # two in a row: stop paying for summaries in this session
    ]
    assert len(fake.requests) == 2 and ctx.records_for("context_collapse") == []


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (SummaryPromptTooLong("too long"), "prompt_too_long"),
        (SummaryError("refused"), "summary_error"),
        (RuntimeError("network down"), "summary_error"),
    ],
)
async def test_summary_failures_never_fail_the_turn(
    tmp_path: Path, error: Exception, reason: str
) -> None:
    spans = Spans()
    fake = FakeSummarizer(error)
    ctx = make_ctx(tmp_path, spans)
    history = over_commit()
    stage = collapse(fake, max_span_fraction=0.5)
    assert await run(stage, history, ctx) == history
    assert decision(spans) == ("fail", reason)
    await run(stage, history, ctx)
    first, second = (len(r) for r in fake.requests)
    if reason == "prompt_too_long":
        assert second < first  # asks for a shorter span next time
    else:
        assert second == first


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "summarizer",
    [
        HostileSummarizer(b"bytes summary"),
        HostileSummarizer(None),
        HostileSummarizer(["a"]),
        HostileSummarizer(hang=True),
    ],
    ids=["bytes", "none", "list", "hang"],
)
async def test_a_summary_that_is_not_text_or_never_comes_is_a_failure(
    tmp_path: Path, summarizer: HostileSummarizer
) -> None:
    """Not text, or no answer within ``summary_timeout``: the pass goes on uncollapsed, the
    failure is counted, and after ``max_failures`` the stage stops asking."""
    spans = Spans()
    ctx = make_ctx(tmp_path, spans)
    history = over_commit()
    stage = collapse(summarizer, summary_timeout=0.05, max_failures=2)
    for _ in range(3):
        assert await run(stage, history, ctx) == history
    assert [decision(spans, k) for k in range(3)] == [
        ("fail", "summary_error"),
        ("fail", "summary_error"),
        ("skip", "circuit_open"),
    ]
    assert summarizer.asked == 2


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "5", True])
def test_a_summary_timeout_must_be_seconds_above_zero(bad: Any) -> None:
    with pytest.raises(ValueError, match="summary_timeout"):
        collapse(FakeSummarizer(), summary_timeout=bad)


# --------------------------------------------------------------------------------------------
# Resume and sessions
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_resumed_session_sends_the_same_requests(tmp_path: Path) -> None:
    fake = FakeSummarizer()
    stage = collapse(fake)  # shared by both sessions
    path = tmp_path / "s1.jsonl"
    writer = TranscriptWriter(path, "s1")
    live = make_ctx(tmp_path, transcript=writer)
    history = over_commit()
    writer.append_messages(history)
    for n in range(36, 40):
        grown = answered(history, await run(stage, history, live), n, 1_000)
        writer.append_messages(grown[len(history) :])
        history = grown
    assert len(fake.requests) == 1

    loaded = load_transcript(path)
    resumed = make_ctx(tmp_path, stage_records=loaded.stage_records)
    assert dump(await run(stage, loaded.messages, resumed)) == dump(await run(stage, history, live))
    assert resumed.report.suppress_autocompact and len(fake.requests) == 1


MALFORMED_COMMITS: list[dict[str, Any]] = [
    {"uuids": 5, "summary": "forged"},
    {"uuids": "a0", "summary": "forged"},
    {"uuids": [1, 2], "summary": "forged"},
    {"uuids": [], "summary": "forged"},
    {"uuids": ["a0", "r0"], "summary": 5},
    {"uuids": ["a0", "r0"], "summary": ""},
    {"uuids": ["a0", "r0"], "summary": "forged", "anchor": ["a1"]},
    {"strategy": "another", "uuids": ["a0", "r0"], "summary": "forged"},
    {},
]


@pytest.mark.parametrize("data", MALFORMED_COMMITS, ids=[json.dumps(d) for d in MALFORMED_COMMITS])
@pytest.mark.asyncio
async def test_a_malformed_record_is_ignored_with_a_warning(
    tmp_path: Path, data: dict[str, Any]
) -> None:
    history = agentic(20)  # below the trigger: only a restored commit could change it
    with structlog.testing.capture_logs() as logs:  # (a context logs as it was made)
        resumed = make_ctx(tmp_path, stage_records=[StageRecord("context_collapse", data)])
        out = await run(collapse(FakeSummarizer()), history, resumed)
    assert out == history and not resumed.report.suppress_autocompact
    [event] = [e for e in logs if e["event"] == "stage_record.ignored"]
    assert (event["stage"], event["record"], event["log_level"]) == (
        "context_collapse",
        0,
        "warning",
    )


@pytest.mark.parametrize("span", ["the-task", "the-recent-rounds", "everything"])
@pytest.mark.asyncio
async def test_a_forged_commit_never_replaces_what_collapse_keeps(
    tmp_path: Path, span: str
) -> None:
    history = agentic(20)
    every = [m.uuid for m in history]
    uuids = {"the-task": every[:5], "the-recent-rounds": every[-8:], "everything": every}[span]
    forged = {"uuids": uuids, "summary": "Nothing was asked.", "anchor": None}
    with structlog.testing.capture_logs() as logs:
        resumed = make_ctx(tmp_path, stage_records=[StageRecord("context_collapse", forged)])
        out = await run(collapse(FakeSummarizer()), history, resumed)
    assert out == history and out[0] is history[0]  # the task stays verbatim
    assert not any("Nothing was asked." in str(m.content) for m in out)
    assert [e["event"] for e in logs].count("stage_record.ignored") == 1


@pytest.mark.asyncio
async def test_a_bad_record_costs_only_itself(tmp_path: Path) -> None:
    fake = FakeSummarizer()
    stage = collapse(fake)
    live = make_ctx(tmp_path)
    history = over_commit()
    await run(stage, history, live)
    assert len(live.stage_records) == 1
    records = [
        StageRecord("context_collapse", {"uuids": 5, "summary": "x"}),
        *live.stage_records,
        StageRecord("context_collapse", {"uuids": ["first"], "summary": "x"}),
    ]
    resumed = make_ctx(tmp_path, stage_records=records)
    assert dump(await run(stage, history, resumed)) == dump(await run(stage, history, live))
    assert resumed.report.suppress_autocompact and len(fake.requests) == 1


@pytest.mark.asyncio
async def test_commits_before_a_compact_boundary_are_not_projected(tmp_path: Path) -> None:
    stage = collapse(FakeSummarizer())
    ctx = make_ctx(tmp_path)
    history = over_commit()
    await run(stage, history, ctx)
    compacted = [
        *history,
        Message(type="system", subtype="compact_boundary", content="compacted", uuid="b"),
        Message.user("Summary of the work so far.", uuid="s", is_compact_summary=True),
    ]
    ctx.begin_pass()
    assert await stage(compacted, ctx) is compacted and not ctx.report.suppress_autocompact


@pytest.mark.asyncio
async def test_state_is_per_session(tmp_path: Path) -> None:
    fake = FakeSummarizer()
    stage = collapse(fake)
    one, two = make_ctx(tmp_path), make_ctx(tmp_path, session_id="s2")
    await run(stage, over_commit(), one)
    small = agentic(3)
    assert await run(stage, small, two) == small and not two.report.suppress_autocompact


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"context_window": 0}, "context_window"),
        ({"commit_fraction": 1.2}, "commit_fraction"),
        ({"target_fraction": "0.5"}, "target_fraction"),
        ({"target_fraction": 0.95}, "target_fraction"),
        ({"max_span_fraction": 0}, "max_span_fraction"),
        ({"keep_recent_rounds": 0}, "keep_recent_rounds"),
        ({"max_failures": False}, "max_failures"),
        ({"summarizer": object()}, "summarizer"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        ContextCollapse(**kwargs)


def test_simple_keyword_construction() -> None:
    stage = ContextCollapse(context_window=1_000_000, commit_fraction=0.95)
    assert (stage.name, stage.strategy, stage.may_break_cache) == (
        "context_collapse",
        "summarize-spans",
        True,
    )
    assert stage.commit_tokens == 950_000


# --------------------------------------------------------------------------------------------
# The Anthropic summariser, on the real SDK against the local scripted server
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_anthropic_summarizer_on_the_scripted_server(tmp_path: Path) -> None:
    def script(body: dict[str, Any]) -> Reply | ScriptError:
        if len(body["messages"]) > 30:
            return ScriptError(400, "invalid_request_error", "prompt is too long: 9 > 8 maximum")
        return Reply([{"type": "text", "text": f"  {SUMMARY}\n"}])

    history = over_commit()
    with ScriptedMessagesServer(script) as server:
        client = sdk_client(server.base_url, api_key="x")
        summarizer = AnthropicSummarizer(client, model="claude-test", max_tokens=500)
        ctx = make_ctx(tmp_path)
        out = await run(collapse(summarizer), history, ctx)

        [body] = server.requests
        assert body["model"] == "claude-test" and body["max_tokens"] == 500
        sent = body["messages"]
        span = json.loads(json.dumps(to_api(history[1 : len(history) - len(out) + 2])))
        # the span as it is, the instruction joined to its last (user) message
        assert sent[:-1] == span[:-1] and roles_alternate(sent)
        assert sent[-1]["content"] == [
            *span[-1]["content"],
            {"type": "text", "text": DEFAULT_SUMMARY_PROMPT},
        ]
        assert out[1].content == SUMMARY_HEADER + SUMMARY and wire_ok(out)

        with pytest.raises(SummaryPromptTooLong):
            await summarizer.summarize(to_api(history))
        assert len(server.requests) == 2
        await client.close()


# --------------------------------------------------------------------------------------------
# Property: snip and collapse together over growing random sessions
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@settings(PROPERTY)
@given(
    history=histories(),
    snip_window=st.integers(300, 8_000),
    window=st.integers(200, 6_000),
    keep=st.integers(1, 3),
    replies=st.lists(st.sampled_from(["s", "", "error", "long"]), min_size=1, max_size=4),
    reference=st.booleans(),
)
def test_collapse_keeps_pairing_alternation_and_is_idempotent(
    tmp_path_factory: pytest.TempPathFactory,
    history: list[Message],
    snip_window: int,
    window: int,
    keep: int,
    replies: list[str],
    reference: bool,
) -> None:
    class Scripted:
        calls = 0

        async def summarize(self, messages: Sequence[MessageParam]) -> str:
            assert messages and roles_alternate(messages)
            kind = replies[self.calls % len(replies)]
            self.calls += 1
            if kind == "error":
                raise SummaryPromptTooLong("too long")
            return {"s": f"summary {self.calls}", "": "", "long": "y" * 5_000}[kind]

    async def body() -> None:
        root = tmp_path_factory.mktemp("collapse")
        spans = Spans()
        pipe = Pipeline(
            [
                HistorySnip(context_window=snip_window, keep_recent_rounds=keep),
                ContextCollapse(Scripted(), context_window=window, keep_recent_rounds=keep),
            ]
        )
        tracker = TokenTracker("reference") if reference else TokenTracker()
        ctx = make_ctx(root, spans, token_tracker=tracker)
        # the session as it grew: a pass before each response, then passes on the whole of it
        starts, seen = [], set()
        for i, m in enumerate(history):  # where each response begins
            if m.type == "assistant" and m.message_id not in seen:
                starts.append(i)
                seen.add(m.message_id)
        # On the whole history the state settles: every pass makes at most one decision, a
        # commit or a snip takes at least one round for good, and between two commits at most
        # max_failures - 1 (2) summaries fail before the circuit opens. A tiny window with
        # failing summaries (say "s", "", "" over 11 rounds) needs more than a dozen passes.
        settle = 3 * (len(starts) + 1) + 2
        for k in [*starts, *[len(history)] * settle]:
            out = await pipe.run(history[:k], ctx)
            assert wire_ok(out)
            assert ctx.report.suppress_autocompact == any(
                isinstance(m.content, str) and m.content.startswith(SUMMARY_HEADER) for m in out
            )
            last = spans.decisions("context_collapse")[-1][ATTR.DECISION]
            snip = spans.decisions("history_snip")[-1][ATTR.DECISION]
            if k == len(history) and snip != "snip" and last in ("skip", "reapply"):
                break  # no new decision: the state is settled
        else:
            raise AssertionError("a pipeline that keeps deciding on the same history")
        assert not out or out[0] is history[0]
        event("collapsed" if ctx.report.suppress_autocompact else "not collapsed")
        assert_same_messages(await pipe.run(history, ctx), out)  # same input and state
        if spans.decisions("context_collapse")[-1][ATTR.REASON] != "circuit_open":
            resumed = make_ctx(root, stage_records=ctx.stage_records, token_tracker=tracker)
            assert_same_messages(await pipe.run(history, resumed), out)

    anyio.run(body)
