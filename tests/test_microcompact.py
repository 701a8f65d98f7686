"""The microcompact strategies: local "clear-oldest" and server-side "server-clear"."""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anthropic
import anyio
import pytest
from anthropic.types import AnthropicBetaParam
from anthropic.types.beta import BetaContextManagementConfigParam
from anthropic.types.beta.beta_clear_tool_uses_20250919_edit_param import (
    BetaClearToolUses20250919EditParam,
)
from anthropic.types.beta.beta_input_tokens_clear_at_least_param import (
    BetaInputTokensClearAtLeastParam,
)
from anthropic.types.beta.beta_input_tokens_trigger_param import BetaInputTokensTriggerParam
from anthropic.types.beta.beta_tool_uses_keep_param import BetaToolUsesKeepParam
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

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
from pipeline.agent import Agent
from pipeline.results.keys import is_replacement_text
from pipeline.testing import Reply, ScriptedMessagesServer, ScriptError, SpanRecorder
from pipeline.tokens import rough_tokens_for_messages
from pipeline.tools import tool
from pipeline.tracing import ATTR, Reason
from pipeline.transcript.read import StageRecord
from pipeline.wire.pairing import check_pairing
from stages import Microcompact, ServerSideMicrocompact, default_stages
from stages._shared import CLEARED_PLACEHOLDER
from stages.microcompact import DEFAULT_COMPACTABLE_TOOLS
from stages.server_microcompact import CONTEXT_MANAGEMENT_BETA
from tests.builders import assistant, results, tool_result, tool_use, user_text
from tests.sdk_support import sdk_client

T0 = datetime(2025, 3, 1, 9, 0, tzinfo=UTC)


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------


def stamp(minutes: float) -> str:
    """An ISO-8601 UTC timestamp ``minutes`` after T0, written the way Claude Code writes it."""
    return (
        (T0 + timedelta(minutes=minutes)).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def at(m: Message, minutes: float) -> Message:
    """``m`` with a timestamp ``minutes`` after T0."""
    return dataclasses.replace(m, timestamp=stamp(minutes))


def output(tag: str, tokens: int) -> str:
    """Tool output of about ``tokens`` estimated tokens (``len/4``) that names ``tag``."""
    line = f"{tag} line of build output\n"
    return (line * (tokens * 4 // len(line) + 1))[: tokens * 4]


def tool_turns(
    n: int,
    *,
    tokens: int = 3_000,
    tool_name: str | Callable[[int], str] = "Bash",
    start: float = 0.0,
    first: int = 0,
    usage: bool = False,
) -> list[Message]:
    """A prompt, then ``n`` responses a minute apart, each calling one tool (``toolu_<k>``,
    counting from ``first``), each answered at once."""
    msgs = [at(user_text("Fix the build."), start)]
    for i in range(n):
        k = first + i
        name = tool_name(k) if callable(tool_name) else tool_name
        u = Usage(input_tokens=10, output_tokens=5) if usage else None
        msgs.append(at(assistant(f"msg_{k}", tool_use(f"toolu_{k}", name), usage=u), start + i))
        msgs.append(at(results(tool_result(f"toolu_{k}", output(f"OUT{k}", tokens))), start + i))
    return msgs


def come_back(msgs: list[Message], after_minutes: float) -> list[Message]:
    """The model answers in text, the user returns ``after_minutes`` later with a new prompt."""
    end = max(
        (datetime.fromisoformat(m.timestamp) - T0).total_seconds() / 60 for m in msgs if m.timestamp
    )
    return [
        *msgs,
        at(assistant("msg_done", {"type": "text", "text": "Done."}), end),
        at(user_text("Next: the flaky test."), end + after_minutes),
    ]


def result_blocks(msgs: Sequence[Message]) -> dict[str, dict[str, Any]]:
    """Every tool_result block by tool_use_id."""
    return {
        b["tool_use_id"]: b
        for m in msgs
        if m.type == "user" and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    }


def cleared_ids(msgs: Sequence[Message]) -> list[str]:
    """tool_use_ids whose content is the placeholder, in order."""
    return [tid for tid, b in result_blocks(msgs).items() if b["content"] == CLEARED_PLACEHOLDER]


def ids(*ks: int) -> list[str]:
    return [f"toolu_{k}" for k in ks]


def wire(msgs: Sequence[Message]) -> str:
    """The request's messages array, as bytes would go over the wire."""
    return json.dumps(to_api(msgs), ensure_ascii=False, sort_keys=True)


@pytest.fixture
def spans() -> SpanRecorder:
    return SpanRecorder()


def decisions(exporter: SpanRecorder) -> list[dict[str, Any]]:
    """Attributes of every microcompact decision span, in order."""
    return [dict(a) for a in exporter.decision_attributes("microcompact")]


def new_ctx(tmp_path: Path, session: str = "s1", **kw: Any) -> SessionContext:
    """A context whose tracker is the reference estimate (len/4), so sizes below are exact
    whatever the library's default estimator is."""
    kw.setdefault("token_tracker", TokenTracker("reference"))
    return SessionContext(session, tmp_path / "store", **kw)


async def one_pass(stage: Any, msgs: list[Message], ctx: SessionContext) -> list[Message]:
    """Run ``stage`` as the pipeline would: a fresh pass report first."""
    ctx.begin_pass()
    out: list[Message] = await stage(msgs, ctx)
    return out


IDLE_ONLY: dict[str, Any] = {"trigger_tokens": 0}
SIZE_ONLY: dict[str, Any] = {"idle_minutes": 0}


# --------------------------------------------------------------------------------------------
# Idle gap vs warm cache
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_idle_gap_clears_all_but_the_newest_keep(tmp_path: Path) -> None:
    msgs = come_back(tool_turns(10), after_minutes=61)
    out = await one_pass(Microcompact(keep=5), msgs, ctx := new_ctx(tmp_path))
    assert cleared_ids(out) == ids(0, 1, 2, 3, 4)
    assert ctx.report.decisions["microcompact"].reason == Reason.IDLE_GAP


@pytest.mark.asyncio
@pytest.mark.parametrize(("gap", "fires"), [(59.9, False), (60.0, True), (600.0, True)])
async def test_the_idle_trigger_fires_at_sixty_minutes(
    tmp_path: Path, gap: float, fires: bool
) -> None:
    msgs = come_back(tool_turns(8), after_minutes=gap)
    out = await one_pass(Microcompact(**IDLE_ONLY), msgs, new_ctx(tmp_path))
    assert cleared_ids(out) == (ids(0, 1, 2) if fires else [])


@pytest.mark.asyncio
async def test_a_warm_cache_is_left_alone(tmp_path: Path, spans: SpanRecorder) -> None:
    exporter, tracer = spans, spans.tracer
    msgs = come_back(tool_turns(10), after_minutes=30)
    out = await one_pass(Microcompact(**IDLE_ONLY), msgs, new_ctx(tmp_path, tracer=tracer))
    assert out is msgs
    [d] = decisions(exporter)
    assert (d[ATTR.DECISION], d[ATTR.REASON]) == ("skip", Reason.CACHE_WARM)
    assert d[ATTR.IDLE_GAP_MINUTES] == pytest.approx(30.0)


@pytest.mark.asyncio
async def test_no_timestamp_counts_as_a_warm_cache(tmp_path: Path) -> None:
    msgs = [dataclasses.replace(m, timestamp=None) for m in come_back(tool_turns(10), 600)]
    out = await one_pass(Microcompact(**IDLE_ONLY), msgs, new_ctx(tmp_path))
    assert out is msgs


@pytest.mark.asyncio
async def test_the_idle_gap_is_measured_from_the_records_then_the_wall_clock(
    tmp_path: Path,
) -> None:
    # nothing recorded after the last response: the wall clock decides
    msgs = tool_turns(8)[:-1]
    msgs.append(dataclasses.replace(tool_turns(8)[-1], timestamp=None))
    stage = Microcompact(**IDLE_ONLY)
    out = await one_pass(stage, msgs, new_ctx(tmp_path))
    assert cleared_ids(out) == ids(0, 1, 2)  # T0 was long ago: all but the newest 5
    stage = Microcompact(**IDLE_ONLY, clock=lambda: T0 + timedelta(minutes=8))
    assert await one_pass(stage, msgs, new_ctx(tmp_path, "s2")) is msgs


@pytest.mark.asyncio
async def test_the_idle_trigger_takes_any_gain_the_cold_cache_makes_it_free(
    tmp_path: Path,
) -> None:
    msgs = come_back(tool_turns(7, tokens=200), after_minutes=90)
    stage = Microcompact(min_reclaim_tokens=1_000_000)
    out = await one_pass(stage, msgs, new_ctx(tmp_path))
    assert cleared_ids(out) == ids(0, 1)


# --------------------------------------------------------------------------------------------
# Size trigger and the minimum-reclaim floor
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("method", ["reference", "default"])
async def test_size_trigger(tmp_path: Path, spans: SpanRecorder, method: str) -> None:
    """The trigger compares against the session's own tracker, whatever its method."""
    exporter, tracer = spans, spans.tracer

    def ctx_for(session: str) -> SessionContext:
        tracker = TokenTracker("reference") if method == "reference" else TokenTracker()
        return SessionContext(session, tmp_path, tracer=tracer, token_tracker=tracker)

    msgs = tool_turns(10)  # about 30K tokens at len/4, no timestamps needed
    size = ctx_for("probe").token_tracker.estimate(msgs)
    below = Microcompact(trigger_tokens=size + 1, min_reclaim_tokens=1_000, **SIZE_ONLY)
    assert await one_pass(below, msgs, ctx_for("s1")) is msgs
    above = Microcompact(trigger_tokens=size, min_reclaim_tokens=1_000, keep=3, **SIZE_ONLY)
    out = await one_pass(above, msgs, ctx := ctx_for("s2"))
    assert cleared_ids(out) == ids(*range(7))
    skip, clear = decisions(exporter)
    assert (skip[ATTR.DECISION], skip[ATTR.REASON]) == ("skip", Reason.BELOW_TRIGGER)
    assert (clear[ATTR.DECISION], clear[ATTR.REASON]) == ("clear", Reason.OVER_TRIGGER)
    assert clear[ATTR.TOKENS_BEFORE] == size > 3 * clear[ATTR.TOKENS_AFTER]
    assert clear[ATTR.CLEARED] == 7
    assert clear[ATTR.KEPT] == 3
    assert ctx.report.decisions["microcompact"].facts[ATTR.CLEARED] == 7


@pytest.mark.asyncio
async def test_the_size_trigger_sees_what_earlier_stages_freed(tmp_path: Path) -> None:
    msgs = tool_turns(10)
    stage = Microcompact(trigger_tokens=25_000, min_reclaim_tokens=1_000, **SIZE_ONLY)
    ctx = new_ctx(tmp_path)
    ctx.begin_pass()
    ctx.report.tokens_freed = 10_000  # e.g. history_snip removed that much this pass
    assert await stage(msgs, ctx) is msgs
    assert ctx.report.decisions["microcompact"].reason == Reason.BELOW_TRIGGER


@pytest.mark.asyncio
async def test_below_the_min_reclaim_floor_the_cache_is_not_broken(
    tmp_path: Path, spans: SpanRecorder
) -> None:
    exporter, tracer = spans, spans.tracer
    msgs = tool_turns(10)  # 7 results of ~3K older than the newest 3: ~21K reclaimable
    strict = Microcompact(keep=3, trigger_tokens=10_000, min_reclaim_tokens=22_000, **SIZE_ONLY)
    assert await one_pass(strict, msgs, new_ctx(tmp_path, tracer=tracer)) is msgs
    [d] = decisions(exporter)
    assert (d[ATTR.DECISION], d[ATTR.REASON]) == ("skip", Reason.BELOW_MIN_RECLAIM)
    assert 20_000 < d[ATTR.RECLAIMABLE_TOKENS] < 22_000
    lenient = Microcompact(keep=3, trigger_tokens=10_000, min_reclaim_tokens=20_000, **SIZE_ONLY)
    assert cleared_ids(await one_pass(lenient, msgs, new_ctx(tmp_path, "s2"))) == ids(*range(7))


@pytest.mark.asyncio
async def test_nothing_eligible(tmp_path: Path) -> None:
    msgs = come_back(tool_turns(3), after_minutes=120)  # 3 results, keep 5
    ctx = new_ctx(tmp_path)
    assert await one_pass(Microcompact(), msgs, ctx) is msgs
    assert ctx.report.decisions["microcompact"].reason == Reason.NOTHING_ELIGIBLE


# --------------------------------------------------------------------------------------------
# Batching: fire rarely, rewrite little (vs langchain#37815)
# --------------------------------------------------------------------------------------------


class ClearJustEnough:
    """The naive approach: over the trigger, clear the oldest results until ``clear_at_least``
    tokens are freed -- i.e. about one result per turn once the context sits at the trigger."""

    name = "microcompact"

    def __init__(self, *, trigger_tokens: int, clear_at_least: int, keep: int) -> None:
        self.trigger_tokens, self.clear_at_least, self.keep = trigger_tokens, clear_at_least, keep

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        cleared: set[str] = ctx.stage_state.setdefault(self.name, set())
        out = self._apply(messages, cleared)
        if ctx.token_tracker.estimate(out) >= self.trigger_tokens:
            blocks = result_blocks(messages)
            freed = 0
            for tid in list(blocks)[: max(0, len(blocks) - self.keep)]:
                if tid not in cleared:
                    cleared.add(tid)
                    freed += rough_tokens_for_messages([Message.user([blocks[tid]])])
                    if freed >= self.clear_at_least:
                        break
            out = self._apply(messages, cleared)
        return out

    @staticmethod
    def _apply(messages: list[Message], cleared: set[str]) -> list[Message]:
        return [
            m.with_content(
                [
                    {**b, "content": CLEARED_PLACEHOLDER}
                    if b.get("type") == "tool_result" and b["tool_use_id"] in cleared
                    else b
                    for b in m.content
                ]
            )
            if m.type == "user" and isinstance(m.content, list)
            else m
            for m in messages
        ]


async def simulate(stage: Any, root: Path, turns: int = 30) -> tuple[int, int, int]:
    """Run ``turns`` tool turns through ``stage``.

    Returns (cache breaks, tokens rewritten, tokens of the last request)."""
    assert turns > 0

    # A cache break is a request whose already-sent prefix differs from the previous request;
    # what it rewrites is everything from the first difference to the end (about chars/4).
    ctx = SessionContext("sim", root, token_tracker=TokenTracker("reference"))
    pipe = Pipeline([stage])
    history = [user_text("Port the service to the new framework.")]
    previous: list[Any] | None = None
    breaks = rewritten = 0
    request: list[Any] = []
    for k in range(turns):
        history += [
            assistant(f"msg_{k}", tool_use(f"toolu_{k}", "Read", file_path=f"/src/f{k}.py")),
            results(tool_result(f"toolu_{k}", output(f"FILE{k}", 3_000))),
        ]
        request = to_api(await pipe.run(history, ctx))
        assert check_pairing(request) == []
        if previous is not None:
            first = next(
                (i for i, (a, b) in enumerate(zip(previous, request, strict=False)) if a != b),
                None,
            )
            if first is not None:
                breaks += 1
                rewritten += len(json.dumps(request[first:])) // 4
        previous = request
    return breaks, rewritten, len(json.dumps(request)) // 4


@pytest.mark.asyncio
async def test_batching_fires_rarely_and_rewrites_little(tmp_path: Path) -> None:
    batched = Microcompact(keep=3, trigger_tokens=40_000, min_reclaim_tokens=20_000, **SIZE_ONLY)
    b_breaks, b_rewritten, b_final = await simulate(batched, tmp_path / "b")
    naive = ClearJustEnough(trigger_tokens=40_000, clear_at_least=1, keep=3)
    n_breaks, n_rewritten, n_final = await simulate(naive, tmp_path / "n")
    every_turn = Microcompact(keep=3, trigger_tokens=1, min_reclaim_tokens=0, **SIZE_ONLY)
    e_breaks, e_rewritten, _ = await simulate(every_turn, tmp_path / "e")

    # 30 turns of ~3K tokens: ~90K unmanaged; batched clears about twice, the others ~every turn
    assert 1 <= b_breaks <= 4
    assert n_breaks >= 4 * b_breaks and e_breaks >= 6 * b_breaks
    assert n_rewritten >= 10 * b_rewritten and e_rewritten >= 4 * b_rewritten
    # and it keeps the context as bounded as the naive way does
    assert b_final <= max(n_final, 40_000)


# --------------------------------------------------------------------------------------------
# What is never touched
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_newest_turn_is_never_touched_even_with_keep_0(tmp_path: Path) -> None:
    msgs = tool_turns(4)
    # the last response called three tools in parallel; results arrive in two records
    msgs += [
        at(assistant("msg_par", tool_use("p1"), tool_use("p2"), tool_use("p3")), 10),
        at(results(tool_result("p1", output("P1", 2_000))), 200),
        at(results(tool_result("p2", output("P2", 2_000)), tool_result("p3", "x" * 800)), 200),
    ]
    out = await one_pass(Microcompact(keep=0, **IDLE_ONLY), msgs, new_ctx(tmp_path))
    assert cleared_ids(out) == ids(0, 1, 2, 3)
    assert out[-2:] == msgs[-2:] and out[-1] is msgs[-1] and out[-2] is msgs[-2]


@pytest.mark.asyncio
async def test_results_between_fragments_of_the_last_response_are_the_newest_turn(
    tmp_path: Path,
) -> None:
    msgs = tool_turns(3)
    msgs += [
        at(assistant("msg_x", tool_use("a")), 5),
        at(results(tool_result("a", output("A", 2_000))), 300),
        at(assistant("msg_x", tool_use("b")), 5),  # a later fragment of the same response
        at(results(tool_result("b", output("B", 2_000))), 300),
    ]
    out = await one_pass(Microcompact(keep=0, **IDLE_ONLY), msgs, new_ctx(tmp_path))
    assert cleared_ids(out) == ids(0, 1, 2)
    assert check_pairing(to_api(out)) == []


@pytest.mark.asyncio
async def test_excluded_and_unknown_tools_are_never_touched(tmp_path: Path) -> None:
    names = ["Read", "Task", "Bash", "mcp__db__query", "Grep", "Bash", "Bash"]
    msgs = come_back(tool_turns(7, tool_name=lambda k: names[k]), after_minutes=120)
    stage = Microcompact(keep=1, exclude_tools=("Read", "Grep"), **IDLE_ONLY)
    out = await one_pass(stage, msgs, new_ctx(tmp_path))
    assert cleared_ids(out) == ids(2, 5)  # Bash only; Task and the MCP tool are not listed
    # exclude_tools wins over tools= too
    both = Microcompact(keep=0, tools=("Bash", "Read"), exclude_tools=("Read",), **IDLE_ONLY)
    assert cleared_ids(await one_pass(both, msgs, new_ctx(tmp_path, "s2"))) == ids(2, 5, 6)


@pytest.mark.asyncio
async def test_the_default_tool_list(tmp_path: Path) -> None:
    assert set(DEFAULT_COMPACTABLE_TOOLS) == {
        "Read", "Bash", "Grep", "Glob", "WebFetch", "WebSearch", "Edit", "Write",
        "MultiEdit", "NotebookEdit", "read_file", "bash",
    }  # fmt: skip
    names = [*DEFAULT_COMPACTABLE_TOOLS, "Task", "TodoWrite"]
    msgs = come_back(tool_turns(len(names), tool_name=lambda k: names[k]), after_minutes=61)
    out = await one_pass(Microcompact(keep=0), msgs, new_ctx(tmp_path))
    assert cleared_ids(out) == ids(*range(len(DEFAULT_COMPACTABLE_TOOLS)))


@pytest.mark.asyncio
async def test_persisted_empty_and_already_cleared_results_are_left_as_they_are(
    tmp_path: Path,
) -> None:
    persisted = (
        "<persisted-output>\nOutput too large (50KB). Full output saved to: /x\n</persisted-output>"
    )
    contents = [persisted, "", [], CLEARED_PLACEHOLDER, "ok", output("BIG", 500)]
    msgs = [at(user_text("go"), 0)]
    for k, content in enumerate(contents):
        msgs += [
            at(assistant(f"msg_{k}", tool_use(f"toolu_{k}")), k),
            at(results(tool_result(f"toolu_{k}", content)), k),
        ]
    msgs = come_back(msgs, after_minutes=120)
    out = await one_pass(Microcompact(keep=0), msgs, ctx := new_ctx(tmp_path))
    blocks = result_blocks(out)
    assert [blocks[t]["content"] for t in ids(0, 1, 2, 3, 4)] == contents[:5]
    assert blocks["toolu_5"]["content"] == CLEARED_PLACEHOLDER
    assert ctx.report.decisions["microcompact"].facts[ATTR.CLEARED] == 1


@pytest.mark.asyncio
async def test_the_placeholder_is_exact_and_other_block_fields_are_kept(tmp_path: Path) -> None:
    assert CLEARED_PLACEHOLDER == "[Old tool result content cleared]"
    msgs = [
        at(user_text("go"), 0),
        at(assistant("m0", tool_use("t0")), 0),
        at(
            results(
                tool_result(
                    "t0",
                    [{"type": "text", "text": output("X", 900)}],
                    is_error=True,
                    cache_control={"type": "ephemeral"},
                )
            ),
            0,
        ),
    ]
    msgs = come_back(msgs, after_minutes=61)
    out = await one_pass(Microcompact(keep=0), msgs, new_ctx(tmp_path))
    assert out[2].content == [
        {
            "type": "tool_result",
            "tool_use_id": "t0",
            "content": "[Old tool result content cleared]",
            "is_error": True,
            "cache_control": {"type": "ephemeral"},
        }
    ]
    assert result_blocks(msgs)["t0"]["content"] != CLEARED_PLACEHOLDER  # input not mutated


# --------------------------------------------------------------------------------------------
# References, pairing, state, resume
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_untouched_messages_pass_by_reference(tmp_path: Path) -> None:
    msgs = come_back(tool_turns(8), after_minutes=61)
    out = await one_pass(Microcompact(keep=5), msgs, new_ctx(tmp_path))
    changed = {i for i, (a, b) in enumerate(zip(msgs, out, strict=True)) if a is not b}
    assert changed == {2, 4, 6}  # the three cleared result records, nothing else
    assert check_pairing(to_api(out)) == []


@pytest.mark.asyncio
async def test_later_passes_reapply_byte_identically_and_free_nothing_new(
    tmp_path: Path, spans: SpanRecorder
) -> None:
    exporter, tracer = spans, spans.tracer
    stage = Microcompact(keep=3)
    ctx = new_ctx(tmp_path, tracer=tracer)
    msgs = come_back(tool_turns(8, usage=True), after_minutes=61)
    first = await one_pass(stage, msgs, ctx)
    assert cleared_ids(first) == ids(0, 1, 2, 3, 4)
    assert ctx.report.tokens_freed > 5 * 2_900

    freed_first = ctx.report.tokens_freed
    # the same call retried (no new response: the same usage anchor, which counted the
    # cleared results): re-applying frees them again against it
    assert await one_pass(stage, msgs, ctx) == first
    assert ctx.report.tokens_freed == freed_first

    # the conversation goes on quickly: a warm cache, small growth, a new usage anchor
    u = Usage(input_tokens=10, output_tokens=5)
    later = [*msgs, at(assistant("msg_n", tool_use("toolu_n"), usage=u), 62)]
    later.append(at(results(tool_result("toolu_n", output("N", 3_000))), 62.5))
    second = await one_pass(stage, later, ctx)
    assert ctx.report.tokens_freed == 0
    assert cleared_ids(second) == ids(0, 1, 2, 3, 4)
    sent_before = to_api(first)
    assert to_api(second)[: len(sent_before)] == sent_before  # the cached prefix is intact
    assert await one_pass(stage, later, ctx) == second  # idempotent
    d = decisions(exporter)
    assert [x[ATTR.DECISION] for x in d] == ["clear", "reapply", "reapply", "reapply"]
    assert d[2][ATTR.REASON] == Reason.BELOW_TRIGGER and d[2][ATTR.REAPPLIED] == 5
    assert len(ctx.records_for("microcompact")) == 1  # written only when the set grew


@pytest.mark.asyncio
async def test_tokens_freed_counts_only_what_the_last_usage_counted(tmp_path: Path) -> None:
    # no usage anywhere: the estimate is of the output itself, so nothing is "freed" from it
    msgs = come_back(tool_turns(8), after_minutes=61)
    ctx = new_ctx(tmp_path)
    out = await one_pass(Microcompact(), msgs, ctx)
    assert cleared_ids(out) and ctx.report.tokens_freed == 0
    # with usage: what was cleared before the last response is subtracted
    msgs = come_back(tool_turns(8, usage=True), after_minutes=61)
    ctx = new_ctx(tmp_path, "s2")
    out = await one_pass(Microcompact(), msgs, ctx)
    expected = sum(
        rough_tokens_for_messages([Message.user([result_blocks(msgs)[t]])])
        - rough_tokens_for_messages([Message.user([result_blocks(out)[t]])])
        for t in ids(0, 1, 2)
    )
    assert ctx.report.tokens_freed == expected


@pytest.mark.asyncio
async def test_sessions_sharing_a_stage_keep_their_own_decisions(tmp_path: Path) -> None:
    stage = Microcompact()
    cold = come_back(tool_turns(8), after_minutes=61)
    warm = come_back(tool_turns(8), after_minutes=1)
    a, b = new_ctx(tmp_path, "a"), new_ctx(tmp_path, "b")
    assert cleared_ids(await one_pass(stage, cold, a)) == ids(0, 1, 2)
    assert await one_pass(stage, warm, b) is warm
    assert b.records_for("microcompact") == []


@pytest.mark.asyncio
async def test_resume_through_a_real_transcript_repeats_the_decisions(tmp_path: Path) -> None:
    path = tmp_path / "s1.jsonl"
    stage = Microcompact(keep=2)
    msgs = come_back(tool_turns(6, usage=True), after_minutes=75)
    writer = TranscriptWriter(path, "s1")
    writer.append_messages(msgs)
    live = new_ctx(tmp_path, transcript=writer)
    live_out = await one_pass(stage, msgs, live)
    assert cleared_ids(live_out) == ids(0, 1, 2, 3)

    # the session goes on a minute later, then the process restarts
    more = [at(assistant("msg_6", tool_use("toolu_6")), 81)]
    more.append(at(results(tool_result("toolu_6", output("OUT6", 3_000))), 81.5))
    writer.append_messages(more)
    live_next = await one_pass(stage, [*msgs, *more], live)

    loaded = load_transcript(path)
    resumed = new_ctx(tmp_path, stage_records=loaded.stage_records)
    resumed_out = await one_pass(stage, loaded.messages, resumed)
    assert wire(resumed_out) == wire(live_next)
    assert cleared_ids(resumed_out) == ids(0, 1, 2, 3)
    # without the records the resumed session would send something else (the cache is warm)
    assert wire(await one_pass(stage, loaded.messages, new_ctx(tmp_path, "s9"))) != wire(live_next)


@pytest.mark.asyncio
async def test_resume_from_in_memory_records(tmp_path: Path) -> None:
    stage = Microcompact(keep=3)
    msgs = come_back(tool_turns(9), after_minutes=90)
    first = new_ctx(tmp_path)
    out = await one_pass(stage, msgs, first)
    warm = [*msgs, at(assistant("msg_z", {"type": "text", "text": "ok"}), 99)]
    warm.append(at(user_text("thanks"), 100))
    resumed = new_ctx(tmp_path, stage_records=first.stage_records)
    again = await one_pass(stage, warm, resumed)
    sent = to_api(out)
    assert to_api(again)[: len(sent)] == sent  # the prefix the live session cached
    assert cleared_ids(again) == cleared_ids(out) == ids(*range(6))
    assert resumed.report.decisions["microcompact"].decision == "reapply"


@pytest.mark.asyncio
async def test_recorded_text_is_reused_verbatim_and_bad_records_do_not_crash(
    tmp_path: Path,
) -> None:
    msgs = tool_turns(6)  # no gap: nothing new would be cleared
    records: list[tuple[str, dict[str, Any]]] = [
        (
            "microcompact",
            {"strategy": "clear-oldest", "placeholder": "[old]", "cleared": ["toolu_0"]},
        ),
        ("microcompact", {"cleared": ["toolu_1"]}),  # no placeholder: the constant
        ("microcompact", {"cleared": "toolu_2"}),  # damaged
        ("microcompact", {"strategy": "something-else", "cleared": ["toolu_3"]}),
        ("history_snip", {"cleared": ["toolu_4"]}),
    ]
    ctx = new_ctx(tmp_path, stage_records=[StageRecord(s, d) for s, d in records])
    out = await one_pass(Microcompact(**IDLE_ONLY), msgs, ctx)
    blocks = result_blocks(out)
    assert blocks["toolu_0"]["content"] == "[old]"
    assert blocks["toolu_1"]["content"] == CLEARED_PLACEHOLDER
    assert [blocks[t]["content"][:4] for t in ids(2, 3, 4)] == ["OUT2", "OUT3", "OUT4"]


@pytest.mark.asyncio
async def test_exclude_tools_wins_over_an_earlier_decision(tmp_path: Path) -> None:
    msgs = tool_turns(4, tool_name="Read")
    ctx = new_ctx(tmp_path, stage_records=[StageRecord("microcompact", {"cleared": ["toolu_0"]})])
    assert await one_pass(Microcompact(exclude_tools=("Read",)), msgs, ctx) is msgs


@pytest.mark.asyncio
async def test_results_before_a_compact_boundary_are_not_counted(tmp_path: Path) -> None:
    old = tool_turns(10)
    boundary = Message(type="system", subtype="compact_boundary", content="")
    summary = Message.user("Summary of the work so far.", is_compact_summary=True)
    msgs = come_back([*old, boundary, summary, *tool_turns(3, start=20, first=10)[1:]], 120)
    ctx = new_ctx(tmp_path)
    out = await one_pass(Microcompact(keep=1), msgs, ctx)
    assert cleared_ids(out) == ids(10, 11)  # only results sent after the boundary count
    assert out[: len(old)] == old


# --------------------------------------------------------------------------------------------
# Spans
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_one_decision_span_per_pass_without_content(
    tmp_path: Path, spans: SpanRecorder
) -> None:
    exporter, tracer = spans, spans.tracer
    stage = Microcompact(keep=2)
    ctx = new_ctx(tmp_path, tracer=tracer)
    pipe = Pipeline([stage])
    msgs = come_back(tool_turns(5), after_minutes=61)
    await pipe.run(msgs, ctx)
    await pipe.run(msgs, ctx)
    await pipe.run(
        come_back(tool_turns(2), after_minutes=1), new_ctx(tmp_path, "s2", tracer=tracer)
    )
    found = decisions(exporter)
    assert [(d[ATTR.DECISION], d[ATTR.REASON]) for d in found] == [
        ("clear", Reason.IDLE_GAP),
        ("reapply", Reason.NOTHING_ELIGIBLE),  # still a gap, but all old results are cleared
        ("skip", Reason.BELOW_TRIGGER),
    ]
    first = found[0]
    assert first[ATTR.CONVERSATION_ID] == "s1"
    assert first[ATTR.STAGE] == "microcompact"
    assert first[ATTR.CLEARED] == 3 and first[ATTR.KEPT] == 2
    assert first[ATTR.TRIGGER] == "idle_gap"
    assert first[ATTR.CACHE_REWRITE_TOKENS] > 0
    for span in exporter.get_finished_spans():
        for value in (span.attributes or {}).values():
            text = str(value)
            assert "OUT" not in text and "line of build output" not in text
            assert "Fix the build" not in text and CLEARED_PLACEHOLDER not in text
    # the decision span is a child of the stage span
    stage_spans = [s for s in exporter.get_finished_spans() if s.name == "stage.microcompact"]
    child = exporter.decisions("microcompact")[0]
    assert child.parent is not None and child.parent.span_id == stage_spans[0].context.span_id


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def test_strategies_and_names() -> None:
    assert (Microcompact.name, Microcompact.strategy) == ("microcompact", "clear-oldest")
    assert (ServerSideMicrocompact.name, ServerSideMicrocompact.strategy) == (
        "microcompact",
        "server-clear",
    )
    assert Microcompact.may_break_cache is True
    assert ServerSideMicrocompact.may_break_cache is False
    default = next(s for s in default_stages() if s.name == "microcompact")
    assert isinstance(default, Microcompact)
    assert (default.keep, default.idle_minutes, default.min_reclaim_tokens) == (5, 60.0, 20_000)
    assert default.trigger_tokens >= 100_000  # high: only to spare an autocompact
    assert "keep=5" in repr(default)


def test_config_string_values_are_accepted() -> None:
    """What ``SLOT=STRATEGY:key=value`` strings parse to: ints, floats, bools, a lone name or
    an ``a+b`` tuple."""
    stage = Microcompact(keep=3, idle_minutes=30, trigger_tokens=120000, exclude_tools="Read")
    assert (stage.keep, stage.idle_minutes, stage.exclude_tools) == (3, 30.0, ("Read",))
    assert Microcompact(tools=("Bash", "Grep", "Bash")).tools == ("Bash", "Grep")
    server = ServerSideMicrocompact(exclude_tools="memory", clear_tool_inputs=True)
    assert server.edit()["exclude_tools"] == ["memory"]
    assert server.edit()["clear_tool_inputs"] is True


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"keep": -1}, "keep"),
        ({"keep": 2.5}, "keep"),
        ({"keep": True}, "keep"),
        ({"idle_minutes": -5}, "idle_minutes"),
        ({"idle_minutes": float("nan")}, "idle_minutes"),
        ({"idle_minutes": "60"}, "idle_minutes"),
        ({"trigger_tokens": -1}, "trigger_tokens"),
        ({"min_reclaim_tokens": 1.5}, "min_reclaim_tokens"),
        ({"tools": ()}, "tools"),
        ({"tools": ("Read", "")}, "tools"),
        ({"tools": 3}, "tools"),
        ({"exclude_tools": (3,)}, "exclude_tools"),
        ({"idle_minutes": 0, "trigger_tokens": 0}, "idle_minutes and trigger_tokens"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], bad: str) -> None:
    with pytest.raises(ValueError, match=f"^{bad}"):
        Microcompact(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"trigger_tokens": 0}, "trigger_tokens"),
        ({"keep": -1}, "keep"),
        ({"clear_at_least": -1}, "clear_at_least"),
        ({"exclude_tools": ("",)}, "exclude_tools"),
        ({"clear_tool_inputs": "yes"}, "clear_tool_inputs"),
    ],
)
def test_server_side_bad_arguments_name_the_argument(kwargs: dict[str, Any], bad: str) -> None:
    with pytest.raises(ValueError, match=f"^{bad}"):
        ServerSideMicrocompact(**kwargs)


# --------------------------------------------------------------------------------------------
# Server-side strategy
# --------------------------------------------------------------------------------------------


def _assert_matches_sdk_types(config: Mapping[str, Any]) -> None:
    """Validate against the SDK's own TypedDicts, and reject keys they do not declare (a
    TypedDict validator ignores unknown keys, which would hide a misspelt field)."""
    TypeAdapter(BetaContextManagementConfigParam).validate_python(config)
    assert set(config) <= set(BetaContextManagementConfigParam.__annotations__)
    for edit in config["edits"]:
        TypeAdapter(BetaClearToolUses20250919EditParam).validate_python(edit, strict=True)
        assert set(edit) <= set(BetaClearToolUses20250919EditParam.__annotations__)
        for key, typed in (
            ("trigger", BetaInputTokensTriggerParam),
            ("keep", BetaToolUsesKeepParam),
            ("clear_at_least", BetaInputTokensClearAtLeastParam),
        ):
            if key in edit:
                TypeAdapter(typed).validate_python(edit[key], strict=True)
                assert set(edit[key]) == set(typed.__annotations__)


def test_the_sdk_knows_the_beta() -> None:
    literal = next(a for a in typing.get_args(AnthropicBetaParam) if a is not str)
    assert CONTEXT_MANAGEMENT_BETA in typing.get_args(literal)


@pytest.mark.asyncio
async def test_server_side_puts_the_edit_in_the_request_and_edits_nothing(
    tmp_path: Path, spans: SpanRecorder
) -> None:
    exporter, tracer = spans, spans.tracer
    stage = ServerSideMicrocompact(
        trigger_tokens=80_000, keep=4, clear_at_least=15_000, exclude_tools=("memory",)
    )
    msgs = come_back(tool_turns(8), after_minutes=600)
    ctx = new_ctx(tmp_path, tracer=tracer)
    assert await one_pass(stage, msgs, ctx) is msgs
    config = ctx.report.request_extras["context_management"]
    assert config == {
        "edits": [
            {
                "type": "clear_tool_uses_20250919",
                "trigger": {"type": "input_tokens", "value": 80_000},
                "keep": {"type": "tool_uses", "value": 4},
                "clear_at_least": {"type": "input_tokens", "value": 15_000},
                "exclude_tools": ["memory"],
                "clear_tool_inputs": False,
            }
        ]
    }
    _assert_matches_sdk_types(config)
    assert ctx.report.betas == [CONTEXT_MANAGEMENT_BETA]
    await one_pass(stage, msgs, ctx)
    assert ctx.report.betas == [CONTEXT_MANAGEMENT_BETA]  # once per pass
    d1, _ = decisions(exporter)
    assert (d1[ATTR.DECISION], d1[ATTR.REASON]) == ("delegate", Reason.DELEGATED)
    assert d1[ATTR.CLEARED] == 0 and d1[ATTR.OVER_TRIGGER] is False


@pytest.mark.asyncio
async def test_server_side_defaults_and_merging_with_other_edits(tmp_path: Path) -> None:
    ctx = new_ctx(tmp_path)
    ctx.begin_pass()
    thinking = {"type": "clear_thinking_20251015", "keep": "all"}
    ctx.report.request_extras["context_management"] = {
        "edits": [thinking, {"type": "clear_tool_uses_20250919"}]
    }
    await ServerSideMicrocompact(clear_at_least=0)([], ctx)
    config = ctx.report.request_extras["context_management"]
    assert config["edits"][0] == thinking
    assert config["edits"][1:] == [
        {
            "type": "clear_tool_uses_20250919",
            "trigger": {"type": "input_tokens", "value": 100_000},
            "keep": {"type": "tool_uses", "value": 5},
            "clear_tool_inputs": False,
        }
    ]
    TypeAdapter(BetaContextManagementConfigParam).validate_python(config)
    _assert_matches_sdk_types({"edits": config["edits"][1:]})


@tool(input_schema={"type": "object", "properties": {}})
async def read_logs() -> str:
    """Return a long log."""
    return output("LOG", 2_000)


@pytest.fixture
def scripted_server() -> Iterator[ScriptedMessagesServer]:
    def script(body: dict[str, Any]) -> Reply | ScriptError:
        if sum(1 for m in body["messages"] if m["role"] == "assistant") == 0:
            call = {"type": "tool_use", "id": "toolu_1", "name": "read_logs", "input": {}}
            return Reply([call], stop_reason="tool_use")
        return Reply([{"type": "text", "text": "done"}])

    with ScriptedMessagesServer(script) as server:
        yield server


@pytest.mark.asyncio
async def test_server_side_config_goes_over_the_wire_with_the_beta_header(
    tmp_path: Path, scripted_server: ScriptedMessagesServer
) -> None:
    headers: list[Mapping[str, str]] = []

    async def capture(request: Any) -> None:  # the SDK's own HTTP client type
        headers.append(dict(request.headers))

    http = anthropic.DefaultAsyncHttpxClient(event_hooks={"request": [capture]})
    client = sdk_client(scripted_server.base_url, http_client=http)
    stage = ServerSideMicrocompact(trigger_tokens=50_000, keep=2)
    agent = Agent(
        client,
        model="claude-test",
        pipeline=Pipeline(default_stages()).replace("microcompact", stage),
        ctx=new_ctx(tmp_path),
        tools=[read_logs],
    )
    result = await agent.run("Read the logs.")
    await http.aclose()
    assert result.text == "done"
    assert len(scripted_server.requests) == 2
    for body, sent in zip(scripted_server.requests, headers, strict=True):
        assert body["context_management"] == {"edits": [stage.edit()]}
        _assert_matches_sdk_types(body["context_management"])
        assert CONTEXT_MANAGEMENT_BETA in sent["anthropic-beta"].split(",")


# --------------------------------------------------------------------------------------------
# Property: pairing preserved, idempotent, newest turn and excluded tools untouched
# --------------------------------------------------------------------------------------------

CONTENTS = st.one_of(
    st.just(""),
    st.just(
        "<persisted-output>\nOutput too large (1KB). Full output saved to: /p\n</persisted-output>"
    ),
    st.just("<persisted-output>" + "x" * 7_000),  # not a replacement: ordinary output
    st.just(CLEARED_PLACEHOLDER),
    st.text(max_size=60),
    st.integers(0, 6_000).map(lambda n: "r" * n),
    st.integers(0, 3_000).map(lambda n: [{"type": "text", "text": "b" * n}]),
)


@st.composite
def histories(draw: st.DrawFn) -> list[Message]:
    msgs = [at(user_text("go"), 0)]
    clock = 0.0
    for k in range(draw(st.integers(1, 7))):
        names = draw(
            st.lists(st.sampled_from(["Bash", "Read", "Grep", "Task"]), min_size=1, max_size=3)
        )
        uses = [tool_use(f"t{k}_{j}", n) for j, n in enumerate(names)]
        clock += draw(st.floats(0, 90))
        msgs.append(at(assistant(f"m{k}", *uses), clock))
        blocks = [tool_result(u["id"], draw(CONTENTS)) for u in uses]
        if draw(st.booleans()):
            msgs += [at(results(b), clock + 0.5) for b in blocks]
        else:
            msgs.append(at(results(*blocks), clock + 0.5))
        if draw(st.booleans()):
            msgs.append(at(user_text("and?"), clock + draw(st.floats(0, 120))))
    return msgs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    msgs=histories(),
    keep=st.integers(0, 4),
    trigger=st.sampled_from([1, 2_000]),
    floor=st.sampled_from([0, 500]),
)
def test_property_pairing_idempotence_and_untouchables(
    msgs: list[Message], keep: int, trigger: int, floor: int
) -> None:
    stage = Microcompact(
        keep=keep, trigger_tokens=trigger, min_reclaim_tokens=floor, exclude_tools=("Grep",)
    )
    assert check_pairing(to_api(msgs)) == []

    async def run() -> None:
        ctx = SessionContext("prop", Path("/nonexistent"))  # microcompact never writes files
        out = await one_pass(stage, msgs, ctx)
        assert check_pairing(to_api(out)) == []
        assert await one_pass(stage, msgs, ctx) == out  # same input, same state: same output
        again = await one_pass(stage, out, ctx)
        assert again is out  # its own output needs nothing more

        before, after = result_blocks(msgs), result_blocks(out)
        last_response = max(i for i, m in enumerate(msgs) if m.type == "assistant")
        newest = set(result_blocks(msgs[last_response:]))
        names = {
            b["id"]: b["name"]
            for m in msgs
            if m.type == "assistant"
            for b in m.content
            if isinstance(b, dict) and b.get("type") == "tool_use"
        }
        for tid, b in after.items():
            if b["content"] != before[tid]["content"]:
                assert b["content"] == CLEARED_PLACEHOLDER
                assert tid not in newest
                assert names[tid] in ("Bash", "Read")
                original = before[tid]["content"]
                assert not is_replacement_text(original)

    anyio.run(run)


def test_a_pass_that_does_not_clear_never_measures_what_it_folds_in(tmp_path: Path) -> None:
    """A pass that does not clear folds newly settled records into the index; a record it
    cannot measure (a tool input that refers to itself) leaves the index for a pass that
    reads the history, rather than failing a pass that never needed its size."""
    loop: dict[str, Any] = {"a": 1}
    loop["self"] = loop
    ctx = SessionContext("s", tmp_path, token_tracker=TokenTracker("reference"))
    pipe = Pipeline([Microcompact(idle_minutes=60, trigger_tokens=0)])
    first = [
        at(user_text("start"), 0),
        at(assistant("m0", {"type": "text", "text": "r0"}, usage=Usage(10, 5)), 60),
        at(user_text("two hours later"), 180),
    ]
    later = [
        at(assistant("m1", {"type": "tool_use", "id": "t1", "name": "Read", "input": loop}), 181),
        at(results(tool_result("t1", "ok")), 181),
        at(assistant("m2", {"type": "text", "text": "r2"}, usage=Usage(50, 5)), 182),
        at(user_text("soon after"), 183),
    ]
    for history in (first, first + later):
        out = anyio.run(pipe.run, history, ctx)
        assert out == history  # nothing cleared, nothing raised
    assert ctx.report.decisions["microcompact"].reason is Reason.CACHE_WARM  # a quiet pass
