"""Prompt-cache breakpoints: where a request asks the API to cache its prefix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from anthropic.types import MessageParam

__all__ = [
    "add_cache_breakpoint",
    "marked_outside_messages",
    "param_breakpoints",
    "place_cache_breakpoint",
]

_NO_BREAKPOINT = frozenset({"thinking", "redacted_thinking"})
"""Blocks that cannot carry ``cache_control``."""


def param_breakpoints(param: MessageParam) -> int:
    """How many blocks of one message carry ``cache_control``, those inside a tool result's
    content included (the API counts every one against its four)."""
    content: Any = param["content"]
    if not isinstance(content, list):
        return 0
    marks = 0
    for block in content:
        if isinstance(block, dict):
            marks += "cache_control" in block
            inner = block.get("content")
            if isinstance(inner, list):
                marks += sum(1 for b in inner if isinstance(b, dict) and "cache_control" in b)
    return marks


def marked_outside_messages(body: Mapping[str, Any]) -> bool:
    """Whether a request sets its own cache breakpoints outside its messages: on its system
    prompt's blocks, on a tool, or for the whole request (a top-level ``cache_control``). A
    client that does manages its caching itself (and may have used all four breakpoints)."""
    if body.get("cache_control") is not None:
        return True
    for group in (body.get("system"), body.get("tools")):
        if isinstance(group, list) and any(
            isinstance(b, Mapping) and b.get("cache_control") is not None for b in group
        ):
            return True
    return False


def add_cache_breakpoint(request: list[MessageParam]) -> bool:
    """Ask the API to cache the request's prefix: ``cache_control`` on the last block that can
    carry one (a message sent as a plain string stays one; the API caches everything up to
    the breakpoint, and the next request, which extends this one, reads it back). The message
    is replaced by a copy with a new content list; no shared block is touched. Returns
    whether a breakpoint was placed."""
    return place_cache_breakpoint(request) is not None


def place_cache_breakpoint(request: list[MessageParam]) -> int | None:
    """:func:`add_cache_breakpoint`, returning the index of the message it replaced (``None``:
    no block can carry one) -- for a caller whose request list is shared with a cache that
    must be told (:meth:`pipeline.wire.cache.WireCache.replaced`)."""
    for i in range(len(request) - 1, -1, -1):
        param = request[i]
        blocks: Any = param["content"]
        if isinstance(blocks, str):
            continue  # kept a string, as sent before: the breakpoint goes on a block before it
        for j in range(len(blocks) - 1, -1, -1):
            block = blocks[j]
            if not isinstance(block, dict) or block.get("type") in _NO_BREAKPOINT:
                continue
            if block.get("type") == "text" and not block.get("text"):
                continue  # the API refuses cache_control on empty text
            marked = [
                *blocks[:j],
                {**block, "cache_control": {"type": "ephemeral"}},
                *blocks[j + 1 :],
            ]
            # the message's other fields, if any, as they were
            request[i] = cast("MessageParam", {**param, "content": marked})
            return i
    return None
