"""A tool output left in the bytes it came in (:class:`DeferredText`), read back where it is
needed.

A replay that holds only the outputs its requests carry leaves the others in the transcript
file (:mod:`pipeline.transcript.deferred`); the proxy leaves a held conversation's long
outputs in the request that carries them again (:mod:`pipeline.wire.held_outputs`). A block
whose ``content`` is a :class:`DeferredText` holds the handle instead of the text.
:func:`resolved` gives a content's text wherever a reader may meet a handle (pricing,
classifying, digesting, encoding an output): such a read costs a parse of its record, never a
wrong answer. Bytes that no longer hold the output a handle names are the source's error
(:class:`TranscriptChanged` for a file), never another output.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "OUTPUT",
    "DeferredSource",
    "DeferredText",
    "TextSource",
    "TranscriptChanged",
    "crc32_of",
    "defer",
    "deferred_in",
    "fill",
    "resolved",
    "text_or",
]


class TranscriptChanged(ValueError):
    """A deferred output's line no longer holds it: the transcript changed after loading."""


class DeferredSource(Protocol):
    """Where deferred outputs lie: the bytes of the record that holds one, parsed."""

    def message(self, offset: int, length: int) -> Any:
        """The message (``{"role", "content"}``) in the ``length`` bytes at ``offset``;
        ``OSError`` when they cannot be read, ``ValueError`` when they are not one."""
        ...

    def unreadable(self, handle: DeferredText, why: str | None) -> ValueError:
        """The error for ``handle``'s output: it cannot be read (``why``: the reason) or is
        no longer where the handle says (None)."""
        ...


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

    def message(self, offset: int, length: int) -> Any:
        """The message of the transcript record on the line at ``offset``."""
        data = self.read(offset, length)
        return json.loads(data.decode("utf-8", "surrogateescape"))["message"]

    def unreadable(self, handle: DeferredText, why: str | None) -> ValueError:
        """:class:`TranscriptChanged`, naming the file."""
        name = repr(handle.tool_use_id[:64])
        if why is not None:
            return TranscriptChanged(
                f"{self.path}: the output of {name} cannot be read again: {why}"
            )
        return TranscriptChanged(
            f"{self.path}: the output of {name} is no longer at byte {handle.offset}: the "
            "transcript changed after it was loaded"
        )

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


_BITS = 48
_LIMIT = 1 << _BITS
"""Offsets, lengths and sizes a handle holds: below 256 TiB."""
_MASK = _LIMIT - 1

OUTPUT = ("content",)
"""The path of a tool_result's output in its block."""
_ID_KEYS = {"content": "tool_use_id", "input": "id"}
"""The key of the id a held text's block is checked by, by its path's first step."""


class DeferredText:
    """Where a text lies: at ``path`` in the ``block``-th block of the message in the
    ``length`` bytes at ``offset`` of ``source`` (a transcript's line, a request's message) --
    a tool_result's output (:data:`OUTPUT`), or, in a request, a tool call's input value, a
    text, a thinking block's text or signature, an image's data. ``tool_use_id``: the id of
    that block's tool call or result ("" for a block without one); the text is ``chars``
    characters long, and ``crc`` is the CRC-32 of its UTF-8 bytes (another text of the same
    length is caught). ``str()`` reads it. Not a dataclass: an encoder that writes dataclasses
    as objects (msgspec) must hand it to its hook (:func:`text_or`) instead."""

    __slots__ = ("_where", "block", "path", "source", "tool_use_id")

    def __init__(
        self,
        source: DeferredSource,
        offset: int,
        length: int,
        block: int,
        tool_use_id: str,
        chars: int,
        crc: int,
        path: tuple[str, ...] = OUTPUT,
    ) -> None:
        if not (0 <= offset < _LIMIT and 0 <= length < _LIMIT and 0 <= chars < _LIMIT):
            raise ValueError(f"a deferred text's offset, length and size are below {_LIMIT}")
        if not 0 <= crc < 1 << 32:
            raise ValueError("a deferred text's crc is a CRC-32")
        self.source = source
        # one int for four (each its own int object beside the handle: ~100 bytes more for
        # every text a held conversation or a replay leaves in its bytes)
        self._where = offset | length << _BITS | chars << 2 * _BITS | crc << 3 * _BITS
        self.block = block
        self.tool_use_id = tool_use_id
        self.path = path

    @property
    def offset(self) -> int:
        """Where its bytes start in its source."""
        return self._where & _MASK

    @property
    def length(self) -> int:
        """How many bytes they are."""
        return self._where >> _BITS & _MASK

    @property
    def chars(self) -> int:
        """The text's length in characters."""
        return self._where >> 2 * _BITS & _MASK

    @property
    def crc(self) -> int:
        """The CRC-32 of the text's UTF-8 bytes."""
        return self._where >> 3 * _BITS

    def _key(self) -> tuple[Any, ...]:
        return (self.source, self._where, self.block, self.tool_use_id, self.path)

    def __eq__(self, other: object) -> bool:
        # (a request's parsed messages are compared by value: equal handles, equal outputs)
        if type(other) is not DeferredText:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"DeferredText({self.tool_use_id[:64]!r}, {'.'.join(self.path)[:64]}, "
            f"{self.chars} chars at {self.offset})"
        )

    def __str__(self) -> str:
        # a reader that takes any value as text (str(value or "")) gets the text, not a repr
        return self.read()

    def read(self) -> str:
        """The text, read from its bytes again; the source's error
        (:meth:`DeferredSource.unreadable`) when they no longer hold it."""
        try:
            message = self.source.message(self.offset, self.length)
        except OSError as exc:
            raise self.source.unreadable(self, exc.strerror or str(exc)) from exc
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise self.source.unreadable(self, None) from exc
        try:
            block = message["content"][self.block]
            # a tool call's id for its input, a result's for its output (none for the rest)
            ident = block.get(_ID_KEYS[self.path[0]]) if self.tool_use_id else ""
            text = block
            for step in self.path:
                text = text[step]
            if (
                not isinstance(text, str)
                or ident != self.tool_use_id
                or len(text) != self.chars
                or crc32_of(text) != self.crc
            ):
                raise ValueError("another text")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise self.source.unreadable(self, None) from exc
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
    """``content``, its text read back from its bytes when it is a :class:`DeferredText`."""
    return content.read() if type(content) is DeferredText else content


def text_or(fallback: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """An encoder's hook (``json``'s ``default``, msgspec's ``enc_hook``) that writes a
    :class:`DeferredText` as its text and anything else as ``fallback`` does (None: refused
    with ``TypeError``, as the encoders refuse what they cannot write)."""

    def hook(value: Any) -> Any:
        if type(value) is DeferredText:
            return value.read()
        if fallback is None:
            raise TypeError(f"{type(value).__name__} is not JSON")
        return fallback(value)

    return hook
