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
import ssl
from collections import deque
from collections.abc import Mapping
from typing import NamedTuple

import httpx2

from pipeline.dropin.h1_connection import Body, Connection, said_something
from pipeline.dropin.upstream_fast import FastTransport, head_bound

__all__ = ["HttptoolsTransport"]

_JOINED = 64 * 1024
"""A body up to this long goes out in one write with its head (one packet for a short
request); a longer one in a write of its own, not copied."""
_TARGETS_KEPT = 64
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_UNSENDABLE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
"""What a header value may not hold: a control character but the tab (a line break would
start a header of the caller's making)."""
_BLANKS = (b" ", b"\t")


class _Target(NamedTuple):
    origin: tuple[str, str, int]
    """Scheme, host (as connected to) and port."""
    head: bytes
    """The request line's target and the ``Host`` field, as ``httpx2`` writes them."""


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
        if ssl_context is None:
            ssl_context = httpx2.create_ssl_context()
            ssl_context.set_alpn_protocols(["http/1.1"])  # the one this client speaks
        super().__init__(
            max_connections=max_connections,
            keepalive_expiry=keepalive_expiry,
            ssl_context=ssl_context,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open = 0
        """Connections open or opening."""
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._targets: dict[str, _Target] = {}
        self._closing = False
        """Closed (:meth:`aclose`) and not asked for a call since: a call that ends now
        closes its connection rather than keeping it."""

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
        bound = head_bound(timeouts)
        conn: Connection | None = None
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
            stream=Body(self, conn, timeouts.get("read")),
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
    ) -> Connection:
        while True:
            kept = self._idle.get(origin)
            while kept:
                conn = kept.pop()
                if conn.idle_timer is not None:
                    conn.idle_timer.cancel()
                    conn.idle_timer = None
                if conn.reusable and not conn.gone and not said_something(conn):
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
    ) -> Connection:
        scheme, host, port = origin
        tls = self._ssl if scheme == "https" else None
        made: list[Connection] = []

        def made_here() -> Connection:
            made.append(Connection(self, origin))
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

    def release(self, conn: Connection) -> None:
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

    def discard(self, conn: Connection) -> None:
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
