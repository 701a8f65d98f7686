"""What a message costs in tokens, before any calibration.

- :func:`iter_segments` walks a message the way the API sees it and yields the pieces to price
  (the reference estimator and the calibrated one price these same segments);
- :func:`content_vector` turns a message into base tokens per content class
  (:mod:`pipeline.tokens.text_stats` classifies each text, :mod:`pipeline.tokens.media` prices
  images, :mod:`pipeline.tokens.priors` holds the tokens per feature).

Nothing here serialises a whole message or session: only ``tool_use`` inputs and unknown
blocks are turned into JSON, one block at a time.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator, Mapping, Sequence
from functools import reduce
from operator import add, mul
from typing import Any, Literal, NamedTuple

from pipeline.messages import Message
from pipeline.tokens.media import IMAGE_TOKENS, image_tokens
from pipeline.tokens.priors import CLASS_INDEX, CLASSES, FEATURE_INDEX, FEATURES
from pipeline.tokens.text_stats import TextKind, text_class, text_stats

__all__ = [
    "ContentVector",
    "Segment",
    "block_segments",
    "content_vector",
    "is_wire_visible",
    "iter_segments",
]


SegmentKind = Literal["text", "thinking", "tool_use", "tool_result", "media", "other"]


class Segment(NamedTuple):
    """One piece of a message's wire-visible content, as the estimators price it (a named
    tuple: one is made per block priced, and a frozen dataclass costs twice as much to make)."""

    kind: SegmentKind
    text: str = ""
    """What to price: block text, thinking, ``name + JSON(input)`` of a tool_use, the JSON of
    an unknown block. Empty for a tool_result's wrapper (its content follows as text
    segments) and for media."""
    block: Mapping[str, Any] | None = None
    """The image or document block (``media`` only)."""
    error: bool = False
    """Text inside an ``is_error`` tool_result."""


def is_wire_visible(message: Message) -> bool:
    """Progress and system records are not sent, except ``local_command`` output."""
    return message.type != "progress" and not (
        message.type == "system" and message.subtype != "local_command"
    )


def iter_segments(message: Message) -> Iterator[Segment]:
    """The segments of one message's content (visibility is the caller's test)."""
    content = message.content
    if isinstance(content, str):
        if content:
            yield Segment("text", content)
        return
    for block in content:
        if isinstance(block, Mapping):
            try:
                yield from _block_segments(block, error=False)
            except RecursionError:  # a block built past what JSON can be written for
                raise ValueError(
                    f"record {message.uuid!r}: a content block is nested too deeply to measure"
                ) from None


def block_segments(block: Mapping[str, Any]) -> Iterator[Segment]:
    """The segments of one content block: what :func:`iter_segments` yields for it."""
    try:
        yield from _block_segments(block, error=False)
    except RecursionError:  # a block built past what JSON can be written for
        raise ValueError("a content block is nested too deeply to measure") from None


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str)
"""``json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)``: JSON as
JavaScript's ``JSON.stringify`` writes it (the reference's count of a tool call's input), without
building an encoder per block (every new tool call is measured by each estimator)."""


def _block_segments(block: Mapping[str, Any], *, error: bool) -> Iterator[Segment]:
    btype = block.get("type")
    if btype == "text":
        yield Segment("text", str(block.get("text") or ""), error=error)
    elif btype == "thinking":
        yield Segment("thinking", str(block.get("thinking") or ""))
    elif btype == "redacted_thinking":
        yield Segment("thinking", str(block.get("data") or ""))
    elif btype in ("image", "document"):
        yield Segment("media", block=block)
    elif btype == "tool_use":
        name = str(block.get("name") or "")
        yield Segment("tool_use", name + _JSON.encode(block.get("input")))
    elif btype == "tool_result":
        yield Segment("tool_result")
        failed = bool(block.get("is_error"))
        content = block.get("content")
        if isinstance(content, str):
            yield Segment("text", content, error=failed)
        elif isinstance(content, list):
            for inner in content:
                if isinstance(inner, Mapping):
                    yield from _block_segments(inner, error=failed)
    else:  # unknown and server blocks: their JSON, one block at a time
        yield Segment("other", _JSON.encode(block))


_NC, _NF = len(CLASSES), len(FEATURES)
_ONE_BY_ONE = 8
"""Fewer vectors than this are summed with :meth:`ContentVector.add` (faster for a few)."""
_ZERO = bytes(8 * (2 * _NC + _NF))


class ContentVector:
    """Base tokens and characters per content class, and the raw features, of some content.

    One array of doubles holds all three (tokens, then characters, then features): an
    estimator caches thousands of these, and three arrays cost twice the headers of one (a
    list of floats would be about three times the size). ``tokens``, ``chars`` and
    ``features`` are copies of their part (write through ``data``).
    """

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = array("d", _ZERO)

    @property
    def tokens(self) -> array[float]:
        """Base tokens per class, in :data:`CLASSES` order."""
        return self.data[:_NC]

    @property
    def chars(self) -> array[float]:
        """Characters per class, in :data:`CLASSES` order."""
        return self.data[_NC : 2 * _NC]

    @property
    def features(self) -> array[float]:
        """Raw text features, in :data:`FEATURES` order."""
        return self.data[2 * _NC :]

    def add(self, other: ContentVector) -> None:
        """Accumulate ``other`` into this vector."""
        mine = self.data
        mine[:] = array("d", map(add, mine, other.data))

    @classmethod
    def sum_of(cls, vectors: Sequence[ContentVector]) -> ContentVector:
        """A new vector: ``vectors`` added in their order, as :meth:`add` adds them one after
        another (the same sums, bit for bit). Many are added a column at a time: a first
        estimate of 1,000 messages spent ~3 ms building an array per message."""
        out = cls()
        if len(vectors) < _ONE_BY_ONE:
            for v in vectors:
                out.add(v)
        else:
            columns = zip(*(v.data for v in vectors), strict=True)
            out.data = array("d", [reduce(add, column, 0.0) for column in columns])
        return out


def _add_text(vec: ContentVector, text: str, kind: TextKind, weights: Sequence[float]) -> None:
    if not text:
        return
    stats = text_stats(text)
    ci = CLASS_INDEX[text_class(text, stats, kind=kind)]
    features = stats.features
    if len(weights) != len(features):
        raise ValueError(f"{len(weights)} weights for {len(features)} features")
    base = sum(map(mul, weights, features))  # the products added in a loop's order
    # never below 12 chars/token: the negative blank-run weight must not price text at ~0
    data = vec.data
    data[ci] += max(base, stats.chars / 12.0)
    data[_NC + ci] += stats.chars
    data[2 * _NC :] = array("d", map(add, data[2 * _NC :], features))


def _add_media(vec: ContentVector, block: Mapping[str, Any], weights: Sequence[float]) -> None:
    if block.get("type") == "document":
        source = block.get("source")
        if isinstance(source, Mapping) and source.get("type") == "text":
            _add_text(vec, str(source.get("data") or ""), "text", weights)
            return
        vec.data[CLASS_INDEX["media"]] += IMAGE_TOKENS  # PDFs and the like: no cheap size
        return
    vec.data[CLASS_INDEX["media"]] += image_tokens(block)


def content_vector(message: Message, weights: Sequence[float]) -> ContentVector:
    """Base tokens per class of one message's content; ``weights`` in :data:`FEATURES` order."""
    vec = ContentVector()
    tool_block = weights[FEATURE_INDEX["tool_blocks"]]
    for seg in iter_segments(message):
        if seg.kind == "media":
            if seg.block is not None:
                _add_media(vec, seg.block, weights)
            continue
        if seg.kind in ("tool_use", "tool_result"):  # ids (sent twice) and block wrappers
            vec.data[CLASS_INDEX["structure"]] += tool_block
            vec.data[2 * _NC + FEATURE_INDEX["tool_blocks"]] += 1.0
        _add_text(vec, seg.text, _text_kind(seg), weights)
    return vec


def _text_kind(seg: Segment) -> TextKind:
    if seg.kind == "thinking":
        return "thinking"
    if seg.kind in ("tool_use", "other"):  # tool inputs and unknown blocks are JSON
        return "json"
    return "error" if seg.error else "text"
