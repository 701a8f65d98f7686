"""Where the API's view of a history starts: ``ThreadStart`` (incremental) against a
from-scratch reference, and what ``Pipeline.run`` does with it (stages see only the records
from the last restart record on: a compact boundary, or a compact summary)."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from pipeline import (
    Message,
    Pipeline,
    SessionContext,
    TokenTracker,
    ToolPolicies,
    Usage,
    to_api,
)
from pipeline.incremental import ThreadStart
from pipeline.kept_list import KeptList
from pipeline.messages import REMINDER, thread_start
from pipeline.testing import MemoryStore, QuietLogger
from pipeline.wire.cache import WireCache
from stages import ToolResultBudget, default_stages
from tests.builders import assistant, ids, results, tool_result, tool_use, user_text

# --------------------------------------------------------------------------------------------
# (a) ThreadStart against the reference
# --------------------------------------------------------------------------------------------


def reference_start(messages: Sequence[Message]) -> int:
    """Index of the last record that restarts the thread, else 0 (the boundary kept, also
    when its summary follows it)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].restarts_thread:
            if i and not messages[i].is_compact_boundary and messages[i - 1].is_compact_boundary:
                return i - 1
            return i
    return 0


def boundary() -> Message:
    return Message("system", "Conversation compacted", subtype="compact_boundary")


def summary() -> Message:
    return Message.user("summary", is_compact_summary=True)


def _plain(rng: random.Random) -> Message:
    """A record that never restarts the thread (some of them look close to one)."""
    kind = rng.randrange(11)
    if kind == 0:
        return user_text("prompt")
    if kind == 1:
        return assistant(f"m{rng.randrange(5)}", tool_use(f"t{rng.randrange(9)}"))
    if kind == 2:
        return results(tool_result(f"t{rng.randrange(9)}", "out"))
    if kind == 3:
        return Message(type="progress")
    if kind == 4:
        return Message(type="system", subtype="informational", content="hook")
    if kind == 5:
        return Message(type="system", subtype="local_command", content="ls")
    if kind == 6:
        return Message(type="attachment", content=[{"type": "text", "text": "ctx"}])
    if kind == 7:
        return Message(type="attachment", content=[{"type": "text", "text": "r"}], subtype=REMINDER)
    if kind == 8:  # only a user record can be a compact summary
        return Message.assistant("not a summary", is_compact_summary=True)
    if kind == 9:
        return Message(type="attachment", content="x", is_compact_summary=True)
    return Message(type="system", subtype="compact_boundary_not", content="")


def _record(rng: random.Random) -> Message:
    roll = rng.random()
    if roll < 0.08:
        return boundary()
    if roll < 0.14:
        return summary()
    return _plain(rng)


def _step(rng: random.Random, history: list[Message]) -> tuple[str, list[Message]]:
    """One caller edit: the op's name and the history to call with (often the same list,
    edited in place)."""
    n = len(history)
    op = rng.choice(
        ["append"] * 5
        + ["truncate", "replace", "to_restart", "drop_last_restart", "unrestart_last"]
        + ["insert", "delete", "equal_copy", "new_list", "same", "swap"]
    )
    restarts = [i for i, m in enumerate(history) if m.restarts_thread]
    if op == "append" or not n:
        history.extend(_record(rng) for _ in range(rng.randint(1, 4)))
    elif op == "truncate":
        del history[rng.randint(0, n) :]
    elif op == "replace":
        history[rng.randrange(n)] = _record(rng)
    elif op == "to_restart":  # an earlier record turned into a boundary (or a summary)
        history[rng.randrange(n)] = boundary() if rng.random() < 0.6 else summary()
    elif op == "drop_last_restart" and restarts:
        del history[restarts[-1]]
    elif op == "unrestart_last" and restarts:  # the last restart record replaced by another
        history[restarts[-1]] = _plain(rng)
    elif op == "insert":
        history.insert(rng.randint(0, n), _record(rng))
    elif op == "delete":
        del history[rng.randrange(n)]
    elif op == "equal_copy":
        i = rng.randrange(n)
        history[i] = dataclasses.replace(history[i])
    elif op == "new_list":
        history = list(history)
    elif op == "swap":
        i, j = rng.randrange(n), rng.randrange(n)
        history[i], history[j] = history[j], history[i]
    return op, history


@pytest.mark.parametrize("seed", range(6))
def test_thread_start_equals_the_reference_over_edits(seed: int) -> None:
    rng = random.Random(seed)
    ops: set[str] = set()
    up = down = 0
    for run in range(60):
        start = ThreadStart()
        history: list[Message] = KeptList() if run % 2 else []
        previous = 0
        for step in range(rng.randint(5, 60)):
            op, history = _step(rng, history)
            ops.add(op)
            # now and then the same records as another kind of sequence
            given: Sequence[Message] = tuple(history) if rng.random() < 0.05 else history
            got = start(given)
            want = reference_start(history)
            assert got == want, (seed, run, step, op)
            # the part after the start, kept in one list (empty when the start is 0)
            assert start.tail == (history[want:] if want else []), (seed, run, step, op)
            # the module function agrees: it points after a boundary, at a summary
            after = want + 1 if history and history[want].is_compact_boundary else want
            assert thread_start(history) == after
            up += got > previous
            down += got < previous
            previous = got
            if rng.random() < 0.1:  # the very same call again
                assert start(given) == want
    assert {"to_restart", "drop_last_restart", "unrestart_last", "truncate"} <= ops
    assert up > 50 and down > 50  # the start moved often, both ways


def test_thread_start_small_cases() -> None:
    start = ThreadStart()
    b1, s1, b2 = boundary(), summary(), boundary()
    history = [user_text("a"), b1, s1, user_text("b")]
    assert start(history) == 1  # the boundary, kept before its summary
    history.append(b2)
    assert start(history) == 4
    history.append(user_text("c"))
    assert start(history) == 4
    del history[4]  # the last boundary removed
    assert start(history) == 1
    history[2] = user_text("no longer a summary")
    assert start(history) == 1
    history[1] = user_text("nor a boundary")
    assert start(history) == 0
    history[1] = b1
    history[0] = boundary()  # before the known start
    assert start(history) == 1
    history[1] = user_text("plain")
    assert start(history) == 0
    del history[:]
    assert start(history) == 0


# --------------------------------------------------------------------------------------------
# (b, c) the stages see what the API sees
# --------------------------------------------------------------------------------------------

BIG = 60_000  # over the 50K per-tool cap of ToolPolicies.claude_code()


def _ctx(store: MemoryStore | None = None, sid: str = "thread-start") -> SessionContext:
    return SessionContext(
        sid,
        "/nonexistent-root",  # the memory store never touches it
        store=store if store is not None else MemoryStore(),
        tool_policies=ToolPolicies.claude_code(),
        logger=QuietLogger(),
    )


def _before_compaction() -> list[Message]:
    usage = Usage(input_tokens=1_000, output_tokens=50)
    return [
        user_text("look at the logs"),
        assistant("m1", tool_use("a", "Other"), usage=usage),
        results(tool_result("a", "x" * BIG)),
    ]


LAYOUTS = {
    "boundary_summary": lambda: [boundary(), summary()],  # Claude Code 2.x
    "boundary": lambda: [boundary()],
    "summary": lambda: [summary()],  # Claude Code 1.x
}


@pytest.mark.asyncio
async def test_budget_persists_a_large_result_without_a_compaction() -> None:
    """The control: without the boundary the same result is persisted."""
    history = [*_before_compaction(), user_text("go on")]
    store = MemoryStore()
    ctx = _ctx(store)
    out = await Pipeline([ToolResultBudget()]).run(history, ctx)
    assert [p.tool_use_id for p in ctx.report.persisted] == ["a"]
    assert list(store.files) == ["/mem/a.txt"]
    assert out[2].content[0]["content"].startswith("<persisted-output>")  # type: ignore[index]
    detail = TokenTracker().estimate_detail(out)
    assert detail.has_anchor and not detail.crossed_compaction


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_budget_ignores_a_large_result_before_a_compaction(layout: str) -> None:
    restart = LAYOUTS[layout]()
    history = [*_before_compaction(), *restart, user_text("go on")]
    store = MemoryStore()
    ctx = _ctx(store)
    out = await Pipeline([ToolResultBudget()]).run(history, ctx)
    assert ctx.report.persisted == []
    assert store.files == {}
    assert "a" not in ids(ctx.replacement_state.seen_ids)
    # the stages got (and returned) the tail from the last restart record on
    cut = reference_start(history)
    assert out[0] is history[cut] and out[0].restarts_thread
    assert len(out) == len(history) - cut
    assert all(o is h for o, h in zip(out, history[cut:], strict=True))
    assert to_api(out) == to_api(history)
    # (c) the estimate of the cut list: no anchor (the usage lies before the cut), and it
    # knows a compaction happened
    detail = TokenTracker().estimate_detail(out)
    assert detail.crossed_compaction is True
    assert detail.has_anchor is False


@pytest.mark.asyncio
async def test_the_stages_see_the_boundary_before_its_summary() -> None:
    history = [*_before_compaction(), boundary(), summary(), user_text("go on")]
    out = await Pipeline([ToolResultBudget()]).run(history, _ctx())
    assert out[0] is history[3] and out[0].is_compact_boundary


# --------------------------------------------------------------------------------------------
# (d) a growing session equals a fresh context on every call
# --------------------------------------------------------------------------------------------


def _reminder(text: str) -> Message:
    return Message(type="attachment", content=[{"type": "text", "text": text}], subtype=REMINDER)


def _two_compactions() -> list[Message]:
    def usage(n: int) -> Usage:
        return Usage(input_tokens=n, output_tokens=40)

    return [
        user_text("start"),
        assistant("m1", tool_use("a", "Other"), usage=usage(1_000)),
        results(tool_result("a", "a" * 60_000)),
        _reminder("<system-reminder>todo</system-reminder>"),
        assistant("m2", tool_use("b", "Bash"), usage=usage(16_000)),
        results(tool_result("b", "b" * 500)),
        assistant("m3", {"type": "text", "text": "done"}, usage=usage(16_200)),
        user_text("go on"),
        boundary(),
        summary(),
        user_text("continue"),
        assistant("m4", tool_use("c", "Grep"), usage=usage(2_000)),
        results(tool_result("c", "c" * 25_000)),
        assistant("m5", tool_use("d", "Other"), tool_use("e", "Bash"), usage=usage(9_000)),
        Message(type="progress"),
        results(tool_result("e", "e" * 10_000)),
        results(tool_result("d", "d" * 55_000)),
        _reminder("<system-reminder>files changed</system-reminder>"),
        assistant("m6", {"type": "text", "text": "fixed"}, usage=usage(12_000)),
        user_text("now the tests"),
        assistant("m7", tool_use("f", "Bash"), usage=usage(12_500)),
        results(tool_result("f", "f" * 31_000)),
        boundary(),
        summary(),
        user_text("again"),
        assistant("m8", tool_use("g", "Other"), usage=usage(2_500)),
        results(tool_result("g", "g" * 70_000)),
        _reminder("<system-reminder>late</system-reminder>"),
        assistant("m9", {"type": "text", "text": "bye"}, usage=usage(20_000)),
        user_text("thanks"),
    ]


def _budget() -> list[Any]:
    return [ToolResultBudget()]


@pytest.mark.asyncio
@pytest.mark.parametrize("grow", ["in_place", "kept", "new_list"])
@pytest.mark.parametrize("stages", [_budget, default_stages], ids=["budget", "default"])
async def test_a_growing_session_equals_a_fresh_context_each_call(
    grow: str, stages: Callable[[], list[Any]]
) -> None:
    history = _two_compactions()
    pipeline = Pipeline(stages())
    ctx = _ctx()
    view: list[Message] = KeptList() if grow == "kept" else []
    starts = []
    for k in range(1, len(history) + 1):
        if grow in ("in_place", "kept"):
            view.append(history[k - 1])
        else:
            view = history[:k]
        out = await pipeline.run(view, ctx)
        fresh_ctx = _ctx(sid=f"fresh-{k}")
        fresh = await Pipeline(stages()).run(history[:k], fresh_ctx)
        assert json.dumps(to_api(out)) == json.dumps(to_api(fresh)), k
        assert len(out) == len(fresh), k
        start = reference_start(history[:k])
        assert out[0] is history[start], k
        starts.append(start)
    assert sorted(set(starts)) == [0, 8, 22]  # each boundary (its summary follows it)
    # the large results of every segment were persisted along the way
    persisted = [
        b["tool_use_id"]
        for m in out
        if m.type == "user" and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result" and str(b.get("content")).startswith("<persisted")
    ]
    assert persisted == ["g"]
    assert {"a", "d", "g"} <= ids(ctx.replacement_state.replacements)


# --------------------------------------------------------------------------------------------
# WireCache after the last restart record goes
# --------------------------------------------------------------------------------------------


def test_wire_cache_after_the_last_boundary_is_removed() -> None:
    a, b = user_text("hi"), boundary()
    cache = WireCache()
    cache.to_api([a, b, user_text("after")])
    assert cache.to_api([a]) == to_api([a]) == [{"role": "user", "content": "hi"}]


def test_wire_cache_after_the_last_summary_is_removed() -> None:
    a, s = user_text("hi"), summary()
    cache = WireCache()
    cache.to_api([a, s, user_text("after")])
    assert cache.to_api([a]) == to_api([a]) == [{"role": "user", "content": "hi"}]
