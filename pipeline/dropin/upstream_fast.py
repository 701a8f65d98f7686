"""What the proxy's fast upstream clients share (:class:`FastTransport`): an ``httpx2``
transport whose calls come taken apart (:meth:`~FastTransport.send`), as
:class:`~pipeline.dropin.upstream.Upstream` hands them over, and the bound of a call's head."""

from __future__ import annotations

import ssl
from collections.abc import Mapping

import httpx2

__all__ = ["FastTransport", "head_bound"]

_NOT_SENT = frozenset((b"host", b"content-length", b"transfer-encoding"))
"""Headers a fast client writes itself from the URL and the body (as ``httpx2`` does)."""


def head_bound(timeouts: Mapping[str, float | None]) -> float | None:
    """The bound of a call from its start to its answer's head, of ``httpx2``'s ``timeouts``:
    the longest of ``read``, ``write`` and ``pool`` (None: none is bounded), past connecting's
    own bound -- a server that never accepts is told by that one (``ConnectTimeout``:
    unreachable, 502), not by this (``ReadTimeout``: slow, 504)."""
    limits = [t for t in (timeouts.get(k) for k in ("read", "write", "pool")) if t is not None]
    return max(limits) + (timeouts.get("connect") or 0.0) if limits else None


class FastTransport(httpx2.AsyncBaseTransport):
    """An ``httpx2`` transport whose work is :meth:`send`: a request taken apart; at most
    ``max_connections`` connections (``ValueError`` below 1), idle ones closed after
    ``keepalive_expiry`` seconds; ``ssl_context``: the certificate checks (default:
    ``httpx2``'s)."""

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
        self._ssl = ssl_context if ssl_context is not None else httpx2.create_ssl_context()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        """Send ``request``; its answer with the body still to read."""
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.headers.raw
            if k.lower() not in _NOT_SENT
        ]
        content = await request.aread()  # its content, read now if it was a stream
        timeouts = request.extensions.get("timeout", {})
        return await self.send(request.method, str(request.url), headers, content, timeouts)

    async def send(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        content: bytes,
        timeouts: Mapping[str, float | None],
    ) -> httpx2.Response:
        """:meth:`handle_async_request` of a request already taken apart (``url``: as written,
        its path and query sent as they are; ``headers``: each value's characters its bytes,
        none of ``Host``, ``Content-Length``; ``timeouts``: as ``httpx2`` writes them)."""
        raise NotImplementedError
