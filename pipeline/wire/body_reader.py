"""Reading a Messages request body in time proportional to what is new in it
(:class:`BodyReader`).

A client re-sends its whole conversation on every call, and each call's body begins with the
bytes of the last one: the same fields, the same messages, then a few new ones. Parsing all of
it again costs time in the size of the history (about 1.5 ms a megabyte with a fast parser,
3 with the standard library's), and so does every later comparison of the parsed messages with
the last request's. The reader keeps the last few bodies it parsed, with where each message
ends in them. A new body that repeats one of them up to some point takes that body's parsed
messages up to there -- the very same objects: the same text parses to the same value -- and
parses only the rest; the fields around the messages are taken again when their text is the
same. Placing the request in its conversation and finding what changed since its last call
then compare those messages by identity, not by value.

Nothing depends on which earlier body a new one is read against: a message is reused only
where its whole text is the same, so the parsed request is always the one a full parse gives.
Anything the reader does not recognise (not UTF-8, not an object with a ``messages`` array, a
key twice, ``NaN``) is parsed whole by :func:`~pipeline.wire.encoding.loads_body`, with its answers
and errors. The parsed values are shared between requests: they must not be changed in place
(nothing here does: every stage and the wire build new messages).
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pipeline.wire.body_split import split_new, worth_splitting
from pipeline.wire.encoding import has_lone_surrogate, loads_body
from pipeline.wire.shared_strings import shared_message

__all__ = ["BodyReader"]

_WS = re.compile(r"[ \t\n\r]*")
_TIES = 8
"""Bodies on each side of the best match looked at for one sharing as long a start."""
_FIRST_STEP = 256
_MAX_STEP = 1 << 20


def _reject(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: the fast codec would write it as null
        raise ValueError(f"{text[:20]} is out of a float's range")
    return value


_DECODER = json.JSONDecoder(parse_constant=_reject, parse_float=_finite)


class _Unknown(Exception):
    """A body this reader does not take apart: parse it whole."""


@dataclass(slots=True)
class _Body:
    raw: bytes
    """The body as it came: kept as bytes, one byte a byte; decoded, a text with one emoji in it
    (Claude Code's system prompt has one) takes four bytes a character."""
    array_open: int
    """Where the messages array's content starts (after its ``[``), in bytes."""
    ends: list[int]
    """Where each message's text ends, in bytes."""
    messages: list[Any]
    before: list[tuple[str, Any]]
    """The top-level fields before ``messages``, in order."""
    rest: bytes
    """The bytes after the array's ``]``."""
    after: list[tuple[str, Any]]
    """The top-level fields after ``messages``, in order."""
    first_lone: int | None
    """The first message holding a lone surrogate (the fast codec refuses those), if any."""
    fields_lone: bool
    """Whether a field around the messages holds one."""
    kept_at: int = 0
    """When the reader kept it (a count): of bodies sharing as long a start, the latest wins."""

    def fast(self) -> bool:
        """Whether the fast codec reads all of it, as :func:`loads_body` would say."""
        return self.first_lone is None and not self.fields_lone


class BodyReader:
    """Parses request bodies, reusing what the last ones held (see the module docstring).
    ``max_bodies``: how many bodies it keeps (the least recently read go first);
    ``max_bytes``: how many bytes of them at most. A kept body costs its bytes, and where its
    messages end; its parsed messages are shared with the conversation that holds them. Not
    thread-safe: one per event loop."""

    def __init__(self, *, max_bodies: int = 256, max_bytes: int = 16 * 2**20) -> None:
        if max_bodies < 0 or max_bytes < 0:
            raise ValueError(
                f"max_bodies and max_bytes must be zero or more, got {max_bodies}, {max_bytes}"
            )
        self.max_bodies = max_bodies
        self.max_bytes = max_bytes
        self._kept: OrderedDict[int, _Body] = OrderedDict()
        self._order: list[tuple[bytes, int]] = []
        """The kept bodies' (bytes, id) in byte order: the one sharing the longest start with
        a new body is next to where the new body would go."""
        self._count = 0
        self._bytes = 0
        self.reused = 0
        """Messages taken from an earlier body so far (not parsed again)."""

    def read(self, raw: bytes) -> tuple[Any, bool]:
        """The body parsed, and whether it may be written with the fast encoder: what
        :func:`~pipeline.wire.encoding.loads_body` returns for ``raw``, and raises."""
        best, same = self._closest(raw)
        try:
            if best is not None and same > best.array_open:
                k = bisect.bisect_right(best.ends, same)
                parsed = _continue(raw, best, k)
                self.reused += k
                if k == len(best.ends):  # it repeats all of best's messages: best is done
                    self._drop(best)
            else:
                parsed = _scan(raw)
        except (_Unknown, ValueError, RecursionError):  # not UTF-8 among the ValueErrors
            return loads_body(raw)
        self._keep(parsed)
        return _assembled(parsed), parsed.fast()

    def _closest(self, raw: bytes) -> tuple[_Body | None, int]:
        """The kept body that shares the longest start with ``raw``, and how long it is (the
        latest kept of those that share as long a one): one of the two next to ``raw`` in
        byte order, so two comparisons whatever the number of bodies kept."""
        order = self._order
        at = bisect.bisect_left(order, (raw,))
        near = [j for j in (at - 1, at) if 0 <= j < len(order)]
        if not near:
            return None, 0
        shared = {j: _shared_with(raw, self._kept[order[j][1]]) for j in near}
        same = max(shared.values())
        if same == 0:
            return None, 0
        # those sharing as long a start sit next to each other around ``at``
        lo, hi = (
            min(j for j in near if shared[j] == same),
            max(j for j in near if shared[j] == same),
        )
        head = memoryview(raw)[:same]  # a view: the start a long body shares is not copied
        while lo > 0 and at - lo < _TIES and order[lo - 1][0].startswith(head):
            lo -= 1
        while hi + 1 < len(order) and hi - at < _TIES and order[hi + 1][0].startswith(head):
            hi += 1
        best = max((self._kept[order[j][1]] for j in range(lo, hi + 1)), key=lambda b: b.kept_at)
        return best, same

    def _drop(self, body: _Body) -> None:
        if self._kept.pop(id(body), None) is not None:
            self._unorder(body)
            self._bytes -= len(body.raw)

    def _unorder(self, body: _Body) -> None:
        entry = (body.raw, id(body))
        at = bisect.bisect_left(self._order, entry)
        if at < len(self._order) and self._order[at] == entry:
            del self._order[at]

    def _keep(self, body: _Body) -> None:
        if len(body.raw) > self.max_bytes or not self.max_bodies:
            return
        self._count += 1
        body.kept_at = self._count
        self._kept[id(body)] = body
        bisect.insort(self._order, (body.raw, id(body)))
        self._bytes += len(body.raw)
        while self._bytes > self.max_bytes or len(self._kept) > self.max_bodies:
            _, gone = self._kept.popitem(last=False)
            self._unorder(gone)
            self._bytes -= len(gone.raw)


def _assembled(body: _Body) -> dict[str, Any]:
    out = dict(body.before)
    out["messages"] = list(body.messages)
    out.update(body.after)
    return out


class _Offsets:
    """Byte offsets in ``raw`` of positions in ``text``, a decoding of ``raw`` that has
    character ``char`` at byte ``byte``, asked for in increasing order. The bytes since the
    last one, when ASCII, are the characters since it one for one; only text that is not
    costs an encoding (Claude Code's bodies hold a few such characters, not in every message)."""

    __slots__ = ("byte", "char", "raw", "text")

    def __init__(self, raw: bytes, text: str, char: int, byte: int) -> None:
        self.raw, self.text, self.char, self.byte = raw, text, char, byte

    def at(self, char: int) -> int:
        span = char - self.char
        if self.raw[self.byte : self.byte + span].isascii():
            self.byte += span
        else:
            self.byte += len(self.text[self.char : char].encode("utf-8"))
        self.char = char
        return self.byte


def _scan(raw: bytes) -> _Body:
    """A body parsed from scratch, with where its messages end."""
    text = raw.decode("utf-8")
    pos = _skip(text)
    if text[pos : pos + 1] != "{":
        raise _Unknown
    before: list[tuple[str, Any]] = []
    pos = _skip(text, pos + 1)
    while True:
        if text[pos : pos + 1] == "}":
            raise _Unknown  # no messages
        name, pos = _key(text, pos)
        if name == "messages":
            break
        value, pos = _DECODER.raw_decode(text, _skip(text, pos))
        before.append((name, value))
        pos = _after_value(text, pos)
    pos = _skip(text, pos)
    if text[pos : pos + 1] != "[":
        raise _Unknown
    offsets = _Offsets(raw, text, 0, 0)
    array_open = offsets.at(pos + 1)
    return _finish(offsets, array_open, [], [], before)


def _continue(raw: bytes, old: _Body, k: int) -> _Body:
    """``raw`` read against ``old``, whose start it repeats past the messages array's start
    and past old's first ``k`` message ends: those messages, then the rest decoded and parsed.
    Where a message ends is an ASCII character, so the rest starts on a character."""
    pos = old.ends[k - 1] if k else old.array_open
    # decoded only when it is read a message at a time (msgspec reads the bytes)
    tail = _kept_tail(raw, old)
    text = "" if worth_splitting(raw, pos, tail) else raw[pos:].decode("utf-8")
    offsets = _Offsets(raw, text, 0, pos)
    return _finish(offsets, old.array_open, old.ends[:k], old.messages[:k], old.before, old, tail)


def _finish(
    offsets: _Offsets,
    array_open: int,
    ends: list[int],
    messages: list[Any],
    before: list[tuple[str, Any]],
    old: _Body | None = None,
    kept_tail: int = 0,
) -> _Body:
    """The body with ``messages`` (ending at ``ends``) taken already, and its text still to
    parse from ``offsets``' place on: more messages, the array's end, the fields after (its
    last ``kept_tail`` bytes ``old``'s, not new)."""
    raw, text = offsets.raw, offsets.text
    ends, messages = list(ends), list(messages)
    first_lone = None
    if old is not None and old.first_lone is not None and old.first_lone < len(messages):
        first_lone = old.first_lone
    close = split_new(raw, array_open, ends, messages, offsets.byte, kept_tail)
    if close is not None:  # the array's end, its new messages read by msgspec
        rest = raw[close + 1 :]
        after_at = close
    else:
        if not text:  # left undecoded for msgspec, which did not read it
            text = raw[offsets.byte :].decode("utf-8")
            offsets = _Offsets(raw, text, 0, offsets.byte)
        pos = _next_message(text, offsets.char) if messages else _skip(text, offsets.char)
        while text[pos : pos + 1] != "]":
            start = pos
            value, pos = _DECODER.raw_decode(text, pos)
            value = shared_message(value)  # held as long as its conversation: one "role"
            # text decoded strictly from UTF-8 holds no surrogate: only a \uD8xx-\uDFxx
            # escape makes one, so a value whose text has no "\ud" (any case) needs no walk
            if (
                first_lone is None
                and _maybe_surrogate(text, start, pos)
                and has_lone_surrogate(value)
            ):
                first_lone = len(messages)
            messages.append(value)
            ends.append(offsets.at(pos))
            pos = _next_message(text, pos)
        after_at = offsets.at(pos)
        rest = raw[after_at + 1 :]
    # raw ends with old's fields (kept_tail): they are the fields after this array when it ends
    # where they start
    same = old is not None and 0 < kept_tail == len(rest)
    after = old.after if old is not None and same else _fields_after(rest.decode())
    names = [n for n, _ in before] + ["messages"] + [n for n, _ in after]
    if len(set(names)) != len(names):
        raise _Unknown  # a key twice: the last one counts, as the full parse knows
    if old is not None and before is old.before and after is old.after:
        fields_lone = old.fields_lone  # the same fields (the tools, the system prompt): known
    else:
        fields_lone = (
            _maybe_surrogate_bytes(raw, 0, array_open)
            or _maybe_surrogate_bytes(raw, after_at, len(raw))
        ) and has_lone_surrogate(dict([*before, *after]))
    return _Body(raw, array_open, ends, messages, before, rest, after, first_lone, fields_lone)


def _kept_tail(raw: bytes, old: _Body | None) -> int:
    """How many of ``raw``'s last bytes are the fields after ``old``'s messages, as they were."""
    return len(old.rest) if old is not None and raw.endswith(old.rest) else 0


def _maybe_surrogate_bytes(raw: bytes, start: int, end: int) -> bool:
    """:func:`_maybe_surrogate` of the bytes ``raw[start:end]`` (the escape is ASCII)."""
    return raw.find(b"\\ud", start, end) >= 0 or raw.find(b"\\uD", start, end) >= 0


def _maybe_surrogate(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` may spell a surrogate: it holds ``\\ud`` or ``\\uD``."""
    return text.find("\\ud", start, end) >= 0 or text.find("\\uD", start, end) >= 0


def _next_message(text: str, pos: int) -> int:
    """After a message: past its comma to the next one, or at the array's ``]``."""
    pos = _skip(text, pos)
    if text[pos : pos + 1] == ",":
        pos = _skip(text, pos + 1)
        if text[pos : pos + 1] == "]":
            raise _Unknown  # a trailing comma: the full parse says what is wrong
    elif text[pos : pos + 1] != "]":
        raise _Unknown
    return pos


def _fields_after(rest: str) -> list[tuple[str, Any]]:
    """The fields that follow the messages array (``rest`` starts after its ``]``)."""
    after: list[tuple[str, Any]] = []
    pos = _skip(rest)
    while rest[pos : pos + 1] == ",":
        name, pos = _key(rest, _skip(rest, pos + 1))
        value, pos = _DECODER.raw_decode(rest, _skip(rest, pos))
        after.append((name, value))
        pos = _skip(rest, pos)
    if rest[pos : pos + 1] != "}" or rest[_skip(rest, pos + 1) :]:
        raise _Unknown
    return after


def _skip(text: str, pos: int = 0) -> int:
    """Past the whitespace at ``pos``."""
    found = _WS.match(text, pos)
    assert found is not None  # it matches nothing too
    return found.end()


def _key(text: str, pos: int) -> tuple[str, int]:
    """An object key at ``pos`` and where its value starts (past the colon)."""
    if text[pos : pos + 1] != '"':
        raise _Unknown
    name, pos = _DECODER.raw_decode(text, pos)
    pos = _skip(text, pos)
    if text[pos : pos + 1] != ":":
        raise _Unknown
    return name, pos + 1


def _after_value(text: str, pos: int) -> int:
    """Past the comma after a value (there must be one: ``messages`` is still to come)."""
    pos = _skip(text, pos)
    if text[pos : pos + 1] != ",":
        raise _Unknown
    return _skip(text, pos + 1)


def _shared_with(raw: bytes, body: _Body) -> int:
    """``_common_prefix(raw, body.raw)``, first trying where a conversation's next call parts
    from its last: right after the last message (one comparison of that much, where the
    search compares about one and a half times as much in growing and shrinking chunks)."""
    guess = body.ends[-1] if body.ends else body.array_open
    if 0 < guess <= len(raw) and raw.startswith(memoryview(body.raw)[:guess]):
        if raw[guess : guess + 1] != body.raw[guess : guess + 1]:
            return guess  # the array goes on (or ends) where the last one's ended
        return _common_prefix(raw, body.raw, guess)
    return _common_prefix(raw, body.raw)


def _common_prefix(a: bytes, b: bytes, start: int = 0) -> int:
    """How many leading bytes ``a`` and ``b`` share, given that they share ``start``: compared
    a chunk at a time, the chunks growing while they match (most kept bodies part from a new
    one early) and shrinking to find where they part. ``b``'s chunks are views, not copies: a
    chunk costs a ``memcmp`` of its length and nothing more (slicing both copied each chunk
    twice: 1 MB shared took ~100 us instead of ~40)."""
    n = min(len(a), len(b))
    view = memoryview(b)
    lo, step = start, _FIRST_STEP
    while lo + step <= n and a.startswith(view[lo : lo + step], lo):
        lo += step
        step = min(step * 2, _MAX_STEP)
    while step > 1:
        step //= 2
        while lo + step <= n and a.startswith(view[lo : lo + step], lo):
            lo += step
    while lo < n and a[lo] == b[lo]:
        lo += 1
    return lo
