"""The tool pairing check: every tool_use answered by exactly one tool_result in the next user
message, and no orphan result -- the Messages API rejects a request otherwise."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["PairingError", "PairingProblem", "check_pairing", "ensure_paired"]


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
        return [b for b in content if isinstance(b, Mapping)]
    return []


def check_pairing(request: Iterable[Mapping[str, Any]]) -> list[PairingProblem]:
    """Every tool_use answered by exactly one tool_result in the next user message, no orphans.

    Returns the problems found (empty when the request is valid).
    """
    params = list(request)
    problems: list[PairingProblem] = []
    seen_uses: set[str] = set()
    for i, param in enumerate(params):
        blocks = _param_blocks(param)
        if param.get("role") == "assistant":
            uses: list[str] = []
            for b in blocks:
                if b.get("type") == "tool_use":
                    uid = str(b.get("id"))
                    if uid in seen_uses:
                        problems.append(PairingProblem("duplicate_tool_use", uid, i))
                    seen_uses.add(uid)
                    uses.append(uid)
            if not uses:
                continue
            nxt = params[i + 1] if i + 1 < len(params) else None
            answered: dict[str, int] = {}
            if nxt is not None and nxt.get("role") == "user":
                for b in _param_blocks(nxt):
                    if b.get("type") == "tool_result":
                        tid = str(b.get("tool_use_id"))
                        answered[tid] = answered.get(tid, 0) + 1
            for uid in uses:
                if answered.get(uid, 0) == 0:
                    problems.append(PairingProblem("unanswered_tool_use", uid, i))
        elif param.get("role") == "user":
            prev = params[i - 1] if i > 0 else None
            prev_uses = (
                {
                    str(b.get("id"))
                    for b in (_param_blocks(prev) if prev is not None else [])
                    if b.get("type") == "tool_use"
                }
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


def ensure_paired(request: Iterable[Mapping[str, Any]]) -> None:
    """Raise :class:`PairingError` naming every offending id if the pairing is broken."""
    problems = check_pairing(request)
    if problems:
        raise PairingError(problems)
