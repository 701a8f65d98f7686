"""Persisted tool results on an object store (S3, GCS, Azure, in memory) through ``obstore``.

The object-store twin of :class:`~pipeline.store.files.FileToolResultStore`, for a fleet of workers
that share sessions. A result goes to ``<prefix>/<session>/tool-results/<stem>.<ext>``, named as
the file store names it (:func:`~pipeline.store.files.safe_file_stem`: a hostile id becomes
``unsafe.<sha256>``), and the model is shown the object's URI (``s3://bucket/...``).

Exclusive create is a conditional write (``PutMode`` ``"create"``: ``If-None-Match: *`` on S3
and Azure, ``ifGenerationMatch=0`` on GCS): of two workers racing on one result, one creates the
object and the other finds it there, reads it and reuses it only when it holds the same bytes,
so both send the same replacement. Different bytes under the name go to
``<stem>.<12 hex of their sha256>.<ext>``, also created exclusively; a mismatch there too is a
:class:`~pipeline.store.files.StoreError`. An object, once created, is never overwritten.

Needs the ``objectstore`` extra (``pip install 'sluicegate[objectstore]'``). An S3-compatible
server must honour ``If-None-Match`` on PUT (AWS S3 does since 2024-08; obstore's default
``conditional_put="etag"`` sends it): a server that ignores it would let a second writer
replace an object silently.
"""

from __future__ import annotations

import errno
import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import anyio.to_thread

try:
    from obstore.exceptions import AlreadyExistsError, PreconditionError
except ImportError as exc:  # pragma: no cover - the objectstore extra installs it
    raise ImportError(
        "the object-store backend needs obstore: pip install 'sluicegate[objectstore]'"
    ) from exc

from pipeline.logs import get_logger
from pipeline.store.files import (
    RESULT_NAME,
    TOOL_RESULTS_SUBDIR,
    StoreError,
    safe_file_stem,
    validate_session_id,
)
from pipeline.store.spool import Spool

if TYPE_CHECKING:
    from obstore import (
        GetOptions,
        GetResult,
        ListResult,
        ObjectMeta,
        PutMode,
        PutResult,
    )


__all__ = [
    "RECORDS_SUBDIR",
    "ObjectLayout",
    "ObjectStoreAPI",
    "ObjectToolResultStore",
    "is_create_conflict",
    "normalize_prefix",
    "place_object",
]

RECORDS_SUBDIR = "records"
_SEGMENT = re.compile(r"[A-Za-z0-9_.=-]{1,255}")
_URI_BASE = re.compile(r"[a-z][a-z0-9+.-]*://[^\s?#]*")


class ObjectStoreAPI(Protocol):
    """The calls this backend makes on a store: what every ``obstore`` store offers
    (``S3Store``, ``GCSStore``, ``AzureStore``, ``MemoryStore``, ``LocalStore``). A wrapper with
    the same methods can stand in (the tests put faults in one this way). Blocking calls."""

    def put(self, path: str, file: bytes, *, mode: PutMode | None = None) -> PutResult:
        """``obstore.put``: ``mode="create"`` raises ``AlreadyExistsError`` if ``path`` exists."""
        ...

    def get(self, path: str, *, options: GetOptions | None = None) -> GetResult:
        """``obstore.get``; ``FileNotFoundError`` when nothing is at ``path``."""
        ...

    def head(self, path: str) -> ObjectMeta:
        """``obstore.head``; ``FileNotFoundError`` when nothing is at ``path``."""
        ...

    def list(
        self, prefix: str | None = None, *, offset: str | None = None
    ) -> Iterable[Sequence[ObjectMeta]]:
        """``obstore.list``: keys under ``prefix`` (whole segments), after ``offset`` if given."""
        ...

    def list_with_delimiter(self, prefix: str | None = None) -> ListResult[Sequence[ObjectMeta]]:
        """``obstore.list_with_delimiter``: the "directories" (``common_prefixes``) and
        objects directly under ``prefix``."""
        ...

    def delete(self, paths: str | Sequence[str]) -> None:
        """``obstore.delete``: the objects at ``paths`` (a batch where the store has one); a
        path with nothing at it may raise ``FileNotFoundError``."""
        ...


def is_create_conflict(exc: BaseException) -> bool:
    """Whether a ``mode="create"`` put failed because something is already at the key (stores
    report it as ``AlreadyExistsError``; a precondition failure means the same there)."""
    return isinstance(exc, AlreadyExistsError | PreconditionError)


def normalize_prefix(prefix: str) -> str:
    """``prefix`` without leading or trailing slashes, refused (``ValueError``) unless every
    segment is ``[A-Za-z0-9_.=-]{1,255}`` and none is ``.`` or ``..``: a key built on it must
    stay where it says."""
    if not isinstance(prefix, str):
        raise ValueError(f"an object prefix must be a string, got {type(prefix).__name__}")
    stripped = prefix.strip("/")
    if not stripped:
        return ""
    for segment in stripped.split("/"):
        if not _SEGMENT.fullmatch(segment) or segment in (".", ".."):
            raise ValueError(
                f"object prefix {prefix[:200]!r}: each segment must match [A-Za-z0-9_.=-]{{1,255}} "
                "and not be '.' or '..'"
            )
    return stripped


@dataclass(frozen=True, slots=True)
class ObjectLayout:
    """Where a session's objects go and the URIs that name them.

    ``prefix``: a key prefix in the store (``""`` for none); ``uri_base``: the URI of the
    store's key root (``s3://bucket``, ``memory://``), so that the URI of key ``k`` is
    ``<uri_base>/<k>``.
    """

    session_id: str
    prefix: str = ""
    uri_base: str = "memory://"
    records: str = RECORDS_SUBDIR
    """The name of the session's records "directory" (one per branch of a conversation)."""

    def __post_init__(self) -> None:
        validate_session_id(self.session_id)
        validate_session_id(self.records)
        object.__setattr__(self, "prefix", normalize_prefix(self.prefix))
        if not isinstance(self.uri_base, str) or not _URI_BASE.fullmatch(self.uri_base):
            raise ValueError(
                f"uri_base must be a URI such as 's3://bucket', got {str(self.uri_base)[:200]!r}"
            )
        scheme, rest = self.uri_base.split("://", 1)
        # trailing slashes off the location, not off the scheme's "://" ("memory://" stays)
        object.__setattr__(self, "uri_base", f"{scheme}://{rest.rstrip('/')}")

    def _dir(self, subdir: str) -> str:
        return "/".join(p for p in (self.prefix, self.session_id, subdir) if p)

    @property
    def results_dir(self) -> str:
        """The key prefix of the session's tool results (no trailing slash)."""
        return self._dir(TOOL_RESULTS_SUBDIR)

    @property
    def records_dir(self) -> str:
        """The key prefix of the session's record objects (no trailing slash)."""
        return self._dir(self.records)

    def uri(self, key: str) -> str:
        """The URI the model is shown for ``key``."""
        return f"{self.uri_base}/{key}"

    def result_key(self, uri: str) -> str | None:
        """The key of a tool result of this session named by ``uri``; None for any other URI
        (another bucket, prefix or session, a name this layout never gives, a traversal)."""
        head = f"{self.uri_base}/{self.results_dir}/"
        if not uri.startswith(head) or not RESULT_NAME.fullmatch(uri[len(head) :]):
            return None
        return uri[len(self.uri_base) + 1 :]


class ObjectToolResultStore:
    """:class:`~pipeline.store.files.ToolResultStore` on an object store (see the module docstring).

    ``store``: an ``obstore`` store (or anything with :class:`ObjectStoreAPI`'s methods);
    ``prefix``, ``session_id``, ``uri_base``: see :class:`ObjectLayout`; ``content_named``:
    every result under its content's name, as
    :class:`~pipeline.store.files.FileToolResultStore` does with it. ``persist`` returns the URI
    of the object that holds the text. An error of the store (unreachable, denied) puts the
    result in ``spool`` (:class:`~pipeline.store.spool.Spool`) when there is one and it has
    room, with the URI the store's write would have given; else it propagates: the budget then
    sends the original and records ``persist_failed``.
    """

    def __init__(
        self,
        store: ObjectStoreAPI,
        *,
        prefix: str = "",
        session_id: str,
        uri_base: str,
        content_named: bool = False,
        spool: Spool | None = None,
    ) -> None:
        self.store = store
        self.layout = ObjectLayout(session_id, prefix, uri_base)
        self.session_id = self.layout.session_id
        self.content_named = content_named
        self.spool = spool
        """Where a result goes when the store cannot take it (:mod:`pipeline.store.spool`)."""
        self._spooled: set[str] = set()
        """Keys this store's last write of each put in the spool."""

    def spooled(self, uri: str) -> bool:
        """Whether the result at ``uri`` waits in the spool (the store did not take it yet):
        what a decision's span says of a persist in an outage."""
        key = self.layout.result_key(uri)
        if self.spool is None or key is None or key not in self._spooled:
            return False
        return self.spool.path_of(key) is not None  # not written to the store since

    def key_for(self, tool_use_id: str, ext: str) -> str:
        """The key of ``tool_use_id``'s result when nothing else is in the way."""
        if ext not in ("txt", "json"):
            raise ValueError(f"unsupported extension {ext!r}")
        return f"{self.layout.results_dir}/{safe_file_stem(tool_use_id)}.{ext}"

    async def persist(self, tool_use_id: str, text: str, ext: str) -> str:
        """Create the object for ``text`` (UTF-8) or reuse one holding the same bytes; return
        its URI."""
        key = self.key_for(tool_use_id, ext)
        data = text.encode("utf-8", errors="surrogatepass")
        # the blocking client in a worker thread: obstore's own async calls need asyncio,
        # and the pipeline runs on any anyio backend (trio included)
        final = await anyio.to_thread.run_sync(self._write, key, data)
        return self.layout.uri(final)

    # -- blocking part, run in a worker thread ----------------------------------------------
    def _write(self, key: str, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()[:12]
        stem, ext = key.rsplit(".", 1)
        distinct = f"{stem}.{digest}.{ext}"
        plain_taken = self.content_named
        try:
            if not self.content_named:
                if self._place(key, data):
                    self._spooled.discard(key)
                    return key
                plain_taken = True  # other bytes there: this result goes by its content's name
            if self._place(distinct, data):
                self._spooled.discard(distinct)
                return distinct
        except Exception:
            # the store is down or refused the write: spooled, the result gets the replacement
            # the write would have given (a content-named one: the same on every worker)
            spooled = distinct if plain_taken else key
            if self.spool is not None and self.spool.put(spooled, data):
                get_logger(session_id=self.session_id).warning("store.spooled", bytes=len(data))
                self._spooled.add(spooled)
                return spooled
            raise
        raise StoreError(
            errno.EEXIST,
            "different objects hold both names for this result",
            self.layout.uri(distinct),
        )

    def _place(self, key: str, data: bytes) -> bool:
        return place_object(self.store, key, data)

    def drain(self, *, force: bool = False) -> tuple[int, int]:
        """Write what :attr:`spool` holds to the store (blocking): (written, still waiting;
        -1: not asked now -- a drain runs elsewhere, ran less than a second ago unless
        ``force``, or the store's circuit breaker is open)."""
        if self.spool is None or not self.spool.waiting():
            self._spooled.clear()  # nothing waits: what was spooled has reached the store
            return 0, 0
        if getattr(self.store, "open", None) is True:  # a circuit breaker that is open
            return 0, -1
        return self.spool.drain(self._place, force=force)


def place_object(store: ObjectStoreAPI, key: str, data: bytes) -> bool:
    """Make ``key`` hold ``data``, never replacing other bytes: True when it does (created, or
    already holding those bytes), False when other bytes are there. Raises what the store
    raises otherwise."""
    for _ in range(2):
        try:
            store.put(key, data, mode="create")
            return True
        except Exception as exc:
            if not is_create_conflict(exc):
                raise
        # someone created it first: it counts only if it holds our bytes
        try:
            found = store.get(key)
        except FileNotFoundError:
            continue  # created and gone again (a prune): try to create it once more
        if found.meta["size"] != len(data):
            return False
        return bytes(found.bytes()) == data
    raise StoreError(errno.EAGAIN, "a result object keeps appearing and vanishing", key)
