"""``wrap(client)``: the real SDK, sync and async, against the scripted server — the user's own
loop, one changed line."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import tempfile
from pathlib import Path
from typing import Any

import anthropic
import anyio
import pytest

from pipeline import Pipeline
from pipeline.dropin.wrap import wrap as wrap_with
from pipeline.testing import RawReply, Reply, ScriptedMessagesServer
from stages import ToolResultBudget, wrap
from tests.sdk_support import sdk_client
from tests.wire_support import (
    TAG,
    OffTheLoop,
    client_loop,
    conversation_dirs,
    only,
    portable,
    results,
    script,
    sync_client_loop,
    visible,
)


def test_an_async_loop_gets_the_budget_and_a_stable_prefix(tmp_path: Path) -> None:
    with ScriptedMessagesServer(script) as server:
        # the budget alone: the later stages may break the prefix by design (and say so)
        client = wrap_with(
            sdk_client(server.base_url),
            root=tmp_path,
            pipeline=lambda: Pipeline([ToolResultBudget()]),
        )
        anyio.run(client_loop, client, "first task", 22)
        count = anyio.run(
            lambda: client.messages.count_tokens(
                model="m", messages=[{"role": "user", "content": "x" * 10}]
            )
        )
        sent = server.requests
    assert count.input_tokens > 0 and len(sent) == 22
    for k, body in enumerate(sent):
        assert visible(body) <= 200_000, k  # 6 × 45K = 270K asked, 200K at most sent
        if k:
            before = sent[k - 1]["messages"]
            assert json.dumps(body["messages"][: len(before)]) == json.dumps(before), k
    persisted = sum(
        str(b.get("content", "")).startswith(TAG)
        for m in sent[-1]["messages"]
        if isinstance(m["content"], list)
        for b in m["content"]
    )
    assert persisted >= 21  # at least one per turn, each re-applied in every later request
    sessions = conversation_dirs(tmp_path)
    assert len(sessions) == 1 and (sessions[0] / "decisions.jsonl").exists()


def test_a_restarted_program_sends_the_same_bytes(tmp_path: Path) -> None:
    async def run(root: Path, restart_at: int | None) -> list[str]:
        with ScriptedMessagesServer(script) as server:

            def client() -> anthropic.AsyncAnthropic:
                raw = sdk_client(server.base_url)
                return wrap(raw, root=root)

            messages: list[dict[str, Any]] = [{"role": "user", "content": "restart task"}]
            current = client()
            for call in range(12):
                if call == restart_at:
                    current = client()  # a new program: only what is on disk is left
                response = await current.messages.create(
                    model="m",
                    max_tokens=100,
                    messages=messages,  # type: ignore[arg-type]
                )
                messages.append(
                    {
                        "role": "assistant",
                        "content": [b.model_dump(exclude_none=True) for b in response.content],
                    }
                )
                messages.append(results(response.content))
            return [json.dumps(b) for b in server.requests]

    live = anyio.run(run, tmp_path / "a", None)
    restarted = anyio.run(run, tmp_path / "b", 6)
    assert portable(restarted, tmp_path / "b") == portable(live, tmp_path / "a")


def test_conversations_never_share_a_ledger(tmp_path: Path) -> None:
    async def many() -> None:
        async with anyio.create_task_group() as tg:
            for n in range(20):
                tg.start_soon(client_loop, client, f"task {n:03d}", 3)

    with ScriptedMessagesServer(script) as server:
        client = wrap(
            sdk_client(server.base_url),
            root=tmp_path,
        )
        anyio.run(many)
        sent = server.requests
    sessions = conversation_dirs(tmp_path)
    assert len(sessions) == 20
    for body in sent:
        first = body["messages"][0]["content"][:8].replace(" ", "_")
        for m in body["messages"]:
            for b in m["content"] if isinstance(m["content"], list) else []:
                text = str(b.get("content", ""))
                if text.startswith(TAG):
                    # a replacement points at its own conversation's store
                    assert f"toolu_{first}" in text.split("saved to: ", 1)[1].split("\n", 1)[0]


def test_the_sync_client_and_beta_messages(tmp_path: Path) -> None:
    with ScriptedMessagesServer(script) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        client = wrap_with(raw, root=tmp_path, pipeline=lambda: Pipeline([ToolResultBudget()]))
        sync_client_loop(client, "sync task", 3)
        async_client = wrap(
            sdk_client(server.base_url),
            root=tmp_path,
        )
        anyio.run(lambda: client_loop(async_client, "beta task", 3, beta=True))
        sent = server.requests
    assert len(sent) == 6
    assert all(visible(b) <= 200_000 for b in sent)
    assert any(TAG in json.dumps(b) for b in sent[:3]) and any(
        TAG in json.dumps(b) for b in sent[3:]
    )


def test_a_streamed_response_reaches_the_session_as_it_passes(tmp_path: Path) -> None:
    async def run(server: ScriptedMessagesServer) -> list[str]:
        client = wrap(
            sdk_client(server.base_url),
            root=tmp_path,
            session_id="streamed",
        )
        messages: list[dict[str, Any]] = [{"role": "user", "content": "stream task"}]
        texts = []
        for _ in range(3):
            async with client.messages.stream(
                model="m",
                max_tokens=10,
                messages=messages,  # type: ignore[arg-type]
            ) as stream:
                final = await stream.get_final_message()
            texts.append(final.id)
            messages.append(
                {
                    "role": "assistant",
                    "content": [b.model_dump(exclude_none=True) for b in final.content],
                }
            )
            messages.append(results(final.content))
        return texts

    with ScriptedMessagesServer(script) as server:
        ids = anyio.run(run, server)
        sent = server.requests
    assert all(visible(b) <= 200_000 for b in sent)  # the budget applied to streamed calls
    records = [
        json.loads(line)
        for line in (only(conversation_dirs(tmp_path)) / "decisions.jsonl").read_text().splitlines()
    ]
    seen = [r["data"] for r in records if r.get("stage") == "wire_session.response"]
    # each streamed response's id and full usage (input from message_start, output from
    # message_delta) reached the session
    assert [d["id"] for d in seen] == ids
    assert all(d["usage"]["output_tokens"] > 1 and "input_tokens" in d["usage"] for d in seen)


def test_each_request_is_a_span_with_its_pipeline_pass_beneath(tmp_path: Path) -> None:
    from pipeline.testing import SpanRecorder

    spans = SpanRecorder()
    with ScriptedMessagesServer(script) as server:
        client = wrap(
            sdk_client(server.base_url),
            root=tmp_path,
            tracer=spans.tracer,
        )
        anyio.run(client_loop, client, "traced task", 2)
    requests = spans.named("wire.request")
    runs = spans.named("pipeline.run")
    assert len(requests) == len(runs) == 2
    for request, run in zip(requests, runs, strict=True):
        assert run.parent is not None and run.parent.span_id == request.context.span_id
        assert request.attributes is not None
        assert request.attributes["http.response.status_code"] == 200
        assert request.attributes["gen_ai.conversation.id"].startswith("fp-")
    # no content in the spans: only ids, counts, names
    dumped = json.dumps([dict(s.attributes or {}) for s in spans.spans])
    assert "traced task" not in dumped and "xxxx" not in dumped


def test_the_sync_clients_pipeline_pass_is_beneath_its_request_span(tmp_path: Path) -> None:
    # the sync path runs the pass on a private loop in a worker thread: the caller's trace
    # context must go with it, or every pass starts a trace of its own
    from pipeline.testing import SpanRecorder

    spans = SpanRecorder()
    with ScriptedMessagesServer(script) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        client = wrap(raw, root=tmp_path, tracer=spans.tracer)
        with spans.tracer.start_as_current_span("caller") as caller:
            sync_client_loop(client, "sync traced", 2)
        raw.close()
    requests = spans.named("wire.request")
    runs = spans.named("pipeline.run")
    assert len(requests) == len(runs) == 2
    for request, run in zip(requests, runs, strict=True):
        assert request.parent is not None
        assert request.parent.span_id == caller.get_span_context().span_id
        assert run.parent is not None and run.parent.span_id == request.context.span_id
        assert run.context.trace_id == caller.get_span_context().trace_id


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_sync_client_works_inside_a_running_event_loop(tmp_path: Path, backend: str) -> None:
    # a sync call made from async code (a blocking call in a coroutine, as some programs do):
    # the pass runs on its own loop in a worker thread, whatever loop the caller runs
    with ScriptedMessagesServer(script) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        client = wrap(raw, root=tmp_path)

        async def blocking_call() -> None:
            sync_client_loop(client, "from a coroutine", 2)

        anyio.run(blocking_call, backend=backend)
        raw.close()
        assert len(server.requests) == 2


def test_the_pass_goes_beside_the_sdks_call_span_not_inside(tmp_path: Path) -> None:
    # the SDK's GenAI span is the model call's alone: the pass the middleware runs during that
    # call is its sibling, under the caller's span
    from pipeline.testing import SpanRecorder

    spans = SpanRecorder()
    with ScriptedMessagesServer(script) as server:
        traced = sdk_client(server.base_url, open_telemetry={"tracer_provider": spans.provider})
        client = wrap(traced, root=tmp_path, tracer=spans.tracer)

        async def run() -> None:
            with spans.tracer.start_as_current_span("caller"):
                await client_loop(client, "beside", 2)

        anyio.run(run)
    [caller] = spans.named("caller")
    sdk_calls = [s for s in spans.spans if s.instrumentation_scope.name != "sluicegate"]
    requests = spans.named("wire.request")
    assert len(sdk_calls) == len(requests) == 2
    for call, request in zip(sdk_calls, requests, strict=True):
        assert call.parent is not None and call.parent.span_id == caller.context.span_id
        assert request.parent is not None and request.parent.span_id == caller.context.span_id
    inside = {s.context.span_id for s in sdk_calls}
    assert not any(s.parent is not None and s.parent.span_id in inside for s in spans.spans)
    [run_span, _] = spans.named("pipeline.run")
    assert run_span.parent is not None and run_span.parent.span_id == requests[0].context.span_id


def test_an_error_that_quotes_content_reaches_no_span_of_a_request(tmp_path: Path) -> None:
    from pipeline.core import FunctionStage, StageError
    from pipeline.testing import SpanRecorder

    secret = "MY-SECRET-PROMPT"

    async def quoting(messages: list[Any], ctx: Any) -> list[Any]:
        raise ValueError(f"could not parse: {messages[-1].content}")

    spans = SpanRecorder()
    with ScriptedMessagesServer(script) as server:
        client = wrap_with(
            sdk_client(server.base_url),
            root=tmp_path,
            pipeline=lambda: Pipeline([FunctionStage("quoting", quoting)]),
            tracer=spans.tracer,
        )

        async def ask() -> None:
            await client.messages.create(
                model="m", max_tokens=10, messages=[{"role": "user", "content": secret}]
            )

        with pytest.raises(StageError, match=secret):
            anyio.run(ask)
    [request] = spans.named("wire.request")
    assert request.status.description == "StageError"
    assert spans.holding(secret) == []


def test_cache_breakpoints_for_clients_that_set_none(tmp_path: Path) -> None:
    def ask(client: anthropic.Anthropic, messages: list[dict[str, Any]]) -> None:
        client.messages.create(model="m", max_tokens=10, messages=messages)  # type: ignore[arg-type]

    tool_turn: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "x", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "out"}],
        },
    ]
    own = json.loads(json.dumps(tool_turn))
    own[1]["content"][0]["cache_control"] = {"type": "ephemeral"}
    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": "ok"}])) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        ask(wrap(raw, root=tmp_path / "on", cache_breakpoint=True), tool_turn)
        ask(wrap(raw, root=tmp_path / "own", cache_breakpoint=True), own)
        ask(wrap(raw, root=tmp_path / "off"), tool_turn)
        on, kept, off = (r["messages"] for r in server.requests)
    marked = [b for m in on for b in m["content"] if isinstance(b, dict) and "cache_control" in b]
    assert marked == [{**tool_turn[2]["content"][0], "cache_control": {"type": "ephemeral"}}]
    assert kept == own  # the client's own breakpoint, alone
    assert off == tool_turn
    assert "cache_control" not in json.dumps(tool_turn)  # the caller's messages untouched


def test_what_a_stage_asks_of_the_request_is_sent(tmp_path: Path) -> None:
    from stages import ServerSideMicrocompact

    with ScriptedMessagesServer(script) as server:
        client = wrap_with(
            sdk_client(server.base_url),
            root=tmp_path,
            pipeline=lambda: Pipeline([ToolResultBudget(), ServerSideMicrocompact()]),
        )
        anyio.run(client_loop, client, "server clearing", 2)
        sent = server.requests
    # server-side clearing's configuration, without the user's help
    assert all("context_management" in b for b in sent)
    assert all(visible(b) <= 200_000 for b in sent)


def test_the_sdk_tool_runner(tmp_path: Path) -> None:
    @anthropic.beta_async_tool
    async def get_log() -> str:
        """The job's log."""
        return "log line\n" * 5_000  # 45,000 chars, six at a time: 270K a turn

    def runner_script(body: dict[str, Any]) -> Reply:
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if turn >= 2:
            return Reply([{"type": "text", "text": "all read"}])
        ids = [f"toolu_r{turn}_{i}" for i in range(6)]
        return Reply(
            [{"type": "tool_use", "id": t, "name": "get_log", "input": {}} for t in ids],
            stop_reason="tool_use",
        )

    async def run(url: str) -> str:
        client = wrap(sdk_client(url), root=tmp_path)
        runner = client.beta.messages.tool_runner(
            model="m",
            max_tokens=10,
            tools=[get_log],
            messages=[{"role": "user", "content": "go"}],
            thread=False,  # the history in the requests (thread mode keeps it on the server)
        )
        last = None
        async for message in runner:
            last = message
        assert last is not None
        return str(last.content[0].text)  # type: ignore[union-attr]

    with ScriptedMessagesServer(runner_script) as server:
        answer = anyio.run(run, server.base_url)
        sent = server.requests
    assert answer == "all read" and len(sent) == 3
    assert all(visible(b) <= 200_000 for b in sent)
    assert TAG in json.dumps(sent[1]) and TAG in json.dumps(sent[2])


EDITS = {
    "applied_edits": [
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 2, "cleared_input_tokens": 900}
    ]
}


@pytest.mark.parametrize("streamed", [False, True])
def test_the_request_span_says_what_the_call_cost(tmp_path: Path, streamed: bool) -> None:
    # model, response id, token usage (a stream's from its first and last events) and the
    # server-side edits the API applied: what a trace UI prices a call by
    from pipeline.testing import SpanRecorder

    spans = SpanRecorder()

    def edited(body: dict[str, Any]) -> Reply:
        usage = {"input_tokens": 7, "output_tokens": 11, "cache_read_input_tokens": 300}
        return Reply([{"type": "text", "text": "ok"}], usage=usage, context_management=EDITS)

    with ScriptedMessagesServer(edited) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        client = wrap(raw, root=tmp_path, tracer=spans.tracer)
        asked: dict[str, Any] = {
            "model": "claude-test",
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}],
        }
        if streamed:
            with client.messages.stream(**asked) as stream:
                reply_id = stream.get_final_message().id
        else:
            reply_id = client.messages.create(**asked).id
        raw.close()
    [request] = spans.named("wire.request")
    attributes = dict(request.attributes or {})
    assert attributes["gen_ai.request.model"] == "claude-test"
    assert attributes["gen_ai.request.stream"] is streamed
    assert attributes["gen_ai.response.id"] == reply_id
    assert attributes["gen_ai.usage.input_tokens"] == 307  # the cached ones included
    assert attributes["gen_ai.usage.output_tokens"] == 11
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == 300
    assert "gen_ai.usage.cache_creation.input_tokens" not in attributes  # not reported
    assert list(attributes["sluicegate.context_management.applied_edits"]) == [
        "clear_tool_uses_20250919"
    ]
    assert attributes["sluicegate.upstream.duration_ms"] >= 0
    assert request.end_time is not None and request.end_time >= (request.start_time or 0)


class _Counted(str):
    """A text that counts its deep copies."""

    copies = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> _Counted:
        _Counted.copies += 1
        return _Counted(str(self))


def test_wrap_never_deep_copies_the_history(tmp_path: Path) -> None:
    """The SDK's request copy deep-copies the body it is about to replace: the whole history,
    every call (~320 ms a call at 5,000 messages)."""
    history: list[dict[str, Any]] = [{"role": "user", "content": _Counted("start")}]
    for k in range(200):
        tid = f"toolu_{k:04d}"
        history += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": tid, "name": "x",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid,
                                          "content": _Counted("y" * 100)}]},
        ]  # fmt: skip
    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": "ok"}])) as up:
        raw = anthropic.Anthropic(base_url=up.base_url, api_key="sk-ant-x", max_retries=0)
        client = wrap_with(raw, root=tmp_path, pipeline=lambda: Pipeline([ToolResultBudget()]))
        _Counted.copies = 0
        client.messages.create(model="m", max_tokens=5, messages=history)  # type: ignore[arg-type]
        raw.close()
        sent = up.requests[0]["messages"]
    assert _Counted.copies == 0
    assert len(sent) == len(history)


def test_the_first_party_client_gets_its_bodies_written_in_the_size_of_whats_new(
    tmp_path: Path,
) -> None:
    """The prepared body goes as bytes the middleware writes, each call encoding only what is
    new since the conversation's last one; the upstream sees what the SDK's own JSON would
    carry, as JSON; a request with ``extra_body`` goes as the SDK's JSON, merged."""
    from pipeline.dropin.wrap import SluicegateMiddleware

    with ScriptedMessagesServer(script) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        sent = []
        for raw_bodies in (True, False):
            middleware = SluicegateMiddleware(
                root=tmp_path / str(raw_bodies),
                pipeline=lambda: Pipeline([ToolResultBudget(limit=50_000)]),
                raw_bodies=raw_bodies,
            )
            sync_client_loop(raw.with_middleware(middleware), "go", 4)
            sent.append(server.requests[-4:])
            if raw_bodies:
                assert middleware.writer is not None and middleware.writer.reused > 0
                assert all(h["content-type"] == "application/json" for h in server.request_headers)
            else:
                assert middleware.writer is None
        texts = [
            portable([json.dumps(b) for b in bodies], tmp_path / str(flag))
            for bodies, flag in zip(sent, (True, False), strict=True)
        ]
        assert texts[0] == texts[1]  # the same requests, each store's own paths aside
        client = raw.with_middleware(
            SluicegateMiddleware(
                root=tmp_path / "extra",
                pipeline=lambda: Pipeline([ToolResultBudget(limit=50_000)]),
                raw_bodies=True,
            )
        )
        client.messages.create(
            model="m",
            max_tokens=10,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"metadata": {"user_id": "u1"}},
        )
        assert server.requests[-1]["metadata"] == {"user_id": "u1"}
        with pytest.raises(ValueError, match="float"):  # as the SDK's own JSON refuses it
            client.messages.create(
                model="m",
                max_tokens=10,
                messages=[{"role": "user", "content": "hi"}],
                extra_body={"top_k": float("nan")},
            )
        raw.close()


def test_raw_bodies_are_asked_for() -> None:
    """Off by default: a middleware added after wrap's sees the request's JSON."""
    seen: list[Any] = []

    class Looking(anthropic.Middleware):
        def handle(self, request: Any, call_next: Any) -> Any:
            seen.append(request.json)
            return call_next(request)

    with ScriptedMessagesServer(script) as server, tempfile.TemporaryDirectory() as root:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        client = wrap(raw, root=root).with_middleware(Looking())
        sync_client_loop(client, "go", 2)
        raw.close()
    assert len(seen) == 2 and all(isinstance(j, dict) and j["messages"] for j in seen)


def test_only_a_client_that_sends_the_body_as_given_gets_raw_bodies() -> None:
    from pipeline.dropin.sdk_middleware import sends_body_as_given as _sends_body_as_given

    class Rewriting(anthropic.Anthropic):
        def _prepare_options(self, options: Any) -> Any:
            return options

    assert _sends_body_as_given(anthropic.Anthropic(api_key="k"))
    assert _sends_body_as_given(anthropic.AsyncAnthropic(api_key="k"))
    assert not _sends_body_as_given(Rewriting(api_key="k"))
    vertex = anthropic.AnthropicVertex(region="us-east5", project_id="p", access_token="t")
    assert not _sends_body_as_given(vertex)


class _Witnessed:
    """A stage that tells whether the pass it is in ran off the caller's event loop."""

    name = "witnessed"

    def __init__(self, witness: OffTheLoop) -> None:
        self.witness = witness

    async def __call__(self, messages: Any, ctx: Any) -> Any:
        if len(messages) > 3:  # a long pass (the first one of a resumed conversation)
            self.witness.wait("the long pass ran")
        return messages


def test_an_async_clients_long_first_pass_runs_off_its_loop(tmp_path: Path) -> None:
    """The long pass waits for a task of the caller's loop: were it run there, it would wait
    for itself (and fail after the timeout). A short first pass, and a long conversation's
    later ones, run on the caller's loop as before."""
    witness = OffTheLoop()
    long_history: list[Any] = [{"role": "user", "content": "resume"}]
    for k in range(3):
        long_history += [
            {"role": "assistant", "content": [{"type": "text", "text": f"a{k}"}]},
            {"role": "user", "content": f"u{k}"},
        ]

    async def main(client: Any) -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(witness.free)
            await client.messages.create(model="m", max_tokens=5, messages=long_history)
        assert witness.began.is_set()
        await client.messages.create(model="m", max_tokens=5, messages=long_history[:1])

    with ScriptedMessagesServer(lambda body: Reply([{"type": "text", "text": "ok"}])) as server:
        client = wrap_with(
            sdk_client(server.base_url),
            root=tmp_path,
            pipeline=lambda: Pipeline([_Witnessed(witness)]),
            long_pass=4,
        )
        anyio.run(main, client)
        assert len(server.requests) == 2


@pytest.mark.parametrize("bad", [0, -1, True])
def test_a_long_pass_bound_below_one_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="long_pass"):
        wrap_with(sdk_client("http://127.0.0.1:9"), pipeline=Pipeline, long_pass=bad)


class _Slow:
    """A stage that takes a while, as a long first pass's CPU work does."""

    name = "slow"

    async def __call__(self, messages: Any, ctx: Any) -> Any:
        import time

        time.sleep(0.2)
        return messages


def _resumed(rounds: int) -> list[Any]:
    history: list[Any] = [{"role": "user", "content": "resume"}]
    for k in range(rounds):
        history += [
            {"role": "assistant", "content": [{"type": "text", "text": f"a{k}"}]},
            {"role": "user", "content": f"u{k}"},
        ]
    return history


def _ran_within(seconds: float, work: Any) -> None:
    """``work()`` in a thread of its own, which must be through within ``seconds`` (a hang
    fails the test instead of holding it)."""
    import threading

    failed: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"not through in {seconds} s"
    if failed:
        raise failed[0]


def test_concurrent_calls_of_a_conversation_with_a_long_pass_take_turns(tmp_path: Path) -> None:
    """Two calls of one resumed conversation at once (parallel samples, a retry): the first
    pass runs off the caller's loop, the other waits for it and runs on the loop; both go
    out. Without the turns, the two passes met on the session's lock from two loops and one
    waited forever."""
    from stages import default_stages

    history = _resumed(150)

    async def main(client: Any) -> None:
        async with anyio.create_task_group() as tasks:
            for _ in range(2):
                tasks.start_soon(
                    functools.partial(
                        client.messages.create, model="m", max_tokens=5, messages=history
                    )
                )

    with ScriptedMessagesServer(lambda body: Reply([{"type": "text", "text": "ok"}])) as server:
        client = wrap_with(
            sdk_client(server.base_url),
            root=tmp_path,
            pipeline=lambda: Pipeline(default_stages()),
            long_pass=4,
        )
        _ran_within(60, lambda: anyio.run(main, client))
        assert len(server.requests) == 2
        assert server.requests[0]["messages"] == server.requests[1]["messages"]


def test_a_long_pass_whose_caller_was_cancelled_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncio's own cancellation returns before the worker's pass is through: the retry's
    pass waits for it, so the two never run at once (each rewrites the session's view of the
    conversation)."""
    import asyncio
    import threading
    import time

    from pipeline.dropin.adapter import WireSession

    spans: list[tuple[float, float, str]] = []
    prepare = WireSession.prepare_call

    async def timed(self: WireSession, body: Any) -> Any:
        start = time.monotonic()
        try:
            return await prepare(self, body)
        finally:
            spans.append((start, time.monotonic(), threading.current_thread().name))

    monkeypatch.setattr(WireSession, "prepare_call", timed)
    history = _resumed(20)
    callers: list[str] = []

    async def main(client: Any) -> None:
        callers.append(threading.current_thread().name)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                client.messages.create(model="m", max_tokens=5, messages=history), 0.05
            )
        await client.messages.create(model="m", max_tokens=5, messages=history)

    with ScriptedMessagesServer(lambda body: Reply([{"type": "text", "text": "ok"}])) as server:
        client = wrap_with(
            sdk_client(server.base_url),
            root=tmp_path,
            pipeline=lambda: Pipeline([_Slow()]),
            long_pass=4,
        )
        _ran_within(60, lambda: asyncio.run(main(client)))
    (first, second) = sorted(spans)
    assert first[2] != callers[0] and second[2] == callers[0]
    assert second[0] >= first[1]  # one after the other


def test_a_long_pass_off_the_loop_is_beneath_its_request_span(tmp_path: Path) -> None:
    """The pass run on a loop of its own keeps the caller's trace: one trace per request."""
    from pipeline.testing import SpanRecorder

    spans = SpanRecorder()
    with ScriptedMessagesServer(lambda body: Reply([{"type": "text", "text": "ok"}])) as server:
        client = wrap(sdk_client(server.base_url), root=tmp_path, tracer=spans.tracer, long_pass=4)
        anyio.run(
            functools.partial(
                client.messages.create, model="m", max_tokens=5, messages=_resumed(10)
            )
        )
    (request,) = spans.named("wire.request")
    (run,) = spans.named("pipeline.run")
    assert run.parent is not None and run.parent.span_id == request.context.span_id


@pytest.mark.parametrize("usage", [10.0, "10", -1, True])
def test_a_reply_whose_usage_the_tracker_refuses_still_reaches_the_caller(
    tmp_path: Path, usage: Any
) -> None:
    """The SDK takes usage it would not count (a float, a string, a negative): the wrapped
    client returns the reply as the SDK alone does; the tracker estimates on without it."""
    from pipeline.testing import RawReply

    reply = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "fine"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": usage, "output_tokens": 2},
    }

    def odd(_body: dict[str, Any]) -> RawReply:
        return RawReply(json.dumps(reply).encode())

    ask = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    with ScriptedMessagesServer(odd) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        synced = wrap(raw, root=tmp_path / "s")
        assert synced.messages.create(**ask).content[0].text == "fine"  # type: ignore[union-attr]

        async def main() -> str:
            client = wrap(sdk_client(server.base_url), root=tmp_path / "a")
            message = await client.messages.create(**ask)
            return message.content[0].text  # type: ignore[union-attr]

        assert anyio.run(main) == "fine"
    for store in ("s", "a"):  # the response is recorded all the same, without its usage
        (log,) = (tmp_path / store).glob("*/*/decisions.jsonl")
        assert '"msg_1"' in log.read_text()


@pytest.mark.parametrize("where", ["system", "tools", "request"])
def test_no_breakpoint_is_added_for_a_client_that_marks_outside_its_messages(
    tmp_path: Path, where: str
) -> None:
    """A client that marks its system prompt or tools (four marks there are the API's most),
    or asks for the whole request to be cached, sets its own: none is added."""
    mark = {"type": "ephemeral"}
    ask: dict[str, Any] = {
        "model": "m",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "go"}]}],
    }
    if where == "system":
        ask["system"] = [{"type": "text", "text": f"s{k}", "cache_control": mark} for k in range(4)]
    elif where == "tools":
        schema = {"type": "object", "properties": {}}
        ask["tools"] = [
            {"name": f"t{k}", "input_schema": schema, "cache_control": mark} for k in range(4)
        ]
    else:
        ask["extra_body"] = {"cache_control": mark}
    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": "ok"}])) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        wrap(raw, root=tmp_path, cache_breakpoint=True).messages.create(**ask)
        (sent,) = server.requests
    assert sent["messages"] == ask["messages"]
    assert json.dumps(sent).count('"cache_control"') == (1 if where == "request" else 4)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "x"}],
        [{"role": "user", "content": 5}],
        ["hello"],
        [{"role": "user", "content": ["x"]}],
    ],
)
def test_a_request_the_pass_cannot_read_goes_as_it_came(tmp_path: Path, messages: Any) -> None:
    """Messages the pass cannot read go to the API as the SDK alone sends them: the API
    judges them (a 400 there, ``anthropic.BadRequestError``), not a bare ``ValueError`` here."""
    ask = {"model": "m", "max_tokens": 5, "messages": messages}
    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": "ok"}])) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        named = {"x-sluicegate-session": "private-name"}  # the conversation's: never sent
        wrap(raw, root=tmp_path / "s").messages.create(**ask, extra_headers=named)

        async def main() -> None:
            client = wrap(sdk_client(server.base_url), root=tmp_path / "a")
            await client.messages.create(**ask, extra_headers=named)

        anyio.run(main)
        assert [r["messages"] for r in server.requests] == [messages, messages]
        assert not any("x-sluicegate-session" in h for h in server.request_headers)


@pytest.mark.parametrize("second", ["sync", "async", "process"])
def test_clients_taking_turns_on_one_store_send_the_same_bytes(tmp_path: Path, second: str) -> None:
    """Two wrapped clients on one store (another client of the same program, or a program
    started anew for each call) taking turns on one conversation: each asks the store for
    news before its call, so an earlier result goes out in one form on every call, whoever
    sends it -- never the preview from one client and the whole output from the other."""
    with ScriptedMessagesServer(script) as server:

        def make() -> Any:
            raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
            return wrap(raw, root=tmp_path)

        first = make()
        other = make() if second == "sync" else None

        def call(k: int, messages: list[dict[str, Any]]) -> Any:
            if k % 2 == 0:
                return first.messages.create(model="m", max_tokens=10, messages=messages)
            if second == "process":  # a new client each time: what a new program would hold
                return make().messages.create(model="m", max_tokens=10, messages=messages)
            if second == "sync":
                return other.messages.create(model="m", max_tokens=10, messages=messages)

            async def run() -> Any:
                client = wrap(sdk_client(server.base_url), root=tmp_path)
                return await client.messages.create(model="m", max_tokens=10, messages=messages)

            return anyio.run(run)

        messages: list[dict[str, Any]] = [{"role": "user", "content": "shared work"}]
        for k in range(6):
            response = call(k, messages)
            blocks = [b.model_dump(exclude_none=True) for b in response.content]
            messages += [{"role": "assistant", "content": blocks}, results(response.content)]
        sent = [r["messages"] for r in server.requests]
    for before, after in itertools.pairwise(sent):
        assert after[: len(before)] == before  # the prefix as sent the call before
    assert all(visible({"messages": s}) <= 200_000 * len(s) for s in sent)
    assert any(TAG in json.dumps(m) for m in sent[1])


def test_no_breakpoint_is_added_for_a_client_that_marks_inside_its_results(
    tmp_path: Path,
) -> None:
    """Marks inside a tool result's content are the client's too (the API counts them): with
    four there, none is added."""
    mark = {"type": "ephemeral"}
    texts = [{"type": "text", "text": f"part {k}", "cache_control": mark} for k in range(4)]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "x", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": texts}],
        },
    ]
    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": "ok"}])) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        wrap(raw, root=tmp_path, cache_breakpoint=True).messages.create(
            model="m",
            max_tokens=10,
            messages=messages,  # type: ignore[arg-type]
        )
        (sent,) = server.requests
    assert sent["messages"] == messages


def test_each_message_goes_as_its_own_message(tmp_path: Path) -> None:
    """At the wire a message is a message: two user messages in a row stay two (no ``\\n``
    added at a seam), and a user message's blocks keep their order."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "x", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "first"},
                {"type": "tool_result", "tool_use_id": "t1", "content": "out"},
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": "more"}]},
    ]
    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": "ok"}])) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        client = wrap(raw, root=tmp_path)
        client.messages.create(model="m", max_tokens=10, messages=messages)  # type: ignore[arg-type]
        client.messages.create(model="m", max_tokens=10, messages=messages)  # type: ignore[arg-type]
        assert [r["messages"] for r in server.requests] == [messages, messages]


def test_a_200_that_is_not_a_message_comes_back_as_the_sdk_alone_gives_it(
    tmp_path: Path,
) -> None:
    """A 200 whose body is not JSON (a gateway's cut answer): ``with_raw_response`` hands it
    back to be read, and ``create`` fails with the SDK's own error -- as without ``wrap``."""
    broken = RawReply(b'{"type": "message", ', content_type="application/json")
    ask = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with ScriptedMessagesServer(lambda _b: broken) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        client = wrap(raw, root=tmp_path / "s")
        answer = client.messages.with_raw_response.create(**ask)
        assert answer.http_response.text == broken.body.decode()
        with pytest.raises(json.JSONDecodeError):
            client.messages.create(**ask)

        async def main() -> str:
            wrapped = wrap(sdk_client(server.base_url), root=tmp_path / "a")
            answer = await wrapped.messages.with_raw_response.create(**ask)
            return answer.http_response.text

        assert anyio.run(main) == broken.body.decode()


def test_a_copy_with_another_key_is_that_keys_tenant(tmp_path: Path) -> None:
    """The tenant is the credential a request goes with: a ``with_options(api_key=...)`` copy
    of a wrapped client files its conversations under its own key's tenant."""
    ask = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": "ok"}])) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k1", max_retries=0)
        client = wrap(raw, root=tmp_path)
        client.messages.create(**ask)
        client.with_options(api_key="k2").messages.create(**ask)
    assert len(list(tmp_path.glob("t-*"))) == 2
