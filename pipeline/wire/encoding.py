"""Text every request can carry: lone surrogates cleaned from what goes over the wire.

A lone surrogate has no UTF-8 form, so one in a request makes it unencodable (the SDK fails
inside its JSON encoder): JavaScript writes one when a cut splits an emoji, and text read with
``surrogateescape`` carries one per invalid byte. ``to_api`` cleans every record it sends; the
agent cleans what the caller gives (system prompt, tool definitions, model).
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from pipeline.wire.canonical import ALIKE, NUMBERS, leaf_kinds, plain_ascii
from pipeline.wire.deferred import text_or

__all__ = [
    "dumps_body",
    "encodable",
    "fast_encode",
    "has_lone_surrogate",
    "loads_body",
    "spaced_encode",
]

_SURROGATE = re.compile("[\ud800-\udfff]")
_ENCODE_MAX = 65_536
"""Texts up to this many characters are tested by encoding them (a bounded copy): about four
times faster than the search, which longer texts get (no copy of a huge text)."""


def _lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate: the one thing UTF-8 cannot encode. ``str``'s
    own methods, never a subclass's (which may encode leniently or refuse ``len``)."""
    if str.isascii(text):  # a flag the string carries: most text costs no search at all
        return False
    if str.__len__(text) > _ENCODE_MAX:
        return _SURROGATE.search(text) is not None
    try:
        str.encode(text, "utf-8")
    except UnicodeEncodeError:
        return True
    return False


def encodable(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings replaced by U+FFFD (in a dict key,
    by its ``\\uXXXX`` escape, so that two keys never become one);
    the very same object when there is none (the common case costs one walk, no copy).

    A lone surrogate has no UTF-8 form, so one in a request makes it unencodable: JavaScript
    writes one when a cut splits an emoji, and text read with ``surrogateescape`` carries one
    per invalid byte. The records keep the original; only the wire form is cleaned. Raises
    ``ValueError`` for a value nested too deeply to rebuild (only when it needs cleaning).
    """
    if not _has_surrogate(value):
        return value
    try:
        return _cleaned(value)
    except RecursionError:
        raise ValueError("content nested too deeply to clean of lone surrogates") from None


_PLAIN_DEPTH = 4
"""Levels of dicts and lists read at a glance below a block (a tool call's input and three
levels within it) before the rest is left to the walk."""
_MESSAGE_DEPTH = _PLAIN_DEPTH + 2
"""The same below a whole message (its content list, its blocks)."""


def _plain(value: Any, depth: int = _PLAIN_DEPTH) -> bool:
    """A block of ASCII text and numbers (a text block, a tool_result with string content, a
    tool call and its input): no lone surrogate in it (:func:`plain_ascii`)."""
    return plain_ascii(value, depth, NUMBERS)


def _has_surrogate(value: Any) -> bool:
    # the common block shapes are read directly, anything else walked (without recursion:
    # content may nest as deep as the interpreter allows)
    if isinstance(value, str):
        return _lone_surrogate(value)
    if not isinstance(value, dict | list):
        return False
    # most content is blocks of ASCII strings: read without the walk's stack and seen-set
    if isinstance(value, dict):
        if _plain(value):
            return False
    elif all(map(_plain, value)):
        return False
    stack = [value]
    walked = {id(value)}  # content that contains itself is walked once, not forever
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            try:
                plain_keys = all(map(str.isascii, v))
            except TypeError:  # a key that is not a string (built content): look at each
                plain_keys = False
            if not plain_keys and any(isinstance(k, str) and _SURROGATE.search(k) for k in v):
                return True
        for x in v.values() if isinstance(v, dict) else v:
            if isinstance(x, str):
                if _lone_surrogate(x):
                    return True
            elif isinstance(x, dict | list) and id(x) not in walked:
                walked.add(id(x))
                stack.append(x)
    return False


def _cleaned_dict(value: dict[Any, Any]) -> dict[Any, Any]:
    # U+FFFD would merge two keys into one: a key keeps its surrogates as visible escapes, and
    # one that still meets another key (the escape's own text) gets U+FFFD appended until free
    out: dict[Any, Any] = {
        k: None for k in value if not (isinstance(k, str) and _SURROGATE.search(k))
    }
    cleaned: dict[Any, Any] = {}
    for k, v in value.items():
        if isinstance(k, str) and _SURROGATE.search(k):
            k = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", k)
            while k in out:
                k += "\ufffd"
            out[k] = None
        cleaned[k] = _cleaned(v)
    return cleaned


def _cleaned(value: Any) -> Any:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value) if _SURROGATE.search(value) else value
    if isinstance(value, dict):
        return _cleaned_dict(value)
    if isinstance(value, list):
        return [_cleaned(v) for v in value]
    return value


def loads_body(raw: bytes) -> tuple[Any, bool]:
    """A request body parsed, and whether :func:`dumps_body` may write it with the fast
    encoder. ``msgspec`` parses what is standard JSON (integers of any size exactly, as the
    standard library does); what it refuses is parsed by the standard library, as before
    (``NaN``, ``Infinity``, a lone surrogate's escape, a number out of a float's range, a
    body nested past msgspec's depth), so both accept and refuse the same bodies and say so
    the same way: ``ValueError`` (also ``RecursionError``) from the standard library."""
    try:
        return _decode(raw), True
    except msgspec.DecodeError:
        return json.loads(raw), False


def dumps_body(value: Any, *, fast: bool = True) -> bytes:
    """``value`` as the JSON bytes of a request: ``msgspec`` (UTF-8, compact) when ``fast``
    and it can write the value; else the standard library's ``json.dumps`` (a lone surrogate;
    a value parsed from a body the fast parser refused: ``fast=False``, so that ``NaN`` stays
    ``NaN`` rather than becoming ``null``)."""
    if fast:
        try:
            return _encode(value)
        except (TypeError, ValueError, OverflowError):  # UnicodeEncodeError is a ValueError
            pass
    return json.dumps(value, default=_TEXT).encode("utf-8")


_TEXT = text_or(None)
"""Outputs held out of memory written as their text (:mod:`pipeline.wire.held_outputs`)."""
_decode = msgspec.json.Decoder().decode
_msgspec_encode = msgspec.json.Encoder(enc_hook=_TEXT).encode
# json.dumps(value, ensure_ascii=False, separators=(",", ":")), built once
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=_TEXT).encode


def _encode(value: Any) -> bytes:
    # a value whose strings are not all ASCII, the standard library writes: msgspec would leave
    # a UTF-8 copy on each such string for as long as it lives (pipeline.wire.canonical); a
    # message of ASCII text and numbers is told at a glance (_plain), anything else walked
    if not _plain(value, _MESSAGE_DEPTH) and leaf_kinds(value) == ALIKE:
        return _COMPACT(value).encode("utf-8")
    return _msgspec_encode(value)


_SPACED = {
    ascii_only: json.JSONEncoder(ensure_ascii=ascii_only, default=_TEXT).encode
    for ascii_only in (True, False)
}


def spaced_encode(value: Any, *, ascii_only: bool) -> bytes:
    """``value`` as Python's ``json.dumps`` writes it by default (a space after each ``,`` and
    ``:``; ``ascii_only``: non-ASCII characters escaped, as ``json.dumps``, ``requests`` and
    httpx before 0.28 write a body), or ``ensure_ascii=False``; ``ValueError`` for what it
    cannot write (a lone surrogate left unescaped)."""
    return _SPACED[ascii_only](value).encode("utf-8")


fast_encode = _encode
"""The fast encoder :func:`dumps_body` uses (JSON bytes; ``TypeError``, ``ValueError`` or
``OverflowError`` for what it cannot write): pieces it writes, joined, are its whole. It writes
what msgspec writes; a value whose strings are not all ASCII is written by the standard library,
alike, so that no string it holds keeps a UTF-8 copy of itself (see
:mod:`pipeline.wire.canonical`)."""


def has_lone_surrogate(value: Any) -> bool:
    """Whether a string anywhere in ``value`` (dicts and lists, keys too) holds a lone surrogate:
    what the fast codec refuses. ASCII text costs no search."""
    return _has_surrogate(value)
