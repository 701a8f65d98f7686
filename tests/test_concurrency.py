"""Many sessions in one process: nothing crosses sessions; one session's turns never overlap.

One ``Pipeline`` (the default stages, shared by every session, as a service would share it) runs
1,000 sessions at once in an anyio task group. Each session has its own ``SessionContext`` over
one store root, and its turns interleave with everyone else's: the store yields to the event
loop inside every write, and the sessions yield between turns. Contents are small, but the
limits are smaller, so every session persists some results to real files.

Afterwards, for every session: its store directory holds exactly the files of the results its
ledger replaced, each file holds that session's own text, its ledger names only its own ids,
its stage state is its own, and every request it built mentions only its own ids and paths.

Serialisation: a recording stage notes when a turn enters and leaves it and waits at a
checkpoint in between. Two turns of one session started together never overlap (the second
waits on the session's lock while the first sits at the checkpoint), while turns of different
sessions do overlap. Nothing here is timed.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from pipeline import (
    FileToolResultStore,
    Message,
    Pipeline,
    SessionContext,
    TokenTracker,
    ToolPolicies,
    Usage,
    to_api,
)
from pipeline.store.files import TOOL_RESULTS_SUBDIR
from pipeline.testing import QuietLogger
from stages import default_stages
from tests.builders import assistant, by_id, ids, results, tool_result, tool_use, user_text

SESSIONS = 1_000
TURNS = 3
POLICIES = ToolPolicies(declared={"Read": math.inf}, cap=300)  # results over 300 chars persist
PER_MESSAGE = 500
_ID = re.compile(r"s(\d{4})_t\d+_\d")


class YieldingStore(FileToolResultStore):
    """The real file store, yielding to other sessions before and after every write."""

    async def persist(self, tool_use_id: str, text: str, ext: str) -> str:
        await anyio.sleep(0)
        path = await super().persist(tool_use_id, text, ext)
        await anyio.sleep(0)
        return path


def sid(i: int) -> str:
    return f"s{i:04d}"


def turn_messages(i: int, t: int) -> list[Message]:
    """Turn ``t`` of session ``i``: three parallel calls; sizes vary so that some persist."""
    ids = [f"{sid(i)}_t{t}_{k}" for k in range(3)]
    sizes = [40 + (i * 7 + t * 13 + k * 101) % 420 for k in range(3)]
    tools = ["Bash", "Read" if (i + t) % 4 == 0 else "Grep", "Glob"]
    usage = Usage(input_tokens=100 + 400 * t, output_tokens=50)  # an anchor for the estimate
    uses = (tool_use(x, n) for x, n in zip(ids, tools, strict=True))
    return [
        assistant(f"{sid(i)}_r{t}", *uses, usage=usage),
        *(results(tool_result(x, f"<{x}>" + "y" * n)) for x, n in zip(ids, sizes, strict=True)),
    ]


def ids_in(text: str) -> set[int]:
    """Session numbers of every tool_use_id mentioned in ``text``."""
    return {int(m.group(1)) for m in _ID.finditer(text)}


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    yield str(request.param)


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_thousand_interleaved_sessions_share_nothing(
    tmp_path: Path, anyio_backend: str
) -> None:
    # a thousand under asyncio; trio runs the same code paths with fewer, to keep the file fast
    sessions = SESSIONS if anyio_backend == "asyncio" else SESSIONS // 5
    root = tmp_path / "store"
    pipe = Pipeline(default_stages(per_message_chars=PER_MESSAGE))  # one, shared by all
    contexts: dict[int, SessionContext] = {}
    requests: dict[int, list[str]] = defaultdict(list)
    order: list[int] = []  # which session finished each turn: proves the interleaving

    async def session(i: int) -> None:
        ctx = SessionContext(
            sid(i),
            root,
            store=YieldingStore(root, sid(i)),
            tool_policies=POLICIES,
            token_tracker=TokenTracker("reference"),  # the cheap estimate: isolation is the point
            logger=QuietLogger(),
        )
        contexts[i] = ctx
        history: list[Message] = [user_text(f"task of {sid(i)}")]
        for t in range(TURNS):
            history += turn_messages(i, t)
            projected = await pipe.run(history, ctx)
            requests[i].append(json.dumps(to_api(projected)))
            order.append(i)
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        for i in range(sessions):
            tg.start_soon(session, i)

    assert len(contexts) == sessions and len(order) == sessions * TURNS
    # turns of different sessions interleaved: other sessions finished turns between the
    # turns of the first one
    first = [k for k, i in enumerate(order) if i == 0]
    assert first[-1] - first[0] > TURNS - 1

    persisted_total = 0
    for i, ctx in contexts.items():
        state = ctx.replacement_state
        own = {f"{sid(i)}_t{t}_{k}" for t in range(TURNS) for k in range(3)}
        # the ledger: only this session's results, and every one of them was decided (once)
        assert ids(state.seen_ids) == own and len(state.seen_ids) == len(own)
        replaced = by_id(state.replacements)
        assert set(replaced) <= own
        # the store directory: exactly the files of the results this ledger replaced
        directory = root / sid(i) / TOOL_RESULTS_SUBDIR
        files = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
        assert files == sorted(f"{x}.txt" for x in replaced)
        for name in files:
            text = (directory / name).read_text()
            assert text.startswith(f"<{name.removesuffix('.txt')}>")
            assert ids_in(text) == {i}
        for x, replacement in replaced.items():
            assert f"Full output saved to: {directory.absolute() / x}.txt" in replacement
        persisted_total += len(files)
        # stage memory is per session (stage objects are shared)
        cache = ctx.stage_state.get("tool_result_budget")  # present with incremental=True
        if cache is not None:
            # (the cache knows a candidate by its ledger key, a blank result as ("empty", id))
            applied = {n if isinstance(n, str) else n[1] for n in cache.apply}
            assert ids(cache.scan.cand_count) <= own and ids(applied) <= own
            assert all(ids_in(repr(m)) <= {i} for m in cache.log.inputs)
        for value in ctx.stage_state.values():
            assert ids_in(repr(value)) <= {i}
        # every request this session built mentions only its own ids and its own directory
        for request in requests[i]:
            assert ids_in(request) == {i}
            for path in re.findall(r"Full output saved to: ([^\s\\\\]+)", request):
                assert Path(path).parent == directory.absolute()
    # the limits made sessions write files (so the checks above had files to check)
    assert persisted_total >= sessions
    assert {p.name for p in root.iterdir()} == {
        sid(i) for i in contexts if (root / sid(i)).exists()
    }


class Recorder:
    """A stage that logs entering and leaving, and waits at a checkpoint in between."""

    name = "recorder"

    def __init__(self) -> None:
        self.log: list[tuple[str, str, int]] = []  # (session, "enter" | "exit", turn)
        self.gates: dict[tuple[str, int], anyio.Event] = {}

    def gate(self, session: str, turn: int) -> anyio.Event:
        return self.gates.setdefault((session, turn), anyio.Event())

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        turn = len(messages)  # the two turns of a session are given histories of two lengths
        self.log.append((ctx.session_id, "enter", turn))
        await self.gate(ctx.session_id, turn).wait()  # the checkpoint
        self.log.append((ctx.session_id, "exit", turn))
        return messages


@pytest.mark.anyio
async def test_two_concurrent_turns_of_one_session_are_serialised(tmp_path: Path) -> None:
    recorder = Recorder()
    pipe = Pipeline([recorder, *default_stages()])
    ctx = SessionContext("solo", tmp_path, logger=QuietLogger())
    short = [user_text("go"), *turn_messages(0, 0)]
    long = [*short, *turn_messages(0, 1)]

    async with anyio.create_task_group() as tg:
        tg.start_soon(pipe.run, short, ctx)
        tg.start_soon(pipe.run, long, ctx)
        # both turns were started; wait until no task can make progress
        await anyio.wait_all_tasks_blocked()
        entered = [e for e in recorder.log if e[1] == "enter"]
        assert len(entered) == 1  # one turn sits at the checkpoint, the other waits on the lock
        first = entered[0][2]
        second = len(long) if first == len(short) else len(short)
        recorder.gate("solo", first).set()
        await anyio.wait_all_tasks_blocked()
        assert recorder.log[-1] == ("solo", "enter", second)  # only now does the second enter
        recorder.gate("solo", second).set()
    assert recorder.log == [
        ("solo", "enter", first),
        ("solo", "exit", first),
        ("solo", "enter", second),
        ("solo", "exit", second),
    ]


@pytest.mark.anyio
async def test_turns_overlap_across_sessions_never_within_one(tmp_path: Path) -> None:
    """A thousand sessions, each starting two turns at once, all released together."""
    recorder = Recorder()
    pipe = Pipeline([recorder, *default_stages()])
    n = SESSIONS
    contexts = [
        SessionContext(
            sid(i), tmp_path, token_tracker=TokenTracker("reference"), logger=QuietLogger()
        )
        for i in range(n)
    ]
    histories = []
    for i in range(n):
        short = [user_text("go"), *turn_messages(i, 0)]
        histories.append((short, [*short, *turn_messages(i, 1)]))

    async with anyio.create_task_group() as tg:
        for ctx, (short, long) in zip(contexts, histories, strict=True):
            tg.start_soon(pipe.run, short, ctx)
            tg.start_soon(pipe.run, long, ctx)
        await anyio.wait_all_tasks_blocked()
        # every session has exactly one turn inside the stage: many sessions at once, and
        # none with two
        inside = [s for s, what, _t in recorder.log if what == "enter"]
        assert sorted(inside) == [sid(i) for i in range(n)]
        # release every gate; each session's second turn enters only after its first exits
        for i, (short, long) in enumerate(histories):
            recorder.gate(sid(i), len(short)).set()
            recorder.gate(sid(i), len(long)).set()

    by_session: dict[str, list[str]] = defaultdict(list)
    for s, what, _t in recorder.log:
        by_session[s].append(what)
    assert len(by_session) == n
    for events in by_session.values():
        assert events == ["enter", "exit", "enter", "exit"]
