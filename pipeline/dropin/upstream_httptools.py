"""The proxy's upstream calls on asyncio's own connections, their answers read by llhttp
(:class:`HttptoolsTransport`): an ``httpx2`` transport, so the proxy reads every answer as before
(an ``httpx2.Response``: its status, headers and body, decoded as ``httpx2`` decodes it), at 0.6
of the CPU aiohttp spends on a call and a quarter of ``httpx2``'s own transport's
(``tests/benchmarks/bench_upstream.py``): a request is its head and its body written to a kept
connection, an answer is what the parser hands on, and nothing else runs.

It sends what it is given and nothing else: the request's own headers (and ``Host`` and
``Content-Length``, as ``httpx2`` writes them), its URL's path and query as written, no cookies,
no redirects followed, no proxy, the answer's body undecoded (``httpx2`` decodes it). A header
that HTTP cannot carry as it is (a name that is not a token, a value with a control character
but a tab, or one that starts or ends blank) is refused before anything is sent
(``httpx2.LocalProtocolError``). Certificates are checked against the same authorities as
``httpx2``'s (``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` honoured), and over TLS it offers HTTP/1.1
alone (ALPN), the one protocol it reads.

What it reads: an answer as HTTP/1.1 frames it (a length, chunks, or the connection's end);
an informational answer (``100 Continue``) before it passed over, one with a body refused, as
is a ``101`` (nothing asks to switch); a HEAD request's answer ended at its head; trailers not
read; an answer framed two ways, or a second answer to one request, never read
(``httpx2.RemoteProtocolError``).

Bounds: at most ``max_connections`` connections (a call past them waits for one, within its
bound: ``httpx2.PoolTimeout``); an idle one closed after ``keepalive_expiry`` seconds, and never
used again once its server said anything while it was idle, read or still in the socket (those
bytes would be read as the next call's answer -- another tenant's, maybe); a connection whose
answer was not read to its end, whose call gave up, or whose answer came as HTTP/1.0 is closed,
and one whose answer was dropped unread is closed when it is let go of. An answer's head may
take 256 KiB (256 fields of up to 64 KiB each), a chunk's line or the trailers 64 KiB; at most
256 KiB of its body wait to be read (the socket is not read meanwhile). Failures are
``httpx2``'s exceptions, so a caller tells a timeout from an unreachable upstream as before.
It runs on asyncio only: a caller on another event loop uses ``httpx2``'s own transport
(:class:`~pipeline.dropin.upstream.Upstream` chooses per call).
"""

from __future__ import annotations

import asyncio
import re
import select
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import NamedTuple

import httptools
import httpx2

from pipeline.dropin.upstream_fast import FastTransport, head_bound

__all__ = ["HttptoolsTransport"]

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
_JOINED = 64 * 1024
"""A body up to this long goes out in one write with its head (one packet for a short
request); a longer one in a write of its own, not copied."""
_TARGETS_KEPT = 64
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_UNSENDABLE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_BLANKS = (b" ", b"\t")
"""What a header value may not hold: a control character but the tab (a line break would
start a header of the caller's making)."""


class _Target(NamedTuple):
    origin: tuple[str, str, int]
    """Scheme, host (as connected to) and port."""
    head: bytes
    """The request line's target and the ``Host`` field, as ``httpx2`` writes them."""


class _Connection(asyncio.Protocol):
    """One connection to the upstream: an answer at a time, read by llhttp as it comes."""

    def __init__(self, pool: HttptoolsTransport, origin: tuple[str, str, int]) -> None:
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
            raise _Refused("an answer past the answer")

    def on_status(self, reason: bytes) -> None:
        self.reason += reason
        if len(self.reason) > HEAD_FIELD:
            raise _Refused("the answer's status line is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:  # a trailer: not read
            return
        if len(self.fields) >= HEAD_FIELDS:
            raise _Refused(f"the answer has more than {HEAD_FIELDS} header fields")
        if len(name) + len(value) > HEAD_FIELD:
            raise _Refused("a header field of the answer is too long")
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        framed = any(n.lower() in (b"content-length", b"transfer-encoding") for n, _ in self.fields)
        if status == 101:
            raise _Refused("the upstream switched protocols unasked")
        if 100 <= status < 200:
            if framed:  # llhttp would read it a body, the next answer's start
                raise _Refused("an informational answer with a body")
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


class _Refused(Exception):
    """An answer past a bound (raised in a parser's callback, which llhttp turns into an
    error of the parse)."""


def _read_error(exc: Exception) -> httpx2.HTTPError:
    return httpx2.ReadError(str(exc) or type(exc).__name__)


class _Body(httpx2.AsyncByteStream):
    """An answer's body as its connection reads it; the connection back in the pool once read
    to its end, closed otherwise."""

    def __init__(self, pool: HttptoolsTransport, conn: _Connection, read: float | None) -> None:
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


class HttptoolsTransport(FastTransport):
    """``httpx2.AsyncBaseTransport`` on asyncio's connections: at most ``max_connections``
    connections, idle ones closed after ``keepalive_expiry`` seconds; ``ssl_context``: the
    certificate checks (default: ``httpx2``'s). Each request's ``timeout`` extension (as
    ``httpx2`` sets it) bounds connecting (``connect``); from the start, sending the request
    and receiving the answer's head (the longest of ``read``, ``write`` and ``pool``, waiting
    for a connection included, past ``connect``); the wait for the head once the request is
    written, and each wait for the answer's body (``read``).

    One event loop at a time: its connections are made on the first request's loop; a request
    on another loop while any is open is a ``RuntimeError`` (they could not be closed from
    there)."""

    def __init__(
        self,
        *,
        max_connections: int,
        keepalive_expiry: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self._limit = max_connections
        self._expiry = keepalive_expiry
        if ssl_context is None:
            ssl_context = httpx2.create_ssl_context()
            ssl_context.set_alpn_protocols(["http/1.1"])  # the one this client speaks
        self._ssl = ssl_context
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open = 0
        """Connections open or opening."""
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._targets: dict[str, _Target] = {}
        self._closing = False
        """Closed (:meth:`aclose`) and not asked for a call since: a call that ends now
        closes its connection rather than keeping it."""
        self._last_bounds: tuple[dict[str, float | None], float | None] | None = None

    async def send(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        content: bytes,
        timeouts: Mapping[str, float | None],
    ) -> httpx2.Response:
        """:meth:`FastTransport.send <pipeline.dropin.upstream_fast.FastTransport.send>`."""
        loop = self._here()
        self._closing = False
        target = self._target(url)
        head = _request_head(method, target.head, headers, len(content))
        bound = self._bound(timeouts)
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(bound):
                conn = await self._connection(target.origin, timeouts.get("connect"), loop)
                if conn.gone:  # closed as it opened
                    raise httpx2.ConnectError("the upstream closed the connection at once")
                answered = conn.start(loop, method)
                transport = conn.transport
                assert transport is not None
                if len(content) <= _JOINED:
                    transport.write(head + content)
                else:
                    transport.write(head)
                    transport.write(content)
                async with asyncio.timeout(timeouts.get("read")):  # no word for that long
                    await answered
        except TimeoutError:
            if conn is None:
                raise httpx2.PoolTimeout("no connection to the upstream came free") from None
            self.discard(conn)
            raise httpx2.ReadTimeout("the upstream did not answer in time") from None
        except BaseException:
            if conn is not None:
                self.discard(conn)
            raise
        return httpx2.Response(
            conn.status,
            headers=conn.fields,
            stream=_Body(self, conn, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": conn.reason},
        )

    # -- the pool -----------------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop its connections are on (None before the first call)."""
        return self._loop

    def _here(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._open:
                raise RuntimeError(
                    "an HttptoolsTransport serves one event loop at a time: aclose() it on the "
                    "loop it served before using it on another"
                )
            self._loop, self._waiting = loop, deque()
        return loop

    async def _connection(
        self, origin: tuple[str, str, int], connect: float | None, loop: asyncio.AbstractEventLoop
    ) -> _Connection:
        while True:
            kept = self._idle.get(origin)
            while kept:
                conn = kept.pop()
                if conn.idle_timer is not None:
                    conn.idle_timer.cancel()
                    conn.idle_timer = None
                if conn.reusable and not conn.gone and not _said_something(conn):
                    return conn
                self.discard(conn)
            if self._open < self._limit:
                return await self._connect(origin, connect, loop)
            # all taken: an idle one elsewhere makes room, else wait for one to end
            other = next((c for kept in self._idle.values() for c in kept), None)
            if other is not None:
                self.discard(other)
                continue
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiting.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then cancelled: the room is the next one's
                else:
                    waiter.cancel()  # (passed over by _wake_one)
                raise

    async def _connect(
        self, origin: tuple[str, str, int], bound: float | None, loop: asyncio.AbstractEventLoop
    ) -> _Connection:
        scheme, host, port = origin
        tls = self._ssl if scheme == "https" else None
        made: list[_Connection] = []

        def made_here() -> _Connection:
            made.append(_Connection(self, origin))
            return made[0]

        self._open += 1  # counted out once by discard() when made, else here
        try:
            async with asyncio.timeout(bound):
                _, conn = await loop.create_connection(
                    made_here,
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls is not None else None,
                )
        except BaseException as exc:
            if made:
                self.discard(made[0])
            else:
                self._open -= 1
                self._wake_one()
            if isinstance(exc, TimeoutError):
                raise httpx2.ConnectTimeout(f"connecting to {host}:{port} took too long") from None
            if isinstance(exc, OSError):  # ssl.SSLError too: a certificate refused
                raise httpx2.ConnectError(str(exc) or type(exc).__name__) from exc
            raise
        return conn

    def release(self, conn: _Connection) -> None:
        """A call is over with ``conn``: kept for the next when it can serve one, else closed."""
        conn.busy = False
        if conn.gone:
            return
        if not (conn.reusable and conn.complete) or self._loop is None or self._closing:
            self.discard(conn)
            return
        if conn.paused and conn.transport is not None:  # idle, it reads: a word is seen
            conn.paused = False
            conn.transport.resume_reading()
        conn.idle_timer = self._loop.call_later(self._expiry, self.discard, conn)
        self._idle.setdefault(conn.origin, []).append(conn)
        self._wake_one()

    def discard(self, conn: _Connection) -> None:
        """Close ``conn`` and count it out (once)."""
        conn.reusable = False
        if conn.gone:
            return
        conn.gone = True
        self._open -= 1
        if conn.idle_timer is not None:
            conn.idle_timer.cancel()
            conn.idle_timer = None
        kept = self._idle.get(conn.origin)
        if kept is not None and conn in kept:
            kept.remove(conn)
        if conn.transport is not None:
            # no TLS close_notify awaited: a server that never answers one would keep it
            conn.transport.abort()
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def aclose(self) -> None:
        """Close the idle connections (of the loop this runs on); one still in a call closes
        when the call ends."""
        if self._loop is not asyncio.get_running_loop():
            return
        self._closing = True
        for kept in list(self._idle.values()):
            for conn in list(kept):
                self.discard(conn)
        self._idle.clear()

    # -- requests -----------------------------------------------------------------------------
    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            target = _parse_target(url)
            if len(self._targets) >= _TARGETS_KEPT:
                self._targets.clear()
            self._targets[url] = target
        return target

    def _bound(self, timeouts: Mapping[str, float | None]) -> float | None:
        """The bound of connecting, sending and the answer's head (the last one kept: a caller
        asks with the same every time)."""
        last = self._last_bounds
        if last is not None and last[0] == timeouts:
            return last[1]
        bound = head_bound(timeouts)
        self._last_bounds = (dict(timeouts), bound)
        return bound


def _parse_target(url: str) -> _Target:
    parsed = httpx2.URL(url)
    scheme = parsed.scheme
    if scheme not in ("http", "https") or not parsed.host:
        raise httpx2.UnsupportedProtocol(f"not an http:// or https:// URL: {url!r}")
    port = parsed.port or (443 if scheme == "https" else 80)
    netloc = parsed.netloc  # the host (IDNA) and a port that is not the scheme's, as httpx2's
    head = parsed.raw_path + b" HTTP/1.1\r\nHost: " + netloc + b"\r\n"
    return _Target((scheme, parsed.host, port), head)


def _request_head(method: str, target: bytes, headers: list[tuple[str, str]], length: int) -> bytes:
    raw_method = method.encode("latin-1")
    if not _TOKEN.fullmatch(raw_method):
        raise httpx2.LocalProtocolError(f"not a method HTTP can carry: {method[:40]!r}")
    lines = [raw_method, b" ", target]
    for name, value in headers:
        raw_name, raw_value = name.encode("latin-1"), value.encode("latin-1")
        if not _TOKEN.fullmatch(raw_name):
            raise httpx2.LocalProtocolError(f"not a header name HTTP can carry: {name[:40]!r}")
        if _UNSENDABLE.search(raw_value):
            raise httpx2.LocalProtocolError(f"header {name[:40]} holds a control character")
        if raw_value[:1] in _BLANKS or raw_value[-1:] in _BLANKS:
            raise httpx2.LocalProtocolError(f"header {name[:40]} starts or ends blank")
        lines += (raw_name, b": ", raw_value, b"\r\n")
    lines.append(b"Content-Length: %d\r\n\r\n" % length)
    return b"".join(lines)


def _said_something(conn: _Connection) -> bool:
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
