"""Read and append session transcripts in Claude Code's JSONL format.

Reading keeps what the API saw (``message.content``) and drops what it did not (the structured
``toolUseResult``, progress payloads, file-history snapshots). Older Claude Code files interleave
sub-agent records (``isSidechain: true``) with the main thread; a sub-agent's own file holds only
sidechain records. The loaded thread is the non-sidechain records where there are any, else all.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import stat
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.messages import (
    REMINDER,
    Block,
    Content,
    Message,
    Usage,
    new_uuid,
    now_timestamp,
)
from pipeline.recorded import (
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
from pipeline.replacement import ReplacementRecord
from pipeline.tokens.checks import bounded_repr, bounded_text

__all__ = [
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
CONTENT_REPLACEMENT = "content-replacement"
STAGE_RECORD = "stage-record"
_BOM = "\ufeff"
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
    could not be made exact (:func:`pipeline.recorded.apply_recorded_wire`)."""
    sidechain_skipped: int = 0
    """Sub-agent records interleaved with the main thread and left out of it."""
    problems: list[LineProblem] = field(default_factory=list)
    """Malformed lines skipped by a ``strict=False`` load."""
    stage_records: list[StageRecord] = field(default_factory=list)
    """``stage-record`` entries in file order (:meth:`TranscriptWriter.append_stage_record`)."""

    def records_for(self, stage: str) -> list[Mapping[str, Any]]:
        """The data of every record stage ``stage`` wrote, in order."""
        return [r.data for r in self.stage_records if r.stage == stage]

    @property
    def unknown_types(self) -> Counter[str]:
        """Skipped records of a type the loader does not know (a newer format, say)."""
        known = IGNORED_RECORD_TYPES | {API_REQUEST, API_REQUEST_SHAPE, API_REQUEST_BLOB}
        return Counter({t: n for t, n in self.skipped_types.items() if t not in known})


def _require_str(raw: Mapping[str, Any], key: str, *, optional: bool = True) -> str | None:
    value = raw.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {type(value).__name__}")
    return value


def _parse_blocks(content: Any, where: str) -> Content:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of blocks")
    blocks: list[Block] = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ValueError(f"{where}[{i}] is not a content block with a string 'type'")
        btype = block["type"]
        if btype == "tool_use":
            if not isinstance(block.get("id"), str):
                raise ValueError(f"{where}[{i}]: tool_use without a string 'id'")
            if isinstance(block.get("input"), dict):
                block["input"] = _shared_keys(block["input"])
        if btype == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise ValueError(f"{where}[{i}]: tool_result without a string 'tool_use_id'")
            inner = block.get("content")
            if inner is not None and not isinstance(inner, str | list):
                raise ValueError(f"{where}[{i}]: tool_result content must be a string or a list")
            if isinstance(inner, list):
                if not all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in inner):
                    raise ValueError(f"{where}[{i}]: tool_result content holds a non-block")
                block["content"] = [_shared_keys(b) for b in inner]
        blocks.append(_shared_keys(block))
    return blocks


def _shared_keys(block: dict[str, Any]) -> dict[str, Any]:
    """The block with its keys interned: the JSON decoder makes new key strings for every line,
    so a long session held one copy of ``"tool_use_id"`` and friends per block (about a tenth
    of the transcript's size in memory)."""
    return {sys.intern(k): v for k, v in block.items()}


def _parse_message(raw: Mapping[str, Any]) -> Message:
    rtype = raw["type"]
    common: dict[str, Any] = {
        "uuid": _require_str(raw, "uuid") or new_uuid(),
        "timestamp": _require_str(raw, "timestamp"),
        "is_sidechain": bool(raw.get("isSidechain", False)),
        "is_meta": bool(raw.get("isMeta", False)),
    }
    if rtype in ("user", "assistant"):
        body = raw.get("message")
        if not isinstance(body, Mapping):
            raise ValueError(f"{rtype} record without a 'message' object")
        content = _parse_blocks(body.get("content"), "message.content")
        if rtype == "user":
            return Message(
                type="user",
                content=content,
                is_compact_summary=bool(raw.get("isCompactSummary", False)),
                **common,
            )
        usage_raw = body.get("usage")
        if usage_raw is not None and not isinstance(usage_raw, Mapping):
            raise ValueError("message.usage must be an object")
        return Message(
            type="assistant",
            content=content,
            message_id=_require_str(body, "id"),
            model=_require_str(body, "model"),
            usage=Usage.from_mapping(usage_raw) if usage_raw is not None else None,
            stop_reason=_require_str(body, "stop_reason"),
            **common,
        )
    if rtype == "system":
        content_raw = raw.get("content")
        return Message(
            type="system",
            content=content_raw if isinstance(content_raw, str) else "",
            subtype=_require_str(raw, "subtype"),
            **common,
        )
    if rtype == "attachment":
        rendered = raw.get("rendered")
        if rendered is not None:  # Claude Code 2.1: the text it sends, already rendered
            return Message(
                type="attachment", content=_rendered_blocks(rendered), subtype=REMINDER, **common
            )
        att = raw.get("attachment")
        att_content: Any = att.get("content") if isinstance(att, Mapping) else None
        content = _parse_blocks(att_content, "attachment.content") if att_content else ""
        return Message(type="attachment", content=content, **common)
    return Message(type="progress", **common)  # progress payloads are UI-only: not kept


def _rendered_blocks(rendered: Any) -> list[Block]:
    """The text blocks of a 2.1 attachment's ``rendered`` list (``[{"content": str}, ...]``)."""
    if not isinstance(rendered, list):
        raise ValueError("attachment 'rendered' must be a list")
    blocks: list[Block] = []
    for i, item in enumerate(rendered):
        text = item.get("content") if isinstance(item, Mapping) else None
        if not isinstance(text, str):
            raise ValueError(f"attachment rendered[{i}] has no string 'content'")
        if text:
            blocks.append({"type": "text", "text": text})
    return blocks


def _replacement_record(rep: Any) -> ReplacementRecord:
    """One ``content-replacement`` entry. The fields are checked here first, so that every
    value an error quotes is cut short (:func:`bounded_repr`): a hostile entry must not turn
    into a message of megabytes."""
    if not isinstance(rep, Mapping):
        raise ValueError("content-replacement entry is not an object")
    tool_use_id, replacement = rep.get("tool_use_id"), rep.get("replacement")
    kind = rep.get("kind", "tool-result")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise ValueError(f"replacement record: bad tool_use_id {bounded_repr(tool_use_id)}")
    if not isinstance(replacement, str):
        raise ValueError(
            f"replacement record {bounded_repr(tool_use_id)}: replacement is not a string"
        )
    if not isinstance(kind, str):
        raise ValueError(
            f"replacement record {bounded_repr(tool_use_id)}: bad kind {bounded_repr(kind)}"
        )
    return ReplacementRecord.from_json(rep)


MAX_NESTING = 256
"""Deepest JSON nesting a record may have. Real records stay under 20; anything deeper would
only reach recursion limits later (estimating, serialising a request), far from its line."""


def _check_depth(raw: Any, line: str) -> None:
    """Refuse a record nested deeper than :data:`MAX_NESTING` (a cheap count rules out almost
    every line before any walk)."""
    if line.count("[") + line.count("{") <= MAX_NESTING:
        return
    stack: list[tuple[Any, int]] = [(raw, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_NESTING:
            raise ValueError(f"nested deeper than {MAX_NESTING} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def load_transcript(
    path: str | os.PathLike[str], *, strict: bool = True, recorded_wire: bool = True
) -> Transcript:
    """Read a Claude Code session JSONL file.

    A malformed line raises :class:`TranscriptError` naming the file and line; with
    ``strict=False`` it is skipped and listed in ``Transcript.problems`` instead. Unknown record
    types are skipped and counted in ``Transcript.skipped_types``, never fatal.

    Claude Code 2.1 records what each call sent: ``api-request`` records become
    ``Transcript.requests``; with ``recorded_wire`` (default) a user message whose records do
    not render to what the call recorded sending (its ``api-request`` chain and
    ``api-request-blob`` records) is replaced by the recorded messages, so that
    :func:`~pipeline.wire.to_api` rebuilds exactly what was sent (``Transcript.wire_check``).
    """
    p = Path(path)
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
    for lineno, line in enumerate(lines, start=1):
        if lineno == 1 and line.startswith(_BOM):
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
            _check_depth(raw, line)
            if rtype == CONTENT_REPLACEMENT:
                reps = raw.get("replacements")
                if not isinstance(reps, list):
                    raise ValueError("content-replacement without a 'replacements' list")
                parsed = [_replacement_record(rep) for rep in reps]  # all or none
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
                msg = _parse_message(raw)
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


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _encode_line(record: Mapping[str, Any]) -> bytes:
    """One JSONL line. Text read from invalid UTF-8 (surrogate escapes) goes back as the same
    bytes; a lone surrogate from a JSON escape has no UTF-8 form, so such a record is written
    with ASCII escapes (it loads back as the same string)."""
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return (json.dumps(record) + "\n").encode("ascii")


def encode_records(records: Iterable[Mapping[str, Any]]) -> bytes:
    """Records as the JSONL bytes a transcript holds for them, one line each."""
    return b"".join(map(_encode_line, records))


def message_to_record(
    m: Message, *, session_id: str, parent_uuid: str | None, agent_id: str | None = None
) -> dict[str, Any]:
    """The Claude Code JSONL record for one message."""
    rec: dict[str, Any] = {
        "parentUuid": parent_uuid,
        "isSidechain": m.is_sidechain,
        "type": m.type,
        "sessionId": session_id,
        "uuid": m.uuid,
        "timestamp": m.timestamp or now_timestamp(),
    }
    if agent_id is not None:
        rec["agentId"] = agent_id
    if m.is_meta:
        rec["isMeta"] = True
    if m.type == "user":
        rec["message"] = {"role": "user", "content": m.content}
        if m.is_compact_summary:
            rec["isCompactSummary"] = True
    elif m.type == "assistant":
        rec["message"] = {
            "id": m.message_id,
            "type": "message",
            "role": "assistant",
            "model": m.model,
            "content": m.content,
            "stop_reason": m.stop_reason,
            "stop_sequence": None,
            "usage": m.usage.to_mapping() if m.usage is not None else None,
        }
    elif m.type == "system":
        rec["subtype"] = m.subtype
        rec["content"] = m.content if isinstance(m.content, str) else ""
    elif m.is_reminder:
        rec["attachment"] = {"type": REMINDER}
        rec["rendered"] = [{"content": b.get("text", "")} for b in m.blocks]
    elif m.type == "attachment":
        rec["attachment"] = {"type": "content", "content": m.content}
    else:
        rec["data"] = {}
    return rec


class TranscriptPathError(OSError):
    """The transcript cannot be written safely where it was asked for: the file or its
    directory is a symbolic link, or not a regular file / a real directory. Nothing is written
    there (following a planted link would append the conversation to another file)."""


class JsonlRecordWriter:
    """The records a transcript appends, in Claude Code's JSONL format: messages chained by
    ``parentUuid``, ``content-replacement`` and ``stage-record`` entries. A subclass says where
    the lines go (:meth:`_write_lines`), so every backend writes the same lines.

    ``_last_uuid``: the uuid the next message chains from (None: the first of the thread).
    """

    session_id: str
    agent_id: str | None
    _last_uuid: str | None

    def _write_lines(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Append ``records`` as one unit, or raise ``OSError`` (nothing of them then counts
        as written)."""
        raise NotImplementedError

    def append_messages(self, messages: Sequence[Message]) -> None:
        """Append messages, chaining ``parentUuid`` from the last one written."""
        records = []
        parent = self._last_uuid
        for m in messages:
            records.append(
                message_to_record(
                    m, session_id=self.session_id, parent_uuid=parent, agent_id=self.agent_id
                )
            )
            parent = m.uuid
        self._write_lines(records)
        self._last_uuid = parent  # only once written: a failed write must not break the chain

    def append_replacements(self, records: Sequence[ReplacementRecord]) -> None:
        """Append one ``content-replacement`` entry holding ``records`` (no-op when empty)."""
        if not records:
            return
        entry: dict[str, Any] = {"type": CONTENT_REPLACEMENT, "sessionId": self.session_id}
        if self.agent_id is not None:
            entry["agentId"] = self.agent_id
        entry["replacements"] = [r.to_json() for r in records]
        self._write_lines([entry])

    def append_stage_record(self, stage: str, data: Mapping[str, Any]) -> None:
        """Append a ``stage-record``: a stage's decision a resumed session must repeat."""
        entry: dict[str, Any] = {"type": STAGE_RECORD, "sessionId": self.session_id}
        if self.agent_id is not None:
            entry["agentId"] = self.agent_id
        entry["stage"] = stage
        entry["data"] = dict(data)
        self._write_lines([entry])


class TranscriptWriter(JsonlRecordWriter):
    """Appends messages and ``content-replacement`` records to a session JSONL file.

    Each append is one ``write`` of whole lines followed by a flush and ``fsync``, so a crash
    leaves at most a torn last line, which a ``strict=False`` load skips and reports.

    The file is created 0600 and missing directories above it 0700 (the conversation is
    private). A transcript or session directory that is a symbolic link, or not a regular file
    or a real directory, is refused with :class:`TranscriptPathError`, here when it is already
    so and on every append (it may be planted later).
    """

    def __init__(
        self, path: str | os.PathLike[str], session_id: str, *, agent_id: str | None = None
    ) -> None:
        self.path = Path(path)
        self.session_id = session_id
        self.agent_id = agent_id
        self._last_uuid = _last_uuid(self.path)

    def _write_lines(self, records: Sequence[Mapping[str, Any]]) -> None:
        payload = encode_records(records)
        if not payload:
            return
        fd = _open_transcript(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        try:
            # After a crash the file may end in a torn line: start on a fresh line, or the
            # first record appended now would be glued to it and lost with it.
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                payload = b"\n" + payload
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)


def _make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and any missing parent 0700 (``Path.mkdir(parents=True)`` would
    give the parents the default mode, 0755 under the usual umask)."""
    missing: list[Path] = []
    d = directory
    while not os.path.lexists(d) and d != d.parent:
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        # made meanwhile (another writer): what it is gets checked on opening it
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)


def _open_transcript(path: Path, flags: int) -> int:
    """A descriptor for the transcript at ``path``, opened relative to its directory, which
    itself is opened without following a link: no symbolic link at either place is ever
    followed, even one planted between two appends. ``O_CREAT`` in ``flags`` creates what is
    missing (the file 0600, directories 0700)."""
    directory = path.parent
    if flags & os.O_CREAT:
        _make_private_dirs(directory)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise TranscriptPathError(
                errno.ENOTDIR,
                "refusing the transcript's directory: it is a symbolic link or not a directory "
                "(give the real path)",
                str(directory),
            ) from None
        raise
    try:
        fd = os.open(
            path.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
        )
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TranscriptPathError(
                errno.ELOOP,
                "refusing to write the transcript through a symbolic link (give the real path)",
                str(path),
            ) from None
        raise
    finally:
        os.close(dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise TranscriptPathError(errno.EINVAL, "the transcript is not a regular file", str(path))
    os.set_blocking(fd, True)
    return fd


def _last_uuid(path: Path) -> str | None:
    """The uuid of the last record of an existing transcript (None for a new one)."""
    try:
        fd = _open_transcript(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    last: str | None = None
    with os.fdopen(fd, "r", encoding="utf-8", errors="surrogateescape", newline="\n") as fh:
        for lineno, line in enumerate(fh, start=1):
            if lineno == 1 and line.startswith(_BOM):
                line = line[1:]
            try:
                raw = json.loads(line)
            except ValueError:
                continue
            if isinstance(raw, dict) and isinstance(raw.get("uuid"), str):
                last = raw["uuid"]
    return last
