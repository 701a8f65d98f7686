"""The proxy's way upstream (:class:`Upstream`): one HTTP client for every conversation and
every API key, which therefore keeps no state of its own between requests.

A request goes out with the client's headers (less the hop's own), its path under the
upstream's base path and its query string byte for byte. The client keeps no cookies: a
``Set-Cookie`` the upstream answers (a load balancer's, say) is relayed to the client it was
meant for and never sent again, so it cannot reach another API key's requests. Redirects are
relayed, not followed. Proxies named by the environment (``HTTPS_PROXY``, ``NO_PROXY``, ...)
and its certificate settings (``SSL_CERT_FILE``) are honoured as ``httpx2`` honours them.
"""

from __future__ import annotations

from collections.abc import Mapping
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx2

__all__ = ["Upstream"]

ACCEPT_ENCODING = "gzip, deflate"
"""What the proxy accepts from the upstream (a client's own ``accept-encoding`` is the hop's:
the proxy reads the answer, then relays it uncompressed)."""


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
        self._client = httpx2.AsyncClient(
            timeout=httpx2.Timeout(timeout, connect=connect),
            limits=limits,
            transport=transport,
            # a jar that takes no cookie: one tenant's would go out with the next's requests
            cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])),
        )
        self._origin = str(base.copy_with(raw_path=b"/")).rstrip("/")
        self._prefix = base.raw_path.decode("ascii").rstrip("/")
        self._timeout = httpx2.Timeout(timeout, connect=connect).as_dict()

    def request(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], content: bytes
    ) -> httpx2.Request:
        """``method`` of ``path`` (the raw path, percent-escapes kept) with ``query`` (the raw
        query string, without ``?``), ``headers`` and the body ``content``."""
        url = self._origin + self._prefix + "/" + path.lstrip("/")
        if query:
            url += "?" + query.decode("latin-1")
        sent = {**headers, "accept-encoding": ACCEPT_ENCODING}
        return httpx2.Request(
            method, url, headers=sent, content=content, extensions={"timeout": self._timeout}
        )

    async def send(self, request: httpx2.Request) -> httpx2.Response:
        """``request``'s answer, its body still to read (``aiter_bytes``, then ``aclose``)."""
        return await self._client.send(request, stream=True)

    async def aclose(self) -> None:
        """Close every connection (the server has drained its requests)."""
        await self._client.aclose()
