"""Reading a Messages event stream for its id, model and usage as it passes: the same for any
way the bytes are cut into chunks, and bounded by one line's limit whatever the stream holds."""

from __future__ import annotations

import json
from typing import Any, cast

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.dropin.event_stream import MAX_EVENT_LINE, EventStreamUsage


def _event(name: str, data: dict[str, Any], *, crlf: bool = False) -> bytes:
    end = "\r\n" if crlf else "\n"
    return f"event: {name}{end}data: {json.dumps(data)}{end}{end}".encode()


def _stream(texts: list[str], *, crlf: bool = False) -> bytes:
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_01",
            "type": "message",
            "role": "assistant",
            "model": "claude-x",
            "content": [],
            "usage": {"input_tokens": 1200, "output_tokens": 1, "cache_read_input_tokens": 7},
        },
    }
    out = [_event("message_start", start, crlf=crlf)]
    out.append(
        _event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
            crlf=crlf,
        )
    )
    for text in texts:
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta"}}
        delta["delta"]["text"] = text  # type: ignore[index]
        out.append(_event("content_block_delta", delta, crlf=crlf))
    out.append(
        _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": 42, "input_tokens": None},
            },
            crlf=crlf,
        )
    )
    out.append(_event("message_stop", {"type": "message_stop"}, crlf=crlf))
    return b"".join(out)


def _read(chunks: list[bytes]) -> EventStreamUsage:
    reader = EventStreamUsage(cast(Any, None))  # feeding alone never reaches the session
    for chunk in chunks:
        reader.feed(chunk)
    return reader


texts = st.lists(
    st.sampled_from(["hi", "message_delta", '"message_delta"', "\n", "é😀", 'data: {"x": 1}']),
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(texts=texts, cuts=st.lists(st.integers(0, 4_000), max_size=30), crlf=st.booleans())
def test_any_chunking_reads_the_same_id_model_and_usage(
    texts: list[str], cuts: list[int], crlf: bool
) -> None:
    raw = _stream(texts, crlf=crlf)
    points = sorted({c % (len(raw) + 1) for c in cuts})
    chunks = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True)]
    reader = _read(chunks)
    assert reader.final
    assert reader.message["id"] == "msg_01" and reader.message["model"] == "claude-x"
    # message_start's counts, then message_delta's running totals (None is no news)
    assert reader.usage == {
        "input_tokens": 1200,
        "output_tokens": 42,
        "cache_read_input_tokens": 7,
    }


def test_a_line_past_the_limit_is_not_held_and_the_lines_after_it_are_read() -> None:
    """An upstream that sends a line without end holds at most one line's limit here, and
    the stream's usage after that line is still read."""
    reader = EventStreamUsage(cast(Any, None))
    reader.feed(b"data: ")
    for _ in range(3 * MAX_EVENT_LINE // 4096):
        reader.feed(b"x" * 4096)
        assert sum(map(len, reader._parts)) <= MAX_EVENT_LINE
    reader.feed(b"still the long line\n\n" + _stream(["ok"]))
    assert reader.final and reader.usage["output_tokens"] == 42
