"""A request body's new messages split and parsed by msgspec (:func:`split_new`), for the
body reader (:mod:`pipeline.wire.body_reader`) when they are many: two scans in C find the
messages array and its messages, where each ends follows from their lengths and the separators
between them (checked against the bytes), and each new one is parsed by msgspec -- the values
:func:`~pipeline.wire.encoding.loads_body` gives. A few new messages of a long body are read
one at a time by the reader instead: the scans cover the whole body."""

from __future__ import annotations

import re
from array import array
from typing import Any

import msgspec

from pipeline.wire.shared_strings import shared_message

__all__ = ["SPLIT_BYTES", "SPLIT_SHARE", "split_new", "worth_splitting"]

SPLIT_BYTES = 1 << 16
"""New bytes from which a body's new messages are split and parsed by msgspec (two C scans of
the whole body, then one parse a message), when they are also a quarter of it or more
(:data:`SPLIT_SHARE`): a few new messages of a long body are read one at a time."""
SPLIT_SHARE = 4
"""The least share of the body, as its inverse, the new bytes must be (4: a quarter)."""
_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_ANY = msgspec.json.Decoder()
_WS_BYTES = re.compile(rb"[ \t\n\r]*")
_BLANK = frozenset((b" ", b"\t", b"\n", b"\r"))
"""The bytes JSON allows between values (what :func:`_skip_bytes` skips), one at a time."""


def worth_splitting(raw: bytes, start: int, kept_tail: int = 0) -> bool:
    """Whether the bytes from ``start`` on, less the last ``kept_tail`` (fields after the
    messages that an earlier body ended with too: Claude Code's system prompt and tools, ~80 KB
    a call, none of it new), are many enough for :func:`split_new`."""
    new = len(raw) - start - kept_tail
    return new >= SPLIT_BYTES and SPLIT_SHARE * new >= len(raw)


def split_new(
    raw: bytes,
    array_open: int,
    ends: array[int],
    messages: list[Any],
    start: int,
    kept_tail: int = 0,
) -> int | None:
    """Many new messages (from byte ``start`` on, after ``messages``, which end at ``ends``)
    split and parsed by msgspec, appended to ``messages`` and ``ends``; where the array's
    ``]`` is. None, with nothing appended, when the new part is small (two scans of the whole
    body would cost more than reading it one message at a time), when msgspec refuses any of
    the body (what it refuses the standard library reads: a lone surrogate's escape, a
    number out of a float's range) or when the body is not laid out as the reader took it.
    The values are msgspec's: :func:`~pipeline.wire.encoding.loads_body`'s own."""
    if not worth_splitting(raw, start, kept_tail):
        return None
    try:
        array = _FIELDS.decode(raw)["messages"]
        items = _ITEMS.decode(array)
    except (msgspec.DecodeError, KeyError):
        return None
    close = array_open + len(array) - 2
    # the messages array msgspec took is the one at array_open (a later "messages" key would
    # be a key twice, which the fields after the array show)
    if not raw.startswith(array, array_open - 1):
        return None
    k, pos = len(ends), start
    if len(items) < k:
        return None
    found: list[Any] = []
    ids: dict[str, str] = {}  # a call's id and its result's: one string
    at: list[int] = []
    for j, item in enumerate(items[k:], start=k):
        if j:
            if raw[pos : pos + 1] in _BLANK:
                pos = _skip_bytes(raw, pos)
            if raw[pos : pos + 1] != b",":
                return None
            pos += 1
        if raw[pos : pos + 1] in _BLANK:  # (compact JSON, as the SDKs write it, has none)
            pos = _skip_bytes(raw, pos)
        try:
            value = _ANY.decode(item)
        except msgspec.DecodeError:
            return None
        found.append(shared_message(value, ids))
        pos += len(item)
        at.append(pos)
    if _skip_bytes(raw, pos) != close:
        return None
    messages += found
    ends.extend(at)
    return close


def _skip_bytes(raw: bytes, pos: int) -> int:
    """Past the whitespace at byte ``pos``."""
    found = _WS_BYTES.match(raw, pos)
    assert found is not None  # it matches nothing too
    return found.end()
