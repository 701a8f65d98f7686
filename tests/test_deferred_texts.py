"""Tool outputs left in the transcript file until the replay reaches them, and put back once no
later request can carry them: the same requests, byte for byte, holding a fraction of the text."""

from __future__ import annotations

import hashlib
import json
import random
import string
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from pipeline import Message, Pipeline, SessionContext, ToolPolicies, TranscriptWriter, Usage
from pipeline.testing import MemoryStore, QuietLogger
from pipeline.transcript.read import load_transcript
from pipeline.transcript.replay import replay_messages
from pipeline.wire.cache import WireCache
from pipeline.wire.deferred import DeferredText, TranscriptChanged, deferred_in, fill
from stages import default_stages
from tests.benchmarks.long_session import write as write_long_session
from tests.builders import assistant, results, tool_result, tool_use, user_text
from tests.conftest import corpus_params

LONG = "line of output\n" * 400  # 6,000 characters


def _session(path: Path) -> Path:
    TranscriptWriter(path, "s").append_messages(
        [
            user_text("go"),
            assistant("m1", tool_use("t1"), tool_use("t2"), usage=Usage(input_tokens=10)),
            results(tool_result("t1", LONG)),
            results(tool_result("t2", "short")),
            assistant("m2", {"type": "text", "text": "done"}, usage=Usage(input_tokens=1600)),
        ]
    )
    return path


def _outputs(messages: Sequence[Message]) -> list[Any]:
    return [
        b["content"]
        for m in messages
        if m.type == "user" and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    ]


def test_long_outputs_stay_in_the_file_until_read(tmp_path: Path) -> None:
    path = _session(tmp_path / "s.jsonl")
    t = load_transcript(path, defer_texts=1024)
    long, short = _outputs(t.messages)
    assert type(long) is DeferredText and long.chars == len(LONG) and short == "short"
    assert t.deferred_texts == 1
    (block,) = [b for m in t.messages for b in deferred_in(m.content)]
    assert fill(block) is long and block["content"] == LONG
    assert fill(block) is None  # read once
    whole = load_transcript(path)
    assert _outputs(whole.messages) == [LONG, "short"] and whole.deferred_texts == 0


def test_a_byte_order_mark_moves_no_output(tmp_path: Path) -> None:
    path = _session(tmp_path / "s.jsonl")
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    (block,) = [
        b
        for m in load_transcript(path, defer_texts=1).messages
        for b in deferred_in(m.content)
        if b["tool_use_id"] == "t1"
    ]
    fill(block)
    assert block["content"] == LONG


@pytest.mark.parametrize(
    "change",
    [
        lambda text: text.replace("line of output", "LINE OF OUTPUT"),  # the same length
        lambda text: text.replace('"t1"', '"t9"'),
        lambda text: text.replace("line of output", "line"),  # the lines move
        lambda text: "",
    ],
)
def test_a_transcript_changed_after_loading_is_named_never_misread(
    tmp_path: Path, change: Any
) -> None:
    path = _session(tmp_path / "s.jsonl")
    t = load_transcript(path, defer_texts=1024)
    (block,) = [b for m in t.messages for b in deferred_in(m.content)]
    path.write_text(change(path.read_text()))
    with pytest.raises(TranscriptChanged, match=r"s\.jsonl: the output of .t1.*changed after"):
        fill(block)


def test_a_transcript_gone_after_loading_is_named(tmp_path: Path) -> None:
    path = _session(tmp_path / "s.jsonl")
    (block,) = [
        b for m in load_transcript(path, defer_texts=1024).messages for b in deferred_in(m.content)
    ]
    path.unlink()
    with pytest.raises(TranscriptChanged, match="cannot be read again: No such file"):
        fill(block)


def test_a_repeated_record_is_still_read_once(tmp_path: Path) -> None:
    path = _session(tmp_path / "s.jsonl")
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join([*lines[:3], lines[2], *lines[3:]]))
    t = load_transcript(path, defer_texts=1024)
    assert len(t.repeated) == 1 and len(t.messages) == 5


def test_a_bad_threshold_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="defer_texts must be at least 1"):
        load_transcript(_session(tmp_path / "s.jsonl"), defer_texts=0)


def test_putting_back_needs_requests_read_one_at_a_time(tmp_path: Path) -> None:
    t = load_transcript(_session(tmp_path / "s.jsonl"), defer_texts=1024)
    ctx = SessionContext("s", tmp_path, store=MemoryStore(), logger=QuietLogger(keep=False))

    async def go() -> None:
        async for _ in replay_messages(t.messages, Pipeline([]), ctx, release=True):
            pass

    with pytest.raises(ValueError, match="release=True needs shared=True"):
        anyio.run(go)


def test_the_wire_cache_names_the_results_a_request_no_longer_carries() -> None:
    block = tool_result("t1", LONG)
    first = [user_text("go"), assistant("m1", tool_use("t1")), results(block)]
    cleared = [*first[:2], results(tool_result("t1", "[cleared]")), user_text("next")]
    wire = WireCache(track_dropped=True)
    wire.to_api(first, shared=True)
    assert wire.dropped == []
    wire.to_api(cleared, shared=True)
    assert len(wire.dropped) == 1 and wire.dropped[0] is block
    wire.to_api([*cleared, assistant("m2", tool_use("t2"))], shared=True)
    assert wire.dropped == []  # the last call's only


def test_the_budget_keeps_no_output_it_decided(tmp_path: Path) -> None:
    """A decided result's output is no longer the budget's to hold: once the records let go
    of it, nothing keeps it alive."""
    ctx = SessionContext("s", tmp_path, store=MemoryStore(), logger=QuietLogger(keep=False))
    messages = [
        user_text("go"),
        assistant("m1", tool_use("t1"), tool_use("t2"), usage=Usage(input_tokens=10)),
        results(tool_result("t1", LONG), tool_result("t2", "x" * 60_000)),
    ]
    anyio.run(Pipeline(default_stages()).run, messages, ctx)
    scan = ctx.stage_state["tool_result_budget"].scan
    candidates = [c for g in scan.groups for c in g]
    assert len(candidates) == 2 and all(c.content is None for c in candidates)


def _replayed(
    path: Path, *, defer: bool, every: int, pipe: Pipeline | None = None
) -> tuple[list[Any], Any]:
    """Per call: its chars, estimate and persisted ids, and every ``every``-th request whole
    (as a digest); and the transcript replayed."""
    t = load_transcript(path, strict=False, defer_texts=1024 if defer else None)
    ctx = SessionContext(
        "r",
        tempfile.mkdtemp(),
        store=MemoryStore(),
        tool_policies=ToolPolicies.claude_code(),
        logger=QuietLogger(keep=False),
    )
    seen: list[Any] = []

    async def go() -> None:
        n = 0
        async for r in replay_messages(
            t.messages,
            pipe or Pipeline(default_stages()),
            ctx,
            requests=t.requests,
            shared=True,
            release=defer,
        ):
            whole = None
            if n % every == 0:
                data = json.dumps(r.request, ensure_ascii=False).encode("utf-8", "surrogatepass")
                whole = hashlib.sha256(data).hexdigest()
            seen.append(
                (r.request_chars, r.estimated_tokens, [p.tool_use_id for p in r.persisted], whole)
            )
            n += 1
        last = json.dumps(r.request, ensure_ascii=False).encode("utf-8", "surrogatepass")
        seen.append(hashlib.sha256(last).hexdigest())

    anyio.run(go)
    return seen, t


def test_a_replay_that_puts_outputs_back_sends_the_same_bytes(tmp_path: Path) -> None:
    path = write_long_session(tmp_path / "long.jsonl", 700)
    plain, _ = _replayed(path, defer=False, every=1)
    deferred, t = _replayed(path, defer=True, every=1)
    assert deferred == plain
    assert t.deferred_texts > 200
    # outputs cleared or previewed went back to the file (the digests above: never one a
    # request carried)
    assert sum(1 for m in t.messages for _ in deferred_in(m.content)) > 10


@pytest.mark.parametrize("session", corpus_params())
def test_real_sessions_replay_alike_with_outputs_put_back(session: Path) -> None:
    plain, _ = _replayed(session, defer=False, every=25)
    deferred, _ = _replayed(session, defer=True, every=25)
    assert deferred == plain


def test_the_replay_command_names_a_transcript_changed_under_it(tmp_path: Path) -> None:
    """One line and exit 1, never a traceback nor another output sent."""
    from pipeline._cli.common import EXIT_FAILED, CliError, ReplayOptions, StoreDir, load
    from pipeline._cli.replay_cmd import run_replay

    path = _session(tmp_path / "s.jsonl")
    t = load(path, lenient=False, defer_texts=1024)
    path.write_text(path.read_text().replace("line of output", "LINE OF OUTPUT"))
    store = StoreDir(tmp_path / "store", temporary=False, kept=True)
    with pytest.raises(CliError, match="changed after it was loaded") as raised:
        run_replay(t, ReplayOptions(json=True, progress=False), None, store)
    assert raised.value.code == EXIT_FAILED


def _write(path: Path, records: list[Message]) -> Path:
    TranscriptWriter(path, "s").append_messages(records)
    return path


@pytest.mark.parametrize(
    "second",
    [
        tool_result("t1", [{"type": "text", "text": "B" * 300_000}]),  # a list: persisted
        tool_result("t1", "C" * 300_000),  # a string: persisted and deferred too
    ],
)
def test_an_output_whose_id_comes_twice_is_never_put_back(tmp_path: Path, second: Any) -> None:
    """A stage that clears or previews by id may give an output back when its id comes
    again: those stay read."""
    path = _write(
        tmp_path / "s.jsonl",
        [
            user_text("go"),
            assistant("m1", tool_use("t1"), usage=Usage(input_tokens=10)),
            results(tool_result("t1", "A" * 5000)),
            results(second),
            assistant("m2", tool_use("t2"), usage=Usage(input_tokens=2000)),
            results(tool_result("t2", "ok")),
            assistant("m3", {"type": "text", "text": "done"}, usage=Usage(input_tokens=2100)),
        ],
    )
    _alike_and_every_output_read(path)


def _alike_and_every_output_read(path: Path) -> None:
    plain, _ = _replayed(path, defer=False, every=1)
    deferred, t = _replayed(path, defer=True, every=1)
    assert deferred == plain
    assert not [b for m in t.messages for b in deferred_in(m.content)]


def test_an_output_with_harness_text_is_never_put_back(tmp_path: Path) -> None:
    """Harness text after an output is read from the output again when a stage re-applies a
    clear: an output that carries some stays read."""
    tail = "\n\n<system-reminder>remember</system-reminder>"
    path = _write(
        tmp_path / "s.jsonl",
        [
            user_text("go"),
            assistant("m1", tool_use("t1"), usage=Usage(input_tokens=10)),
            results(tool_result("t1", "A" * 60_000 + tail)),  # persisted: previewed
            assistant("m2", {"type": "text", "text": "done"}, usage=Usage(input_tokens=2000)),
        ],
    )
    _alike_and_every_output_read(path)


def test_a_pipeline_that_may_read_an_output_again_puts_none_back(tmp_path: Path) -> None:
    from pipeline._cli.common import ReplayOptions
    from pipeline._cli.replay_cmd import deferred_from
    from pipeline.core import rereading_stages
    from stages import ToolResultBudget

    assert rereading_stages(Pipeline(default_stages())) == []
    assert deferred_from(ReplayOptions()) == 1024
    rescanning = ReplayOptions(stage_specs=("microcompact=clear-every-turn",))
    assert deferred_from(rescanning) is None
    assert rereading_stages(rescanning.pipeline()) == ["microcompact"]
    pipe = Pipeline([ToolResultBudget(incremental=False)])
    t = load_transcript(_session(tmp_path / "s.jsonl"), defer_texts=1024)
    ctx = SessionContext("s", tmp_path, store=MemoryStore(), logger=QuietLogger(keep=False))

    async def go() -> None:
        async for _ in replay_messages(t.messages, pipe, ctx, shared=True, release=True):
            pass

    with pytest.raises(ValueError, match="tool_result_budget may read an output again"):
        anyio.run(go)


def _past_the_price_cache(path: Path, calls: int) -> Path:
    """More records than the token estimator's price cache holds (4,096) before the calls,
    then calls whose long outputs microcompact clears and history snip prices again."""
    rng = random.Random(1)
    records = [user_text("Start."), *(user_text(f"note {k}") for k in range(4_200))]
    for i in range(calls):
        tid = f"toolu_{i:04d}"
        cached = Usage(input_tokens=3, cache_read_input_tokens=1_000 + 2_000 * i, output_tokens=20)
        records.append(
            assistant(f"msg_{i:04d}", tool_use(tid, "Notes" if i % 2 else "Bash"), usage=cached)
        )
        lines = ("".join(rng.choices(string.ascii_letters + " ", k=89)) for _ in range(88))
        records.append(results(tool_result(tid, tid + "\n" + "\n".join(lines))))
    records.append(assistant("msg_end", {"type": "text", "text": "done"}))
    return _write(path, records)


def test_a_stage_that_prices_a_put_back_output_again_reads_it_from_the_file(
    tmp_path: Path,
) -> None:
    """History snip prices its input again once the estimator's cache has let a record go;
    the outputs microcompact cleared are still in that input: each is read from the file
    for it, so the snip decides as it would have."""
    path = _past_the_price_cache(tmp_path / "s.jsonl", 40)
    stages = (
        "microcompact=clear-oldest:trigger_tokens=10000:min_reclaim_tokens=1000:keep=3",
        "history_snip=snip-middle:context_window=20000:keep_recent_rounds=2",
    )
    from pipeline._cli.common import pipeline_for

    plain, _ = _replayed(path, defer=False, every=4, pipe=pipeline_for(stages, 200_000))
    deferred, t = _replayed(path, defer=True, every=4, pipe=pipeline_for(stages, 200_000))
    assert deferred == plain
    assert sum(1 for m in t.messages for _ in deferred_in(m.content)) > 10  # put back


def test_a_session_that_reuses_a_tool_id_puts_no_output_back(tmp_path: Path) -> None:
    """History snip gives a snipped run back when a reused id makes a pair cross its cut:
    in such a session every output stays read."""
    from pipeline._cli.common import pipeline_for

    records = [user_text("go")]
    for i in range(60):
        tid = "t5" if i == 40 else f"t{i}"  # call 40 reuses call 5's id
        usage = Usage(input_tokens=100 + 1400 * i)
        records.append(assistant(f"m{i}", tool_use(tid, "Read"), usage=usage))
        records.append(results(tool_result(tid, f"output {i}\n" + "x" * 5000)))
    done = {"type": "text", "text": "done"}
    records.append(assistant("end", done, usage=Usage(input_tokens=90000)))
    path = _write(tmp_path / "s.jsonl", records)
    snip = ("history_snip=snip-middle:context_window=30000",)
    plain, _ = _replayed(path, defer=False, every=1, pipe=pipeline_for(snip, 200_000))
    deferred, t = _replayed(path, defer=True, every=1, pipe=pipeline_for(snip, 200_000))
    assert deferred == plain
    assert not [b for m in t.messages for b in deferred_in(m.content)]
