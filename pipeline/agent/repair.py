"""Repair of a loaded history's tool pairing, so that a resumed session can be sent.

A transcript can hold a tool_use that no result answers anywhere in it, not only at its end: the
process died between two parallel results (one record per result), lines were lost or copied
twice. The Messages API rejects such a request, so resuming would fail on every try. Claude Code
answers each unanswered tool_use with an error result; this does the same, and drops results
that answer nothing (or answer an id a second time).

The repair is a pure function of the records, so every resume of the same transcript sends the
same request; the records it adds in the middle of the history are not written to the
transcript (appended at its end they would land elsewhere on the next load).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pipeline.messages import Block, Message, now_timestamp
from pipeline.wire.form import to_api, wire_positions
from pipeline.wire.pairing import PairingProblem, check_pairing

if TYPE_CHECKING:
    pass

__all__ = ["INTERRUPTED_RESULT", "PairingRepair", "repair_pairing"]

INTERRUPTED_RESULT = "Tool execution was interrupted (the session stopped before it finished)."

_MAX_ROUNDS = 4  # each round fixes every problem it can see; a fix can only reveal a few more


@dataclass(slots=True)
class PairingRepair:
    """A repaired history and what was done to it."""

    messages: list[Message]
    answered: list[str] = field(default_factory=list)
    """tool_use ids given an ``INTERRUPTED_RESULT`` error result."""
    dropped: list[str] = field(default_factory=list)
    """tool_result ids removed (orphans, second answers)."""
    moved: list[str] = field(default_factory=list)
    """tool_result ids that came too late, moved to right after their call."""
    trailing: list[Message] = field(default_factory=list)
    """The added records that stand at the end of ``messages`` (safe to append to a transcript)."""
    remaining: list[PairingProblem] = field(default_factory=list)
    """What could not be repaired (a tool_use id used twice): the request would be rejected."""


def _interrupted(tool_use_id: str) -> Block:
    return {
        "type": "tool_result",
        "tool_use_id": tool_use_id,
        "content": INTERRUPTED_RESULT,
        "is_error": True,
    }


def _one_round(
    messages: list[Message],
    problems: list[PairingProblem],
    repair: PairingRepair,
    inserted: set[int],
) -> list[Message]:
    positions = wire_positions(messages)
    unanswered: dict[int, list[str]] = {}
    orphans: set[tuple[int, str]] = set()
    duplicates: set[tuple[int, str]] = set()
    for p in problems:
        if p.kind == "unanswered_tool_use":
            unanswered.setdefault(p.index, []).append(p.tool_use_id)
        elif p.kind == "orphan_tool_result":
            orphans.add((p.index, p.tool_use_id))
        elif p.kind == "duplicate_tool_result":
            duplicates.add((p.index, p.tool_use_id))
    waiting = {t for ids in unanswered.values() for t in ids}
    # a late result of an unanswered call moves to where the API looks for it
    late: dict[str, Block] = {}
    for i, m in enumerate(messages):
        if m.type == "user" and isinstance(m.content, list):
            for b in m.content:
                tid = b.get("tool_use_id") if b.get("type") == "tool_result" else None
                if (positions[i], tid) in orphans and tid in waiting and tid not in late:
                    late[str(tid)] = b
    # Answers go right after the record that opened the call's response (its first fragment):
    # an assistant record, so never one this round empties, and the wire folds later fragments
    # of the response back past tool_result-only records -- also when another response was
    # recorded in between (after the last fragment, the answer would land behind that one).
    after: dict[int, int] = {}
    for i, entry in enumerate(positions):
        if entry in unanswered and messages[i].type == "assistant" and entry not in after.values():
            after[i] = entry
    out: list[Message] = []
    seen: set[tuple[int, str]] = set()
    for i, m in enumerate(messages):
        entry = positions[i]
        if m.type == "user" and isinstance(m.content, list):
            blocks = []
            for b in m.content:
                tid = b.get("tool_use_id") if b.get("type") == "tool_result" else None
                key = (entry, str(tid))
                if tid is not None and (key in orphans or (key in duplicates and key in seen)):
                    if tid not in late:
                        repair.dropped.append(str(tid))
                    continue
                seen.add(key)
                blocks.append(b)
            if not blocks:
                continue  # nothing is left of the record
            if len(blocks) != len(m.content):
                m = replace(m, content=blocks)
        out.append(m)
        call = after.get(i)
        if call is not None:
            ids = unanswered[call]
            answer = Message.user(
                [late.get(t) or _interrupted(t) for t in ids], timestamp=now_timestamp()
            )
            inserted.add(id(answer))
            out.append(answer)
            repair.answered += [t for t in ids if t not in late]
            repair.moved += [t for t in ids if t in late]
    return out


def repair_pairing(messages: Sequence[Message]) -> PairingRepair:
    """``messages`` with every unanswered tool_use answered by an error result (or by its own
    result when that came too late), placed right after the call's response where the API
    looks for it, and every orphan or second result removed.
    The input is not modified; an unchanged history comes back as an equal new list."""
    repair = PairingRepair(list(messages))
    inserted: set[int] = set()
    for _ in range(_MAX_ROUNDS):
        problems = check_pairing(to_api(repair.messages))
        fixable = [p for p in problems if p.kind != "duplicate_tool_use"]
        if not fixable:
            repair.remaining = problems
            break
        repair.messages = _one_round(repair.messages, problems, repair, inserted)
    else:
        repair.remaining = check_pairing(to_api(repair.messages))
    tail = len(repair.messages)
    while tail and id(repair.messages[tail - 1]) in inserted:
        tail -= 1
    repair.trailing = repair.messages[tail:]
    return repair
