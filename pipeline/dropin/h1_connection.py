"""One upstream connection of :class:`~pipeline.dropin.upstream_httptools.HttptoolsTransport`
(:class:`Connection`): an answer at a time, read by llhttp as its bytes come, within the bounds
below, and its body (:class:`Body`) as the caller reads it. What it refuses is an
``httpx2.RemoteProtocolError``; the pool it belongs to (:class:`Pool`) keeps it for the next call
or closes it."""

from __future__ import annotations

import asyncio
import select
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol

import httptools
import httpx2

__all__ = [
    "BODY_HELD",
    "HEAD_BYTES",
    "HEAD_FIELD",
    "HEAD_FIELDS",
    "Body",
    "Connection",
    "Pool",
    "said_something",
]

HEAD_FIELD = 64 * 1024
"""The longest status line, and header field (name and value), of an answer read; also the
most bytes read past an answer's head with nothing of its body in them (a chunk's line)."""
HEAD_FIELDS = 256
"""The most header fields an answer may have."""
HEAD_BYTES = 256 * 1024
"""The most bytes an answer's head may take, informational answers before it included (llhttp
copies a field's value again with each piece of it: a head is kept short)."""
BODY_HELD = 256 * 1024
"""Bytes of an answer's body held unread before its connection stops reading."""


class Pool(Protocol):
    """What a connection and its body ask of the pool they belong to."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the connections are on."""

    def release(self, conn: Connection) -> None:
        """A call is over with ``conn``: kept for the next when it can serve one, else closed."""

    def discard(self, conn: Connection) -> None:
        """Close ``conn`` and count it out (once)."""


class Connection(asyncio.Protocol):
    """One connection to the upstream: an answer at a time, read by llhttp as it comes."""

    def __init__(self, pool: Pool, origin: tuple[str, str, int]) -> None:
        self.pool, self.origin = pool, origin
        self.transport: asyncio.Transport | None = None
        self.busy = False
        """A call owns it (from its request's write to its answer's end)."""
        self.reusable = True
        """Nothing has happened that forbids another call on it."""
        self.gone = False
        """Closed, or counted out of the pool."""
        self.idle_timer: asyncio.TimerHandle | None = None
        self._begin_answer()

    def _begin_answer(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.head: asyncio.Future[None] | None = None
        self.status = 0
        self.reason = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.stalled = 0
        """Bytes read past the head since the body last moved on."""
        self.moved = False
        self.head_only = False
        """The answer to a HEAD request: its head is all of it."""
        self.head_done = False
        self.informational = False
        self.to_close = False
        """The answer's body ends with the connection (no length, not chunked)."""
        self.chunks: deque[bytes] = deque()
        self.held = 0
        self.paused = False
        self.complete = False
        self.failure: httpx2.HTTPError | None = None
        self.waiter: asyncio.Future[None] | None = None

    # -- the call's side ----------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, method: str) -> asyncio.Future[None]:
        """A new answer to read on this connection (to a ``method`` request): the future of
        its head."""
        self._begin_answer()
        self.head_only = method == "HEAD"
        self.busy = True
        self.head = loop.create_future()
        return self.head

    def take(self) -> bytes:
        """What the body holds that was not taken yet (empty: nothing now)."""
        if not self.chunks:
            return b""
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.held = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def body_wait(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        self.waiter = loop.create_future()
        return self.waiter

    # -- asyncio's side -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.complete:
            # bytes no call asked for: the next call would read them as its answer
            self.reusable = False
            self.pool.discard(self)
            return
        if not self.head_done:
            self.head_bytes += len(data)
            if self.head_bytes > HEAD_BYTES:
                self._fail(httpx2.RemoteProtocolError("the answer's head is too long"))
                return
        self.moved = False
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self.complete:  # bytes past the answer's end: it stands, the connection goes
                self.pool.discard(self)
            elif isinstance(exc, httptools.HttpParserUpgrade):
                self._fail(httpx2.RemoteProtocolError("the upstream switched protocols"))
            else:
                self._fail(httpx2.RemoteProtocolError(f"not an HTTP/1.1 answer: {exc}"))
            return
        if self.head_done and not self.complete:
            # a chunk's line, a trailer: bounded like a field of the head
            self.stalled = 0 if self.moved else self.stalled + len(data)
            if self.stalled > HEAD_FIELD:
                self._fail(httpx2.RemoteProtocolError("the answer's framing is too long"))

    def eof_received(self) -> bool:
        return False  # the transport closes: connection_lost tells the rest

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        if self.busy and not self.complete:
            if self.head_done and self.to_close and exc is None:
                self.on_message_complete()  # its body ended with the connection, as it said
            elif not self.head_done:
                why = "the upstream closed the connection without an answer"
                self._fail(httpx2.RemoteProtocolError(why) if exc is None else _read_error(exc))
            else:
                why = "the upstream closed the connection before the answer's end"
                self._fail(httpx2.RemoteProtocolError(why) if exc is None else _read_error(exc))
        self.pool.discard(self)

    def pause_writing(self) -> None:  # the body waits in the transport's buffer meanwhile
        pass

    def resume_writing(self) -> None:
        pass

    # -- llhttp's side ------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: not read (nor as the next's)
            raise Refused("an answer past the answer")

    def on_status(self, reason: bytes) -> None:
        self.reason += reason
        if len(self.reason) > HEAD_FIELD:
            raise Refused("the answer's status line is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:  # a trailer: not read
            return
        if len(self.fields) >= HEAD_FIELDS:
            raise Refused(f"the answer has more than {HEAD_FIELDS} header fields")
        if len(name) + len(value) > HEAD_FIELD:
            raise Refused("a header field of the answer is too long")
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        framed = any(n.lower() in (b"content-length", b"transfer-encoding") for n, _ in self.fields)
        if status == 101:
            raise Refused("the upstream switched protocols unasked")
        if 100 <= status < 200:
            if framed:  # llhttp would read it a body, the next answer's start
                raise Refused("an informational answer with a body")
            # an informational answer (100 Continue...): the real one follows
            self.informational = True
            self.fields, self.reason = [], b""
            return
        self.status = status
        self.head_done = True
        self.moved = True
        self.to_close = not framed and status not in (204, 304) and not self.head_only
        if self.parser.get_http_version() != "1.1":
            self.reusable = False  # HTTP/1.0 kept alive: as h11, never used again
        if self.head is not None and not self.head.done():
            self.head.set_result(None)
        if self.head_only:
            # llhttp is not told of HEAD: it would wait for the body the length announces
            self.reusable = False
            self.on_message_complete()

    def on_body(self, body: bytes) -> None:
        self.moved = True
        if self.complete:  # (a HEAD's answer: its head was all of it)
            return
        self.chunks.append(body)
        self.held += len(body)
        if self.held > BODY_HELD and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_chunk_header(self) -> None:
        self.moved = True

    def on_chunk_complete(self) -> None:
        self.moved = True

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        if self.complete:
            return
        self.complete = True
        if not self.parser.should_keep_alive() or self.to_close:
            self.reusable = False
        self._wake()

    # -- ends ---------------------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, failure: httpx2.HTTPError) -> None:
        self.reusable = False
        if self.failure is None:
            self.failure = failure
        for future in (self.head, self.waiter):
            if future is not None and not future.done():
                future.set_exception(failure)
        self.pool.discard(self)


class Refused(Exception):
    """An answer past a bound (raised in a parser's callback, which llhttp turns into an
    error of the parse)."""


def _read_error(exc: Exception) -> httpx2.HTTPError:
    return httpx2.ReadError(str(exc) or type(exc).__name__)


class Body(httpx2.AsyncByteStream):
    """An answer's body as its connection reads it; the connection back in the pool once read
    to its end, closed otherwise."""

    def __init__(self, pool: Pool, conn: Connection, read: float | None) -> None:
        self.pool, self.conn, self.read = pool, conn, read
        self.done = False

    def __del__(self) -> None:
        # an answer dropped unclosed (its reader failed before reading it): its connection
        # is closed, not held out of the pool for ever -- on its loop, whichever thread
        # lets go of it
        if not self.done:
            loop = self.pool.loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self.pool.discard, self.conn)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.conn
        loop = asyncio.get_running_loop()
        while True:
            data = conn.take()
            if data:
                yield data
                continue
            if conn.failure is not None:
                raise conn.failure
            if conn.complete:
                break
            waiter = conn.body_wait(loop)
            try:
                async with asyncio.timeout(self.read):
                    await waiter
            except TimeoutError:
                self.pool.discard(conn)
                raise httpx2.ReadTimeout("the upstream's answer stopped coming") from None
        await self.aclose()

    async def aclose(self) -> None:
        if self.done:
            return
        self.done = True
        self.pool.release(self.conn)


def said_something(conn: Connection) -> bool:
    """Whether the server sent bytes on ``conn`` that the loop has not read yet (an idle
    connection about to serve a call: those bytes would be read as its answer). A connection
    whose socket cannot be polled counts as having spoken."""
    transport = conn.transport
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is None:
        return True
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True
