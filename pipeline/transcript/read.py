"""Read session transcripts in Claude Code's JSONL format (appending them is
:mod:`pipeline.transcript.writer`, whose names are re-exported here).

Reading keeps what the API saw (``message.content``) and drops what it did not (the structured
``toolUseResult``, progress payloads, file-history snapshots). Older Claude Code files interleave
sub-agent records (``isSidechain: true``) with the main thread; a sub-agent's own file holds only
sidechain records. The loaded thread is the non-sidechain records where there are any, else all.
"""

from __future__ import annotations

import io
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.messages import Message
from pipeline.replacement import ReplacementRecord
from pipeline.tokens.checks import bounded_text
from pipeline.transcript.deferred import Deferral
from pipeline.transcript.recorded import (
    API_REQUEST,
    API_REQUEST_BLOB,
    API_REQUEST_SHAPE,
    IGNORED_RECORD_TYPES,
    RecordedRequest,
    WireCheck,
    apply_recorded_wire,
    parse_blob,
    parse_request,
    parse_shape,
)
from pipeline.transcript.records import (
    MAX_NESTING,
    check_depth,
    parse_message,
    replacement_entry,
    same_record,
)
from pipeline.transcript.writer import (
    BOM,
    CONTENT_REPLACEMENT,
    STAGE_RECORD,
    JsonlRecordWriter,
    TranscriptPathError,
    TranscriptWriter,
    encode_records,
    message_to_record,
)
from pipeline.wire.deferred import deferred_in, fill

__all__ = [
    "MAX_NESTING",
    "JsonlRecordWriter",
    "LineProblem",
    "StageRecord",
    "Transcript",
    "TranscriptError",
    "TranscriptPathError",
    "TranscriptWriter",
    "encode_records",
    "jsonl_lines",
    "load_transcript",
    "load_transcript_lines",
    "message_to_record",
]

_MESSAGE_RECORD_TYPES = frozenset({"user", "assistant", "progress", "attachment", "system"})
_MAX_REASON = 300
"""Longest reason a malformed line reports: values are quoted at most ~80 characters each, and
this caps whatever else an error might carry (a hostile line must not print megabytes)."""


@dataclass(frozen=True, slots=True)
class StageRecord:
    """A decision a stage wrote to the transcript so that a resumed session can repeat it."""

    stage: str
    data: Mapping[str, Any]


class TranscriptError(ValueError):
    """A transcript line that cannot be read; names the file and the 1-based line number."""

    def __init__(self, path: Path | str, line: int, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        super().__init__(f"{path}:{line}: {reason}")


@dataclass(frozen=True, slots=True)
class LineProblem:
    """A line skipped by a non-strict load."""

    line: int
    reason: str


@dataclass(slots=True)
class Transcript:
    """A loaded session: the thread's messages, replacement records and what was skipped."""

    path: Path
    messages: list[Message]
    replacement_records: list[ReplacementRecord] = field(default_factory=list)
    session_id: str | None = None
    skipped_types: Counter[str] = field(default_factory=Counter)
    """Records not part of the prompt or of an unknown type, by type (never fatal)."""
    requests: list[RecordedRequest] = field(default_factory=list)
    """What each call sent besides its messages (Claude Code 2.1's ``api-request`` records):
    model, system prompt, tools; in file order."""
    version: str | None = None
    """The Claude Code version that wrote the first record naming one (``"2.1.328"``...)."""
    wire_check: WireCheck = field(default_factory=WireCheck)
    """How the records compared with what each call recorded sending (Claude Code 2.1): how
    many recorded messages replaced records that did not render to them, and how many calls
    could not be made exact (:func:`pipeline.transcript.recorded.apply_recorded_wire`)."""
    sidechain_skipped: int = 0
    """Sub-agent records interleaved with the main thread and left out of it."""
    problems: list[LineProblem] = field(default_factory=list)
    """Malformed lines skipped by a ``strict=False`` load."""
    repeated: list[LineProblem] = field(default_factory=list)
    """Message records written twice (a line repeated exactly, its uuid and all), each read
    once. Never fatal."""
    out_of_order: list[LineProblem] = field(default_factory=list)
    """Message records whose ``parentUuid`` names a record further down the file (lines
    moved by hand, say): read where they stand, and listed. Never fatal."""
    stage_records: list[StageRecord] = field(default_factory=list)
    """``stage-record`` entries in file order (:meth:`TranscriptWriter.append_stage_record`)."""
    deferred_texts: int = 0
    """Tool outputs left in the file (``load_transcript(defer_texts=...)``), each a
    :class:`~pipeline.wire.deferred.DeferredText` in its block."""

    def records_for(self, stage: str) -> list[Mapping[str, Any]]:
        """The data of every record stage ``stage`` wrote, in order."""
        return [r.data for r in self.stage_records if r.stage == stage]

    @property
    def unknown_types(self) -> Counter[str]:
        """Skipped records of a type the loader does not know (a newer format, say)."""
        known = IGNORED_RECORD_TYPES | {API_REQUEST, API_REQUEST_SHAPE, API_REQUEST_BLOB}
        return Counter({t: n for t, n in self.skipped_types.items() if t not in known})


def load_transcript(
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    recorded_wire: bool = True,
    defer_texts: int | None = None,
) -> Transcript:
    """Read a Claude Code session JSONL file.

    A malformed line raises :class:`TranscriptError` naming the file and line; with
    ``strict=False`` it is skipped and listed in ``Transcript.problems`` instead. Unknown record
    types are skipped and counted in ``Transcript.skipped_types``, never fatal.

    Claude Code 2.1 records what each call sent: ``api-request`` records become
    ``Transcript.requests``; with ``recorded_wire`` (default) a user message whose records do
    not render to what the call recorded sending (its ``api-request`` chain and
    ``api-request-blob`` records) is replaced by the recorded messages, so that
    :func:`~pipeline.wire.form.to_api` rebuilds exactly what was sent (``Transcript.wire_check``).

    ``defer_texts``: every tool_result text output of at least this many characters is left
    in the file, its block holding a :class:`~pipeline.wire.deferred.DeferredText`
    instead (for a replay that reads each while a request can carry it:
    :mod:`pipeline.transcript.deferred`). Not with recorded requests, which are checked
    against the records' text: those are read whole.
    """
    p = Path(path)
    if defer_texts is not None:
        deferral = Deferral(p, defer_texts)
        with p.open("rb") as raw:
            return load_transcript_lines(
                deferral.lines(raw),
                p,
                strict=strict,
                recorded_wire=recorded_wire,
                _deferral=deferral,
            )
    # JSONL lines end at "\n" only: a bare "\r" is JSON whitespace inside a record
    with p.open("r", encoding="utf-8", errors="surrogateescape", newline="\n") as fh:
        return load_transcript_lines(fh, p, strict=strict, recorded_wire=recorded_wire)


def jsonl_lines(text: str) -> Iterator[str]:
    """The lines of JSONL ``text`` as a file read with ``newline="\n"`` gives them: split at
    ``"\n"`` only, each with its line end (``str.splitlines`` would also split at ``"\r"``,
    ``"\u2028"`` and others, which are whitespace or string content inside a record)."""
    return iter(io.StringIO(text, newline="\n"))


def load_transcript_lines(
    lines: Iterable[str],
    name: str | os.PathLike[str],
    *,
    strict: bool = True,
    recorded_wire: bool = True,
    _deferral: Deferral | None = None,
) -> Transcript:
    """:func:`load_transcript` on lines already read: ``lines`` as iterating a file opened
    with ``newline="\n"`` yields them (see :func:`jsonl_lines`); ``name`` is what
    ``Transcript.path`` and a :class:`TranscriptError` call the source. Same rules, same
    errors as reading a file."""
    p = Path(name)
    main: list[Message] = []
    side: list[Message] = []
    records: list[ReplacementRecord] = []
    result = Transcript(path=p, messages=main)
    shapes: dict[str, Mapping[str, Any]] = {}
    requests: list[tuple[int, int, int, Mapping[str, Any]]] = []
    blobs: list[tuple[int, int, int, Mapping[str, Any]]] = []
    seen: set[str] = set()
    """Every message record's uuid (the records' own strings)."""
    first: dict[str, Message] | None = None
    """The first record of each uuid, made when a uuid first comes again (rare)."""
    ahead: list[tuple[int, str]] = []
    """(line, parentUuid) of each message record whose parent was not read before it."""
    for lineno, line in enumerate(lines, start=1):
        if lineno == 1 and line.startswith(BOM):
            line = line[1:]  # a byte order mark some editors write: only at the file's start
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            if not isinstance(raw, dict):
                raise ValueError("a record must be a JSON object")
            rtype = raw.get("type")
            if not isinstance(rtype, str):
                raise ValueError("record without a string 'type'")
            check_depth(raw, line)
            if rtype == CONTENT_REPLACEMENT:
                reps = raw.get("replacements")
                if not isinstance(reps, list):
                    raise ValueError("content-replacement without a 'replacements' list")
                parsed = [replacement_entry(rep) for rep in reps]  # all or none
                records.extend(parsed)
            elif rtype == STAGE_RECORD:
                stage, data = raw.get("stage"), raw.get("data")
                if not isinstance(stage, str) or not isinstance(data, dict):
                    raise ValueError("stage-record needs a string 'stage' and an object 'data'")
                result.stage_records.append(StageRecord(stage, data))
            elif rtype == API_REQUEST_SHAPE:
                digest, shape = parse_shape(raw)
                shapes[digest] = shape
                result.skipped_types[rtype] += 1
            elif rtype in (API_REQUEST, API_REQUEST_BLOB):
                parse_request(raw, shapes, 0) if rtype == API_REQUEST else parse_blob(raw, 0)
                (requests if rtype == API_REQUEST else blobs).append(
                    (len(main), len(side), lineno, raw)
                )
                result.skipped_types[rtype] += 1
            elif rtype not in _MESSAGE_RECORD_TYPES:
                result.skipped_types[rtype] += 1
            else:
                msg = parse_message(raw)
                if msg.uuid in seen:
                    if first is None:
                        first = {}
                        for m in (*main, *side):
                            first.setdefault(m.uuid, m)
                    if same_record(first[msg.uuid], msg):
                        # the same record written twice (a line repeated): read once
                        again = "repeats an earlier record: read once"
                        result.repeated.append(LineProblem(lineno, again))
                        continue
                else:
                    seen.add(msg.uuid)
                    if first is not None:
                        first[msg.uuid] = msg
                parent = raw.get("parentUuid")
                if isinstance(parent, str) and parent not in seen:
                    ahead.append((lineno, parent))
                if _deferral is not None and msg.type == "user":
                    _deferral.defer_outputs(msg.content)
                (side if msg.is_sidechain else main).append(msg)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            reason = f"malformed record: {bounded_text(str(exc), _MAX_REASON)}"
            if strict:
                raise TranscriptError(p, lineno, reason) from None
            result.problems.append(LineProblem(lineno, reason))
            continue
        # only a record that loaded names the session (a skipped line decides nothing)
        if result.session_id is None and isinstance(raw.get("sessionId"), str):
            result.session_id = raw["sessionId"]
        if result.version is None and isinstance(raw.get("version"), str):
            result.version = raw["version"][:40]
    result.out_of_order = [
        LineProblem(lineno, "its parent record comes later in the file: read where it stands")
        for lineno, parent in ahead
        if parent in seen
    ]
    on_side = not main and bool(side)
    if on_side:
        result.messages = side
    else:
        result.sidechain_skipped = len(side)
    result.replacement_records = records
    result.requests = [
        parse_request(raw, shapes, at_side if on_side else at_main, lineno)
        for at_main, at_side, lineno, raw in requests
    ]
    if _deferral is not None and _deferral.count:
        if recorded_wire and (blobs or result.requests):  # compared as text: read them back
            for m in (*main, *side):
                for b in deferred_in(m.content):
                    fill(b)
        else:
            result.deferred_texts = _deferral.count
    if recorded_wire and (blobs or result.requests):
        result.messages, result.requests, result.wire_check = apply_recorded_wire(
            result.messages,
            result.requests,
            [
                parse_blob(raw, at_side if on_side else at_main, lineno)
                for at_main, at_side, lineno, raw in blobs
            ],
        )
    return result
