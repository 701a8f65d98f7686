"""The read-back tool for outputs persisted on an object store, by their URI.

:class:`ObjectOutputReader` is the object-store twin of
:class:`~pipeline.store.readback.PersistedOutputReader`: the same tool name, definition and pages,
so
the model pages through a result another worker persisted (``s3://bucket/.../x.txt``) exactly as
through a local file. It reads only the results of its own session in its own store: a URI of
another bucket, prefix or session, or a name its store never gives, is refused like a path
outside the store directory.

Reads are ranged. The first call on an object streams it once to count its lines and mark
where every 1,000th line (and at least every 1 MiB) starts; the marks are kept (objects are
never overwritten; they are keyed by ETag and size all the same), so a later page reads only
from the mark before it, in 256 KiB ranges, however far into a large result it lies.
"""

from __future__ import annotations

import bisect
import io
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.store.objects import ObjectLayout, ObjectStoreAPI
from pipeline.store.readback import (
    _EOL,
    DEFAULT_LIMIT_LINES,
    DEFAULT_MAX_CHARS,
    READBACK_DESCRIPTION,
    READBACK_TOOL_NAME,
    PagedReader,
    ReadbackError,
    _shown,
    _skip_lines,
)
from pipeline.store.spool import Spool

if TYPE_CHECKING:
    from obstore import GetOptions, ObjectMeta

__all__ = ["ObjectOutputReader"]

MARK_LINES = 1_000
MARK_BYTES = 1 << 20
_RANGE = 256 * 1024
"""Bytes per ranged read while paging."""
_STREAM_CHUNK = 1 << 20
_CACHED_OBJECTS = 64


@dataclass(frozen=True, slots=True)
class LineIndex:
    """Where lines start in one object: line ``lines_before[i] + 1`` starts at byte
    ``offsets[i]``; ``total`` lines in all (a last line without a line end counts)."""

    lines_before: list[int]
    offsets: list[int]
    total: int

    def mark_for(self, line: int) -> tuple[int, int]:
        """(lines before the mark, its byte offset) of the last mark at or before ``line``."""
        i = bisect.bisect_right(self.lines_before, line - 1) - 1
        return self.lines_before[i], self.offsets[i]


def index_lines(chunks: Iterable[bytes]) -> LineIndex:
    """Count the lines of a byte stream and mark line starts, as the read-back tool counts
    lines (``\\r\\n``, ``\\r`` and ``\\n`` each end one)."""
    lines_before, offsets = [0], [0]
    lines = pos = 0
    carry = last = b""
    for chunk in chunks:
        buf = carry + chunk
        carry = b""
        if buf.endswith(b"\r"):
            buf, carry = buf[:-1], b"\r"  # maybe half a '\r\n': decide with the next chunk
        for match in _EOL.finditer(buf):
            lines += 1
            end = pos + match.end()
            if lines - lines_before[-1] >= MARK_LINES or end - offsets[-1] >= MARK_BYTES:
                lines_before.append(lines)
                offsets.append(end)
        pos += len(buf)
        if buf:
            last = buf[-1:]
    if carry:
        lines += 1
        last = carry
    if last not in (b"", b"\n", b"\r"):
        lines += 1
    return LineIndex(lines_before, offsets, lines)


class _RangedObject(io.RawIOBase):
    """One object as a seekable raw stream: every read is one ranged GET, conditional on the
    ETag the page started with (a replaced object fails the read instead of mixing)."""

    def __init__(self, store: ObjectStoreAPI, key: str, meta: ObjectMeta) -> None:
        super().__init__()
        self._store, self._key = store, key
        self._size, self._etag = meta["size"], meta["e_tag"]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]  # a view is what BufferedReader passes
        # a range past the end is an error on the store: the end is known, so stop there
        if self._pos >= self._size:
            return 0
        end = min(self._size, self._pos + len(buffer))
        options: GetOptions = {"range": (self._pos, end)}
        if self._etag is not None:
            options["if_match"] = self._etag
        data = bytes(self._store.get(self._key, options=options).bytes())[: end - self._pos]
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


class ObjectOutputReader(PagedReader):
    """The read-back tool (``read_persisted_output``) for one session's results on an object
    store, named by their URIs (see the module docstring).

    ``store``, ``layout`` and ``spool``: those of the
    :class:`~pipeline.store.objects.ObjectToolResultStore` that wrote them (a result in its
    spool is read from there).
    """

    name = READBACK_TOOL_NAME

    def __init__(
        self,
        store: ObjectStoreAPI,
        layout: ObjectLayout,
        *,
        default_limit: int = DEFAULT_LIMIT_LINES,
        max_chars: int = DEFAULT_MAX_CHARS,
        spool: Spool | None = None,
    ) -> None:
        super().__init__(
            name=READBACK_TOOL_NAME,
            description=READBACK_DESCRIPTION,
            default_limit=default_limit,
            max_chars=max_chars,
        )
        self.store = store
        self.layout = layout
        self.spool = spool
        """Results this worker persisted while the store was down, read from here until they
        are written to it."""
        self._indexes: OrderedDict[tuple[str, str | None, int], LineIndex] = OrderedDict()
        self._lock = threading.Lock()

    def resolve(self, uri: str) -> str:
        """The key of the result ``uri`` names, refused (:class:`ReadbackError`) unless it is
        one of this session's results in this store."""
        key = self.layout.result_key(uri)
        if key is None:
            where = self.layout.uri(self.layout.results_dir)
            raise ReadbackError(
                f"no readable output at {_shown(uri)} (only outputs saved under {where}/)"
            )
        return key

    def _read(self, path: str, offset: int, limit: int) -> str:
        key = self.resolve(path)
        spooled = self.spool.path_of(key) if self.spool is not None else None
        if spooled is not None:
            try:
                return self._page_file(spooled, path, offset, limit)
            except FileNotFoundError:
                pass  # written to the store meanwhile: read there
        try:
            meta = self.store.head(key)
        except FileNotFoundError:
            raise ReadbackError(f"no readable output at {_shown(path)} (not found)") from None
        except Exception as exc:  # unreachable, denied...: named by type (messages hold URLs)
            raise ReadbackError(f"cannot read {_shown(path)}: {type(exc).__name__}") from exc
        try:
            return self._page(key, meta, offset, limit)
        except ReadbackError:
            raise
        except Exception as exc:
            raise ReadbackError(f"cannot read {_shown(path)}: {type(exc).__name__}") from exc

    def _page(self, key: str, meta: ObjectMeta, offset: int, limit: int) -> str:
        index = self._index(key, meta)
        if offset - 1 > index.total:
            raise self._past_end(offset, index.total)
        before, at = index.mark_for(offset)
        raw = io.BufferedReader(_RangedObject(self.store, key, meta), buffer_size=_RANGE)
        raw.seek(at)
        start, skipped = _skip_lines(raw, offset - 1 - before)
        if skipped < offset - 1 - before:
            raise self._past_end(offset, before + skipped)
        raw.seek(at + start)
        return self._page_at(raw, offset, limit, lambda _text, last: index.total - last)

    def _index(self, key: str, meta: ObjectMeta) -> LineIndex:
        cache_key = (key, meta["e_tag"], meta["size"])
        with self._lock:
            found = self._indexes.get(cache_key)
            if found is not None:
                self._indexes.move_to_end(cache_key)
                return found
        options: GetOptions = {}
        if meta["e_tag"] is not None:
            options["if_match"] = meta["e_tag"]
        stream = self.store.get(key, options=options).stream(min_chunk_size=_STREAM_CHUNK)
        index = index_lines(bytes(chunk) for chunk in stream)
        with self._lock:
            self._indexes[cache_key] = index
            while len(self._indexes) > _CACHED_OBJECTS:
                self._indexes.popitem(last=False)
        return index
