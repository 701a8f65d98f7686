"""A resumed session decides again exactly the results whose decision never reached the
transcript, and freezes the rest.

The process can die after tool results are recorded but before the budget pass records what it
decided (its files may be written by then). Those results were never sent: treating them as
sent whole would send a request over the budget forever after.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import (
    Message,
    Pipeline,
    ReplacementState,
    SessionContext,
    ToolPolicies,
    TranscriptWriter,
    load_transcript,
    to_api,
)
from pipeline.replacement import ReplacementRecord, decided_in
from pipeline.results.keys import content_digest
from pipeline.results.reading import answered_results
from pipeline.testing import QuietLogger
from pipeline.transcript.read import StageRecord
from stages import ToolResultBudget
from tests.builders import assistant, key, results, tool_result, tool_use, user_text
from tests.edit_support import records as histories

SID = "resume-decisions"
LIMIT = 200_000
SIZE = 29_000  # under the per-tool gate; eight of them are 232,000 chars, over LIMIT


def _ctx(
    root: Path, transcript: TranscriptWriter | None, state: ReplacementState | None = None
) -> SessionContext:
    return SessionContext(
        SID,
        root / "store",
        transcript=transcript,
        replacement_state=state,
        tool_policies=ToolPolicies.claude_code(),
        logger=QuietLogger(),
    )


def _parallel(prefix: str, n: int = 8) -> list[Message]:
    ids = [f"{prefix}{i}" for i in range(n)]
    return [
        assistant(f"msg_{prefix}", *(tool_use(t, "Bash") for t in ids)),
        *(results(tool_result(t, chr(ord("a") + i) * (SIZE + i))) for i, t in enumerate(ids)),
    ]


def _chars_in_last_user(request: list[dict[str, object]]) -> int:
    content = request[-1]["content"]
    assert isinstance(content, list)
    return sum(len(str(b.get("content", ""))) for b in content)


def _store_files(root: Path) -> dict[str, tuple[int, bytes]]:
    d = root / "store" / SID / "tool-results"
    return {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted(d.iterdir())}


@pytest.mark.anyio
async def test_results_whose_decision_was_never_recorded_are_decided_again(tmp_path: Path) -> None:
    pipe = Pipeline([ToolResultBudget(LIMIT)])
    history = [user_text("run the eight jobs"), *_parallel("p")]
    path = tmp_path / "t.jsonl"
    TranscriptWriter(path, SID).append_messages(history)

    # the live pass persists its files, then the process dies before the records are written
    live = await pipe.run(history, _ctx(tmp_path, transcript=None))
    live_request = to_api(live)
    assert _chars_in_last_user(live_request) <= LIMIT
    files = _store_files(tmp_path)
    assert files  # something was persisted before the "crash"

    loaded = load_transcript(path)
    assert loaded.replacement_records == [] and loaded.stage_records == []
    state = ReplacementState.reconstruct(
        loaded.messages, loaded.replacement_records, decided=decided_in(loaded.stage_records)
    )
    assert state.seen_ids == set() and state.replacements == {}  # nothing was sent

    resumed = await pipe.run(loaded.messages, _ctx(tmp_path, TranscriptWriter(path, SID), state))
    request = to_api(resumed)
    assert json.dumps(request) == json.dumps(live_request)  # the same decisions
    assert _chars_in_last_user(request) <= LIMIT
    assert _store_files(tmp_path) == files  # the files already written, reused as they are


@pytest.mark.anyio
async def test_recorded_decisions_freeze_results_wherever_they_stand(tmp_path: Path) -> None:
    # a pass sends two results whole; a late parallel result joins their group before the next
    # response. Resumed, the two stay frozen (recorded) and the late one is decided as live.
    pipe = Pipeline([ToolResultBudget(5_000)])
    path = tmp_path / "t.jsonl"
    writer = TranscriptWriter(path, SID)
    ctx = _ctx(tmp_path, writer)
    history = [
        user_text("go"),
        assistant("msg_1", tool_use("a"), tool_use("b"), tool_use("c")),
        results(tool_result("a", "a" * 2_000)),
        results(tool_result("b", "b" * 2_000)),
    ]
    writer.append_messages(history)
    await pipe.run(history, ctx)
    late = results(tool_result("c", "c" * 2_000))
    history.append(late)
    writer.append_messages([late])
    live = to_api(await pipe.run(history, ctx))

    loaded = load_transcript(path)
    # the first pass recorded a and b as sent whole, each bound to its output
    assert loaded.stage_records == [
        StageRecord(
            "tool_result_budget",
            {"decided": [["a", content_digest("a" * 2_000)], ["b", content_digest("b" * 2_000)]]},
        )
    ]
    assert [(r.tool_use_id, r.digest) for r in loaded.replacement_records] == [
        ("c", content_digest("c" * 2_000))
    ]
    a, b, c = key("a", "a" * 2_000), key("b", "b" * 2_000), key("c", "c" * 2_000)
    assert decided_in(loaded.stage_records) == {a, b}
    state = ReplacementState.reconstruct(
        loaded.messages, loaded.replacement_records, decided=decided_in(loaded.stage_records)
    )
    assert state.classify(a) == state.classify(b) == "frozen"
    assert state.classify(c) == "must_reapply"  # c's own pass recorded its replacement
    assert len(state.seen_ids) == 3
    resumed = to_api(await pipe.run(loaded.messages, _ctx(tmp_path, None, state)))
    assert json.dumps(resumed) == json.dumps(live)

    # without the decision records, a and b would count as unsent and compete with c
    unrecorded = ReplacementState.reconstruct(loaded.messages, loaded.replacement_records)
    assert unrecorded.classify(a) == "fresh"

    # a transcript written before results were bound to their content ({"seen": [ids]}, records
    # without a digest) resumes the same way: a bare id binds to the result that carries it
    legacy_records = [
        ReplacementRecord(r.tool_use_id, r.replacement) for r in loaded.replacement_records
    ]
    legacy = ReplacementState.reconstruct(
        loaded.messages,
        legacy_records,
        decided=decided_in([StageRecord("tool_result_budget", {"seen": ["a", "b"]})]),
    )
    assert legacy == state


def test_malformed_decision_records_are_ignored() -> None:
    class Rec:
        def __init__(self, stage: str, data: dict[str, object]) -> None:
            self.stage, self.data = stage, data

    digest = content_digest("out")
    records = [
        Rec("tool_result_budget", {"decided": [["p", digest], ["q", "not-a-digest"], ["r"]]}),
        Rec("tool_result_budget", {"decided": [["s", digest.upper()], [7, digest], "t", None]}),
        Rec("tool_result_budget", {"decided": {"u": digest}}),
        Rec("tool_result_budget", {"decided": [["v", digest, "extra"]]}),
        # the format before results were bound to their content: bare ids
        Rec("tool_result_budget", {"seen": ["x", 5, None, "y"]}),
        Rec("tool_result_budget", {"seen": "x"}),
        Rec("tool_result_budget", {}),
        Rec("history_snip", {"seen": ["z"]}),
        Rec("history_snip", {"decided": [["w", digest]]}),
    ]
    assert decided_in(records) == {f"p#{digest}", "x#", "y#"}  # a legacy id, never a key


def test_a_synthetic_response_does_not_count_as_sending_what_came_before() -> None:
    history = [
        user_text("go"),
        assistant("msg_1", tool_use("a")),
        results(tool_result("a", "a" * 10)),
        Message.assistant([{"type": "text", "text": "API Error: overloaded"}], model="<synthetic>"),
    ]
    a = key("a", "a" * 10)
    assert ReplacementState.reconstruct(history, []).classify(a) == "fresh"
    history.append(assistant("msg_2", {"type": "text", "text": "done"}))
    state = ReplacementState.reconstruct(history, [])
    assert state.classify(a) == "frozen" and state.seen_ids == {a}


def test_results_between_fragments_of_the_last_response_were_not_sent() -> None:
    # a response is recorded in fragments with its tool results between them
    history = [
        user_text("go"),
        assistant("msg_1", tool_use("a")),
        results(tool_result("a", "a" * 10)),
        assistant("msg_1", tool_use("b")),
        results(tool_result("b", "b" * 10)),
    ]
    state = ReplacementState.reconstruct(history, [])
    assert state.classify(key("a", "a" * 10)) == state.classify(key("b", "b" * 10)) == "fresh"
    assert state.seen_ids == set() and state.replacements == {}


def test_results_before_the_last_compaction_are_not_in_the_ledger() -> None:
    # a compacted transcript keeps the records before its boundary, but they are never sent
    # again: their decisions are not the session's to restore
    history = [
        user_text("go"),
        assistant("msg_1", tool_use("old")),
        results(tool_result("old", "o" * 10)),
        Message(type="system", subtype="compact_boundary", content=""),
        Message.user("summary of the part before", is_compact_summary=True),
        assistant("msg_2", tool_use("new")),
        results(tool_result("new", "n" * 10)),
        assistant("msg_3", {"type": "text", "text": "done"}),
    ]
    new = key("new", "n" * 10)
    for records in (
        [
            ReplacementRecord(
                "old",
                "<persisted-output>\nold\n</persisted-output>",
                digest=content_digest("o" * 10),
            ),
            ReplacementRecord(
                "new",
                "<persisted-output>\nnew\n</persisted-output>",
                digest=content_digest("n" * 10),
            ),
        ],
        [  # written before results were bound to their content
            ReplacementRecord("old", "<persisted-output>\nold\n</persisted-output>"),
            ReplacementRecord("new", "<persisted-output>\nnew\n</persisted-output>"),
        ],
    ):
        state = ReplacementState.reconstruct(history, records)
        assert set(state.replacements) == {new}
        assert state.seen_ids == {new}


def test_an_id_that_spells_another_results_key_is_not_taken_for_a_legacy_record() -> None:
    """A result whose tool_use_id reads ``<id>#<digest>`` (hostile input) is decided on its own
    after a restart as before it: a decision recorded for the result that key names does not
    freeze it."""
    first = "A" * 5_000
    spelled = f"a#{content_digest(first)}"
    history = [
        user_text("go"),
        assistant("m1", tool_use("a", "Glob")),
        results(tool_result("a", first)),
        assistant("m2", tool_use(spelled, "Glob")),
        results(tool_result(spelled, "B" * 10_000)),
    ]
    records = [StageRecord("tool_result_budget", {"decided": [["a", content_digest(first)]]})]
    state = ReplacementState.reconstruct(history[:4], [], decided=decided_in(records))
    rebuilt = ReplacementState.reconstruct(history, [], decided=decided_in(records))
    assert state.classify(f"a#{content_digest(first)}") == "frozen"
    # the later result stands after the last response: undecided, so fresh
    assert rebuilt.classify(f"{spelled}#{content_digest('B' * 10_000)}") == "fresh"


@settings(max_examples=400, deadline=None)
@given(histories(), st.integers(0, 45))
def test_after_a_rebuild_only_results_before_the_thread_are_read(
    history: list[Message], first: int
) -> None:
    """A ledger just rebuilt from a history holds every answered result from the thread's
    start on: reading from there again finds nothing new (what a first pass after a restart
    skips), and what lies before the thread's start is still read."""
    state = ReplacementState.reconstruct(history, [], keep_absent=True)
    every = answered_results(history, first) - state.seen_ids
    assert answered_results(history, first, rebuilt=True) - state.seen_ids == every
