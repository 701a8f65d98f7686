"""Session transcripts in Claude Code's JSONL format, and replaying them.

- :mod:`.read`: :func:`load_transcript`, a transcript read back (messages, replacement and
  stage records, what it holds of each API call);
- :mod:`.writer`: :class:`TranscriptWriter`, appending to one;
- :mod:`.recorded`: what a Claude Code 2.1 transcript records about each API call;
- :mod:`.replay`: a recorded session run through a pipeline call by call.
"""

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
