"""The tool-result budget, branch by branch."""

from __future__ import annotations

import errno
import json
import math
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan

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
from pipeline.gate import build_replacement, format_size, gate_tool_result, generate_preview
from pipeline.replacement import ReplacementRecord
from pipeline.results.keys import content_digest
from pipeline.store.files import FileToolResultStore
from pipeline.testing import SpanRecorder
from pipeline.tracing import ATTR, SPAN_BUDGET_GROUP
from stages import ToolResultBudget
from stages.tool_result_budget import collect_groups, select_fresh_to_replace
from tests.builders import (
    assistant,
    by_id,
    ids,
    key,
    results,
    tool_result,
    tool_use,
    user_text,
)

# -- replacement text ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chars", "expected"),
    [
        (0, "0 bytes"),
        (1023, "1023 bytes"),
        (1024, "1KB"),
        (51_200, "50KB"),
        (60_000, "58.6KB"),
        (1024 * 3 + 256, "3.3KB"),  # exact tie 3.25: JS toFixed rounds half up
        (1024 * 3 + 768, "3.8KB"),  # exact tie 3.75
        (1024 * 1024, "1MB"),
        (1024 * 1024 * 1024 * 2, "2GB"),
        (144_356, "141KB"),
    ],
)
def test_format_size(chars: int, expected: str) -> None:
    assert format_size(chars) == expected


def test_preview_whole_text_when_short() -> None:
    assert generate_preview("a" * 2000) == ("a" * 2000, False)


def test_preview_cuts_at_last_newline_past_half() -> None:
    text = "x" * 1500 + "\n" + "y" * 1000
    assert generate_preview(text) == ("x" * 1500, True)


def test_preview_cuts_at_2000_when_newline_too_early() -> None:
    text = "x" * 999 + "\n" + "y" * 3000
    preview, more = generate_preview(text)
    assert more and preview == text[:2000]
    # exactly at the half is not "past" it
    text = "x" * 1000 + "\n" + "y" * 3000
    assert generate_preview(text)[0] == text[:2000]


def test_replacement_text_exact() -> None:
    assert build_replacement("/s/tool-results/t.txt", 60_000, "head", True) == (
        "<persisted-output>\nOutput too large (58.6KB). Full output saved to: "
        "/s/tool-results/t.txt\n\nPreview (first 2KB):\nhead\n...\n</persisted-output>"
    )
    assert build_replacement("/p", 10, "whole", False).endswith("whole\n</persisted-output>")


# -- thresholds ------------------------------------------------------------------------------


def test_threshold_precedence() -> None:
    p = ToolPolicies(
        declared={"Read": math.inf, "Bash": 30_000, "Big": 80_000},
        overrides={"Bash": 70_000, "Read": 5},
        cap=50_000,
    )
    assert p.threshold("Read") == math.inf  # inf opts out, even against an override
    assert p.threshold("Bash") == 70_000  # an override may exceed the cap
    assert p.threshold("Big") == 50_000  # min(declared, cap)
    assert p.threshold("Unknown") == 50_000  # undeclared counts as 100K → cap
    assert ToolPolicies.claude_code(cap=8_000).threshold("Bash") == 8_000
    assert ToolPolicies.claude_code().threshold("Grep") == 20_000
    with pytest.raises(ValueError, match="Bad"):
        ToolPolicies(overrides={"Bad": 0})


# -- the per-tool gate -----------------------------------------------------------------------


class CountingStore:
    """A store that keeps results in memory and counts writes."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.writes: list[tuple[str, str, str]] = []
        self.fail = fail

    async def persist(self, tool_use_id: str, text: str, ext: str) -> str:
        if self.fail is not None:
            raise self.fail
        self.writes.append((tool_use_id, text, ext))
        return f"/mem/{tool_use_id}.{ext}"


@pytest.mark.asyncio
@pytest.mark.parametrize("empty", [None, "", "  \n", [], [{"type": "text", "text": " "}]])
async def test_gate_empty_becomes_placeholder(empty: Any) -> None:
    block = tool_result("t1", empty, is_error=False)
    out = await gate_tool_result(block, tool_name="Grep", threshold=10, store=CountingStore())
    assert (out.decision, out.reason) == ("fill_empty", "empty")
    assert out.block == {**block, "content": "(Grep completed with no output)"}


@pytest.mark.asyncio
async def test_gate_branches() -> None:
    store = CountingStore()
    img = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A" * 99}}
    ]
    out = await gate_tool_result(tool_result("i", img), tool_name="X", threshold=1, store=store)
    assert (out.decision, out.reason, out.block["content"]) == ("keep", "image", img)

    at = tool_result("a", "x" * 10)
    out = await gate_tool_result(at, tool_name="X", threshold=10, store=store)
    assert out.decision == "keep" and out.block is at  # persist only when strictly over

    mixed = [{"type": "text", "text": "x" * 50}, {"type": "document", "source": {}}]
    out = await gate_tool_result(tool_result("m", mixed), tool_name="X", threshold=10, store=store)
    assert (out.decision, out.reason) == ("keep", "not_persistable")

    out = await gate_tool_result(
        tool_result("u", "x" * 99), tool_name="R", threshold=math.inf, store=store
    )
    assert out.decision == "skip_unbounded_tool"
    assert store.writes == []

    over = tool_result("o", "y" * 11, is_error=True, cache_control={"type": "ephemeral"})
    out = await gate_tool_result(over, tool_name="X", threshold=10, store=store)
    assert out.decision == "persist" and out.path == "/mem/o.txt"
    assert out.block["is_error"] is True and out.block["cache_control"] == {"type": "ephemeral"}
    assert out.block["content"] == build_replacement("/mem/o.txt", 11, "y" * 11, False)
    assert store.writes == [("o", "y" * 11, "txt")]


@pytest.mark.asyncio
async def test_gate_text_block_list_goes_to_pretty_json() -> None:
    store = CountingStore()
    content = [{"type": "text", "text": "a" * 8}, {"type": "text", "text": "b" * 8}]
    out = await gate_tool_result(
        tool_result("j", content), tool_name="X", threshold=15, store=store
    )
    assert out.decision == "persist"
    assert store.writes == [("j", json.dumps(content, indent=2, ensure_ascii=False), "json")]


@pytest.mark.asyncio
async def test_gate_storage_error_keeps_original() -> None:
    block = tool_result("f", "z" * 20)
    store = CountingStore(fail=OSError(errno.ENOSPC, "No space left on device"))
    out = await gate_tool_result(block, tool_name="X", threshold=10, store=store)
    assert out.decision == "persist_failed" and out.block is block
    assert out.error == "OSError: ENOSPC (No space left on device)"


# -- grouping and selection ------------------------------------------------------------------


def test_groups_follow_the_wire() -> None:
    msgs = [
        user_text("go"),
        assistant("X", tool_use("a")),
        results(tool_result("a", "A")),
        assistant("Y", tool_use("b")),
        results(tool_result("b", "B")),
        assistant("X", tool_use("c")),
        Message(type="progress"),
        Message(type="system", subtype="turn_duration"),
        results(tool_result("c", "C")),
    ]
    groups = [[c.tool_use_id for c in g] for g in collect_groups(msgs)]
    assert groups == [["a"], ["b", "c"]]
    # and the wire agrees: trC joins trB's user message
    wire = to_api(msgs)
    last_user = [b["tool_use_id"] for b in wire[-1]["content"]]  # type: ignore[index]
    assert last_user == ["b", "c"]


def test_selection_is_largest_first_stable_and_skips_unpersistable() -> None:
    from stages.tool_result_budget import Candidate

    def cand(i: str, size: int, ok: bool = True) -> Candidate:
        return Candidate(0, i, "X", "", size, ok)

    fresh = [cand("a", 50), cand("b", 80), cand("c", 80), cand("d", 90, ok=False), cand("e", 10)]
    picked = [c.tool_use_id for c in select_fresh_to_replace(fresh, frozen_size=0, limit=150)]
    # total 310: d (90) cannot be persisted, b then c (stable on ties) bring it to 150
    assert picked == ["b", "c"]
    assert select_fresh_to_replace(fresh, frozen_size=0, limit=310) == []
    # frozen alone over the limit: every fresh one goes, the overage is accepted
    picked = [c.tool_use_id for c in select_fresh_to_replace(fresh, frozen_size=500, limit=100)]
    assert picked == ["b", "c", "a", "e"]


# -- the stage -------------------------------------------------------------------------------


def make_ctx(
    tmp_path: Path,
    *,
    store: Any = None,
    cap: float = 50_000,
    transcript: TranscriptWriter | None = None,
    exporter: SpanRecorder | None = None,
) -> SessionContext:
    tracer = exporter.tracer if exporter is not None else None
    return SessionContext(
        "sess-1",
        tmp_path / "store",
        store=store,
        tool_policies=ToolPolicies(declared={"Read": math.inf, "Bash": 30_000}, cap=cap),
        transcript=transcript,
        tracer=tracer,
    )


def parallel_turn(mid: str, sizes: dict[str, int], tool: str = "Other") -> list[Message]:
    """One response with parallel tool calls, then one user record per result."""
    out: list[Message] = [assistant(mid, *(tool_use(t, tool) for t in sizes))]
    out += [results(tool_result(t, f"<{t}>" + "x" * (n - len(t) - 2))) for t, n in sizes.items()]
    return out


def contents(msgs: list[Message]) -> dict[str, Any]:
    return {
        b["tool_use_id"]: b["content"]
        for m in msgs
        if m.type == "user" and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    }


@pytest.mark.asyncio
async def test_over_budget_group_persists_largest_then_reapplies_without_io(tmp_path: Path) -> None:
    store = CountingStore()
    ctx = make_ctx(tmp_path, store=store)
    pipe = Pipeline([ToolResultBudget(limit=100_000)])
    history = [user_text("go"), *parallel_turn("r1", {"a": 40_000, "b": 45_000, "c": 30_000})]
    out1 = await pipe.run(history, ctx)
    # 115K > 100K: the largest (b, 45K) goes, leaving 70K
    assert [w[0] for w in store.writes] == ["b"]
    assert contents(out1)["b"].startswith("<persisted-output>")
    assert contents(out1)["a"] == contents(history)["a"]
    state = ctx.replacement_state
    assert state.seen_ids == {key(t, c) for t, c in contents(history).items()}
    assert set(state.replacements) == {key("b", contents(history)["b"])}
    assert [p.tool_use_id for p in ctx.report.persisted] == ["b"]

    history2 = [*history, assistant("r2", {"type": "text", "text": "ok"}), user_text("more")]
    out2 = await pipe.run(history2, ctx)
    assert len(store.writes) == 1  # re-applied from the ledger, no I/O
    assert ctx.report.reapplied == 1 and ctx.report.persisted == []
    assert contents(out2)["b"] == contents(out1)["b"]
    # untouched messages pass through by reference
    assert out2[0] is history2[0] and out2[-1] is history2[-1]


@pytest.mark.asyncio
async def test_frozen_results_are_never_replaced_later(tmp_path: Path) -> None:
    """A same-id fragment brings a new result into a group the model already saw whole."""
    store = CountingStore()
    ctx = make_ctx(tmp_path, store=store)
    pipe = Pipeline([ToolResultBudget(limit=50_000)])
    turn = [
        user_text("go"),
        assistant("r1", tool_use("a", "Other")),
        results(tool_result("a", "a" * 45_000)),
    ]
    await pipe.run(turn, ctx)
    assert store.writes == []  # under budget: a is seen, frozen
    turn += [assistant("r1", tool_use("b", "Other")), results(tool_result("b", "b" * 20_000))]
    out = await pipe.run(turn, ctx)
    # 65K > 50K, but a is frozen: only the fresh b may go
    assert [w[0] for w in store.writes] == ["b"]
    assert contents(out)["a"] == "a" * 45_000


@pytest.mark.asyncio
async def test_frozen_alone_over_budget_is_accepted(tmp_path: Path) -> None:
    store = CountingStore()
    ctx = make_ctx(tmp_path, store=store)
    msgs = parallel_turn("r1", {"a": 40_000, "b": 40_000, "c": 5_000})
    sent = contents(msgs)
    # both were sent whole before
    ctx.replacement_state.seen_ids.update({key("a", sent["a"]), key("b", sent["b"])})
    out = await Pipeline([ToolResultBudget(limit=50_000)]).run(msgs, ctx)
    assert [w[0] for w in store.writes] == ["c"]  # the only fresh one
    assert contents(out)["a"] == contents(msgs)["a"] and contents(out)["b"] == contents(msgs)["b"]


@pytest.mark.asyncio
async def test_never_persist_tool_is_left_whole_and_out_of_the_sum(tmp_path: Path) -> None:
    store = CountingStore()
    ctx = make_ctx(tmp_path, store=store, exporter=(exp := SpanRecorder()))
    msgs = [
        assistant("r1", tool_use("read1", "Read"), tool_use("o1", "Other")),
        results(tool_result("read1", "r" * 45_000)),  # over the limit on its own
        results(tool_result("o1", "o" * 20_000)),
    ]
    out = await Pipeline([ToolResultBudget(limit=30_000)]).run(msgs, ctx)
    assert store.writes == []  # 20K without Read is under 30K
    assert contents(out) == contents(msgs)
    assert key("read1", "r" * 45_000) in ctx.replacement_state.seen_ids
    decisions = {
        s.attributes[ATTR.TOOL_CALL_ID]: s.attributes[ATTR.DECISION]
        for s in exp.decisions("tool_result_budget")
    }  # type: ignore[index]
    assert decisions == {"read1": "skip_unbounded_tool", "o1": "keep"}


@pytest.mark.asyncio
async def test_per_tool_gate_for_results_seen_first(tmp_path: Path) -> None:
    store = CountingStore()
    ctx = make_ctx(tmp_path, store=store)
    msgs = [assistant("r1", tool_use("b1", "Bash")), results(tool_result("b1", "x" * 30_001))]
    out = await Pipeline([ToolResultBudget()]).run(msgs, ctx)
    assert [w[0] for w in store.writes] == ["b1"]
    assert ctx.report.persisted[0].reason == "per_tool"
    assert contents(out)["b1"].startswith("<persisted-output>\nOutput too large (29.3KB).")


@pytest.mark.asyncio
async def test_unpersistable_candidate_is_passed_over(tmp_path: Path) -> None:
    store = CountingStore()
    ctx = make_ctx(tmp_path, store=store)
    mixed = [
        {"type": "text", "text": "m" * 40_000},
        {"type": "document", "source": {"type": "text"}},
    ]
    msgs = [
        assistant("r1", tool_use("m"), tool_use("s")),
        results(tool_result("m", mixed)),
        results(tool_result("s", "s" * 30_000)),
    ]
    out = await Pipeline([ToolResultBudget(limit=50_000)]).run(msgs, ctx)
    assert [w[0] for w in store.writes] == ["s"]
    assert contents(out)["m"] == mixed


@pytest.mark.asyncio
async def test_failed_write_keeps_original_and_freezes(tmp_path: Path) -> None:
    failing = CountingStore(fail=PermissionError(errno.EACCES, "Permission denied"))
    ctx = make_ctx(tmp_path, store=failing, exporter=(exp := SpanRecorder()))
    msgs = parallel_turn("r1", {"a": 40_000, "b": 40_000})
    pipe = Pipeline([ToolResultBudget(limit=50_000)])
    out = await pipe.run(msgs, ctx)
    assert out is msgs  # nothing could be replaced
    assert ctx.report.persist_failed == ["a"]
    assert ctx.replacement_state.seen_ids == {key(t, c) for t, c in contents(msgs).items()}
    assert not ctx.replacement_state.replacements
    failing.fail = None  # the store recovers; the frozen result must still never change
    assert await pipe.run(msgs, ctx) is msgs
    assert failing.writes == []
    decisions = exp.decisions("tool_result_budget")
    assert [s.attributes[ATTR.DECISION] for s in decisions] == [  # type: ignore[index]
        "keep",
        "persist_failed",
        "skip",  # the second pass: nothing fresh, nothing replaced to re-apply
    ]
    # which failure it was: EACCES is not ENOSPC or EROFS
    assert decisions[1].attributes[ATTR.ERROR] == (  # type: ignore[index]
        "PermissionError: EACCES (Permission denied)"
    )


@pytest.mark.asyncio
async def test_unchanged_input_returns_same_list_and_fields_kept(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, store=CountingStore())
    small = [assistant("r1", tool_use("a")), results(tool_result("a", "tiny"))]
    assert await Pipeline([ToolResultBudget()]).run(small, ctx) is small
    big = [
        assistant("r2", tool_use("z")),
        results(tool_result("z", "z" * 60_000, is_error=True, cache_control={"type": "ephemeral"})),
    ]
    out = await Pipeline([ToolResultBudget()]).run(big, ctx)
    block = out[1].content[0]  # type: ignore[index]
    assert block["is_error"] is True and block["cache_control"] == {"type": "ephemeral"}
    assert block["tool_use_id"] == "z" and block["type"] == "tool_result"
    assert big[1].content[0]["content"] == "z" * 60_000  # type: ignore[index]  # input untouched


@pytest.mark.asyncio
async def test_records_are_written_once_per_pass_and_resume_reproduces(tmp_path: Path) -> None:
    log = tmp_path / "session.jsonl"
    writer = TranscriptWriter(log, "sess-1")
    ctx = make_ctx(tmp_path, transcript=writer)
    pipe = Pipeline([ToolResultBudget(limit=50_000)])
    history = [user_text("go"), *parallel_turn("r1", {"a": 40_000, "b": 30_000})]
    writer.append_messages(history)
    out1 = await pipe.run(history, ctx)
    await pipe.run(history, ctx)  # nothing new: no second record
    loaded = load_transcript(log)
    entries = [json.loads(x) for x in log.read_text().splitlines() if '"content-replacement"' in x]
    assert len(entries) == 1 and entries[0]["sessionId"] == "sess-1"
    a = contents(history)["a"]
    assert loaded.replacement_records == [
        ReplacementRecord(
            "a", ctx.replacement_state.replacements[key("a", a)], digest=content_digest(a)
        )
    ]
    resumed = make_ctx(tmp_path)
    resumed.replacement_state = ReplacementState.reconstruct(
        loaded.messages, loaded.replacement_records
    )
    out_resumed = await pipe.run(loaded.messages, resumed)
    assert json.dumps(to_api(out_resumed)) == json.dumps(to_api(out1))
    assert resumed.replacement_state == ctx.replacement_state


def test_reconstruct_rules() -> None:
    msgs = [
        assistant("r1", tool_use("a"), tool_use("b"), tool_use("c")),
        results(tool_result("a", "A" * 10)),
        results(tool_result("b", "<persisted-output>\nalready\n</persisted-output>")),
        results(tool_result("c", "")),
    ]
    a = key("a", "A" * 10)
    records = [
        ReplacementRecord("a", "REP-A", digest=content_digest("A" * 10)),
        ReplacementRecord("gone", "REP-GONE", digest=content_digest("gone")),
        # made from other output than a's: never applied to a
        ReplacementRecord("a", "REP-OTHER", digest=content_digest("A" * 11)),
    ]
    state = ReplacementState.reconstruct(msgs, records)
    assert state.seen_ids == {a}  # b is not a candidate, c is empty
    assert state.replacements == {a: "REP-A"}  # verbatim; results no longer present skipped
    # a record written before results were bound to their content (no digest) binds to the
    # result with its id
    legacy = [ReplacementRecord("a", "REP-A"), ReplacementRecord("gone", "REP-GONE")]
    assert ReplacementState.reconstruct(msgs, legacy) == state


def test_reconstruct_binds_a_legacy_record_to_the_first_result_with_its_id() -> None:
    msgs = [
        assistant("r1", tool_use("a")),
        results(tool_result("a", "first")),
        assistant("r2", tool_use("a")),
        results(tool_result("a", "second")),
    ]
    state = ReplacementState.reconstruct(msgs, [ReplacementRecord("a", "REP-A")])
    assert state.replacements == {key("a", "first"): "REP-A"}
    assert state.replacement_for("a", "first") == "REP-A"
    assert state.replacement_for("a", "second") is None
    # sent before the last response: seen; the second one came after it: decided again
    assert state.seen_ids == {key("a", "first")}


def test_subagent_starts_from_a_copy(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    ctx.replacement_state.record_replacement(key("a", "A"), "R")
    child = ctx.for_subagent("agent-1")
    child.replacement_state.record_replacement(key("b", "B"), "S")
    assert by_id(ctx.replacement_state.replacements) == {"a": "R"}
    assert by_id(child.replacement_state.replacements) == {"a": "R", "b": "S"}
    assert ids(child.replacement_state.seen_ids) == {"a", "b"}
    assert len(child.replacement_state.seen_ids) == 2


@pytest.mark.asyncio
async def test_hostile_ids_are_stored_safely(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    hostile = "../../../etc/passwd"
    msgs = [assistant("r1", tool_use(hostile)), results(tool_result(hostile, "p" * 60_000))]
    out = await Pipeline([ToolResultBudget()]).run(msgs, ctx)
    assert isinstance(ctx.store, FileToolResultStore)
    files = list(ctx.store.directory.iterdir())
    assert len(files) == 1 and files[0].name.startswith("unsafe.")
    assert files[0].read_text() == "p" * 60_000
    assert str(files[0]) in contents(out)[hostile]


# -- spans -----------------------------------------------------------------------------------


def spans(exporter: SpanRecorder, name: str) -> list[ReadableSpan]:
    return exporter.named(name)


@pytest.mark.asyncio
async def test_spans_describe_groups_and_decisions_without_content(tmp_path: Path) -> None:
    exporter = SpanRecorder()
    ctx = make_ctx(tmp_path, exporter=exporter)
    marker = "SECRET-MARKER-"
    msgs = [
        assistant("r1", tool_use("a", "Other"), tool_use("b", "Other")),
        results(tool_result("a", marker * 3000)),
        results(tool_result("b", marker * 1000)),
    ]
    pipe = Pipeline([ToolResultBudget(limit=50_000)])
    await pipe.run(msgs, ctx)
    await pipe.run(msgs, ctx)
    (group,) = spans(exporter, SPAN_BUDGET_GROUP)
    assert group.attributes is not None
    assert group.attributes[ATTR.LIMIT] == 50_000
    assert group.attributes[ATTR.FRESH_CHARS] == len(marker) * 4000
    assert group.attributes[ATTR.FROZEN_CHARS] == 0
    assert group.attributes[ATTR.OUTCOME] == "persisted"
    made = [dict(s.attributes or {}) for s in exporter.decisions("tool_result_budget")]
    by_id = {str(a[ATTR.TOOL_CALL_ID]): a for a in made if ATTR.TOOL_CALL_ID in a}
    # the second pass decided nothing new: its own decision says it re-applied the first's
    [again] = [s for s in exporter.decisions("tool_result_budget") if s.attributes == made[-1]]
    assert again.name == "tool_result_budget.reapply"
    assert made[-1][ATTR.REASON] == "no_fresh_results" and made[-1][ATTR.REAPPLIED] == 1
    a = by_id["a"]
    assert a[ATTR.DECISION] == "persist" and a[ATTR.CHARS] == len(marker) * 3000
    assert str(a[ATTR.PATH]).endswith("/sess-1/tool-results/a.txt")
    assert by_id["b"][ATTR.DECISION] == "keep"
    stage_spans = [s for s in exporter.get_finished_spans() if s.name == "stage.tool_result_budget"]
    assert again.parent is not None and again.parent.span_id == stage_spans[1].context.span_id
    assert [s.attributes[ATTR.REAPPLIED] for s in stage_spans] == [0, 1]  # type: ignore[index]
    assert group.parent is not None and group.parent.span_id == stage_spans[0].context.span_id
    for s in exporter.get_finished_spans():
        for value in (s.attributes or {}).values():
            assert marker not in str(value)


@pytest.mark.asyncio
async def test_a_group_that_persisted_by_the_per_tool_limit_says_so(tmp_path: Path) -> None:
    # one Bash result over its 30,000 limit in a message far under the budget: the group's
    # outcome is "persisted" (its span once read under_budget beside persisted=1), the decision
    # says how far over which limit it was and what it freed, in integers
    exporter = SpanRecorder()
    ctx = make_ctx(tmp_path, exporter=exporter)
    msgs = parallel_turn("r1", {"a": 45_000, "b": 1_000}, tool="Bash")
    await Pipeline([ToolResultBudget(limit=200_000)]).run(msgs, ctx)
    (group,) = spans(exporter, SPAN_BUDGET_GROUP)
    g = dict(group.attributes or {})
    assert g[ATTR.OUTCOME] == "persisted" and g[ATTR.PERSISTED] == 1
    assert g[ATTR.CHARS_OVER] == 0  # the rest fits the per-message budget
    by_id = {a[ATTR.TOOL_CALL_ID]: a for a in exporter.decision_attributes("tool_result_budget")}
    a, b = by_id["a"], by_id["b"]
    assert (a[ATTR.DECISION], a[ATTR.REASON]) == ("persist", "per_tool")
    assert a[ATTR.LIMIT] == a[ATTR.LIMIT_PER_TOOL] == 30_000 and type(a[ATTR.LIMIT]) is int
    assert a[ATTR.CHARS_OVER] == 15_000
    assert a[ATTR.CHARS_FREED] == 45_000 - a[ATTR.REPLACEMENT_CHARS]
    assert g[ATTR.CHARS_FREED] == a[ATTR.CHARS_FREED]
    assert (b[ATTR.DECISION], b[ATTR.REASON], b[ATTR.CHARS_OVER]) == ("keep", "per_message", 0)


def test_the_grouping_scan_keeps_little_a_round() -> None:
    """What the budget's undoable scan keeps for a round of a held conversation (a call and
    its result), its result's key included: ~480 bytes. Kept as objects beside each step (an
    undo object for the result, a list of pairs for the call, a list per group), ~890; with
    an undo object and its names for every call, ~670; with a tuple of the result's one key,
    ~530. Undone step by step, the call's part read back from the call itself, it leaves
    nothing."""
    import gc
    import tracemalloc

    from stages._group_scan import GroupScan

    messages: list[Message] = []
    for k in range(2_000):
        tid = f"toolu_{k:06d}"
        call = {"type": "tool_use", "id": tid, "name": "Read", "input": {}}
        messages.append(Message.assistant([call], message_id=f"msg_{k}"))
        result = {"type": "tool_result", "tool_use_id": tid, "content": f"out {k} " + "x" * 300}
        messages.append(Message.user([result]))
    scan = GroupScan()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, m in enumerate(messages):
            scan.push(i, m, {}, set())
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept / 2_000 < 505
    assert [len(g) for g in scan.groups] == [1] * 2_000
    for i in range(len(messages) - 1, -1, -1):  # undone to nothing, step by step
        scan.pop(i, messages[i], {}, set())
    assert (scan.groups, scan.tool_names, scan.sizes, scan.first_pos) == ([], {}, {}, {})


@pytest.mark.parametrize("seed", range(20))
def test_the_grouping_scan_undone_to_any_point_is_the_scan_of_that_prefix(seed: int) -> None:
    """Answers that reuse a tool id (named before, or named with a non-string), fragments of
    one response, answers without an id: undone back to any message, the scan is the one of
    the messages before it."""
    import random

    from stages._group_scan import GroupScan

    rng = random.Random(seed)
    messages: list[Message] = []
    for k in range(40):
        if rng.random() < 0.5:
            calls = [
                {
                    "type": "tool_use",
                    "id": f"t{rng.randrange(12)}",
                    "name": rng.choice(["Read", "Bash", 7, ""]),
                    "input": {},
                }
                for _ in range(rng.randrange(3))
            ]
            rid = rng.choice([f"m{k}", f"m{k - 1}", None])
            ok = {"type": "text", "text": "ok"}
            messages.append(Message.assistant([*calls, ok], message_id=rid))
        else:
            outs = [tool_result(f"t{rng.randrange(12)}", "x" * rng.randrange(50)) for _ in "ab"]
            messages.append(Message.user(outs[: rng.randrange(1, 3)]))

    def scanned(upto: int) -> GroupScan:
        scan = GroupScan()
        for i, m in enumerate(messages[:upto]):
            scan.push(i, m, {}, set())
        return scan

    def state(scan: GroupScan) -> tuple[Any, ...]:
        keep = ("closed", "current", "tool_names", "assistant_ids", "first_pos", "cand_count")
        return tuple(getattr(scan, k) for k in keep)

    scan = scanned(len(messages))
    for cut in sorted(rng.sample(range(len(messages)), 6), reverse=True):
        while len(scan.undo) > cut:
            i = len(scan.undo) - 1
            scan.pop(i, messages[i], {}, set())
        assert state(scan) == state(scanned(cut))


@pytest.mark.asyncio
async def test_a_breakpoint_inside_a_persisted_result_stays_on_the_result(tmp_path: Path) -> None:
    """A client's ``cache_control`` on a text block inside a result that is persisted goes
    onto the result's block (the same one mark, about where it was), never lost; a mark on
    the result's block already is all it keeps."""
    ctx = make_ctx(tmp_path, store=CountingStore())
    mark = {"type": "ephemeral", "ttl": "1h"}
    inner = [
        {"type": "text", "text": "a" * 30_000},
        {"type": "text", "text": "b" * 30_000, "cache_control": mark},
    ]
    outer = {"type": "ephemeral"}
    big = [
        assistant("r1", tool_use("x"), tool_use("y")),
        results(tool_result("x", inner), tool_result("y", inner, cache_control=outer)),
    ]
    out = await Pipeline([ToolResultBudget()]).run(big, ctx)
    x, y = out[1].content  # type: ignore[misc]
    assert isinstance(x["content"], str) and x["cache_control"] == mark
    assert isinstance(y["content"], str) and y["cache_control"] == outer
    assert json.dumps([m.content for m in out]).count("cache_control") == 2


@pytest.mark.asyncio
async def test_a_never_persist_result_is_out_of_the_sum_on_every_pass(tmp_path: Path) -> None:
    """A never-persist tool's result (``Read``) is out of the per-message sum whether it came
    in this pass or an earlier one: how passes split a message never changes a decision."""
    use = assistant("r1", tool_use("r", "Read"), tool_use("o", "Other"))
    read = results(tool_result("r", "r" * 180_000))
    other = results(tool_result("o", "o" * 30_000))
    pipe = Pipeline([ToolResultBudget()])
    together = await pipe.run([use, read, other], make_ctx(tmp_path / "one"))
    ctx = make_ctx(tmp_path / "two")
    await pipe.run([use, read], ctx)
    split = await pipe.run([use, read, other], ctx)
    assert contents(together)["o"] == contents(split)["o"] == "o" * 30_000


@pytest.mark.asyncio
async def test_a_result_whose_write_failed_leaves_its_message_over_budget(tmp_path: Path) -> None:
    """A fresh result over its tool's limit whose write fails: the message is over budget by
    this pass's own failure (``over_budget``), not by what the model saw whole before."""
    failing = CountingStore(fail=OSError(errno.EIO, "I/O error"))
    ctx = make_ctx(tmp_path, store=failing, exporter=(exp := SpanRecorder()))
    await Pipeline([ToolResultBudget()]).run(parallel_turn("r1", {"big": 250_000}), ctx)
    (group,) = exp.attributes(SPAN_BUDGET_GROUP)
    assert group[ATTR.OUTCOME] == "over_budget"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"overrides": {"X": math.inf}}, "override for tool 'X' must be finite"),
        ({"overrides": {"X": math.nan}}, "must be a number"),
        ({"overrides": {"X": 0}}, "must be > 0"),
        ({"declared": {"X": -1}}, "must be > 0"),
        ({"cap": True}, "must be a number"),
    ],
)
def test_a_limit_the_policies_would_not_honour_is_refused(kwargs: Any, message: str) -> None:
    """An override is a finite number > 0 (an infinite one would be ignored: refused, not
    silently dropped); every limit is a number, not a bool."""
    with pytest.raises(ValueError, match=message):
        ToolPolicies(**kwargs)
