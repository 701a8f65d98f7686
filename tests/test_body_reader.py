"""The body reader gives what a full parse gives, for any sequence of bodies: the same value,
the same bytes once written, the same refusals; and it parses only what is new."""

from __future__ import annotations

import gc
import json
import sys
import tracemalloc
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipeline.wire import body_reader, body_split, body_text, kept_bodies
from pipeline.wire.body_reader import BodyReader
from pipeline.wire.encoding import dumps_body, loads_body
from pipeline.wire.shared_strings import shared_message
from tests.wire_support import OffTheLoop, stepped


def _same_as_a_full_parse(reader: BodyReader, raw: bytes) -> None:
    try:
        expected, fast = loads_body(raw)
    except (ValueError, RecursionError) as exc:
        with pytest.raises(type(exc)):
            reader.read(raw)
        return
    got, got_fast = reader.read(raw)
    assert got_fast is fast
    assert json.dumps(got) == json.dumps(expected)  # NaN is not equal to itself
    assert list(got) == list(expected)  # the fields in their order
    assert dumps_body(got, fast=got_fast) == dumps_body(expected, fast=fast)


texts = st.text(alphabet=st.sampled_from('ab \n"\\é☃😀\ud800'), max_size=12)
blocks = st.one_of(
    texts,
    st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": texts}), min_size=1, max_size=3
    ),
)
messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]), "content": blocks}
)
extras = st.dictionaries(
    st.sampled_from(["model", "system", "tools", "max_tokens", "metadata"]),
    st.one_of(
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        texts,
        st.just([{"name": "t", "input_schema": {"messages": [1, {"messages": "x"}]}}]),
    ),
    max_size=4,
)
edits = st.sampled_from(["append", "append2", "edit", "drop_last", "extras", "same", "fork"])
writers = st.sampled_from(
    [
        {},
        {"separators": (",", ":")},
        {"indent": 1},
        {"ensure_ascii": False},
    ]
)
tails = st.sampled_from(
    ["", "NaN", "1e400", "dup", "trailing", "badutf8", "nested", "number", "notobject", "empty"]
)


def _body(msgs: list[Any], extra: dict[str, Any], before: bool, writer: dict[str, Any]) -> bytes:
    fields = dict(extra)
    body = {**fields, "messages": msgs} if before else {"messages": msgs, **fields}
    return json.dumps(body, **writer).encode("utf-8", "surrogatepass")


def _spoiled(raw: bytes, how: str) -> bytes:
    if how == "NaN":
        return raw.replace(b'"messages"', b'"t": NaN, "messages"', 1)
    if how == "1e400":
        return raw.replace(b'"messages"', b'"t": 1e400, "messages"', 1)
    if how == "dup":
        return raw[:-1] + b', "messages": []}'
    if how == "trailing":
        return raw.replace(b"]}", b",]}") if raw.endswith(b"]}") else raw + b","
    if how == "badutf8":
        return raw.replace(b'"messages"', b'"t": "\xff", "messages"', 1)
    if how == "nested":
        return raw[:-1] + b', "x": {"messages": [1, 2]}}'
    if how == "number":
        return raw.replace(b'"messages": [', b'"messages": [12, ', 1)
    if how == "notobject":
        return b"[" + raw + b"]"
    if how == "empty":
        return raw.replace(b'"messages": [', b'"messages": [ ', 1)
    return raw


@pytest.mark.parametrize(
    "bulk, head",
    [(False, None), (True, None), (True, 5)],
    ids=["one_at_a_time", "split_by_msgspec", "split_after_a_short_head"],
)
@settings(max_examples=300, deadline=None)
@given(
    start=st.lists(messages, max_size=6),
    steps=st.lists(
        st.tuples(edits, messages, extras, st.booleans(), writers, tails), min_size=1, max_size=12
    ),
)
def test_any_sequence_of_bodies_reads_as_a_full_parse(
    bulk: bool, head: int | None, start: list[Any], steps: list[Any]
) -> None:
    """``bulk``: every body's new messages split and parsed by msgspec (at its thresholds, from
    64 KB of new messages that are a quarter of the body); ``head``: a new body's first bytes
    decoded for the fields before its messages (at most 64 KB at first), cut inside a field or
    a character."""
    saved = body_split.SPLIT_BYTES, body_split.SPLIT_SHARE, body_reader._HEAD
    if bulk:
        body_split.SPLIT_BYTES, body_split.SPLIT_SHARE = 0, 10**9
    if head is not None:
        body_reader._HEAD = head
    try:
        reader = BodyReader()
        for msgs, extra, (before, writer, tail) in stepped(start, steps, "extras"):
            _same_as_a_full_parse(reader, _spoiled(_body(msgs, extra, before, writer), tail))
    finally:
        body_split.SPLIT_BYTES, body_split.SPLIT_SHARE, body_reader._HEAD = saved


@pytest.mark.parametrize("writer", [{}, {"separators": (",", ":")}, {"indent": 2}])
def test_a_long_first_body_is_split_by_msgspec(writer: dict[str, Any]) -> None:
    msgs = [{"role": "user", "content": f"m{k} " + "é" * 300} for k in range(400)]
    raw = json.dumps({"model": "m", "messages": msgs, "max_tokens": 5}, **writer).encode()
    array_open = raw.index(b"[") + 1
    found: list[Any] = []
    ends: list[int] = []
    close = body_split.split_new(raw, array_open, ends, found, array_open)
    assert close is not None and raw[close : close + 1] == b"]"
    assert found == msgs and len(ends) == len(msgs)
    starts = [array_open, *ends[:-1]]
    pieces = [raw[a:b].decode().lstrip(" \n,") for a, b in zip(starts, ends, strict=True)]
    assert [json.loads(p) for p in pieces] == msgs
    _same_as_a_full_parse(BodyReader(), raw)
    spoiled = raw.replace(b"m7 ", b"m7 \\ud800", 1)  # msgspec refuses: the standard library reads
    assert body_split.split_new(spoiled, array_open, [], [], array_open) is None
    _same_as_a_full_parse(BodyReader(), spoiled)
    # a key twice: msgspec keeps the last array, which is not the one at array_open
    twice = raw[:-1] + b', "messages": ' + raw[array_open - 1 : raw.rindex(b"]") + 1] + b"}"
    twice = twice.replace(b"m3 ", b"m4 ", 1)
    assert body_split.split_new(twice, array_open, [], [], array_open) is None
    _same_as_a_full_parse(BodyReader(), twice)


def test_a_growing_conversation_parses_only_its_new_messages() -> None:
    reader = BodyReader()
    msgs: list[Any] = [{"role": "user", "content": "go"}]
    first: list[Any] = []
    for k in range(30):
        raw = json.dumps({"model": "m", "max_tokens": 5, "messages": msgs}).encode()
        body, fast = reader.read(raw)
        assert fast and body == json.loads(raw)
        if k == 0:
            first = body["messages"]
        else:  # the same objects where the text is the same: compared by identity later
            assert all(a is b for a, b in zip(body["messages"], first, strict=False))
        msgs = [*msgs, {"role": "assistant", "content": f"a{k}"}, {"role": "user", "content": "u"}]
    assert reader.reused == sum(1 + 2 * k for k in range(29))


def test_what_it_keeps_is_bounded() -> None:
    reader = BodyReader(max_bytes=10_000)
    for k in range(50):
        msgs = [{"role": "user", "content": f"{k} " + "x" * 1_000}]
        reader.read(json.dumps({"messages": msgs}).encode())
    assert reader._bytes <= 10_000
    reader = BodyReader(max_bodies=3)
    for k in range(10):
        reader.read(json.dumps({"messages": [{"role": "user", "content": str(k)}]}).encode())
    assert len(reader._kept) == 3
    with pytest.raises(ValueError, match="max_bytes"):
        BodyReader(max_bytes=-1)


def test_what_it_keeps_of_many_short_messages_is_within_max_bytes_in_memory() -> None:
    """A body of many short messages keeps alive far more than its bytes (each message's
    parsed dicts): the bound counts them, so what the reader holds in memory, traced, stays
    within ``max_bytes``."""
    bound = 4 << 20
    reader = BodyReader(max_bytes=bound)
    gc.collect()
    tracemalloc.start()
    try:
        for k in range(12):
            msgs = [
                {"role": "user" if j % 2 else "assistant", "content": f"{k}"} for j in range(5_001)
            ]
            reader.read(json.dumps({"messages": msgs}, separators=(",", ":")).encode())
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reader._kept, "the last body is kept"
    assert held <= bound, f"{held / 2**20:.1f} MiB held under a bound of {bound / 2**20:.0f}"


def test_a_conversation_let_go_is_forgotten_and_read_whole_when_it_comes_back() -> None:
    reader = BodyReader()
    a = [{"role": "user", "content": "task A " + "a" * 500}]
    b = [{"role": "user", "content": "task B " + "b" * 500}]
    parsed_a = reader.read(_raw(a))[0]["messages"]
    parsed_b = reader.read(_raw(b))[0]["messages"]
    assert reader.forget([]) == 0
    assert reader.forget([dict(parsed_a[0])]) == 0  # equal, not the same objects
    assert reader.forget(list(parsed_a)) == 1  # the messages the conversation holds, copied
    assert len(reader._kept) == 1 and reader.forget(parsed_a) == 0
    grown = [*a, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    again = reader.read(_raw(grown))[0]["messages"]
    assert again[0] is not parsed_a[0] and reader.reused == 0  # parsed whole: nothing kept
    more = [*b, {"role": "assistant", "content": "ok"}]
    assert reader.read(_raw(more))[0]["messages"][0] is parsed_b[0]  # the other one still is


def test_a_kept_body_counts_where_its_messages_end_in_4_bytes_each() -> None:
    """A body under 4 GiB (every body a proxy takes) keeps where each of its messages ends in
    4 bytes, not 8: a held conversation keeps one for every message; its next body too."""
    reader = BodyReader()
    msgs = [{"role": "user", "content": f"m{k} " + "x" * 40} for k in range(30)]
    reader.read(_raw(msgs))
    reader.read(_raw([*msgs, {"role": "assistant", "content": "ok"}]))
    assert reader._kept
    for body in reader._kept.values():
        assert body.ends.itemsize == 4 and len(body.ends) >= 30


def test_forgetting_looks_up_the_bodies_ending_alike_and_leaves_no_entry_behind() -> None:
    """The reader finds the bodies to forget by their last message (not by a look at every
    kept body), and its index of them holds nothing for a body it let go, by ``forget``, by
    a body that continues it or past ``max_bodies``."""
    reader = BodyReader(max_bodies=8)
    parsed = []
    for k in range(20):
        msgs = [{"role": "user", "content": f"task {k} " + "x" * 300}]
        parsed.append(reader.read(_raw(msgs))[0]["messages"])
    assert len(reader._kept) == 8
    shared_last = [*parsed[-1]]
    assert reader.forget(parsed[0]) == 0  # let go past max_bodies already
    assert reader.forget(shared_last) == 1
    grown = [
        {"role": "user", "content": "task 18 " + "x" * 300},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "go on"},
    ]
    reader.read(_raw(grown))  # continues the body of task 18, which it replaces
    kept = {id(b) for b in reader._kept.values()}
    indexed = {i for same in reader._by_last.values() for i in same}
    assert indexed == {id(b) for b in reader._kept.values() if b.messages} == kept
    for body in list(reader._kept.values()):
        assert reader.forget(body.messages) == 1
    assert not reader._kept and not reader._by_last


@pytest.mark.parametrize("system", ["plain", "Generated with Claude Code \U0001f916", "\u2192"])
def test_a_kept_body_holds_what_was_parsed_of_it_not_its_bytes(system: str) -> None:
    """The reader keeps neither the body's bytes nor a decoding of them (one character past
    U+FFFF in it -- Claude Code's system prompt has one -- would make a text four bytes a
    character): what it holds past the parsed messages (their text ASCII, one byte a
    character) is its digests and offsets, and the bytes up to its first message's end."""
    content = "x" * 200_000
    opening = {"role": "user", "content": "go"}
    raw = json.dumps(
        {"system": system, "messages": [opening, {"role": "user", "content": content}]},
        ensure_ascii=False,
    ).encode()
    reader = BodyReader()
    references = sys.getrefcount(raw)
    gc.collect()
    tracemalloc.start()
    try:
        body, _fast = reader.read(raw)
        assert body["messages"][1]["content"] == content
        del body
        gc.collect()
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(reader._kept) == 1
    assert sys.getrefcount(raw) == references  # the body itself is not kept
    assert held < len(content) + 10_000, held


def test_a_kept_body_costs_a_digest_and_an_end_a_message_beside_what_was_parsed() -> None:
    """Beside the parsed messages (what parsing them alone leaves), a kept body holds a
    message's digest (16 bytes) and where it ends (8 bytes, in an array: an int object for
    each end was ~40)."""
    n = 20_000
    msgs = [{"role": ("user", "assistant")[i % 2], "content": f"m{i}"} for i in range(n)]
    raw = json.dumps({"model": "m", "messages": msgs}, separators=(",", ":")).encode()
    del msgs
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        alone = [shared_message(m) for m in json.loads(raw)["messages"]]
        parsed = tracemalloc.get_traced_memory()[0] - start
        del alone
        gc.collect()
        reader = BodyReader()
        start = tracemalloc.get_traced_memory()[0]
        body, _fast = reader.read(raw)
        del body
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert (held - parsed) / n < 32


def test_a_body_is_read_against_bodies_sent_with_its_credential_only() -> None:
    """The same bytes sent with two credentials parse to objects of their own: a body never
    takes a message parsed from another key's body (nor a digest of one)."""
    reader = BodyReader()
    msgs = [{"role": "user", "content": "the same opening " * 40}]
    raw = json.dumps({"model": "m", "messages": msgs}).encode()
    first = reader.read(raw, scope=b"x-api-key:one")[0]["messages"]
    other = reader.read(raw, scope=b"x-api-key:two")[0]["messages"]
    assert other == first and other[0] is not first[0]
    again = reader.read(raw, scope=b"x-api-key:one")[0]["messages"]
    assert again[0] is first[0]
    alone = reader.read(raw)[0]["messages"][0]  # no credential
    assert alone is not first[0] and alone is not other[0]
    assert len(reader._scoped) == 3
    assert all(b"one" not in key and b"two" not in key for key in reader._scoped)


@pytest.mark.parametrize("tail", [b",]", b", ]", b",\n]"])
def test_a_trailing_comma_after_messages_read_before_is_refused(tail: bytes) -> None:
    reader = BodyReader()
    head = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}'
    reader.read(head + b"]}")
    with pytest.raises(ValueError):
        reader.read(head + tail + b"}")


def test_a_lone_surrogate_in_a_message_read_before_still_says_slow() -> None:
    reader = BodyReader()
    first = b'{"messages": [{"role": "user", "content": "a\\ud800"}'
    assert reader.read(first + b"]}")[1] is False
    body, fast = reader.read(first + b', {"role": "user", "content": "b"}]}')
    assert fast is False and body == json.loads(first + b', {"role": "user", "content": "b"}]}')


@pytest.mark.parametrize("escape", [b"\\ud800", b"\\uD800", b"\\uDbFf"])
def test_a_lone_surrogate_escape_in_any_case_says_slow(escape: bytes) -> None:
    """Only an escape makes a surrogate in strict UTF-8 text: in a new message, in a field
    before the messages, or in one after them that changes, in either case of its hex."""
    reader = BodyReader()
    plain = b'{"role": "user", "content": "a"}'
    lone = b'{"role": "user", "content": "a' + escape + b'"}'
    bodies = [
        b'{"model": "m", "messages": [' + plain + b"]}",
        b'{"model": "m", "messages": [' + plain + b", " + lone + b"]}",
        b'{"model": "m' + escape + b'", "messages": [' + plain + b"]}",
        b'{"model": "m", "messages": [' + plain + b'], "tools": ["' + escape + b'"]}',
        b'{"model": "m", "messages": [' + plain + b"]}",
    ]
    for raw in bodies:
        _same_as_a_full_parse(reader, raw)
    assert [loads_body(raw)[1] for raw in bodies] == [True, False, False, False, True]


def test_among_many_conversations_sharing_an_opening_each_body_reuses_its_own() -> None:
    """Sixty conversations that open alike (one system text, one long first message) take
    turns; each body is read against the last one of its own conversation: its messages are
    that body's objects, and a body that repeats one kept whole drops it (the kept list stays
    one body per conversation). Finding it takes a digest where the kept bodies part (their
    opening, then their first different message), then a few along its own: not one for every
    conversation that opens alike (sixty)."""
    reader = BodyReader()
    opening = [{"role": "user", "content": "the same long task " * 200}]
    talks: list[list[Any]] = [list(opening) for _ in range(60)]
    last: dict[int, list[Any]] = {}
    for turn in range(4):
        for k, msgs in enumerate(talks):
            msgs += [
                {"role": "assistant", "content": f"{k}.{turn}"},
                {"role": "user", "content": "go"},
            ]
            raw = json.dumps({"model": "m", "system": "s", "messages": msgs}).encode()
            digested = reader.digested
            body, _fast = reader.read(raw)
            if k in last:
                assert all(a is b for a, b in zip(body["messages"], last[k], strict=False))
                assert body["messages"][len(last[k])] is not None
            last[k] = body["messages"]
            assert reader.digested - digested <= 16, reader.digested - digested
        assert len(reader._kept) == 60
        order = reader._scoped[b""]
        assert sorted(set(order)) == order
        assert {i for opening in order for i in reader._alike[b"", opening]} == set(reader._kept)


@settings(max_examples=300, deadline=None)
@given(
    kept=st.lists(messages, max_size=40),
    edit=st.sampled_from(["append", "change", "truncate", "same", "fields"]),
    at=st.integers(0, 40),
    writer=writers,
)
def test_the_messages_a_body_repeats_of_a_kept_one_are_found_exactly(
    kept: list[Any], edit: str, at: int, writer: dict[str, Any]
) -> None:
    """Against a kept body of up to 40 messages, a new body that changes any one message, ends
    anywhere, goes on, or changes only the fields after the messages: the messages it repeats
    are counted exactly (growing steps, each of the last messages, then each between the last
    step that matched and the first that did not)."""
    new = list(kept)
    if edit == "append":
        new += [{"role": "user", "content": "next"}]
    elif edit == "change" and kept:
        at %= len(kept)
        new[at] = {"role": "user", "content": [{"type": "text", "text": "changed" * 3}]}
    elif edit == "truncate":
        new = new[: at % (len(kept) + 1)]
    tools = "t2" if edit == "fields" else "t1"
    old_raw = _body(kept, {"tools": "t1"}, False, writer)
    new_raw = _body(new, {"tools": tools}, False, writer)
    reader = BodyReader()
    _same_as_a_full_parse(reader, old_raw)
    assume(len(reader._kept) == 1)  # not one the full parse reads (a lone surrogate as UTF-8)
    [body] = reader._kept.values()
    found, k = reader._continued(new_raw, [body])
    expected = 0
    while expected < min(len(kept), len(new)) and kept[expected] == new[expected]:
        expected += 1
    assert found is body and k == expected
    _same_as_a_full_parse(reader, new_raw)


def test_a_moving_cache_mark_and_forks_of_a_long_history_cost_a_few_digests() -> None:
    """A client that moves its cache mark onto its last message each call (Claude Code) parts
    from its last body one message before that body's end: the new body takes its place (one
    kept body per conversation, not one per call). Conversations forked from one 300-message
    history, read in turns: a read costs digests in the log of what they share, not one per
    shared message."""
    reader = BodyReader()
    talk: list[Any] = [{"role": "user", "content": f"step {i} " * 20} for i in range(300)]
    for call in range(12):
        marked = [*talk[:-1], {"role": "user", "content": [{"type": "text", "text": "t",
                  "cache_control": {"type": "ephemeral"}}]}]  # fmt: skip
        digested = reader.digested
        _same_as_a_full_parse(reader, json.dumps({"model": "m", "messages": marked}).encode())
        assert len(reader._kept) == 1
        assert reader.digested - digested <= 16, reader.digested - digested
        talk += [{"role": "assistant", "content": f"a{call}"}, {"role": "user", "content": "u"}]
    forks = [[*talk, {"role": "assistant", "content": f"fork {k}"}] for k in range(6)]
    for turn in range(3):
        for k, fork in enumerate(forks):
            fork += [{"role": "user", "content": f"{k}.{turn}"}]
            raw = json.dumps({"model": "m", "messages": fork}).encode()
            digested, reused = reader.digested, reader.reused
            _same_as_a_full_parse(reader, raw)
            assert reader.digested - digested <= 40, reader.digested - digested
            assert reader.reused - reused >= len(talk) - 3  # the shared history
            fork += [{"role": "assistant", "content": f"{k}.{turn}"}]


def test_forks_that_part_late_one_after_another_cost_a_read_steps_in_their_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sixty-four kept bodies of one credential share a 2,000-message history, each with one
    message changed at its own place: a body repeating the whole history is read against the
    one it repeats furthest with a few digests and a comparison of kept digests per body and
    step -- not one per body and body (a review measured 317 ms a read at 256 such bodies)."""
    compared: list[int] = []
    real = kept_bodies._same_at
    monkeypatch.setattr(kept_bodies, "_same_at", lambda *a: compared.append(1) or real(*a))
    history = [{"role": "user", "content": f"m{i}"} for i in range(2_000)]
    reader = BodyReader()
    for i in range(64):
        changed = list(history)
        changed[1 + i * 30] = {"role": "user", "content": f"changed {i}"}
        reader.read(json.dumps({"model": "m", "messages": changed}).encode(), scope=b"k")
    raw = json.dumps({"model": "m", "messages": [*history, {"role": "user", "content": "next"}]})
    compared.clear()
    digested, reused = reader.digested, reader.reused
    assert reader.read(raw.encode(), scope=b"k") == loads_body(raw.encode())
    assert len(compared) <= 8 * 64, len(compared)
    assert reader.digested - digested <= 64, reader.digested - digested
    assert reader.reused - reused == 1 + 63 * 30  # against the fork changed latest


def test_a_body_is_read_against_the_kept_bodies_that_open_like_it_only() -> None:
    """Two hundred conversations of one credential: a next body is read against its own
    conversation's only, found in the order of their openings (the bytes up to the first
    message's end) -- not against every kept body. Openings past 256 KB are kept cut short, one
    object for the bodies that open alike: two first messages alike for 270 KB sit together
    and are told apart by their digests."""
    reader = BodyReader()
    talks = [[{"role": "user", "content": f"task {k} " * (k % 7 + 1)}] for k in range(200)]
    long = "x" * 270_000
    talks += [[{"role": "user", "content": long + tail}] for tail in ("a", "bb")]
    for k, msgs in enumerate(talks):
        msgs.append({"role": "assistant", "content": f"a{k}"})
        reader.read(json.dumps({"model": "m", "messages": msgs}).encode())
    assert all(len(b.opening) <= b.array_open + 256 * 1024 for b in reader._kept.values())
    cut = [b.opening for b in reader._kept.values() if len(b.messages[0]["content"]) > 2**18]
    assert len(cut) == 2 and cut[0] is cut[1]
    for k in (7, 123, 200, 201):
        msgs = [*talks[k], {"role": "user", "content": "next"}]
        raw = json.dumps({"model": "m", "messages": msgs}).encode()
        alike = reader._opening_alike(raw, b"")
        assert len(alike) == (2 if k >= 200 else 1)
        reused = reader.reused
        _same_as_a_full_parse(reader, raw)
        assert reader.reused - reused == 2


def test_the_messages_a_body_repeats_are_counted_whichever_way_it_parts() -> None:
    """A next call, a retry of the same body, a body that edits an early message, one with
    fewer messages, one whose fields after the messages differ, and one of another
    conversation that opens alike: each against the right kept body, its repeated messages
    counted to the one."""
    msgs = [{"role": "user", "content": f"m{i} " * 50} for i in range(6)]
    reader = BodyReader()
    reader.read(json.dumps({"model": "m", "messages": msgs, "system": "s" * 900}).encode())
    other = [*msgs[:2], {"role": "user", "content": "elsewhere"}]
    reader.read(json.dumps({"model": "m", "messages": other}).encode())
    mine, theirs = reader._kept.values()
    edited = [dict(msgs[0], content="other"), *msgs[1:]]
    cases = [
        ({"model": "m", "messages": [*msgs, msgs[0]], "system": "s" * 900}, mine, 6),
        ({"model": "m", "messages": msgs, "system": "s" * 900}, mine, 6),
        ({"model": "m", "messages": edited, "system": "s" * 900}, theirs, 0),  # a tie: the latest
        ({"model": "m", "messages": msgs[:3], "system": "s" * 900}, mine, 3),
        ({"model": "m", "messages": msgs, "system": "s" * 899 + "t"}, mine, 6),
        ({"model": "m", "messages": [*other, msgs[0]]}, theirs, 3),
        ({"model": "n", "messages": msgs}, None, 0),
    ]
    for body, expected, count in cases:
        raw = json.dumps(body).encode()
        assert reader._continued(raw, [mine, theirs]) == (expected, count), body


def test_fields_after_the_messages_sent_again_are_not_new(monkeypatch: pytest.MonkeyPatch) -> None:
    """Claude Code sends its system prompt and tools (~80 KB) after the messages, the same each
    call: a call that adds two messages is read a message at a time, not split (two scans of
    the whole body for two messages)."""
    split: list[int | None] = []

    def recorded(*args: Any) -> int | None:
        split.append(found := body_split.split_new(*args))
        return found

    monkeypatch.setattr(body_reader, "split_new", recorded)
    tools = [{"name": f"t{k}", "description": "d" * 800, "input_schema": {}} for k in range(100)]
    msgs: list[Any] = [{"role": "user", "content": "go"}]
    reader = BodyReader()
    read: list[Any] = []
    for k in range(3):
        raw = json.dumps({"model": "m", "messages": msgs, "system": "s", "tools": tools}).encode()
        _same_as_a_full_parse(reader, raw)
        read.append(reader.read(raw)[0]["tools"])
        msgs = [*msgs, {"role": "assistant", "content": f"a{k}"}, {"role": "user", "content": "u"}]
    assert split[0] is not None  # the first body: all of it new
    assert split[1:] == [None, None, None, None, None]  # each body read twice here
    assert read[1] is read[0] and read[2] is read[0]  # the fields after: parsed once


def _history(n: int, tag: str) -> list[Any]:
    return [{"role": "user", "content": f"{tag} {k} " + "z" * 2_000} for k in range(n)]


def _raw(msgs: list[Any]) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 5, "messages": msgs}).encode()


def test_a_long_new_body_is_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parse waits for a task of the event loop: were it run on the loop, it would wait
    for itself (and fail after the timeout). A body that adds a few messages to a kept one is
    read on the loop: its offload is never called."""
    import anyio
    import anyio.to_thread

    witness = OffTheLoop()
    parsed = body_reader._parsed

    def waiting(*args: Any) -> Any:
        witness.wait("parsed")
        return parsed(*args)

    monkeypatch.setattr(body_reader, "_parsed", waiting)
    msgs = _history(200, "a")  # ~400 KB, all new
    first, grown = _raw(msgs), _raw([*msgs, {"role": "user", "content": "more"}])
    assert len(first) >= body_reader.OFF_LOOP_BYTES

    async def never(fn: Any) -> Any:
        raise AssertionError("a few new messages were parsed off the loop")

    async def main() -> None:
        reader = BodyReader()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(witness.free)
            got = await reader.read_async(first, offload=anyio.to_thread.run_sync)
        assert got == loads_body(first) and reader.off_loop == 1
        again, fast = await reader.read_async(grown, offload=never)
        assert fast and again == json.loads(grown) and reader.off_loop == 1
        assert all(a is b for a, b in zip(again["messages"], got[0]["messages"], strict=False))
        assert reader.reused == len(msgs)

    anyio.run(main)


def test_bodies_read_while_a_long_one_is_parsed_elsewhere_are_all_kept() -> None:
    """Two long bodies' parses wait off the loop while another conversation's body is read
    and kept on it: then each is kept, a later body of each reuses its messages, and the
    parse that fails raises its error to its reader."""
    import anyio

    gate = anyio.Event()

    async def later(fn: Any) -> Any:
        await gate.wait()
        return fn()

    async def never(fn: Any) -> Any:
        raise AssertionError("a short body was parsed off the loop")

    long_msgs, short_msgs = _history(200, "long"), _history(3, "short")
    bad = _raw(_history(200, "bad")).replace(b"bad 7", b"bad \\ud800 7", 1)[:-1]  # cut short

    async def main() -> None:
        reader = BodyReader()
        results: dict[str, Any] = {}

        async def read(name: str, raw: bytes) -> None:
            try:
                results[name] = await reader.read_async(raw, offload=later)
            except ValueError as exc:
                results[name] = exc

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(read, "long", _raw(long_msgs))
            tasks.start_soon(read, "bad", bad)
            await anyio.sleep(0.05)
            # on the loop, while the others wait (were it sent off the loop, it would fail)
            results["short"] = await reader.read_async(_raw(short_msgs), offload=never)
            assert set(results) == {"short"}
            gate.set()
        assert reader.off_loop == 2
        assert results["long"] == loads_body(_raw(long_msgs))
        assert results["short"] == loads_body(_raw(short_msgs))
        assert isinstance(results["bad"], ValueError)  # the parse's error, raised here
        for msgs in (long_msgs, short_msgs):
            before = reader.reused
            grown = _raw([*msgs, {"role": "user", "content": "next"}])
            got = await reader.read_async(grown, offload=later)
            assert got == loads_body(grown) and reader.reused - before == len(msgs)

    anyio.run(main)


_ASTRAL = "Generated with Claude Code \U0001f916"
"""A character past U+FFFF, as Claude Code's system prompt holds one: text decoded with it
takes four bytes a character."""


def _peak(work: Any) -> int:
    """The most ``work()`` held allocated at once, beyond what it started with."""
    import tracemalloc

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        work()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_first_body_is_not_decoded_whole_to_be_read() -> None:
    """A body new to the reader, with a character past U+FFFF after its messages, as Claude
    Code's: its messages are read from its bytes, and only its start is decoded (decoded
    whole, the body peaked at ~5x its size, four bytes a character)."""
    msgs = [{"role": "user", "content": f"m{k} " + "x" * 2_000} for k in range(200)]
    tools = [{"name": f"tool{k}", "description": _ASTRAL * 40} for k in range(30)]
    raw = json.dumps(
        {"model": "m", "messages": msgs, "system": _ASTRAL, "tools": tools},
        ensure_ascii=False,
        separators=(",", ":"),
    ).encode()
    reader = BodyReader()
    assert _peak(lambda: reader.read_source(raw)) < 2.5 * len(raw)
    body, _fast, _source = BodyReader().read_source(raw)
    assert body == json.loads(raw)


def test_a_body_whose_fields_before_its_messages_are_long_reads_them_whole() -> None:
    """Fields before the messages longer than the bytes decoded first, a character cut at
    their end: decoded further, read as a full parse reads them."""
    for pad in range(4):
        system = "a" * (body_reader._HEAD - 12 + pad) + "\u00e9\U0001f916" * 9_000
        msgs = [{"role": "user", "content": "go"}]
        raw = json.dumps({"system": system, "messages": msgs}, ensure_ascii=False).encode()
        body, fast, source = BodyReader().read_source(raw)
        assert body == json.loads(raw) and fast and source is not None


def test_the_fields_a_body_repeats_after_its_messages_are_not_decoded_again() -> None:
    """A call that adds a round to a conversation whose system prompt and tools (after the
    messages, ~80 KB, a character past U+FFFF among them: Claude Code's) are as before: what
    it decodes is its new messages, not those fields again (four bytes a character)."""
    tools = [{"name": f"tool{k}", "description": _ASTRAL * 100} for k in range(30)]
    msgs: list[Any] = [{"role": "user", "content": "go"}]
    reader = BodyReader()

    def body() -> bytes:
        return json.dumps(
            {"model": "m", "messages": msgs, "system": _ASTRAL, "tools": tools},
            ensure_ascii=False,
            separators=(",", ":"),
        ).encode()

    reader.read_source(body())
    for k in range(3):
        msgs += [
            {"role": "assistant", "content": [{"type": "text", "text": f"step {k}"}]},
            {"role": "user", "content": f"and {k}"},
        ]
        raw = body()
        fields = len(json.dumps({"system": _ASTRAL, "tools": tools}, ensure_ascii=False).encode())
        assert fields > 80_000
        assert _peak(lambda raw=raw: reader.read_source(raw)) < fields  # ~4x it, decoded
        assert reader.read_source(raw)[0] == json.loads(raw)


def test_a_run_of_continuation_bytes_at_the_head_s_end_is_not_walked_back() -> None:
    """Where the bytes decoded first end inside a character, the cut moves back to its start:
    three bytes at most; a longer run of continuation bytes is not UTF-8, and the body is
    decoded whole (which refuses it at once) rather than walked back a byte at a time."""
    head = b'{"system": "' + "\U0001f916".encode()
    assert body_text.char_boundary(head, len(head) - 1) == len(head) - 4
    bad = b'{"system": "' + b"\x80" * 10_000 + b'", "messages": []}'
    assert body_text.char_boundary(bad, 5_000) == len(bad)
    with pytest.raises(ValueError):
        BodyReader().read_source(bad)
