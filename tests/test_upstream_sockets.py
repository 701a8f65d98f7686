"""The proxy's upstream connections find their sockets once, and still see a server that
closed them while idle: over plain TCP and over TLS, against servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.dropin.upstream import Upstream
from pipeline.dropin.upstream_sockets import KnownSockets, _Watch
from tests.wire_support import RawUpstream, read_request

_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def readable(sock: socket.socket | None) -> bool:
    return _Watch(sock).readable()


def test_readable_says_what_a_read_would_meet() -> None:
    mine, theirs = socket.socketpair()
    try:
        assert not readable(mine)
        theirs.sendall(b"x")
        assert readable(mine)
        assert mine.recv(1) == b"x"
        assert not readable(mine)
        theirs.close()
        assert readable(mine)  # the end a closed peer leaves
    finally:
        mine.close()
    assert readable(mine)  # no descriptor: as closed
    assert readable(None)


def test_a_watched_socket_closed_is_read_as_closed_though_its_number_is_taken_again() -> None:
    mine, theirs = socket.socketpair()
    watch = _Watch(mine)
    assert not watch.readable()
    number = mine.fileno()
    mine.close()
    again, other = socket.socketpair()  # the lowest free descriptor: most likely the same
    try:
        assert number in (again.fileno(), other.fileno())  # the case this is about
        assert watch.readable()  # not the newcomer's state: the watched one is gone
    finally:
        for sock in (theirs, again, other):
            sock.close()


class _Server(RawUpstream):
    """HTTP/1.1 on 127.0.0.1 (over TLS with ``wrap``): answers each request ``{}``, keeping
    the connection, or (``close_after``) closing it once answered -- without saying so."""

    def __init__(
        self, *, close_after: bool, wrap: Callable[[socket.socket], socket.socket] | None = None
    ) -> None:
        self.close_after, self.wrap = close_after, wrap
        self.connections = 0
        super().__init__()

    def answer(self, conn: socket.socket) -> None:
        self.connections += 1
        try:
            if self.wrap is not None:
                conn = self.wrap(conn)
            while read_request(conn):
                conn.sendall(_ANSWER)
                if self.close_after:
                    return
        except (OSError, ssl.SSLError):
            return


async def _calls(base_url: str, count: int) -> list[int]:
    upstream = Upstream(base_url, timeout=10, connect=10, max_connections=4, kept_alive=4)
    statuses = []
    try:
        for _ in range(count):
            request = upstream.request("POST", "/v1/messages", b"", {"x": "y"}, b"{}")
            response = await upstream.send(request)
            async for _chunk in response.aiter_bytes():
                pass
            await response.aclose()
            statuses.append(response.status_code)
            await asyncio.sleep(0.05)  # the server's close reaches this end
    finally:
        await upstream.aclose()
    return statuses


def test_the_proxys_upstream_pool_finds_each_socket_once() -> None:
    upstream = Upstream("http://127.0.0.1:1", timeout=1, connect=1, max_connections=1, kept_alive=1)
    pool = upstream._client._transport._pool  # type: ignore[attr-defined]
    assert isinstance(pool._network_backend, KnownSockets)


def _tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[[socket.socket], socket.socket]:
    """A server side of TLS under a certificate authority of the test's, which the client
    trusts (``SSL_CERT_FILE``, read when the proxy's client is made)."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    served = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(served)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    return lambda conn: served.wrap_socket(conn, server_side=True)


@pytest.mark.parametrize("close_after", [True, False], ids=["closed-when-idle", "kept"])
@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_a_connection_the_server_closed_while_idle_is_not_used_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, close_after: bool, tls: bool
) -> None:
    wrap = _tls(tmp_path, monkeypatch) if tls else None
    server = _Server(close_after=close_after, wrap=wrap)
    port = server.sock.getsockname()[1]
    try:
        statuses = asyncio.run(_calls(f"{'https' if tls else 'http'}://127.0.0.1:{port}", 4))
    finally:
        server.sock.close()
    assert statuses == [200] * 4
    # each call on a new connection where the server closed the last; else all on one
    assert server.connections == (4 if close_after else 1)


def test_a_proxy_from_the_environment_still_carries_the_upstream_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[bytes] = []

    class Proxy(RawUpstream):
        def answer(self, conn: socket.socket) -> None:
            seen.append(read_request(conn).split(b"\r\n")[0])
            conn.sendall(_ANSWER)

    proxy = Proxy()
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    try:
        statuses = asyncio.run(_calls("http://api.upstream.invalid", 1))
    finally:
        proxy.sock.close()
    assert statuses == [200]
    assert seen == [b"POST http://api.upstream.invalid/v1/messages HTTP/1.1"]
