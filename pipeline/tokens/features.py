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
import math
import struct
from array import array
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from operator import add, mul
from typing import Any, Literal, NamedTuple

import msgspec

from pipeline.messages import Message
from pipeline.tokens.media import IMAGE_TOKENS, image_tokens
from pipeline.tokens.priors import CLASS_INDEX, CLASSES, FEATURE_INDEX
from pipeline.tokens.text_stats import TextKind, text_class, text_stats
from pipeline.wire.canonical import WRITTEN_ALIKE, plain_ascii
from pipeline.wire.deferred import resolved, text_or

__all__ = [
    "ContentVector",
    "Segment",
    "block_segments",
    "content_vector",
    "is_wire_visible",
    "iter_segments",
    "packed_vector",
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
        if type(block) is dict or isinstance(block, Mapping):
            try:
                yield from _block_segments(block, error=False)
            except RecursionError:  # a block built past what JSON can be written for
                raise _too_deep(message) from None


def _too_deep(message: Message) -> ValueError:
    """The error for a block of ``message`` built past what JSON can be written for."""
    return ValueError(f"record {message.uuid!r}: a content block is nested too deeply to measure")


def block_segments(block: Mapping[str, Any]) -> Iterator[Segment]:
    """The segments of one content block: what :func:`iter_segments` yields for it."""
    try:
        yield from _block_segments(block, error=False)
    except RecursionError:  # a block built past what JSON can be written for
        raise ValueError("a content block is nested too deeply to measure") from None


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=text_or(str))
"""``json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)``: JSON as
JavaScript's ``JSON.stringify`` writes it (the reference's count of a tool call's input), without
building an encoder per block (every new tool call is measured by each estimator)."""


_AS_IS = frozenset({str, int, bool, type(None)})
"""Values JavaScript writes as Python's encoder does, with nothing inside them."""


def _as_javascript(value: Any) -> Any:
    """``value`` with the numbers JavaScript's ``JSON.stringify`` writes otherwise than
    Python's encoder made alike: an integral float as an integer (``1.0`` is written ``1``),
    a NaN or an infinity as null. The same object when nothing in it changes."""
    kind = type(value)
    if kind is float:
        if not math.isfinite(value):
            return None
        return int(value) if value.is_integer() and abs(value) < 1e21 else value
    if kind is dict and all(type(v) in _AS_IS for v in value.values()):
        return value  # (most inputs: strings and integers, nothing to look into)
    if kind is dict:
        out = {k: _as_javascript(v) for k, v in value.items()}
        return value if all(out[k] is v for k, v in value.items()) else out
    if kind is list:
        items = [_as_javascript(v) for v in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    return value


def _block_segments(block: Mapping[str, Any], *, error: bool) -> Iterator[Segment]:
    btype = block.get("type")
    if btype == "text":
        yield Segment("text", str(resolved(block.get("text")) or ""), error=error)
    elif btype == "thinking":
        yield Segment("thinking", str(resolved(block.get("thinking")) or ""))
    elif btype == "redacted_thinking":
        yield Segment("thinking", str(block.get("data") or ""))
    elif btype in ("image", "document"):
        yield Segment("media", block=block)
    elif btype == "tool_use":
        yield Segment("tool_use", _call_text(block))
    elif btype == "tool_result":
        yield Segment("tool_result")
        failed = bool(block.get("is_error"))
        content = resolved(block.get("content"))
        if isinstance(content, str):
            yield Segment("text", content, error=failed)
        elif isinstance(content, list):
            for inner in content:
                if type(inner) is dict or isinstance(inner, Mapping):
                    yield from _block_segments(inner, error=failed)
    else:  # unknown and server blocks: their JSON, one block at a time
        yield Segment("other", _JSON.encode(block))


def _call_text(block: Mapping[str, Any]) -> str:
    """What a tool_use costs as text: its name and its input's JSON."""
    given = block.get("input")
    name = str(block.get("name") or "")
    if plain_ascii(given, _INPUT_DEPTH, WRITTEN_ALIKE):  # most inputs: strings and integers
        try:
            return name + _FAST_JSON(given).decode("ascii")
        except (TypeError, ValueError, OverflowError):  # an integer past 64 bits
            pass
    return name + _JSON.encode(_as_javascript(given))


_FAST_JSON = msgspec.json.Encoder().encode
"""A tool call's input of ASCII strings and integers as :data:`_JSON` writes it (nothing in
it for :func:`_as_javascript` to change), ~3 times as fast."""
_INPUT_DEPTH = 4
"""Levels below a tool call's input read at a glance (:func:`plain_ascii`)."""


_NC = len(CLASSES)
_ZERO = bytes(8 * 2 * _NC)
_ENTRY = struct.Struct("<Bdd")
"""One class of a packed vector: its index, base tokens and characters (17 bytes)."""


class ContentVector:
    """Base tokens and characters per content class of some content.

    One array of doubles holds both (tokens, then characters). ``tokens`` and ``chars`` are
    copies of their part (write through ``data``). An estimator caches thousands of vectors,
    one a message, and most messages have one or two classes: it keeps them :meth:`pack`-ed
    (17 bytes a class present, ~70 bytes a message against ~350 for the array) and adds them
    up with :meth:`sum_packed`.
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
        return self.data[_NC:]

    def add(self, other: ContentVector) -> None:
        """Accumulate ``other`` into this vector."""
        mine = self.data
        mine[:] = array("d", map(add, mine, other.data))

    def pack(self) -> bytes:
        """The classes this vector has (tokens or characters not 0), packed:
        :meth:`unpack` and :meth:`sum_packed` read it back exactly."""
        data = self.data
        return b"".join(
            _ENTRY.pack(i, data[i], data[_NC + i]) for i in range(_NC) if data[i] or data[_NC + i]
        )

    @classmethod
    def unpack(cls, packed: bytes) -> ContentVector:
        """The vector :meth:`pack` packed."""
        return cls.sum_packed((packed,))

    @classmethod
    def sum_of(cls, vectors: Iterable[ContentVector]) -> ContentVector:
        """A new vector: ``vectors`` added in their order, as :meth:`add` adds them one after
        another (the same sums, bit for bit)."""
        out = cls()
        for v in vectors:
            out.add(v)
        return out

    @classmethod
    def sum_packed(cls, packed: Iterable[bytes]) -> ContentVector:
        """A new vector: the packed vectors added in their order, with the same bits as
        :meth:`add` adding each in turn (a class a vector does not have adds 0.0, which
        changes no sum). Each class present costs one addition: a first estimate of 1,000
        messages reads ~1,500 entries, not 1,000 arrays a column at a time."""
        sums = [0.0] * (2 * _NC)
        for p in packed:
            for i, tokens, chars in _ENTRY.iter_unpack(p):
                sums[i] += tokens
                sums[_NC + i] += chars
        out = cls()
        out.data = array("d", sums)
        return out


_Sums = MutableMapping[int, float] | array  # type: ignore[type-arg]
"""What prices are added into: a vector's array, or a map of the entries a price touched."""


def _add_text(data: _Sums, text: str, kind: TextKind, weights: Sequence[float]) -> None:
    if not text:
        return
    stats = text_stats(text)
    ci = CLASS_INDEX[text_class(text, stats, kind=kind)]
    features = stats.features
    if len(weights) != len(features):
        raise ValueError(f"{len(weights)} weights for {len(features)} features")
    base = sum(map(mul, weights, features))  # the products added in a loop's order
    # never below 12 chars/token: the negative blank-run weight must not price text at ~0
    data[ci] += max(base, stats.chars / 12.0)
    data[_NC + ci] += stats.chars


def _add_media(data: _Sums, block: Mapping[str, Any], weights: Sequence[float]) -> None:
    if block.get("type") == "document":
        source = block.get("source")
        if isinstance(source, Mapping) and source.get("type") == "text":
            _add_text(data, str(resolved(source.get("data")) or ""), "text", weights)
            return
        data[CLASS_INDEX["media"]] += IMAGE_TOKENS  # PDFs and the like: no cheap size
        return
    data[CLASS_INDEX["media"]] += image_tokens(block)


def content_vector(message: Message, weights: Sequence[float]) -> ContentVector:
    """Base tokens per class of one message's content; ``weights`` in :data:`FEATURES` order."""
    return ContentVector.unpack(packed_vector(message, weights))


def packed_vector(message: Message, weights: Sequence[float]) -> bytes:
    """``content_vector(message, weights).pack()``, without the vector: a new conversation
    prices every message it holds, and most touch one or two classes of ten."""
    data: defaultdict[int, float] = defaultdict(float)
    tool_block = weights[FEATURE_INDEX["tool_blocks"]]
    content = message.content
    if isinstance(content, str):
        _add_text(data, content, "text", weights)
        return _packed(data)
    for block in content:
        # the blocks most messages are made of, priced without their segments (the same
        # additions, in the same order)
        if type(block) is dict:
            btype = block.get("type")
            if btype == "tool_result":
                inner = block.get("content")
                if type(inner) is str:
                    data[_STRUCTURE] += tool_block
                    kind: TextKind = "error" if block.get("is_error") else "text"
                    _add_text(data, inner, kind, weights)
                    continue
            elif btype == "text":
                text = block.get("text")
                if type(text) is str:
                    _add_text(data, text, "text", weights)
                    continue
            elif btype == "tool_use":
                try:
                    call = _call_text(block)
                except RecursionError:
                    raise _too_deep(message) from None
                data[_STRUCTURE] += tool_block
                _add_text(data, call, "json", weights)
                continue
        elif not isinstance(block, Mapping):
            continue
        # each segment priced as it comes, as iter_segments' reader does (the same error
        # first when pricing one fails)
        segments = _block_segments(block, error=False)
        while True:
            try:
                seg = next(segments)
            except StopIteration:
                break
            except RecursionError:  # a block built past what JSON can be written for
                raise _too_deep(message) from None
            _add_segment(data, seg, weights, tool_block)
    return _packed(data)


def _packed(data: Mapping[int, float]) -> bytes:
    """The entries of ``data`` (tokens at a class's index, characters ``_NC`` on), as
    :meth:`ContentVector.pack` packs a vector that holds them."""
    entries = []
    for i in sorted({k % _NC for k in data}):
        tokens, chars = data.get(i, 0.0), data.get(_NC + i, 0.0)
        if tokens or chars:
            entries.append(_ENTRY.pack(i, tokens, chars))
    return b"".join(entries)


_STRUCTURE = CLASS_INDEX["structure"]


def _add_segment(data: _Sums, seg: Segment, weights: Sequence[float], tool_block: float) -> None:
    if seg.kind == "media":
        if seg.block is not None:
            _add_media(data, seg.block, weights)
        return
    if seg.kind in ("tool_use", "tool_result"):  # ids (sent twice) and block wrappers
        data[_STRUCTURE] += tool_block
    _add_text(data, seg.text, _text_kind(seg), weights)


def _text_kind(seg: Segment) -> TextKind:
    if seg.kind == "thinking":
        return "thinking"
    if seg.kind in ("tool_use", "other"):  # tool inputs and unknown blocks are JSON
        return "json"
    return "error" if seg.error else "text"
