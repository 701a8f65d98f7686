"""The request a conversation's messages came in, as a body writer takes bytes from it
(:class:`Source`; see :mod:`pipeline.wire.body_writer`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.wire.encoding import spaced_encode

__all__ = ["Source"]


_SPACED_KEY = b'": '
"""What follows the first key of a message Python's ``json.dumps`` writes (within
:data:`_SPACED_LOOK` bytes of its start: ``{"role": ``, ``{"content": ``)."""
_SPACED_LOOK = 40


@dataclass(frozen=True, slots=True)
class Source:
    """The request body a conversation's messages came in, as the body reader took it apart
    (:meth:`~pipeline.wire.body_reader.BodyReader.read_source_async`): its bytes, where its
    messages array's content starts, where each message ends, and the message objects parsed
    from it (the reader hands the same object again only for bytes it found the same, at the
    same place)."""

    raw: bytes
    array_open: int
    ends: Sequence[int]
    messages: Sequence[Any]
    """The request's parsed messages: the reader's own list, which no one changes (the writer
    keeps it as it is, to tell the next body's messages taken from the same bytes)."""

    def same_bytes(self, i: int, piece: bytes, message: Any) -> bool:
        """Whether message ``i`` is ``piece`` in ``raw`` (``message`` written as this writer
        writes it), or ``message`` as Python's ``json.dumps`` writes it by default, after a
        ``,`` or a ``,`` and a space (the first: right after the ``[``): what lets a written
        body take those bytes from ``raw``."""
        if i >= len(self.ends) or i >= len(self.messages):
            return False
        end, start = self.ends[i], self.start(i)
        if i and self.raw[self.ends[i - 1] : self.ends[i - 1] + 1] != b",":
            return False
        if end - start == len(piece) and self.raw.startswith(piece, start):
            return True
        # one encoding more, only where the request looks spaced and only of the message
        # parsed there (or its equal: a string content's message is made anew), never a
        # stage's (whose held texts it would read again)
        if (
            not self.raw.startswith(b'{"', start)  # (indented JSON opens on a new line)
            or self.raw.find(_SPACED_KEY, start, min(end, start + _SPACED_LOOK)) < 0
        ):
            return False
        given = memoryview(self.raw)[start:end]
        try:
            if message is not self.messages[i] and message != self.messages[i]:
                return False
            spaced = spaced_encode(message, ascii_only=bytes(given).isascii())
        except (TypeError, ValueError, OverflowError, RecursionError):
            return False
        return given == spaced

    def start(self, i: int) -> int:
        """Where message ``i`` begins: past the ``,`` after the one before it, and a space
        there."""
        if not i:
            return self.array_open
        at = self.ends[i - 1] + 1
        return at + 1 if self.raw[at : at + 1] == b" " else at
