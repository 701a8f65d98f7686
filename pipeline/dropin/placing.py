"""Placing a request in its family, under the index's lock (:class:`Placing`, a mixin of
:class:`~pipeline.dropin.conversations.Conversations`): the conversation it continues, or one
made for it -- a family's first, or a branch that goes its own way from another, starting from
that one's decisions (see :mod:`pipeline.dropin.conversations`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pipeline.dropin.adapter import WireSession
from pipeline.dropin.branching import inherited_by
from pipeline.dropin.families import Branch, Family, NewBranch, named
from pipeline.dropin.families import plan as place
from pipeline.dropin.family_loading import records_of
from pipeline.dropin.held_families import HeldFamilies
from pipeline.logs import get_logger
from pipeline.transcript import Transcript

__all__ = ["Placing"]


class Placing:
    """Where a request goes among the conversations an index holds; the index gives the
    attributes below."""

    _lock: threading.Lock
    _holding: HeldFamilies
    _session: Callable[..., WireSession]

    def _place(
        self,
        family: Family,
        messages: list[Any],
        opening: bytes,
        *,
        build: Callable[[Callable[[], Any]], Any],
        sync: bool = False,
        hold: bool = False,
        full: list[bytes] | None = None,
        size: int | None = None,
        read: dict[str, Transcript | None] | None = None,
        owned: bool = False,
    ) -> Branch | str:
        """The request's conversation; or, with ``read`` (what conversations not held sent,
        read beforehand by name), the name of one whose records must be read first.
        ``owned``: ``messages`` is a list no one changes (a body reader's parse), kept as it
        is rather than copied."""
        try:
            return self._placed(
                family, messages, opening, build, sync, hold, full, size, read, owned
            )
        finally:
            self._write_released()

    def _write_released(self) -> None:
        """Write what the conversations let go held back (a response's record kept until its
        client had it): on disk before a request of theirs loads them again. Out of the
        index's lock, which is never held across I/O; at once after it, with no other task of
        the event loop in between."""
        with self._lock:
            released, self._holding.released = self._holding.released, []
        for branch in released:
            branch.session.catch_up_sync()

    def _placed(
        self,
        family: Family,
        messages: list[Any],
        opening: bytes,
        build: Callable[[Callable[[], Any]], Any],
        sync: bool,
        hold: bool,
        full: list[bytes] | None,
        size: int | None,
        read: dict[str, Transcript | None] | None,
        owned: bool = False,
    ) -> Branch | str:
        with self._lock:
            plan = place(family, messages, opening, full, strict=owned)
            if isinstance(plan, tuple):
                branch, chain, start, checked = plan
                self._set(family, branch, messages, chain, start, hold, size, owned, checked)
                return branch
        if plan.via is not None and read is not None and plan.via not in read:
            return plan.via
        # a new conversation: made outside the index's lock (its parent read under its own)
        via = None
        if plan.via is not None:
            via = read[plan.via] if read is not None else records_of(family, plan.via)
        made = self._new_branch(family, plan, messages, build, sync, via)
        with self._lock:
            branch = family.branches.setdefault(plan.name, made)  # or another's, made meanwhile
            if branch is made:
                self._holding.added(family)
            self._set(family, branch, messages, plan.chain, plan.start, hold, size, owned)
            if branch is made:
                family.adopt(branch)
            return branch

    def _set(
        self,
        family: Family,
        branch: Branch,
        messages: list[Any],
        chain: list[bytes],
        start: int,
        hold: bool = False,
        size: int | None = None,
        owned: bool = False,
        checked: int = 0,
    ) -> None:
        family.register(branch, chain, start)
        last = branch.params
        # one list of the request's messages for the branch, its session and the body's
        # writer (8 bytes a message each), where no caller changes it
        branch.params = messages if owned else list(messages)
        # how many leading messages placing found the last request's own values: not
        # compared again
        branch.session.routed(messages, chain, branch.params, (checked, last))
        branch.calls += hold
        if not self._holding.routed(
            family, branch, size
        ):  # let go meanwhile (another thread routed), or unsure: the branch holds it
            branch.keep = family

    def _new_branch(
        self,
        family: Family,
        plan: NewBranch,
        messages: list[Any],
        build: Callable[[Callable[[], Any]], Any],
        sync: bool,
        via: Transcript | None,
    ) -> Branch:
        """A conversation made for ``plan``; ``via``: the records of the one not held it goes
        its own way from (:attr:`NewBranch.via`), as :func:`records_of` read them."""
        # a family's conversations share their results: each under its content's name
        storage = family.states.open(family.name, branch=plan.name, content_named=True)
        inherited = None
        if plan.parent is not None:
            inherited = inherited_by(family, plan, messages, sync, via, self._lock)
            get_logger(session_id=named(family.name, plan.name)).info(
                "wire_session.forked",
                parent=plan.parent.conversation_id,
                shared_messages=plan.at,
            )

        def make() -> WireSession:
            session = self._session(family, plan.name, storage, loaded=None, inherited=inherited)
            if family.unsure:
                session.store_unread()
            return session

        return Branch(family, plan.name, build(make))
