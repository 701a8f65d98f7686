"""What stands between a client and its response at the proxy: only what must. The request's
end (its span, metrics and log line) comes after the client has the whole response, and at
once when the client is gone; the server's garbage collector is set for a long-lived process,
and set back when it stops."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import re
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

from pipeline import Pipeline
from pipeline._cli.proxy_cmd import (
    SERVER_GC_THRESHOLDS,
    SERVER_SWITCH_INTERVAL,
    server_collector,
    server_switching,
)
from pipeline.core import FunctionStage
from pipeline.dropin.adapter import WireSession
from pipeline.dropin.relay import relay
from pipeline.dropin.upstream import Upstream, unless_left
from pipeline.store.sessions import SessionStates
from pipeline.testing import QuietLogger, Reply, ScriptedMessagesServer
from pipeline.wire import digests
from pipeline.wire.body_reader import BodyReader
from pipeline.wire.digests import OpeningMemo, opening_digest
from stages import ToolResultBudget
from tests.builders import tool_result, tool_use
from tests.wire_support import TAG, RawUpstream, proxy, read_request


def _reply(_body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "ok"}])


def _budget() -> Pipeline:
    return Pipeline([ToolResultBudget()])


class _EndsAfterTheClient(QuietLogger):
    """A logger whose request line waits (5 s at most) for the client to hold its response,
    and keeps whether it did."""

    def __init__(self) -> None:
        super().__init__()
        self.client_has_it = threading.Event()
        self.in_time: list[bool] = []

    def info(self, event: str, **kw: Any) -> None:
        if event == "wire.request":
            self.in_time.append(self.client_has_it.wait(5))
        super().info(event, **kw)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "event-stream"])
@pytest.mark.parametrize("calls", [1, 3])
def test_a_client_holds_its_whole_response_before_the_request_ends(
    tmp_path: Path, calls: int, stream: bool
) -> None:
    logger = _EndsAfterTheClient()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(upstream.base_url, tmp_path, _budget, logger=logger) as url,
        httpx2.Client(timeout=30) as client,
    ):
        for k in range(calls):  # one kept-alive connection: the next request follows at once
            logger.client_has_it.clear()
            body = {"model": "m", "max_tokens": 5, "messages": messages, "stream": stream}
            answer = client.post(f"{url}/v1/messages", json=body)  # read to its end
            logger.client_has_it.set()
            assert answer.status_code == 200
            content = [{"type": "text", "text": "ok"}]
            if stream:
                assert b"message_stop" in answer.content
            else:
                assert answer.json()["content"] == content
            deadline = time.monotonic() + 10
            while len(logger.in_time) <= k:
                assert time.monotonic() < deadline, "the request never ended"
                time.sleep(0.01)
            messages = [
                *messages,
                {"role": "assistant", "content": content},
                {"role": "user", "content": f"again {k}"},
            ]
    assert logger.in_time == [True] * calls


def test_a_client_gone_mid_response_ends_the_request_at_once() -> None:
    """The client's side stalls (its socket full) and it leaves: the request's end and the
    upstream's close happen as the response gives up, not when a collection finds them."""

    async def run() -> tuple[list[str], bool]:
        ended: list[str] = []

        def answer(_request: httpx2.Request) -> httpx2.Response:
            body = b'{"id": "msg_1", "pad": "' + b"x" * 20_000 + b'"}'
            return httpx2.Response(200, content=body, headers={"content-type": "application/json"})

        transport = httpx2.MockTransport(answer)
        async with httpx2.AsyncClient(transport=transport, base_url="http://upstream") as client:
            upstream = await client.send(client.build_request("POST", "/v1/messages"), stream=True)
            response = relay(upstream, end=lambda _cut: ended.append("end"))
            gone = asyncio.Event()
            never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            async def send(message: Any) -> None:
                if message["type"] == "http.response.body":
                    gone.set()
                    await never  # the write waits for room that never comes

            async def receive() -> Any:
                await gone.wait()
                return {"type": "http.disconnect"}

            await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
            await asyncio.sleep(0.05)
            # as it is now, not once the loop closes (which finalizes what was left open)
            return list(ended), upstream.is_closed

    gc.disable()
    try:
        ended, closed = asyncio.run(run())
    finally:
        gc.enable()
    assert ended == ["end"]
    assert closed


def test_the_server_collector_freezes_start_up_and_is_set_back() -> None:
    saved = gc.get_threshold()
    gc.unfreeze()
    with server_collector():
        assert gc.get_threshold() == SERVER_GC_THRESHOLDS
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == saved
    assert gc.get_freeze_count() == 0


def test_the_server_hands_the_interpreter_on_sooner_and_is_set_back() -> None:
    saved = sys.getswitchinterval()
    with server_switching():
        assert sys.getswitchinterval() == pytest.approx(SERVER_SWITCH_INTERVAL)
        assert saved > SERVER_SWITCH_INTERVAL
    assert sys.getswitchinterval() == saved


def test_the_server_collector_leaves_an_earlier_freeze_alone() -> None:
    gc.freeze()  # the embedding application's
    try:
        frozen = gc.get_freeze_count()
        with server_collector():
            pass
        assert gc.get_freeze_count() >= frozen > 0
    finally:
        gc.unfreeze()


class _Receives:
    """A request whose ``receive`` says the client left after ``after`` seconds, or raises."""

    def __init__(self, after: float, *, broken: bool = False) -> None:
        self.after, self.broken = after, broken

    async def receive(self) -> dict[str, Any]:
        await asyncio.sleep(self.after)
        if self.broken:
            raise RuntimeError("receive broke")
        return {"type": "http.disconnect"}


async def _answer_late() -> str:
    await asyncio.sleep(10)
    return "answer"


def test_a_client_gone_while_its_call_is_upstream_cancels_the_call() -> None:
    async def run() -> Any:
        return await unless_left(_Receives(0.01).receive, _answer_late())  # type: ignore[arg-type]

    started = time.monotonic()
    assert asyncio.run(run()) is None
    assert time.monotonic() - started < 5


def test_a_receive_that_fails_is_raised_not_taken_for_a_client_gone() -> None:
    async def run() -> Any:
        return await unless_left(_Receives(0.01, broken=True).receive, _answer_late())  # type: ignore[arg-type]

    with pytest.raises(RuntimeError, match="receive broke"):
        asyncio.run(run())


def test_a_cancel_swallowed_before_is_not_the_watchs_to_take_back() -> None:
    async def run() -> Any:
        me = asyncio.current_task()
        assert me is not None
        me.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # swallowed, never taken back
            await asyncio.sleep(1)
        return await unless_left(_Receives(0.01).receive, _answer_late())  # type: ignore[arg-type]

    assert asyncio.run(run()) is None


def test_under_another_backend_the_watch_is_a_task_group() -> None:
    """The proxy may be served on trio (another ASGI server): the same answers there."""
    import anyio

    class Leaves:
        async def receive(self) -> dict[str, Any]:
            await anyio.sleep(0.01)
            return {"type": "http.disconnect"}

    class Stays:
        async def receive(self) -> dict[str, Any]:
            await anyio.sleep(60)
            return {"type": "http.disconnect"}

    async def late() -> str:
        await anyio.sleep(10)
        return "answer"

    async def soon() -> str:
        await anyio.sleep(0)
        return "answer"

    async def run() -> tuple[Any, Any]:
        gone = await unless_left(Leaves().receive, late())  # type: ignore[arg-type]
        answered = await unless_left(Stays().receive, soon())  # type: ignore[arg-type]
        return gone, answered

    assert anyio.run(run, backend="trio") == (None, "answer")


def _history(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for k in range((n - 1) // 2):
        tid = f"toolu_{k:04d}"
        use = {"type": "tool_use", "id": tid, "name": "Read", "input": {"path": f"f{k}"}}
        text = f"{k} " + "x" * (60_000 if k == (n - 1) // 2 - 1 else 500)  # the last: fresh
        result = {"type": "tool_result", "tool_use_id": tid, "content": text}
        out += [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    return out


def _two_calls(root: Path, long_pass: int | None) -> tuple[list[int], list[str]]:
    """Two calls of one conversation (121 messages, then two more) through a proxy with
    ``long_pass``: the thread each pass ran in, and what the upstream received."""
    threads: list[int] = []

    async def mark(messages: list[Any], ctx: Any) -> list[Any]:
        threads.append(threading.get_ident())
        return messages

    def pipeline() -> Pipeline:
        return Pipeline([ToolResultBudget(), FunctionStage("mark", mark)])

    history = _history(121)
    later = [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "on"}]
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(upstream.base_url, root, pipeline, long_pass=long_pass) as url,
        httpx2.Client(timeout=30) as client,
    ):
        for messages in (history, later):
            body = {"model": "m", "max_tokens": 5, "messages": messages}
            assert client.post(f"{url}/v1/messages", json=body).status_code == 200
        sent = [json.dumps(r, sort_keys=True) for r in upstream.requests]
    # the paths of persisted results: under the store's root and its secret's tenant digest
    return threads, [re.sub(r"t-[0-9a-f]{20}", "t-*", t.replace(str(root), "<root>")) for t in sent]


def test_a_long_pass_runs_off_the_servers_loop_and_sends_the_same(tmp_path: Path) -> None:
    """With ``long_pass``, a pass over that many new messages (a conversation met first) runs
    on a loop of its own in a worker thread, and a pass over a few new ones on the server's
    loop; the upstream receives the same requests as with every pass on the server's loop
    (a 60K result persisted, then re-applied)."""
    on_loop, sent = _two_calls(tmp_path / "a", None)
    off_loop, sent_too = _two_calls(tmp_path / "b", 50)
    assert on_loop[0] == on_loop[1]  # the server's loop, both times
    assert off_loop[0] != off_loop[1]  # the first pass off it, the second on it
    assert TAG in sent[0] and TAG in sent[1]
    assert sent_too == sent


def test_the_upstream_keeps_a_bounded_few_urls_parsed() -> None:
    """A URL is parsed once for the path and query every call asks for; any number of others
    keeps a bounded few, and each request gets the URL a fresh parse gives."""
    upstream = Upstream(
        "http://127.0.0.1:9/base", timeout=5, connect=1, max_connections=1, kept_alive=1
    )
    first = upstream.request("POST", "/v1/messages", b"beta=true", {}, b"{}")
    again = upstream.request("POST", "/v1/messages", b"beta=true", {}, b"{}")
    assert again.url == first.url == "http://127.0.0.1:9/base/v1/messages?beta=true"
    usual = upstream._urls[("/v1/messages", b"beta=true")]
    for k in range(1_000):  # a client asking for a new path each time, and the usual one
        asked = upstream.request("GET", f"/v1/p{k}#x", f"q={k}".encode(), {}, b"")
        assert asked.url == f"http://127.0.0.1:9/base/v1/p{k}%23x?q={k}"
        upstream.request("POST", "/v1/messages", b"beta=true", {}, b"{}")
    assert len(upstream._urls) <= 64
    # the one asked for all along was parsed once: the least recently asked for go first
    assert upstream._urls[("/v1/messages", b"beta=true")] is usual
    assert (
        upstream.request("GET", "/v1/p3#x", b"q=3", {}, b"").url.raw_path == b"/base/v1/p3%23x?q=3"
    )


def test_an_opening_is_digested_again_only_for_other_objects() -> None:
    """The memo answers what ``opening_digest`` answers: by identity for the objects it holds
    (a system prompt and first message an earlier request shares), digested again for any
    other -- equal or not, old ids reused by new objects -- and it keeps a bounded few."""
    memo = OpeningMemo(size=8)
    system = [{"type": "text", "text": "You are an agent. " * 500}]
    first = {"role": "user", "content": "go"}
    digest = memo.digest(system, "", first)
    assert digest == opening_digest(system, "", first)
    assert memo.digest(system, "", first) is digest  # the same objects: kept
    assert memo.digest(system, "hint", first) == opening_digest(system, "hint", first) != digest
    equal = json.loads(json.dumps(first))
    assert memo.digest(system, "", equal) == digest  # equal objects: digested again, alike
    for k in range(300):  # objects made and dropped: their ids come back for others
        other = {"role": "user", "content": f"go {k % 7}"}
        assert memo.digest(None, "", other) == opening_digest(None, "", other)
    assert len(memo._kept) <= 8


def test_a_repeated_system_prompt_is_digested_once_in_a_conversation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the proxy, a conversation's system prompt (re-sent on every call) is digested
    on its first call only: the body reader hands on the same parsed objects."""
    digested: list[int] = []
    real = digests._system_digest

    def counted(system: Any) -> bytes:
        digested.append(len(json.dumps(system)))
        return real(system)

    monkeypatch.setattr(digests, "_system_digest", counted)
    system = [{"type": "text", "text": "You are an agent. " * 2_000}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(upstream.base_url, tmp_path, _budget) as url,
        httpx2.Client(timeout=30) as client,
    ):
        for k in range(5):
            body = {"model": "m", "max_tokens": 5, "system": system, "messages": messages}
            assert client.post(f"{url}/v1/messages", json=body).status_code == 200
            messages = [
                *messages,
                {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
                {"role": "user", "content": f"again {k}"},
            ]
    assert len([n for n in digested if n > 30_000]) == 1


class _CloseFails(httpx2.AsyncByteStream):
    """An event stream whose close raises (the upstream's connection broken under it)."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        start = {"id": "msg_1", "model": "m", "usage": {"input_tokens": 10, "output_tokens": 1}}
        for event in (
            {"type": "message_start", "message": start},
            {"type": "message_delta", "delta": {}, "usage": {"output_tokens": 5}},
            {"type": "message_stop"},
        ):
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()

    async def aclose(self) -> None:
        raise RuntimeError("close failed")


def test_a_held_back_record_is_written_when_the_upstreams_close_fails(tmp_path: Path) -> None:
    """The client leaves after ``message_delta`` and closing the upstream then raises: the
    response's record, held back until the client had the response, is written all the same,
    and the request ends."""

    async def run() -> tuple[list[str | None], str]:
        storage = SessionStates(tmp_path, fsync_each=False).open("s")  # records held back
        session = await WireSession.open("s", tmp_path, _budget(), storage=storage)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        _, call = await session.prepare_call(body)
        transport = httpx2.MockTransport(
            lambda _r: httpx2.Response(
                200, stream=_CloseFails(), headers={"content-type": "text/event-stream"}
            )
        )
        ended: list[str | None] = []
        async with httpx2.AsyncClient(transport=transport, base_url="http://u") as client:
            upstream = await client.send(client.build_request("POST", "/v1/messages"), stream=True)
            response = relay(upstream, session, call, end=ended.append)

            async def send(message: Any) -> None:
                if b"message_delta" in message.get("body", b""):
                    raise OSError("client gone")

            async def receive() -> Any:
                await anyio.sleep_forever()

            with contextlib.suppress(Exception):
                await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return ended, "".join(f.read_text() for f in tmp_path.rglob("*.jsonl"))

    ended, records = anyio.run(run)
    assert ended == ["client_disconnected"]  # the request ends, saying its client left
    assert '"wire_session.response"' in records


@pytest.mark.parametrize("gone", [False, True], ids=["stays", "gone"])
def test_a_held_answer_whose_send_fails_ends_its_request_as_its_client_gone(
    tmp_path: Path, gone: bool
) -> None:
    """A JSON answer is held whole, then sent in one piece: when that send fails (a server of
    ASGI 2.4 tells a client gone so) the request ends with ``client_disconnected``; sent, it
    ends clean."""

    async def run() -> list[str | None]:
        session = await WireSession.open("s", tmp_path, _budget())
        _, call = await session.prepare_call(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        )
        answer = {"id": "msg_1", "model": "m", "usage": {"input_tokens": 1, "output_tokens": 1}}
        transport = httpx2.MockTransport(lambda _r: httpx2.Response(200, json=answer))
        ended: list[str | None] = []
        async with httpx2.AsyncClient(transport=transport, base_url="http://u") as client:
            upstream = await client.send(client.build_request("POST", "/v1/messages"), stream=True)
            response = relay(upstream, session, call, end=ended.append)
            assert response.held

            async def send(message: Any) -> None:
                if gone and message["type"] == "http.response.body":
                    raise OSError("client gone")

            async def receive() -> Any:
                await anyio.sleep_forever()

            with contextlib.suppress(Exception):
                await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return ended

    assert anyio.run(run) == (["client_disconnected"] if gone else [None])


class _Recorded(RawUpstream):
    """An upstream that keeps each request body's bytes and answers ``ok``."""

    threaded = True

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        super().__init__()

    def answer(self, conn: socket.socket) -> None:
        while request := read_request(conn):
            self.bodies.append(request.partition(b"\r\n\r\n")[2])
            reply = json.dumps(
                {
                    "id": f"msg_{len(self.bodies)}",
                    "type": "message",
                    "role": "assistant",
                    "model": "m",
                    "content": [{"type": "text", "text": "ok"}],
                    "stop_reason": "end_turn",
                    "usage": {"input_tokens": 10, "output_tokens": 1},
                }
            ).encode()
            head = (
                f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(reply)}"
            )
            conn.sendall(head.encode() + b"\r\n\r\n" + reply)


def test_a_spaced_client_s_messages_go_upstream_as_its_own_bytes(tmp_path: Path) -> None:
    """A client writing JSON as Python's ``json.dumps`` does by default (``requests``, httpx
    before 0.28): the messages no stage changed go upstream as the bytes it sent -- what lets
    the proxy keep none of them between calls -- and one a stage changed as the proxy writes it;
    each request repeats the one before it, byte for byte, up to the messages it adds."""
    upstream = _Recorded()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go \u00e9t\u00e9"}]
    sent: list[bytes] = []
    try:
        with (
            proxy(upstream.url, tmp_path, _budget, tenancy=None) as url,
            httpx2.Client(timeout=30) as client,
        ):
            for k in range(6):
                tid = f"toolu_spaced_{k}"
                output = "x" * (60_000 if k == 2 else 100)  # one the budget replaces
                messages.append({"role": "assistant", "content": [tool_use(tid)]})
                messages.append({"role": "user", "content": [tool_result(tid, output)]})
                raw = json.dumps({"model": "m", "max_tokens": 5, "messages": messages}).encode()
                sent.append(raw)
                answer = client.post(
                    f"{url}/v1/messages", content=raw, headers={"content-type": "application/json"}
                )
                assert answer.status_code == 200, answer.text
    finally:
        upstream.sock.close()
    assert len(upstream.bodies) == 6
    first, last = json.dumps(messages[0]).encode(), upstream.bodies[-1]
    assert first in last  # the client's bytes: spaced, its text escaped
    for k in (0, 1, 3):  # results no stage changed
        assert json.dumps(messages[2 + 2 * k]).encode() in last
    replaced = json.loads(last)["messages"][6]["content"][0]["content"]
    assert replaced.startswith("<persisted-output>")
    for before, after in itertools.pairwise(upstream.bodies):
        # up to its last message, which the proxy marked for the cache (the next does not)
        _body, _fast, source = BodyReader().read_source(before)
        assert source is not None
        assert after.startswith(before[: source.start(len(source.ends) - 1)])
