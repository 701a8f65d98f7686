"""The request for a conversation that grows between calls, built from what changed.

``to_api`` normalises the whole history on every call: for a session of thousands of records
that is most of what a replay (or an agent) spends per call. :class:`WireCache` keeps the wire
entries of the last call and, when the history only grew by records that reach nothing older
(:class:`pipeline.incremental.AppendWatch`), feeds just the new records: only the last entry
of the previous request can change (consecutive user records merge into it). Anything else --
an edit, a late fragment of an older response, a compact boundary -- rebuilds from scratch.
The result always equals ``to_api(messages)`` (``tests/test_wire_cache.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from pipeline.incremental import AppendWatch
from pipeline.messages import Message, _entry_to_param, _Wire

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic.types import MessageParam

__all__ = ["WireCache", "request_chars"]


class WireCache:
    """``to_api`` for one conversation across calls; :attr:`chars` is ``request_chars`` of the
    last request, kept up to date the same way.

    Every call returns new message dicts and content lists, as ``to_api`` does, so a caller
    may edit them (say, add a ``cache_control`` breakpoint); the block dicts inside are shared
    with the records, as with ``to_api``: do not mutate those.
    """

    def __init__(self) -> None:
        self._watch = AppendWatch()
        self._wire = _Wire()
        self._params: list[MessageParam] = []
        self._chars: list[int] = []
        self.chars = 0
        """Characters of visible text in the last request (see :func:`request_chars`)."""

    def to_api(self, messages: Sequence[Message]) -> list[MessageParam]:
        """Exactly ``to_api(messages)`` (and raises where it raises)."""
        try:
            self._extend(messages)
        except BaseException:
            # a record to_api rejects (or a cancellation) midway: start over next time
            self._watch.invalidate()
            self._wire, self._params, self._chars, self.chars = _Wire(), [], [], 0
            raise
        return [_fresh(p) for p in self._params]

    def _extend(self, messages: Sequence[Message]) -> None:
        grown = self._watch.advance(messages)
        if grown is None:
            self._wire, self._params, self._chars, self.chars = _Wire(), [], [], 0
            tail = messages[self._watch.start :]
        else:
            tail = messages[grown:]
        wire = self._wire
        keep = max(0, len(wire.entries) - 1)  # the last entry may take the new records
        for m in tail:
            wire.add(m)
        fresh = [_entry_to_param(e) for e in wire.entries[keep:]]
        del self._params[keep:]
        self._params += fresh
        self.chars -= sum(self._chars[keep:])
        del self._chars[keep:]
        counted = [_param_chars(p) for p in fresh]
        self._chars += counted
        self.chars += sum(counted)


def _block_chars(block: Any) -> int:
    if not isinstance(block, dict):
        return 0
    btype = block.get("type")
    if btype == "text":
        return len(str(block.get("text") or ""))
    if btype == "thinking":
        return len(str(block.get("thinking") or ""))
    if btype == "tool_use":
        return len(str(block.get("name") or "")) + len(repr(block.get("input")))
    if btype == "tool_result":
        content = block.get("content")
        if isinstance(content, str):
            return len(content)
        if isinstance(content, list):
            return sum(_block_chars(b) for b in content)
    return 0


def request_chars(request: Sequence[MessageParam]) -> int:
    """Characters of text, thinking, tool input and tool output in a request (images: 0)."""
    return sum(map(_param_chars, request))


def _fresh(param: MessageParam) -> MessageParam:
    """A new message dict with a new content list (the blocks themselves are shared)."""
    content: Any = param["content"]
    fresh = {"role": param["role"], "content": content if isinstance(content, str) else [*content]}
    return cast("MessageParam", fresh)


def _param_chars(param: MessageParam) -> int:
    content: Any = param["content"]
    if isinstance(content, str):
        return len(content)
    return sum(_block_chars(b) for b in content)
