"""Writing a Messages request body in time proportional to what is new in it
(:class:`BodyWriter`).

Each call of a conversation sends the last call's messages again, then a few new ones; the wire
form hands them on as the same message objects (:class:`~pipeline.wire.cache.WireCache` shares
every message but the last ones between requests). Encoding the whole body again costs time in
the size of the history (~0.35 ms a megabyte). The writer keeps, per conversation, the last body
it wrote and where each message ends in it. A new body whose messages begin with the same
objects takes those messages' bytes from the last body (one copy) and encodes only the rest and
the fields around them.

The bytes are always those :func:`~pipeline.wire.encoding.dumps_body` writes (a test holds it
to that over random sequences of bodies): the same encoder writes each piece, and a JSON object
is its members joined in order. What the fast encoder cannot write (a lone surrogate), or a body
read with the standard library (``fast=False``), goes to ``dumps_body`` whole. A message object
is taken to be unchanged while it is the same object: messages are shared between requests and
must not be changed in place (nothing here does; the wire form's contract says the same).
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass
from itertools import compress, count
from typing import Any

from pipeline.wire.encoding import dumps_body, fast_encode

__all__ = ["BodyWriter"]


@dataclass
class _Written:
    raw: bytes
    start: int
    """Where the messages array's first message begins in ``raw``."""
    ends: list[int]
    """Where each message ends, counted from ``start``."""
    messages: list[Any]
    """The message objects written (held: an id is never another object's meanwhile)."""
    fields: dict[str, tuple[Any, bytes]]
    """Each other field's value object and its ``"name":value`` bytes (held, as the messages)."""
    finite: bool
    """Whether the fields were written refusing a NaN or an infinity."""


class BodyWriter:
    """Writes request bodies as :func:`~pipeline.wire.encoding.dumps_body` does, each at the
    cost of what changed since the last body written under the same key (see the module).
    ``max_bytes``: how many bytes of written bodies it keeps at most, the least recently
    written let go first (a conversation whose body was let go is encoded whole once).
    Not thread-safe: one per event loop."""

    def __init__(self, *, max_bytes: int = 32 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._kept: OrderedDict[Hashable, _Written] = OrderedDict()
        self._bytes = 0
        self.reused = 0
        """Messages taken from an earlier body so far (not encoded again)."""

    def write(
        self,
        key: Hashable,
        body: Mapping[str, Any],
        *,
        fast: bool = True,
        finite: bool = False,
        unchanging: Collection[str] = (),
    ) -> bytes:
        """``dumps_body(body, fast=fast)``, reusing the last body written under ``key``.
        ``finite``: refuse a NaN or an infinity anywhere in what is written (``ValueError``, as
        the anthropic SDK's JSON refuses one) rather than write it as the fast encoder does,
        ``null``. ``unchanging``: the fields whose values are never changed in place either (a
        parsed request's: the system prompt and tools a client sends again are the reader's
        same objects): one that is the last body's object there is not encoded again (Claude
        Code's two are ~80 KB a call)."""
        last = self._kept.pop(key, None)
        if last is not None:
            self._bytes -= len(last.raw)
        messages = body.get("messages")
        if not fast or type(messages) is not list or not isinstance(body, dict):
            return _checked(dumps_body(body, fast=fast), body, finite)
        try:
            written = self._spliced(body, messages, last, finite, unchanging)
        except _NotFinite:
            raise ValueError("Out of range float values are not JSON compliant") from None
        except (TypeError, ValueError, OverflowError):  # what the fast encoder refuses
            return _checked(dumps_body(body, fast=fast), body, finite)
        if len(written.raw) <= self.max_bytes:
            self._kept[key] = written
            self._bytes += len(written.raw)
            while self._bytes > self.max_bytes:
                _, gone = self._kept.popitem(last=False)
                self._bytes -= len(gone.raw)
        return written.raw

    def forget(self, key: Hashable) -> None:
        """Let go of what is kept under ``key`` (a conversation let go)."""
        gone = self._kept.pop(key, None)
        if gone is not None:
            self._bytes -= len(gone.raw)

    def _spliced(
        self,
        body: dict[str, Any],
        messages: list[Any],
        last: _Written | None,
        finite: bool,
        unchanging: Collection[str],
    ) -> _Written:
        encode = _finite_encode if finite else fast_encode
        known = last.fields if unchanging and last is not None and last.finite == finite else {}
        fields: dict[str, tuple[Any, bytes]] = {}
        before: list[bytes] = []
        after: list[bytes] = []
        side = before
        for name, value in body.items():
            if type(name) is not str:
                raise TypeError("a field name that is not a string")
            if name == "messages":
                side = after
                continue
            kept = known.get(name)
            if kept is not None and kept[0] is value and name in unchanging:
                piece = kept[1]
            else:
                piece = fast_encode(name) + b":" + encode(value)
            fields[name] = (value, piece)
            side.append(piece)
        same = 0
        if last is not None:
            # the first message that is not the last body's object there (a C-level sweep)
            n = min(len(messages), len(last.messages))
            same = next(compress(count(), map(operator.is_not, messages, last.messages)), n)
        new = [encode(m) for m in messages[same:]]
        head = b"{" + b"".join(p + b"," for p in before) + b'"messages":['
        tail = b"]" + b"".join(b"," + p for p in after) + b"}"
        ends = last.ends[:same] if last is not None else []
        pieces: list[bytes | memoryview] = [head]
        at = 0
        if same:
            assert last is not None
            at = ends[-1]
            pieces.append(memoryview(last.raw)[last.start : last.start + at])
        for k, piece in enumerate(new):
            if k or same:
                pieces.append(b",")
                at += 1
            pieces.append(piece)
            at += len(piece)
            ends.append(at)
        pieces.append(tail)
        self.reused += same
        return _Written(b"".join(pieces), len(head), ends, list(messages), fields, finite)


class _NotFinite(Exception):
    """A NaN or an infinity where ``finite`` asked for none."""


def _finite_encode(value: Any) -> bytes:
    """``fast_encode(value)``; :class:`_NotFinite` when ``value`` holds a NaN or an infinity
    (which the fast encoder writes as ``null``: a piece without ``null`` holds none)."""
    raw = fast_encode(value)
    if b"null" in raw and _holds_non_finite(value):
        raise _NotFinite
    return raw


def _checked(raw: bytes, body: Any, finite: bool) -> bytes:
    """``raw``, the whole body written; ``ValueError`` when ``finite`` and it holds a NaN or an
    infinity (the standard library writes them as ``NaN``, ``Infinity``)."""
    if finite and _holds_non_finite(body):
        raise ValueError("Out of range float values are not JSON compliant")
    return raw


def _holds_non_finite(value: Any) -> bool:
    stack = [value]
    while stack:  # no recursion: content may nest as deep as the interpreter allows
        v = stack.pop()
        if isinstance(v, float):
            if not math.isfinite(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return False
