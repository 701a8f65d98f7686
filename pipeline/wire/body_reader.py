"""Reading a Messages request body in time proportional to what is new in it
(:class:`BodyReader`).

A client re-sends its whole conversation on every call, and each call's body begins with the
bytes of the last one: the same fields, the same messages, then a few new ones. Parsing all of
it again costs time in the size of the history (about 1.5 ms a megabyte with a fast parser,
3 with the standard library's), and so does every later comparison of the parsed messages with
the last request's. The reader keeps what it parsed of the last bodies -- their messages, where
each message ends, a digest of each body's bytes up to every message's end, and its opening
(the bytes up to its first message's end, at most 256 KB of that message) -- but not the bodies
themselves (those were as large again as everything parsed from them). A new body whose
bytes up to some message's end have a kept body's digest there takes that body's parsed
messages up to there -- the very same objects: the same text parses to the same value -- and
parses only the rest; the fields around the messages are taken again when their digest is the
same. Placing the request in its conversation and finding what changed since its last call
then compare those messages by identity, not by value.

The digests are XXH3-128 under a seed drawn at random for each process: checking one costs
about what comparing the bytes did (~0.02 ms a megabyte), and two texts that differ share
one by chance once in 2**128. A body is only ever read against bodies sent with the same
credential (``scope``): one made to collide with another key's message could at most stand
for a text of its own key's. The bodies a new one may continue are those that open like it:
kept in the order of their openings, they sit right before where it would go (a search, then
one comparison). Among them, finding the one it continues costs one digest where they part
(conversations that share an opening part at their first different message), and a few
along the latest kept of those alike further: one four messages before its
end, each of its last four (where a conversation's next call parts from it: a client moves its
cache mark), and where the first differs, halving. Which of the others are alike with it that
far their own digests say, without a digest of the new body.

Nothing depends on which earlier body a new one is read against: a message is reused only
where its whole text is the same, so the parsed request is always the one a full parse gives.
Anything the reader does not recognise (not UTF-8, not an object with a ``messages`` array, a
key twice, ``NaN``) is parsed whole by :func:`~pipeline.wire.encoding.loads_body`, with its answers
and errors. The parsed values are shared between requests: they must not be changed in place
(nothing here does: every stage and the wire build new messages).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any

import xxhash

from pipeline.wire.body_split import split_new, worth_splitting
from pipeline.wire.encoding import has_lone_surrogate, loads_body
from pipeline.wire.shared_strings import shared_message

__all__ = ["BodyReader"]

_WS = re.compile(r"[ \t\n\r]*")
_SEED = int.from_bytes(os.urandom(8), "little")
"""The digests' seed: this process's own, never written anywhere."""
_SCOPE_KEY = os.urandom(16)
"""What a credential is digested under before the reader keeps it (never the credential)."""
_DIGEST = 16
"""Bytes of one digest."""
_TAIL = 4
"""A kept body's last messages checked one by one (a next call parts from it among them)."""
_CROWD = 8
"""Kept bodies still alike past this many of a read's steps: only the latest this many go on
(bodies that share a long history and part late, one after another, would otherwise cost a
read steps in the square of their number)."""
_GROUP = 64
"""Kept bodies that open alike read against at most (the latest this many)."""
_OPENING = 256 * 1024
"""The most bytes of a kept body's first message kept as its opening."""
_OWN = 64
"""Bytes a kept body costs the reader a message (its digest, its end, the list slots), counted
against ``max_bytes`` with the body's own length."""


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
    size: int
    """The body's length in bytes and :data:`_OWN` a message: what it counts against the
    reader's ``max_bytes``."""
    array_open: int
    """Where the messages array's content starts (after its ``[``), in bytes."""
    ends: list[int]
    """Where each message's text ends, in bytes."""
    digests: bytes
    """The digest of the body's bytes up to ``array_open``, then up to each message's end."""
    messages: list[Any]
    before: list[tuple[str, Any]]
    """The top-level fields before ``messages``, in order."""
    rest_size: int
    """How many bytes follow the array's ``]``."""
    rest_digest: bytes
    """Their digest."""
    after: list[tuple[str, Any]]
    """The top-level fields after ``messages``, in order."""
    first_lone: int | None
    """The first message holding a lone surrogate (the fast codec refuses those), if any."""
    fields_lone: bool
    """Whether a field around the messages holds one."""
    opening: bytes = b""
    """Its bytes up to its first message's end (up to ``array_open`` without messages; at most
    :data:`_OPENING` of that message): kept in byte order, the bodies a new one opens like are
    next to where it would go."""
    scope: bytes = b""
    """The digest of the credential it was sent with."""
    kept_at: int = 0
    """When the reader kept it (a count): of bodies a new one continues as far, the latest wins."""

    def fast(self) -> bool:
        """Whether the fast codec reads all of it, as :func:`loads_body` would say."""
        return self.first_lone is None and not self.fields_lone

    def bound(self, j: int) -> int:
        """Where its ``j``-th message ends (0: where the messages array's content starts)."""
        return self.ends[j - 1] if j else self.array_open

    def digest(self, j: int) -> bytes:
        """The digest of its bytes up to :meth:`bound` ``(j)``."""
        return self.digests[j * _DIGEST : (j + 1) * _DIGEST]


def _same_at(a: _Body, b: _Body, j: int) -> bool:
    """Whether ``a``'s and ``b``'s bytes are alike up to their bound ``j``."""
    return (
        j <= min(len(a.ends), len(b.ends))
        and a.bound(j) == b.bound(j)
        and a.digest(j) == b.digest(j)
    )


class BodyReader:
    """Parses request bodies, reusing what the last ones held (see the module docstring).
    ``max_bodies``: how many bodies it keeps what it parsed of (the least recently read go
    first); ``max_bytes``: how large those bodies may be together, counted at their length, their
    opening and 64 bytes a message. A kept body costs a digest and an offset a message (~60
    bytes) and its opening (shared by the bodies that open alike), and keeps its parsed
    messages alive -- the ones the conversation that sent it holds while it is held. Not
    thread-safe: one per event loop."""

    def __init__(self, *, max_bodies: int = 256, max_bytes: int = 256 * 2**20) -> None:
        if max_bodies < 0 or max_bytes < 0:
            raise ValueError(
                f"max_bodies and max_bytes must be zero or more, got {max_bodies}, {max_bytes}"
            )
        self.max_bodies = max_bodies
        self.max_bytes = max_bytes
        self._kept: OrderedDict[int, _Body] = OrderedDict()
        self._scoped: dict[bytes, list[bytes]] = {}
        """By the credential they were sent with, the kept bodies' openings, each once, in
        order."""
        self._alike: dict[tuple[bytes, bytes], dict[int, _Body]] = {}
        """By credential and opening, the kept bodies that open so, the latest kept last
        (they share one opening object)."""
        self._count = 0
        self._bytes = 0
        self.reused = 0
        """Messages taken from an earlier body so far (not parsed again)."""
        self.digested = 0
        """Digests taken of new bodies' starts to find the kept bodies they continue, so far."""

    def read(self, raw: bytes, *, scope: bytes = b"") -> tuple[Any, bool]:
        """The body parsed, and whether it may be written with the fast encoder: what
        :func:`~pipeline.wire.encoding.loads_body` returns for ``raw``, and raises. ``scope``:
        the credential it was sent with (see :func:`~pipeline.dropin.tenancy.credential_of`):
        a body is read against kept bodies of the same one only."""
        key = hashlib.blake2b(scope, key=_SCOPE_KEY, digest_size=16).digest() if scope else b""
        best, k = self._continued(raw, self._opening_alike(raw, key))
        try:
            if best is not None:
                parsed = _continue(raw, best, k)
                self.reused += k
                if k >= len(best.ends) - _TAIL and 2 * k >= len(best.ends):
                    # it repeats best but for its last few messages, most of them (a client
                    # moves its cache mark there): this body is that conversation's now
                    self._drop(best)
            else:
                parsed = _scan(raw)
        except (_Unknown, ValueError, RecursionError):  # not UTF-8 among the ValueErrors
            return loads_body(raw)
        parsed.scope = key
        self._keep(parsed)
        return _assembled(parsed), parsed.fast()

    def _opening_alike(self, raw: bytes, key: bytes) -> list[_Body]:
        """The kept bodies of ``key`` whose opening ``raw`` starts with (the latest
        :data:`_GROUP`): only one opening can be the start of ``raw`` (where a first message
        ends is one place; an opening cut short is as long as any other cut at that place),
        and it sorts right before ``raw``."""
        order = self._scoped.get(key)
        if not order:
            return []
        at = bisect.bisect_left(order, raw)
        if not at or not raw.startswith(opening := order[at - 1]):
            return []
        return list(islice(reversed(self._alike[key, opening].values()), _GROUP))

    def _continued(self, raw: bytes, bodies: Iterable[_Body]) -> tuple[_Body | None, int]:
        """The kept body among ``bodies`` whose bytes ``raw`` repeats through the most of its
        messages (the latest kept of those that tie), and how many; ``None`` when ``raw``
        repeats none's start up to its messages.

        While several are left, each step: one digest of ``raw`` for those that end their
        next message at the same place (those whose digest there is not ``raw``'s repeat less
        than the rest); then how far ``raw`` repeats the latest kept of the rest (along it,
        see :meth:`_along`), and which of the others are alike with it that far (their own
        digests say so: the others repeat less than it). Past :data:`_CROWD` steps, the
        latest :data:`_CROWD` only go on."""
        view, size = memoryview(raw), len(raw)
        found: list[tuple[int, int, _Body]] = []  # (messages repeated, kept_at, body)
        left, state, at, j = list(bodies), xxhash.xxh3_128(seed=_SEED), 0, 0
        steps = 0
        while len(left) > 1:
            steps += 1
            if steps > _CROWD and len(left) > _CROWD:
                left = sorted(left, key=lambda body: body.kept_at)[-_CROWD:]
            ending: dict[int, list[_Body]] = {}
            for body in left:
                if j > len(body.ends):  # repeated whole
                    found.append((len(body.ends), body.kept_at, body))
                elif body.bound(j) <= size:
                    ending.setdefault(body.bound(j), []).append(body)
                elif j:
                    found.append((j - 1, body.kept_at, body))
            left = []
            for end, group in ending.items():
                step = state.copy()
                step.update(view[at:end])
                digest = step.digest()
                self.digested += 1
                same = [b for b in group if b.digest(j) == digest]
                if j:
                    found += [(j - 1, b.kept_at, b) for b in group if b.digest(j) != digest]
                # only one place can end a whole message (an object) that starts where they
                # all part (a bare number could end early: then the parse after it refuses)
                if same and not left:
                    left, next_state, next_at = same, step, end
            if len(left) <= 1:
                if left:
                    state, at, j = next_state, next_at, j + 1
                break
            state, at = next_state, next_at
            pivot = max(left, key=lambda body: body.kept_at)
            k, state, at = self._along(view, pivot, state, at, j + 1, len(pivot.ends))
            found.append((k, pivot.kept_at, pivot))
            left = [b for b in left if b is not pivot and _same_at(pivot, b, k)]
            j = k + 1
        if left:
            body = left[0]
            k, _state, _at = self._along(view, body, state, at, j, len(body.ends))
            found.append((k, body.kept_at, body))
        found = [f for f in found if f[0] >= 0]
        if not found:
            return None, 0
        k, _at, best = max(found, key=lambda f: (f[0], f[1]))
        return best, k

    def _along(
        self, view: memoryview, body: _Body, state: Any, at: int, j: int, last: int
    ) -> tuple[int, Any, int]:
        """Up to which of ``body``'s bounds ``j`` to ``last`` ``view`` repeats its bytes, known
        to repeat them up to bound ``j - 1`` (at ``at``; ``state``: their digest's), with the
        digest state and the offset there: ``last`` first (a conversation that only grew),
        then a few before it, then each of the last few (where a next call parts); where that
        one differs, halving the bounds between (each digest from the last that matched on,
        so the bytes hashed add up to about twice the span)."""
        if j > last:
            return last, state, at
        step = self._step(view, body, last, state, at)
        if step is not None:  # all of them (a conversation that only grew)
            return last, step, body.bound(last)
        good, near = j - 1, max(j, last - _TAIL)
        step = self._step(view, body, near, state, at) if near < last else None
        if step is None:
            bad = near
            while bad - good > 1:
                mid = (good + bad) // 2
                step = self._step(view, body, mid, state, at)
                if step is None:
                    bad = mid
                else:
                    good, state, at = mid, step, body.bound(mid)
            return good, state, at
        good, state, at = near, step, body.bound(near)
        for bound in range(near + 1, last + 1):
            step = self._step(view, body, bound, state, at)
            if step is None:
                break
            good, state, at = bound, step, body.bound(bound)
        return good, state, at

    def _step(self, view: memoryview, body: _Body, j: int, state: Any, at: int) -> Any:
        """The digest state of ``view`` up to ``body``'s bound ``j``, from ``state`` (at
        ``at``), when its digest there is ``body``'s; else None."""
        end = body.bound(j)
        if end > len(view):
            return None
        step = state.copy()
        step.update(view[at:end])
        self.digested += 1
        return step if step.digest() == body.digest(j) else None

    def _drop(self, body: _Body) -> None:
        if self._kept.pop(id(body), None) is not None:
            self._unscope(body)
            self._bytes -= body.size

    def _unscope(self, body: _Body) -> None:
        group = self._alike.get((body.scope, body.opening))
        if group is None or group.pop(id(body), None) is None or group:
            return
        del self._alike[body.scope, body.opening]
        order = self._scoped[body.scope]
        del order[bisect.bisect_left(order, body.opening)]
        if not order:
            del self._scoped[body.scope]

    def _keep(self, body: _Body) -> None:
        if body.size > self.max_bytes or not self.max_bodies:
            return
        self._count += 1
        body.kept_at = self._count
        self._kept[id(body)] = body
        order = self._scoped.setdefault(body.scope, [])
        at = bisect.bisect_left(order, body.opening)
        if at < len(order) and order[at] == body.opening:
            body.opening = order[at]  # one object for the bodies that open alike
        else:
            order.insert(at, body.opening)
        self._alike.setdefault((body.scope, body.opening), {})[id(body)] = body
        self._bytes += body.size
        while self._bytes > self.max_bytes or len(self._kept) > self.max_bodies:
            _, gone = self._kept.popitem(last=False)
            self._unscope(gone)
            self._bytes -= gone.size


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
    reused = len(ends)
    ends, messages = list(ends), list(messages)
    first_lone = None
    if old is not None and old.first_lone is not None and old.first_lone < len(messages):
        first_lone = old.first_lone
    close = split_new(raw, array_open, ends, messages, offsets.byte, kept_tail)
    if close is not None:  # the array's end, its new messages read by msgspec
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
    rest_size = len(raw) - after_at - 1
    # raw ends with old's fields (kept_tail): they are the fields after this array when it ends
    # where they start
    same = old is not None and 0 < kept_tail == rest_size
    if old is not None and same:
        after, rest_digest = old.after, old.rest_digest
    else:
        after = _fields_after(raw[after_at + 1 :].decode())
        rest_digest = _digest(memoryview(raw)[after_at + 1 :])
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
    digests = _digests(raw, array_open, ends, reused, old)
    # where it repeats old's first message, old's opening: the same bytes, one object
    end = min(ends[0], array_open + _OPENING) if ends else array_open
    opening = old.opening if old is not None and reused else raw[:end]
    size = len(raw) + len(opening) + _OWN * len(ends)
    return _Body(
        size, array_open, ends, digests, messages, before, rest_size, rest_digest, after,
        first_lone, fields_lone, opening,
    )  # fmt: skip


def _digests(raw: bytes, array_open: int, ends: list[int], reused: int, old: _Body | None) -> bytes:
    """The digests of ``raw`` up to ``array_open`` and up to each of ``ends``: ``old``'s for
    the first ``reused`` messages (the bytes it repeats of it), taken anew after them."""
    view = memoryview(raw)
    at = ends[reused - 1] if reused else array_open
    state = xxhash.xxh3_128(view[:at], seed=_SEED)
    out = bytearray(old.digests[: (reused + 1) * _DIGEST] if old is not None else state.digest())
    for end in ends[reused:]:
        state.update(view[at:end])
        out += state.digest()  # one buffer: a small bytes object a message would peak at 3x
        at = end
    return bytes(out)


def _digest(data: memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data, seed=_SEED)


def _kept_tail(raw: bytes, old: _Body | None) -> int:
    """How many of ``raw``'s last bytes are the fields after ``old``'s messages, as they were."""
    if old is None or not 0 < old.rest_size <= len(raw):
        return 0
    tail = memoryview(raw)[len(raw) - old.rest_size :]
    return old.rest_size if _digest(tail) == old.rest_digest else 0


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
