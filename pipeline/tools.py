"""Tools for the agent loop: plain async Python functions with a JSON schema."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.messages import Block
from pipeline.policies import UNDECLARED_MAX_RESULT_SIZE_CHARS

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic.types import ToolParam

__all__ = ["Tool", "ToolOutput", "tool"]

ToolOutput = str | list[Block]
"""What a tool returns: text, or content blocks (text / image)."""
Handler = Callable[[dict[str, Any]], Awaitable[ToolOutput]]


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool the model may call.

    ``max_result_size_chars`` is the tool's declared limit for the per-tool gate
    (``math.inf`` = never persist, for a tool that bounds its own output); tools that declare
    nothing count as 100,000, i.e. the 50,000 cap.
    """

    name: str
    description: str
    input_schema: Mapping[str, Any]
    handler: Handler
    max_result_size_chars: float = UNDECLARED_MAX_RESULT_SIZE_CHARS

    @property
    def definition(self) -> ToolParam:
        """The entry for ``tools=[...]`` in a Messages API request."""
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": dict(self.input_schema),
        }


def tool(
    *,
    input_schema: Mapping[str, Any],
    name: str | None = None,
    description: str | None = None,
    max_result_size_chars: float = UNDECLARED_MAX_RESULT_SIZE_CHARS,
) -> Callable[[Callable[..., Awaitable[ToolOutput]]], Tool]:
    """Decorator: ``async def f(**tool_input) -> str`` becomes a :class:`Tool`.

    The function is called with the model's input as keyword arguments; its name and docstring
    are the defaults for the tool's name and description.
    """

    def wrap(fn: Callable[..., Awaitable[ToolOutput]]) -> Tool:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"tool {fn.__name__!r} must be an async function")

        async def handler(tool_input: dict[str, Any]) -> ToolOutput:
            return await fn(**tool_input)

        return Tool(
            name=name or fn.__name__,
            description=description or inspect.getdoc(fn) or "",
            input_schema=input_schema,
            handler=handler,
            max_result_size_chars=max_result_size_chars,
        )

    return wrap
