"""The body writer writes what :func:`dumps_body` writes, for any sequence of bodies under any
keys; it encodes only the messages that are not the last body's objects; what it keeps is
bounded."""

from __future__ import annotations

import contextlib
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.wire import body_writer
from pipeline.wire.body_writer import BodyWriter
from pipeline.wire.encoding import dumps_body
from tests.wire_support import stepped

texts = st.text(alphabet=st.sampled_from('ab \n"\\é☃😀\ud800\x00'), max_size=12)
values = st.one_of(
    texts,
    st.integers(-(2**70), 2**70),
    st.floats(allow_infinity=True, allow_nan=True),
    st.none(),
    st.booleans(),
)
blocks = st.one_of(
    texts,
    st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": texts}), min_size=1, max_size=3
    ),
    st.lists(st.dictionaries(texts, values, max_size=3), min_size=1, max_size=2),
)
messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]), "content": blocks}
)
fields = st.dictionaries(
    st.sampled_from(["model", "system", "tools", "max_tokens", "metadata", "messages_x", ""]),
    values,
    max_size=4,
)
edits = st.sampled_from(
    ["append", "append2", "replace", "equal_copy", "drop_last", "fields", "same", "fork", "empty"]
)


@settings(max_examples=400, deadline=None)
@given(
    start=st.lists(messages, max_size=6),
    steps=st.lists(
        st.tuples(
            edits, messages, fields, st.booleans(), st.booleans(), st.sampled_from(["a", "b"])
        ),
        min_size=1,
        max_size=14,
    ),
    unchanging=st.booleans(),
)
def test_any_sequence_of_bodies_is_written_as_dumps_body_writes_it(
    start: list[Any], steps: list[Any], unchanging: bool
) -> None:
    writer = BodyWriter(max_bytes=400)  # small: bodies are let go and written whole too
    for msgs, extra, (before, fast, key) in stepped(start, steps, "fields"):
        body = {**extra, "messages": msgs} if before else {"messages": msgs, **extra}
        try:
            expected: bytes | type[Exception] = dumps_body(body, fast=fast)
        except Exception as exc:  # what dumps_body raises, the writer raises too
            expected = type(exc)
        try:
            kept = extra.keys() if unchanging else ()  # the fields' values are never changed
            got: bytes | type[Exception] = writer.write(key, body, fast=fast, unchanging=kept)
        except Exception as exc:
            got = type(exc)
        assert got == expected


def _round(k: int) -> list[dict[str, Any]]:
    use = {"type": "tool_use", "id": f"t{k}", "name": "x", "input": {}}
    result = {"type": "tool_result", "tool_use_id": f"t{k}", "content": "z" * 100}
    return [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]


def test_a_growing_conversation_encodes_only_its_new_messages() -> None:
    writer = BodyWriter()
    msgs: list[Any] = [{"role": "user", "content": "go"}]
    for k in range(30):
        body = {"model": "m", "max_tokens": 5, "messages": msgs, "system": "s"}
        assert writer.write("c", body) == dumps_body(body)
        msgs = [*msgs, *_round(k)]
    assert writer.reused == sum(1 + 2 * k for k in range(29))


def test_fields_sent_again_as_the_same_objects_are_encoded_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A field named unchanging whose value is the last body's object is not encoded again; a
    new object is, and a field not named is encoded every time (its value may have been
    changed in place)."""
    encoded: list[Any] = []
    real = body_writer.fast_encode

    def counted(value: Any) -> bytes:
        encoded.append(value)
        return real(value)

    monkeypatch.setattr(body_writer, "fast_encode", counted)
    writer = BodyWriter()
    system = [{"type": "text", "text": "You are an agent."}]
    tools = [{"name": "Read", "input_schema": {"type": "object"}}]
    msgs: list[Any] = [{"role": "user", "content": "go"}]
    for k in range(4):
        if k == 2:
            system = [dict(system[0])]  # an equal new object: encoded again
        tools[0]["name"] = f"Read{k}"  # changed in place: not named, so written as it is now
        body = {"model": "m", "system": system, "tools": tools, "messages": msgs}
        assert writer.write("c", body, unchanging={"model", "system"}) == dumps_body(body)
        msgs = [*msgs, *_round(k)]
    assert sum(v is system or v == system for v in encoded) == 2  # the first call, and k == 2
    assert sum(v is tools for v in encoded) == 4


def test_conversations_under_other_keys_do_not_share_bytes() -> None:
    writer = BodyWriter()
    one: list[Any] = [{"role": "user", "content": "one"}]
    two: list[Any] = [{"role": "user", "content": "two"}]
    for k in range(5):
        for key, msgs in (("1", one), ("2", two)):
            body = {"model": "m", "messages": msgs}
            assert writer.write(key, body) == dumps_body(body)
        one, two = [*one, *_round(k)], [*two, *_round(k)]
    assert writer.reused == 2 * sum(1 + 2 * k for k in range(4))


def test_what_it_keeps_is_bounded() -> None:
    writer = BodyWriter(max_bytes=5_000)
    for k in range(50):
        body = {"model": "m", "messages": [{"role": "user", "content": f"{k}" * 900}]}
        writer.write(k, body)
        assert writer._bytes <= 5_000
    assert len(writer._kept) <= 5
    writer.forget(49)
    assert 49 not in writer._kept
    huge = {"model": "m", "messages": [{"role": "user", "content": "x" * 10_000}]}
    assert writer.write("huge", huge) == dumps_body(huge)
    assert "huge" not in writer._kept  # larger than all it may keep: written, not kept


def test_bodies_the_stages_rewrite_are_written_as_a_whole_encode_writes_them(
    tmp_path: Path,
) -> None:
    """A conversation through the default stages with a small window, so that they act
    (results persisted, then old rounds snipped: the request shrinks from 89 messages to 39):
    every body the writer writes is what encoding it whole writes at that moment -- no message
    it took bytes from was changed in place after it went."""
    from pipeline import Pipeline
    from pipeline.dropin.adapter import WireSession
    from pipeline.store.sessions import SessionStates
    from pipeline.wire.request_fields import merge_request_fields
    from stages import default_stages

    async def run() -> tuple[int, int]:
        session = await WireSession.open(
            "stages",
            tmp_path,
            Pipeline(default_stages(context_window=60_000)),
            storage=SessionStates(tmp_path, fsync_each=False).open("stages"),
        )
        writer = BodyWriter()
        msgs: list[Any] = [{"role": "user", "content": "go"}]
        calls = 0
        for k in range(60):
            body = {"model": "m", "max_tokens": 5, "messages": msgs}
            prepared, call = await session.prepare_call(body)
            merged = merge_request_fields(prepared, session.ctx.report.request_extras)
            assert writer.write("c", merged) == dumps_body(merged), f"call {k}"
            calls += 1
            size = len(dumps_body(merged))
            await session.observe_async(
                f"msg_{k}", {"input_tokens": size // 4, "output_tokens": 5}, "m", call=call
            )
            use = {"type": "tool_use", "id": f"toolu_{k}", "name": "Bash", "input": {}}
            text = "y" * (60_000 if k % 7 == 3 else 3_000 + 100 * k)
            result = {"type": "tool_result", "tool_use_id": f"toolu_{k}", "content": text}
            msgs = [
                *msgs,
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [result]},
            ]
        return calls, writer.reused

    calls, reused = anyio.run(run)
    assert calls == 60
    assert reused > 0  # it did take bytes from earlier bodies


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_finite_refuses_what_the_fast_encoder_would_write_as_null(bad: float) -> None:
    writer = BodyWriter()
    first = [{"role": "user", "content": [{"type": "text", "text": "a", "x": None}]}]
    body = {"model": "m", "messages": first}
    assert writer.write("k", body, finite=True) == dumps_body(body)  # a null of its own is fine
    later = [*first, {"role": "assistant", "content": [{"type": "tool_use", "input": {"v": bad}}]}]
    with pytest.raises(ValueError, match="float"):
        writer.write("k", {"model": "m", "messages": later}, finite=True)
    with pytest.raises(ValueError, match="float"):
        writer.write("k2", {"model": "m", "top_k": bad, "messages": first}, finite=True)
    assert writer.write("k3", {"messages": later}) == dumps_body({"messages": later})


# -- the request's own bytes (a Source) ----------------------------------------------------------

spacings = st.sampled_from(["compact", "spaced", "pretty"])


def _client_bytes(body: dict[str, Any], spacing: str) -> bytes:
    """``body`` as a client writes it: compactly (the anthropic SDKs, Claude Code), spaced
    (Python's ``json.dumps`` by default) or indented."""
    import json

    if spacing == "compact":
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        try:
            return text.encode()
        except UnicodeEncodeError:  # a lone surrogate: escaped, as JavaScript writes it
            return json.dumps(body, separators=(",", ":")).encode()
    if spacing == "spaced":
        return json.dumps(body).encode()
    return json.dumps(body, indent=1).encode()


@settings(max_examples=300, deadline=None)
@given(
    start=st.lists(messages, max_size=6),
    steps=st.lists(
        st.tuples(edits, messages, fields, spacings, st.integers(0, 7), st.sampled_from("ab")),
        min_size=1,
        max_size=14,
    ),
    max_bytes=st.sampled_from([0, 300, 32 * 2**20]),
)
def test_bodies_written_from_the_requests_bytes_are_what_dumps_body_writes(
    start: list[Any], steps: list[Any], max_bytes: int
) -> None:
    """Each request read by the body reader (compact, spaced or indented, so its messages are
    this writer's bytes or not), some of its messages then rewritten as a stage rewrites them
    (a new object) and the body sent on written with the request as its source: always the
    bytes ``dumps_body`` writes of it, whatever was kept from the earlier bodies."""
    from pipeline.wire.body_reader import BodyReader

    reader = BodyReader()
    writer = BodyWriter(max_bytes=max_bytes)
    last: dict[str, tuple[list[Any], list[Any]]] = {}
    for msgs, extra, (spacing, rewrite, key) in stepped(start, steps, "fields"):
        raw = _client_bytes({**extra, "messages": msgs}, spacing)
        try:
            body, fast, source = reader.read_source(raw, scope=key.encode())
        except ValueError:
            continue  # what the reader refuses never reaches the writer
        sent = list(body["messages"])
        # a message equal to the last request's is sent as the same object, as a session
        # keeps its records: written in other bytes this time, perhaps
        earlier, earlier_sent = last.get(key, ([], []))
        for i, (now, then) in enumerate(zip(sent, earlier, strict=False)):
            if now != then or type(now) is not type(then):
                break
            sent[i] = earlier_sent[i]
        last[key] = (list(body["messages"]), sent)
        if sent and rewrite < len(sent):  # a stage's new object, sent in the request's place
            sent = [*sent]
            sent[rewrite] = {"role": "user", "content": f"rewritten {rewrite}"}
        out = {**body, "messages": sent}
        try:
            expected: bytes | type[Exception] = dumps_body(out, fast=fast)
        except Exception as exc:
            expected = type(exc)
        try:
            got: bytes | type[Exception] = writer.write(key, out, fast=fast, source=source)
        except Exception as exc:
            got = type(exc)
        if spacing == "spaced" and fast and isinstance(got, bytes):
            _as_written_or_the_client_s(got, out, expected)
        else:
            assert got == expected


def _as_written_or_the_client_s(got: bytes, out: dict[str, Any], expected: Any) -> None:
    """``got`` reads as ``expected`` (what ``dumps_body`` writes of ``out``) and each of its
    messages is that encoder's bytes of the message or Python's spaced ones (a spaced
    client's, taken from its request)."""
    import json

    from pipeline.wire.body_reader import BodyReader
    from pipeline.wire.encoding import fast_encode, spaced_encode

    assert isinstance(expected, bytes) and dumps_body(json.loads(got)) == expected
    _body, _fast, written = BodyReader().read_source(got)
    if written is None:  # read by the standard library: no places to check
        return
    for i, message in enumerate(out["messages"]):
        piece = bytes(got[written.start(i) : written.ends[i]])
        encodings = []
        for encode in (fast_encode, partial(spaced_encode, ascii_only=piece.isascii())):
            with contextlib.suppress(ValueError):  # a lone surrogate, written escaped
                encodings.append(encode(message))
        assert piece in encodings


def test_a_compact_client_s_messages_are_not_kept_between_bodies() -> None:
    """A conversation whose client writes JSON as the SDKs do, or spaced as Python's
    ``json.dumps`` does: its messages' bytes are taken from each request and the writer keeps
    only what it wrote of its own (a message a stage rewrote); written indented, every message
    is kept, as before there was a source."""
    import json

    from pipeline.wire.body_reader import BodyReader

    kept: dict[str, int] = {}
    for spacing in ("compact", "spaced", "pretty"):
        reader, writer = BodyReader(), BodyWriter()
        msgs: list[Any] = [{"role": "user", "content": "go \u00e9"}]
        for k in range(40):
            raw = _client_bytes({"model": "m", "messages": msgs}, spacing)
            body, fast, source = reader.read_source(raw)
            sent = list(body["messages"])
            sent[1:2] = [{"role": "assistant", "content": "cleared"}] if k else []
            out = {**body, "messages": sent}
            got = writer.write("c", out, fast=fast, source=source)
            if spacing == "spaced":  # the client's own bytes: the messages it sent, spaced
                assert json.loads(got) == out and b'"role": "user"' in got
            else:
                assert got == dumps_body(out)
            msgs = [*msgs, *_round(k)]
        kept[spacing] = sum(len(run.own or b"") for run in writer._kept["c"].runs)
        assert writer.reused > 0
    rewritten = len(b'{"role":"assistant","content":"cleared"}')
    assert kept["compact"] == kept["spaced"] == rewritten
    assert kept["pretty"] > 40 * 100


def test_a_request_sent_on_unchanged_is_its_own_bytes_not_a_copy() -> None:
    """A compact client's request that nothing rewrote is written as the request's bytes
    themselves (a copy of a long body costs ~0.2 ms a megabyte); one a stage changed, or whose
    fields are written otherwise, is written anew."""
    from pipeline.wire.body_reader import BodyReader

    reader, writer = BodyReader(), BodyWriter()
    msgs: list[Any] = [{"role": "user", "content": "go \u00e9"}]
    for k in range(6):
        raw = _client_bytes({"model": "m", "max_tokens": 5, "messages": msgs}, "compact")
        body, fast, source = reader.read_source(raw)
        assert writer.write("c", dict(body), fast=fast, source=source) is raw
        msgs = [*msgs, *_round(k)]
    raw = _client_bytes({"model": "m", "max_tokens": 5, "messages": msgs}, "compact")
    body, fast, source = reader.read_source(raw)
    rewritten = {**body, "messages": [*body["messages"][:-1], {"role": "user", "content": "x"}]}
    got = writer.write("c", rewritten, fast=fast, source=source)
    assert got is not raw and got == dumps_body(rewritten)
    # the same messages with a field before or after them changed to one as long, or the last
    # message left out: written anew, never the request's bytes
    raw = _client_bytes({"model": "m", "messages": msgs, "z": 1}, "compact")
    body, fast, source = reader.read_source(raw)
    for out in (
        {**body, "model": "n"},
        {**body, "z": 2},
        {**body, "messages": body["messages"][:-1]},
    ):
        got = writer.write("c", out, fast=fast, source=source)
        assert got is not raw and got == dumps_body(out)
    assert writer.write("c", dict(body), fast=fast, source=source) is raw
    spaced = _client_bytes({"model": "m", "max_tokens": 5, "messages": msgs}, "spaced")
    body, fast, source = reader.read_source(spaced)
    got = writer.write("c", dict(body), fast=fast, source=source)
    assert got is not spaced and got.startswith(b'{"model":"m","max_tokens":5,')


def test_a_body_in_many_runs_keeps_the_shortest_of_the_request_s_as_its_own() -> None:
    """A stage clearing old results (each a new object, the same on every call) leaves the
    request's messages in many runs between them, each a call a message long: past 64 runs the
    request's shortest are kept as the writer's own bytes, so that writing a body costs a
    bounded number of steps, and what it keeps stays the cleared results and those calls --
    not the results the request still carries. The bytes stay ``dumps_body``'s."""
    from pipeline.wire.body_reader import BodyReader

    reader, writer = BodyReader(), BodyWriter()
    msgs: list[Any] = [{"role": "user", "content": "go"}]
    cleared: dict[int, Any] = {}
    fewer = 0
    for k in range(120):
        raw = _client_bytes({"messages": msgs}, "compact")
        body, fast, source = reader.read_source(raw)
        sent = list(body["messages"])
        for i in range(2, len(sent) - 40, 2):  # the results but the last twenty rounds'
            sent[i] = cleared.setdefault(i, {"role": "user", "content": f"cleared {i}"})
        out = {**body, "messages": sent}
        runs_before = len(writer._kept["c"].runs) if "c" in writer._kept else 0
        assert writer.write("c", out, fast=fast, source=source) == dumps_body(out)
        runs = len(writer._kept["c"].runs)
        assert runs <= 64
        fewer += runs < runs_before
        use, result = _round(k)
        result = {"role": "user", "content": [{**result["content"][0], "content": "z" * 2_000}]}
        msgs = [*msgs, use, result]
    own = sum(len(run.own or b"") for run in writer._kept["c"].runs)
    assert own < len(raw) / 20  # of the results, the request's
    assert fewer >= 2  # kept in fewer runs more than once
    assert writer.from_source > 0 and writer.reused > 0


def test_a_body_written_refusing_non_finite_numbers_takes_nothing_written_without() -> None:
    """A message written as ``null`` (a NaN, ``finite=False``) is not taken into a body that
    must refuse one (``finite=True``) under the same key: it raises, as a new writer would."""
    writer = BodyWriter()
    msgs = [{"role": "user", "content": [{"type": "tool_use", "input": {"v": float("nan")}}]}]
    writer.write("k", {"messages": msgs})
    with pytest.raises(ValueError, match="float"):
        writer.write("k", {"messages": [*msgs, {"role": "user", "content": "go"}]}, finite=True)


def test_what_it_keeps_counts_the_fields_and_the_messages_taken_from_the_request() -> None:
    """A body whose messages are all the request's still counts its fields and a reference a
    message against ``max_bytes``: with none allowed, nothing is kept."""
    from pipeline.wire.body_reader import BodyReader

    system = "s" * 5_000
    msgs = [{"role": "user", "content": "go"}]
    for max_bytes, kept in ((0, 0), (100_000, 1)):
        reader, writer = BodyReader(), BodyWriter(max_bytes=max_bytes)
        for key in range(3):
            raw = _client_bytes({"system": system, "messages": msgs}, "compact")
            body, fast, source = reader.read_source(raw, scope=str(key).encode())
            assert writer.write(key, body, fast=fast, source=source) == dumps_body(body)
            assert writer._bytes <= max_bytes
        assert len(writer._kept) == 3 * kept
        if kept:
            assert writer._bytes >= 3 * 5_000


def test_a_message_too_deep_to_write_spaced_is_not_taken_from_the_request() -> None:
    """A message nested deeper than the standard library writes: not the request's bytes,
    and no error (the writer encodes what it can itself, or says what it cannot)."""
    from pipeline.wire.source import Source

    deep: list[Any] = []
    inner = deep
    for _ in range(100_000):
        inner.append([])
        inner = inner[0]
    message = {"role": "user", "content": deep}
    raw = b'{"messages": [{"role": "user", "content": [[[]]]}]}'
    source = Source(raw, raw.index(b"[") + 1, [len(raw) - 2], [message])
    assert not source.same_bytes(0, b"{}", message)


def test_only_a_spaced_request_s_messages_are_encoded_spaced_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The spaced encoding is tried only where a message's bytes look spaced: never for a
    compact or an indented client's (each new message would be encoded twice for nothing),
    once a new message for a spaced one's."""
    from pipeline.wire import source
    from pipeline.wire.body_reader import BodyReader

    tried: list[str] = []
    real = source.spaced_encode
    monkeypatch.setattr(source, "spaced_encode", lambda m, **kw: tried.append("") or real(m, **kw))
    for spacing, expected in (("compact", 0), ("pretty", 0), ("spaced", 2 * 10 + 1)):
        tried.clear()
        reader, writer = BodyReader(), BodyWriter()
        msgs: list[Any] = [{"role": "user", "content": "go"}]
        for k in range(10):
            msgs = [*msgs, *_round(k)]
            body, fast, source = reader.read_source(_client_bytes({"messages": msgs}, spacing))
            writer.write("c", body, fast=fast, source=source)
        assert len(tried) == expected, spacing
