"""Where a session's state lives, from one location: a local directory or an object store URL.

:func:`open_session_state` gives a :class:`SessionStorage`: the tool-result store, the record
log the session appends its decisions to, the loader of what was recorded before, and the
read-back tool for the results. A local directory is the default file backend, unchanged
(``<root>/<session>/tool-results/``, ``<root>/<session>/decisions.jsonl``, paths shown to the
model as Claude Code shows them); ``s3://bucket/prefix`` puts the same state on S3 (and
``az://container/prefix`` on Azure Blob Storage), shared by every worker given the same URL
(:mod:`pipeline.store.objects`, :mod:`pipeline.store.object_records`,
:mod:`pipeline.store.object_reader`; needs the ``objectstore`` extra); ``memory:///prefix``
keeps it in memory (tests).

:class:`SessionStates` is the same for many sessions of one worker (a proxy): the location
checked once, one store client shared by every session. Calls made while a client waits (a
persist, an append, a load) are bounded: :func:`in_turn_options` gives obstore's client a few
seconds and a few attempts (:data:`STORE_TIMEOUT`, :data:`STORE_RETRIES`) instead of its
default of ten retries over up to three minutes, so an unreachable store costs a turn a bounded
delay, never the turn.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.store.files import (
    STORE_COOL_DOWN,
    FileToolResultStore,
    StoreError,
    ToolResultStore,
    validate_session_id,
)
from pipeline.store.object_locations import (
    STORE_RETRIES,
    STORE_TIMEOUT,
    build_store,
    in_turn_options,
    parse_url,
    shown,
)
from pipeline.store.readback import PagedReader, PersistedOutputReader
from pipeline.store.records import RecordLog
from pipeline.store.spool import Spool
from pipeline.transcript.read import Transcript, TranscriptWriter, load_transcript

if TYPE_CHECKING:
    from pipeline.store.objects import ObjectStoreAPI

__all__ = [
    "DECISIONS_FILE",
    "STORE_RETRIES",
    "STORE_TIMEOUT",
    "SessionStates",
    "SessionStorage",
    "in_turn_options",
    "open_session_state",
    "readback_for",
]

DECISIONS_FILE = "decisions.jsonl"
"""The local backend's record file: ``<root>/<session>/decisions.jsonl``."""
SECRET_NAME = "tenant-secret"
"""Where a store keeps its tenancy secret: ``<root>/tenant-secret`` (see
:mod:`pipeline.dropin.tenancy`)."""
_BRANCH = re.compile(r"f[0-9a-f]{16}")
"""The name of a branch of a conversation other than its first (see :meth:`SessionStates.open`)."""
_SECRET_BYTES = 32


@dataclass(frozen=True, slots=True)
class SessionStorage:
    """One session's state, wherever it lives (see :func:`open_session_state`)."""

    session_id: str
    location: str
    """Where it lives, as given (a directory, or a URL without credentials or query)."""
    store: ToolResultStore
    """Where oversized tool results go (``SessionContext(store=...)``)."""
    records: RecordLog
    """Where the session's decisions are appended (``SessionContext(transcript=...)``)."""
    load: Callable[[], Transcript | None]
    """The records appended so far, ``strict=False``; None when there are none yet."""
    reader: PagedReader
    """The read-back tool for the results ``store`` persists."""
    changed_elsewhere: Callable[[], bool] = lambda: False
    """Whether another writer appended records that ``load`` has not returned yet (blocking:
    one request of an object store; a local file's length, one ``lstat``). A worker or client
    that keeps a session in memory asks before each call and loads again when True."""
    branch: str | None = None
    """Which branch of the session's records this is: None for its first, ``f<16 hex>`` for
    another (a conversation that went another way from a point of this one; its results share
    the session's ``tool-results``)."""
    sync: Callable[[], None] | None = None
    """Makes the records appended so far durable (blocking; ``OSError`` when it cannot): set
    where an append is written but not yet durable (a local store opened with
    ``fsync_each=False``); None where each append already is."""
    shared: bool = False
    """Whether other workers may write this session's records too (an object store)."""
    drain: Callable[[], object] | None = None
    """Writes to the store the results spooled while it was down (blocking; cheap when none
    wait; a store still down leaves them for the next time): set on an object store with a
    spool (:mod:`pipeline.store.spool`)."""
    compact: Callable[[], None] | None = None
    """Writes the records appended since the last snapshot as one, so a worker new to the
    conversation reads a bounded number of objects (blocking; ``OSError`` when it cannot): set
    on an object store (:mod:`pipeline.store.object_snapshots`)."""


def open_session_state(
    location: str | os.PathLike[str],
    session_id: str,
    *,
    writer_id: str | None = None,
    object_store: ObjectStoreAPI | None = None,
    **options: Any,
) -> SessionStorage:
    """The storage of ``session_id`` at ``location``.

    - a local directory (a path, no ``scheme://``): the file backend;
    - ``s3://bucket[/prefix]``: S3 through ``obstore.store.S3Store.from_url``; credentials,
      region and endpoint come from the usual environment (``AWS_ACCESS_KEY_ID``,
      ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``,
      ``AWS_ALLOW_HTTP`` for a plain-HTTP endpoint...) or from ``options`` (passed on:
      ``config``, ``client_options``, ``retry_config``, ``credential_provider`` or
      ``S3Config`` keys). Timeouts and retries are :func:`in_turn_options`' unless
      ``client_options`` (merged over them) or ``retry_config`` (instead of them) say otherwise;
    - ``az://container[/prefix]``: Azure Blob Storage through
      ``obstore.store.AzureStore.from_url``, the same way (``AZURE_STORAGE_ACCOUNT_NAME``,
      ``AZURE_STORAGE_ACCOUNT_KEY``, ``AZURE_STORAGE_USE_EMULATOR`` with
      ``AZURITE_BLOB_STORAGE_URL`` for Azurite, ``AZURE_ALLOW_HTTP``...);
    - ``memory:///[prefix]``: a new in-memory store.

    ``object_store``: use this ``obstore`` store instead of building one from the URL (two
    workers in one process sharing a ``MemoryStore``; a store configured in code).
    ``writer_id``: names this worker's record objects (object stores only; a local file has
    one writer at a time). ``ValueError`` for an unsupported scheme or a malformed URL.
    """
    states = SessionStates(location, writer_id=writer_id, object_store=object_store, **options)
    return states.open(session_id)


class SessionStates:
    """Where every session of one worker keeps its state: ``location`` (as for
    :func:`open_session_state`) checked once, and for an object store one client made once and
    shared by every session (one connection pool, not one per conversation).

    ``open(session_id)`` gives a session's :class:`SessionStorage`; ``shared`` tells whether
    the location can be shared by several workers (an object store). ``cool_down``: seconds an
    object store that failed is not asked again, each call failing at once meanwhile
    (:class:`~pipeline.store.breaker.StoreBreaker`); None: every call asks it. ``spool``: a
    local directory where an object store's sessions keep the results it cannot take (it is
    down, or refuses the write), until it takes them (:mod:`pipeline.store.spool`); None: such
    a result is sent whole.
    """

    def __init__(
        self,
        location: str | os.PathLike[str],
        *,
        writer_id: str | None = None,
        object_store: ObjectStoreAPI | None = None,
        fsync_each: bool = True,
        cool_down: float | None = STORE_COOL_DOWN,
        spool: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        text = os.fspath(location)
        self.fsync_each = fsync_each
        """Whether a local store's appends are each made durable before they return; False:
        written at once, made durable by the session's ``sync`` (the proxy does so once per
        call, after the response has gone by). An object store's are always durable."""
        if not isinstance(text, str):
            raise ValueError("a store location must be a path or a URL string, not bytes")
        self.writer_id = writer_id
        self.spool: Spool | None = None
        """Where an object store's sessions put results it cannot take (None: they are sent
        whole): see :mod:`pipeline.store.spool`."""
        self._root: Path | None = None
        self._store: ObjectStoreAPI | None = None
        self._prefix = self._uri_base = ""
        if "://" not in text:
            if options or object_store is not None or spool is not None:
                raise ValueError(
                    "store options apply to object store URLs, not to a local directory"
                )
            self._root = Path(text)
            self.location = str(self._root)
            return
        kind, uri_base, path = parse_url(text)
        # imported here: the local default must not need the objectstore extra
        from pipeline.store.objects import normalize_prefix

        try:
            self._prefix = normalize_prefix(path)
        except ValueError as exc:
            raise ValueError(f"store URL {shown(text)}: {exc}") from None
        self._uri_base = uri_base
        from pipeline.store.breaker import StoreBreaker

        store = object_store if object_store is not None else build_store(kind, uri_base, options)
        # a store that failed is not asked again for a while: one that hangs would cost every
        # call of every conversation its timeout and retries
        self._store = store if cool_down is None else StoreBreaker(store, cool_down=cool_down)
        self.location = f"{uri_base}/{self._prefix}" if self._prefix else uri_base
        if spool is not None:
            self.spool = Spool(spool)

    @property
    def shared(self) -> bool:
        """Whether this is an object store (workers given the same URL share its state)."""
        return self._store is not None

    def drain_spool(self, *, force: bool = False) -> tuple[int, int]:
        """Write what :attr:`spool` holds to the object store (blocking): (written, left; -1:
        not asked now, see :meth:`~pipeline.store.spool.Spool.drain`). Nothing to do without a
        spool or while the store's circuit breaker is open."""
        if self.spool is None or self._store is None or not self.spool.waiting():
            return 0, 0
        if getattr(self._store, "open", None) is True:
            return 0, -1
        from pipeline.store.objects import place_object

        store = self._store
        return self.spool.drain(lambda key, data: place_object(store, key, data), force=force)

    def check(self) -> None:
        """Ask an object store for one listing under the prefix (a directory: nothing):
        :class:`~pipeline.store.files.StoreError` naming the failure's type when it cannot answer
        now (credentials, bucket, endpoint, network)."""
        if self._store is None:
            return
        try:
            next(iter(self._store.list(self._prefix or None)), None)
        except Exception as exc:  # obstore's text holds the request URL: the type only
            raise StoreError(errno.EIO, f"cannot list the store ({type(exc).__name__})") from exc

    def open(
        self, session_id: str, *, branch: str | None = None, content_named: bool = False
    ) -> SessionStorage:
        """The storage of ``session_id`` here (``ValueError`` for an unsafe session id).
        ``branch``: another record log of the same session (``f<16 hex>``), beside its first:
        ``decisions.<branch>.jsonl`` in its directory, ``records.<branch>/`` on an object store;
        its results go to the session's ``tool-results`` like the first's. ``content_named``:
        results under their content's name (see
        :class:`~pipeline.store.files.FileToolResultStore`), for sessions that share results."""
        sid = validate_session_id(session_id)
        if branch is not None and not _BRANCH.fullmatch(branch):
            raise ValueError(f"a branch is named f<16 hex>, got {branch!r:.40}")
        if self._root is not None:
            return _local(self._root, sid, branch, content_named, self.fsync_each)
        assert self._store is not None
        return _on_objects(
            self._store,
            self._uri_base,
            self._prefix,
            sid,
            self.writer_id,
            self.location,
            branch,
            content_named,
            self.spool,
        )

    def within(self, name: str) -> SessionStates:
        """The sessions one level down, under ``name`` (a tenant's: see
        :mod:`pipeline.dropin.tenancy`), on the same store and client."""
        sub = validate_session_id(name)
        inner = SessionStates.__new__(SessionStates)
        inner.writer_id = self.writer_id
        inner.fsync_each = self.fsync_each
        inner.spool = self.spool
        inner._root = None if self._root is None else self._root / sub
        inner._store = self._store
        inner._uri_base = self._uri_base
        inner._prefix = "/".join(p for p in (self._prefix, sub) if p)
        inner.location = f"{self.location.rstrip('/')}/{sub}"
        return inner

    def branches(self, session_id: str, *, by_time: bool = False) -> list[str | None]:
        """The branches ``session_id`` has records of (None for its first, first), in name
        order; blocking (a directory listing, or one object-store LIST). ``by_time``: the
        others in the order they were last written, the latest last, on a local store (an
        object store's listing gives no times: name order)."""
        sid = validate_session_id(session_id)
        names: set[str] = set()
        written: dict[str, float] = {}
        if self._root is not None:
            try:
                entries = list(os.scandir(self._root / sid))
            except (FileNotFoundError, NotADirectoryError):
                return []
            names = {e.name for e in entries}
            first = DECISIONS_FILE in names
            found = {
                n[len("decisions.") : -len(".jsonl")]
                for n in names
                if n.startswith("decisions.") and n.endswith(".jsonl")
            }
            if by_time:
                for e in entries:
                    with contextlib.suppress(OSError):  # gone meanwhile: as if never written
                        written[e.name[len("decisions.") : -len(".jsonl")]] = e.stat().st_mtime
        else:
            assert self._store is not None
            key = "/".join(p for p in (self._prefix, sid) if p)
            try:
                listed = self._store.list_with_delimiter(key)
            except Exception as exc:  # the type only: obstore's text holds the request URL
                raise StoreError(
                    errno.EIO, f"cannot list the store ({type(exc).__name__})"
                ) from exc
            dirs = {p.rsplit("/", 1)[-1] for p in listed["common_prefixes"]}
            first = "records" in dirs
            found = {d[len("records.") :] for d in dirs if d.startswith("records.")}
        others = sorted(b for b in found if _BRANCH.fullmatch(b))
        if by_time:
            others.sort(key=lambda b: written.get(b, 0.0))  # stable: name order among ties
        return ([None] if first else []) + others

    def secret(self) -> bytes:
        """The store's tenancy secret (:mod:`pipeline.dropin.tenancy`), made at random the first
        time
        and kept beside the sessions (a file of 0600; an object created exclusively, so every
        worker on the store reads the one that won). Blocking; ``OSError`` when it can be
        neither read nor made."""
        if self._root is not None:
            return _local_secret(self._root / SECRET_NAME)
        assert self._store is not None
        key = "/".join(p for p in (self._prefix, SECRET_NAME) if p)
        from pipeline.store.objects import is_create_conflict

        made = secrets.token_bytes(_SECRET_BYTES)
        try:
            self._store.put(key, made, mode="create")
            return made
        except Exception as exc:
            if not is_create_conflict(exc):
                raise StoreError(
                    errno.EIO, f"cannot write the tenancy secret ({type(exc).__name__})"
                ) from exc
        try:
            found = bytes(self._store.get(key).bytes())
        except Exception as exc:
            raise StoreError(
                errno.EIO, f"cannot read the tenancy secret ({type(exc).__name__})"
            ) from exc
        if len(found) < _SECRET_BYTES // 2:
            raise StoreError(errno.EIO, "the store's tenancy secret is too short", key)
        return found


def _local_secret(path: Path) -> bytes:
    """Read the secret at ``path``, or make it (exclusively: of two processes racing, both
    read the one that was made first)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        made = secrets.token_bytes(_SECRET_BYTES)
        tmp = path.with_name(f".{SECRET_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.write(fd, made)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # whole or not at all, and never over another's
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        data = path.read_bytes()
    if len(data) < _SECRET_BYTES // 2:
        raise StoreError(errno.EIO, "the store's tenancy secret is too short", str(path))
    return data


def _local(
    root: Path,
    sid: str,
    branch: str | None = None,
    content_named: bool = False,
    fsync_each: bool = True,
) -> SessionStorage:
    store = FileToolResultStore(root, sid, content_named=content_named)
    path = root / sid / (DECISIONS_FILE if branch is None else f"decisions.{branch}.jsonl")
    records = TranscriptWriter(path, sid, fsync_each=fsync_each, hold_open=True)

    def load() -> Transcript | None:
        try:
            size = os.lstat(path).st_size  # before it is read: more found later is news
        except (FileNotFoundError, NotADirectoryError):
            records.loaded(0)
            return None
        loaded = load_transcript(path, strict=False)
        records.loaded(size)
        return loaded

    return SessionStorage(
        session_id=sid,
        location=str(root),
        store=store,
        records=records,
        load=load,
        reader=PersistedOutputReader(store.directory),
        changed_elsewhere=records.changed_elsewhere,
        branch=branch,
        sync=None if fsync_each else records.sync,
    )


def _on_objects(
    store: ObjectStoreAPI,
    uri_base: str,
    prefix: str,
    sid: str,
    writer_id: str | None,
    location: str,
    branch: str | None = None,
    content_named: bool = False,
    spool: Spool | None = None,
) -> SessionStorage:
    from pipeline.store.object_reader import ObjectOutputReader
    from pipeline.store.object_records import ObjectRecordLog
    from pipeline.store.objects import RECORDS_SUBDIR, ObjectToolResultStore

    records = ObjectRecordLog(
        store,
        prefix=prefix,
        session_id=sid,
        uri_base=uri_base,
        writer_id=writer_id,
        records=RECORDS_SUBDIR if branch is None else f"{RECORDS_SUBDIR}.{branch}",
    )
    results = ObjectToolResultStore(
        store,
        prefix=prefix,
        session_id=sid,
        uri_base=uri_base,
        content_named=content_named,
        spool=spool,
    )
    return SessionStorage(
        session_id=sid,
        location=location,
        store=results,
        records=records,
        load=records.load,
        reader=ObjectOutputReader(store, results.layout, spool=spool),
        changed_elsewhere=records.changed_elsewhere,
        branch=branch,
        shared=True,
        drain=None if spool is None else results.drain,
        compact=records.compact,
    )


def readback_for(store: object) -> PagedReader | None:
    """The read-back tool for what ``store`` persists: local files or an object store's
    objects; None for a store of another kind."""
    if isinstance(store, FileToolResultStore):
        return PersistedOutputReader(store.directory)
    # an object store is an instance of a class of pipeline.store.objects, which is then
    # imported: a session without obstore never imports it
    objects = sys.modules.get("pipeline.store.objects")
    if objects is not None and isinstance(store, objects.ObjectToolResultStore):
        from pipeline.store.object_reader import ObjectOutputReader

        return ObjectOutputReader(store.store, store.layout, spool=store.spool)
    return None
