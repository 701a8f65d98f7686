"""Microcompact's clear index (settled results kept across passes, the rest scanned) answers
every question exactly as a scan of the whole history does, pass after pass."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import Message, Usage
from pipeline.incremental import AppendWatch
from pipeline.messages import SYNTHETIC_MODEL
from pipeline.results.keys import PERSISTED_OUTPUT_TAG
from pipeline.tokens import rough_tokens_for_messages
from stages._clear_index import ClearIndex
from stages._clearable import Gains, HistoryAt, rough_tokens_priced, scan_clearable
from stages._shared import CLEARED_PLACEHOLDER, last_response, tool_results
from tests.builders import tool_result, tool_use

TOOLS = frozenset({"Read", "Bash"})

CONTENTS: list[Any] = [
    "",
    "ok",
    "x" * 400,
    "y" * 3_000,
    CLEARED_PLACEHOLDER,
    f"{PERSISTED_OUTPUT_TAG}\nOutput too large. Full output saved to: /tmp/f.txt",
    f"{PERSISTED_OUTPUT_TAG}\nOutput too large. Saved to: /tmp/f.txt\n</persisted-output>",
    [],
    [{"type": "text", "text": "z" * 900}],
    [{"type": "text", "text": CLEARED_PLACEHOLDER}],
    [{"type": "text", "text": "a"}, {"type": "text", "text": "b" * 2_000}],
    [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}],
    None,
]


@st.composite
def turn(draw: st.DrawFn, n: int, earlier: list[str]) -> list[Message]:
    """One response (one or two fragments; usage on some) and the records answering it."""
    calls = draw(st.integers(0, 3))
    ids = []
    for k in range(calls):
        if earlier and draw(st.integers(0, 3)) == 0:
            ids.append(draw(st.sampled_from(earlier)))  # a reused id (hostile input)
        else:
            ids.append(f"t{n}_{k}")
    uses = [tool_use(t, draw(st.sampled_from(["Read", "Bash", "Task"]))) for t in ids]
    usage = Usage(input_tokens=100 * n + 1, output_tokens=5) if draw(st.booleans()) else None
    split = calls > 1 and draw(st.booleans())
    fragments = [uses[:1], uses[1:]] if split else [uses]
    results = [
        tool_result(t, draw(st.sampled_from(CONTENTS)))
        if draw(st.integers(0, 12))
        else {"type": "tool_result", "content": "no id"}
        for t in ids
    ]
    out = [Message.user(f"step {n}")] if draw(st.integers(0, 3)) == 0 else []
    extra = draw(st.integers(0, 11))
    if extra == 0:  # the conversation restarts from a summary after this record
        out += [
            Message(type="system", subtype="compact_boundary", content=""),
            Message.user(f"summary {n}"),
        ]
    elif extra == 1:  # an assistant record no API response produced (with or without usage)
        synthetic_usage = Usage(input_tokens=7, output_tokens=1) if draw(st.booleans()) else None
        out.append(
            Message.assistant(
                "interrupted", message_id=f"s{n}", usage=synthetic_usage, model=SYNTHETIC_MODEL
            )
        )
    for f, blocks in enumerate(fragments):
        last = f == len(fragments) - 1
        out.append(
            Message.assistant(
                [{"type": "text", "text": f"r{n}"}, *blocks],
                message_id=f"m{n}",
                usage=usage if last else None,
                model="claude-test",
            )
        )
        if split and not last:  # a result between two fragments of one streamed response
            out.append(Message.user(results[:1]))
    rest = results[1:] if split else results
    if rest:
        if draw(st.booleans()):
            out.append(Message.user(rest))
        else:
            out.extend(Message.user([r]) for r in rest)
    return out


def _eligible(found: Any, cleared: dict[str, str]) -> list[str]:
    return [r.tool_use_id for r in found.candidates(cleared) if not r.protected and r.reclaim > 0]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_view_answers_as_a_whole_history_scan(data: st.DataObject) -> None:
    history: list[Message] = [Message.user("start")]
    seen: list[str] = []
    cleared = {
        t: CLEARED_PLACEHOLDER for t in data.draw(st.sets(st.sampled_from(["t2_0", "t5_1"])))
    }
    watch, index = AppendWatch(), ClearIndex()
    gains: Gains = {}
    for n in range(data.draw(st.integers(1, 14))):
        new = data.draw(turn(n, seen))
        seen.extend(
            t for m in new for _, b in tool_results(m) if isinstance(t := b.get("tool_use_id"), str)
        )
        cut = data.draw(st.integers(0, len(new)))  # passes fall mid-turn too
        for part in (new[:cut], new[cut:]):
            history = history + part
            if data.draw(st.integers(0, 9)) == 0 and len(history) > 1:
                i = data.draw(st.integers(0, len(history) - 1))
                history[i] = dataclasses.replace(history[i])  # an equal copy: not growth
            grown = watch.advance(history)
            if grown is None:
                index.valid = False
            fresh = (
                [t for t in data.draw(st.lists(st.sampled_from(seen))) if t not in cleared]
                if seen
                else []
            )
            for t in dict.fromkeys(fresh):
                cleared[t] = CLEARED_PLACEHOLDER
            index.note_cleared(dict.fromkeys(fresh))
            if data.draw(st.booleans()):  # a pass that does not clear folds in what settled
                _fold_quietly(history, watch, index, cleared, gains)
            _check(history, watch, index, cleared, gains, seen)
            first = data.draw(st.integers(0, len(history)))
            _check_rough_tokens(history, index, gains, first, data.draw(st.integers(1, 4)))


def _fold_quietly(
    history: list[Message], watch: AppendWatch, index: ClearIndex, cleared: dict[str, str],
    gains: Gains,
) -> None:  # fmt: skip
    response = last_response(history, watch.start)
    turn_start = response[0] if response is not None else watch.start - 1
    was_valid = index.valid
    at = HistoryAt(history, watch.start, turn_start, watch.tool_names, TOOLS)
    folded = index.fold(at, cleared, gains, afresh=False)
    assert folded or not was_valid or index.start != watch.start  # only an edit defers it


def _check_rough_tokens(
    history: list[Message], index: ClearIndex, gains: Gains, first: int, every: int
) -> None:
    """The cache-rewrite count: the rough tokens of an output from ``first`` on, settled
    records it still holds read from the index, the rest priced (gains reused)."""
    out = [m if k % every else dataclasses.replace(m) for k, m in enumerate(history)]
    assert rough_tokens_priced(history, gains) == rough_tokens_for_messages(history)
    assert index.rough_tokens_after(out, history, first, gains) == rough_tokens_for_messages(
        out[first:]
    )


def _check(
    history: list[Message],
    watch: AppendWatch,
    index: ClearIndex,
    cleared: dict[str, str],
    gains: Gains,
    seen: list[str],
) -> None:
    start, names = watch.start, watch.tool_names
    response = last_response(history, start)
    turn_start = response[0] if response is not None else start - 1
    full = scan_clearable(history, start, turn_start, names, TOOLS)
    view = index.view(HistoryAt(history, start, turn_start, names, TOOLS), cleared, gains)
    for tid in set(seen) | set(full.results):
        assert (tid in view) == (tid in full.results), tid
        assert view.get(tid) == full.results.get(tid), tid
    for keep in range(6):
        assert view.newest_ids(keep) == full.newest_ids(keep), keep
    assert _eligible(view, cleared) == _eligible(full, cleared)
    assert view.kept(cleared) == full.kept(cleared)
    assert view.newest_turn_ids == full.newest_turn_ids


def test_a_settled_result_with_nothing_to_reclaim_becomes_eligible_by_a_later_occurrence() -> None:
    # t0 settles with a tiny output (nothing to reclaim); its id comes back, large, in the
    # unsettled part (the responses since carry no usage, so the anchor stays behind)
    history = [
        Message.user("start"),
        Message.assistant([tool_use("t0", "Read")], message_id="m0", usage=Usage(10, 5)),
        Message.user([tool_result("t0", "ok")]),
        Message.assistant([tool_use("t1", "Read")], message_id="m1", usage=Usage(20, 5)),
        Message.user([tool_result("t1", "ok")]),
        Message.assistant([tool_use("t2", "Bash")], message_id="m2"),
        Message.user([tool_result("t0", "y" * 3_000), tool_result("t2", "z" * 3_000)]),
        Message.assistant([tool_use("t3", "Bash")], message_id="m3"),
        Message.user([tool_result("t3", "w")]),
    ]
    watch, index = AppendWatch(), ClearIndex()
    watch.advance(history)
    response = last_response(history, 0)
    assert response is not None
    names = watch.tool_names
    full = scan_clearable(history, 0, response[0], names, TOOLS)
    view = index.view(HistoryAt(history, 0, response[0], names, TOOLS), {}, {})
    assert index.settled == 3 and "t0" in index.results  # t0's first occurrence is settled
    assert _eligible(view, {}) == _eligible(full, {}) == ["t0", "t2"]


def test_a_result_in_a_mapping_that_is_not_a_dict_still_counts_as_a_key() -> None:
    """The stages read tool_results from any mapping block, so the append watch counts their
    ids too: a later tool_use naming one is not growth, and the index is rebuilt."""
    history = [
        Message.user("start"),
        Message.assistant([tool_use("a", "Read")], message_id="m0", usage=Usage(10, 5)),
        Message.user([MappingProxyType(tool_result("x", "y" * 3_000))]),
    ]
    watch = AppendWatch()
    watch.advance(history)
    later = [Message.assistant([tool_use("x", "Read")], message_id="m1", usage=Usage(20, 5))]
    assert watch.advance(history + later) is None
