"""Tool outputs left in the transcript file until a replay reaches them (:class:`DeferredText`).

A long session's tool outputs are most of its transcript, and a replay needs each only while
a request can carry it: from the call that first sees it to the call whose request clears
it, previews it or drops it. ``load_transcript(path, defer_texts=N)`` keeps, in place of
every tool_result output of at least ``N`` characters, a handle naming where its line lies in
the file; :func:`fill` reads it back into its block, and :func:`defer` puts the handle back
once nothing will read the output again. The replay does both
(:func:`~pipeline.transcript.replay.replay_messages` with ``release=True``), so it holds the
outputs a request can carry, not the whole session's.

A line that no longer holds the output its handle names (the file rewritten meanwhile) is
:class:`TranscriptChanged`, never another output.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFER_AT", "DeferredText", "TextSource", "TranscriptChanged", "defer", "fill"]

DEFER_AT = 1024
"""Characters from which the ``replay`` command leaves an output in the file: the outputs
this long are most of a session's text, and fewer handles mean fewer reads."""


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

    def close(self) -> None:
        """Close the file (a later read opens it again)."""
        with self._opening:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

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
                or _crc(text) != self.crc
            ):
                raise ValueError("another output")
        except (ValueError, KeyError, IndexError, TypeError, RecursionError) as exc:
            raise TranscriptChanged(
                f"{self.source.path}: the output of {self.tool_use_id[:64]!r} is no longer at "
                f"byte {self.offset}: the transcript changed after it was loaded"
            ) from exc
        return text


def _crc(text: str) -> int:
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


_BOM = b"\xef\xbb\xbf"


class Deferral:
    """The loader's side: the lines of a file as text, each one's place noted, and the large
    outputs of the records read from it deferred (:func:`defer_outputs`)."""

    def __init__(self, path: Path, least: int) -> None:
        if least < 1:
            raise ValueError(f"defer_texts must be at least 1 character, got {least}")
        self.source = TextSource(path)
        self.least = least
        self.count = 0
        """Outputs deferred."""
        self._offset = 0
        self._length = 0

    def lines(self, fh: Any) -> Any:
        """The lines of binary file ``fh`` as text (as a file opened with ``newline="\\n"``
        and ``errors="surrogateescape"`` gives them, a leading byte order mark dropped)."""
        offset = 0
        for raw in fh:
            self._offset, self._length = offset, len(raw)
            offset += len(raw)
            if self._offset == 0 and raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
                self._offset, self._length = len(_BOM), len(raw)
            yield raw.decode("utf-8", "surrogateescape")

    def defer_outputs(self, content: Any) -> None:
        """Defer the large text outputs among the blocks of the user record just read."""
        if not isinstance(content, list):
            return
        for k, b in enumerate(content):
            if b.get("type") != "tool_result":
                continue
            text = b.get("content")
            if isinstance(text, str) and len(text) >= self.least:
                b["content"] = DeferredText(
                    self.source,
                    self._offset,
                    self._length,
                    k,
                    b["tool_use_id"],
                    len(text),
                    _crc(text),
                )
                self.count += 1


def read_deferred(value: Any) -> Any:
    """``json.dumps``' ``default`` for records that hold deferred outputs: the output."""
    if type(value) is DeferredText:
        return value.read()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
