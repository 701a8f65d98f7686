"""The replay's and the demo's closing words: what was decided, in plain words."""

from __future__ import annotations

from pipeline._cli.report import Story
from pipeline.context import PersistedResult
from pipeline.transcript.replay import Call, CallResult


def _result(number: int, persisted: list[PersistedResult], reapplied: int = 0) -> CallResult:
    call = Call(number=number, message_id=f"msg_{number}", index=0, usage=None)
    return CallResult(call, [], 0, persisted=persisted, reapplied=reapplied)


def _group(k: int) -> PersistedResult:
    return PersistedResult(
        f"t{k}", "get_log", 41_000, f"/s/t{k}.txt", "per_message", 200_000, 10, 403_000
    )


def test_each_call_that_persisted_is_told_with_its_limit_and_sizes() -> None:
    story = Story()
    story.add(_result(0, []))
    story.add(_result(1, [_group(k) for k in range(5)]))
    gate = PersistedResult("b", "Bash", 79_993, "/s/b.txt", "per_tool", 30_000)
    story.add(_result(3, [gate], reapplied=5))
    lines = story.lines()
    assert lines[0] == "what happened:"
    assert lines[1] == (
        "  call 1: 10 results, 403,000 chars together, over the per-message budget of 200,000: "
        "the 5 largest were saved to disk; the model sees a ~2K preview of each and the file's "
        "path"
    )
    assert lines[2] == (
        "  call 3: a Bash result of 79,993 chars, over its per-tool limit of 30,000: saved to "
        "disk as it arrived; the model sees a ~2K preview of it and the file's path"
    )
    assert "re-applied" in lines[3] and "(5 in all)" in lines[3]


def test_nothing_persisted_says_nothing_and_a_long_replay_is_cut() -> None:
    assert Story().lines() == []
    story = Story()
    for n in range(30):
        story.add(_result(n, [_group(n)]))
    lines = story.lines()
    assert len(lines) == 1 + 12 + 1
    assert lines[-1] == "  ... and 18 more calls that persisted results"


def test_hostile_tool_names_are_escaped() -> None:
    story = Story()
    story.add(_result(0, [PersistedResult("x", "\x1b]0;PWNED\x07", 60_000, "/p", "per_tool")]))
    assert "\x1b" not in "\n".join(story.lines())


def test_two_groups_in_one_call_get_a_clause_each() -> None:
    a = PersistedResult("a", "t", 50_000, "/a", "per_message", 200_000, 5, 250_000)
    b = PersistedResult("b", "t", 60_000, "/b", "per_message", 200_000, 4, 260_000)
    c = PersistedResult("c", "t", 61_000, "/c", "per_message", 200_000, 4, 260_000)
    story = Story()
    story.add(_result(2, [a, b, c]))
    line = story.lines()[1]
    assert "5 results, 250,000 chars together" in line and "the 1 largest was saved" in line
    assert "4 results, 260,000 chars together" in line and "the 2 largest were saved" in line
