"""A family of conversations -- those of one tenant that open alike -- and where a request goes
among them (:func:`plan`): the conversation whose last request it extends, one that sent all
of it before, or a new branch from where it went its own way. The index that holds the families
(:class:`~pipeline.dropin.conversations.Conversations`) decides under its lock; nothing here
takes one."""

from __future__ import annotations

import weakref
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import anyio

from pipeline.dropin.adapter import WireSession
from pipeline.store.sessions import SessionStates
from pipeline.wire.digests import chain_of
from pipeline.wire.same_values import same_start

__all__ = ["Branch", "Family", "NewBranch", "family_key", "named", "plan"]


@dataclass(eq=False)
class Branch:
    """One conversation of a family: its session and how it was last routed. It holds its
    family weakly (the family holds it): a family let go is freed at once, with its
    conversations, rather than left to the garbage collector as a reference cycle."""

    family_of: InitVar[Family]
    name: str | None
    """None for the family's first conversation, ``f<16 hex>`` for a branch."""
    session: WireSession
    chain: list[bytes] = field(default_factory=list)
    """The digests of the messages of the last request routed here."""
    params: list[Any] = field(default_factory=list)
    """The messages of the last request routed here, as the client sent them (empty when not
    known: loaded from records, only the digests are)."""
    call_lock: anyio.Lock = field(default_factory=lambda: anyio.Lock(fast_acquire=True))
    """What a caller that must not overlap two calls of a conversation takes (the proxy;
    uncontended, it is taken without a trip through the event loop)."""
    tenant: str = field(init=False)
    """Its family's tenant."""
    family_name: str = field(init=False)
    calls: int = field(default=0, init=False)
    """Calls in flight that did not take :attr:`call_lock` (``wrap``'s), between being routed
    and the end of their pass: the index lets go of no family with one."""
    size: int = field(default=0, init=False)
    """The size of the last request routed here, as its caller counted it (the proxy: its
    body's bytes and 2 KiB a message); 0 when none was given. What the conversation holds in
    memory grows with it."""
    _family: weakref.ref[Family] = field(init=False, repr=False)
    keep: Family | None = field(default=None, init=False, repr=False)
    """The family, held by its branch where no index holds it: an unsure one
    (:attr:`Family.unsure`, made for one request) or one let go while the branch was made."""

    def __post_init__(self, family_of: Family) -> None:
        self.tenant, self.family_name = family_of.tenant, family_of.name
        self._family = weakref.ref(family_of)
        if family_of.unsure:
            self.keep = family_of

    @property
    def family(self) -> Family:
        """Its family; ``LookupError`` once the family was let go and freed (one with a
        conversation in its pass never is)."""
        family = self._family()
        if family is None:
            raise LookupError(f"conversation {self.conversation_id}: its family was let go")
        return family

    @property
    def conversation_id(self) -> str:
        """The conversation's name: the family's, then ``.<branch>`` for a branch."""
        return named(self.family_name, self.name)

    @property
    def key(self) -> tuple[str, str]:
        """Its tenant and name: what tells it from every other conversation held (the body
        writers of ``wrap`` and the proxy keep its last body under it)."""
        return self.tenant, self.conversation_id


@dataclass(eq=False)
class Family:
    """The conversations of one tenant that open alike, and the index of what they sent."""

    tenant: str
    name: str
    opening: bytes
    """The first link of every chain of the family (system prompt, hint, first message)."""
    states: SessionStates
    """The tenant's sessions."""
    calibration_root: Path
    branches: dict[str | None, Branch] = field(default_factory=dict)
    owner: dict[bytes, Branch] = field(default_factory=dict)
    """A chain digest -> the first conversation that sent that prefix."""
    ends: dict[bytes, Branch] = field(default_factory=dict)
    """The chain digest of a conversation's last request -> that conversation."""
    recent: list[Branch] = field(default_factory=list)
    """Most recently routed first."""
    unsure: bool = False
    """Its records could not be read (the store was down): its conversations re-derive."""
    gone: dict[bytes, str] = field(default_factory=dict)
    """A chain digest no conversation held sent -> the name of the conversation not held
    (let go, or not loaded; its records stay) that sent it first: a request that repeats it
    goes to that one, made again by its name. The oldest past :data:`GONE_KEPT` are
    forgotten."""
    gone_ends: dict[bytes, str] = field(default_factory=dict)
    """The chain digest of a conversation's last request -> its name, for those not held."""

    def register(self, branch: Branch, chain: list[bytes], start: int = 0) -> None:
        """``branch`` now ends with ``chain`` (new from ``start``), the most recent."""
        old = branch.chain
        if old and self.ends.get(old[-1]) is branch:
            del self.ends[old[-1]]
        gone = self.gone
        for c in chain[start:]:
            self.owner.setdefault(c, branch)
            if gone:
                gone.pop(c, None)
        if chain:
            self.ends[chain[-1]] = branch
            if branch.name is not None and self.gone_ends.get(chain[-1]) == branch.name:
                del self.gone_ends[chain[-1]]
        branch.chain = chain
        # a new list in one step: a reader without the lock (FamilyDecisions.alone) never
        # sees the family between the branch's removal and its return to the front
        self.recent = [branch, *(b for b in self.recent if b is not branch)]

    def remember(self, name: str, chain: list[bytes]) -> None:
        """The conversation ``name``, not held, sent ``chain`` (read from its records): what
        no conversation held sent of it is kept by its name (:attr:`gone`)."""
        for c in chain:
            if c not in self.owner:
                self.gone.setdefault(c, name)
        if chain and chain[-1] not in self.ends:
            self.gone_ends[chain[-1]] = name
        self.keep_gone()

    def adopt(self, branch: Branch) -> None:
        """``branch``, new to the index, sent all of its chain: what a conversation not held
        sent of it, ``branch`` stands for now (it is that one again, or shares it)."""
        if not (self.gone or self.gone_ends):
            return
        for c in branch.chain:
            if self.gone.pop(c, None) is not None:
                self.owner.setdefault(c, branch)
        # an end it had before is left: it names a conversation held again, which wins
        if branch.chain:
            self.gone_ends.pop(branch.chain[-1], None)

    def forget(self, branch: Branch) -> None:
        """``branch`` no longer held (its records stay): out of the index. What it sent first,
        another conversation held that sent it too now stands for (the first found, most
        recent first); the rest, and its last request's end, are kept by its name
        (:attr:`gone`): a request of ``branch`` again makes it anew by that name, and its
        records then fill it (:meth:`WireSession._write_pending`)."""
        if self.branches.get(branch.name) is not branch:
            return
        del self.branches[branch.name]
        self.recent.remove(branch)
        for c in [c for c, b in self.ends.items() if b is branch]:
            del self.ends[c]
        if branch.chain and branch.name is not None:
            self.gone_ends[branch.chain[-1]] = branch.name
        # every entry, not only its chain's: a tail it sent before a moved cache mark too
        owned = [c for c, b in self.owner.items() if b is branch]
        holders: dict[bytes, Branch] = {}
        if owned:
            for other in self.recent:
                for c in other.chain:
                    holders.setdefault(c, other)
        for c in owned:
            holder = holders.get(c)
            if holder is not None:
                self.owner[c] = holder
                continue
            del self.owner[c]
            if branch.name is not None:
                self.gone[c] = branch.name
        self.keep_gone()

    def keep_gone(self) -> None:
        """The oldest of :attr:`gone` and :attr:`gone_ends` past :data:`GONE_KEPT` forgotten."""
        for index in (self.gone, self.gone_ends):
            while len(index) > GONE_KEPT:
                del index[next(iter(index))]


GONE_KEPT = 16_384
"""Digests of conversations not held a family keeps at most, each index (~100 bytes each)."""


Placed = tuple["Branch", list[bytes], int, int]
"""A request placed in a conversation held: it, the request's chain, where the request is new
to it, and how many leading messages were found to be its last request's very values (its
own objects, or equal as JSON tells values apart where ``strict``; 0 where not compared)."""


def plan(
    family: Family,
    messages: list[Any],
    opening: bytes,
    full: list[bytes] | None = None,
    *,
    strict: bool = False,
) -> Placed | NewBranch:
    """Where a request goes in ``family`` (under the lock of the index that holds it): an
    existing conversation (:data:`Placed`); or a conversation to make. ``full``: the
    request's whole chain, made beforehand (off an event loop: see :func:`new_to`); else the
    part not known already is digested here. ``strict``: a message
    that is not a conversation's own object there is compared as JSON tells values apart
    (:func:`~pipeline.wire.same_values.same_value`: ``1`` is not ``true``) -- for a body
    reader's parse, which hands on the same objects for the messages whose bytes repeat."""
    found = _extends(family, messages, strict)
    if found is not None:
        branch, start = found
        chain = _chain(messages, start, branch.chain, opening, full)
        known = _known(family, chain, start)
        if known == start or family.owner.get(chain[known - 1]) is branch:
            return branch, chain, start, start
        # what follows its last request another conversation sent (a fork of that one
        # that repeats its messages, or one not held): placed by that one's, below, to send
        # what it sent
    shared, chain = _shared_prefix(family, messages, opening, full, strict)
    known = _known(family, chain, 0)
    start = min(shared, known)
    if not family.branches:
        return NewBranch(None, None, chain, 0, start)
    if not chain or known == 0:
        # no message known (a request without any, or conversations recorded before any
        # response): the most recent, whose decisions apply only to what they were made on
        return family.recent[0], chain, start, 0
    if known == len(chain):
        end = chain[-1]  # all of it sent before: a retry, or a twin
        # the one whose last request it is, held or not, before the one that sent it first
        held = family.ends.get(end)
        if held is None and end not in family.gone_ends:
            held = family.owner.get(end)
        if held is not None:
            return held, chain, start, 0
        return _again(family, family.gone_ends.get(end) or family.gone[end], chain, known, start)
    last = chain[known - 1]
    if last in family.ends:
        return family.ends[last], chain, start, 0
    if last in family.gone_ends:  # it extends the last request of one not held
        return _again(family, family.gone_ends[last], chain, known, start)
    name = f"f{chain[known].hex()[:16]}"
    existing = family.branches.get(name)
    if existing is not None:
        return existing, chain, start, 0
    if last in family.gone:  # it goes its own way from one not held
        return _again(family, name, chain, known, start, via=family.gone[last])
    return NewBranch(name, family.owner[last], chain, known, start)


def _known(family: Family, chain: list[bytes], start: int) -> int:
    """Where ``chain`` stops being sent before by a conversation of ``family``, held or not,
    from ``start``."""
    known = start
    owner, gone = family.owner, family.gone
    while known < len(chain) and (chain[known] in owner or chain[known] in gone):
        known += 1
    return known


def _again(
    family: Family,
    name: str,
    chain: list[bytes],
    known: int,
    start: int,
    via: str | None = None,
) -> Placed | NewBranch:
    """The conversation ``name`` made, inheriting from the held conversation that sent the
    most of the request: one not held made again to take a request that repeats what it sent
    (its own records then win over what it inherits: :meth:`WireSession._write_pending`), or
    a new one that goes its own way from ``via``, not held (whose records then say what it
    decided on the results past what the held one shares)."""
    existing = family.branches.get(name)
    if existing is not None:  # held again meanwhile
        return existing, chain, start, 0
    at = known
    while at and family.owner.get(chain[at - 1]) is None:
        at -= 1
    if not at:  # nothing of it held (a family's first conversation is): the most recent
        return family.recent[0], chain, start, 0
    return NewBranch(name, family.owner[chain[at - 1]], chain, at, min(start, at), via)


def _extends(family: Family, messages: list[Any], strict: bool) -> tuple[Branch, int] | None:
    """The conversation whose last request this one extends furthest, compared by value
    (one message compared first to rule most out; of equal ones, the most recent): a retry
    of an earlier request of one conversation must not take another's that repeats it."""
    n = len(messages)
    best: tuple[Branch, int] | None = None
    for branch in family.recent:
        params = branch.params
        m = len(params)
        if not m or m > n or m != len(branch.chain) or (best is not None and m <= best[1]):
            continue
        if (
            messages[m - 1] == params[m - 1]
            and messages[:m] == params
            and (not strict or same_start(messages, params, m) == m)
        ):
            best = (branch, m)
    return best


def _shared_prefix(
    family: Family, messages: list[Any], opening: bytes, full: list[bytes] | None, strict: bool
) -> tuple[int, list[bytes]]:
    """The request's chain, the part it shares by value with the most recent conversation
    taken from that one's (not digested again)."""
    shared, base = 0, []
    if family.recent:
        recent = family.recent[0]
        params, chain = recent.params, recent.chain
        limit = min(len(params), len(chain), len(messages))
        while shared < limit and messages[shared] == params[shared]:
            shared += 1
        if strict:
            shared = same_start(messages, params, shared)
        base = chain[:shared]
    return shared, _chain(messages, shared, base, opening, full)


def _chain(
    messages: list[Any], start: int, base: list[bytes], opening: bytes, full: list[bytes] | None
) -> list[bytes]:
    # a chain is a function of the messages' values: ``base`` (the chain of messages equal to
    # the request's first ``start``) is ``full``'s start
    return list(full) if full is not None else chain_of(messages, start, base, opening=opening)


_TAIL = 8
"""A conversation's last messages a client may send again changed (a cache mark moved)."""


def new_to(family: Family, messages: list[Any]) -> int:
    """About how many of a request's messages ``family`` does not know: past the longest of
    its recent conversations' last requests whose message a few before its end the request
    holds there too (one comparison each, by identity first: a body reader hands on the same
    objects for text that repeats). A guess, read without the index's lock, for whether to
    digest the request off an event loop: placing it decides."""
    n, known = len(messages), 0
    for branch in family.recent[:4]:
        params = branch.params
        j = min(len(params), n) - 1 - _TAIL
        if j >= known and messages[j] == params[j]:
            known = j + 1
    return n - known


@dataclass(frozen=True)
class NewBranch:
    """A conversation to make: its name, the one it goes another way from (None for a new
    family's first), the request's chain, how many messages they share, where it is new;
    ``via``: the conversation not held it goes its own way from, further than from
    ``parent`` (its records say what it decided on the results they share)."""

    name: str | None
    parent: Branch | None
    chain: list[bytes]
    at: int
    start: int
    via: str | None = None


def family_key(family: Family) -> tuple[str, str]:
    """Where :class:`~pipeline.dropin.conversations.Conversations` holds ``family``: its tenant
    and name."""
    return family.tenant, family.name


def named(family: str, branch: str | None) -> str:
    return family if branch is None else f"{family}.{branch}"
