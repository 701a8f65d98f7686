"""Writing a Messages request body in time proportional to what is new in it
(:class:`BodyWriter`).

Each call of a conversation sends the last call's messages again, then a few new ones; the wire
form hands them on as the same message objects (:class:`~pipeline.wire.cache.WireCache` shares
every message but the last ones between requests). Encoding the whole body again costs time in
the size of the history (~0.35 ms a megabyte). The writer keeps, per conversation, what it
wrote of the last body's messages, in runs: a new body whose messages begin with the same
objects takes those messages' bytes from there (one copy) and encodes only the rest and the
fields around them.

Where the bytes of a run come from: a proxy has the request its messages came in (a
:class:`Source`). A message whose bytes at its place in the request (after a ``,``, or a ``,``
and a space) are exactly what the writer would write -- as a client writing compact JSON
sends it (the anthropic SDKs, Claude Code: JavaScript's ``JSON.stringify``) -- or exactly what
Python's ``json.dumps`` writes of it by default (spaced: ``requests``, httpx before 0.28),
checked once, when the message is new, is taken from the request's bytes, on this call and
the next ones, while the request holds the same parsed object there (the body reader hands the
same object again only for bytes it found the same, at the same place). The writer then keeps
the bytes of the messages a stage rewrote and of a client's that it writes otherwise (indented
JSON, other escapes), not a copy of every body sent on (as large as the conversation's text
again). Runs are at most :data:`_MAX_RUNS`: past that, the request's shortest runs are kept as
its own bytes.

The bytes are those :func:`~pipeline.wire.encoding.dumps_body` writes, but for a spaced
client's messages taken from its request, which are its own bytes (a test holds it to that
over random sequences of bodies, from requests written compactly, spaced or indented): the
same encoder writes each piece, and a JSON object is its members joined in order; a request's
bytes are taken only where they are that encoder's, or the standard library's spaced encoding
of the very object parsed from them (never bytes that parse to it otherwise: a key given
twice, a number written another way). What the fast encoder cannot
write (a lone surrogate), or a body read with the standard library (``fast=False``), goes to
``dumps_body`` whole. A message object is taken to be unchanged while it is the same object:
messages are shared between requests and must not be changed in place (nothing here does; the
wire form's contract says the same).
"""

from __future__ import annotations

import math
import operator
from array import array
from collections import OrderedDict
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, count
from typing import Any

from pipeline.wire.encoding import dumps_body, fast_encode
from pipeline.wire.source import Source

__all__ = ["BodyWriter", "Source"]


@dataclass(slots=True)
class _Run:
    """Messages ``first`` to ``stop`` of a written body, as one piece: the source's bytes
    (``own`` None) or bytes of its own, each message ending at ``ends`` in them."""

    first: int
    stop: int
    own: bytearray | None = None
    """Grown and cut in place, as the run is: a run copied whole at each message or body
    written would cost the body's size a message (a body written without a source is one
    run of its own)."""
    ends: array[int] | None = None

    def cut(self, at: int) -> _Run:
        """The run, its messages from ``at`` on let go (in place: a run is the last body's,
        which the writer lets go as it writes the next)."""
        if self.own is not None and self.ends is not None:
            keep = at - self.first
            del self.own[self.ends[keep - 1] :]
            del self.ends[keep:]
        self.stop = at
        return self


@dataclass
class _Written:
    runs: list[_Run]
    """Its messages, in runs."""
    size: int
    """What counts against ``max_bytes``: the bytes of its own it keeps, its fields' and 16 a
    message (the references to the messages and the source's)."""
    messages: list[Any]
    """The message objects written (held: an id is never another object's meanwhile)."""
    inputs: Sequence[Any] | None
    """The source's message objects, where runs took its bytes (held, as the messages)."""
    fields: dict[str, tuple[Any, bytes]]
    """Each other field's value object and its ``"name":value`` bytes (held, as the messages)."""
    finite: bool
    """Whether the fields were written refusing a NaN or an infinity."""


_MAX_RUNS = 64
"""Past this many runs, the source's shortest are kept as bytes of the writer's own (see
:func:`_fewer`): writing a body costs a step a run."""


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
        self.from_source = 0
        """Messages whose bytes were the request's own so far (not kept between bodies)."""

    def write(
        self,
        key: Hashable,
        body: Mapping[str, Any],
        *,
        fast: bool = True,
        finite: bool = False,
        unchanging: Collection[str] = (),
        source: Source | None = None,
    ) -> bytes:
        """``dumps_body(body, fast=fast)``, reusing the last body written under ``key``.
        ``finite``: refuse a NaN or an infinity anywhere in what is written (``ValueError``, as
        the anthropic SDK's JSON refuses one) rather than write it as the fast encoder does,
        ``null``. ``unchanging``: the fields whose values are never changed in place either (a
        parsed request's: the system prompt and tools a client sends again are the reader's
        same objects): one that is the last body's object there is not encoded again (Claude
        Code's two are ~80 KB a call). ``source``: the request the body's messages came from;
        a message written as the same bytes as the source's at its place is taken from the
        source's bytes and not kept (a client writing JSON as compactly as this writer does --
        the anthropic SDKs, Claude Code -- leaves it the bytes of the messages a stage
        rewrote, not a copy of every body). The body's ``messages`` list and the values of
        the ``unchanging`` fields are kept as they are, to be compared with the next body's
        by identity: the caller must not change them in place afterwards."""
        last = self._kept.pop(key, None)
        if last is not None:
            self._bytes -= last.size
        messages = body.get("messages")
        if not fast or type(messages) is not list or not isinstance(body, dict):
            return _checked(dumps_body(body, fast=fast), body, finite)
        try:
            raw, written = self._spliced(body, messages, last, finite, unchanging, source)
        except _NotFinite:
            raise ValueError("Out of range float values are not JSON compliant") from None
        except (TypeError, ValueError, OverflowError):  # what the fast encoder refuses
            return _checked(dumps_body(body, fast=fast), body, finite)
        if written.size <= self.max_bytes:
            self._kept[key] = written
            self._bytes += written.size
            while self._bytes > self.max_bytes:
                _, gone = self._kept.popitem(last=False)
                self._bytes -= gone.size
        return raw

    def forget(self, key: Hashable) -> None:
        """Let go of what is kept under ``key`` (a conversation let go)."""
        gone = self._kept.pop(key, None)
        if gone is not None:
            self._bytes -= gone.size

    def _spliced(
        self,
        body: dict[str, Any],
        messages: list[Any],
        last: _Written | None,
        finite: bool,
        unchanging: Collection[str],
        source: Source | None,
    ) -> tuple[bytes, _Written]:
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
        # a body written refusing what the other wrote as null: nothing of it taken
        runs = _still_written(messages, last if last and last.finite == finite else None, source)
        same = runs[-1].stop if runs else 0
        self.reused += same
        for i in range(same, len(messages)):
            piece = encode(messages[i])
            if source is not None and source.same_bytes(i, piece, messages[i]):
                _add_source(runs, i)
            else:
                _add_own(runs, i, piece)
        if len(runs) > _MAX_RUNS:
            runs = _fewer(runs, source)
        head = b"{" + b"".join(p + b"," for p in before) + b'"messages":['
        tail = b"]" + b"".join(b"," + p for p in after) + b"}"
        pieces: list[bytes | bytearray | memoryview] = [head]
        view = memoryview(source.raw) if source is not None else None
        # what is kept: its own bytes, the fields' and a reference a message (two lists)
        size = sum(len(piece) for _value, piece in fields.values()) + 16 * len(messages)
        for k, run in enumerate(runs):
            if k:
                pieces.append(b",")
            if run.own is not None:
                pieces.append(run.own)
                size += len(run.own)
            else:
                assert source is not None and view is not None
                pieces.append(view[source.start(run.first) : source.ends[run.stop - 1]])
                self.from_source += run.stop - run.first
        pieces.append(tail)
        # the source's objects are held only while a run takes its bytes
        taken = source is not None and any(run.own is None for run in runs)
        # the source's own list: a body reader's parse, never changed (see Source.messages)
        inputs = source.messages if taken and source is not None else None
        # the body's own list, as its messages' objects are: never changed by the caller
        written = _Written(runs, size, messages, inputs, fields, finite)
        if source is not None and len(pieces) == 3 and runs[0].own is None:
            # every message the request's own bytes, and the fields around them too: the body
            # is the request, byte for byte (no copy of it: ~0.2 ms a megabyte)
            raw, start, end = source.raw, source.start(runs[0].first), source.ends[-1]
            if (
                runs[0].stop == len(source.ends)
                and start == len(head)
                and len(raw) - end == len(tail)
                and raw.startswith(head)
                and raw.endswith(tail)
            ):
                return raw, written
        return b"".join(pieces), written


def _still_written(messages: list[Any], last: _Written | None, source: Source | None) -> list[_Run]:
    """The runs of the last body that this one writes again: up to the first message that is
    not the last body's object there; a run of the source's bytes only while the source
    repeats the last one's objects there too (the same bytes at the same place)."""
    if last is None:
        return []
    n = min(len(messages), len(last.messages))
    same = next(compress(count(), map(operator.is_not, messages, last.messages)), n)
    if any(run.own is None for run in last.runs):
        if source is None or last.inputs is None:
            inputs_same = 0
        else:
            m = min(len(source.messages), len(last.inputs), same)
            pairs = map(operator.is_not, source.messages, last.inputs)
            inputs_same = next(compress(count(), pairs), m)
        for run in last.runs:
            if run.own is None and run.stop > inputs_same:
                same = min(same, max(run.first, inputs_same))
                break
    runs: list[_Run] = []
    for run in last.runs:
        if run.first >= same:
            break
        runs.append(run if run.stop <= same else run.cut(same))
    return runs


def _add_source(runs: list[_Run], i: int) -> None:
    if runs and runs[-1].own is None and runs[-1].stop == i:
        runs[-1].stop = i + 1
    else:
        runs.append(_Run(i, i + 1))


def _add_own(runs: list[_Run], i: int, piece: bytes) -> None:
    if runs and runs[-1].own is not None and runs[-1].stop == i:
        run = runs[-1]
        assert run.own is not None and run.ends is not None
        run.own += b","
        run.own += piece
        run.ends.append(len(run.own))
        run.stop = i + 1
    else:
        runs.append(_Run(i, i + 1, bytearray(piece), array("q", (len(piece),))))


def _fewer(runs: list[_Run], source: Source | None) -> list[_Run]:
    """``runs`` in half as many as :data:`_MAX_RUNS` at most: the source's shortest runs taken
    as bytes of the writer's own, joined with the runs of its own beside them (runs of the
    two kinds alternate: a run of one kind follows a run of the other). A stage clearing old
    results leaves the source's runs between them a message or two long: the bytes kept grow
    by those, not by the whole body."""
    if source is None:
        return runs
    sizes = sorted(
        (source.ends[r.stop - 1] - source.start(r.first), k)
        for k, r in enumerate(runs)
        if r.own is None
    )
    taken: set[int] = set()
    left = len(runs)
    for _size, k in sizes:
        if left <= _MAX_RUNS // 2:
            break
        taken.add(k)
        left -= (k > 0) + (k < len(runs) - 1)  # joined with its neighbours, its own
    out: list[_Run] = []
    group: list[_Run] = []  # runs of its own, one after another: joined once
    for k, run in enumerate([*runs, _Run(len(runs), len(runs))]):  # a sentinel: the source
        if k in taken:
            start = source.start(run.first)
            piece = bytearray(memoryview(source.raw)[start : source.ends[run.stop - 1]])
            ends = array("q", (source.ends[i] - start for i in range(run.first, run.stop)))
            run = _Run(run.first, run.stop, piece, ends)
        if run.own is not None:
            group.append(run)
            continue
        if group:
            out.append(_joined(group))
            group = []
        if k < len(runs):
            out.append(run)
    return out


def _joined(runs: list[_Run]) -> _Run:
    """Adjacent runs of the writer's own bytes as one."""
    if len(runs) == 1:
        return runs[0]
    ends = array("q")
    base = 0
    for run in runs:
        assert run.own is not None and run.ends is not None
        ends.extend(base + e for e in run.ends)
        base += len(run.own) + 1
    own = bytearray(b",".join(r.own or b"" for r in runs))
    return _Run(runs[0].first, runs[-1].stop, own, ends)


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
