"""What a client can hold at the proxy, over HTTP against the proxy on a real port: a
conversation during a slow upstream call, the upstream call itself, the conversations kept in
memory."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest

from pipeline import Pipeline
from pipeline.dropin.limits import MAX_HEAD_BYTES
from pipeline.dropin.proxy import build_app
from pipeline.testing import QuietLogger, Reply, ScriptedMessagesServer
from stages import ToolResultBudget
from tests.builders import tool_result, tool_use
from tests.wire_support import TAG, process_running, proxy, proxy_process


def _budget() -> Pipeline:
    return Pipeline([ToolResultBudget()])


def _reply(_body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "ok"}])


def _turns(*texts: str) -> dict[str, Any]:
    """One conversation's request: its user turns, answered ``ok`` in between."""
    messages: list[dict[str, Any]] = []
    for text in texts:
        if messages:
            messages.append({"role": "assistant", "content": "ok"})
        messages.append({"role": "user", "content": text})
    return {"model": "m", "max_tokens": 5, "messages": messages}


class _Held:
    """An upstream that answers a request whose last turn is ``slow`` only once released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.waiting = threading.Event()

    def __call__(self, body: dict[str, Any]) -> Reply:
        if body["messages"][-1]["content"] in ("slow", [{"type": "text", "text": "slow"}]):
            self.waiting.set()
            self.release.wait(15)
        return Reply([{"type": "text", "text": "ok"}])


def test_an_abandoned_slow_call_holds_up_no_later_call_of_its_conversation(
    tmp_path: Path,
) -> None:
    held, logger = _Held(), QuietLogger()
    with (
        ScriptedMessagesServer(held) as upstream,
        proxy(upstream.base_url, tmp_path, _budget, logger=logger) as url,
    ):
        try:
            with pytest.raises(httpx2.ReadTimeout):  # the client gives up on it
                httpx2.post(f"{url}/v1/messages", json=_turns("go", "slow"), timeout=1.0)
            assert held.waiting.is_set()
            # the same conversation's retry, with another turn: answered while the abandoned
            # call's upstream still has not
            again = httpx2.post(f"{url}/v1/messages", json=_turns("go", "fast"), timeout=8.0)
            assert again.status_code == 200
            assert not held.release.is_set()
            deadline = time.monotonic() + 10
            while not [
                f for _, e, f in logger.events if e == "wire.request" and f["status"] == 499
            ]:
                assert time.monotonic() < deadline, logger.events
                time.sleep(0.02)
        finally:
            held.release.set()


def test_an_upstream_slower_than_its_timeout_is_a_504_timeout_error(tmp_path: Path) -> None:
    held = _Held()
    with (
        ScriptedMessagesServer(held) as upstream,
        proxy(upstream.base_url, tmp_path, _budget, upstream_timeout=0.5) as url,
    ):
        try:
            answer = httpx2.post(f"{url}/v1/messages", json=_turns("slow"), timeout=10.0)
        finally:
            held.release.set()
    assert answer.status_code == 504
    assert answer.json()["error"]["type"] == "timeout_error"


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan")])
@pytest.mark.parametrize("name", ["upstream_timeout", "body_timeout"])
def test_a_timeout_that_is_not_positive_is_refused(
    tmp_path: Path, timeout: float, name: str
) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a positive number"):
        build_app(pipeline=_budget, root=tmp_path, **{name: timeout})


def test_conversations_let_go_come_back_byte_for_byte_through_the_proxy(tmp_path: Path) -> None:
    use = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}
    out = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "y" * 80_000}
    first = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "task A"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [out]},
        ],
    }
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(upstream.base_url, tmp_path, _budget, max_conversations=1) as url,
    ):
        assert httpx2.post(f"{url}/v1/messages", json=first).status_code == 200
        for other in ("task B", "task C"):  # each lets the one before go
            assert httpx2.post(f"{url}/v1/messages", json=_turns(other)).status_code == 200
        later = {
            **first,
            "messages": [
                *first["messages"],
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "and now?"},
            ],
        }
        assert httpx2.post(f"{url}/v1/messages", json=later).status_code == 200
    sent, resent = upstream.requests[0]["messages"], upstream.requests[3]["messages"]
    assert sent[2]["content"][0]["content"].startswith(TAG)
    assert resent[:3] == sent


def test_conversations_let_go_are_freed_without_the_collector(tmp_path: Path) -> None:
    """A conversation let go past ``max_conversations`` is freed by reference counting at once:
    nothing it holds waits in a reference cycle for the garbage collector (whose passes over a
    busy proxy's young objects took ~20 ms each when every one-shot conversation did)."""
    import gc

    from pipeline.dropin.adapter import WireSession
    from stages import default_stages

    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(
            upstream.base_url, tmp_path, lambda: Pipeline(default_stages()), max_conversations=1
        ) as url,
    ):
        assert httpx2.post(f"{url}/v1/messages", json=_turns("warm")).status_code == 200
        gc.collect()
        gc.disable()
        try:
            for k in range(8):
                for turns in ((f"task {k}",), (f"task {k}", "and then")):
                    answer = httpx2.post(f"{url}/v1/messages", json=_turns(*turns))
                    assert answer.status_code == 200
            live = sum(isinstance(o, WireSession) for o in gc.get_objects())
        finally:
            gc.enable()
    assert live <= 2  # the one held, and at most the one let go last (its records written)


@pytest.mark.parametrize("bound", ["conversations", "size"])
def test_what_the_proxy_parsed_of_a_conversation_let_go_is_freed(
    tmp_path: Path, bound: str
) -> None:
    """Past ``max_conversations`` or ``max_held_bytes``, nothing of a conversation let go stays
    in memory: not its session, not its last request as the body reader parsed it."""
    import gc

    limit = {"max_conversations": 1} if bound == "conversations" else {"max_held_bytes": 30_000}
    outputs = [f"output {k} " + "z" * 20_000 for k in range(3)]

    def alive(k: int) -> int:
        # content lists holding the result, its text or the handle the proxy holds for it
        # (a dict of strings alone is not tracked by gc)
        return sum(
            1
            for o in gc.get_objects()
            if type(o) is list
            and any(type(b) is dict and b.get("tool_use_id") == f"toolu_{k}" for b in o)
        )

    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(upstream.base_url, tmp_path, _budget, **limit) as url,
    ):
        for k, output in enumerate(outputs):
            body = {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {"role": "user", "content": f"task {k}"},
                    {"role": "assistant", "content": [tool_use(f"toolu_{k}")]},
                    {"role": "user", "content": [tool_result(f"toolu_{k}", output)]},
                ],
            }
            assert httpx2.post(f"{url}/v1/messages", json=body).status_code == 200
            del body
        upstream.requests.clear()  # what the upstream was sent, kept by the test's server
        gc.collect()
        held = [alive(k) for k in range(len(outputs))]
    assert held[:2] == [0, 0] and held[2] >= 1  # the last conversation alone is held


def test_bodies_refused_when_placed_are_kept_within_the_held_size(tmp_path: Path) -> None:
    """A body read and then refused (a bad conversation name: 400) belongs to no conversation
    held; what the body reader keeps of such bodies stays within ``max_held_bytes`` too."""
    import gc

    texts = [f"{k} " + "x" * 50_000 for k in range(6)]
    with proxy("http://127.0.0.1:9", tmp_path, _budget, max_held_bytes=120_000) as url:
        for k, text in enumerate(texts):
            body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": text}]}
            headers = {"x-api-key": f"k{k}", "x-sluicegate-session": "not/a name"}
            assert httpx2.post(f"{url}/v1/messages", json=body, headers=headers).status_code == 400
            del body
        gc.collect()
        kept = {  # messages lists that hold one (a dict of strings alone is not tracked by gc)
            m["content"]
            for o in gc.get_objects()
            if type(o) is list
            for m in o
            if type(m) is dict and m.get("content") in texts
        }
    assert 1 <= len(kept) <= 2  # 120,000 bytes of ~50,100-byte bodies, not all six


def test_the_held_size_counts_a_conversation_of_short_messages_by_its_messages(
    tmp_path: Path,
) -> None:
    """Each message holds records and state beyond its text (~2 KB however short), so the held
    size counts a request as its bytes and 2 KiB a message: conversations of a thousand short
    messages (~20 KB of body each) are let go past a 4 MB bound, not held by the hundred."""
    import gc

    from pipeline.dropin.adapter import WireSession

    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(upstream.base_url, tmp_path, _budget, max_held_bytes=4_000_000) as url,
    ):
        for k in range(6):
            turns = [f"c{k}", *(str(j) for j in range(500))]
            assert httpx2.post(f"{url}/v1/messages", json=_turns(*turns)).status_code == 200
        upstream.requests.clear()
        gc.collect()
        live = sum(isinstance(o, WireSession) for o in gc.get_objects())
    assert live <= 2  # the one held, and at most the one let go last (its records written)


def test_a_request_of_more_messages_than_the_api_takes_is_refused(tmp_path: Path) -> None:
    """The API takes at most 100,000 messages in a request: one with more is answered 400 as
    the API would, and no conversation holds it."""
    from pipeline.dropin.limits import MAX_MESSAGES

    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(upstream.base_url, tmp_path, _budget) as url,
    ):
        turns = [str(j) for j in range(MAX_MESSAGES // 2 + 1)]  # MAX_MESSAGES + 1 messages
        answer = httpx2.post(f"{url}/v1/messages", json=_turns(*turns), timeout=60)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["type"] == "invalid_request_error"
        assert "100000 messages" in answer.json()["error"]["message"]
        assert not upstream.requests
        ok = httpx2.post(f"{url}/v1/messages", json=_turns(*turns[:-1]), timeout=120)
        assert ok.status_code == 200  # MAX_MESSAGES - 1: sent on


def _half_open(url: str, count: int) -> list[socket.socket]:
    """``count`` connections that send a request head's first lines, then nothing."""
    host, port = url.removeprefix("http://").split(":")
    held = []
    for _ in range(count):
        conn = socket.create_connection((host, int(port)), timeout=10)
        conn.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\n")
        held.append(conn)
    return held


def _closed_by_the_server(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


PARSERS = ["httptools", "h11"]
"""The proxy's two HTTP/1.1 parsers (``--http``): every bound holds on both."""


@pytest.mark.parametrize("parser", PARSERS)
def test_a_connection_whose_request_head_never_ends_is_closed(tmp_path: Path, parser: str) -> None:
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy_process(upstream.base_url, tmp_path, "--header-timeout", "1", "--http", parser) as (
            url,
            _,
            _,
        ),
    ):
        held = _half_open(url, 20)
        try:
            for conn in held:
                conn.settimeout(10)
            assert all(_closed_by_the_server(conn) for conn in held)
            # a connection that sends its request in time is served as ever
            answer = httpx2.post(f"{url}/v1/messages", json=_turns("hi"), timeout=10)
            assert answer.status_code == 200
        finally:
            for conn in held:
                conn.close()


@pytest.mark.parametrize("parser", PARSERS)
def test_a_request_whose_body_never_ends_is_answered_408_and_its_connection_closed(
    tmp_path: Path, parser: str
) -> None:
    """A body sent a few bytes at a time holds its connection for ``--body-timeout`` at most:
    such uploads would otherwise take every connection the proxy serves, for good."""
    head = (
        b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 1000\r\n\r\n{"mo'
    )
    limits = ("--body-timeout", "1", "--max-connections", "4", "--http", parser)
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy_process(upstream.base_url, tmp_path, *limits) as (url, lines, _),
    ):
        held = [_connect(url) for _ in range(3)]
        try:
            for conn in held:
                conn.sendall(head)
            answers = []
            for conn in held:
                answer = b""
                while chunk := conn.recv(65_536):  # until the proxy closes it
                    answer += chunk
                answers.append(answer)
            assert all(a.startswith(b"HTTP/1.1 408") and b"timeout_error" in a for a in answers)
            # their slots are free: other clients are served as ever
            for _ in range(4):
                answer = httpx2.post(f"{url}/v1/messages", json=_turns("hi"), timeout=10)
                assert answer.status_code == 200
        finally:
            for conn in held:
                conn.close()
    assert sum("request_timeout" in line for line in lines) == 3, "".join(lines)[-3000:]


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _refused(url: str, pieces: list[bytes]) -> bytes:
    """What the proxy answers a connection that sends ``pieces`` (then nothing more) before
    it closes the connection: a 400, or nothing if the close came first (a reset)."""
    conn = _connect(url)
    try:
        for piece in pieces:
            try:
                conn.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.001)
        answer = b""
        try:
            while chunk := conn.recv(65_536):
                answer += chunk
        except ConnectionResetError:
            pass
        return answer
    finally:
        conn.close()


class _Reader:
    """Reads HTTP/1.1 responses off a socket, one after another."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""
        self.doubled: set[str] = set()
        """The header names the last response sent more than once."""

    def _until(self, mark: bytes) -> bytes:
        while mark not in self.buffer:
            chunk = self.conn.recv(65_536)
            assert chunk, "the connection closed before every answer came"
            self.buffer += chunk
        got, _, self.buffer = self.buffer.partition(mark)
        return got

    def _take(self, size: int) -> bytes:
        while len(self.buffer) < size:
            chunk = self.conn.recv(65_536)
            assert chunk, "the connection closed inside an answer"
            self.buffer += chunk
        got, self.buffer = self.buffer[:size], self.buffer[size:]
        return got

    reset = False
    """The connection was reset (the peer closed it with bytes unread)."""

    def _more(self) -> bytes:
        try:
            return self.conn.recv(65_536)
        except ConnectionResetError:
            self.reset = True
            return b""

    def rest(self) -> bytes:
        """Everything left until the connection ends."""
        while chunk := self._more():
            self.buffer += chunk
        rest, self.buffer = self.buffer, b""
        return rest

    def ended(self) -> bool:
        """The connection ended with no byte of another response."""
        if not self.buffer:
            self.buffer = self._more()
        return not self.buffer

    def response(self) -> tuple[int, bytes]:
        """The next response's status and body (by its length, or its chunks)."""
        lines = self._until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        names = [line.lower().split(": ", 1)[0] for line in lines[1:]]
        self.doubled = {name for name in names if names.count(name) > 1}
        fields = dict(line.lower().split(": ", 1) for line in lines[1:])
        status = int(lines[0].split()[1])
        if "content-length" in fields:
            return status, self._take(int(fields["content-length"]))
        assert fields.get("transfer-encoding") == "chunked", fields
        body = b""
        while size := int(self._until(b"\r\n").split(b";")[0], 16):
            body += self._take(size)
            self._take(2)
        self._until(b"\r\n")  # no trailers: the empty line that ends the body
        return status, body


@pytest.mark.parametrize("parser", PARSERS)
def test_a_request_head_past_its_bound_is_refused_and_pipelined_requests_are_answered(
    tmp_path: Path, parser: str
) -> None:
    """A head of more than MAX_HEAD_BYTES -- one header that never ends, sent in pieces (llhttp
    gathers a value whole before handing it over); on httptools also a URL past the bound
    and many small headers, each head whole in one write (h11 bounds only a head not yet
    ended: one read of a whole head passes) -- is answered 400 (or the connection reset)
    and never reaches the upstream; a head under the bound and two requests in one write
    are served."""
    request = json.dumps(_turns("hi")).encode()

    def head(target: str = "/v1/messages", extra: str = "") -> bytes:
        return (
            f"POST {target} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(request)}\r\n{extra}\r\n"
        ).encode()

    with (
        ScriptedMessagesServer(_slow_or_ok) as upstream,
        proxy_process(upstream.base_url, tmp_path, "--http", parser) as (url, _, _),
    ):
        endless = [b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-pad: "] + [b"a" * 4096] * 64
        long_url = [head("/v1/messages?q=" + "a" * (MAX_HEAD_BYTES + 1)) + request]
        many = [head(extra="x-a: b\r\n" * (MAX_HEAD_BYTES // 8 + 1)) + request]
        for pieces in (endless, long_url, many) if parser == "httptools" else (endless,):
            answer = _refused(url, pieces)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer[:200]
        assert upstream.requests == []
        conn = _connect(url)
        try:
            conn.sendall(head(extra=f"x-pad: {'a' * (MAX_HEAD_BYTES - 1_000)}\r\n") + request)
            conn.sendall((head() + request) * 2)  # a second request before the first's answer
            reader = _Reader(conn)
            answers = []
            for _ in range(3):
                answers.append(reader.response())
                # the upstream's date and server go back; the proxy adds none of its own
                assert reader.doubled == set()
        finally:
            conn.close()
        assert [status for status, _ in answers] == [200, 200, 200]
        assert all(json.loads(body)["content"][0]["text"] == "ok" for _, body in answers)
        assert len(upstream.requests) == 3
        # a request the upstream takes a second to answer, then a head that goes on past the
        # bound meanwhile: the answer first, then the refusal (not in the answer's place)
        conn = _connect(url)
        try:
            slow = json.dumps(_turns("slow")).encode()
            conn.sendall(head().replace(str(len(request)).encode(), str(len(slow)).encode()))
            conn.sendall(slow + endless[0])
            time.sleep(0.2)
            conn.sendall(b"a" * 2 * MAX_HEAD_BYTES)
            reader = _Reader(conn)
            assert reader.response()[0] == 200
            rest = reader.rest()  # or the connection's end, where one read held all of it
            assert rest == b"" or rest.startswith(b"HTTP/1.1 400"), rest[:200]
        finally:
            conn.close()


def _slow_or_ok(body: dict[str, Any]) -> Reply:
    """``ok``, a second late to a request whose last turn is ``slow``."""
    if body["messages"][-1]["content"] in ("slow", [{"type": "text", "text": "slow"}]):
        time.sleep(1)
    return _reply(body)


def test_what_httptools_reads_ahead_is_bounded(tmp_path: Path) -> None:
    """llhttp parses whatever a read holds at once, and keeps a header's value to itself
    until its line ends: a trailer that never ends is refused (never reaching the upstream);
    of 200 requests written at once, at most 17 are taken (one answered, 16 waiting), then
    400 and the connection's end; a request that asks to upgrade (curl's ``--http2`` on
    ``http://``) is served as a plain request, body and all, and so is the one after it;
    a waiting request whose body breaks is refused after the answer under way."""

    def head(text: str = "hi", extra: str = "") -> tuple[bytes, bytes]:
        body = json.dumps(_turns(text)).encode()
        return (
            "POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{extra}\r\n"
        ).encode(), body

    request = b"".join(head())
    chunked = (
        b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    hi = json.dumps(_turns("hi")).encode()
    with (
        ScriptedMessagesServer(_slow_or_ok) as upstream,
        proxy_process(upstream.base_url, tmp_path, "--http", "httptools") as (url, _, _),
    ):
        trailer = chunked + f"{len(hi):x}\r\n".encode() + hi + b"\r\n0\r\nx-trailer: "
        answer = _refused(url, [trailer] + [b"a" * 4096] * 64)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer[:200]
        assert upstream.requests == []

        upgrade = "connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AA\r\n"
        conn = _connect(url)
        try:
            conn.sendall(b"".join(head("upgrade please", upgrade)) + request)
            reader = _Reader(conn)
            assert [reader.response()[0] for _ in range(2)] == [200, 200]
        finally:
            conn.close()
        assert [r["messages"][-1]["content"] for r in upstream.requests] == ["upgrade please", "hi"]

        conn = _connect(url)
        try:  # a slow request, then one whose chunked body breaks while it waits its turn
            conn.sendall(b"".join(head("slow")) + chunked + b"zz\r\n")
            reader = _Reader(conn)
            assert reader.response()[0] == 200
            assert reader.rest().startswith(b"HTTP/1.1 400")
        finally:
            conn.close()
        assert len(upstream.requests) == 3

        conn = _connect(url)
        try:
            conn.sendall(request * 200)
            reader = _Reader(conn)
            statuses = []
            while not reader.ended():
                statuses.append(reader.response()[0])
        finally:
            conn.close()
        assert 1 <= statuses.count(200) <= 17, statuses
        assert set(statuses) <= {200, 400}
        assert statuses[-1] == 400 or reader.reset
        assert len(upstream.requests) == 3 + statuses.count(200)


def _few_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


def test_at_the_descriptor_limit_the_proxy_recovers_and_says_so_once(tmp_path: Path) -> None:
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy_process(
            upstream.base_url, tmp_path, "--header-timeout", "2", preexec_fn=_few_files
        ) as (url, lines, _),
    ):
        held = _half_open(url, 300)  # more than the proxy has descriptors
        try:
            answered = None
            deadline = time.monotonic() + 30
            while answered != 200:
                assert time.monotonic() < deadline, "the proxy never answered again"
                try:
                    answered = httpx2.post(
                        f"{url}/v1/messages", json=_turns("hi"), timeout=3
                    ).status_code
                except httpx2.TransportError:
                    time.sleep(0.2)
        finally:
            for conn in held:
                conn.close()
    floods = [line for line in lines if "out of system resource" in line]
    assert len(floods) <= 5, len(floods)
    assert not any("Traceback" in line for line in lines), "".join(lines)[-3000:]


def test_a_conversation_met_with_its_history_keeps_one_key_a_result(tmp_path: Path) -> None:
    """A conversation's first request that carries earlier results keys each of them twice (its
    ledger rebuilt from where they stand, then the budget's scan): the proxy holds one string
    for both, not two (~110 bytes a result, for as long as it holds the conversation)."""
    import gc
    import re

    from stages import default_stages

    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for k in range(12):
        messages.append({"role": "assistant", "content": [tool_use(f"toolu_keyed_{k:02d}")]})
        messages.append({"role": "user", "content": [tool_result(f"toolu_keyed_{k:02d}", "out")]})
    body = {"model": "m", "max_tokens": 5, "messages": messages}
    key = re.compile(r"toolu_keyed_\d\d#[0-9a-f]{32}\Z")
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(upstream.base_url, tmp_path, lambda: Pipeline(default_stages())) as url,
    ):
        assert httpx2.post(f"{url}/v1/messages", json=body).status_code == 200
        gc.collect()
        objects: dict[str, set[int]] = {}
        for o in gc.get_objects():
            if isinstance(o, dict):
                values: list[Any] = [*o, *o.values()]
            elif isinstance(o, set | frozenset | list | tuple):
                values = list(o)
            elif str(vars(type(o)).get("__module__", "")).startswith(("pipeline.", "stages.")):
                # (ours alone: another library's proxy object may refuse to be read here)
                slots = (s for c in type(o).__mro__ for s in getattr(c, "__slots__", ()))
                values = [getattr(o, s, None) for s in slots if isinstance(s, str)]
            else:
                continue
            for v in values:
                if type(v) is str and key.match(v):
                    objects.setdefault(v, set()).add(id(v))
    assert len(objects) == 12
    assert all(len(ids) == 1 for ids in objects.values()), objects


def test_a_held_conversation_keeps_one_list_of_its_last_request_messages(tmp_path: Path) -> None:
    """The last request's parsed messages are one list for the body reader, the router, the
    conversation and the writer of the body sent on (8 bytes a message each; four copies
    were kept), the request's values never being changed in place."""
    import gc

    from stages import default_stages

    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for k in range(30):
        messages.append({"role": "assistant", "content": [tool_use(f"toolu_listed_{k:02d}")]})
        messages.append({"role": "user", "content": [tool_result(f"toolu_listed_{k:02d}", "out")]})
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(upstream.base_url, tmp_path, lambda: Pipeline(default_stages())) as url,
    ):
        for n in (41, len(messages)):  # a conversation, then its next call
            body = {"model": "m", "max_tokens": 5, "messages": messages[:n]}
            assert httpx2.post(f"{url}/v1/messages", json=body).status_code == 200
        gc.collect()
        # the proxy's lists of the last request's messages, from its first to its last: the
        # ones whose first message is the proxy's parse of it (the test's own lists and the
        # upstream's parse have theirs)
        lists = [
            o
            for o in gc.get_objects()
            if type(o) is list
            and len(o) == len(messages)
            and type(o[0]) is dict
            and o[0] is not messages[0]
            and o[0].get("content") == "go"
        ]
        by_first: dict[int, int] = {}
        for o in lists:
            by_first[id(o[0])] = by_first.get(id(o[0]), 0) + 1
        held = max(by_first.values())
    # the reader's (which the router, the conversation and the writer keep too) and the body
    # sent on (the stages' output, of the same dicts where nothing changed), which the writer
    # keeps to compare the next one with
    assert held <= 2, held


def _open_files(pid: int) -> list[str]:
    """What process ``pid`` has open: a descriptor closed between the listing and its reading
    (a file opened a moment to be synced, a socket) is one it does not hold."""
    held = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        if fd.name.isdigit():
            with contextlib.suppress(FileNotFoundError):
                held.append(os.readlink(fd))
    return held


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc")
def test_each_conversation_held_keeps_its_record_file_open(tmp_path: Path) -> None:
    """The command keeps a record file open for each conversation it holds (within an eighth
    of its descriptors), not the library's 64: past those, each call closed another's file
    and opened its own again (~10 system calls a call)."""
    from pipeline._cli.serving import records_held_open

    conversations = 90
    # the command raises its soft limit on open files to the hard one
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    room = records_held_open(hard if hard != resource.RLIM_INFINITY else 1 << 20, 100)
    if room < conversations:
        pytest.skip(f"{hard} descriptors hold {room} record files open, under {conversations}")
    store = tmp_path / "store"
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy_process(upstream.base_url, store, "--max-conversations", "100") as (url, _, _),
        httpx2.Client(timeout=30) as client,
    ):
        for k in range(conversations):
            for turns in ((f"conversation {k}",), (f"conversation {k}", "on")):
                response = client.post(f"{url}/v1/messages", json=_turns(*turns))
                assert response.status_code == 200, response.text
        pid = process_running("pipeline", "proxy", str(store))
        assert pid is not None
        held = _open_files(pid)
    # (a file's records are also opened a moment to be synced: each file counted once)
    assert len({t for t in held if t.endswith("decisions.jsonl")}) == conversations
