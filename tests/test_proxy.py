"""The proxy: a real uvicorn server on 127.0.0.1 between the real SDK and the scripted
server — non-streamed and streamed calls, passthrough, upstream errors, a restart, many
conversations at once."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx2
import pytest

from pipeline import Pipeline
from pipeline.testing import Reply, ScriptedMessagesServer, ScriptError
from stages import ToolResultBudget, default_stages
from tests.sdk_support import sdk_client
from tests.wire_support import (
    TAG,
    client_loop,
    conversation_dirs,
    portable,
    proxy,
    results,
    script,
    visible,
)


async def proxied_loop(url: str, prompt: str, calls: int, *, stream: bool = False) -> None:
    """One user's loop through the proxy on a client of its own, closed in the loop that used
    it: a client left to the garbage collector closes its pooled connections later, in
    whichever event loop is running then."""
    async with sdk_client(url) as client:
        await client_loop(client, prompt, calls, stream=stream)


def budget_only() -> Pipeline:
    return Pipeline([ToolResultBudget()])


@pytest.mark.parametrize("stream", [False, True])
def test_calls_through_the_proxy_get_the_budget_and_a_stable_prefix(
    tmp_path: Path, stream: bool
) -> None:
    with (
        ScriptedMessagesServer(script) as upstream,
        proxy(upstream.base_url, tmp_path, budget_only) as url,
    ):
        anyio.run(lambda: proxied_loop(url, "proxied task", 20, stream=stream))
        health = httpx2.get(f"{url}/healthz")
        sent = upstream.requests
    assert health.text == "ok"
    assert len(sent) == 20
    for k, body in enumerate(sent):
        assert visible(body) <= 200_000, k
        if k:
            before = sent[k - 1]["messages"]
            assert json.dumps(body["messages"][: len(before)]) == json.dumps(before), k
    assert TAG in json.dumps(sent[-1])
    (session,) = conversation_dirs(tmp_path)
    responses = [
        json.loads(line)["data"]
        for line in (session / "decisions.jsonl").read_text().splitlines()
        if '"wire_session.response"' in line
    ]
    assert len(responses) == 20  # every response's usage reached the session, streamed too
    assert all(r["usage"]["output_tokens"] >= 1 for r in responses)


def test_other_paths_and_upstream_errors_pass_as_they_are(tmp_path: Path) -> None:
    busy = ScriptError(529, "overloaded_error", "Overloaded, try later")
    with (
        ScriptedMessagesServer(lambda _b: busy) as upstream,
        proxy(upstream.base_url, tmp_path, budget_only) as url,
    ):
        client = anthropic.Anthropic(base_url=url, api_key="secret-key", max_retries=0)
        count = client.messages.count_tokens(
            model="m", messages=[{"role": "user", "content": "count me"}]
        )
        with pytest.raises(anthropic.APIStatusError) as info:
            client.messages.create(
                model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
            )
        counted = upstream.count_requests
    assert count.input_tokens > 0
    assert counted[0]["messages"] == [{"role": "user", "content": "count me"}]
    assert info.value.status_code == 529 and "Overloaded, try later" in str(info.value)


def test_a_restarted_proxy_sends_the_same_bytes(tmp_path: Path) -> None:
    def run(root: Path, restart_at: int | None) -> list[str]:
        async def calls(url_box: list[str], restart: Callable[[], None]) -> None:
            client_messages: list[dict[str, Any]] = [{"role": "user", "content": "restart task"}]
            for call in range(10):
                if call == restart_at:
                    restart()
                async with sdk_client(url_box[0]) as client:
                    response = await client.messages.create(
                        model="m",
                        max_tokens=10,
                        messages=client_messages,  # type: ignore[arg-type]
                    )
                blocks = [b.model_dump(exclude_none=True) for b in response.content]
                client_messages.append({"role": "assistant", "content": blocks})
                client_messages.append(results(response.content))

        with ScriptedMessagesServer(script) as upstream:
            stack: list[Any] = []
            box: list[str] = []

            def start() -> None:
                while stack:  # the old proxy stops: only the disk is left
                    stack.pop().__exit__(None, None, None)
                ctx = proxy(upstream.base_url, root, lambda: Pipeline(default_stages()))
                box[:] = [ctx.__enter__()]
                stack.append(ctx)

            start()
            try:
                anyio.run(calls, box, start)
            finally:
                while stack:
                    stack.pop().__exit__(None, None, None)
            return [json.dumps(b) for b in upstream.requests]

    live = run(tmp_path / "a", None)
    restarted = run(tmp_path / "b", 5)
    assert portable(restarted, tmp_path / "b") == portable(live, tmp_path / "a")


def test_many_conversations_at_once_never_cross(tmp_path: Path) -> None:
    async def many(url: str) -> None:
        async with anyio.create_task_group() as tg:
            for n in range(200):
                tg.start_soon(proxied_loop, url, f"task {n:04d}", 2)

    with (
        ScriptedMessagesServer(script) as upstream,
        proxy(upstream.base_url, tmp_path, budget_only) as url,
    ):
        anyio.run(many, url)
        sent = upstream.requests
    assert len(sent) == 400
    assert len(conversation_dirs(tmp_path)) == 200
    for body in sent:
        first = body["messages"][0]["content"][:8].replace(" ", "_")
        for m in body["messages"]:
            for b in m["content"] if isinstance(m["content"], list) else []:
                text = str(b.get("content", ""))
                if text.startswith(TAG):
                    assert f"toolu_{first}" in text


def test_a_client_that_goes_away_mid_stream_leaves_the_proxy_serving(tmp_path: Path) -> None:
    body = {
        "model": "m",
        "max_tokens": 10,
        "stream": True,
        "messages": [{"role": "user", "content": "stream and leave"}],
    }
    with (
        ScriptedMessagesServer(script) as upstream,
        proxy(upstream.base_url, tmp_path, budget_only) as url,
    ):
        with httpx2.Client() as raw, raw.stream("POST", f"{url}/v1/messages", json=body) as r:
            assert r.status_code == 200
            next(r.iter_bytes())  # the first events, then the client is gone
        anyio.run(lambda: proxied_loop(url, "after the leaver", 2, stream=True))
        health = httpx2.get(f"{url}/healthz")
        sent = upstream.requests
    assert health.text == "ok" and len(sent) == 3


def test_an_unreachable_upstream_is_a_502_the_client_can_retry(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nothing listens there once closed
    with proxy(f"http://127.0.0.1:{dead}", tmp_path, budget_only) as url:
        client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as info:
            client.messages.create(
                model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
            )
        passthrough = httpx2.get(f"{url}/v1/models")
    assert info.value.status_code == 502 and "upstream unreachable" in str(info.value)
    assert passthrough.status_code == 502


def test_shutdown_lets_a_request_in_flight_finish(tmp_path: Path) -> None:
    import time as clock

    from stages import ServerSideMicrocompact

    upstream_has_it = threading.Event()

    def slow(_body: dict[str, Any]) -> Reply:
        upstream_has_it.set()
        clock.sleep(1.0)
        return Reply([{"type": "text", "text": "finished"}])

    answers: list[str] = []

    def call(url: str) -> None:
        with anthropic.Anthropic(base_url=url, api_key="k", max_retries=0) as client:
            reply = client.messages.create(
                model="m", max_tokens=10, messages=[{"role": "user", "content": "slow one"}]
            )
        answers.append(reply.content[0].text)  # type: ignore[union-attr]

    def with_clearing() -> Pipeline:
        return Pipeline([ToolResultBudget(), ServerSideMicrocompact()])

    with ScriptedMessagesServer(slow) as upstream:
        with proxy(upstream.base_url, tmp_path, with_clearing) as url:
            caller = threading.Thread(target=call, args=(url,))
            caller.start()
            assert upstream_has_it.wait(20)  # in flight; leaving the block shuts down
        caller.join(timeout=20)
        sent = upstream.requests
    assert answers == ["finished"]  # graceful: the request in flight was answered
    assert "context_management" in sent[0]  # what a stage asked of the request went upstream


def test_two_proxies_on_one_local_store_taking_turns_send_one_conversations_bytes(
    tmp_path: Path,
) -> None:
    """Two proxies on one directory, a conversation's calls going to each in turn: each asks
    the store for news before a call (one ``lstat``), so an earlier result goes out in one
    form on every call, as one proxy alone sends it."""

    def run(root: Path, proxies: int) -> list[str]:
        with ScriptedMessagesServer(script) as upstream, contextlib.ExitStack() as stack:
            urls = [
                stack.enter_context(proxy(upstream.base_url, root, budget_only))
                for _ in range(proxies)
            ]

            async def calls() -> None:
                messages: list[dict[str, Any]] = [{"role": "user", "content": "turns task"}]
                for call in range(8):
                    async with sdk_client(urls[call % proxies]) as client:
                        response = await client.messages.create(
                            model="m",
                            max_tokens=10,
                            messages=messages,  # type: ignore[arg-type]
                        )
                    blocks = [b.model_dump(exclude_none=True) for b in response.content]
                    messages += [
                        {"role": "assistant", "content": blocks},
                        results(response.content),
                    ]

            anyio.run(calls)
            return [json.dumps(b) for b in upstream.requests]

    alone = run(tmp_path / "one", 1)
    turns = run(tmp_path / "two", 2)
    assert sum(r.count(TAG) for r in alone) > 10
    assert portable(turns, tmp_path / "two") == portable(alone, tmp_path / "one")
