"""The tool pairing check: every tool_use answered by exactly one tool_result in the next user
message, and no orphan result -- the Messages API rejects a request otherwise."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "PairingError",
    "PairingIndex",
    "PairingProblem",
    "check_pairing",
    "ensure_paired",
]


@dataclass(frozen=True, slots=True)
class PairingProblem:
    """One broken tool pairing in a request: which id, where, and what is wrong."""

    kind: Literal[
        "unanswered_tool_use", "orphan_tool_result", "duplicate_tool_result", "duplicate_tool_use"
    ]
    tool_use_id: str
    index: int  # index of the wire message that holds the offending block

    def __str__(self) -> str:
        return f"{self.kind} {self.tool_use_id!r} at message {self.index}"


class PairingError(ValueError):
    """A request the Messages API would reject for broken tool_use/tool_result pairing."""

    def __init__(self, problems: Sequence[PairingProblem]) -> None:
        self.problems = list(problems)
        shown = "; ".join(str(p) for p in self.problems[:10])
        more = f" (+{len(self.problems) - 10} more)" if len(self.problems) > 10 else ""
        super().__init__(f"broken tool pairing: {shown}{more}")


def _param_blocks(param: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    content = param.get("content")
    if isinstance(content, list):
        return [b for b in content if type(b) is dict or isinstance(b, Mapping)]
    return []


def _entry_problems(
    params: Sequence[Mapping[str, Any]], i: int, first_use: dict[str, int]
) -> list[PairingProblem]:
    """The problems of wire message ``i`` (it depends on its neighbours); the tool_use ids it
    is the first to use are added to ``first_use`` (id -> message index)."""
    param = params[i]
    blocks = _param_blocks(param)
    problems: list[PairingProblem] = []
    if param.get("role") == "assistant":
        uses: list[str] = []
        for b in blocks:
            if b.get("type") == "tool_use":
                uid = str(b.get("id"))
                if uid in first_use:
                    problems.append(PairingProblem("duplicate_tool_use", uid, i))
                else:
                    first_use[uid] = i
                uses.append(uid)
        if uses:
            nxt = params[i + 1] if i + 1 < len(params) else None
            answered: set[str] = set()
            if nxt is not None and nxt.get("role") == "user":
                answered = {
                    str(b.get("tool_use_id"))
                    for b in _param_blocks(nxt)
                    if b.get("type") == "tool_result"
                }
            problems += [
                PairingProblem("unanswered_tool_use", uid, i) for uid in uses if uid not in answered
            ]
    elif param.get("role") == "user":
        prev = params[i - 1] if i > 0 else None
        prev_uses = (
            {str(b.get("id")) for b in _param_blocks(prev) if b.get("type") == "tool_use"}
            if prev is not None and prev.get("role") == "assistant"
            else set()
        )
        counts: dict[str, int] = {}
        for b in blocks:
            if b.get("type") == "tool_result":
                tid = str(b.get("tool_use_id"))
                counts[tid] = counts.get(tid, 0) + 1
                if tid not in prev_uses:
                    problems.append(PairingProblem("orphan_tool_result", tid, i))
                elif counts[tid] == 2:
                    problems.append(PairingProblem("duplicate_tool_result", tid, i))
    return problems


def check_pairing(request: Iterable[Mapping[str, Any]]) -> list[PairingProblem]:
    """Every tool_use answered by exactly one tool_result in the next user message, no orphans.

    Returns the problems found (empty when the request is valid).
    """
    params = list(request)
    first_use: dict[str, int] = {}
    problems: list[PairingProblem] = []
    for i in range(len(params)):
        problems += _entry_problems(params, i, first_use)
    return problems


def ensure_paired(request: Iterable[Mapping[str, Any]]) -> None:
    """Raise :class:`PairingError` naming every offending id if the pairing is broken."""
    problems = check_pairing(request)
    if problems:
        raise PairingError(problems)


class PairingIndex:
    """:func:`check_pairing` of a request that changes only at its end, kept up to date at the
    cost of what changed (a message's problems depend on its neighbours and on the tool_use
    ids before it, all of which an unchanged prefix keeps)."""

    def __init__(self) -> None:
        self._problems: list[Sequence[PairingProblem]] = []
        self._first_use: dict[str, int] = {}
        """tool_use id -> the message that first used it, in the order of those messages (ids
        are registered message by message): what a change from message ``k`` on takes back is
        its tail, the ids first used at ``k`` or later."""
        self.count = 0
        """How many problems the request has."""

    def update(self, params: Sequence[Mapping[str, Any]], changed_from: int) -> None:
        """Take the request ``params`` whose messages from ``changed_from`` on are new or
        changed (0: all of them)."""
        start = max(0, min(changed_from - 1, len(self._problems)))
        first_use = self._first_use
        while first_use and next(reversed(first_use.values())) >= start:
            first_use.popitem()
        self.count -= sum(map(len, self._problems[start:]))
        del self._problems[start:]
        for i in range(start, len(params)):
            problems = _entry_problems(params, i, first_use)
            # most messages have none: share one empty tuple rather than keep a list each
            self._problems.append(problems or ())
            self.count += len(problems)

    @property
    def tool_use_ids(self) -> AbstractSet[str]:
        """The tool_use ids of the request (a live view)."""
        return self._first_use.keys()

    @property
    def problems(self) -> list[PairingProblem]:
        """Every problem, in the order :func:`check_pairing` gives them."""
        return [p for ps in self._problems for p in ps] if self.count else []
