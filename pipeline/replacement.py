"""The ledger of what the model has seen: ``ReplacementState`` and its records.

Once a tool_result has been sent whole, changing it later would change the cached prompt prefix;
once it has been replaced, the same replacement string must be sent forever after. The state
remembers both, and the records written to the transcript let a resumed session rebuild it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.messages import Block, Message

__all__ = [
    "PERSISTED_OUTPUT_TAG",
    "ReplacementRecord",
    "ReplacementState",
    "candidate_size",
    "is_candidate",
    "iter_tool_results",
]

PERSISTED_OUTPUT_TAG = "<persisted-output>"
PERSISTED_OUTPUT_CLOSING_TAG = "</persisted-output>"


@dataclass(frozen=True, slots=True)
class ReplacementRecord:
    """One replaced tool_result: the exact string the model was shown instead of the output."""

    tool_use_id: str
    replacement: str
    kind: str = "tool-result"

    def to_json(self) -> dict[str, str]:
        """The transcript shape: ``{"kind", "tool_use_id", "replacement"}``."""
        return {"kind": self.kind, "tool_use_id": self.tool_use_id, "replacement": self.replacement}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ReplacementRecord:
        """Parse a record; raise ``ValueError`` naming the bad field."""
        tool_use_id = raw.get("tool_use_id")
        replacement = raw.get("replacement")
        kind = raw.get("kind", "tool-result")
        if not isinstance(tool_use_id, str) or not tool_use_id:
            raise ValueError(f"replacement record: bad tool_use_id {tool_use_id!r}")
        if not isinstance(replacement, str):
            raise ValueError(f"replacement record {tool_use_id!r}: replacement is not a string")
        if not isinstance(kind, str):
            raise ValueError(f"replacement record {tool_use_id!r}: bad kind {kind!r}")
        return cls(tool_use_id=tool_use_id, replacement=replacement, kind=kind)


def _content_has_image(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(b, Mapping) and b.get("type") == "image" for b in content
    )


def content_is_empty(content: Any) -> bool:
    """None, "", whitespace, ``[]``, or only blank text blocks."""
    if content is None:
        return True
    if isinstance(content, str):
        return not content.strip()
    if isinstance(content, list):
        return all(
            isinstance(b, Mapping)
            and b.get("type") == "text"
            and not str(b.get("text") or "").strip()
            for b in content
        )
    return False


def candidate_size(content: Any) -> int:
    """Characters a tool_result's content counts for: ``len(str)`` or the sum of its text blocks."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(b["text"])
            for b in content
            if isinstance(b, Mapping) and b.get("type") == "text" and isinstance(b.get("text"), str)
        )
    return 0


def is_candidate(block: Mapping[str, Any]) -> bool:
    """A tool_result the budget may decide on."""
    if block.get("type") != "tool_result":
        return False
    content = block.get("content")
    if content_is_empty(content):  # blank results get the placeholder, never a decision
        return False
    if isinstance(content, str) and content.startswith(PERSISTED_OUTPUT_TAG):
        return False
    return not _content_has_image(content)


def iter_tool_results(messages: Iterable[Message]) -> Iterable[tuple[Message, Block]]:
    """Every tool_result block held by a user message, in order."""
    for m in messages:
        if m.type == "user" and isinstance(m.content, list):
            for b in m.content:
                if b.get("type") == "tool_result":
                    yield m, b


@dataclass(slots=True)
class ReplacementState:
    """``seen_ids``: every tool_use_id that passed a budget decision; ``replacements``: the subset
    that was replaced, mapped to the exact string the model was shown."""

    seen_ids: set[str] = field(default_factory=set)
    replacements: dict[str, str] = field(default_factory=dict)

    def copy(self) -> ReplacementState:
        """An independent copy (a sub-agent starts from its parent's state)."""
        return ReplacementState(set(self.seen_ids), dict(self.replacements))

    def classify(self, tool_use_id: str) -> str:
        """``"must_reapply"``, ``"frozen"`` or ``"fresh"``."""
        if tool_use_id in self.replacements:
            return "must_reapply"
        if tool_use_id in self.seen_ids:
            return "frozen"
        return "fresh"

    def record_replacement(self, tool_use_id: str, replacement: str) -> None:
        """Mark seen and replaced in one step: no observer sees one without the other."""
        self.replacements[tool_use_id] = replacement
        self.seen_ids.add(tool_use_id)

    @classmethod
    def reconstruct(
        cls,
        messages: Sequence[Message],
        records: Iterable[ReplacementRecord],
    ) -> ReplacementState:
        """Rebuild the state of a resumed session.

        Every candidate present in ``messages`` was sent, so it is seen (frozen unless replaced);
        replacements are restored only for ids still present as candidates, and the stored
        strings are used verbatim, never rebuilt.
        """
        state = cls()
        present: set[str] = set()
        for _m, block in iter_tool_results(messages):
            if is_candidate(block):
                tid = block.get("tool_use_id")
                if isinstance(tid, str):
                    present.add(tid)
        state.seen_ids |= present
        for record in records:
            if record.kind == "tool-result" and record.tool_use_id in present:
                state.replacements[record.tool_use_id] = record.replacement
        return state
