"""The tool pairing check over a replay's requests, at the cost of what changed per call.

A recorded session can hold requests the Messages API would reject (a tool_result before its
tool_use, a late same-id fragment carrying a tool_use): the replay reports them rather than
passing them off as sendable. Checking every request whole would make a long replay quadratic;
consecutive requests share their leading message objects (``WireCache``), so the check is kept
up to date from the first message that changed, as the live loop's cache does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.incremental import first_difference
from pipeline.pairing import PairingIndex, PairingProblem

__all__ = ["PairingWatch"]

_TAIL = 4
"""Trailing positions refreshed after each request: the caller's own copies of the last
messages (``WireCache.editable``) sit there, equal to but not the objects the next request
shares."""


class PairingWatch:
    """:func:`~pipeline.pairing.check_pairing` of each request of one replay, in order.

    Messages are compared by equality (identity first, as ``list ==`` does): equal messages
    have the same pairing problems, whatever their identity.
    """

    def __init__(self) -> None:
        self._index = PairingIndex()
        self._seen: list[Mapping[str, Any]] = []
        """The last request's messages (the same objects, except where equal ones stand)."""

    def check(self, request: Sequence[Mapping[str, Any]]) -> int:
        """Take the next request; return how many pairing problems it has."""
        self._index.update(request, self._first_change(request))
        return self._index.count

    @property
    def problems(self) -> list[PairingProblem]:
        """The problems of the last request, in :func:`~pipeline.pairing.check_pairing` order."""
        return self._index.problems

    def _first_change(self, request: Sequence[Mapping[str, Any]]) -> int:
        """Where ``request`` first differs from the last one; remember it.

        The usual request extends the last one: its new tail is appended and the two lists
        compared in one C-level ``list ==`` (a pointer check per shared message, as
        ``InputLog`` does), with no copy of the history; a Python-level sweep cost a long
        replay a tenth of its time. Otherwise (a stage removed or edited messages) the
        position is found by a sweep and the request copied.
        """
        seen, n_seen = self._seen, len(self._seen)
        if len(request) >= n_seen:
            seen.extend(request[n_seen:])
            if seen == request:
                # keep the next comparison a pointer check: the request's own objects where
                # the last one had its private copies
                start = max(0, n_seen - _TAIL)
                seen[start:n_seen] = request[start:n_seen]
                return n_seen
            del seen[n_seen:]
        first = first_difference(request, seen)
        self._seen = list(request)
        return min(len(request), n_seen) if first is None else first
