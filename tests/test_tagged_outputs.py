"""Tool output that begins with ``<persisted-output>`` is not a replacement because of it.

Tool output is attacker-controlled (a ``cat`` of a transcript, a crafted file, a web page): only
text that can be a replacement -- the tag at both ends, no longer than a replacement can be -- is
left as it is; anything longer is ordinary output, gated and budgeted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import Pipeline, SessionContext, ToolPolicies, to_api
from pipeline.gate import gate_tool_result, persist_content
from pipeline.results.keys import MAX_REPLACEMENT_CHARS, is_replacement_text
from pipeline.results.reading import is_candidate
from pipeline.store.files import FileToolResultStore
from pipeline.testing import QuietLogger
from pipeline.tracing import Decision, Reason
from stages import ToolResultBudget
from tests.builders import assistant, results, tool_result, tool_use, user_text

TAG = "<persisted-output>"


def _ctx(root: Path) -> SessionContext:
    return SessionContext(
        "tagged", root, tool_policies=ToolPolicies.claude_code(), logger=QuietLogger()
    )


@pytest.mark.anyio
async def test_a_huge_output_that_starts_with_the_tag_is_gated(tmp_path: Path) -> None:
    hostile = TAG + "x" * 300_000
    store = FileToolResultStore(tmp_path, "tagged")
    block = tool_result("t1", hostile)
    out = await gate_tool_result(block, tool_name="Bash", threshold=50_000, store=store)
    assert out.decision == Decision.PERSIST
    assert len(out.block["content"]) < 3_000
    assert out.path is not None and Path(out.path).read_text() == hostile


@pytest.mark.anyio
async def test_tagged_outputs_count_in_the_per_message_budget(tmp_path: Path) -> None:
    # ten 30,000-char outputs that start (and end) with the tag: 300,000 chars in one message
    fake = [TAG + chr(ord("a") + i) * 30_000 + "\n</persisted-output>" for i in range(10)]
    ids = [f"t{i}" for i in range(10)]
    history = [
        user_text("go"),
        assistant("msg_1", *(tool_use(t) for t in ids)),
        results(*(tool_result(t, c) for t, c in zip(ids, fake, strict=True))),
    ]
    ctx = _ctx(tmp_path)
    out = await Pipeline([ToolResultBudget(200_000)]).run(history, ctx)
    sent = to_api(out)[-1]["content"]
    assert isinstance(sent, list)
    assert sum(len(b["content"]) for b in sent) <= 200_000
    assert len(ctx.report.persisted) >= 4


@pytest.mark.anyio
async def test_a_genuine_replacement_goes_as_it_is(tmp_path: Path) -> None:
    store = FileToolResultStore(tmp_path, "tagged")
    persisted = await persist_content(store, "t1", "y" * 100_000)
    assert is_replacement_text(persisted.replacement)
    block = tool_result("t2", persisted.replacement)
    out = await gate_tool_result(block, tool_name="Bash", threshold=1_000, store=store)
    assert (out.decision, out.reason) == (Decision.KEEP, Reason.ALREADY_REPLACED)
    assert out.block is block
    assert not is_candidate(block)


def test_only_text_that_can_be_a_replacement_is_one() -> None:
    close = "\n</persisted-output>"
    longest = TAG + "p" * (MAX_REPLACEMENT_CHARS - len(TAG) - len(close)) + close
    assert is_replacement_text(longest)
    assert not is_replacement_text(longest[: -len(close)] + "p" + close)  # one char too long
    assert not is_replacement_text(TAG + "no closing tag")
    assert not is_replacement_text(" " + TAG + close)
    assert not is_replacement_text([{"type": "text", "text": TAG + close}])
    assert is_candidate(tool_result("t", TAG + "x" * 10_000))
