"""Text a harness appended to a tool result (``pipeline.wire.harness``): split off exactly, put back
verbatim, never measured, persisted or cleared with the output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from pipeline import Message, Pipeline, SessionContext
from pipeline.testing import QuietLogger
from pipeline.wire.harness import MAX_TAIL_CHARS, last_result_index, split_tail, with_tail
from stages import Microcompact, ToolResultBudget
from tests.builders import assistant, tool_result, tool_use, user_text

REMINDER = (
    "<system-reminder>\n<total_tokens>14976412 tokens left</total_tokens>\n</system-reminder>"
)
NOTICE = (
    "<system-reminder>\n[SYSTEM NOTIFICATION - NOT USER INPUT]\n<task-notification>\n"
    "<result>REPORT-MARKER done</result>\n</task-notification>\n</system-reminder>"
)


@pytest.mark.parametrize(
    ("content", "core"),
    [
        ("out\n\n" + REMINDER, "out"),
        ("out\n\n" + NOTICE + "\n\n" + REMINDER, "out"),
        ("\n\n" + REMINDER, ""),  # nothing but the harness's: the core is empty
        ("out", "out"),
        ("out" + REMINDER, "out" + REMINDER),  # no separator: the tool's own text
        ("out\n\n</system-reminder>", "out\n\n</system-reminder>"),
        (
            "out\n\n<system-reminder>A\n\n<system-reminder>B</system-reminder>C</system-reminder>",
            "out",
        ),
        ("out</system-reminder>\n\n" + REMINDER, "out</system-reminder>"),
        ("a\n\n<system-reminder>open only", "a\n\n<system-reminder>open only"),
        # a reminder that quotes its own tag is the harness's all the same
        ("out\n\n<system-reminder>a </system-reminder> b</system-reminder>", "out"),
        ("out\n\n<system-reminder>a <system-reminder> b</system-reminder>\n", "out"),
        ("out\n\n<system-reminder>q </system-reminder> x</system-reminder>\n\n" + REMINDER, "out"),
        # output shaped like a reminder, then output: the tool's, and only the last is the tail
        (
            "o\n\n<system-reminder>x</system-reminder> more\n\n" + REMINDER,
            "o\n\n<system-reminder>x</system-reminder> more",
        ),
    ],
)
def test_a_string_tail_is_split_exactly(content: str, core: str) -> None:
    got_core, tail = split_tail(content)
    assert got_core == core
    assert got_core + (tail or "") == content  # nothing lost, nothing added
    assert with_tail("NEW", tail) == "NEW" + content[len(core) :]


def test_a_list_tail_is_trailing_reminder_blocks_only() -> None:
    blocks: list[dict[str, Any]] = [
        {"type": "text", "text": "Async agent launched"},
        {"type": "text", "text": REMINDER + "\n"},
        {"type": "text", "text": NOTICE},
    ]
    core, tail = split_tail(blocks)
    assert core == blocks[:1] and tail == blocks[1:]
    assert with_tail("R", tail) == [{"type": "text", "text": "R"}, *blocks[1:]]
    # a block that carries more than type and text (a breakpoint) is the client's own
    marked = [*blocks[:2], {**blocks[2], "cache_control": {"type": "ephemeral"}}]
    assert split_tail(marked) == (marked, None)
    assert split_tail([{"type": "image", "source": {}}]) == (
        [{"type": "image", "source": {}}],
        None,
    )


def test_a_tail_is_bounded() -> None:
    long = "\n\n<system-reminder>" + "x" * MAX_TAIL_CHARS + "</system-reminder>"
    assert split_tail("out" + long) == ("out" + long, None)
    blocks = [{"type": "text", "text": "out"}] + [
        {"type": "text", "text": "<system-reminder>" + "y" * 20_000 + "</system-reminder>"}
        for _ in range(5)
    ]
    core, tail = split_tail(blocks)
    assert tail is not None and sum(len(b["text"]) for b in tail) <= MAX_TAIL_CHARS
    assert core + tail == blocks


def test_hostile_tag_soup_is_split_in_one_scan() -> None:
    soup = "o" + "\n\n<system-reminder>" * 200_000 + "</system-reminder>" * 200_000
    core, tail = split_tail(soup)
    assert core + (tail or "") == soup
    nested = "o" + ("\n\n<system-reminder>x" * 1_500) + ("</system-reminder>" * 1_500)
    core, tail = split_tail(nested)
    assert core == "o" and tail == nested[1:]


def test_only_the_last_result_of_a_record_can_carry_a_tail() -> None:
    content = [tool_result("a", "x"), {"type": "text", "text": "hi"}, tool_result("b", "y")]
    assert last_result_index(content) == 2
    assert last_result_index("text") == -1 and last_result_index([]) == -1


def _ctx(root: Path) -> SessionContext:
    return SessionContext("harness", root, logger=QuietLogger())


def test_the_budget_neither_counts_nor_persists_harness_text(tmp_path: Path) -> None:
    """Six equal outputs, 216K together: on the output alone, the largest-first order is the
    message's order; the reminder on the last must not make it the largest, and must reach the
    model verbatim whatever is persisted."""
    outputs = [f"log {i} " * 6_000 for i in range(6)]  # 36K each, under the per-tool limit
    history = [
        user_text("check the jobs"),
        assistant("m1", *(tool_use(f"t{i}", "Bash") for i in range(6))),
        Message.user(
            [
                tool_result(f"t{i}", outputs[i] + ("\n\n" + NOTICE if i == 5 else ""))
                for i in range(6)
            ]
        ),
    ]
    ctx = _ctx(tmp_path)
    out = anyio.run(Pipeline([ToolResultBudget()]).run, history, ctx)
    sent = [b["content"] for b in out[2].content]
    assert [c.startswith("<persisted-output>") for c in sent] == [True] + [False] * 5
    assert sent[5] == outputs[5] + "\n\n" + NOTICE
    assert [(p.tool_use_id, p.chars) for p in ctx.report.persisted] == [("t0", len(outputs[0]))]
    files = list(tmp_path.rglob("tool-results/*"))
    assert [f.read_text() for f in files] == [outputs[0]]


def test_a_persisted_result_keeps_its_tail_and_the_file_holds_only_output(tmp_path: Path) -> None:
    output = "z" * 60_000
    history = [
        user_text("go"),
        assistant("m1", tool_use("big", "Bash")),
        Message.user([tool_result("big", output + "\n\n" + REMINDER)]),
    ]
    ctx = _ctx(tmp_path)
    pipe = Pipeline([ToolResultBudget()])
    out = anyio.run(pipe.run, history, ctx)
    sent = out[2].content[0]["content"]
    assert sent.startswith("<persisted-output>") and sent.endswith(
        "</persisted-output>\n\n" + REMINDER
    )
    (saved,) = tmp_path.rglob("tool-results/*")
    assert saved.read_text() == output
    again = anyio.run(pipe.run, [*history, assistant("m2", tool_use("x", "Bash"))], ctx)
    assert again[2].content[0]["content"] == sent  # re-applied byte for byte, tail included


def test_a_blank_output_with_a_reminder_gets_the_placeholder_and_the_reminder(
    tmp_path: Path,
) -> None:
    history = [
        user_text("go"),
        assistant("m1", tool_use("e", "Glob")),
        Message.user([tool_result("e", "\n\n" + REMINDER)]),
    ]
    out = anyio.run(Pipeline([ToolResultBudget()]).run, history, _ctx(tmp_path))
    assert out[2].content[0]["content"] == "(Glob completed with no output)\n\n" + REMINDER


def test_a_cleared_result_keeps_its_reminder(tmp_path: Path) -> None:
    history: list[Message] = [user_text("go")]
    for i in range(6):
        history.append(assistant(f"m{i}", tool_use(f"r{i}", "Read")))
        history.append(Message.user([tool_result(f"r{i}", f"file {i} " * 400 + "\n\n" + REMINDER)]))
    stage = Microcompact(keep=2, trigger_tokens=100, min_reclaim_tokens=0)
    out = anyio.run(Pipeline([stage]).run, history, _ctx(tmp_path))
    contents = [m.content[0]["content"] for m in out[2::2]]
    cleared = [c for c in contents if c.startswith("[Old tool result content cleared]")]
    assert cleared and all(c == "[Old tool result content cleared]\n\n" + REMINDER for c in cleared)
    assert all(c.endswith(REMINDER) for c in contents)
