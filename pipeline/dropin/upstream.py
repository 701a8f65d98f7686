"""The proxy's way upstream (:class:`Upstream`): one HTTP client for every conversation and
every API key, which therefore keeps nothing of a request's between requests (only the URLs of
the paths asked for, parsed).

A request goes out with the client's headers (less the hop's own; none added but
``accept-encoding``), its path under the upstream's base path and its query string as the
client wrote them (what a URL may not hold raw percent-escaped). The client keeps no cookies: a
``Set-Cookie`` the upstream answers (a load balancer's, say) is relayed to the client it was
meant for and never sent again, so it cannot reach another API key's requests. Redirects are
relayed, not followed. Proxies named by the environment (``HTTPS_PROXY``, ``NO_PROXY``, ...)
and its certificate settings (``SSL_CERT_FILE``) are honoured as ``httpx2`` honours them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import TYPE_CHECKING, Any

import anyio
import httpx2

from pipeline.dropin.upstream_sockets import known_sockets

if TYPE_CHECKING:
    from starlette.types import Receive

__all__ = ["Upstream", "unless_left"]

ACCEPT_ENCODING = "gzip, deflate"
"""What the proxy accepts from the upstream (a client's own ``accept-encoding`` is the hop's:
the proxy reads the answer, then relays it uncompressed)."""


_URLS_KEPT = 64
"""Upstream URLs an :class:`Upstream` keeps parsed."""


class Upstream:
    """Requests to the upstream at ``base_url`` (its path, if any, comes before each request's),
    each allowed ``timeout`` seconds to answer (``connect`` to connect), at most
    ``max_connections`` at once of which ``kept_alive`` are kept between requests.
    ``transport``: how to reach it (tests pass one; default: the network)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float,
        connect: float,
        max_connections: int,
        kept_alive: int,
        transport: httpx2.AsyncBaseTransport | None = None,
    ) -> None:
        base = httpx2.URL(base_url.rstrip("/"))
        if base.scheme not in ("http", "https") or not base.host:
            raise ValueError(f"the upstream must be an http:// or https:// URL, got {base_url!r}")
        limits = httpx2.Limits(
            max_connections=max_connections, max_keepalive_connections=kept_alive
        )
        timeouts = httpx2.Timeout(timeout, connect=connect)
        self._client = httpx2.AsyncClient(
            timeout=timeouts,
            limits=limits,
            transport=transport,
            # a jar that takes no cookie: one tenant's would go out with the next's requests
            cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])),
        )
        if transport is None:
            # httpx2's own transport (the environment's proxies, if any, have theirs beside
            # it: a transport passed in would turn them off), its connections' sockets found
            # once
            known_sockets(self._client)
        self._origin = str(base.copy_with(raw_path=b"/")).rstrip("/")
        self._prefix = base.raw_path.decode("ascii").rstrip("/")
        self._timeout = timeouts.as_dict()
        self._urls: dict[tuple[str, bytes], httpx2.URL] = {}
        """The URLs of the last paths and queries asked for (a client asks for one or two,
        every call): parsing one costs more than the rest of a request's building."""

    def request(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], content: bytes
    ) -> httpx2.Request:
        """``method`` of ``path`` (the raw path, percent-escapes kept) with ``query`` (the raw
        query string, without ``?``), ``headers`` and the body ``content``. Both go as the
        client wrote them, but for what a URL may not hold raw (``#``, ``"``, ``<``...),
        percent-escaped."""
        key = (path, query)
        url = self._urls.pop(key, None)  # back in as the latest: the oldest asked for goes first
        if url is None:
            url = self._url(path, query)
            if len(self._urls) >= _URLS_KEPT:  # a client may ask for any number: the oldest goes
                del self._urls[next(iter(self._urls))]
        self._urls[key] = url
        sent = {**headers, "accept-encoding": ACCEPT_ENCODING}
        return httpx2.Request(
            method, url, headers=sent, content=content, extensions={"timeout": self._timeout}
        )

    def _url(self, path: str, query: bytes) -> httpx2.URL:
        # a "#" would start a fragment, never sent: the client's is part of its path or query
        text = self._origin + self._prefix + "/" + path.lstrip("/").replace("#", "%23")
        if query:
            text += "?" + query.decode("latin-1").replace("#", "%23")
        return httpx2.URL(text)

    async def send(self, request: httpx2.Request) -> httpx2.Response:
        """``request``'s answer, its body still to read (``aiter_bytes``, then ``aclose``)."""
        return await self._client.send(request, stream=True)

    async def aclose(self) -> None:
        """Close every connection (the server has drained its requests)."""
        await self._client.aclose()


async def unless_left(
    receive: Receive, send: Coroutine[Any, Any, httpx2.Response]
) -> httpx2.Response | None:
    """The upstream's answer to ``send``, or None when the client went away first (the call
    is then cancelled: its connection closed, nothing left running for nobody). The body was
    read: what the client's side says next can only be that it left."""
    try:
        me = asyncio.current_task()
    except RuntimeError:  # not asyncio (uvicorn serves on asyncio; an ASGI test may not)
        me = None
    if me is None:
        return await _unless_left_anyio(receive, send)
    left = False
    failed: Exception | None = None
    cancels = me.cancelling()  # those from before are not the watch's to take back

    async def watch() -> None:
        nonlocal left, failed
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception as exc:  # raised here, as the task group would
            failed = exc
        left = True
        me.cancel()

    # a bare task cancelling this one, as asyncio.timeout does: a task group and its cancel
    # scope cost ~0.1 ms a request (anyio formats the task's repr on every cancel)
    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        answer = await send
    except asyncio.CancelledError:
        if not left or me.uncancel() > cancels:  # cancelled from elsewhere too: that goes on
            raise
        if failed is not None:
            raise failed from None
        return None
    except Exception:
        if not left:
            raise
        me.uncancel()  # the call failed of its cancellation: the client is gone
        if failed is not None:
            raise failed from None
        return None
    finally:
        watcher.cancel()
    if left:  # the call swallowed the cancellation: take it back
        me.uncancel()
    return answer


async def _unless_left_anyio(
    receive: Receive, send: Coroutine[Any, Any, httpx2.Response]
) -> httpx2.Response | None:
    """:func:`unless_left` on any backend anyio runs on."""
    answer: httpx2.Response | None = None
    failed: Exception | None = None

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        tasks.cancel_scope.cancel()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(watch)
        try:
            answer = await send
        except Exception as exc:  # raised as it is, not in the task group's exception group
            failed = exc
        tasks.cancel_scope.cancel()
    if failed is not None:
        raise failed
    return answer
