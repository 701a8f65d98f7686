"""Builders for conversations in tests: short, explicit, no hidden defaults that matter."""

from __future__ import annotations

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


class QuietLogger:
    """A structlog-shaped logger that drops everything (console logging is not under test)."""

    def bind(self, **_kw: Any) -> QuietLogger:
        return self

    def debug(self, *_a: Any, **_kw: Any) -> None:
        pass

    info = warning = error = exception = debug


class MemoryStore:
    """A deterministic in-memory store (no I/O); ids in ``failing`` fail to persist, every time."""

    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        self.failing = failing
        self.files: dict[str, str] = {}

    async def persist(self, tool_use_id: str, text: str, ext: str) -> str:
        if tool_use_id in self.failing:
            raise OSError(28, "No space left on device")
        path = f"/mem/{tool_use_id}.{ext}"
        self.files.setdefault(path, text)
        return path
