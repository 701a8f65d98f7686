"""The ``microcompact`` stage slot: clears old tool_result content of compactable tools (SPEC §5).

Not implemented yet: this is an explicit pass-through that returns its input unchanged, so the
stage order is in place and a user can already swap in their own strategy by name.
"""

from __future__ import annotations

from pipeline import Message, SessionContext


class Microcompact:
    """PASS-THROUGH until a real strategy lands: returns the input list itself, unchanged."""

    name = "microcompact"
    may_break_cache = True
    implemented = False

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        return messages

    def __repr__(self) -> str:
        return "Microcompact()"
