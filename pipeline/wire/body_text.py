"""Reading the text of a Messages request body around its messages: the fields before and
after the ``messages`` array, and the steps between messages (for
:mod:`pipeline.wire.body_reader`, which reads the messages themselves). Anything not laid out
as it expects is :class:`NotTakenApart`: the body is then parsed whole."""

from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = [
    "DECODER",
    "NotTakenApart",
    "char_boundary",
    "fields_after",
    "fields_before",
    "maybe_surrogate",
    "maybe_surrogate_bytes",
    "next_message",
    "skip",
]

_WS = re.compile(r"[ \t\n\r]*")


def _reject(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: the fast codec would write it as null
        raise ValueError(f"{text[:20]} is out of a float's range")
    return value


DECODER = json.JSONDecoder(parse_constant=_reject, parse_float=_finite)


class NotTakenApart(Exception):
    """A body the reader does not take apart: parse it whole."""


def char_boundary(raw: bytes, size: int) -> int:
    """Where the first ``size`` bytes of ``raw`` end, moved back to the start of a UTF-8
    character (all of ``raw`` when it is shorter, or when more than three continuation bytes
    stand there: not UTF-8, which decoding it whole says at once)."""
    end = min(size, len(raw))
    for _ in range(4):
        if not (0 < end < len(raw) and raw[end] & 0xC0 == 0x80):  # a continuation byte
            return end
        end -= 1
    return len(raw)


def fields_before(text: str) -> tuple[list[tuple[str, Any]], int]:
    """The fields before ``messages`` in ``text`` (a body's start) and where its array
    opens; ``NotTakenApart`` or ``ValueError`` when ``text`` does not hold them whole."""
    pos = skip(text)
    if text[pos : pos + 1] != "{":
        raise NotTakenApart
    before: list[tuple[str, Any]] = []
    pos = skip(text, pos + 1)
    while True:
        if text[pos : pos + 1] == "}":
            raise NotTakenApart  # no messages
        name, pos = _key(text, pos)
        if name == "messages":
            break
        value, pos = DECODER.raw_decode(text, skip(text, pos))
        before.append((name, value))
        pos = _after_value(text, pos)
    pos = skip(text, pos)
    if text[pos : pos + 1] != "[":
        raise NotTakenApart
    return before, pos


def maybe_surrogate_bytes(raw: bytes, start: int, end: int) -> bool:
    """:func:`maybe_surrogate` of the bytes ``raw[start:end]`` (the escape is ASCII)."""
    return raw.find(b"\\ud", start, end) >= 0 or raw.find(b"\\uD", start, end) >= 0


def maybe_surrogate(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` may spell a surrogate: it holds ``\\ud`` or ``\\uD``."""
    return text.find("\\ud", start, end) >= 0 or text.find("\\uD", start, end) >= 0


def next_message(text: str, pos: int) -> int:
    """After a message: past its comma to the next one, or at the array's ``]``."""
    pos = skip(text, pos)
    if text[pos : pos + 1] == ",":
        pos = skip(text, pos + 1)
        if text[pos : pos + 1] == "]":
            raise NotTakenApart  # a trailing comma: the full parse says what is wrong
    elif text[pos : pos + 1] != "]":
        raise NotTakenApart
    return pos


def fields_after(rest: str) -> list[tuple[str, Any]]:
    """The fields that follow the messages array (``rest`` starts after its ``]``)."""
    after: list[tuple[str, Any]] = []
    pos = skip(rest)
    while rest[pos : pos + 1] == ",":
        name, pos = _key(rest, skip(rest, pos + 1))
        value, pos = DECODER.raw_decode(rest, skip(rest, pos))
        after.append((name, value))
        pos = skip(rest, pos)
    if rest[pos : pos + 1] != "}" or rest[skip(rest, pos + 1) :]:
        raise NotTakenApart
    return after


def skip(text: str, pos: int = 0) -> int:
    """Past the whitespace at ``pos``."""
    found = _WS.match(text, pos)
    assert found is not None  # it matches nothing too
    return found.end()


def _key(text: str, pos: int) -> tuple[str, int]:
    """An object key at ``pos`` and where its value starts (past the colon)."""
    if text[pos : pos + 1] != '"':
        raise NotTakenApart
    name, pos = DECODER.raw_decode(text, pos)
    pos = skip(text, pos)
    if text[pos : pos + 1] != ":":
        raise NotTakenApart
    return name, pos + 1


def _after_value(text: str, pos: int) -> int:
    """Past the comma after a value (there must be one: ``messages`` is still to come)."""
    pos = skip(text, pos)
    if text[pos : pos + 1] != ",":
        raise NotTakenApart
    return skip(text, pos + 1)
