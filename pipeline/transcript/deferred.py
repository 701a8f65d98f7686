"""Tool outputs left in the transcript file until a replay reaches them: the loader's side
(:class:`Deferral`; the handle is :class:`~pipeline.wire.deferred.DeferredText`).

A long session's tool outputs are most of its transcript, and a replay needs each only while
a request can carry it: from the call that first sees it to the call whose request clears
it, previews it or drops it. ``load_transcript(path, defer_texts=N)`` keeps, in place of
every tool_result output of at least ``N`` characters, a handle naming where its line lies in
the file; :func:`~pipeline.wire.deferred.fill` reads it back into its block, and
:func:`~pipeline.wire.deferred.defer` puts the handle back
once nothing will read the output again. The replay does both
(:func:`~pipeline.transcript.replay.replay_messages` with ``release=True``), so it holds the
outputs a request can carry, not the whole session's.

A line that no longer holds the output its handle names (the file rewritten meanwhile) is
:class:`~pipeline.wire.deferred.TranscriptChanged`, never another output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.wire.deferred import DeferredText, TextSource, crc32_of

__all__ = ["DEFER_AT", "Deferral", "read_deferred"]

DEFER_AT = 1024
"""Characters from which the ``replay`` command leaves an output in the file: the outputs
this long are most of a session's text, and fewer handles mean fewer reads."""


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
                    crc32_of(text),
                )
                self.count += 1


def read_deferred(value: Any) -> Any:
    """``json.dumps``' ``default`` for records that hold deferred outputs: the output."""
    if type(value) is DeferredText:
        return value.read()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
