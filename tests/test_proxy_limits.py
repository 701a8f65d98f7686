"""What a client can hold at the proxy, over HTTP against the proxy on a real port: a
conversation during a slow upstream call, the upstream call itself, the conversations kept in
memory."""

from __future__ import annotations

import resource
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest

from pipeline import Pipeline
from pipeline.dropin.proxy import build_app
from pipeline.testing import QuietLogger, Reply, ScriptedMessagesServer
from stages import ToolResultBudget
from tests.wire_support import TAG, proxy, proxy_process


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
def test_an_upstream_timeout_that_is_not_positive_is_refused(
    tmp_path: Path, timeout: float
) -> None:
    with pytest.raises(ValueError, match="upstream_timeout must be a positive number"):
        build_app(pipeline=_budget, root=tmp_path, upstream_timeout=timeout)


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


def test_a_connection_whose_request_head_never_ends_is_closed(tmp_path: Path) -> None:
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy_process(upstream.base_url, tmp_path, "--header-timeout", "1") as (url, _, _),
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
