"""What a :class:`~pipeline.wire.body_reader.BodyReader` keeps of the bodies it parsed, and
how it finds the one a new body continues (:class:`KeptBodies`).

Per body: its parsed messages, where each message ends, a digest of the body's bytes from its
start up to each message's end, and its opening (the bytes up to its first message's end, at
most 256 KB of that message) -- not the body itself (as large again as everything parsed from
it). The digests are XXH3-128 under a seed drawn at random for each process: checking one costs
about what comparing the bytes did (~0.02 ms a megabyte), and two texts that differ share one
by chance once in 2**128. A body is only ever read against bodies sent with the same credential
(its ``scope``): one made to collide with another key's message could at most stand for a text
of its own key's.

The bodies a new one may continue are those that open like it: kept in the order of their
openings, they sit right before where it would go (a search, then one comparison). Among them,
finding the one it continues costs one digest where they part (conversations that share an
opening part at their first different message), and a few along the latest kept of those alike
further: its last message's end first (a conversation that only grew), then one four messages
before its end, each of its last four (where a conversation's next call parts from it: a client
moves its cache mark), and where the first differs, halving. Which of the others are alike with
it that far their own digests say, without a digest of the new body.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import xxhash

__all__ = [
    "MAX_KEPT_BYTES",
    "KeptBodies",
    "KeptBody",
    "cost",
    "digest_of",
    "digests_of",
    "kept_tail",
    "opening_of",
]

MAX_KEPT_BYTES = 256 << 20
"""What a reader keeps of the bodies it read, at most, by default (their sizes: :func:`cost`)."""

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
_OWN = 512
"""Bytes a kept body costs the reader a message beyond its text, counted against ``max_bytes``
with the body's own length: its digest, its end, and the parsed message it keeps alive (its
dicts and lists: measured 300-800 bytes a message of a few to a hundred bytes)."""


@dataclass(slots=True)
class KeptBody:
    """What a reader keeps of a body it parsed (see the module)."""

    size: int
    """What it counts against ``max_bytes`` (:func:`cost`)."""
    array_open: int
    """Where the messages array's content starts (after its ``[``), in bytes."""
    ends: array[int]
    """Where each message's text ends, in bytes (4 bytes an end, 8 in a body of 4 GiB or more;
    as a list of ints, ~40)."""
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
    """The digest of the credential it was sent with (:meth:`KeptBodies.scope_key`)."""
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


class KeptBodies:
    """The bodies a reader keeps (see the module). ``max_bodies``: how many (the least
    recently read go first); ``max_bytes``: how large together (:func:`cost`). A kept body
    costs a digest and an offset a message (~60 bytes) and its opening (shared by the bodies
    that open alike), and keeps its parsed messages alive -- the ones the conversation that
    sent it holds while it is held. Not thread-safe: one per event loop."""

    def __init__(self, *, max_bodies: int = 256, max_bytes: int = MAX_KEPT_BYTES) -> None:
        if max_bodies < 0 or max_bytes < 0:
            raise ValueError(
                f"max_bodies and max_bytes must be zero or more, got {max_bodies}, {max_bytes}"
            )
        self.max_bodies = max_bodies
        self.max_bytes = max_bytes
        self._kept: OrderedDict[int, KeptBody] = OrderedDict()
        self._scoped: dict[bytes, list[bytes]] = {}
        """By the credential they were sent with, the kept bodies' openings, each once, in
        order."""
        self._alike: dict[tuple[bytes, bytes], dict[int, KeptBody]] = {}
        """By credential and opening, the kept bodies that open so, the latest kept last
        (they share one opening object)."""
        self._by_last: dict[int, dict[int, KeptBody]] = {}
        """By the identity of their last message, the kept bodies that have messages: what
        :meth:`forget` looks for, without a look at every kept body."""
        self._count = 0
        self._bytes = 0
        self.digested = 0
        """Digests taken of new bodies' starts to find the kept bodies they continue, so far."""

    @staticmethod
    def scope_key(scope: bytes) -> bytes:
        """What a body sent with the credential ``scope`` is kept under (a keyed digest, never
        the credential)."""
        return hashlib.blake2b(scope, key=_SCOPE_KEY, digest_size=16).digest() if scope else b""

    def _opening_alike(self, raw: bytes, key: bytes) -> list[KeptBody]:
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

    def _continued(self, raw: bytes, bodies: Iterable[KeptBody]) -> tuple[KeptBody | None, int]:
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
        found: list[tuple[int, int, KeptBody]] = []  # (messages repeated, kept_at, body)
        left, state, at, j = list(bodies), xxhash.xxh3_128(seed=_SEED), 0, 0
        steps = 0
        while len(left) > 1:
            steps += 1
            if steps > _CROWD and len(left) > _CROWD:
                left = sorted(left, key=lambda body: body.kept_at)[-_CROWD:]
            ending: dict[int, list[KeptBody]] = {}
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
        self, view: memoryview, body: KeptBody, state: Any, at: int, j: int, last: int
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

    def _step(self, view: memoryview, body: KeptBody, j: int, state: Any, at: int) -> Any:
        """The digest state of ``view`` up to ``body``'s bound ``j``, from ``state`` (at
        ``at``), when its digest there is ``body``'s; else None."""
        end = body.bound(j)
        if end > len(view):
            return None
        step = state.copy()
        step.update(view[at:end])
        self.digested += 1
        return step if step.digest() == body.digest(j) else None

    def forget(self, messages: Sequence[Any]) -> int:
        """Let go of the kept bodies whose messages are ``messages`` (the same objects, the last
        one's identity and the count checked: the parse a conversation's last request was
        read into), so that a conversation let go from memory is not kept alive here; returns
        how many. Costs a look at the kept bodies ending with that message. A body let go too
        many is only parsed whole again."""
        if not messages:
            return 0
        last, n = messages[-1], len(messages)
        alike = self._by_last.get(id(last), {})
        gone = [b for b in alike.values() if len(b.messages) == n and b.messages[-1] is last]
        for body in gone:
            self._drop(body)
        return len(gone)

    def _drop(self, body: KeptBody) -> None:
        if self._kept.pop(id(body), None) is not None:
            self._unscope(body)
            self._bytes -= body.size

    def _unscope(self, body: KeptBody) -> None:
        if body.messages:
            last = id(body.messages[-1])
            same = self._by_last.get(last)
            if same is not None and same.pop(id(body), None) is not None and not same:
                del self._by_last[last]
        group = self._alike.get((body.scope, body.opening))
        if group is None or group.pop(id(body), None) is None or group:
            return
        del self._alike[body.scope, body.opening]
        order = self._scoped[body.scope]
        del order[bisect.bisect_left(order, body.opening)]
        if not order:
            del self._scoped[body.scope]

    def _keep(self, body: KeptBody) -> None:
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
        if body.messages:
            self._by_last.setdefault(id(body.messages[-1]), {})[id(body)] = body
        self._bytes += body.size
        while self._bytes > self.max_bytes or len(self._kept) > self.max_bodies:
            _, gone = self._kept.popitem(last=False)
            self._unscope(gone)
            self._bytes -= gone.size

    def _drop_continued(self, best: KeptBody, k: int) -> None:
        """Let ``best`` go when a new body repeats it but for its last few messages, most of
        them (a client moves its cache mark there): that body is the conversation's now."""
        if k >= len(best.ends) - _TAIL and 2 * k >= len(best.ends):
            self._drop(best)


def _same_at(a: KeptBody, b: KeptBody, j: int) -> bool:
    """Whether ``a``'s and ``b``'s bytes are alike up to their bound ``j``."""
    return (
        j <= min(len(a.ends), len(b.ends))
        and a.bound(j) == b.bound(j)
        and a.digest(j) == b.digest(j)
    )


def digests_of(
    raw: bytes, array_open: int, ends: Sequence[int], reused: int, old: KeptBody | None
) -> bytes:
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


def digest_of(data: memoryview) -> bytes:
    """The digest of ``data`` (this process's seed)."""
    return xxhash.xxh3_128_digest(data, seed=_SEED)


def kept_tail(raw: bytes, old: KeptBody | None) -> int:
    """How many of ``raw``'s last bytes are the fields after ``old``'s messages, as they were."""
    if old is None or not 0 < old.rest_size <= len(raw):
        return 0
    tail = memoryview(raw)[len(raw) - old.rest_size :]
    return old.rest_size if digest_of(tail) == old.rest_digest else 0


def opening_of(
    raw: bytes, array_open: int, ends: Sequence[int], reused: int, old: KeptBody | None
) -> bytes:
    """``raw``'s opening: ``old``'s where it repeats ``old``'s first message (the same bytes,
    one object)."""
    end = min(ends[0], array_open + _OPENING) if ends else array_open
    return old.opening if old is not None and reused else raw[:end]


def cost(raw: bytes, opening: bytes, ends: Sequence[int]) -> int:
    """What a body counts against ``max_bytes``: its length, its opening and :data:`_OWN` a
    message."""
    return len(raw) + len(opening) + _OWN * len(ends)
