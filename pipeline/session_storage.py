"""Where a session's state lives, from one location: a local directory or an object store URL.

:func:`open_session_state` gives a :class:`SessionStorage`: the tool-result store, the record
log the session appends its decisions to, the loader of what was recorded before, and the
read-back tool for the results. A local directory is the default file backend, unchanged
(``<root>/<session>/tool-results/``, ``<root>/<session>/decisions.jsonl``, paths shown to the
model as Claude Code shows them); ``s3://bucket/prefix`` puts the same state on S3, shared by
every worker given the same URL (:mod:`pipeline.objectstore`, :mod:`pipeline.objectrecords`,
:mod:`pipeline.objectreader`; needs the ``objectstore`` extra); ``memory:///prefix`` keeps it
in memory (tests).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pipeline.readback import PagedReader, PersistedOutputReader
from pipeline.records import RecordLog
from pipeline.storage import FileToolResultStore, ToolResultStore, validate_session_id
from pipeline.transcript import Transcript, TranscriptWriter, load_transcript

if TYPE_CHECKING:
    from pipeline.objectstore import ObjectStoreAPI

__all__ = ["DECISIONS_FILE", "SessionStorage", "open_session_state"]

DECISIONS_FILE = "decisions.jsonl"
"""The local backend's record file: ``<root>/<session>/decisions.jsonl``."""

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
"""S3's bucket naming rules (the part that matters here: no slash, no case, no space)."""


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
      ``S3Config`` keys);
    - ``memory:///[prefix]``: a new in-memory store.

    ``object_store``: use this ``obstore`` store instead of building one from the URL (two
    workers in one process sharing a ``MemoryStore``; a store configured in code).
    ``writer_id``: names this worker's record objects (object stores only; a local file has
    one writer at a time). ``ValueError`` for an unsupported scheme or a malformed URL.
    """
    sid = validate_session_id(session_id)
    text = os.fspath(location)
    if not isinstance(text, str):
        raise ValueError("a store location must be a path or a URL string, not bytes")
    if "://" not in text:
        if options or object_store is not None:
            raise ValueError("store options apply to object store URLs, not to a local directory")
        return _local(Path(text), sid)
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ValueError(f"malformed store URL {_shown(text)}") from None
    scheme = parts.scheme.lower()
    if parts.username is not None or parts.password is not None:
        # credentials belong in the environment or the options, never in a URL that is logged
        raise ValueError(f"store URL {_shown(text)}: credentials in the URL are not accepted")
    if parts.query or parts.fragment or port is not None:
        raise ValueError(f"store URL {_shown(text)}: no port, query or fragment expected")
    if scheme == "s3":
        if not _BUCKET.fullmatch(parts.hostname or "") or parts.netloc != parts.hostname:
            raise ValueError(f"store URL {_shown(text)}: not a valid S3 bucket name")
        return _on_objects(
            f"s3://{parts.netloc}", parts.path, sid, writer_id, object_store, options, "s3"
        )
    if scheme == "memory":
        if parts.netloc:
            raise ValueError(f"store URL {_shown(text)}: a memory URL has no host (memory:///x)")
        return _on_objects("memory://", parts.path, sid, writer_id, object_store, options, "memory")
    raise ValueError(
        f"unsupported store URL scheme {scheme[:20]!r} in {_shown(text)}: give a local "
        "directory, s3://bucket/prefix or memory:///prefix"
    )


def _shown(url: str) -> str:
    """A URL as safe to put in an error: scheme and host only (a userinfo part or a query may
    hold a secret), bounded."""
    scheme, sep, rest = url.partition("://")
    host = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    return repr(f"{scheme[:20]}{sep}{host[:100]}/...")


def _local(root: Path, sid: str) -> SessionStorage:
    store = FileToolResultStore(root, sid)
    path = root / sid / DECISIONS_FILE

    def load() -> Transcript | None:
        return load_transcript(path, strict=False) if path.exists() else None

    return SessionStorage(
        session_id=sid,
        location=str(root),
        store=store,
        records=TranscriptWriter(path, sid),
        load=load,
        reader=PersistedOutputReader(store.directory),
    )


def _on_objects(
    uri_base: str,
    path: str,
    sid: str,
    writer_id: str | None,
    object_store: ObjectStoreAPI | None,
    options: dict[str, Any],
    kind: str,
) -> SessionStorage:
    # imported here: the local default must not need the objectstore extra
    from pipeline.objectreader import ObjectOutputReader
    from pipeline.objectrecords import ObjectRecordLog
    from pipeline.objectstore import ObjectLayout, ObjectToolResultStore

    layout = ObjectLayout(sid, path, uri_base)  # ValueError for a bad prefix
    store = object_store if object_store is not None else _build_store(kind, uri_base, options)
    prefix, base = layout.prefix, layout.uri_base
    records = ObjectRecordLog(
        store, prefix=prefix, session_id=sid, uri_base=base, writer_id=writer_id
    )
    return SessionStorage(
        session_id=sid,
        location=layout.uri(prefix) if prefix else base,
        store=ObjectToolResultStore(store, prefix=prefix, session_id=sid, uri_base=base),
        records=records,
        load=records.load,
        reader=ObjectOutputReader(store, prefix=prefix, session_id=sid, uri_base=base),
    )


def _build_store(kind: str, uri_base: str, options: dict[str, Any]) -> ObjectStoreAPI:
    from obstore.exceptions import BaseError
    from obstore.store import MemoryStore, S3Store

    if kind == "memory":
        if options:
            raise ValueError("a memory store takes no options")
        return MemoryStore()
    try:
        # the bucket only: the key prefix is ours to apply (it is in every key and URI)
        return S3Store.from_url(uri_base, **options)
    except (BaseError, TypeError) as exc:
        raise ValueError(
            f"cannot configure the S3 store {_shown(uri_base)}: {str(exc)[:300]}"
        ) from None
