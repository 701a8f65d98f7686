"""Session transcripts in Claude Code's JSONL format, and replaying them.

- :mod:`.read`: :func:`load_transcript`, a transcript read back (messages, replacement and
  stage records, what it holds of each API call);
- :mod:`.writer`: :class:`TranscriptWriter`, appending to one;
- :mod:`.recorded`: what a Claude Code 2.1 transcript records about each API call;
- :mod:`.replay`: a recorded session run through a pipeline call by call.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.transcript.read import StageRecord, Transcript, TranscriptError, load_transcript
    from pipeline.transcript.writer import TranscriptPathError, TranscriptWriter

__all__ = [
    "StageRecord",
    "Transcript",
    "TranscriptError",
    "TranscriptPathError",
    "TranscriptWriter",
    "load_transcript",
]

_HOME = {
    "StageRecord": "pipeline.transcript.read",
    "Transcript": "pipeline.transcript.read",
    "TranscriptError": "pipeline.transcript.read",
    "TranscriptPathError": "pipeline.transcript.writer",
    "TranscriptWriter": "pipeline.transcript.writer",
    "load_transcript": "pipeline.transcript.read",
}


def __getattr__(name: str) -> Any:
    # imported on first use: a module of this package never loads the others with it
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
