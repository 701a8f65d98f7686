"""The proxy's upstream connections, each asked cheaply whether its server closed it.

Before each request and after each response, httpcore's pool asks every idle connection
whether it has expired: whether its socket is readable, which on an idle HTTP/1.1 connection
means the server closed it. Its anyio stream answers that by building a dict of the
stream's attributes (and asking the kernel for the peer's address) to find the socket, then
polling it: ~6 % of the proxy's event loop under 16 conversations at once, and more the more
connections are kept. :class:`KnownSockets` wraps the pool's own network backend so that each
stream finds its socket once, when it connects, and asks the kernel with a poll object
registered once; everything else goes to the stream it wraps.
"""

from __future__ import annotations

import select
import sys
from collections.abc import Iterable
from typing import Any

import httpcore2
import httpx2

__all__ = ["KnownSockets", "known_sockets"]


class _Watch:
    """One socket's readability, asked again and again: whether a read would be answered at
    once (data, or the end a closed peer leaves; a socket gone counts as closed). A poll
    object registered once, so each ask is one system call (``select.select`` where there is
    no ``poll``)."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._fd = -1 if sock is None else sock.fileno()
        self._poll: Any = None
        if self._fd >= 0 and sys.platform != "win32" and hasattr(select, "poll"):
            self._poll = select.poll()
            self._poll.register(self._fd, select.POLLIN)

    def readable(self) -> bool:
        # a socket closed since (its descriptor -1, or another's now) is as good as read
        if self._fd < 0 or self._sock.fileno() != self._fd:
            return True
        if self._poll is None:
            ready, _, _ = select.select([self._fd], [], [], 0)
            return bool(ready)
        return bool(self._poll.poll(0))


class _Stream(httpcore2.AsyncNetworkStream):
    """A stream of the wrapped backend, its socket found once."""

    def __init__(self, inner: httpcore2.AsyncNetworkStream) -> None:
        self._inner = inner
        self._watch = _Watch(inner.get_extra_info("socket"))
        # the wrapped stream's own methods, bound: a read or a write costs no frame more
        self.read = inner.read  # type: ignore[method-assign]
        self.write = inner.write  # type: ignore[method-assign]
        self.aclose = inner.aclose  # type: ignore[method-assign]

    async def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        return _Stream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            return self._watch.readable()
        return self._inner.get_extra_info(info)


class KnownSockets(httpcore2.AsyncNetworkBackend):
    """``inner`` (a network backend of httpcore's), its streams' sockets found once each."""

    def __init__(self, inner: httpcore2.AsyncNetworkBackend) -> None:
        self.inner = inner

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        return _Stream(
            await self.inner.connect_tcp(
                host,
                port,
                timeout=timeout,
                local_address=local_address,
                socket_options=socket_options,
            )
        )

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        return _Stream(
            await self.inner.connect_unix_socket(
                path, timeout=timeout, socket_options=socket_options
            )
        )

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def known_sockets(client: httpx2.AsyncClient) -> bool:
    """Wrap the network backend of ``client``'s own transport's pool (the one it made, for
    URLs no proxy takes) in :class:`KnownSockets`; whether it could. Where the client or its
    pool is not as this expects (another httpx2), it is left as it is: each connection then
    finds its socket on each ask, as before."""
    transport = getattr(client, "_transport", None)
    pool = getattr(transport, "_pool", None)
    backend = getattr(pool, "_network_backend", None)
    if not isinstance(pool, httpcore2.AsyncConnectionPool) or isinstance(backend, KnownSockets):
        return isinstance(backend, KnownSockets)
    if not isinstance(backend, httpcore2.AsyncNetworkBackend):
        return False
    pool._network_backend = KnownSockets(backend)
    return True
