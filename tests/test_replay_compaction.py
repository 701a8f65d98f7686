"""Replay of a generated session whose server compacted its context mid-way: the compaction
block goes out as it came, the token tracker counts from it on (within its usual error of what
follows it), and no stage takes what precedes it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anyio

from pipeline import Pipeline, SessionContext
from pipeline.messages import Message, Usage
from pipeline.tokens import TokenTracker, rough_tokens_for_messages
from pipeline.transcript.replay import replay_messages
from stages import default_stages

SUMMARY = "Summary: the build failed in three shards; two fixed, one left (a flaky network test)."


def _session(before: int, after: int, chars: int) -> tuple[list[Message], int]:
    """A task, ``before`` tool rounds, a response holding a compaction block, a prompt,
    ``after`` rounds; each response's usage is what the API read for it (from the block on,
    after it). Also where the block stands."""
    history: list[Message] = [Message.user("Why does CI fail?", uuid="task")]
    start = 0

    def respond(content: list[dict[str, object]], n: int) -> None:
        message = Message.assistant(content, message_id=f"msg_{n:03d}")
        # a compacting response's usage is its last iteration's: the summary, read afresh
        read = rough_tokens_for_messages([*history[start:], message][-1 if n == 999 else 0 :])
        usage = Usage(input_tokens=read, output_tokens=40)
        history.append(dataclasses.replace(message, usage=usage))

    for n in range(before + after):
        if n == before:
            start = len(history)
            respond([{"type": "compaction", "content": SUMMARY}], 999)
            history.append(Message.user("Go on with the last shard."))
        tid = f"toolu_{n:03d}"
        respond([{"type": "tool_use", "id": tid, "name": "Bash", "input": {"n": n}}], n)
        output = f"shard {n}\n" + "log line of the build\n" * (chars // 22)
        history.append(
            Message.user([{"type": "tool_result", "tool_use_id": tid, "content": output}])
        )
    return history, next(i for i, m in enumerate(history) if m.message_id == "msg_999")


def test_a_replay_counts_and_keeps_from_the_compaction_block_on(tmp_path: Path) -> None:
    """What follows the block grows past the stages' triggers: they take from it alone."""
    history, at = _session(before=40, after=60, chars=12_000)
    ctx = SessionContext("replayed", tmp_path, token_tracker=TokenTracker())

    async def main() -> list[tuple[int, int | None, int, list[object]]]:
        pipeline = Pipeline(default_stages(context_window=200_000))
        return [
            (r.estimated_tokens, r.actual_tokens, r.removed_tokens, list(r.request))
            async for r in replay_messages(history, pipeline, ctx)
        ]

    calls = anyio.run(main)
    after = [c for c in calls[41:] if c[1]]  # the calls after the compaction's own
    assert len(after) >= 55
    for estimated, actual, removed, request in after:
        assert actual is not None
        # what the API reads (from the block on), less what the stages took
        assert abs(estimated - (actual - removed)) <= max(0.15 * (actual - removed), 150)
        # the block where it stood: nothing before it was taken
        assert {"type": "compaction", "content": SUMMARY} in request[at]["content"]  # type: ignore[index]
    assert any(removed for _, _, removed, _ in after)  # a stage did take from what follows
