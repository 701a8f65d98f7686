"""The proxy's upstream calls on its fast clients (httptools: asyncio's connections, answers read
by llhttp; aiohttp) go out and come back as on httpx2: the same request on the wire, the same
answer read, the same failures -- against servers on 127.0.0.1 that see the raw bytes."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import importlib.util
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx2
import pytest

from pipeline.dropin.upstream import Upstream
from pipeline.dropin.upstream_aiohttp import AiohttpTransport
from pipeline.dropin.upstream_httptools import HttptoolsTransport
from pipeline.testing import Reply, ScriptedMessagesServer
from tests.cli_support import clean_env
from tests.wire_support import RawUpstream, ScriptedUpstream, proxy_process, read_request

FAST = ("httptools", "aiohttp")
CLIENTS = (*FAST, "httpx2")
TRANSPORTS = {"httptools": HttptoolsTransport, "aiohttp": AiohttpTransport}


class _Scripted(ScriptedUpstream):
    """Answers requests on each connection by ``script(conn, n)``, n counting from 1 on each,
    each connection in a thread of its own; records each request's raw bytes and counts
    connections."""

    def __init__(self, script: Callable[[socket.socket, int], None]) -> None:
        super().__init__(lambda conn, _request, n: script(conn, n))


class _Recording(_Scripted):
    """Answers each request with ``answers`` in turn (the last one again), one connection at a
    time, keeping each."""

    threaded = False

    def __init__(self, *answers: bytes) -> None:
        self.answers = list(answers)
        super().__init__(self._next)

    def _next(self, conn: socket.socket, _n: int) -> None:
        conn.sendall(self.answers[min(len(self.requests), len(self.answers)) - 1])


def _upstream(url: str, client: str, *, timeout: float = 10.0) -> Upstream:
    return Upstream(url, timeout=timeout, connect=5, max_connections=4, kept_alive=4, client=client)


async def _call(
    upstream: Upstream,
    headers: dict[str, str] | None = None,
    body: bytes = b'{"model": "m"}',
    path: str = "/v1/messages",
    query: bytes = b"",
) -> tuple[httpx2.Response, bytes]:
    request = upstream.request("POST", path, query, headers or {"x-api-key": "k"}, body)
    response = await upstream.send(request)
    try:
        received = b"".join([chunk async for chunk in response.aiter_bytes()])
    finally:
        await response.aclose()
    return response, received


def _head(raw: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """A request's line and its headers (names lowercased), in order."""
    head = raw.partition(b"\r\n\r\n")[0].split(b"\r\n")
    fields = [line.split(b":", 1) for line in head[1:]]
    return head[0], [(name.strip().lower(), value.strip()) for name, value in fields]


def _both(
    answers: tuple[bytes, ...], run: Callable[[Upstream], object]
) -> dict[str, tuple[object, _Recording]]:
    out = {}
    for client in CLIENTS:
        server = _Recording(*answers)
        try:
            upstream = _upstream(server.url, client)
            assert upstream.client == client

            async def go(upstream: Upstream = upstream) -> object:
                try:
                    return await run(upstream)  # type: ignore[misc]
                finally:
                    await upstream.aclose()

            out[client] = (asyncio.run(go()), server)
        finally:
            server.sock.close()
    return out


_OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@pytest.mark.parametrize(
    ("method", "path", "query", "body"),
    [
        ("POST", "/v1/messages", b"beta=true&x=%2Fa%20b", b'{"model": "m", "messages": []}' * 100),
        ("GET", "/v1/models", b"limit=5", b""),
        ("POST", "/v1/messages/count_tokens", b"", b""),
        ("DELETE", "/v1/files/file_1", b"", b""),
        ("GET", "/v1/p#x%41", b"q=#1", b""),
    ],
    ids=["messages", "get", "empty-post", "delete", "escapes"],
)
def test_the_request_on_the_wire_is_the_one_httpx2_sends(
    method: str, path: str, query: bytes, body: bytes
) -> None:
    headers = {
        "x-api-key": "sk-test",
        "anthropic-version": "2023-06-01",
        "content-type": "application/json",
        "anthropic-beta": "a,b",
        "X-Mixed-Case": "Kept",
    }

    async def run(upstream: Upstream) -> None:
        # the path and query as a client wrote them: escapes kept, not normalised
        request = upstream.request(method, path, query, headers, body)
        answer = await upstream.send(request)
        await answer.aread()
        await answer.aclose()

    seen = _both((_OK,), run)  # an empty body goes by httpx2 either way: the same bytes
    lines = {client: _head(server.requests[0]) for client, (_, server) in seen.items()}
    bodies = {
        client: server.requests[0].partition(b"\r\n\r\n")[2] for client, (_, server) in seen.items()
    }
    # the Host each names is its own server's
    for client, (_, server) in seen.items():
        assert (b"host", server.url.removeprefix("http://").encode()) in lines[client][1]
    fields = {c: sorted((n, b"" if n == b"host" else v) for n, v in lines[c][1]) for c in lines}
    for fast in FAST:
        assert lines[fast][0] == lines["httpx2"][0], fast
        if method == "POST" and body:
            assert lines[fast][0] == b"POST /v1/messages?beta=true&x=%2Fa%20b HTTP/1.1"
        assert fields[fast] == fields["httpx2"], fast
        names = {name for name, _ in lines[fast][1]}
        assert not names & {b"user-agent", b"accept", b"cookie", b"connection"}  # none added
        assert bodies[fast] == bodies["httpx2"] == body


def test_the_answer_is_read_as_httpx2_reads_it() -> None:
    text = b'{"id": "msg_1", "content": []}' * 50
    packed = gzip.compress(text)
    answers = (
        # gzip'd, two cookies, a reason of its own
        b"HTTP/1.1 201 Made Here\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
        b"set-cookie: a=1\r\nset-cookie: b=2\r\ncontent-length: %d\r\n\r\n" % len(packed) + packed,
        # chunked, in three chunks
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        b"5\r\nevent\r\n3\r\n: x\r\n2\r\n\n\n\r\n0\r\n\r\n",
        # a redirect: relayed, not followed
        b"HTTP/1.1 307 Temporary Redirect\r\nlocation: /elsewhere\r\ncontent-length: 0\r\n\r\n",
    )

    async def run(upstream: Upstream) -> list[tuple[int, str, list[tuple[str, str]], bytes]]:
        out = []
        for _ in answers:
            response, received = await _call(upstream)
            out.append(
                (
                    response.status_code,
                    response.reason_phrase,
                    list(response.headers.multi_items()),
                    received,
                )
            )
        return out

    seen = _both(answers, run)
    for fast in FAST:
        got, served = seen[fast]
        assert got == seen["httpx2"][0], fast
        assert got[0][0] == 201 and got[0][3] == text  # type: ignore[index]
        assert got[1][3] == b"event: x\n\n"  # type: ignore[index]
        assert got[2][0] == 307  # type: ignore[index]
        # one connection for all three, and no cookie ever sent back
        assert served.connections == 1
        assert all(b"cookie:" not in r.lower().partition(b"\r\n\r\n")[0] for r in served.requests)


def test_a_connection_left_half_read_is_not_used_again() -> None:
    big = b"x" * 500_000
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big) + big

    async def run(upstream: Upstream) -> int:
        request = upstream.request("POST", "/v1/messages", b"", {}, b"{}")
        response = await upstream.send(request)
        async for _chunk in response.aiter_bytes():
            break  # the client went away
        await response.aclose()
        _, received = await _call(upstream)
        return len(received)

    for client, (length, server) in _both((answer,), run).items():
        assert length == len(big), client
        assert server.connections == 2, client  # the half-read one was closed


class _Silent(RawUpstream):
    """Reads the request, then says nothing until closed."""

    def answer(self, conn: socket.socket) -> None:
        read_request(conn)
        conn.recv(1)


class _Deaf(RawUpstream):
    """Accepts a connection and never reads from it."""

    def answer(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        time.sleep(30)


class _Garbage(RawUpstream):
    def answer(self, conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"SPDY/9 what\r\n\r\n")


class _CutShort(RawUpstream):
    def answer(self, conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"id": ')


def _failure(
    server: RawUpstream, client: str, timeout: float = 10.0, body: bytes = b"{}"
) -> tuple[type[BaseException], float]:
    async def run() -> tuple[type[BaseException], float]:
        upstream = _upstream(server.url, client, timeout=timeout)
        start = time.monotonic()
        try:
            await _call(upstream, body=body)
        except httpx2.HTTPError as exc:
            return type(exc), time.monotonic() - start
        finally:
            await upstream.aclose()
        raise AssertionError("no failure")

    try:
        return asyncio.run(run())
    finally:
        server.sock.close()


@pytest.mark.parametrize("client", CLIENTS)
def test_failures_are_httpx2s(client: str) -> None:
    refused = socket.create_server(("127.0.0.1", 0))
    port = refused.getsockname()[1]
    refused.close()

    class Nowhere(RawUpstream):
        def __init__(self) -> None:
            self.sock = socket.socket()
            self.url = f"http://127.0.0.1:{port}"

    kind, _ = _failure(Nowhere(), client)
    assert issubclass(kind, httpx2.ConnectError)
    kind, took = _failure(_Silent(), client, timeout=0.5)
    assert issubclass(kind, httpx2.TimeoutException) and not issubclass(kind, httpx2.ConnectTimeout)
    assert took < 5
    kind, _ = _failure(_Garbage(), client)
    assert issubclass(kind, httpx2.RemoteProtocolError)
    kind, _ = _failure(_CutShort(), client)
    assert issubclass(kind, httpx2.RemoteProtocolError | httpx2.ReadError)


@pytest.mark.parametrize("client", FAST)
def test_a_request_the_upstream_never_reads_times_out(client: str) -> None:
    # a body far past what the socket buffers hold: sending it waits on a server that never reads
    kind, took = _failure(_Deaf(), client, timeout=0.5, body=b"x" * (32 << 20))
    assert issubclass(kind, httpx2.TimeoutException), kind
    assert took < 10


async def _odd_header(server: _Recording, client: str, value: str) -> object:
    """What ``server`` received of the header ``x-odd: value``, or "refused"."""
    upstream = _upstream(server.url, client)
    try:
        await _call(upstream, {"x-api-key": "k", "x-odd": value})
    except httpx2.TransportError:
        return "refused"
    finally:
        await upstream.aclose()
    return [v for n, v in _head(server.requests[0])[1] if n == b"x-odd"]


@pytest.mark.parametrize("value", ["a\x00b", "a\x7fb", "\xe9t\xe9", "a\tb"])
def test_hostile_header_values_go_as_the_client_sent_them_or_not_at_all(value: str) -> None:
    outcomes = {}
    for client in CLIENTS:
        server = _Recording(_OK)
        try:
            outcomes[client] = asyncio.run(_odd_header(server, client, value))
        finally:
            server.sock.close()
    sent = [value.encode("latin-1")]  # a str from the server: each character one byte
    if value == "a\tb" or not value.isascii():  # HTTP allows both (obs-text): not as UTF-8
        assert outcomes["httptools"] == outcomes["aiohttp"] == outcomes["httpx2"] == sent
    else:  # a control character: refused before it is sent (the proxy answers 502), or sent
        # as it came -- never sent otherwise, never a crash
        for outcome in outcomes.values():
            assert outcome in (sent, "refused")


class _Counting(_Scripted):
    """Answers each request after 0.1 s; counts the connections open at once (``most``)."""

    def __init__(self) -> None:
        self.open = self.most = 0
        self.lock = threading.Lock()
        super().__init__(lambda conn, n: (time.sleep(0.1), conn.sendall(_OK)))

    def answer(self, conn: socket.socket) -> None:
        with self.lock:
            self.open += 1
            self.most = max(self.most, self.open)
        try:
            super().answer(conn)
        finally:
            with self.lock:
                self.open -= 1


def _most_at_once(bodies: list[bytes], max_connections: int, client: str) -> int:
    """The most connections open at once while calls with ``bodies`` go out all together."""
    server = _Counting()

    async def run() -> None:
        upstream = Upstream(
            server.url, timeout=10, connect=5, max_connections=max_connections,
            kept_alive=max_connections, client=client,
        )  # fmt: skip
        try:
            await asyncio.gather(*[_call(upstream, body=body) for body in bodies])
        finally:
            await upstream.aclose()

    try:
        asyncio.run(run())
    finally:
        server.sock.close()
    return server.most


@pytest.mark.parametrize("client", FAST)
def test_connections_are_bounded(client: str) -> None:
    assert _most_at_once([b"{}"] * 6, 2, client) == 2


def test_auto_is_httptools_unless_the_environment_names_a_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in (
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ):
        monkeypatch.delenv(name, raising=False)
    assert _upstream("http://127.0.0.1:1", "auto").client == "httptools"
    assert _upstream("http://127.0.0.1:1", "aiohttp").client == "aiohttp"
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:9")
    assert _upstream("http://127.0.0.1:1", "auto").client == "httpx2"
    for fast in FAST:
        with pytest.raises(ValueError, match="names a proxy"):  # asked for: refused, not bypassed
            _upstream("http://127.0.0.1:1", fast)
    with pytest.raises(ValueError, match="client must be one of"):
        _upstream("http://127.0.0.1:1", "curl")
    given = Upstream(
        "http://127.0.0.1:1", timeout=1, connect=1, max_connections=1, kept_alive=1,
        transport=httpx2.MockTransport(lambda r: httpx2.Response(200)), client="aiohttp",
    )  # fmt: skip
    assert given.client == "httpx2"  # a transport given is the way


@pytest.mark.parametrize("client", FAST)
def test_the_transport_refuses_a_bound_below_one(client: str) -> None:
    with pytest.raises(ValueError, match="max_connections"):
        TRANSPORTS[client](max_connections=0)


@pytest.mark.parametrize("client", FAST)
def test_on_another_event_loop_the_calls_go_by_httpx2(client: str) -> None:
    trio = pytest.importorskip("trio")
    server = _Recording(_OK)
    try:
        upstream = _upstream(server.url, client)

        async def run() -> int:
            try:
                response, _ = await _call(upstream)
            finally:
                await upstream.aclose()
            return response.status_code

        assert trio.run(run) == 200
    finally:
        server.sock.close()
    assert re.match(rb"POST /v1/messages HTTP/1.1", server.requests[0])


def _messages_reply(_body: dict[str, object]) -> Reply:
    return Reply([{"type": "text", "text": "ok"}])


@pytest.mark.parametrize("client", CLIENTS)
def test_the_command_calls_upstream_with_the_client_asked_for(tmp_path: Path, client: str) -> None:
    streamed = {"model": "m", "max_tokens": 5, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    with (
        ScriptedMessagesServer(_messages_reply) as upstream,
        proxy_process(
            upstream.base_url, tmp_path, "--upstream-client", client, "--loop", "asyncio", "-v"
        ) as (url, lines, _),
    ):
        answer = httpx2.post(f"{url}/v1/messages", json={**streamed, "stream": False}, timeout=10)
        assert answer.status_code == 200 and answer.json()["content"][0]["text"] == "ok"
        with httpx2.stream("POST", f"{url}/v1/messages", json=streamed, timeout=10) as events:
            assert events.status_code == 200
            assert b"message_stop" in b"".join(events.iter_bytes())
        assert len(upstream.requests) == 2
    assert any(f"upstream_client={client}" in line for line in lines), lines[:5]


def test_the_command_refuses_a_loop_it_cannot_have(tmp_path: Path) -> None:
    if importlib.util.find_spec("uvloop") is not None:
        pytest.skip("uvloop is installed here")
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "proxy", "--loop", "uvloop", "--store", str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 2
    assert "--loop uvloop: uvloop is not installed" in done.stderr


# -- the review's findings: each fails on the version before its fix --------------------------


def _answer(text: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(text) + text


@pytest.mark.parametrize("client", CLIENTS)
def test_bytes_a_server_sends_on_an_idle_connection_never_answer_the_next_request(
    client: str,
) -> None:
    def script(conn: socket.socket, n: int) -> None:
        conn.sendall(_answer(b"answer-%d" % n))
        if n == 1:  # then, idle in the pool, an answer nobody asked for
            time.sleep(0.2)
            conn.sendall(_answer(b"STRAY-for-nobody"))

    server = _Scripted(script)

    async def run() -> list[bytes]:
        upstream = _upstream(server.url, client)
        try:
            got = []
            for tenant in ("a", "b"):
                got.append((await _call(upstream, {"x-api-key": tenant}))[1])
                await asyncio.sleep(0.5)
            return got
        finally:
            await upstream.aclose()

    try:
        got = asyncio.run(run())
    finally:
        server.sock.close()
    assert got == [b"answer-1", b"answer-1"]  # the second on a connection of its own
    assert server.connections == 2


@pytest.mark.parametrize("client", CLIENTS)
def test_a_clients_expect_100_continue_is_not_sent_on(client: str) -> None:
    server = _Recording(_OK)

    async def run() -> float:
        upstream = _upstream(server.url, client, timeout=5)
        start = time.monotonic()
        try:
            await _call(upstream, {"x-api-key": "k", "expect": "100-continue"}, b"{}" * 1000)
        finally:
            await upstream.aclose()
        return time.monotonic() - start

    try:
        took = asyncio.run(run())
    finally:
        server.sock.close()
    assert took < 2  # aiohttp waited for a 100 Continue that never came, until the timeout
    assert b"expect:" not in server.requests[0].lower()


@pytest.mark.parametrize("client", CLIENTS)
def test_an_answer_with_a_long_head_is_read(client: str) -> None:
    long_cookie = b"set-cookie: lb=" + b"c" * 9_000 + b"\r\n"
    many = b"".join(b"x-h%d: v\r\n" % k for k in range(150))
    answers = [
        b"HTTP/1.1 200 OK\r\n" + extra + b"content-length: 2\r\n\r\n{}"
        for extra in (long_cookie, many)
    ]

    async def run() -> list[int]:
        upstream = _upstream(server.url, client)
        try:
            return [(await _call(upstream))[0].status_code for _ in answers]
        finally:
            await upstream.aclose()

    server = _Recording(*answers)
    try:
        assert asyncio.run(run()) == [200, 200]
    finally:
        server.sock.close()


def _never_accepting() -> tuple[str, list[socket.socket]]:
    """An address whose accept queue is full: a new connection's SYN is dropped, its connect
    never completes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    held = [listener]
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(listener.getsockname())
        held.append(filler)
    time.sleep(0.2)
    return f"http://127.0.0.1:{listener.getsockname()[1]}", held


@pytest.mark.parametrize("client", CLIENTS)
def test_a_server_that_never_accepts_is_a_connect_timeout(client: str) -> None:
    url, held = _never_accepting()

    async def run() -> type[BaseException]:
        upstream = Upstream(
            url, timeout=1, connect=1, max_connections=4, kept_alive=4, client=client
        )
        try:
            await _call(upstream)
        except httpx2.HTTPError as exc:
            return type(exc)
        finally:
            await upstream.aclose()
        raise AssertionError("connected")

    try:
        kind = asyncio.run(run())
    finally:
        for sock in held:
            sock.close()
    assert kind is httpx2.ConnectTimeout  # unreachable (502), not slow (504)


@pytest.mark.parametrize("client", FAST)
def test_the_two_pools_together_stay_within_max_connections(client: str) -> None:
    # with a body: the fast client's pool; without: httpx2's
    assert _most_at_once([b"{}", b""] * 8, 8, client) <= 8


@pytest.mark.parametrize("client", FAST)
def test_a_fast_client_asked_for_beside_a_proxy_of_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, client: str
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    with pytest.raises(ValueError, match="HTTPS_PROXY names a proxy"):
        _upstream("http://127.0.0.1:1", client)
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "proxy", "--upstream-client", client,
         "--store", str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=clean_env(HTTPS_PROXY="http://127.0.0.1:9"),
    )  # fmt: skip
    assert done.returncode == 2
    assert f"--upstream-client {client}: HTTPS_PROXY names a proxy" in done.stderr


@pytest.mark.parametrize("client", FAST)
def test_an_upstream_url_with_credentials_goes_by_httpx2(client: str) -> None:
    upstream = _upstream("http://user:secret@127.0.0.1:1", client)
    assert upstream.client == "httpx2"


@pytest.mark.parametrize("client", FAST)
def test_a_connection_reset_while_the_answer_is_awaited_is_a_read_error(client: str) -> None:
    def script(conn: socket.socket, n: int) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # a reset, no answer

    server = _Scripted(script)
    try:
        kind, _ = _failure(server, client)
    finally:
        server.sock.close()
    assert issubclass(kind, httpx2.ReadError | httpx2.RemoteProtocolError), kind


@pytest.mark.parametrize("client", FAST)
def test_a_transport_serves_one_loop_at_a_time(client: str) -> None:
    server = _Scripted(lambda conn, n: conn.sendall(_OK))  # a connection left open: no matter
    transport = TRANSPORTS[client](max_connections=2)
    request = httpx2.Request("POST", server.url + "/v1/messages", content=b"{}")

    async def call() -> int:
        answer = await transport.handle_async_request(request)
        await answer.aread()
        await answer.aclose()
        return answer.status_code

    async def and_close() -> int:
        status = await call()
        await transport.aclose()
        return status

    first = asyncio.new_event_loop()
    try:
        assert first.run_until_complete(call()) == 200
        with pytest.raises(RuntimeError, match="one event loop at a time"):
            asyncio.run(call())  # the first loop's session is still open
        first.run_until_complete(transport.aclose())
        assert asyncio.run(and_close()) == 200  # closed on its loop: another may use it
        assert asyncio.run(and_close()) == 200
    finally:
        first.close()
        server.sock.close()
