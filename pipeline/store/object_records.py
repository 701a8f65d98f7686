"""A session's records on an object store: one immutable object per append.

No shared file is read, modified and written back. Each append creates one new object,
``<prefix>/<session>/records/<sequence:012d>.jsonl``, holding the same JSONL lines
:class:`~pipeline.transcript.read.TranscriptWriter` would append, and it is created exclusively
(``mode="create"``): an object once written is never replaced, and a number is taken once.

Order. An append takes the number after the highest the log has seen (listing what was added
since its last listing first when it has never listed, and after a number it found taken).
Two writers that reach for the same number race on one key: one create wins, the other gets a
conflict and takes the next number. Numbers thus have no
gaps (a writer only goes past a number it found taken), number N exists before N + 1 is
written, and listing the keys after the last one seen finds every record added since --
whatever lag a listing had. The load order is the number order, the same for every reader, and
it is the order the appends committed. A conflict on a key that holds exactly the bytes being
appended is this append's own create, retried by the client after a lost reply (or another
writer appending the very same lines there): it counts as done, no record twice.

Reading (:meth:`ObjectRecordLog.load`) lists the records, sorts them and parses them in order as
one transcript with ``strict=False``: a malformed line of any object is skipped and reported as
it is in a file. A listed object that cannot be read yet (eventual consistency) is tried again
a few times, then skipped with a warning; any other store error fails the load (``StoreError``)
rather than give a partial record set that would silently change decisions.

A worker that keeps a session in memory while others may serve it asks
:meth:`ObjectRecordLog.changed_elsewhere` before each call: one ``HEAD`` of the number after the
highest it has seen (there are no gaps), True when another writer added records since this log
last loaded. The
bytes of every record object this log has read or written are kept (objects are immutable), so
loading again after a move reads only the objects that are new.

Compaction (:meth:`ObjectRecordLog.compact`, after each call): the records are also written as
snapshots (:mod:`pipeline.store.object_snapshots`), and a load starts from the newest chain of
them when that spares it reading more than two records, so a worker new to a long conversation
reads at most three objects, not one per record.
"""

from __future__ import annotations

import bisect
import contextvars
import errno
import random
import re
import secrets
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.logs import get_logger
from pipeline.store.files import StoreError
from pipeline.store.held_records import RECORD_NAME, HeldRecords
from pipeline.store.object_snapshots import (
    DELTA_BYTES,
    Chain,
    choose_chain,
    snapshot_name,
    snapshots_dir,
)
from pipeline.store.objects import RECORDS_SUBDIR, ObjectLayout, ObjectStoreAPI, is_create_conflict
from pipeline.transcript.read import (
    JsonlRecordWriter,
    Transcript,
    encode_records,
    jsonl_lines,
    load_transcript_lines,
)

__all__ = ["APPEND_ATTEMPTS", "READERS", "ObjectRecordLog"]

APPEND_ATTEMPTS = 16
"""Create conflicts an append survives before it fails (each takes the next number)."""
_BACKOFF_CAP = 0.05
"""Longest pause (seconds) after a lost number: writers racing for one conversation take
turns instead of one starving (a writer that lost eight numbers in a row to a busy peer failed,
under CPU load, before the pause)."""
READERS = 16
"""Record objects a load reads at once."""
_WRITER_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MAX_SEQUENCE = 10**12 - 1
_SYSTEM_RANDOM = random.SystemRandom()


def _store_error(action: str, key: str, exc: BaseException) -> StoreError:
    """A store failure as an ``OSError`` (what callers of a record log catch), named by its
    type only: an ``obstore`` message carries the request URL and the server's reply."""
    return StoreError(errno.EIO, f"record {action} failed ({type(exc).__name__})", key)


class ObjectRecordLog(JsonlRecordWriter):
    """:class:`~pipeline.store.records.RecordLog` on an object store (see the module docstring).

    ``store``: an ``obstore`` store (or anything with
    :class:`~pipeline.store.objects.ObjectStoreAPI`'s methods); ``prefix``, ``session_id``,
    ``uri_base``, ``records`` (the records directory's name): see
    :class:`~pipeline.store.objects.ObjectLayout`. ``writer_id``
    (``[A-Za-z0-9_.-]{1,64}``) names this writer in what it logs; by default a random one.
    ``read_attempts`` and ``retry_delay`` (seconds, doubled each time):
    how long :meth:`load` waits for a listed object to become readable. ``delta_bytes``: see
    :meth:`compact`.

    Appends block (a LIST and a PUT): run them in a worker thread from async code. They raise
    :class:`~pipeline.store.files.StoreError` (an ``OSError``) when the store fails. The log keeps
    the bytes of the records it has read or written (what the session's decisions take: a
    replacement record holds its preview, about 2 KB), so a later :meth:`load` reads only what
    is new.
    """

    def __init__(
        self,
        store: ObjectStoreAPI,
        *,
        prefix: str = "",
        session_id: str,
        uri_base: str = "memory://",
        writer_id: str | None = None,
        agent_id: str | None = None,
        records: str = RECORDS_SUBDIR,
        read_attempts: int = 4,
        retry_delay: float = 0.1,
        delta_bytes: int = DELTA_BYTES,
        logger: Any = None,
    ) -> None:
        if writer_id is None:
            writer_id = secrets.token_hex(8)
        if not isinstance(writer_id, str) or not _WRITER_ID.fullmatch(writer_id):
            raise ValueError(f"writer_id must match [A-Za-z0-9_.-]{{1,64}}, got {writer_id!r:.80}")
        if read_attempts < 1 or retry_delay < 0:
            raise ValueError("read_attempts must be >= 1 and retry_delay >= 0")
        if isinstance(delta_bytes, bool) or not isinstance(delta_bytes, int) or delta_bytes < 0:
            raise ValueError(f"delta_bytes must be an int >= 0, got {delta_bytes!r:.80}")
        self.delta_bytes = delta_bytes
        self.store = store
        self.layout = ObjectLayout(session_id, prefix, uri_base, records)
        self.session_id = self.layout.session_id
        self.agent_id = agent_id
        self.writer_id = writer_id
        self.read_attempts = read_attempts
        self.retry_delay = retry_delay
        self.logger = logger or get_logger(session_id=self.session_id)
        self._last_uuid = None
        self._next = 0
        """The number the next append tries first: one past the highest seen."""
        self._listed_after: str | None = None
        """The greatest key seen by a listing: the next listing asks only for what follows."""
        self._held = HeldRecords(self.layout.records_dir)
        """The bytes of the records this log has read or written."""
        self._unloaded: set[str] = set()
        """Keys of other writers' records listed since the last load and not loaded yet."""
        self._incomplete = False
        """A load began and did not end well: what it counted as seen may not be held."""
        self._snapshots: set[str] = set()
        """Snapshot keys known to exist (the older ones go when a new base is written)."""
        self._chain: tuple[str, ...] = ()
        """The newest chain known: its base's key and its newest delta's."""
        self._chain_base = -1
        self._chain_last = -1
        self._lock = threading.Lock()
        self._exclusive = threading.Lock()
        """Held by a load and by a compaction: each takes the held pieces apart and puts them
        together again, which the other must not see halfway."""

    # -- appending --------------------------------------------------------------------------
    def _write_lines(self, records: Sequence[Mapping[str, Any]]) -> None:
        payload = encode_records(records)
        if payload:
            with self._lock:  # one append at a time: each takes the number after the last
                self._append(payload)

    def _append(self, payload: bytes) -> str:
        key = ""
        # the number after the highest this log has seen is tried without a listing first (one
        # request, not two, on each append of a conversation one worker serves); a log that has
        # never listed, or whose number was taken, lists what was added first
        listed = self._listed_after is not None or not self._held.empty
        for attempt in range(APPEND_ATTEMPTS):
            if not listed:
                try:
                    self._catch_up()
                except Exception as exc:
                    raise _store_error("listing", self.layout.records_dir, exc) from exc
            listed = False
            if self._next > _MAX_SEQUENCE:
                raise StoreError(errno.EOVERFLOW, "record numbers exhausted", key)
            key = self._held.key(self._next)
            # taken and holding other bytes: another writer's (or our listing lagged); else
            # our own create, whose reply was lost and which the client sent again
            if not self._create(key, payload, "append") and not self._holds(key, payload):
                # the next number, after a short random pause that lets a busy peer's run of
                # appends end; the record there is another writer's, for the next load to read
                if key not in self._held:
                    self._unloaded.add(key)
                self._next += 1
                time.sleep(_SYSTEM_RANDOM.uniform(0, min(_BACKOFF_CAP, 0.001 * 2**attempt)))
                continue
            self._next += 1
            self._held.add(key, payload)
            return key
        raise StoreError(errno.EEXIST, f"no free record number in {APPEND_ATTEMPTS} attempts", key)

    def _create(self, key: str, data: bytes, action: str) -> bool:
        """Create ``key`` holding ``data``; False when something is there already."""
        try:
            self.store.put(key, data, mode="create")
        except Exception as exc:
            if not is_create_conflict(exc):
                raise _store_error(action, key, exc) from exc
            return False
        return True

    def _holds(self, key: str, payload: bytes) -> bool:
        """Whether ``key`` holds exactly ``payload`` (False when it cannot be read)."""
        try:
            found = self.store.get(key)
            return found.meta["size"] == len(payload) and bytes(found.bytes()) == payload
        except Exception:  # unreadable now: count it as taken, the append takes the next number
            return False

    def _catch_up(self) -> None:
        for key, sequence in self._listing(after=self._listed_after):
            self._next = max(self._next, sequence + 1)
            if key not in self._held:
                self._unloaded.add(key)  # another writer's: the next load must read it

    def changed_elsewhere(self) -> bool:
        """Whether another writer added records this log has not loaded: one ``HEAD`` of the
        number after the highest this log has seen (numbers have no gaps, so whatever was
        added since holds that one; a ``HEAD`` is a read, a fraction of a listing's price).
        Blocking; ``StoreError`` when the store cannot be asked."""
        with self._lock:
            if self._unloaded or self._incomplete:
                return True  # what a load must still read (or read again)
            key = self._held.key(self._next)
            try:
                self.store.head(key)
            except FileNotFoundError:
                return False
            except Exception as exc:
                raise _store_error("check", key, exc) from exc
            self._unloaded.add(key)  # another writer's: the next load lists and reads it
            return True

    def _listing(self, *, after: str | None = None) -> Iterator[tuple[str, int]]:
        """(key, sequence) of every record object listed, after ``after`` if given;
        other names under ``records/`` are not ours and are left out."""
        head = self.layout.records_dir + "/"
        for chunk in self.store.list(self.layout.records_dir, offset=after):
            for meta in chunk:
                key = meta["path"]
                if self._listed_after is None or key > self._listed_after:
                    self._listed_after = key
                match = RECORD_NAME.fullmatch(key[len(head) :]) if key.startswith(head) else None
                if match is not None:
                    yield key, int(match[1])

    # -- loading ----------------------------------------------------------------------------
    def load(self) -> Transcript | None:
        """Every record of the session, in number order, as one transcript
        (``strict=False``: malformed lines are in ``Transcript.problems``, each also logged with
        its object); None when the session has no record object yet (as for a transcript file
        that does not exist). The next message appended chains from the last message loaded.
        It starts from the newest snapshots when they spare it more than two records' reads.

        Raises :class:`~pipeline.store.files.StoreError` when the store cannot be listed or read
        (an object that lists but is not found yet is skipped after a few tries instead)."""
        with self._exclusive:
            return self._load()

    def _load(self) -> Transcript | None:
        # until this load ends well, the log may count as seen (its next number past them)
        # records it does not hold: a check for news says True meanwhile
        with self._lock:
            self._incomplete = True
        self._start_from_snapshots()
        with self._lock:
            held = self._held
            after = held.key(held.last) if held.last >= 0 else None
            try:
                entries = sorted(self._listing(after=after), key=lambda e: e[1])
            except Exception as exc:
                raise _store_error("listing", self.layout.records_dir, exc) from exc
            if not entries and held.empty:
                self._incomplete = False
                return None
            if entries:
                self._next = max(self._next, entries[-1][1] + 1)
            missing = [key for key, _sequence in entries if key not in held]
        # every object is read before any is taken: a read that fails fails the load whole,
        # and then nothing counts as loaded; one skipped as unreadable stays unloaded (the
        # next check asks for a load again)
        fetched: dict[str, bytes | None] = {}
        if missing:
            # several reads at once: a new worker's first load of a long session is one GET
            # per record object, and each waits on the store's latency
            # each read in a copy of the caller's context: what it logs says the call and
            # the trace it belongs to (a worker thread starts with an empty context)
            contexts = [contextvars.copy_context() for _ in missing]
            with ThreadPoolExecutor(max_workers=min(READERS, len(missing))) as pool:
                bodies = pool.map(lambda c, k: c.run(self._read, k), contexts, missing)
                fetched = dict(zip(missing, bodies, strict=True))
        with self._lock:
            for key, data in fetched.items():
                if data is not None and key not in held:
                    held.add(key, data)
            listed = {key for key, _sequence in entries}
            self._unloaded = {key for key in self._unloaded | listed if key not in held}
            self._incomplete = False
            pieces = held.texts()
        starts: list[int] = []
        names: list[str] = []

        def lines() -> Iterator[str]:
            count = 0
            for data, key in pieces:
                starts.append(count + 1)
                names.append(key)
                for line in jsonl_lines(data.decode("utf-8", errors="surrogateescape")):
                    count += 1
                    yield line

        loaded = load_transcript_lines(lines(), self.layout.records_dir, strict=False)
        for event, found in (
            ("records.malformed_line", loaded.problems),
            ("records.repeated_line", loaded.repeated),
        ):
            for problem in found:
                at = bisect.bisect_right(starts, problem.line) - 1
                self.logger.warning(
                    event,
                    key=names[at],
                    line=problem.line - starts[at] + 1,
                    reason=problem.reason,
                )
        if loaded.messages:
            with self._lock:
                self._last_uuid = loaded.messages[-1].uuid
        return loaded

    # -- snapshots --------------------------------------------------------------------------
    @property
    def _snapshots_dir(self) -> str:
        return snapshots_dir(self.layout.records_dir)

    def _start_from_snapshots(self) -> None:
        """Hold the chain of snapshots that reaches furthest when it goes more than two records
        past what is held (two reads for every record it covers). Snapshots are a cache: a
        chain that cannot be listed or read is left (the records are read instead), and one
        removed meanwhile by a newer base is listed again, once."""
        directory = self._snapshots_dir
        for _attempt in range(2):
            try:
                listed = [meta["path"] for chunk in self.store.list(directory) for meta in chunk]
                chain = choose_chain(listed, directory)
                if chain is None or not self._note_chain(chain):
                    return
                with self._lock:
                    kept_base = self._held.ends_at(chain.base_last)
                wanted = ([] if kept_base else [chain.base]) + (
                    [chain.delta] if chain.delta else []
                )
                found = [self._read_snapshot(key) for key in wanted]
            except Exception as exc:  # a cache: the records are read instead
                self.logger.warning("records.snapshots_unreadable", error=type(exc).__name__)
                return
            if all(data is not None for data in found):
                break
        else:
            return
        with self._lock:
            pieces = []
            for key, data in zip(wanted, found, strict=True):
                assert data is not None
                pieces.append((chain.base_last if key == chain.base else chain.last, data, key))
            self._held.take(chain.base_last if kept_base else -1, pieces)
            # what was unloaded stays so until the load ends well: a load that fails after
            # this still finds the conversation changed next time
            self._next = max(self._next, chain.last + 1)
            head = self._held.key(chain.last)
            if self._listed_after is None or head > self._listed_after:
                self._listed_after = head  # a listing of what is new starts past the chain

    def _note_chain(self, chain: Chain) -> bool:
        """Remember ``chain`` (the snapshots to remove later, the newest chain); whether it is
        worth reading (it goes more than two records past what is held)."""
        with self._lock:
            self._snapshots.update((chain.base, *chain.others))
            if chain.delta is not None:
                self._snapshots.add(chain.delta)
            if chain.last > self._chain_last:
                self._chain = (chain.base,) if chain.delta is None else (chain.base, chain.delta)
                self._chain_base, self._chain_last = chain.base_last, chain.last
            return chain.last > self._held.last + 2

    def _read_snapshot(self, key: str) -> bytes | None:
        """The bytes of snapshot ``key``; None when it is gone (a newer base replaced it)."""
        try:
            return bytes(self.store.get(key).bytes())
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise _store_error("read", key, exc) from exc

    def compact(self) -> None:
        """Write the records held since the newest snapshot as one (a delta, or a new base past
        :data:`~pipeline.store.object_snapshots.DELTA_BYTES`), and remove the snapshots a new
        base makes old, but the chain it replaces (a worker may be reading it). Blocking: call
        it after a call's records, off the response's path. Raises
        :class:`~pipeline.store.files.StoreError` when the snapshot cannot be written; a
        removal that fails is logged and tried again with the next base."""
        if not self._exclusive.acquire(blocking=False):
            return  # a load or a compaction is under way: the next call's takes these records
        try:
            self._compact()
        finally:
            self._exclusive.release()

    def _compact(self) -> None:
        with self._lock:
            last = self._held.last
            if last <= self._chain_last:
                return
            since = self._held.since(self._chain_base) if self._chain_base >= 0 else None
            if since is not None and sum(map(len, since)) <= self.delta_bytes:
                first, data = self._chain_base + 1, b"".join(since)
            else:
                first, data = 0, self._held.whole()
        key = f"{self._snapshots_dir}/{snapshot_name(first, last)}"
        # taken: the same records, so the same bytes (another worker wrote this range)
        self._create(key, data, "snapshot")
        with self._lock:
            self._snapshots.add(key)
            if last <= self._chain_last:
                return  # a newer chain is known meanwhile: it stays the one to keep
            self._chain_last = last
            if first > 0:
                self._chain = (self._chain[0], key)
                return
            self._held.fold(last, data, key)
            old = sorted(self._snapshots.difference(self._chain, (key,)))
            self._chain, self._chain_base = (key,), last
        if old:
            try:
                self.store.delete(old)
            except FileNotFoundError:
                pass  # one was gone already (another worker's removal): the rest are removed
            except Exception as exc:  # left in the store; the next base tries again
                self.logger.warning("records.snapshot_removal_failed", error=type(exc).__name__)
                return
            with self._lock:
                self._snapshots.difference_update(old)

    def _read(self, key: str) -> bytes | None:
        """The bytes of ``key``; None when it stays not found (it listed: a store whose reads
        lag its listings)."""
        for attempt in range(self.read_attempts):
            try:
                return bytes(self.store.get(key).bytes())
            except FileNotFoundError:
                if attempt + 1 < self.read_attempts:
                    time.sleep(self.retry_delay * 2**attempt)
            except Exception as exc:
                raise _store_error("read", key, exc) from exc
        self.logger.warning("records.unreadable_object", key=key, attempts=self.read_attempts)
        return None
