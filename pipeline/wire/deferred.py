"""A tool output left in its transcript file (:class:`DeferredText`), read back where it is
needed.

A replay that holds only the outputs its requests carry leaves the others in the file
(:mod:`pipeline.transcript.deferred`); a block whose ``content`` is a :class:`DeferredText`
holds the handle instead of the text. :func:`resolved` gives a content's text wherever a
reader may meet a handle (pricing, classifying, digesting an output): such a read costs a
read of its line, never a wrong answer. A line that no longer holds the output its handle
names (the file rewritten meanwhile) is :class:`TranscriptChanged`, never another output.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DeferredText",
    "TextSource",
    "TranscriptChanged",
    "crc32_of",
    "defer",
    "deferred_in",
    "fill",
    "resolved",
]


class TranscriptChanged(ValueError):
    """A deferred output's line no longer holds it: the transcript changed after loading."""


class TextSource:
    """The transcript file deferred outputs are read back from (opened at the first read,
    read with ``pread``: safe from any thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._opening = threading.Lock()

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (fewer: the file was cut)."""
        with self._opening:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            fd = self._fd
        return os.pread(fd, length, offset)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class DeferredText:
    """Where a tool_result's output lies: the ``block``-th block of the user record on the
    line of ``length`` bytes at ``offset``; the output is ``chars`` characters long, and
    ``crc`` is the CRC-32 of its UTF-8 bytes (another output of the same length is caught)."""

    source: TextSource
    offset: int
    length: int
    block: int
    tool_use_id: str
    chars: int
    crc: int

    def read(self) -> str:
        """The output, read from the file again; :class:`TranscriptChanged` when the line no
        longer holds it."""
        try:
            data = self.source.read(self.offset, self.length)
        except OSError as exc:
            raise TranscriptChanged(
                f"{self.source.path}: the output of {self.tool_use_id[:64]!r} cannot be read "
                f"again: {exc.strerror or exc}"
            ) from exc
        try:
            raw = json.loads(data.decode("utf-8", "surrogateescape"))
            block = raw["message"]["content"][self.block]
            text = block["content"]
            if (
                not isinstance(text, str)
                or block["tool_use_id"] != self.tool_use_id
                or len(text) != self.chars
                or crc32_of(text) != self.crc
            ):
                raise ValueError("another output")
        except (ValueError, KeyError, IndexError, TypeError, RecursionError) as exc:
            raise TranscriptChanged(
                f"{self.source.path}: the output of {self.tool_use_id[:64]!r} is no longer at "
                f"byte {self.offset}: the transcript changed after it was loaded"
            ) from exc
        return text


def crc32_of(text: str) -> int:
    """The CRC-32 of ``text``'s UTF-8 bytes (a lone surrogate as itself)."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def fill(block: dict[str, Any]) -> DeferredText | None:
    """Read ``block``'s deferred output back into it, in place; its handle (None: nothing was
    deferred)."""
    handle = block.get("content")
    if type(handle) is not DeferredText:
        return None
    block["content"] = handle.read()
    return handle


def defer(block: dict[str, Any], handle: DeferredText) -> None:
    """Put ``handle`` back in place of ``block``'s output, letting go of the text."""
    block["content"] = handle


def deferred_in(content: Any) -> list[dict[str, Any]]:
    """The blocks of a record's ``content`` whose output is deferred."""
    if not isinstance(content, list):
        return []
    return [b for b in content if type(b) is dict and type(b.get("content")) is DeferredText]


def resolved(content: Any) -> Any:
    """``content``, its text read back from the file when it is a :class:`DeferredText`."""
    return content.read() if type(content) is DeferredText else content
