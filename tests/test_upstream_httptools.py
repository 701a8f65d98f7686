"""The httptools client's own ways (``pipeline.dropin.upstream_httptools``): how an answer's end
is found, what it will not read, when a connection is used again -- and that with many calls on
few connections each caller reads its own answer, against servers on 127.0.0.1 that see the raw
bytes. What it shares with the other clients is in ``test_upstream_aiohttp.py``."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from pathlib import Path

import httpx2
import pytest

from pipeline.dropin.h1_connection import BODY_HELD, HEAD_BYTES, HEAD_FIELD, HEAD_FIELDS
from pipeline.dropin.upstream import Upstream
from pipeline.dropin.upstream_httptools import HttptoolsTransport
from tests.wire_support import RawUpstream, ScriptedUpstream, read_request

_Script = ScriptedUpstream


def _upstream(url: str, *, timeout: float = 10.0, connections: int = 4) -> Upstream:
    upstream = Upstream(
        url, timeout=timeout, connect=5, max_connections=connections, kept_alive=connections,
        client="httptools",
    )  # fmt: skip
    assert upstream.client == "httptools"
    return upstream


async def _call(upstream: Upstream, key: str = "k", *, slow: float = 0.0) -> bytes:
    request = upstream.request("POST", "/v1/messages", b"", {"x-api-key": key}, b"{}")
    response = await upstream.send(request)
    try:
        parts = []
        async for chunk in response.aiter_bytes():
            parts.append(chunk)
            if slow:
                await asyncio.sleep(slow)
        return b"".join(parts)
    finally:
        await response.aclose()


def _run(server: RawUpstream, go: object) -> object:
    try:
        return asyncio.run(go)  # type: ignore[arg-type]
    finally:
        server.sock.close()


def _answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + extra + b"content-length: %d\r\n\r\n" % len(body) + body


async def _calls(upstream: Upstream, count: int) -> list[bytes]:
    try:
        return [await _call(upstream) for _ in range(count)]
    finally:
        await upstream.aclose()


def test_an_answer_that_ends_with_its_connection_is_read_whole_and_its_connection_closed() -> None:
    def script(conn: socket.socket, _request: bytes, n: int) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it, %d" % n)
        conn.shutdown(socket.SHUT_WR)

    server = _Script(script)
    got = _run(server, _calls(_upstream(server.url), 2))
    assert got == [b"all of it, 1", b"all of it, 1"]
    assert server.connections == 2  # it ended with its connection: none to use again


def test_an_informational_answer_before_the_answer_is_passed_over() -> None:
    def script(conn: socket.socket, _request: bytes, _n: int) -> None:
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" + _answer(b"the answer"))

    server = _Script(script)
    assert _run(server, _calls(_upstream(server.url), 2)) == [b"the answer"] * 2
    assert server.connections == 1


@pytest.mark.parametrize(
    "head",
    [
        b"".join(b"x-f%d: v\r\n" % k for k in range(HEAD_FIELDS + 1)),
        b"x-long: " + b"v" * HEAD_FIELD + b"\r\n",
        b"content-length: 3\r\ntransfer-encoding: chunked\r\n",  # two framings: which one?
        b"content-length: 3\r\ncontent-length: 4\r\n",
    ],
    ids=["too-many-fields", "a-field-too-long", "length-and-chunked", "two-lengths"],
)
def test_an_answer_past_the_bounds_or_framed_two_ways_is_refused(head: bytes) -> None:
    def script(conn: socket.socket, _request: bytes, _n: int) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\n" + head + b"\r\nabcd")

    assert _failure_of(_Script(script)) is httpx2.RemoteProtocolError


@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
def test_a_long_body_read_slowly_arrives_whole(chunked: bool) -> None:
    body = bytes(random.Random(7).getrandbits(8) for _ in range(4 * BODY_HELD))

    def script(conn: socket.socket, _request: bytes, _n: int) -> None:
        if not chunked:
            conn.sendall(_answer(body))
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for start in range(0, len(body), 50_000):
            piece = body[start : start + 50_000]
            conn.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
        conn.sendall(b"0\r\n\r\n")

    server = _Script(script)

    async def go() -> list[bytes]:
        upstream = _upstream(server.url)
        try:  # the reader slower than the socket: the connection stops reading meanwhile
            return [await _call(upstream, slow=0.01), await _call(upstream)]
        finally:
            await upstream.aclose()

    assert _run(server, go()) == [body, body]
    assert server.connections == 1


def test_a_second_answer_to_one_request_is_never_read_as_the_next_ones() -> None:
    def script(conn: socket.socket, _request: bytes, n: int) -> None:
        conn.sendall(_answer(b"mine-%d" % n) + _answer(b"STRAY"))

    server = _Script(script)
    got = _run(server, _calls(_upstream(server.url), 3))
    assert got == [b"mine-1"] * 3  # each on a connection of its own
    assert server.connections == 3


def _key(request: bytes) -> bytes:
    return request.split(b"x-api-key: ", 1)[1].split(b"\r\n", 1)[0]


def test_many_callers_on_few_connections_each_read_their_own_answer() -> None:
    def script(conn: socket.socket, request: bytes, _n: int) -> None:
        key = _key(request)
        # a slow answer for some: their callers give up waiting while it comes
        time.sleep(0.3 if key.endswith(b"7") else random.random() * 0.01)
        conn.sendall(_answer(b"for " + key * 50))

    server = _Script(script)

    async def one(upstream: Upstream, key: str) -> bool:
        if key.endswith("7"):  # its connection, its answer late: never another caller's
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.15):
                    await _call(upstream, key)
            return True
        await asyncio.sleep(0.2)  # once the slow ones were given up, before their answers
        return await _call(upstream, key) == b"for " + key.encode() * 50

    async def go() -> list[bool]:
        upstream = _upstream(server.url, connections=8)
        try:
            return list(await asyncio.gather(*[one(upstream, f"tenant-{k}") for k in range(60)]))
        finally:
            await upstream.aclose()

    assert all(_run(server, go()))  # type: ignore[arg-type]


def test_a_call_given_up_while_it_waits_frees_its_connection() -> None:
    def script(conn: socket.socket, request: bytes, _n: int) -> None:
        key = _key(request)
        if key == b"first":
            time.sleep(1)  # its caller gives up before this
        conn.sendall(_answer(b"for " + key))

    server = _Script(script)

    async def go() -> list[bytes]:
        upstream = _upstream(server.url, connections=1)
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await _call(upstream, "first")
            # one connection in all: the given-up one is closed, not waited for
            async with asyncio.timeout(5):
                return [await _call(upstream, "second"), await _call(upstream, "third")]
        finally:
            await upstream.aclose()

    assert _run(server, go()) == [b"for second", b"for third"]
    assert server.connections == 2


def test_an_idle_connection_is_closed_after_its_expiry() -> None:
    server = _Script(lambda conn, _request, n: conn.sendall(_answer(b"%d" % n)))
    transport = HttptoolsTransport(max_connections=2, keepalive_expiry=0.2)

    async def call() -> bytes:
        answer = await transport.send("POST", server.url + "/v1/messages", [], b"{}", {})
        try:
            return await answer.aread()
        finally:
            await answer.aclose()

    async def go() -> list[bytes]:
        got = [await call(), await call()]
        await asyncio.sleep(0.5)
        got.append(await call())
        await transport.aclose()
        return got

    assert _run(server, go()) == [b"1", b"2", b"1"]
    assert server.connections == 2


@pytest.mark.parametrize(
    ("method", "headers"),
    [("POST\r\nX", []), ("POST", [("x bad", "v")]), ("POST", [("x-ok", "a\r\nx-evil: 1")])],
    ids=["method", "name", "value"],
)
def test_a_request_http_cannot_carry_is_refused_before_a_byte_goes(
    method: str, headers: list[tuple[str, str]]
) -> None:
    server = _Script(lambda conn, _request, _n: conn.sendall(_answer(b"")))
    transport = HttptoolsTransport(max_connections=1)

    async def go() -> None:
        try:
            with pytest.raises(httpx2.LocalProtocolError):
                await transport.send(method, server.url + "/v1/messages", headers, b"{}", {})
        finally:
            await transport.aclose()

    _run(server, go())
    assert server.connections == 0


# -- the review's findings: each fails on the version before its fix --------------------------


def _failure_of(server: RawUpstream, method: str = "POST", timeout: float = 3.0) -> object:
    """What a call to ``server`` ends in: the answer's status and body, or its error's type."""
    transport = HttptoolsTransport(max_connections=2)
    bounds = {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout}

    async def go() -> object:
        try:
            answer = await transport.send(method, server.url + "/v1/x", [], b"{}", bounds)
            try:
                return answer.status_code, await answer.aread()
            finally:
                await answer.aclose()
        except httpx2.HTTPError as exc:
            return type(exc)
        finally:
            await transport.aclose()

    return _run(server, go())


def test_a_head_requests_answer_ends_at_its_head() -> None:
    # llhttp is not told of HEAD: it waited for the body the length announces, until the timeout
    server = _Script(
        lambda conn, _r, _n: conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n")
    )
    start = time.monotonic()
    assert _failure_of(server, "HEAD") == (200, b"")
    assert time.monotonic() - start < 2


@pytest.mark.parametrize(
    "first",
    [
        b"HTTP/1.1 199 Misc\r\ncontent-length: 9\r\n\r\nINJECTED!",
        b"HTTP/1.1 150 X\r\ntransfer-encoding: chunked\r\n\r\n4\r\nEVIL\r\n0\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n",
    ],
    ids=["1xx-length", "1xx-chunked", "101"],
)
def test_an_informational_answer_with_a_body_or_a_switch_is_refused(first: bytes) -> None:
    # the 1xx's body was read as the start of the answer's (b"INJECTED!ok")
    server = _Script(lambda conn, _r, _n: conn.sendall(first + _answer(b"ok")))
    assert _failure_of(server) is httpx2.RemoteProtocolError


def test_trailers_are_bounded() -> None:
    def script(conn: socket.socket, _request: bytes, _n: int) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nx-t: ")
        for _ in range(8):  # a trailer that never ends: held whole until the read timeout
            conn.sendall(b"a" * HEAD_FIELD)
        time.sleep(5)

    start = time.monotonic()
    assert _failure_of(_Script(script), timeout=4) is httpx2.RemoteProtocolError
    assert time.monotonic() - start < 3


def test_a_head_past_its_bound_is_refused() -> None:
    def script(conn: socket.socket, _request: bytes, _n: int) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        for k in range(HEAD_BYTES // 60_000 + 2):  # fields each within their bound
            conn.sendall(b"x-f%d: " % k + b"v" * 60_000 + b"\r\n")
        conn.sendall(b"content-length: 2\r\n\r\nok")

    assert _failure_of(_Script(script)) is httpx2.RemoteProtocolError


def test_bytes_waiting_unread_on_an_idle_connection_keep_it_from_the_next_call() -> None:
    late = threading.Event()

    def script(conn: socket.socket, request: bytes, n: int) -> None:
        conn.sendall(_answer(b"for " + _key(request)))
        if n == 1:
            late.wait(5)  # while the connection is idle, and before the loop reads them
            conn.sendall(_answer(b"a late copy for " + _key(request)))

    server = _Script(script)

    async def go() -> list[bytes]:
        upstream = _upstream(server.url)
        try:
            first = await _call(upstream, "a")
            late.set()
            time.sleep(0.1)  # the loop busy: the bytes wait in the socket, unread
            return [first, await _call(upstream, "b")]
        finally:
            await upstream.aclose()

    assert _run(server, go()) == [b"for a", b"for b"]
    assert server.connections == 2


def test_an_answer_dropped_unread_gives_its_connection_back() -> None:
    server = _Script(lambda conn, _r, n: conn.sendall(_answer(b"%d" % n)))

    async def go() -> bytes:
        upstream = _upstream(server.url, connections=1)
        try:
            request = upstream.request("POST", "/v1/messages", b"", {}, b"{}")
            answer = await upstream.send(request)
            del answer  # never read, never closed
            await asyncio.sleep(0.05)
            async with asyncio.timeout(2):
                return await _call(upstream)
        finally:
            await upstream.aclose()

    assert _run(server, go()) == b"1"  # on a new connection: the dropped one was closed
    assert server.connections == 2


def test_connections_given_up_as_they_open_are_counted_once() -> None:
    server = _Script(lambda conn, _r, _n: conn.sendall(_answer(b"ok")))
    transport = HttptoolsTransport(max_connections=50, keepalive_expiry=0)
    rng = random.Random(3)

    async def go() -> list[int]:
        counts = []
        for _ in range(400):  # a connect bound about what a connection takes here
            bounds = {"connect": rng.uniform(0.00005, 0.0006), "read": 5, "write": 5, "pool": 5}
            try:
                answer = await transport.send("POST", server.url + "/x", [], b"{}", bounds)
                await answer.aread()
                await answer.aclose()
            except httpx2.ConnectTimeout:
                pass
            await transport.aclose()
            await asyncio.sleep(0)
            counts.append(transport._open)
        return counts

    assert set(_run(server, go())) == {0}  # type: ignore[arg-type]


def test_an_http_1_0_answer_kept_alive_is_not_used_again() -> None:
    def script(conn: socket.socket, _request: bytes, n: int) -> None:
        conn.sendall(
            b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 1\r\n\r\n%d" % n
        )

    server = _Script(script)
    assert _run(server, _calls(_upstream(server.url), 2)) == [b"1", b"1"]
    assert server.connections == 2


def test_a_header_value_that_starts_or_ends_blank_is_refused() -> None:
    server = _Script(lambda conn, _r, _n: conn.sendall(_answer(b"")))
    transport = HttptoolsTransport(max_connections=1)

    async def go() -> None:
        try:
            for value in (" a", "a\t"):
                with pytest.raises(httpx2.LocalProtocolError):
                    await transport.send("POST", server.url + "/x", [("x-v", value)], b"{}", {})
        finally:
            await transport.aclose()

    _run(server, go())
    assert server.connections == 0


def test_over_tls_it_offers_http_1_1_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a server that would pick h2 when offered it: this client speaks HTTP/1.1 only
    import ssl

    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    served = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(served)
    served.set_alpn_protocols(["h2", "http/1.1"])
    ca_file = f"{tmp_path}/ca.pem"
    ca.cert_pem.write_to_path(ca_file)
    monkeypatch.setenv("SSL_CERT_FILE", ca_file)
    chosen: list[str | None] = []

    class Tls(RawUpstream):
        def answer(self, conn: socket.socket) -> None:
            with served.wrap_socket(conn, server_side=True) as tls:
                chosen.append(tls.selected_alpn_protocol())
                read_request(tls)  # type: ignore[arg-type]
                tls.sendall(_answer(b"ok"))

    server = Tls()
    url = server.url.replace("http://", "https://")

    async def go() -> bytes:
        upstream = _upstream(url)
        try:
            return await _call(upstream)
        finally:
            await upstream.aclose()

    assert _run(server, go()) == b"ok"
    assert chosen == ["http/1.1"]
