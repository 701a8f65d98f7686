"""A message's price (``content_vector``) is the price of its segments (``iter_segments``), each
added in turn: the blocks it prices without making segments give the same bits, and a message
it cannot price fails the same way."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeline.tokens.priors as priors
from pipeline import Message
from pipeline.tokens.features import (
    CLASS_INDEX,
    ContentVector,
    _add_media,
    _add_text,
    _text_kind,
    content_vector,
    iter_segments,
    packed_vector,
)
from pipeline.wire.deferred import DeferredText, crc32_of

WEIGHTS = tuple(priors.PRIOR_WEIGHTS[f] for f in priors.FEATURES)
TOOL_BLOCK = WEIGHTS[priors.FEATURE_INDEX["tool_blocks"]]


def by_segments(message: Message) -> ContentVector:
    """The definition: every segment of the message, priced in order."""
    vec = ContentVector()
    for seg in iter_segments(message):
        if seg.kind == "media":
            if seg.block is not None:
                _add_media(vec.data, seg.block, WEIGHTS)
            continue
        if seg.kind in ("tool_use", "tool_result"):
            vec.data[CLASS_INDEX["structure"]] += TOOL_BLOCK
        _add_text(vec.data, seg.text, _text_kind(seg), WEIGHTS)
    return vec


class Block(Mapping[str, Any]):
    """A block that is a mapping but not a dict (what a caller may build)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class Text(str):
    """A string that is not exactly ``str``."""


class Held:
    """Where a held output lies: a message of one tool_result holding it."""

    def __init__(self, text: str) -> None:
        self.text = text

    def message(self, offset: int, length: int) -> Any:
        block = {"type": "tool_result", "tool_use_id": "t", "content": self.text}
        return {"role": "user", "content": [block]}

    def unreadable(self, handle: DeferredText, why: str | None) -> ValueError:
        return ValueError("unreadable")


def held(text: str) -> DeferredText:
    """``text`` as a proxy holds an output: read back when priced."""
    return DeferredText(Held(text), 0, 1, 0, "t", len(text), crc32_of(text))


texts = st.one_of(
    st.text(max_size=60),
    st.sampled_from(["", "{}", "[1, 2]", "\x1b[31mred\x1b[0m " * 5, "日本語のテキスト" * 4]),
    st.builds(Text, st.text(max_size=20)),
    st.builds(held, st.text(min_size=1, max_size=30)),
)
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
inner_blocks = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.just({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}),
    st.builds(lambda v: {"type": "text", "text": v}, values),
)
result_contents = st.one_of(texts, st.lists(inner_blocks, max_size=3), values)
blocks = st.one_of(
    st.builds(
        lambda c, e: {"type": "tool_result", "tool_use_id": "t", "content": c, **e},
        result_contents,
        st.sampled_from([{}, {"is_error": True}, {"is_error": False}, {"is_error": "yes"}]),
    ),
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.builds(lambda t: {"type": "text", "text": t}, values),
    st.builds(
        lambda n, i: {"type": "tool_use", "id": "t", "name": n, "input": i},
        st.one_of(st.text(max_size=8), st.none(), st.integers()),
        values,
    ),
    st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": "s"}, texts),
    st.builds(lambda t: {"type": "redacted_thinking", "data": t}, st.text(max_size=10)),
    st.builds(lambda v: {"type": "server_tool_use", "input": v}, values),
    st.builds(lambda d: d, st.dictionaries(st.sampled_from(["type", "text", "content"]), values)),
    st.builds(lambda b: Block(b), inner_blocks),
    values,  # not a block at all
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(texts.filter(lambda t: isinstance(t, str)), st.lists(blocks, max_size=5)))
def test_the_price_is_the_segments_price(content: Any) -> None:
    message = Message.user(content, uuid="u")
    try:
        expected: bytes | str = by_segments(message).pack()
    except Exception as exc:  # whatever the walk raises, the price raises
        expected = repr(exc)
    try:
        got: bytes | str = packed_vector(message, WEIGHTS)
    except Exception as exc:
        got = repr(exc)
    assert got == expected
    if isinstance(got, bytes):
        assert content_vector(message, WEIGHTS).pack() == got


def test_a_price_that_fails_fails_as_the_segments_walk_fails() -> None:
    """Pricing a segment fails (weights of the wrong length) before a later segment of the
    same block could: that error, as when each segment was priced as it came."""
    later = {"type": "x", (1, 2): 1}  # a key JSON cannot write: its segment fails to form
    block = {"type": "tool_result", "content": [{"type": "text", "text": "hi"}, later]}
    message = Message.user([block], uuid="u")
    with pytest.raises(ValueError, match="weights for"):
        packed_vector(message, (*WEIGHTS, 1.0))


def deep(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    "block",
    [
        {"type": "tool_use", "id": "t", "name": "n", "input": deep(100_000)},
        {
            "type": "tool_result",
            "tool_use_id": "t",
            "content": [{"type": "other", "x": deep(100_000)}],
        },
    ],
)
def test_a_block_nested_too_deeply_is_named(block: dict[str, Any]) -> None:
    message = Message.user([block], uuid="u")
    with pytest.raises(ValueError, match="'u': a content block is nested too deeply to measure"):
        content_vector(message, WEIGHTS)
