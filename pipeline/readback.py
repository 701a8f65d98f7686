"""A tool the model calls to read a persisted output back, page by page.

The replacement text tells the model where the full output is; this tool reads it by that path,
with ``offset``/``limit`` in lines. It only reads inside the session's store directory and is
itself never persisted (``max_result_size_chars = math.inf``): persisting the output of the tool
that reads persisted outputs would be a loop. Its own bound is ``max_chars`` per call.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from pipeline.tools import Tool

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic.types import ToolParam

__all__ = ["READBACK_TOOL_NAME", "LineReader", "PersistedOutputReader", "ReadbackError"]

READBACK_TOOL_NAME = "read_persisted_output"
DEFAULT_LIMIT_LINES = 2_000
DEFAULT_MAX_CHARS = 40_000


class ReadbackError(ValueError):
    """A read-back request that cannot be served; the message is safe to show the model."""


class LineReader:
    """A file-reading tool confined to some directories: definition + async handler.

    Reads ``limit`` lines from line ``offset`` (1-based) of a file under one of ``roots``
    (symlinks are resolved first, so a link cannot lead outside). Never persisted
    (``max_result_size_chars = math.inf``); ``max_chars`` bounds one call's output instead.
    """

    max_result_size_chars: float = math.inf

    def __init__(
        self,
        roots: list[Path],
        *,
        name: str,
        description: str,
        default_limit: int = DEFAULT_LIMIT_LINES,
        max_chars: int = DEFAULT_MAX_CHARS,
    ) -> None:
        self.roots = [Path(r) for r in roots]
        self.name = name
        self.description = description
        self.default_limit = default_limit
        self.max_chars = max_chars

    @property
    def definition(self) -> ToolParam:
        """The tool definition to pass in ``tools=[...]``."""
        return {
            "name": self.name,
            "description": (
                f"{self.description} Returns up to `limit` lines (default {self.default_limit}) "
                "starting at line `offset` (1-based, default 1); call again with a larger "
                "offset for more."
            ),
            "input_schema": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "The saved output's path."},
                    "offset": {"type": "integer", "minimum": 1, "description": "First line."},
                    "limit": {"type": "integer", "minimum": 1, "description": "Max lines."},
                },
                "required": ["path"],
                "additionalProperties": False,
            },
        }

    def as_tool(self) -> Tool:
        """This reader as an agent :class:`~pipeline.tools.Tool` (never persisted)."""
        definition = self.definition
        return Tool(
            name=self.name,
            description=str(definition.get("description", "")),
            input_schema=definition["input_schema"],
            handler=self,
            max_result_size_chars=self.max_result_size_chars,
        )

    async def __call__(self, tool_input: Mapping[str, Any]) -> str:
        """Handle one tool call; raises :class:`ReadbackError` for a bad request."""
        path = tool_input.get("path")
        offset = tool_input.get("offset", 1)
        limit = tool_input.get("limit", self.default_limit)
        if not isinstance(path, str) or not path:
            raise ReadbackError("'path' must be a non-empty string")
        for key, value in (("offset", offset), ("limit", limit)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ReadbackError(f"'{key}' must be an integer >= 1, got {value!r}")
        return await anyio.to_thread.run_sync(self._read, path, offset, limit)

    def resolve(self, path: str) -> Path:
        """The real file ``path`` names, refused unless it lies inside one of the roots.

        A relative path is taken relative to the first root.
        """
        if "\x00" in path:
            raise ReadbackError("path contains a NUL character")
        bases = [r.resolve() for r in self.roots]
        candidate = Path(path)
        if not candidate.is_absolute():
            candidate = bases[0] / candidate
        real = candidate.resolve()
        if not any(real.is_relative_to(b) for b in bases) or not real.is_file():
            raise ReadbackError(
                f"no readable file at {path!r} (only files under the allowed directories)"
            )
        return real

    def _read(self, path: str, offset: int, limit: int) -> str:
        real = self.resolve(path)
        lines: list[str] = []
        used = 0
        total = 0
        truncated_line = False
        with real.open("r", encoding="utf-8", errors="replace", newline="") as fh:
            for number, line in enumerate(fh, start=1):
                total = number
                if number < offset or len(lines) >= limit or truncated_line:
                    continue
                room = self.max_chars - used
                if len(line) > room:
                    lines.append(line[:room])
                    truncated_line = True
                    continue
                lines.append(line)
                used += len(line)
        if total and offset > total:
            raise ReadbackError(f"offset {offset} is past the end ({total} lines)")
        text = "".join(lines)
        last = offset + len(lines) - 1
        if truncated_line:
            return (
                text + f"\n[output cut at {self.max_chars} chars within line {last}; "
                f"file has {total} lines]"
            )
        if last < total:
            return text + f"\n[lines {offset}-{last} of {total}; next: offset={last + 1}]"
        return text


class PersistedOutputReader(LineReader):
    """The read-back tool for persisted outputs, confined to one store directory.

    ``directory`` is where the replacement paths point (``FileToolResultStore.directory``).
    """

    name = READBACK_TOOL_NAME

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        default_limit: int = DEFAULT_LIMIT_LINES,
        max_chars: int = DEFAULT_MAX_CHARS,
    ) -> None:
        super().__init__(
            [Path(directory)],
            name=READBACK_TOOL_NAME,
            description=(
                "Read a tool output that was too large to show in full and was saved to a "
                "file (the path after 'Full output saved to:' in a <persisted-output> block)."
            ),
            default_limit=default_limit,
            max_chars=max_chars,
        )
        self.directory = Path(directory)
