"""A tool the model calls to read a persisted output back, page by page.

The replacement text tells the model where the full output is; this tool reads it by that path,
with ``offset``/``limit`` in lines. It only reads inside the session's store directory and is
itself never persisted (``max_result_size_chars = math.inf``): persisting the output of the tool
that reads persisted outputs would be a loop. Its own bound is ``max_chars`` per call.
"""

from __future__ import annotations

import errno
import io
import math
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from pipeline.tools import Tool

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic.types import ToolParam

__all__ = [
    "READBACK_DESCRIPTION",
    "READBACK_TOOL_NAME",
    "LineReader",
    "PagedReader",
    "PersistedOutputReader",
    "ReadbackError",
]

READBACK_TOOL_NAME = "read_persisted_output"
READBACK_DESCRIPTION = (
    "Read a tool output that was too large to show in full and was saved to a "
    "file (the path after 'Full output saved to:' in a <persisted-output> block)."
)
"""The read-back tool's description, the same whichever store holds the outputs."""
DEFAULT_LIMIT_LINES = 2_000
DEFAULT_MAX_CHARS = 40_000

_CHUNK = 1 << 16
"""Bytes (or chars) read at a time while skipping or counting lines: memory stays at this size."""
_EOL = re.compile(rb"\r\n|\r|\n")
"""Line ends as the text reader sees them (``newline=""``): a line count in bytes must agree."""
_ECHO_CHARS = 200
"""At most this much of a hostile value is echoed back in an error message."""
_OPEN_FLAGS = (
    os.O_RDONLY
    # the checked path must be the file opened: no symlink swapped in at the last component ...
    | getattr(os, "O_NOFOLLOW", 0)
    # ... and a FIFO swapped in must not block the open
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


class ReadbackError(ValueError):
    """A read-back request that cannot be served; the message is safe to show the model."""


def _shown(text: str) -> str:
    """``text`` as safe to echo: ``repr`` escapes control characters and lone surrogates, and a
    long value is cut to 200 chars of that, plus its length."""
    shown = repr(text[: _ECHO_CHARS + 1])  # never copy a 100 KB value whole
    if len(shown) <= _ECHO_CHARS:
        return shown
    return f"{shown[:_ECHO_CHARS]}... ({len(text):,} chars)"


def _brief(value: object) -> str:
    """A bounded description of a tool-input value of any JSON type, for an error message."""
    if isinstance(value, str):
        return _shown(value)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        # str() of a huge int is slow, and past 4,300 digits it raises ValueError
        return f"an integer of {value.bit_length():,} bits"
    if value is None or isinstance(value, int | float):
        return repr(value)
    return f"a JSON {type(value).__name__}"


def _reason(exc: BaseException) -> str:
    """Why a path could not be used, without the path (``str(OSError)`` echoes it whole)."""
    if isinstance(exc, UnicodeError):
        return "not valid text (a lone surrogate?)"
    if isinstance(exc, OSError):
        if exc.errno == errno.ELOOP:
            return "symlink loop"
        return exc.strerror or type(exc).__name__
    if isinstance(exc, RuntimeError):  # Path.resolve before 3.13 reports a loop this way
        return "symlink loop"
    return type(exc).__name__


def _open_regular(real: Path, path: str) -> io.BufferedReader:
    """``real`` opened for reading, refused unless it is (still) a regular file."""
    fd = os.open(real, _OPEN_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ReadbackError(f"no readable file at {_shown(path)} (not a regular file)")
        return open(fd, "rb")  # the caller closes it
    except BaseException:
        os.close(fd)
        raise


def _skip_lines(raw: io.BufferedReader[Any], count: int) -> tuple[int, int]:
    """Skip ``count`` lines from the start of ``raw``.

    Returns ``(byte offset where the next line starts, lines skipped)``; fewer lines skipped
    than asked means the file ended first, and then the count is the file's line count (a last
    line without a line end counts). Reads chunk by chunk, so memory stays bounded, but the time
    grows with the bytes skipped.
    """
    pos = skipped = 0
    last = b""
    while skipped < count:
        chunk = raw.read(_CHUNK)
        if not chunk:
            return pos, skipped + (1 if last not in (b"", b"\n", b"\r") else 0)
        if chunk.endswith(b"\r") and raw.peek(1)[:1] == b"\n":
            chunk += raw.read(1)  # one '\r\n' is one line end: keep it in one chunk
        ends = chunk.count(b"\n")
        if b"\r" in chunk:  # counting '\r\n' is slow: only where there is a '\r' at all
            ends += chunk.count(b"\r") - chunk.count(b"\r\n")
        if skipped + ends >= count:
            for match in _EOL.finditer(chunk):
                skipped += 1
                if skipped == count:
                    return pos + match.end(), count
        skipped += ends
        pos += len(chunk)
        last = chunk[-1:]
    return pos, skipped


def _count_lines(text: io.TextIOWrapper) -> int:
    """Lines left in ``text`` (a last line without a line end counts), read chunk by chunk."""
    ends = 0
    last = ""
    while chunk := text.read(_CHUNK):
        ends += chunk.count("\n")
        if "\r" in chunk:
            ends += chunk.count("\r") - chunk.count("\r\n")
        if last == "\r" and chunk[0] == "\n":
            ends -= 1  # a '\r\n' split between two chunks is one line end
        last = chunk[-1]
    return ends + (1 if last not in ("", "\n", "\r") else 0)


class PagedReader:
    """What every read-back tool shares: its definition, the checks on its input, and how a
    page of lines is cut from a byte stream. A subclass says where ``path`` leads
    (:meth:`_read`).

    Never persisted (``max_result_size_chars = math.inf``); ``max_chars`` bounds one call's
    output instead. A bad request of any kind raises :class:`ReadbackError` only.
    """

    max_result_size_chars: float = math.inf

    def __init__(
        self,
        *,
        name: str,
        description: str,
        default_limit: int = DEFAULT_LIMIT_LINES,
        max_chars: int = DEFAULT_MAX_CHARS,
    ) -> None:
        if default_limit < 1 or max_chars < 1:
            raise ValueError("default_limit and max_chars must be >= 1")
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
            raise ReadbackError(f"'path' must be a non-empty string, got {_brief(path)}")
        for key, value in (("offset", offset), ("limit", limit)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ReadbackError(f"'{key}' must be an integer >= 1, got {_brief(value)}")
        return await anyio.to_thread.run_sync(self._read, path, offset, limit)

    def _read(self, path: str, offset: int, limit: int) -> str:
        """Lines ``offset``.. of what ``path`` names (blocking: runs in a worker thread)."""
        raise NotImplementedError

    def _page_at(
        self,
        raw: io.BufferedReader[Any],
        offset: int,
        limit: int,
        count_rest: Callable[[io.TextIOWrapper, int], int],
    ) -> str:
        """The page of up to ``limit`` lines from line ``offset``, ``raw`` standing at that
        line's first byte; ``count_rest(text, last)`` tells how many lines follow line ``last``
        (``text`` stands right after it)."""
        with io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="") as text:
            lines: list[str] = []
            used = 0
            cut = at_end = False
            while len(lines) < limit and used < self.max_chars:
                room = self.max_chars - used
                # one char more than fits tells a cut line from one that just fits, and
                # a 1 GB line without a line end costs no more than this
                line = text.readline(room + 1)
                if not line:
                    at_end = True
                    break
                if len(line) > room:
                    lines.append(line[:room])
                    cut = True
                    break
                lines.append(line)
                used += len(line)
            if not lines and offset > 1:
                raise self._past_end(offset, offset - 1)
            body = "".join(lines)
            last = offset + len(lines) - 1
            if cut:
                # the rest of a long line is never read, so the total is not counted
                return (
                    body + f"\n[output cut at {self.max_chars} chars within line {last}; "
                    f"the rest of that line is not shown; next: offset={last + 1}]"
                )
            rest = 0 if at_end else count_rest(text, last)
        if rest:
            return body + f"\n[lines {offset}-{last} of {last + rest}; next: offset={last + 1}]"
        return body

    def _page_file(self, real: Path, path: str, offset: int, limit: int) -> str:
        """The page of a local file ``real`` (named ``path`` to the model)."""
        with _open_regular(real, path) as raw:
            start, skipped = _skip_lines(raw, offset - 1)
            if skipped < offset - 1:
                raise self._past_end(offset, skipped)
            raw.seek(start)
            return self._page_at(raw, offset, limit, lambda text, _last: _count_lines(text))

    @staticmethod
    def _past_end(offset: int, total: int) -> ReadbackError:
        return ReadbackError(f"offset {_brief(offset)} is past the end ({total} lines)")


class LineReader(PagedReader):
    """A file-reading tool confined to some directories: definition + async handler.

    Reads ``limit`` lines from line ``offset`` (1-based) of a file under one of ``roots``
    (symlinks are resolved first, so a link cannot lead outside). Never persisted
    (``max_result_size_chars = math.inf``); ``max_chars`` bounds one call's output instead.

    Memory stays bounded whatever the file: a line is read only up to what is left of
    ``max_chars`` (a longer line is cut, and the page says so), and lines are skipped and
    counted in fixed-size chunks. Time is not bounded the same way: an ``offset`` far into a
    huge file costs a scan up to it, and a page that does not reach the end scans the rest of
    the file to count its lines. A bad request of any kind raises :class:`ReadbackError` only.
    """

    def __init__(
        self,
        roots: list[Path],
        *,
        name: str,
        description: str,
        default_limit: int = DEFAULT_LIMIT_LINES,
        max_chars: int = DEFAULT_MAX_CHARS,
    ) -> None:
        if not roots:
            raise ValueError("LineReader needs at least one root directory")
        super().__init__(
            name=name, description=description, default_limit=default_limit, max_chars=max_chars
        )
        self.roots = [Path(r) for r in roots]

    def resolve(self, path: str) -> Path:
        """The real file ``path`` names, refused unless it lies inside one of the roots.

        A relative path is taken relative to the first root. Raises :class:`ReadbackError`
        only, with the path echoed in a bounded form.
        """
        if "\x00" in path:
            raise ReadbackError("path contains a NUL character")
        try:
            os.fsencode(path)  # a lone surrogate (from a JSON escape) names no file
            bases = [r.resolve() for r in self.roots]
            candidate = Path(path)
            if not candidate.is_absolute():
                candidate = bases[0] / candidate
            real = candidate.resolve()
            inside = any(real.is_relative_to(b) for b in bases) and real.is_file()
        except (OSError, RuntimeError, ValueError) as exc:
            raise ReadbackError(f"cannot use the path {_shown(path)}: {_reason(exc)}") from exc
        if not inside:
            raise ReadbackError(
                f"no readable file at {_shown(path)} (only files under the allowed directories)"
            )
        return real

    def _read(self, path: str, offset: int, limit: int) -> str:
        try:
            return self._page(self.resolve(path), path, offset, limit)
        except ReadbackError:
            raise
        except (OSError, RuntimeError, ValueError) as exc:  # e.g. EACCES, EIO, or a race
            raise ReadbackError(f"cannot read {_shown(path)}: {_reason(exc)}") from exc

    def _page(self, real: Path, path: str, offset: int, limit: int) -> str:
        return self._page_file(real, path, offset, limit)


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
            description=READBACK_DESCRIPTION,
            default_limit=default_limit,
            max_chars=max_chars,
        )
        self.directory = Path(directory)
