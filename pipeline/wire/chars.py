"""The size of a request's visible text (:func:`request_chars`), what a token estimate of the
request sent goes by."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.wire.deferred import DeferredText

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic.types import MessageParam

__all__ = ["param_chars", "request_chars"]


def _text_chars(value: Any) -> int:
    if type(value) is DeferredText:  # held out of memory: its length is known
        return value.chars
    return len(str(value or ""))


def _input_chars(given: Any) -> int:
    held = (
        [v.chars for v in given.values() if type(v) is DeferredText] if type(given) is dict else []
    )
    if not held:
        return len(repr(given))
    # a value held out of memory counts as its characters and its quotes: not read back
    rest = {k: "" if type(v) is DeferredText else v for k, v in given.items()}
    return len(repr(rest)) + sum(held)


def _block_chars(block: Any) -> int:
    if not isinstance(block, dict):
        return 0
    btype = block.get("type")
    if btype == "text":
        return _text_chars(block.get("text"))
    if btype == "thinking":
        return _text_chars(block.get("thinking"))
    if btype == "tool_use":
        return len(str(block.get("name") or "")) + _input_chars(block.get("input"))
    if btype == "tool_result":
        content = block.get("content")
        if isinstance(content, str):
            return len(content)
        if type(content) is DeferredText:
            return content.chars
        if isinstance(content, list):
            return sum(_block_chars(b) for b in content)
    return 0


def request_chars(request: Sequence[MessageParam]) -> int:
    """Characters of text, thinking, tool input and tool output in a request (images: 0)."""
    return sum(map(param_chars, request))


def param_chars(param: MessageParam) -> int:
    """Characters of visible text in one message param (see :func:`request_chars`)."""
    content: Any = param["content"]
    if isinstance(content, str):
        return len(content)
    return sum(_block_chars(b) for b in content)
