"""What a client can push on at the proxy's door, over HTTP against the proxy on a real port:
the body's size and encoding, nesting, the path it names, the headers it sends on."""

from __future__ import annotations

import gzip
import json
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

from pipeline import Pipeline
from pipeline.core import FunctionStage
from pipeline.dropin.wrap import wrap
from pipeline.testing import QuietLogger, Reply, ScriptedMessagesServer
from stages import Autocompact, ToolResultBudget
from tests.cli_support import clean_env
from tests.sdk_support import sdk_client
from tests.wire_support import TAG, CutUpstream, StalledStream, proxy, read_request

LIMIT = 200_000


def _reply(_body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "ok"}])


def _budget() -> Pipeline:
    return Pipeline([ToolResultBudget()])


@pytest.fixture
def door(tmp_path: Path) -> Iterator[tuple[str, ScriptedMessagesServer]]:
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(upstream.base_url, tmp_path, _budget, max_body_bytes=LIMIT) as url,
    ):
        yield url, upstream


def _request(text: str) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": text}]}


def _big_result_request() -> dict[str, Any]:
    use = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}
    out = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "y" * 120_000}
    return {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [out]},
        ],
    }


def test_a_body_over_the_limit_is_a_413_and_never_goes_upstream(door: Any) -> None:
    url, upstream = door
    declared = httpx2.post(f"{url}/v1/messages", json=_request("z" * (LIMIT + 10)))
    assert declared.status_code == 413
    assert declared.json()["error"]["type"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no content-length: counted as it comes
        yield b'{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"'
        for _ in range(30):
            yield b"z" * 10_000
        yield b'"}]}'

    streamed = httpx2.post(f"{url}/v1/messages", content=chunks())
    assert streamed.status_code == 413
    passthrough = httpx2.post(f"{url}/v1/messages/count_tokens", content=b"z" * (LIMIT + 1))
    assert passthrough.status_code == 413
    assert upstream.requests == [] and upstream.count_requests == []
    assert httpx2.post(f"{url}/v1/messages", json=_request("small")).status_code == 200


def test_a_compressed_body_is_refused_by_name(door: Any) -> None:
    url, upstream = door
    packed = gzip.compress(json.dumps(_request("hi")).encode())
    answer = httpx2.post(
        f"{url}/v1/messages",
        content=packed,
        headers={"content-encoding": "gzip", "content-type": "application/json"},
    )
    assert answer.status_code == 415
    assert "content-encoding gzip is not supported" in answer.json()["error"]["message"]
    assert upstream.requests == []


@pytest.mark.parametrize("depth", [990, 2_000, 90_000])
def test_deeply_nested_json_is_a_400_not_a_500(door: Any, depth: int) -> None:
    url, _ = door
    nested = "[" * depth + "]" * depth
    raw = (
        '{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text",'
        f'"text":"x","extra":{nested}}}]}}]}}'
    )
    answer = httpx2.post(f"{url}/v1/messages", content=raw.encode())
    assert answer.status_code in (200, 400), answer.text[:200]  # never a 500
    if answer.status_code == 400:
        assert answer.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/messages/", "//v1/messages", "/anthropic/v1/messages"])
def test_a_messages_request_under_another_spelling_gets_the_budget(door: Any, path: str) -> None:
    url, upstream = door
    answer = httpx2.post(f"{url}{path}", json=_big_result_request())
    assert answer.status_code == 200
    (sent,) = upstream.requests
    assert sent["messages"][2]["content"][0]["content"].startswith(TAG)


def _raw_get(url: str, target: str) -> int:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        status_line = conn.makefile("rb").readline().decode()
    return int(status_line.split()[1])


@pytest.mark.parametrize("target", ["/../../tenant-b/admin", "/v1/%2E%2E/%2e%2e/tenant-b/x"])
def test_a_path_with_dot_segments_is_refused(door: Any, target: str) -> None:
    url, _ = door
    assert _raw_get(url, target) == 400


def test_the_conversation_header_stays_with_the_proxy(door: Any) -> None:
    url, upstream = door
    headers = {"x-sluicegate-session": "my-private-session"}
    assert httpx2.post(f"{url}/v1/messages", json=_request("hi"), headers=headers).is_success
    assert "x-sluicegate-session" not in upstream.request_headers[0]


def test_the_conversation_header_stays_with_wrap(tmp_path: Path) -> None:
    async def call(client: Any) -> None:
        await client.messages.create(
            **_request("hi"), extra_headers={"x-sluicegate-session": "my-private-session"}
        )

    with ScriptedMessagesServer(_reply) as upstream:
        named = sdk_client(upstream.base_url, default_headers={"x-sluicegate-session": "mine"})
        anyio.run(call, wrap(named, root=tmp_path, pipeline=_budget))
        anyio.run(call, wrap(sdk_client(upstream.base_url), root=tmp_path, pipeline=_budget))
    assert all("x-sluicegate-session" not in h for h in upstream.request_headers)
    assert len(upstream.request_headers) == 2


def test_the_command_takes_its_body_limit(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "pipeline", "proxy", "--port", "0", "--log-json",
        "--store", str(tmp_path / "store"), "--upstream", "http://127.0.0.1:9", "--max-body", "2KB",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=clean_env()
    )
    try:
        assert proc.stderr is not None
        event: dict[str, Any] = {}
        while event.get("event") != "proxy.listening":
            event = json.loads(proc.stderr.readline())
        answer = httpx2.post(f"{event['url']}/v1/messages", json=_request("z" * 4_000))
        assert answer.status_code == 413
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_a_client_gone_during_its_upload_is_logged_in_one_line(tmp_path: Path) -> None:
    logger = QuietLogger()
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(upstream.base_url, tmp_path, _budget, logger=logger) as url,
    ):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            head = "POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
            conn.sendall(head.encode() + b"{}")
        deadline = time.monotonic() + 10
        while not any(e == "wire.request" for _, e, _ in logger.events):
            assert time.monotonic() < deadline, logger.events
            time.sleep(0.02)
        assert upstream.requests == []
    [(_, _, told)] = [x for x in logger.events if x[1] == "wire.request"]
    assert (told["status"], told["error"]) == (499, "client_disconnected")


def test_a_client_gone_mid_stream_is_logged_as_gone(tmp_path: Path) -> None:
    """A client that leaves while its stream goes on (Esc in Claude Code): the request's line
    and span say ``client_disconnected`` (a warning: its usage was never read), under the
    status it had."""
    upstream = StalledStream()
    logger = QuietLogger()
    try:
        with proxy(upstream.url, tmp_path, _budget, logger=logger) as url:
            with httpx2.stream(
                "POST", f"{url}/v1/messages", json={**_request("hi"), "stream": True}
            ) as answer:
                assert next(answer.iter_bytes()).startswith(b"event: ping")
            deadline = time.monotonic() + 10
            while not any(e == "wire.request" for _, e, _ in logger.events):
                assert time.monotonic() < deadline, logger.events
                time.sleep(0.02)
    finally:
        upstream.release.set()
        upstream.sock.close()
    [(level, _, told)] = [x for x in logger.events if x[1] == "wire.request"]
    assert (level, told["status"], told["error"]) == ("warning", 200, "client_disconnected")


def test_an_upstream_stream_cut_mid_chunk_is_cut_for_the_client_and_logged_once(
    tmp_path: Path,
) -> None:
    upstream = CutUpstream()
    logger, told = QuietLogger(), _Lines()
    logging.getLogger("uvicorn.error").addHandler(told)
    try:
        with (
            proxy(upstream.url, tmp_path, _budget, logger=logger) as url,
            pytest.raises(httpx2.RemoteProtocolError),  # as it would be without the proxy
            httpx2.stream("POST", f"{url}/v1/messages", json=_request("hi")) as answer,
        ):
            answer.read()
    finally:
        logging.getLogger("uvicorn.error").removeHandler(told)
        upstream.sock.close()
    assert not any(record.exc_info for record in told.records)  # no traceback
    assert [e for _, e, _ in logger.events].count("wire.upstream_cut") == 1


@pytest.mark.parametrize("bound", [100_000, None])
def test_an_answer_past_the_bound_is_passed_on_unread(tmp_path: Path, bound: int | None) -> None:
    """A JSON answer is read whole for its usage only up to ``max_answer_bytes``: a larger
    one is passed on as it comes, byte for byte, unread (a warning), so what an upstream
    answers cannot make the proxy hold without end; the conversation goes on."""
    text = "z" * 300_000

    def large(_body: dict[str, Any]) -> Reply:
        return Reply([{"type": "text", "text": text}])

    logger = QuietLogger()
    options: dict[str, Any] = {} if bound is None else {"max_answer_bytes": bound}
    with (
        ScriptedMessagesServer(large) as upstream,
        proxy(upstream.base_url, tmp_path, _budget, logger=logger, **options) as url,
    ):
        first = httpx2.post(f"{url}/v1/messages", json=_request("hi"), timeout=30)
        assert first.status_code == 200 and first.json()["content"][0]["text"] == text
        again = _request("hi")
        again["messages"] += [
            {"role": "assistant", "content": first.json()["content"]},
            {"role": "user", "content": "more"},
        ]
        assert httpx2.post(f"{url}/v1/messages", json=again, timeout=30).status_code == 200
    told = [fields for _, event, fields in logger.events if event == "wire.answer_too_large"]
    if bound is None:
        assert not told  # read for its usage, as ever
    else:
        assert len(told) == 2 and all(f["bytes"] > bound for f in told)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize(
    ("target", "sent"),
    [
        ("/v1/%252e%252e/%252e%252e/admin", "/v1/%252e%252e/%252e%252e/admin"),  # never %2e
        ("/v1/models?a=1&a=2&flag&q=%20x;y", "/v1/models?a=1&a=2&flag&q=%20x;y"),
        ("/v1/models?a=1#frag", "/v1/models?a=1%23frag"),  # not a fragment cut off
        ("/v1/files/f#1", "/v1/files/f%231"),
    ],
)
def test_a_path_and_query_reach_the_upstream_as_the_client_wrote_them(
    tmp_path: Path, target: str, sent: str
) -> None:
    seen: list[str] = []

    class Upstream(CutUpstream):
        def _serve(self) -> None:
            conn, _ = self.sock.accept()
            with conn:
                seen.append(conn.recv(1 << 16).split(b" ")[1].decode())
                conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")

    upstream = Upstream()
    try:
        with proxy(upstream.url, tmp_path, _budget) as url:
            assert _raw_get(url, target) == 404
    finally:
        upstream.sock.close()
    assert seen == [sent]


def test_only_a_path_whose_last_segments_are_v1_messages_is_a_messages_request(door: Any) -> None:
    url, upstream = door
    answer = httpx2.post(f"{url}/xv1/messages", json=_big_result_request())
    assert answer.status_code == 404  # passed on as it is: the upstream has no such route
    assert upstream.requests == []


@pytest.mark.parametrize("client", ["aiohttp", "httpx2"])
def test_a_header_value_past_ascii_goes_upstream_as_the_clients_bytes(
    tmp_path: Path, client: str
) -> None:
    # obs-text, which HTTP allows in a field value: it once failed the request with a 500
    heads: list[bytes] = []
    reply = json.dumps(
        {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
         "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
         "usage": {"input_tokens": 1, "output_tokens": 1}}
    ).encode()  # fmt: skip

    class Upstream(CutUpstream):
        def answer(self, conn: socket.socket) -> None:
            heads.append(read_request(conn).partition(b"\r\n\r\n")[0])
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % len(reply) + reply
            )

    upstream = Upstream()
    body = json.dumps(_request("hi")).encode()
    try:
        with proxy(upstream.url, tmp_path, _budget, upstream_client=client) as url:
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                conn.sendall(
                    b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                    b"content-type: application/json\r\nx-api-key: k\r\nx-odd: \xe9t\xe9\r\n"
                    b"content-length: %d\r\n\r\n" % len(body) + body
                )
                status_line = conn.makefile("rb").readline()
    finally:
        upstream.sock.close()
    assert status_line.split()[1] == b"200"
    assert b"\r\nx-odd: \xe9t\xe9\r\n" in heads[0].lower() + b"\r\n"


def test_a_header_sent_on_two_lines_goes_upstream_whole(door: Any) -> None:
    """Two ``anthropic-beta`` lines are one comma-joined value in HTTP: the upstream gets
    both betas, not the last line's alone."""
    url, upstream = door
    headers = [
        ("anthropic-beta", "interleaved-thinking-2025-05-14"),
        ("anthropic-beta", "context-1m-2025-08-07"),
    ]
    response = httpx2.post(f"{url}/v1/messages", json=_request("hi"), headers=headers)
    assert response.status_code == 200
    betas = upstream.request_headers[-1]["anthropic-beta"]
    assert betas == "interleaved-thinking-2025-05-14, context-1m-2025-08-07"
    twice = [("anthropic-version", "2023-06-01"), ("anthropic-version", "2023-06-01")]
    assert httpx2.post(f"{url}/v1/messages", json=_request("hi"), headers=twice).is_success
    assert upstream.request_headers[-1]["anthropic-version"] == "2023-06-01"  # still valid


@pytest.mark.parametrize("name", ["x-api-key", "authorization"])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_credential_sent_on_two_lines_is_refused(door: Any, name: str, path: str) -> None:
    """A request whose credential header comes twice would be placed under one credential
    and checked upstream under the other: it is a 400, and nothing goes upstream."""
    url, upstream = door
    sent = len(upstream.requests) + len(upstream.count_requests)
    headers = [(name, "sk-ant-first"), (name, "sk-ant-second")]
    response = httpx2.post(f"{url}{path}", json=_request("hi"), headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert name in response.json()["error"]["message"]
    assert "sk-ant" not in response.text
    assert len(upstream.requests) + len(upstream.count_requests) == sent


# --------------------------------------------------------------------------------------------
# A pass that fails: answered as the API would, counted and logged once, no content anywhere
# --------------------------------------------------------------------------------------------

SECRET = "PATIENT-RECORD-4711"


def _failing_pipeline() -> Pipeline:
    async def redact(messages: list[Any], ctx: Any) -> list[Any]:
        raise ValueError(f"could not parse: {SECRET}")

    return Pipeline([ToolResultBudget(), FunctionStage("redact", redact)])


def _blocking_pipeline() -> Pipeline:
    return Pipeline([Autocompact(context_window=60_000, max_output_tokens=8_000, block=True)])


@pytest.mark.parametrize(
    ("pipeline", "messages", "status", "kind", "says"),
    [
        (_failing_pipeline, [{"role": "user", "content": "hi"}], 500, "api_error", "'redact'"),
        (
            _blocking_pipeline,
            [{"role": "user", "content": "word " * 60_000}],
            400,
            "invalid_request_error",
            "blocking limit",
        ),
        (_budget, [{"role": "system", "content": "x"}], 400, "invalid_request_error", "role"),
    ],
    ids=["stage-raises", "stage-refuses", "unreadable"],
)
def test_a_pass_that_fails_is_an_api_error_logged_once_without_content(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    pipeline: Any,
    messages: list[dict[str, Any]],
    status: int,
    kind: str,
    says: str,
) -> None:
    logger = QuietLogger()
    with ScriptedMessagesServer(_reply) as upstream:
        with proxy(upstream.base_url, tmp_path, pipeline, logger=logger) as url:
            answer = httpx2.post(
                f"{url}/v1/messages",
                json={"model": "m", "max_tokens": 5, "messages": messages},
                headers={"x-api-key": "k"},
            )
        assert upstream.requests == []  # nothing sent
    assert answer.status_code == status
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert says in body["error"]["message"]
    lines = [kw for _level, event, kw in logger.events if event == "wire.request"]
    assert len(lines) == 1 and lines[0]["status"] == status
    printed = capfd.readouterr().err
    assert SECRET not in answer.text + repr(logger.events) + printed
    assert "Traceback" not in printed


def test_what_a_client_names_is_cut_in_log_lines_as_in_spans(tmp_path: Path) -> None:
    """A 3,000-char model, a 20,000-char tool name and id: the access line and the budget's
    decision line carry them cut as the span attributes are (256 chars)."""
    tid, name = "toolu_" + "i" * 20_000, "T" * 20_000
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": tid, "name": name}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid, "content": "ok"}]},
    ]
    messages[1]["content"][0]["input"] = {}
    logger = QuietLogger()
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(upstream.base_url, tmp_path, _budget, logger=logger) as url,
    ):
        answer = httpx2.post(
            f"{url}/v1/messages",
            json={"model": "m" * 3_000, "max_tokens": 5, "messages": messages},
            headers={"x-api-key": "k"},
        )
    assert answer.status_code == 200
    (line,) = [kw for _, event, kw in logger.events if event == "wire.request"]
    (decided,) = [kw for _, event, kw in logger.events if event == "tool_result_budget.decision"]
    assert len(line["model"]) == 256
    assert len(decided["tool_use_id"]) == len(decided["tool_name"]) == 256
