"""What a replay feeds the pipeline as usage, and what the pipeline reports as its size.

A replay takes each response's usage as recorded, less the tokens the pipeline has removed so
far (``CallResult.removed_tokens``), so that size-triggered stages see about the size a live
session would have had -- instead of the unmanaged size on every call. ``Pipeline.run``'s
``estimated_tokens`` subtracts what stages freed from the anchored usage, unless a stage
replaced that response (a summary).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
from anthropic.types import MessageParam

from pipeline import Message, Pipeline, SessionContext, TokenTracker, Usage
from pipeline.testing import MemoryStore, QuietLogger
from pipeline.tracing import ATTR
from pipeline.transcript.replay import less_usage, replay_messages
from stages import HistorySnip
from stages.autocompact import Autocompact
from tests.builders import assistant, results, tool_result, tool_use, user_text


def _ctx() -> SessionContext:
    return SessionContext(
        "replay-usage",
        "/nonexistent-root",
        store=MemoryStore(frozenset()),
        token_tracker=TokenTracker("reference"),
        logger=QuietLogger(),
    )


def _session(turns: int, *, without_usage: int = -1) -> list[Message]:
    history: list[Message] = [user_text("start")]
    for t in range(turns):
        usage = None if t == without_usage else Usage(input_tokens=1_000 + 2_300 * t)
        history += [
            assistant(f"r{t}", tool_use(f"t{t}", "Read"), usage=usage),
            results(tool_result(f"t{t}", "x" * 8_000)),
        ]
    return history


def test_less_usage_takes_cache_reads_first_and_never_goes_below_zero() -> None:
    usage = Usage(input_tokens=10, cache_creation_input_tokens=100, cache_read_input_tokens=1_000)
    assert less_usage(usage, 500) == Usage(10, 0, 100, 500)
    assert less_usage(usage, 1_050) == Usage(10, 0, 50, 0)
    assert less_usage(usage, 5_000) == Usage(0, 0, 0, 0)
    assert less_usage(usage, 0) == usage


@pytest.mark.asyncio
async def test_a_replay_snips_once_then_sees_the_managed_size() -> None:
    """Recorded usage grows by 2,300 a call; once history snip has removed rounds, later calls
    are replayed with the usage less what it removed, so it does not fire again every call."""
    pipe = Pipeline([HistorySnip(context_window=25_000, keep_recent_rounds=2)])
    snips, removed = [], []
    async for r in replay_messages(_session(12), pipe, _ctx()):
        snips.append(r.estimated_tokens)
        removed.append(r.removed_tokens)
    assert removed[0] == 0 and max(removed) > 0
    first = next(i for i, x in enumerate(removed) if x)
    assert removed[first:] == sorted(removed[first:])  # never taken back
    assert all(s < 20_000 for s in snips[first:])  # below the trigger once managed


@pytest.mark.asyncio
async def test_a_removal_is_counted_once_while_the_anchor_stays() -> None:
    """A recorded response without usage keeps the anchor of the call before it: the next pass
    frees the same removal again against that anchor, which must not count it twice."""
    pipe = Pipeline([HistorySnip(context_window=25_000, keep_recent_rounds=2)])
    ctx = _ctx()
    seen = []
    async for r in replay_messages(_session(12, without_usage=9), pipe, ctx):
        seen.append(
            (r.removed_tokens, ctx.report.decisions["history_snip"].facts[ATTR.REMOVED_NEW])
        )
    totals = [total for total, _ in seen]
    new_removals = [i for i, (_, new) in enumerate(seen) if new]
    for i in range(1, len(seen)):
        if i not in new_removals:
            assert totals[i] == totals[i - 1], seen  # nothing new removed: the same total


class Summary:
    async def summarize(self, messages: Sequence[MessageParam]) -> str:
        return "summary " + "y" * 4_000


@pytest.mark.asyncio
async def test_the_size_after_a_summary_does_not_subtract_what_was_freed_before_it() -> None:
    history = _session(30)
    history += [
        assistant("rlast", {"type": "text", "text": "done"}, usage=Usage(input_tokens=70_000)),
        user_text("next request"),
    ]
    ctx = _ctx()
    pipe = Pipeline(
        [
            HistorySnip(context_window=80_000, keep_recent_rounds=2),
            Autocompact(
                Summary(),
                context_window=45_000,
                max_output_tokens=0,
                buffer_tokens=3_000,
                block=False,
            ),
        ]
    )
    out = await pipe.run(history, ctx)
    assert ctx.report.tokens_freed > 0  # history snip freed anchored tokens first
    assert any(m.is_compact_boundary for m in out)  # then the summary replaced the anchor
    assert ctx.report.estimated_tokens == ctx.token_tracker.estimate(out) > 0


@pytest.mark.anyio
async def test_a_shared_replay_sends_what_a_copying_one_sends(tmp_path: Path) -> None:
    """``shared=True`` (the CLI's way) hands out one list brought up to date call by call: read
    before the next call, each request is byte for byte the one a copying replay returns, with
    the default stages acting (persisting, snipping and clearing) along the way."""
    from pipeline.transcript.read import load_transcript
    from stages import Microcompact, ToolResultBudget
    from tests.benchmarks.long_session import write

    def stages() -> Pipeline:  # small limits: each of them acts within 120 calls
        return Pipeline(
            [
                ToolResultBudget(limit=40_000),
                HistorySnip(context_window=30_000),
                Microcompact(idle_minutes=0, trigger_tokens=21_000),
            ]
        )

    path = tmp_path / "s.jsonl"
    write(path, 120)
    messages = load_transcript(path).messages
    copied = [r.request async for r in replay_messages(messages, stages(), _ctx())]
    shared: list[str] = []
    lists = set()
    acted: set[tuple[str, str]] = set()
    ctx = _ctx()
    async for r in replay_messages(messages, stages(), ctx, shared=True):
        shared.append(json.dumps(r.request))
        lists.add(id(r.request))
        acted |= {(name, str(made.decision)) for name, made in ctx.report.decisions.items()}
        acted |= {("tool_result_budget", "persist")} if r.persisted else set()
    assert shared == [json.dumps(r) for r in copied]
    assert len(lists) == 1 and len(copied) == 120
    assert {
        ("tool_result_budget", "persist"),
        ("history_snip", "snip"),
        ("microcompact", "clear"),
    } <= acted


@pytest.mark.asyncio
async def test_a_long_replay_lets_other_tasks_run() -> None:
    """A pass takes no trip through the event loop; a replay gives other tasks (and the
    cancellation Ctrl-C becomes) a turn every few tens of milliseconds."""
    ticks: list[float] = []
    done = False

    async def other_task() -> None:
        while not done:
            ticks.append(time.monotonic())
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_task)
        await anyio.sleep(0)  # it has run once
        start = time.monotonic()
        calls = 0
        async for _ in replay_messages(_session(3_000), Pipeline([]), _ctx()):
            calls += 1
        took = time.monotonic() - start
        done = True
    during = [t for t in ticks if t > start]
    assert calls == 3_000
    if took > 0.1:  # a replay long enough to owe other tasks a turn (a few on a slow machine)
        assert len(during) >= 2, (took, len(during))
