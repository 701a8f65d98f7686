"""What a new conversation of a family starts from: the decisions of the one it goes its own way
from, completed by those of the family's others (:func:`inherited_by`)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from pipeline.dropin.families import Family, NewBranch
from pipeline.dropin.inheritance import Inherited
from pipeline.dropin.session_log import decisions
from pipeline.messages import Message
from pipeline.replacement import ReplacementRecord, ReplacementState
from pipeline.results.reading import read_results
from pipeline.transcript import Transcript

__all__ = ["FamilyDecisions", "inherited_by", "result_keys"]


class FamilyDecisions:
    """How the family's conversations other than ``name`` decided results (called with their
    keys; blocking), and whether it has any other (:meth:`alone`): a conversation's
    :attr:`~pipeline.dropin.adapter.WireSession.elsewhere`, and what a new one inherits
    besides its parent's. ``lock`` guards the family's list. It holds the family weakly: the
    family holds the session (a cycle would keep a conversation let go for the collector,
    with all it holds)."""

    __slots__ = ("_held", "_lock", "_name")

    def __init__(self, lock: threading.Lock, family: Family, name: str | None) -> None:
        self._lock, self._held, self._name = lock, weakref.ref(family), name

    def __call__(self, keys: Collection[str]) -> tuple[list[ReplacementRecord], set[str]]:
        """How the others decided the results ``keys`` (none once the family was let go).
        Each lookup is one step whatever another thread does
        (:meth:`WireSession.decisions_on`), so no lock of theirs is taken: one of them may be
        in a pass that asks the same of this one."""
        family = self._held()
        if family is None:
            return [], set()
        with self._lock:
            others = [b for b in family.recent if b.name != self._name]
        records: list[ReplacementRecord] = []
        seen: set[str] = set()
        missing = set(keys)
        for other in others:
            if not missing:
                break
            found, whole = other.session.decisions_on(missing)
            records += found
            seen |= whole
            missing -= {r.key for r in found} | whole
        return records, seen

    def alone(self) -> bool:
        """Whether the family holds no conversation but this one now (or was let go): nothing
        to ask, so no worker thread to ask it in. Read without the lock (on the event loop):
        the family's list is copied in one step, and every change to it is one step
        (:meth:`~pipeline.dropin.families.Family.register` puts a new list in place)."""
        family = self._held()
        if family is None:
            return True
        name = self._name
        return all(b.name == name for b in list(family.recent))


def inherited_by(
    family: Family,
    plan: NewBranch,
    messages: Sequence[Any],
    sync: bool,
    via: Transcript | None,
    lock: threading.Lock,
) -> Inherited:
    """What the conversation ``plan`` makes in ``family`` starts from: its parent's decisions
    on the results its first request holds (``sync``: taken under the parent's lock for
    synchronous callers), then the family's others' (:class:`FamilyDecisions`; ``lock``
    guards its list) and those of ``via`` (the records of the one not held it goes its own
    way from) on any its parent never decided."""
    parent = plan.parent
    assert parent is not None
    keys = result_keys(messages)
    if sync:
        with parent.session.sync_lock:
            inherited = parent.session.inherit(plan.at, keys)
    else:
        inherited = parent.session.inherit(plan.at, keys)
    # a result the parent never decided may have been decided by another conversation of the
    # family -- this client's own, whose last request no record placed (its response was
    # lost, then the process): bound to their output, those decisions are what this output
    # was sent as
    missing = keys - inherited.decided_keys()
    if missing:
        inherited.adopt(*FamilyDecisions(lock, family, parent.name)(missing))
    missing = keys - inherited.decided_keys()
    if missing and via is not None:  # the one not held it goes its own way from
        inherited.adopt(*decisions(via, ReplacementState(), missing))
    inherited.chain = list(plan.chain)  # its first request, as this one sent it
    return inherited


def result_keys(messages: Sequence[Any]) -> set[str]:
    """The ledger keys of the tool results a request holds (what a branch inherits decisions
    on): the other conversation's decisions on anything else stay with it."""
    keys: set[str] = set()
    for param in messages:
        if not (isinstance(param, Mapping) and param.get("role") == "user"):
            continue
        try:
            record = Message.from_param(param)
            keys.update(slot.key for slot in read_results(record) if slot.key is not None)
        except ValueError:  # a message the pass will refuse: it inherits nothing
            continue
    return keys
