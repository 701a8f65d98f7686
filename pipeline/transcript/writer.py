"""Append session transcripts in Claude Code's JSONL format: one ``write`` of whole lines per
append, fsync'd, 0600 in 0700, never through a symbolic link (:class:`TranscriptWriter`), and
the same lines for other sinks (:class:`JsonlRecordWriter`, :func:`encode_records`).
:mod:`pipeline.transcript.read` reads them back."""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.messages import REMINDER, Message, now_timestamp
from pipeline.replacement import ReplacementRecord
from pipeline.transcript.open_files import OPEN_FILES, HeldFile, OpenFiles
from pipeline.transcript.safe_open import TranscriptPathError, open_to_append, open_transcript

__all__ = [
    "BOM",
    "CONTENT_REPLACEMENT",
    "STAGE_RECORD",
    "JsonlRecordWriter",
    "TranscriptPathError",
    "TranscriptWriter",
    "encode_records",
    "message_to_record",
]

CONTENT_REPLACEMENT = "content-replacement"
STAGE_RECORD = "stage-record"
BOM = "\ufeff"
"""A byte order mark some editors write at a file's start (read past, never written)."""


_UNESCAPED = json.JSONEncoder(ensure_ascii=False).encode
"""``json.dumps(value, ensure_ascii=False)``, its encoder made once (``json.dumps`` makes one
per call for any option but its defaults)."""


def _encode_line(record: Mapping[str, Any]) -> bytes:
    """One JSONL line. Text read from invalid UTF-8 (surrogate escapes) goes back as the same
    bytes; a lone surrogate from a JSON escape has no UTF-8 form, so such a record is written
    with ASCII escapes (it loads back as the same string)."""
    try:
        return (_UNESCAPED(record) + "\n").encode("utf-8", "surrogateescape")
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
        self._write_lines([self._stage_entry(stage, data)])

    def _stage_entry(self, stage: str, data: Mapping[str, Any]) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": STAGE_RECORD, "sessionId": self.session_id}
        if self.agent_id is not None:
            entry["agentId"] = self.agent_id
        entry["stage"] = stage
        entry["data"] = dict(data)
        return entry


MAX_HELD_BACK = 16
"""Records a writer holds back at most (:meth:`TranscriptWriter.append_stage_record_later`):
then they are written, with no response record to go with."""

_WRITERS: weakref.WeakSet[TranscriptWriter] = weakref.WeakSet()
"""Every writer of the process: a forked child has only the thread that forked, so a lock
another thread held at the fork would stay held in it."""


def _after_fork() -> None:
    for writer in list(_WRITERS):
        writer.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork)


class TranscriptWriter(JsonlRecordWriter):
    """Appends messages and ``content-replacement`` records to a session JSONL file.

    Each append is one ``write`` of whole lines followed by a flush and ``fsync``, so a crash
    leaves at most a torn last line, which a ``strict=False`` load skips and reports. With
    ``fsync_each=False`` an append is written (a crash of the process loses nothing) and
    :meth:`sync` makes what was appended durable on disk later, once for many appends (a
    machine that loses power in between may lose them): for callers that must answer first.

    The file is created 0600 and missing directories above it 0700 (the conversation is
    private). A transcript or session directory that is a symbolic link, or not a regular file
    or a real directory, is refused with :class:`TranscriptPathError`, here when it is already
    so and on every append (it may be planted later).

    ``hold_open=True`` keeps the file's descriptor between appends (an append is then four
    system calls instead of about a dozen: opening the file safely is most of them): each
    first checks that the path still names the file held, and one removed, replaced (a link
    planted there included) or moved away is opened again at its path as above -- so the
    checks for links are made when the file is opened, and a directory moved away and
    replaced by a link to where it went still names the file held, which is appended to (no
    other file is ever written). ``open_files`` bounds the descriptors held in the process
    (:mod:`pipeline.transcript.open_files`); :meth:`close` lets one go at once, and so does
    the writer's garbage collection.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        session_id: str,
        *,
        agent_id: str | None = None,
        fsync_each: bool = True,
        hold_open: bool = False,
        open_files: OpenFiles = OPEN_FILES,
    ) -> None:
        self.path = Path(path)
        self.session_id = session_id
        self.agent_id = agent_id
        self.fsync_each = fsync_each
        self.hold_open = hold_open
        self._open_files = open_files
        self._unsynced = False
        self._lock = threading.Lock()
        """Held while the file is written, or its descriptor closed (appends may run in worker
        threads)."""
        self._file = (
            HeldFile(self.path, open_to_append, self._lock, open_files) if hold_open else None
        )
        self._waiting: list[bytes] = []
        """Lines held back (:meth:`append_stage_record_later`), written before the next ones."""
        self.known_size: int | None = None
        """The file's length as this writer knows it -- what was loaded (:meth:`loaded`), then
        what it appended -- or None when never told: see :meth:`changed_elsewhere`."""
        _WRITERS.add(self)  # a forked child resets its lock (held, maybe, by another thread)
        self._last_uuid = _last_uuid(self.path)

    @property
    def append_blocks(self) -> bool:
        """Whether an append waits on the disk (an ``fsync``): see
        :func:`~pipeline.store.records.appends_block`."""
        return self.fsync_each

    def append_stage_record_later(self, stage: str, data: Mapping[str, Any]) -> bool:
        """Hold a ``stage-record`` back, to be written with the next append (before it), at
        :meth:`write_held`, :meth:`sync` or :meth:`close`: for a decision that a crash may lose
        without harm, because a new process finds it again (a result sent whole, placed so
        once the model's answer to it comes back). False when each record is to be durable
        at once (``fsync_each``): nothing is held, the caller appends it."""
        if self.fsync_each:
            return False
        line = encode_records([self._stage_entry(stage, data)])
        with self._lock:
            self._waiting.append(line)
            waiting = len(self._waiting)
        if waiting >= MAX_HELD_BACK:  # calls that never got a response write them, bounded
            self.write_held()
        return True

    def write_held(self) -> None:
        """Write the records held back (:meth:`append_stage_record_later`) now."""
        if self._waiting:
            self._write_lines(())

    def sync(self) -> None:
        """Make every append so far durable on disk (one ``fsync``; nothing when each append
        already was, none was made since the last sync, or the file is gone: removed with
        its directory, a temporary one, before a sync that runs after the call); records held
        back are written first (a failure to, raised after the sync). Blocking."""
        try:
            self.write_held()
        finally:
            self._sync_written()

    def _sync_written(self) -> None:
        if not self._unsynced:
            return
        self._unsynced = False  # an append from now on marks it again
        try:
            fd = self._held_copy()
            if fd is None:
                fd = open_transcript(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return  # nothing left to make durable
        except BaseException:
            self._unsynced = True
            raise
        try:
            os.fsync(fd)
        except BaseException:
            self._unsynced = True
            raise
        finally:
            os.close(fd)

    def _held_copy(self) -> int | None:
        """A copy of the descriptor held (``hold_open``), None when none is: the file the
        appends went to, synced without opening it again (two opens, the directory's and the
        file's, and their checks for links: a third of a sync's CPU). A copy, so that the
        fsync waits on the disk without the lock appends take."""
        held = self._file
        if held is None:
            return None
        with self._lock:
            fd = held.fd
            return None if fd is None else os.dup(fd)

    def _write_lines(self, records: Sequence[Mapping[str, Any]]) -> None:
        payload = encode_records(records)
        held = self._file
        with self._lock:
            if self._waiting:
                payload = b"".join(self._waiting) + payload
            if not payload:
                return
            if held is None:
                fd = open_to_append(self.path)
                try:
                    self._append(fd, os.fstat(fd).st_size, payload)
                finally:
                    os.close(fd)
            else:
                fd, size = held.descriptor()
                try:
                    self._append(fd, size, payload)
                except BaseException:
                    held.close()  # what state it is in is unknown: the next opens afresh
                    raise
            self._waiting.clear()
        if held is not None:
            held.used()

    def loaded(self, size: int) -> None:
        """The file was read up to ``size`` bytes (0: it does not exist): what this writer
        appends from now on counts from there."""
        with self._lock:
            self.known_size = size

    def changed_elsewhere(self) -> bool:
        """Whether another writer (another client of the store, another process) appended to
        the file since it was :meth:`loaded` or this writer last appended: its length is not
        the one this writer knows (one ``lstat``). Never told a length, and never having
        written, a file with anything in it is news: another writer made it first."""
        with self._lock:  # not between an append of this writer's and its count
            known = self.known_size
            try:
                size = os.lstat(self.path).st_size
            except (FileNotFoundError, NotADirectoryError):
                return bool(known)
            return size != (known or 0)

    def _append(self, fd: int, size: int, payload: bytes) -> None:
        # After a crash the file may end in a torn line: start on a fresh line, or the first
        # record appended now would be glued to it and lost with it.
        if size and os.pread(fd, 1, size - 1) != b"\n":
            payload = b"\n" + payload
        os.write(fd, payload)
        if self.known_size == size or (self.known_size is None and size == 0):
            # the file was as this writer knew it: it now knows it to here (else another
            # writer's lines came between, and it stays behind: a check says so)
            self.known_size = size + len(payload)
        if self.fsync_each:
            os.fsync(fd)
        else:
            self._unsynced = True

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's descriptor, lock and held-back records are the
        parent's (it writes those); the next append opens the file again."""
        self._lock = threading.Lock()
        self._waiting = []
        if self._file is not None:
            self._file.forget_after_fork(self._lock)

    def close(self) -> None:
        """Write the records held back, and let the held descriptor go (appends after it open
        the file again). Idempotent."""
        try:
            self.write_held()
        finally:
            if self._file is not None:
                with self._lock:
                    self._file.close()


def _last_uuid(path: Path) -> str | None:
    """The uuid of the last record of an existing transcript (None for a new one)."""
    try:
        fd = open_transcript(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    last: str | None = None
    with os.fdopen(fd, "r", encoding="utf-8", errors="surrogateescape", newline="\n") as fh:
        for lineno, line in enumerate(fh, start=1):
            if lineno == 1 and line.startswith(BOM):
                line = line[1:]
            try:
                raw = json.loads(line)
            except ValueError:
                continue
            if isinstance(raw, dict) and isinstance(raw.get("uuid"), str):
                last = raw["uuid"]
    return last
