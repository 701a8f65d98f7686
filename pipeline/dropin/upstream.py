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

On asyncio the calls go out on asyncio's own connections, their answers read by llhttp
(:mod:`pipeline.dropin.upstream_httptools`: the same requests and answers, at about a third of
the CPU of aiohttp's, itself less than half of ``httpx2``'s), where httptools is installed, else
through aiohttp (:mod:`pipeline.dropin.upstream_aiohttp`), unless the environment names a
proxy; ``httpx2`` otherwise (``client="httpx2"`` always), and for a request without a body or
with a header value past ASCII (aiohttp would add a ``Content-Length: 0``, write the value as
UTF-8).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Coroutine, Mapping
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import httpx2

from pipeline.dropin.limits import UPSTREAM_CLIENTS as CLIENTS
from pipeline.dropin.upstream_sockets import known_sockets

if TYPE_CHECKING:
    from starlette.types import Receive

    from pipeline.dropin.upstream_fast import FastTransport

__all__ = ["CLIENTS", "Outgoing", "Target", "Upstream", "choose_client", "unless_left"]

ACCEPT_ENCODING = "gzip, deflate"
"""What the proxy accepts from the upstream (a client's own ``accept-encoding`` is the hop's:
the proxy reads the answer, then relays it uncompressed)."""


_WRITTEN_HERE = frozenset(
    ("accept-encoding", "host", "content-length", "transfer-encoding", "expect")
)
"""Headers a request's own never stand for: the proxy's ``accept-encoding``; those the HTTP
client writes from the URL and the body; and ``expect`` (a client's ``100-continue`` was
answered by the server that read its body: the proxy sends the body with the head)."""

_URLS_KEPT = 64
"""Upstream URLs an :class:`Upstream` keeps parsed."""


class Target(NamedTuple):
    """Where a request goes: its URL parsed, and written out (what the fast clients are
    given)."""

    url: httpx2.URL
    text: str


class Outgoing(NamedTuple):
    """A request for :meth:`Upstream.send`, as :meth:`Upstream.request` builds it."""

    method: str
    target: Target
    headers: list[tuple[str, str]]
    """Each value's characters its bytes (Latin-1), ``accept-encoding`` the proxy's own."""
    content: bytes

    @property
    def url(self) -> httpx2.URL:
        """Where it goes."""
        return self.target.url


class Upstream:
    """Requests to the upstream at ``base_url`` (its path, if any, comes before each request's),
    each allowed ``timeout`` seconds to answer (``connect`` to connect), at most
    ``max_connections`` at once of which ``kept_alive`` are kept between requests (httptools
    and aiohttp: idle ones closed after 5 s). ``transport``: how to reach it (tests pass one;
    default: the network); ``client``: with which HTTP client (one of :data:`CLIENTS`)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float,
        connect: float,
        max_connections: int,
        kept_alive: int,
        transport: httpx2.AsyncBaseTransport | None = None,
        client: str = "auto",
    ) -> None:
        base = httpx2.URL(base_url.rstrip("/"))
        if base.scheme not in ("http", "https") or not base.host:
            raise ValueError(f"the upstream must be an http:// or https:// URL, got {base_url!r}")
        # both pools within max_connections: the fast one's carries the calls with a body, httpx2's
        # the rest (a GET, a header value past ASCII) -- a few, an eighth (one at least: under
        # 8, one connection past max_connections)
        share = max_connections // 8
        name = "httpx2" if base.userinfo else choose_client(client, transport)
        fast = _fast_transport(name, max_connections - share)
        spare = max_connections if fast is None else max(1, share)
        limits = httpx2.Limits(
            max_connections=spare, max_keepalive_connections=min(kept_alive, spare)
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
        self._fast = fast
        """The fast way, for calls on asyncio (None: ``httpx2``'s for every call; an upstream
        URL with credentials in it goes by ``httpx2``, which sends them as before)."""
        self._client_name = name
        self._origin = str(base.copy_with(raw_path=b"/")).rstrip("/")
        self._prefix = base.raw_path.decode("ascii").rstrip("/")
        self._timeout = timeouts.as_dict()
        self._urls: dict[tuple[str, bytes], Target] = {}
        """The URLs of the last paths and queries asked for (a client asks for one or two,
        every call): parsing one costs more than the rest of a request's building."""

    def request(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], content: bytes
    ) -> Outgoing:
        """``method`` of ``path`` (the raw path, percent-escapes kept) with ``query`` (the raw
        query string, without ``?``), ``headers`` (each value's characters its bytes, as
        ASGI servers decode them: Latin-1) and the body ``content``, to :meth:`send`. The path
        and query go as the client wrote them, but for what a URL may not hold raw (``#``,
        ``"``, ``<``...), percent-escaped; the headers byte for byte."""
        key = (path, query)
        url = self._urls.pop(key, None)  # back in as the latest: the oldest asked for goes first
        if url is None:
            url = self._url(path, query)
            if len(self._urls) >= _URLS_KEPT:  # a client may ask for any number: the oldest goes
                del self._urls[next(iter(self._urls))]
        self._urls[key] = url
        fields = [(k, v) for k, v in headers.items() if k.lower() not in _WRITTEN_HERE]
        fields.append(("accept-encoding", ACCEPT_ENCODING))
        return Outgoing(method, url, fields, content)

    def _url(self, path: str, query: bytes) -> Target:
        # a "#" would start a fragment, never sent: the client's is part of its path or query
        text = self._origin + self._prefix + "/" + path.lstrip("/").replace("#", "%23")
        if query:
            text += "?" + query.decode("latin-1").replace("#", "%23")
        url = httpx2.URL(text)
        return Target(url, str(url))

    @property
    def client(self) -> str:
        """Which HTTP client calls go out with on asyncio: ``httptools``, ``aiohttp`` or
        ``httpx2``."""
        return self._client_name

    async def send(self, request: Outgoing) -> httpx2.Response:
        """``request``'s answer, its body still to read (``aiter_bytes``, then ``aclose``)."""
        fast = self._fast
        # aiohttp would write a header value past ASCII as UTF-8, not as the client's bytes,
        # and a Content-Length: 0 httpx2 leaves out (a GET's): those go by httpx2 (on
        # httptools too, which would send them alike: one rule, the fewest ways a call goes)
        if (
            fast is not None
            and request.content
            and _on_asyncio()
            and all(v.isascii() for _, v in request.headers)
        ):
            # the transport itself: the client's layer (its cookie jar, which takes none,
            # redirects, which are relayed, auth, which is the client's) has nothing to do
            target, timeouts = request.target, self._timeout
            return await fast.send(
                request.method, target.text, request.headers, request.content, timeouts
            )
        # bytes as the client sent them (a str is each byte as one character): httpx2 would
        # refuse a value past ASCII (obs-text, which HTTP allows) rather than send it
        sent = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers]
        built = httpx2.Request(
            request.method,
            request.target.url,
            headers=sent,
            content=request.content,
            extensions={"timeout": self._timeout},
        )
        return await self._client.send(built, stream=True)

    async def aclose(self) -> None:
        """Close every connection (the server has drained its requests)."""
        if self._fast is not None and _on_asyncio():
            await self._fast.aclose()
        await self._client.aclose()


_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def choose_client(client: str, transport: httpx2.AsyncBaseTransport | None = None) -> str:
    """The HTTP client an :class:`Upstream` asked for ``client`` (one of :data:`CLIENTS`) calls
    with on asyncio: ``httptools``, ``aiohttp`` or ``httpx2`` (``transport`` given: ``httpx2``,
    its way; ``auto``: the first of them that can serve). ``ValueError`` for another name, or
    for ``httptools`` or ``aiohttp`` when it cannot be imported or a proxy is named."""
    if client not in CLIENTS:
        raise ValueError(f"client must be one of {', '.join(CLIENTS)}, got {client!r}")
    if client == "httpx2" or transport is not None:
        return "httpx2"
    named = [n for n in _PROXY_VARIABLES if os.environ.get(n) or os.environ.get(n.lower())]
    if named:  # neither fast client would go through it, httpx2 does
        if client != "auto":
            raise ValueError(
                f"client {client!r}: {named[0]} names a proxy, which {client} would not go "
                "through (httpx2 does)"
            )
        return "httpx2"
    for name, why in (("httptools", _httptools_unusable), ("aiohttp", _aiohttp_unusable)):
        if client not in ("auto", name):
            continue
        unusable = why()
        if unusable is None:
            return name
        if client == name:
            raise ValueError(f"client {name!r}: {unusable}")
    return "httpx2"


def _httptools_unusable() -> str | None:
    if importlib.util.find_spec("httptools") is None:
        return "httptools is not installed"
    return None


def _aiohttp_unusable() -> str | None:
    if importlib.util.find_spec("aiohttp") is None:
        return "aiohttp is not installed"
    from pipeline.dropin.upstream_aiohttp import usable

    return usable()


def _fast_transport(name: str, max_connections: int) -> FastTransport | None:
    if name == "httptools":
        from pipeline.dropin.upstream_httptools import HttptoolsTransport

        return HttptoolsTransport(max_connections=max(1, max_connections))
    if name == "aiohttp":
        from pipeline.dropin.upstream_aiohttp import AiohttpTransport

        return AiohttpTransport(max_connections=max(1, max_connections))
    return None


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # another event loop (trio)
        return False
    return True


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
