"""``WireCache.to_api`` equals ``to_api`` on every call of a growing, sometimes edited history.

Records come from the same generator as ``to_api``'s own property (late fragments of earlier
responses, interleaved results, prompts, attachments, local commands, compact boundaries,
empty records). A history is fed in growing prefixes, as an agent or a replay calls; between
calls the caller sometimes edits, drops or reorders records, or starts a new list. Every
call's request must be ``to_api``'s, byte for byte, and :attr:`WireCache.chars` must be
``request_chars`` of it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import Message, to_api
from pipeline.kept_list import KeptList
from pipeline.messages import REMINDER
from pipeline.testing import RecordReads
from pipeline.wire.cache import WireCache, request_chars
from pipeline.wire.caching import place_cache_breakpoint
from pipeline.wire.pairing import PairingError, check_pairing
from tests.builders import results, tool_result, tool_use, user_text
from tests.edit_support import records

EXAMPLES = 1_500


def _same_shape(m: Message, data: st.DataObject, pool: list[dict[str, object]]) -> Message:
    """``m`` with other content of the same wire shape: the same kinds of blocks and ids (what
    a stage clearing old results makes). Any subset of its blocks changes (none, too: a new
    record of the same blocks); a new block may carry a lone surrogate or a breakpoint, or be
    a text block another record already holds (``pool``: the one object in two records)."""
    if isinstance(m.content, str):
        return m.with_content(m.content + "'" if m.content else "")
    blocks = []
    for b in m.content:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind is None or not data.draw(st.booleans()):
            blocks.append(b)
            continue
        tail = data.draw(st.sampled_from(["'", "\ud800", "\u2192"]))
        if kind == "text":
            shared = [t for t in pool if t is not b]
            if shared and data.draw(st.booleans()):
                b = data.draw(st.sampled_from(shared))
            else:
                b = {**b, "text": f"{b.get('text')}{tail}"}
                pool.append(b)
        elif kind == "tool_result":
            b = {**b, "content": f"[cleared]{tail}"}
        elif kind == "tool_use":
            b = {**b, "input": {"edited": tail}}
        if data.draw(st.integers(0, 4)) == 0:
            b = {**b, "cache_control": {"type": "ephemeral"}}
        blocks.append(b)
    return m.with_content(blocks)


def _reshape(view: list[Message], data: st.DataObject) -> None:
    """Replace up to three records by records of the same shape, in place."""
    pool: list[dict[str, object]] = [
        b
        for m in view
        if isinstance(m.content, list)
        for b in m.content
        if isinstance(b, dict) and b.get("type") == "text"
    ]
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(view) - 1))
        view[i] = _same_shape(view[i], data, pool)


def _hold_again(view: list[Message], data: st.DataObject) -> None:
    """Add a record holding a block object the history already holds (in a prompt, twice in
    one record, in a reminder, in a fragment of an earlier response): which of its holders
    put it where in the request is then not the block's to say."""
    held = [
        (m, b)
        for m in view
        if isinstance(m.content, list)
        for b in m.content
        if isinstance(b, dict) and b.get("type") in ("text", "tool_result")
    ]
    if not held:
        return
    m, b = data.draw(st.sampled_from(held))
    how = data.draw(st.sampled_from(["user", "twice", "reminder", "fragment"]))
    if how == "twice" or b.get("type") != "text":
        view.append(Message.user([b, b]))
    elif how == "reminder":
        view.append(Message(type="attachment", subtype=REMINDER, content=[b]))
    elif how == "fragment" and m.type == "assistant":
        view.append(Message.assistant([b], message_id=m.message_id))
    else:
        view.append(Message.user([b]))


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None)
@given(records(), st.lists(st.integers(0, 9), min_size=1, max_size=12), st.data())
def test_incremental_request_equals_to_api(
    history: list[Message], steps: list[int], data: st.DataObject
) -> None:
    cache = WireCache()
    view: list[Message] = []
    for step in steps:
        cut = data.draw(st.integers(len(view), max(len(view), len(history))))
        view = view + history[len(view) : cut]
        if step == 0 and view:  # an edit somewhere
            i = data.draw(st.integers(0, len(view) - 1))
            view[i] = user_text(f"edited {i}")
        elif step == 1 and view:  # a record dropped
            del view[data.draw(st.integers(0, len(view) - 1))]
        elif step == 2 and len(view) > 1:  # two swapped
            view[0], view[-1] = view[-1], view[0]
        elif step == 3:  # the same records in a new list
            view = list(view)
        elif step in (4, 5) and view:  # content cleared in place, as a stage clears results
            _reshape(view, data)
        elif step == 6:
            _hold_again(view, data)
        request = cache.to_api(view)
        expected = to_api(view)
        assert json.dumps(request) == json.dumps(expected)
        assert cache.chars == request_chars(expected)
        assert cache.pairing.problems == check_pairing(expected)
        # what a caller may edit: the last messages, as its own copies
        for param in request[-cache.editable :]:
            assert all(param is not p for p in cache.to_api(view))


@pytest.mark.slow
@settings(max_examples=EXAMPLES // 2, deadline=None)
@given(records(), st.lists(st.integers(0, 9), min_size=1, max_size=12), st.data())
def test_a_shared_request_of_a_kept_history_equals_to_api(
    history: list[Message], steps: list[int], data: st.DataObject
) -> None:
    """The replay's way: the history is one kept list changed in place (its log asks it what
    changed) and the request is the cache's own list, brought up to date in place; a caller
    marks the last block of each request, or places a cache breakpoint as the agent does (on
    the last block that can carry one, perhaps before the editable messages) and says where."""
    cache = WireCache()
    view: KeptList[Message] = KeptList()
    for step in steps:
        view.extend(
            history[len(view) : data.draw(st.integers(len(view), max(len(view), len(history))))]
        )
        if step == 0 and view:
            i = data.draw(st.integers(0, len(view) - 1))
            view[i] = user_text(f"edited {i}")
        elif step == 1 and view:
            del view[data.draw(st.integers(0, len(view) - 1))]
        elif step == 2 and len(view) > 1:
            view[0], view[-1] = view[-1], view[0]
        elif step == 3:
            view = KeptList(view)
        elif step == 4 and view:
            view.insert(data.draw(st.integers(0, len(view))), view.pop())
        elif step in (5, 6) and view:
            _reshape(view, data)
        elif step == 7:  # nothing at the end can carry a breakpoint: it goes further back
            thinking = {"type": "thinking", "thinking": "t", "signature": "s"}
            view += [Message.assistant([thinking], message_id=f"th{len(view)}"), user_text("p")]
        elif step == 8:
            _hold_again(view, data)
        request = cache.to_api(view, shared=True)
        expected = to_api(view)
        assert json.dumps(request) == json.dumps(expected)
        assert cache.to_api(view, shared=True) is request
        assert cache.chars == request_chars(expected)
        assert cache.pairing.problems == check_pairing(expected)
        if data.draw(st.booleans()):  # as the agent marks it: on an older message, if need be
            marked = place_cache_breakpoint(request)
            if marked is not None:
                cache.replaced(marked)
            continue
        content = request[-1]["content"] if request else ""
        if isinstance(content, list) and content:
            content[-1] = {**content[-1], "cache_control": {"type": "ephemeral"}}
    assert json.dumps(cache.to_api(view, shared=True)) == json.dumps(to_api(view))


def _fed_tool_loop() -> tuple[RecordReads, WireCache, list[Message]]:
    """A watched 50-round tool loop (101 records) and a cache that has built its request."""
    reads = RecordReads()
    cache = WireCache()
    history: list[Message] = [user_text("start")]
    for k in range(50):
        history += [
            Message.assistant([tool_use(f"u{k}")], message_id=f"r{k}"),
            results(tool_result(f"u{k}", "x" * k)),
        ]
    history = reads.watch(history)
    cache.to_api(history)
    return reads, cache, history


def test_a_grown_history_feeds_only_the_new_records() -> None:
    """The point of the cache: a grown history costs its new records, not the whole list."""
    reads, cache, history = _fed_tool_loop()
    assert reads.records == len(history)  # the first call reads everything
    history.append(user_text("and more"))  # merges into the last user message
    reads.reset()
    request = cache.to_api(history)
    assert reads.records == 0  # none of the 101 old records is read again
    assert json.dumps(request) == json.dumps(to_api(history))


def test_earlier_messages_are_shared_from_call_to_call() -> None:
    """What keeps a long session's requests linear: a call copies no message but the last
    ``editable``; the others are the very objects of the previous request."""
    cache = WireCache(editable=2)
    history: list[Message] = [user_text("start")]
    for k in range(30):
        history += [
            Message.assistant([tool_use(f"u{k}")], message_id=f"r{k}"),
            results(tool_result(f"u{k}", "x")),
        ]
    first = cache.to_api(history)
    history += [Message.assistant([tool_use("v")], message_id="rv"), results(tool_result("v", "y"))]
    second = cache.to_api(history)
    assert all(a is b for a, b in zip(first[:-2], second, strict=False))
    assert not any(a is b for a, b in zip(first[-2:], second[-4:-2], strict=True))


def test_pairing_problems_follow_the_request() -> None:
    cache = WireCache()
    history: list[Message] = [
        user_text("start"),
        Message.assistant([tool_use("u")], message_id="r"),
    ]
    cache.to_api(history)
    with pytest.raises(PairingError, match="unanswered_tool_use 'u'"):
        cache.ensure_paired()
    history.append(results(tool_result("u", "ok")))
    cache.to_api(history)
    cache.ensure_paired()  # answered: no problem left
    history.append(results(tool_result("ghost", "?")))
    cache.to_api(history)
    assert [p.kind for p in cache.pairing.problems] == ["orphan_tool_result"]


def test_a_caller_may_edit_the_request_it_got() -> None:
    """Adding a cache breakpoint to the last block of a returned request (a new block in the
    message's content list) never leaks into the next request."""
    cache = WireCache()
    history: list[Message] = [user_text("start")]
    for k in range(4):
        history += [
            Message.assistant([tool_use(f"u{k}")], message_id=f"r{k}"),
            results(tool_result(f"u{k}", "x")),
        ]
        request = cache.to_api(history)
        content = request[-1]["content"]
        assert isinstance(content, list)
        content[-1] = {**content[-1], "cache_control": {"type": "ephemeral"}}
        request[-1] = {**request[-1], "role": "user"}
    assert cache.to_api(history) == to_api(history)
    assert "cache_control" not in json.dumps(cache.to_api(history))


def test_a_record_to_api_rejects_raises_every_time_and_the_cache_recovers() -> None:
    class NotABlock:
        pass

    cache = WireCache()
    good: list[Message] = [user_text("start"), Message.assistant([tool_use("u")], message_id="r")]
    cache.to_api(good)
    bad = [*good, Message.user([NotABlock()])]  # type: ignore[list-item]
    for _ in range(3):
        try:
            cache.to_api(bad)
        except ValueError as exc:  # what to_api itself raises, naming the record
            assert "content item 0 is a NotABlock" in str(exc)
        else:
            raise AssertionError("a record to_api rejects went through")
    grown = [*good, results(tool_result("u", "fine"))]
    assert cache.to_api(grown) == to_api(grown)


def test_an_edit_redoes_only_what_follows_it() -> None:
    """A stage that clears a few old results rewrites records near the end: the cache rolls
    back to the first one and reads none before it."""
    reads, cache, history = _fed_tool_loop()
    edited = list(history)
    edited[90] = results(tool_result("u44", "[cleared]"))  # the 45th result
    reads.reset()
    request = cache.to_api(edited)
    assert reads.records <= len(history) - 88  # from the rolled-back entry on, nothing older
    assert json.dumps(request) == json.dumps(to_api(edited))


def test_wire_cache_is_importable_from_pipeline_wire() -> None:
    import pipeline.wire as wire
    import pipeline.wire.cache as wire_cache

    assert wire.WireCache is wire_cache.WireCache
    assert wire.request_chars is wire_cache.request_chars
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        wire.nothing  # noqa: B018


@pytest.mark.parametrize(
    ("used", "answered", "now"),
    [
        (1, 1, True),
        (1, 1, 1.0),
        ({"a": 1, "b": 2}, {"a": 1, "b": 2}, {"b": 2, "a": 1}),
        (True, 1, True),
    ],
)
def test_an_id_replaced_by_an_equal_value_of_another_kind_repairs_the_pairing(
    used: object, answered: object, now: object
) -> None:
    """Ids that compare equal may still pair differently (the pairing keys ``str(id)``): a
    result whose id changed that way is no same-shape edit, and the pairing follows it."""

    def result(tid: object) -> Message:
        return Message.user([{"type": "tool_result", "tool_use_id": tid, "content": "x"}])

    use = Message.assistant([{"type": "tool_use", "id": used, "name": "Bash", "input": {}}])
    history = [user_text("hi"), use, result(answered), user_text("next")]
    cache = WireCache()
    cache.to_api(history)
    history[2] = result(now)
    request = cache.to_api(history)
    assert json.dumps(request) == json.dumps(to_api(history))
    assert cache.pairing.problems == check_pairing(request)


def _x() -> dict[str, object]:
    return {"type": "text", "text": "x"}


def _shared_seam() -> tuple[list[Message], int, Message]:
    x = _x()  # the first holder's copy is made at the text seam; the second's is x itself
    return [Message.user([x]), Message.user([x])], 0, Message.user([{"type": "text", "text": "y"}])


def _repeated_in_one_record() -> tuple[list[Message], int, Message]:
    x = _x()
    old = Message.user([x, x])
    return [old, user_text("next")], 0, old.with_content([x, {"type": "text", "text": "y"}])


def _reminder_before_its_prompt() -> tuple[list[Message], int, Message]:
    x = _x()  # the reminder's block goes before the prompt, which holds the same object
    old = Message(type="attachment", subtype=REMINDER, content=[x])
    return [old, Message.user([x])], 0, old.with_content([{"type": "text", "text": "y"}])


def _reminder_folded() -> tuple[list[Message], int, Message]:
    x = _x()  # the reminder's text is folded into the result; the prompt's x is itself
    old = Message(type="attachment", subtype=REMINDER, content=[x])
    return (
        [results(tool_result("u", "out"), x), old],
        1,
        old.with_content([{"type": "text", "text": "y"}]),
    )


def _repeated_result_folded() -> tuple[list[Message], int, Message]:
    r = tool_result("u", "out")  # the reminder folds into the second occurrence
    old = results(r, r)
    rem = Message(type="attachment", subtype=REMINDER, content=[{"type": "text", "text": "rem"}])
    return [old, rem], 0, old.with_content([r, {**r, "content": "[cleared]"}])


def _fragment_cleaned() -> tuple[list[Message], int, Message]:
    x = _x()  # the first fragment is cleaned of a surrogate (every block copied), not the second
    old = Message.assistant([x, {"type": "text", "text": "\ud800"}], message_id="r")
    new = old.with_content([{"type": "text", "text": "y"}, old.blocks[1]])
    return [old, Message.assistant([x], message_id="r")], 0, new


@pytest.mark.parametrize(
    "case",
    [
        _shared_seam,
        _repeated_in_one_record,
        _reminder_before_its_prompt,
        _reminder_folded,
        _repeated_result_folded,
        _fragment_cleaned,
    ],
)
def test_a_block_object_held_twice_is_not_swapped_for_the_wrong_holder(case: Any) -> None:
    """A same-shape edit swaps new blocks into the message in place only where the old block
    went in as itself and nowhere else: one object held by two records, or twice by one, whose
    copy at a seam, in a folded reminder or in a cleaned record is not the edited one's."""
    held, at, new = case()
    history = [user_text("start"), Message.assistant([tool_use("u")], message_id="p"), *held]
    for k in range(2):  # enough after the edit for it to be patched in place
        history += [
            Message.assistant([tool_use(f"v{k}")], message_id=f"q{k}"),
            results(tool_result(f"v{k}", "ok")),
        ]
    cache = WireCache()
    cache.to_api(history)
    history[2 + at] = new
    assert json.dumps(cache.to_api(history)) == json.dumps(to_api(history))
    assert cache.chars == request_chars(to_api(history))


def test_a_message_of_one_record_holds_the_record_s_own_content_list() -> None:
    """The cache's requests hold each record's content list itself where a message is made of
    one record (a list a message not held twice for a conversation the proxy holds); the last
    ``editable`` messages are copies a caller may change, and ``to_api`` copies every one."""
    from pipeline.wire.form import to_api

    records: list[Message] = [Message.user("go")]
    for k in range(6):
        use = {"type": "tool_use", "id": f"t{k}", "name": "x", "input": {}}
        result = {"type": "tool_result", "tool_use_id": f"t{k}", "content": f"out {k}"}
        records += [Message.assistant([use], message_id=f"m{k}"), Message.user([result])]
    cache = WireCache()
    request = cache.to_api(records)
    assert request == to_api(records)
    for i, (param, record) in enumerate(zip(request, records, strict=True)):  # 1:1 here
        if isinstance(record.content, list):
            assert (param["content"] is record.content) == (i < len(records) - 2)
    copied = zip(to_api(records)[1:], records[1:], strict=True)  # the first: a string
    assert all(p["content"] is not r.content for p, r in copied)


def test_a_new_message_is_the_param_it_was_made_from_where_that_is_plain() -> None:
    """``given``: a new message of one record is the very param the record was made from when
    that param is ``{"role", "content"}`` with the record's own list (and other fields after
    role, sent as they are); a param with its keys in another order, or content the wire form
    must clean (a lone surrogate) gets a new message, equal to ``to_api``'s."""
    params: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "go"}]}]
    for k in range(6):
        use = {"type": "tool_use", "id": f"t{k}", "name": "x", "input": {}}
        result = {"type": "tool_result", "tool_use_id": f"t{k}", "content": f"out {k}"}
        params += [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    params[3] = {"content": params[3]["content"], "role": "assistant"}  # keys the other way
    params[5] = {**params[5], "extra": 1}
    params[7] = {"role": "assistant", "content": [{"type": "text", "text": "a \ud800 b"}]}
    records = [
        Message.from_param(p, message_id=f"m{i}") if p["role"] == "assistant" else
        Message.from_param(p)
        for i, p in enumerate(params)
    ]  # fmt: skip
    cache = WireCache()
    request = cache.to_api(records, given=params)
    expected = to_api(records)
    expected[5] = {**expected[5], "extra": 1}
    assert request == expected
    taken = [i for i, (q, p) in enumerate(zip(request, params, strict=True)) if q is p]
    assert taken == [i for i in range(len(params) - 2) if i not in (3, 7)]
    nxt = {"role": "user", "content": "next"}
    later = cache.to_api([*records, Message.from_param(nxt)], given=[nxt])
    assert later[: len(taken)] == request[: len(taken)] and later[0] is params[0]


@pytest.mark.parametrize("seed", range(30))
def test_the_pairing_index_taken_back_to_any_message_is_the_index_of_the_request(
    seed: int,
) -> None:
    """Ids used twice, results without calls, edits at any message: after each update the
    index's problems and tool_use ids are those of the request checked whole (what an edit
    takes back is the ids first used from the edit on)."""
    import random

    from pipeline.wire.pairing import PairingIndex

    rng = random.Random(seed)

    def message(k: int) -> dict[str, Any]:
        if k % 2:
            ids = [f"t{rng.randrange(8)}" for _ in range(rng.randrange(3))]
            return {"role": "assistant", "content": [tool_use(t) for t in ids] or "ok"}
        ids = [f"t{rng.randrange(8)}" for _ in range(rng.randrange(3))]
        return {"role": "user", "content": [tool_result(t, "out") for t in ids] or "go"}

    index = PairingIndex()
    request: list[dict[str, Any]] = []
    for _ in range(40):
        changed = rng.randrange(len(request) + 1)
        request = request[:changed] + [message(k) for k in range(changed, changed + 3)]
        index.update(request, changed)
        assert index.problems == check_pairing(request)
        first: dict[str, int] = {}
        for i, m in enumerate(request):
            if m["role"] == "assistant" and isinstance(m["content"], list):
                for b in m["content"]:
                    first.setdefault(b["id"], i)
        assert dict(index._first_use) == first and list(index._first_use) == list(first)


def test_what_the_cache_counts_of_each_message_is_8_bytes_a_number() -> None:
    """Each message's visible characters and breakpoints are kept as 8-byte numbers: as ints
    in lists, a count past 256 was an object of its own (~32 bytes) for every message of a held
    conversation."""
    import gc
    import tracemalloc

    history: list[Message] = [user_text("start")]
    for k in range(2_000):
        history += [
            Message.assistant([tool_use(f"u{k}")], message_id=f"r{k}"),
            results(tool_result(f"u{k}", "x" * (300 + k))),
        ]
    cache = WireCache()
    cache.to_api(history[:1])
    gc.collect()
    tracemalloc.start()
    try:
        cache.to_api(history)
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    chars = sum(
        stat.size
        for stat in snapshot.statistics("lineno")
        if stat.traceback[0].filename.endswith(("wire/chars.py", "wire/caching.py"))
    )
    assert chars / len(history) < 4  # what counting left: nothing a message
    assert cache.chars == request_chars(to_api(history))


def test_what_the_cache_keeps_of_each_message_is_its_entry_and_4_byte_indexes() -> None:
    """A held conversation keeps the cache's entry and indexes for every message: the indexes
    (record to entry, entry to its records, breakpoints) are 4 bytes each, and an entry is an
    object of six slots (its two flags share one): 8 and 16 bytes less a message."""
    import sys

    class SixSlots:
        __slots__ = ("a", "b", "c", "d", "e", "f")

    history: list[Message] = [user_text("start")]
    for k in range(50):
        history += [
            Message.assistant([tool_use(f"u{k}")], message_id=f"r{k}"),
            results(tool_result(f"u{k}", "x" * 30)),
        ]
    cache = WireCache()
    assert cache.to_api(history) == to_api(history)
    for numbers in (cache._entry_of, cache._first_record, cache._last_record, cache._breakpoints):
        assert numbers.itemsize == 4 and len(numbers) >= len(history) - 1
    entries = cache._wire.entries
    assert all(sys.getsizeof(e) == sys.getsizeof(SixSlots()) for e in entries)
    merged = [e for e in entries if e.merged]
    closed = [e for e in entries if e.closed]
    assert not merged and not closed  # records of an agent's own: neither
    entries[0].merged = True
    assert entries[0].merged and not entries[0].closed
    entries[0].merged = False
    assert not entries[0].merged
    # a message a client sent is a whole one (closed): the flags read apart
    from pipeline.messages import WIRE_MESSAGE

    sent = [Message.from_param({"role": "user", "content": "go"}, subtype=WIRE_MESSAGE)]
    wired = WireCache()
    wired.to_api(sent)
    (entry,) = wired._wire.entries
    assert entry.closed and not entry.merged


def test_a_record_s_fields_go_into_the_message_made_of_it_alone() -> None:
    """``fields``: by record name, what a message had besides role and content, written after
    them into the message made of that one record -- one the cache made anew (content a stage
    changed, a string), the last ones handed on as fresh copies too; a message made of
    several records gets none."""
    use = {"type": "tool_use", "id": "t1", "name": "x", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "out"}
    records = [
        Message.user("go"),
        Message.assistant([use], message_id="m1"),
        Message.user([result]),
        Message.user([{"type": "text", "text": "and"}]),  # merged into the one before
        Message.assistant("done", message_id="m2"),
        Message.user("next"),
    ]
    fields = {records[0].uuid: {"x": 1}, records[2].uuid: {"y": [2]}, records[4].uuid: {"z": 3}}
    fields[records[5].uuid] = {"w": None}
    cache = WireCache()
    request = cache.to_api(records, fields=fields)
    plain = to_api(records)
    assert len(request) == len(plain) == 5
    assert request[0] == {**plain[0], "x": 1}
    assert request[1] == plain[1]
    assert request[2] == plain[2]  # records 2 and 3 in one message: neither's fields
    assert request[3] == {**plain[3], "z": 3} and request[4] == {**plain[4], "w": None}
    assert [list(p)[:2] for p in request] == [["role", "content"]] * 5
    # a stage's new record of the same name (new content) is sent with the fields too
    edited = [records[0].with_content("went"), *records[1:]]
    again = cache.to_api(edited, fields=fields)
    assert again[0] == {"role": "user", "content": "went", "x": 1}
    assert cache.to_api(edited) == again  # each message kept as it was made
