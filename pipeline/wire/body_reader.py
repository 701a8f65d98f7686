"""Reading a Messages request body in time proportional to what is new in it
(:class:`BodyReader`).

A client re-sends its whole conversation on every call, and each call's body begins with the
bytes of the last one: the same fields, the same messages, then a few new ones. Parsing all of
it again costs time in the size of the history (about 1.5 ms a megabyte with a fast parser,
3 with the standard library's), and so does every later comparison of the parsed messages with
the last request's. The reader keeps what it parsed of the last bodies -- their messages, where
each message ends, a digest of each body's bytes up to every message's end -- but not the
bodies themselves (:mod:`pipeline.wire.kept_bodies`, which also says how the one a new body
continues is found, among bodies sent with the same credential only). A new body whose
bytes up to some message's end have a kept body's digest there takes that body's parsed
messages up to there -- the very same objects: the same text parses to the same value -- and
parses only the rest; the fields around the messages are taken again when their digest is the
same. Placing the request in its conversation and finding what changed since its last call
then compare those messages by identity, not by value.

Nothing depends on which earlier body a new one is read against: a message is reused only
where its whole text is the same, so the parsed request is always the one a full parse gives.
Anything the reader does not recognise (not UTF-8, not an object with a ``messages`` array, a
key twice, ``NaN``) is parsed whole by :func:`~pipeline.wire.encoding.loads_body`, with its answers
and errors. The parsed values are shared between requests, the ``messages`` list included
(the router, the conversation and the writer of the body sent on keep that one list): they
must not be changed in place (nothing here does: every stage and the wire build new
messages).
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pipeline.wire.body_split import split_new, worth_splitting
from pipeline.wire.body_text import (
    DECODER,
    NotTakenApart,
    char_boundary,
    fields_after,
    fields_before,
    maybe_surrogate,
    maybe_surrogate_bytes,
    next_message,
    skip,
)
from pipeline.wire.encoding import has_lone_surrogate, loads_body
from pipeline.wire.kept_bodies import (
    MAX_KEPT_BYTES,
    KeptBodies,
    KeptBody,
    cost,
    digest_of,
    digests_of,
    kept_tail,
    opening_of,
)
from pipeline.wire.shared_strings import shared_message
from pipeline.wire.source import Source

__all__ = ["OFF_LOOP_BYTES", "BodyReader"]

OFF_LOOP_BYTES = 256 * 1024
"""New bytes from which :meth:`BodyReader.read_async` parses a body off its event loop (~0.4
ms of parsing; a worker thread's hop costs ~0.1 ms)."""


class BodyReader(KeptBodies):
    """Parses request bodies, reusing what the last ones held (see the module docstring).
    ``max_bodies``, ``max_bytes``: what it keeps of them (:class:`~pipeline.wire.kept_bodies.
    KeptBodies`). Not thread-safe: one per event loop."""

    def __init__(self, *, max_bodies: int = 256, max_bytes: int = MAX_KEPT_BYTES) -> None:
        super().__init__(max_bodies=max_bodies, max_bytes=max_bytes)
        self.reused = 0
        """Messages taken from an earlier body so far (not parsed again)."""
        self.off_loop = 0
        """Bodies :meth:`read_async` had parsed off its event loop so far."""

    def read(self, raw: bytes, *, scope: bytes = b"") -> tuple[Any, bool]:
        """The body parsed, and whether it may be written with the fast encoder: what
        :func:`~pipeline.wire.encoding.loads_body` returns for ``raw``, and raises. ``scope``:
        the credential it was sent with (see :func:`~pipeline.dropin.tenancy.credential_of`):
        a body is read against kept bodies of the same one only."""
        body, fast, _source = self.read_source(raw, scope=scope)
        return body, fast

    def read_source(self, raw: bytes, *, scope: bytes = b"") -> tuple[Any, bool, Source | None]:
        """:meth:`read`, and where the body's messages are in ``raw`` (see
        :meth:`read_source_async`)."""
        key, best, k = self._found(raw, scope)
        return self._sourced(raw, _parsed(raw, best, k), key, best, k)

    async def read_async(
        self,
        raw: bytes,
        *,
        scope: bytes = b"",
        offload: Callable[[Callable[[], _Parsed]], Awaitable[_Parsed]],
        at_least: int = OFF_LOOP_BYTES,
    ) -> tuple[Any, bool]:
        """:meth:`read` on an event loop: when ``at_least`` bytes or more of ``raw`` are new
        (a first call of a long conversation: ~1.5 ms a megabyte to parse), they are parsed
        by ``offload`` (e.g. ``anyio.to_thread.run_sync``) while the loop serves the rest;
        what a few new messages cost is paid on the loop. Finding the kept body it continues
        and keeping it are the loop's (the reader is not thread-safe); the parse reads only
        ``raw`` and that body, which no later read changes."""
        body, fast, _source = await self.read_source_async(
            raw, scope=scope, offload=offload, at_least=at_least
        )
        return body, fast

    async def read_source_async(
        self,
        raw: bytes,
        *,
        scope: bytes = b"",
        offload: Callable[[Callable[[], _Parsed]], Awaitable[_Parsed]],
        at_least: int = OFF_LOOP_BYTES,
    ) -> tuple[Any, bool, Source | None]:
        """:meth:`read_async`, and where the body's messages are in ``raw`` (a
        :class:`~pipeline.wire.source.Source` for the writer of the body sent on), or
        None for a body parsed whole."""
        key, best, k = self._found(raw, scope)
        new = len(raw) - (best.bound(k) if best is not None else 0)
        parse = functools.partial(_parsed, raw, best, k)
        if new >= at_least:
            self.off_loop += 1
            parsed = await offload(parse)
        else:
            parsed = parse()
        return self._sourced(raw, parsed, key, best, k)

    def _sourced(
        self, raw: bytes, parsed: _Parsed, key: bytes, best: KeptBody | None, k: int
    ) -> tuple[Any, bool, Source | None]:
        body, fast = self._taken(parsed, key, best, k)
        if not isinstance(parsed, KeptBody):
            return body, fast, None
        return body, fast, Source(raw, parsed.array_open, parsed.ends, body["messages"])

    def _found(self, raw: bytes, scope: bytes) -> tuple[bytes, KeptBody | None, int]:
        key = self.scope_key(scope)
        best, k = self._continued(raw, self._opening_alike(raw, key))
        return key, best, k

    def _taken(
        self, parsed: _Parsed, key: bytes, best: KeptBody | None, k: int
    ) -> tuple[Any, bool]:
        if not isinstance(parsed, KeptBody):
            return parsed  # parsed whole: nothing to keep
        if best is not None:
            self.reused += k
            self._drop_continued(best, k)  # nothing, if another read let it go meanwhile
        parsed.scope = key
        self._keep(parsed)
        return _assembled(parsed), parsed.fast()


_Parsed = KeptBody | tuple[Any, bool]
"""A body taken apart by this reader, or one parsed whole (:func:`loads_body`'s answer)."""


def _parsed(raw: bytes, best: KeptBody | None, k: int) -> _Parsed:
    """``raw`` parsed: read against ``best``'s first ``k`` messages when it continues one,
    else from scratch; whole, by :func:`loads_body`, when this reader does not take it apart
    (its errors raised). Reads nothing but its arguments: any thread may run it."""
    try:
        return _continue(raw, best, k) if best is not None else _scan(raw)
    except (NotTakenApart, ValueError, RecursionError):  # not UTF-8 among the ValueErrors
        return loads_body(raw)


def _assembled(body: KeptBody) -> dict[str, Any]:
    out = dict(body.before)
    out["messages"] = body.messages  # the kept list itself: a request's values are never changed
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


_HEAD = 64 * 1024
"""Bytes of a new body decoded first, for the fields before its messages (eight times as many
each time they run past them): the messages are read from the bytes (by msgspec), and a whole
body decoded at once is four bytes a character when one of its characters is past U+FFFF --
as Claude Code's system prompt has one, a first request's parse would peak at ~5x its size."""


def _scan(raw: bytes) -> KeptBody:
    """A body parsed from scratch, with where its messages end."""
    size = _HEAD
    while True:
        end = char_boundary(raw, size)
        text = raw[:end].decode("utf-8")
        try:
            before, pos = fields_before(text)
        except (NotTakenApart, ValueError):
            if end == len(raw):
                raise
            size *= 8  # a field before the messages runs past the text decoded so far
            continue
        break
    offsets = _Offsets(raw, text, 0, 0)
    array_open = offsets.at(pos + 1)
    if end < len(raw):  # the rest decoded only where msgspec does not read it (_finish)
        offsets = _Offsets(raw, "", 0, array_open)
    return _finish(offsets, array_open, [], [], before)


def _continue(raw: bytes, old: KeptBody, k: int) -> KeptBody:
    """``raw`` read against ``old``, whose start it repeats past the messages array's start
    and past old's first ``k`` message ends: those messages, then the rest decoded and parsed.
    Where a message ends is an ASCII character, so the rest starts on a character."""
    pos = old.ends[k - 1] if k else old.array_open
    # decoded only when it is read a message at a time (msgspec reads the bytes), and not the
    # fields after the messages that repeat old's (Claude Code's system prompt and tools: ~80
    # KB a call, four bytes a character decoded, for the character past U+FFFF they hold)
    tail = kept_tail(raw, old)
    text = "" if worth_splitting(raw, pos, tail) else raw[pos : len(raw) - tail].decode("utf-8")
    offsets = _Offsets(raw, text, 0, pos)
    return _finish(offsets, old.array_open, old.ends[:k], old.messages[:k], old.before, old, tail)


def _finish(
    offsets: _Offsets,
    array_open: int,
    ends: Sequence[int],
    messages: list[Any],
    before: list[tuple[str, Any]],
    old: KeptBody | None = None,
    kept_tail: int = 0,
) -> KeptBody:
    """The body with ``messages`` (ending at ``ends``) taken already, and its text still to
    parse from ``offsets``' place on: more messages, the array's end, the fields after (its
    last ``kept_tail`` bytes ``old``'s, not new)."""
    raw, text = offsets.raw, offsets.text
    reused = len(ends)
    # 4 bytes an end where the body's offsets fit (a body of 4 GiB or more: 8)
    ends, messages = array("I" if len(raw) < 1 << 32 else "q", ends), list(messages)
    first_lone = None
    if old is not None and old.first_lone is not None and old.first_lone < len(messages):
        first_lone = old.first_lone
    close = split_new(raw, array_open, ends, messages, offsets.byte, kept_tail)
    if close is not None:  # the array's end, its new messages read by msgspec
        after_at = close
    else:
        if not text:  # left undecoded for msgspec, which did not read it
            text = raw[offsets.byte : len(raw) - kept_tail].decode("utf-8")
            offsets = _Offsets(raw, text, 0, offsets.byte)
        pos = next_message(text, offsets.char) if messages else skip(text, offsets.char)
        ids: dict[str, str] = {}  # a call's id and its result's: one string
        while text[pos : pos + 1] != "]":
            start = pos
            value, pos = DECODER.raw_decode(text, pos)
            value = shared_message(value, ids)  # held as long as its conversation: one "role"
            # text decoded strictly from UTF-8 holds no surrogate: only a \uD8xx-\uDFxx
            # escape makes one, so a value whose text has no "\ud" (any case) needs no walk
            if (
                first_lone is None
                and maybe_surrogate(text, start, pos)
                and has_lone_surrogate(value)
            ):
                first_lone = len(messages)
            messages.append(value)
            ends.append(offsets.at(pos))
            pos = next_message(text, pos)
        after_at = offsets.at(pos)
    rest_size = len(raw) - after_at - 1
    # raw ends with old's fields (kept_tail): they are the fields after this array when it ends
    # where they start
    same = old is not None and 0 < kept_tail == rest_size
    if old is not None and same:
        after, rest_digest = old.after, old.rest_digest
    else:
        after = fields_after(raw[after_at + 1 :].decode())
        rest_digest = digest_of(memoryview(raw)[after_at + 1 :])
    names = [n for n, _ in before] + ["messages"] + [n for n, _ in after]
    if len(set(names)) != len(names):
        raise NotTakenApart  # a key twice: the last one counts, as the full parse knows
    if old is not None and before is old.before and after is old.after:
        fields_lone = old.fields_lone  # the same fields (the tools, the system prompt): known
    else:
        fields_lone = (
            maybe_surrogate_bytes(raw, 0, array_open)
            or maybe_surrogate_bytes(raw, after_at, len(raw))
        ) and has_lone_surrogate(dict([*before, *after]))
    digests = digests_of(raw, array_open, ends, reused, old)
    opening = opening_of(raw, array_open, ends, reused, old)
    return KeptBody(
        cost(raw, opening, ends), array_open, ends, digests, messages, before, rest_size,
        rest_digest, after, first_lone, fields_lone, opening,
    )  # fmt: skip
