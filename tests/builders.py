"""Builders for conversations in tests: short, explicit, no hidden defaults that matter."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pipeline import Message, Usage


def tool_use(tool_use_id: str, name: str = "Bash", **inp: Any) -> dict[str, Any]:
    """A tool_use block."""
    return {"type": "tool_use", "id": tool_use_id, "name": name, "input": inp or {"command": "x"}}


def tool_result(tool_use_id: str, content: Any, **extra: Any) -> dict[str, Any]:
    """A tool_result block."""
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content, **extra}


def user_text(text: str) -> Message:
    """A user prompt."""
    return Message.user(text)


def assistant(message_id: str, *blocks: dict[str, Any], usage: Usage | None = None) -> Message:
    """One assistant record (a fragment of response ``message_id``)."""
    return Message.assistant(list(blocks), message_id=message_id, usage=usage, model="claude-test")


def results(*blocks: dict[str, Any]) -> Message:
    """A user record holding tool_result blocks."""
    return Message.user(list(blocks))


def json_paths(node: Any, prefix: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """Every place in a JSON tree a value sits (containers included), as key/index paths."""
    if prefix:
        yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from json_paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from json_paths(v, (*prefix, i))
