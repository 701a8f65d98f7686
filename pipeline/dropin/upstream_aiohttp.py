"""The proxy's upstream calls on aiohttp (:class:`AiohttpTransport`): an ``httpx2`` transport, so
the proxy reads every answer as before (an ``httpx2.Response``: its status, headers and body,
decoded as ``httpx2`` decodes it) while the HTTP work is aiohttp's, which costs less than half
the CPU a call of ``httpx2``'s own transport (httpcore on h11, in Python).

It sends what it is given and nothing else: the request's own headers (aiohttp adds only
``Host`` and ``Content-Length``, as ``httpx2`` does -- but for a request without a body, a
``Content-Length: 0`` that ``httpx2`` leaves out; and it writes a header value as UTF-8, where
``httpx2`` sends the bytes it is given: :class:`~pipeline.dropin.upstream.Upstream` sends both
kinds by ``httpx2``), its URL as written (no re-quoting), no cookies, no redirects followed,
no proxy, the answer's body undecoded (``httpx2`` decodes it).
Certificates are checked against the same authorities as ``httpx2``'s (``SSL_CERT_FILE`` and
``SSL_CERT_DIR`` honoured). Its failures are ``httpx2``'s exceptions, so a caller tells a
timeout from an unreachable upstream as before. It runs on asyncio only (aiohttp's): a caller
on another event loop uses ``httpx2``'s own transport (:class:`~pipeline.dropin.upstream.Upstream`
chooses per call).
"""

from __future__ import annotations

import asyncio
import inspect
import ssl
import sys
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import httpx2
import yarl

from pipeline.dropin.upstream_fast import FastTransport, head_bound

__all__ = ["AiohttpTransport"]

_SSL_SHUTDOWN_LEAKS = sys.version_info < (3, 12, 8) or (3, 13, 0) <= sys.version_info < (3, 13, 1)
"""Whether asyncio keeps a TLS connection whose server never completes its shutdown (fixed in
3.12.8 and 3.13.1): aiohttp then aborts such a connection after two seconds, if asked."""

_TARGETS_KEPT = 64
_NOT_ADDED = ("Accept", "Accept-Encoding", "Content-Type", "User-Agent")
"""Headers aiohttp would add to a request that lacks them: none is, as ``httpx2`` adds none."""


_HEAD_FIELD = 64 * 1024
"""The longest line of an answer's head, and header, read (aiohttp's own default is 8 KiB; a
load balancer's cookie can be longer, and ``httpx2`` reads heads of up to 100 KiB)."""
_HEAD_FIELDS = 256
"""The most headers an answer may have (aiohttp's own default is 128)."""


def usable() -> str | None:
    """Why aiohttp cannot serve here (None: it can): this module checks each kept connection
    before reusing it in a method of aiohttp's pool, which must be as it expects."""
    get = getattr(aiohttp.TCPConnector, "_get", None)
    if not inspect.iscoroutinefunction(get):
        return "aiohttp's pool is not as this module expects (its _get is not a coroutine)"
    if list(inspect.signature(get).parameters) != ["self", "key", "traces"]:
        return "aiohttp's pool is not as this module expects (its _get takes other arguments)"
    if "max_headers" not in inspect.signature(aiohttp.ClientSession).parameters:
        return "aiohttp is older than 3.12"
    return None


class _QuietConnector(aiohttp.TCPConnector):
    """aiohttp's pool, that never reuses a connection on which the server said something while
    it was idle: those bytes would be read as the next request's answer -- another tenant's,
    maybe (``httpcore`` closes such a connection likewise)."""

    async def _get(self, key: Any, traces: Any) -> Any:
        while True:
            connection = await super()._get(key, traces)
            if connection is None or not _spoke_unasked(connection.protocol):
                return connection
            connection.close()


def _spoke_unasked(protocol: Any) -> bool:
    # bytes buffered or parsed on a connection no request owns: it cannot be reused as clean
    return protocol is None or bool(protocol.should_close)


class AiohttpTransport(FastTransport):
    """``httpx2.AsyncBaseTransport`` on an aiohttp session: at most ``max_connections``
    connections, idle ones closed after ``keepalive_expiry`` seconds; ``ssl_context``: the
    certificate checks (default: ``httpx2``'s). Each request's ``timeout`` extension (as
    ``httpx2`` sets it) bounds connecting (``connect``) and, from the start, sending the request
    and receiving the answer's head (the longest of ``read``, ``write`` and ``pool``, waiting
    for a connection included, past ``connect``), then each read of its body (``read``).
    An answer's head may hold 256 headers of up to 64 KiB each.

    One event loop at a time: the session is made on the first request, on that request's loop
    (a session belongs to the loop it was made on); a request on another loop while it is open
    is a ``RuntimeError`` (its connections could not be closed from there). ``ValueError`` where
    aiohttp is not as this module needs (:func:`usable`)."""

    def __init__(
        self,
        *,
        max_connections: int,
        keepalive_expiry: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(
            max_connections=max_connections,
            keepalive_expiry=keepalive_expiry,
            ssl_context=ssl_context,
        )
        unusable = usable()
        if unusable is not None:
            raise ValueError(unusable)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._targets: dict[str, yarl.URL] = {}
        """The URLs of the last requests, parsed."""
        self._last_bounds: tuple[dict[str, float | None], float | None, Any] | None = None

    def _session_here(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._session
        if session is not None and not session.closed and self._loop is not loop:
            raise RuntimeError(
                "an AiohttpTransport serves one event loop at a time: aclose() it on the loop "
                "it served before using it on another"
            )
        if session is None or session.closed:
            connector = _QuietConnector(
                limit=self._limit,
                keepalive_timeout=self._expiry,
                ssl=self._ssl,
                enable_cleanup_closed=_SSL_SHUTDOWN_LEAKS,
            )
            session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),  # one tenant's cookie never reaches another
                skip_auto_headers=_NOT_ADDED,
                auto_decompress=False,
                trust_env=False,  # no proxy and no .netrc credentials: Upstream decides
                timeout=aiohttp.ClientTimeout(total=None),
                max_line_size=_HEAD_FIELD,
                max_field_size=_HEAD_FIELD,
                max_headers=_HEAD_FIELDS,
            )
            self._session, self._loop = session, loop
        return session

    async def send(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        content: bytes,
        timeouts: Mapping[str, float | None],
    ) -> httpx2.Response:
        """:meth:`FastTransport.send <pipeline.dropin.upstream_fast.FastTransport.send>`
        (the URL sent without re-quoting)."""
        head, bounds = self._bounds(timeouts)
        session = self._session_here()
        target = self._targets.get(url)
        if target is None:
            target = yarl.URL(url, encoded=True)
            if len(self._targets) >= _TARGETS_KEPT:
                self._targets.clear()
            self._targets[url] = target
        try:
            async with asyncio.timeout(head):
                answer = await session.request(
                    method,
                    target,
                    data=content,
                    headers=headers,
                    allow_redirects=False,
                    timeout=bounds,
                )
        except Exception as exc:
            raise _failure(exc) from exc
        return httpx2.Response(
            answer.status,
            headers=list(answer.raw_headers),
            stream=_Body(answer),
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": (answer.reason or "").encode("latin-1", "replace"),
            },
        )

    def _bounds(self, timeouts: Mapping[str, float | None]) -> tuple[float | None, Any]:
        """The bound of sending and the answer's head, and aiohttp's timeouts, of ``timeouts``
        (the last ones asked for kept: a caller asks with the same every time)."""
        last = self._last_bounds
        if last is not None and last[0] == timeouts:
            return last[1], last[2]
        head = head_bound(timeouts)
        bounds = aiohttp.ClientTimeout(
            total=None,
            connect=None,
            sock_connect=timeouts.get("connect"),
            sock_read=timeouts.get("read"),
        )
        self._last_bounds = (dict(timeouts), head, bounds)
        return head, bounds

    async def aclose(self) -> None:
        """Close the session's connections (of the loop this runs on)."""
        session, self._session = self._session, None
        if session is not None and not session.closed and self._loop is asyncio.get_running_loop():
            await session.close()


class _Body(httpx2.AsyncByteStream):
    """An answer's body as aiohttp reads it, its failures ``httpx2``'s."""

    def __init__(self, answer: aiohttp.ClientResponse) -> None:
        self._answer = answer

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._answer.content.iter_any():
                yield chunk
        except Exception as exc:
            raise _failure(exc) from exc

    async def aclose(self) -> None:
        answer = self._answer
        if answer.content.at_eof():
            answer.release()  # read to its end: the connection goes back to the pool
        else:
            answer.close()  # a connection half read is never used again


def _failure(exc: Exception) -> httpx2.HTTPError:
    """``exc`` as ``httpx2`` would have raised it (what it is not: a transport error)."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx2.ConnectTimeout(message)
    if isinstance(exc, aiohttp.ServerTimeoutError | TimeoutError):
        return httpx2.ReadTimeout(message)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx2.ConnectError(message)
    # cut off, or not HTTP as it must be (ClientResponseError)
    broken = aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError
    if isinstance(exc, broken | aiohttp.ClientResponseError):
        return httpx2.RemoteProtocolError(message)
    if isinstance(exc, aiohttp.ClientError | OSError):
        # aiohttp tells a failed write from a failed read no more than this: a body goes
        # into the socket's buffer at once, so what fails is most often the wait for the answer
        return httpx2.ReadError(message)
    if isinstance(exc, ValueError):  # a header value aiohttp will not write (a control char)
        return httpx2.LocalProtocolError(message)
    return httpx2.TransportError(f"{type(exc).__name__}: {message}")
