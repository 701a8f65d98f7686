"""The conversations an index holds in memory, and the bounds on them (:class:`HeldFamilies`).

A :class:`~pipeline.dropin.conversations.Conversations` index holds families of conversations
(:mod:`pipeline.dropin.families`), least recently routed to first, under two bounds: how many
conversations, and what their last requests come to (each request as the caller counts it; a
request counted as nothing leaves its conversation's size as it was). The proxy counts a
request as its body's bytes and :data:`MESSAGE_COST` a message (:func:`held_size`): each
message holds records and the stages' state beyond its text, ~2 KB however short it is, so a
body of many short messages holds far more than its bytes. The proxy's resident size, its body
caches included, grows by ~0.7-1.5 times what the conversations held come to
(``tests/benchmarks/bench_proxy_memory.py``).

Past either bound, the families least recently routed to are let go, all their conversations at
once: never the family just routed to, nor one with a conversation in a call or whose answer is
still to be read (the bounds may be passed by those). A family holds at most
:data:`MAX_BRANCHES` conversations itself (a client that forks one conversation again and again
would otherwise grow the family just routed to without end): past it, or past the held size on
its own, its least recently routed ones are let go -- never its first, the one just routed to,
nor one busy as above.

A conversation let go is freed at once (nothing it holds is left in a reference cycle); a request
of one loads it from its records again, and it goes on with the same decisions, byte for byte,
as a new process would. A family loaded holds its first conversation and the
:data:`MAX_BRANCHES` less one others written last (an object store's: the last in name order),
and reads what the 256 written before those sent; the family keeps what the conversations it
does not hold sent by their names (:attr:`~pipeline.dropin.families.Family.gone`), so that a
request of one makes it anew by its name, and its records fill it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pipeline.dropin.families import Branch, Family, family_key
from pipeline.logs import get_logger

__all__ = [
    "MAX_BRANCHES",
    "MAX_HELD",
    "MAX_HELD_BYTES",
    "MESSAGE_COST",
    "HeldFamilies",
    "held_size",
]

MAX_HELD = 256
"""How many conversations are held in memory by default."""
MAX_HELD_BYTES = 512 << 20
"""What the last requests of the conversations held may come to by default (512 MiB, as
:func:`held_size` counts them: the proxy's resident size grows by ~0.7-1.5 times that)."""
MAX_BRANCHES = 32
"""How many conversations one family holds in memory by default (forks, edits, rewinds of one
conversation; its records keep the others)."""
MESSAGE_COST = 2048
"""What a message of a held request counts beyond its bytes: its records and the stages' state
(measured: 1.8-2.3 KB a message of a few to a hundred bytes, the proxy's resident size)."""


def held_size(body_bytes: int, messages: int) -> int:
    """What a request of ``body_bytes`` bytes and ``messages`` messages counts against
    ``max_held_bytes`` when the proxy holds it."""
    return body_bytes + MESSAGE_COST * messages


class HeldFamilies:
    """The families held in memory and their bounds (see the module). ``max_held``: how many
    conversations; ``max_held_bytes``: what their last requests may come to (None: no bound);
    ``max_branches``: how many conversations one family holds (at least 2: its first and one
    more; no more than ``max_held`` if that is 2 or more); ``on_let_go``: told of each
    conversation let go. Not locked: its index calls it under its own lock."""

    def __init__(
        self,
        max_held: int | None = MAX_HELD,
        max_held_bytes: int | None = MAX_HELD_BYTES,
        on_let_go: Callable[[Branch], None] | None = None,
        max_branches: int = MAX_BRANCHES,
    ) -> None:
        if max_held is not None and max_held < 1:
            raise ValueError(f"max_held must be at least 1 (or None), got {max_held}")
        if max_held_bytes is not None and max_held_bytes < 1:
            raise ValueError(f"max_held_bytes must be at least 1 (or None), got {max_held_bytes}")
        if isinstance(max_branches, bool) or not isinstance(max_branches, int) or max_branches < 2:
            raise ValueError(f"max_branches must be an integer of at least 2, got {max_branches!r}")
        self.max_held = max_held
        self.max_held_bytes = max_held_bytes
        self.max_branches = (
            max_branches if max_held is None else max(2, min(max_branches, max_held))
        )
        """How many conversations a family holds (no more than :attr:`max_held` either, but
        two at least: its first and one more)."""
        self.on_let_go = on_let_go
        self.families: OrderedDict[tuple[str, str], Family] = OrderedDict()
        """By tenant and name, least recently routed to first."""
        self.count = 0
        """Conversations held: the branches of every family held."""
        self.size = 0
        """What their last requests come to (:attr:`~pipeline.dropin.families.Branch.size`)."""
        self.released: list[Branch] = []
        """Conversations let go whose held-back writes are still to make (the index makes
        them out of its lock)."""

    def holds(self, family: Family) -> bool:
        """Whether ``family`` is the one held under its key."""
        return self.families.get(family_key(family)) is family

    def hold(self, key: tuple[str, str], loaded: Family) -> Family:
        """The family held under ``key``: ``loaded``, unless one is held there already."""
        family = self.families.get(key)
        if family is None:
            family = self.families[key] = loaded
            self.count += len(loaded.branches)
            self.size += sum(b.size for b in loaded.branches.values())
        return family

    def added(self, family: Family) -> None:
        """A branch new to ``family`` (counted when the family is held)."""
        if self.holds(family):
            self.count += 1

    def routed(self, family: Family, branch: Branch, size: int | None) -> bool:
        """A request was placed in ``branch`` of ``family`` (``size``: what it counts as;
        None: as the branch's last did): the family is now the most recent, and families
        are let go past the bounds. Whether ``family`` is held (one let go meanwhile, or made
        for one request, is not: its branch must hold it)."""
        held = self.holds(family)
        if size is not None:
            if held:  # only a held family's conversations count
                self.size += size - branch.size
            branch.size = size
        if held:
            self.families.move_to_end(family_key(family))
            self.let_go(keep=family)
            self._trim(family, keep=branch)
        return held

    def _trim(self, family: Family, keep: Branch) -> None:
        """Past :attr:`max_branches` conversations in ``family``, or past
        :attr:`max_held_bytes` on its own, let go of its least recently routed conversations:
        never its first, ``keep``, nor a busy one."""
        bound = self.max_held_bytes
        if len(family.branches) <= self.max_branches and (bound is None or self.size <= bound):
            return  # every call comes here: no sum over the family unless a bound is passed
        size = sum(b.size for b in family.branches.values()) if bound is not None else 0

        def over() -> bool:
            return len(family.branches) > self.max_branches or (bound is not None and size > bound)

        if not over():
            return
        gone = 0
        for branch in reversed(list(family.recent)):
            if not over():
                break
            if branch is keep or branch.name is None or _busy(branch):
                continue
            family.forget(branch)
            self.count -= 1
            self.size -= branch.size
            size -= branch.size
            self._release(branch)
            gone += 1
        if gone:
            get_logger().debug("conversations.branches_let_go", branches=gone, held=self.count)

    def let_go(self, keep: Family) -> None:
        """Past :attr:`max_held` conversations or :attr:`max_held_bytes`, let go of the
        families least recently routed to: never ``keep``, nor one with a conversation in a
        call or whose answer is still to be read (the next pass waits for that)."""
        excess = 0 if self.max_held is None else self.count - self.max_held
        over = 0 if self.max_held_bytes is None else self.size - self.max_held_bytes
        if excess <= 0 and over <= 0:
            return
        gone: list[tuple[str, str]] = []
        for key, family in self.families.items():
            if excess <= 0 and over <= 0:
                break
            if family is keep or any(_busy(b) for b in family.branches.values()):
                continue
            gone.append(key)
            excess -= len(family.branches)
            over -= sum(b.size for b in family.branches.values())
        for key in gone:
            family = self.families.pop(key)
            self.count -= len(family.branches)
            self.size -= sum(b.size for b in family.branches.values())
            for branch in family.branches.values():
                self._release(branch)
        if gone:
            get_logger().debug(
                "conversations.let_go", families=len(gone), held=self.count, held_bytes=self.size
            )

    def _release(self, branch: Branch) -> None:
        self.released.append(branch)
        if self.on_let_go is not None:
            self.on_let_go(branch)

    def branches(self) -> list[Branch]:
        """Every conversation held."""
        return [b for f in self.families.values() for b in f.branches.values()]


def _busy(branch: Branch) -> bool:
    """Whether ``branch`` is in a call, or has an answer still to be read: not let go."""
    return branch.call_lock.locked() or bool(branch.calls) or branch.session.answers_out
