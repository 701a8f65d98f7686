"""What a conversation that went another way from another starts from.

A request that shares only part of a conversation's messages -- a client's fork, an edit, a
rewind -- becomes a conversation of its own (:mod:`pipeline.dropin.conversations`). It starts from
the
other's decisions on the results it holds, the other's stage records, the responses the other
observed for the part they share and its token tracker's state, so the part they share goes
out as the other sent it. :class:`Inherited` is that, and the first record of the new
conversation's own log (:data:`FORK_RECORD`), which makes that log whole on its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.replacement import DECIDED_RECORD_STAGE, ReplacementRecord, decided_in, decided_record
from pipeline.transcript.read import StageRecord

__all__ = ["FORK_RECORD", "Inherited"]

FORK_RECORD = "wire_session.fork"
"""The stage of the first record of a conversation that went another way from another."""


@dataclass(slots=True)
class Inherited:
    """What a conversation that went another way from another starts from (see the module)."""

    parent: str
    """The other conversation's name."""
    at: int
    """How many messages the two share."""
    replacement_records: list[ReplacementRecord] = field(default_factory=list)
    stage_records: list[StageRecord] = field(default_factory=list)
    chain: list[bytes] = field(default_factory=list)
    """The digests of the messages of this conversation's first request."""
    tracker: dict[str, Any] | None = None

    def decided_keys(self) -> set[str]:
        """The ledger keys of the results it holds a decision on (replaced, or sent whole)."""
        return {r.key for r in self.replacement_records} | decided_in(self.stage_records)

    def adopt(self, records: list[ReplacementRecord], whole: set[str]) -> None:
        """Take another conversation's decisions (``records`` replaced, ``whole`` sent whole)
        on results this one holds none on."""
        known = self.decided_keys()
        self.replacement_records += [r for r in records if r.key not in known]
        whole = whole - known
        if whole:
            self.stage_records.append(StageRecord(DECIDED_RECORD_STAGE, decided_record(whole)))

    def to_record(self) -> dict[str, Any]:
        """The data of the :data:`FORK_RECORD`."""
        return {
            "parent": self.parent,
            "at": self.at,
            "replacements": [r.to_json() for r in self.replacement_records],
            "stages": [[r.stage, dict(r.data)] for r in self.stage_records],
            "chain": [c.hex() for c in self.chain],
        }

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> tuple[Inherited, list[str]]:
        """A :data:`FORK_RECORD`'s data read back, and what in it was unreadable (left out one
        part at a time: a bad replacement record, a bad stage record; the chain up to its first
        bad digest), so that one damaged field never costs the rest."""
        problems: list[str] = []
        parent, at = data.get("parent"), data.get("at")
        if not isinstance(parent, str):
            problems.append("parent")
            parent = ""
        if not isinstance(at, int) or isinstance(at, bool) or at < 0:
            problems.append("at")
            at = 0
        records: list[ReplacementRecord] = []
        replacements = data.get("replacements")
        for raw in replacements if isinstance(replacements, list) else ():
            try:
                records.append(ReplacementRecord.from_json(raw))
            except (ValueError, AttributeError):
                problems.append("replacement")
        stages: list[StageRecord] = []
        given = data.get("stages")
        for item in given if isinstance(given, list) else ():
            if (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], Mapping)
                and item[0] != FORK_RECORD
            ):
                stages.append(StageRecord(item[0], item[1]))
            else:
                problems.append("stage record")
        chain: list[bytes] = []
        digests = data.get("chain")
        for text in digests if isinstance(digests, list) else ():
            try:
                digest = bytes.fromhex(text) if isinstance(text, str) else b""
            except ValueError:
                digest = b""
            if not digest:
                problems.append("chain")
                break  # what follows a bad link cannot be placed
            chain.append(digest)
        return cls(parent, at, records, stages, chain), problems
