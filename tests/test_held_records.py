"""A decision a crash may lose without harm -- the budget's record of results sent whole -- is
held back on a local store whose appends are made durable later, and written with the next
record (the call's response) rather than before the call goes upstream. A new process that
never got it finds the same decision again: a result the model answered after is placed as
sent whole, and a retried request decides it alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio

from pipeline import Message, Pipeline, TranscriptWriter
from pipeline.dropin.adapter import WireSession
from pipeline.replacement import DECIDED_RECORD_STAGE
from pipeline.store.sessions import SessionStates
from pipeline.transcript.writer import MAX_HELD_BACK
from stages import ToolResultBudget, default_stages


def _kinds(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line).get("stage", "message") for line in path.read_text().splitlines()]


def test_a_held_record_goes_with_the_next_append_before_it(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = TranscriptWriter(path, "s", fsync_each=False, hold_open=True)
    assert writer.append_stage_record_later("a", {"k": 1})
    assert writer.append_stage_record_later("b", {"k": 2})
    assert _kinds(path) == []  # nothing written yet
    writer.append_stage_record("c", {"k": 3})
    assert _kinds(path) == ["a", "b", "c"]
    writer.append_stage_record_later("d", {})
    writer.write_held()
    assert _kinds(path)[-1] == "d"
    writer.append_stage_record_later("e", {})
    writer.sync()  # written, then made durable
    writer.append_stage_record_later("f", {})
    writer.close()
    assert _kinds(path) == ["a", "b", "c", "d", "e", "f"]


def test_a_writer_that_makes_each_record_durable_holds_nothing_back(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = TranscriptWriter(path, "s")  # fsync_each
    assert not writer.append_stage_record_later("a", {})
    writer.append_messages([Message.user("hi")])
    assert _kinds(path) == ["message"]


def _body(k: int, answered: bool) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    for i in range(k):
        tool = f"toolu_{i}"
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": tool, "name": "x"}]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tool, "content": f"r{i} " * 40}],
            },
        ]
    if answered:
        messages.append({"role": "assistant", "content": "done"})
        messages.append({"role": "user", "content": "go on"})
    return {"model": "m", "max_tokens": 10, "messages": messages}


async def _session(root: Path, pipeline: Pipeline | None = None) -> WireSession:
    storage = SessionStates(root, fsync_each=False).open("s")
    pipeline = pipeline or Pipeline(default_stages())
    return await WireSession.open("s", root, pipeline, storage=storage)


def test_the_budgets_whole_record_waits_for_the_response_and_goes_before_it(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        session = await _session(tmp_path)
        log = session.storage.records.path  # type: ignore[attr-defined]
        _, call = await session.prepare_call(_body(1, answered=False))
        await session.prepare_call(_body(1, answered=False))  # a retry: nothing new
        before = _kinds(log)
        assert DECIDED_RECORD_STAGE not in before  # not written before the call went
        await session.observe_async(
            "msg_1", {"input_tokens": 50, "output_tokens": 3}, "m", call=call
        )
        after = _kinds(log)
        assert after[len(before) :] == [DECIDED_RECORD_STAGE, "wire_session.response"]

    anyio.run(run)


def test_a_held_record_a_crash_lost_is_found_again_by_a_new_process(tmp_path: Path) -> None:
    """The process ends after the call went upstream, before anything was written after it.
    When the client's next request carries the model's answer, the next process sends the
    results whole, as they went -- even under a budget that would now persist them -- and
    records that; a retry of the lost call decides them whole again, alike."""

    async def lost(root: Path) -> None:
        session = await _session(root)
        await session.prepare_call(_body(2, answered=False))
        # no response, no settle, no flush: the held record dies with the process

    async def next_process(
        root: Path, body: dict[str, Any], pipeline: Pipeline
    ) -> tuple[list[Any], list[str]]:
        session = await _session(root, pipeline)
        prepared, _call = await session.prepare_call(body)
        await session.settle()
        log = session.storage.records.path  # type: ignore[attr-defined]
        return prepared["messages"], _kinds(log)

    for answered in (True, False):
        root = tmp_path / f"answered-{answered}"
        anyio.run(lost, root)
        # answered: a budget far below the results (they went whole: they stay so)
        pipeline = Pipeline([ToolResultBudget(50)]) if answered else Pipeline(default_stages())
        sent, kinds = anyio.run(next_process, root, _body(2, answered=answered), pipeline)
        results = [
            b["content"]
            for m in sent
            if isinstance(m["content"], list)
            for b in m["content"]
            if b.get("type") == "tool_result"
        ]
        assert results == ["r0 " * 40, "r1 " * 40]  # whole, as they went
        assert DECIDED_RECORD_STAGE in kinds  # found again, and recorded this time


def test_records_held_back_are_bounded(tmp_path: Path) -> None:
    """Calls that never get a response (a client whose upstream always fails, in a process
    that never settles) cannot make a writer hold more than ``MAX_HELD_BACK`` records."""
    path = tmp_path / "t.jsonl"
    writer = TranscriptWriter(path, "s", fsync_each=False, hold_open=True)
    for k in range(MAX_HELD_BACK * 3 + 1):
        writer.append_stage_record_later("probe", {"k": k})
        assert len(_kinds(path)) > k - MAX_HELD_BACK
    writer.close()
    assert len(_kinds(path)) == MAX_HELD_BACK * 3 + 1
