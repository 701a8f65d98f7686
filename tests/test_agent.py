"""The agent loop, on the real anthropic SDK against the local scripted Messages server."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from pipeline import Message, Pipeline, SessionContext, TranscriptWriter, load_transcript, to_api
from pipeline.agent import CANCELLED_RESULT, INTERRUPTED_RESULT, Agent, AgentAPIError
from pipeline.testing import Reply, ScriptedMessagesServer, ScriptError, without_cache_control
from pipeline.tools import Tool, tool
from pipeline.wire.pairing import check_pairing
from stages import ToolResultBudget, default_stages
from tests.sdk_support import sdk_client

MARK = "OUTPUT-MARK "


@tool(
    input_schema={
        "type": "object",
        "properties": {"n": {"type": "integer"}, "delay": {"type": "number"}},
    }
)
async def emit(n: int, delay: float = 0.0) -> str:
    """Emit about n characters of output."""
    await anyio.sleep(delay)
    return (MARK * (n // len(MARK) + 1))[:n]


@tool(input_schema={"type": "object", "properties": {}})
async def boom() -> str:
    """Always fails."""
    raise RuntimeError("disk on fire")


def tool_call(tid: str, name: str, **inp: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": tid, "name": name, "input": inp}


def scripted(*turns: list[dict[str, Any]]) -> Callable[[dict[str, Any]], Reply | ScriptError]:
    """Reply with ``turns[k]`` on the k-th call (by assistant messages sent so far)."""

    def script(body: dict[str, Any]) -> Reply | ScriptError:
        k = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if k < len(turns):
            return Reply(turns[k], stop_reason="tool_use")
        return Reply([{"type": "text", "text": "all done"}])

    return script


@pytest.fixture
def server_factory() -> Iterator[Callable[..., ScriptedMessagesServer]]:
    servers: list[ScriptedMessagesServer] = []

    def make(script: Callable[[dict[str, Any]], Reply | ScriptError]) -> ScriptedMessagesServer:
        s = ScriptedMessagesServer(script)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def new_agent(
    server: ScriptedMessagesServer,
    tmp_path: Path,
    *,
    tools: list[Tool],
    pipeline: Pipeline | None = None,
    session: str = "sess",
) -> Agent:
    log = tmp_path / f"{session}.jsonl"
    ctx = SessionContext(session, tmp_path / "store", transcript=TranscriptWriter(log, session))
    return Agent(
        sdk_client(server.base_url),
        model="claude-test",
        pipeline=pipeline or Pipeline(default_stages()),
        ctx=ctx,
        tools=tools,
    )


@pytest.mark.asyncio
async def test_large_result_is_persisted_before_the_next_request(
    server_factory: Callable[..., ScriptedMessagesServer], tmp_path: Path
) -> None:
    server = server_factory(
        scripted(
            [tool_call("toolu_big", "emit", n=60_000), tool_call("toolu_small", "emit", n=500)]
        )
    )
    agent = new_agent(server, tmp_path, tools=[emit])
    result = await agent.run("go")
    assert (result.stop_reason, result.turns, result.text) == ("end_turn", 2, "all done")
    second = server.requests[1]["messages"]
    blocks = second[2]["content"]
    assert [b["tool_use_id"] for b in blocks] == ["toolu_big", "toolu_small"]
    big = blocks[0]["content"]
    assert big.startswith("<persisted-output>\nOutput too large (58.6KB). Full output saved to: ")
    path = big.split("Full output saved to: ")[1].split("\n")[0]
    assert Path(path).read_text() == (MARK * 5000)[:60_000]
    assert blocks[1]["content"] == (MARK * 100)[:500]
    assert check_pairing(second) == []
    # the tools sent include the automatic read-back tool
    assert [t["name"] for t in server.requests[0]["tools"]] == ["emit", "read_persisted_output"]


@pytest.mark.asyncio
async def test_parallel_tools_run_concurrently_and_answer_in_call_order(
    server_factory: Callable[..., ScriptedMessagesServer], tmp_path: Path
) -> None:
    arrived: list[str] = []
    all_in = anyio.Event()

    @tool(input_schema={"type": "object", "properties": {"tag": {"type": "string"}}})
    async def meet(tag: str) -> str:
        """Wait until all three calls are running: sequential execution would never finish."""
        arrived.append(tag)
        if len(arrived) == 3:
            all_in.set()
        await all_in.wait()
        return tag * (3 - len(arrived) + 1)

    server = server_factory(
        scripted(
            [
                tool_call("t1", "meet", tag="a"),
                tool_call("t2", "meet", tag="b"),
                tool_call("t3", "meet", tag="c"),
            ]
        )
    )
    agent = new_agent(server, tmp_path, tools=[meet])
    with anyio.fail_after(10):
        await agent.run("go")
    assert sorted(arrived) == ["a", "b", "c"]
    sent = server.requests[1]["messages"][2]["content"]
    assert [b["tool_use_id"] for b in sent] == ["t1", "t2", "t3"]  # call order, not finish order


@pytest.mark.asyncio
async def test_usage_feeds_the_tracker(
    server_factory: Callable[..., ScriptedMessagesServer], tmp_path: Path
) -> None:
    server = server_factory(scripted([tool_call("t1", "emit", n=4_000)]))
    agent = new_agent(server, tmp_path, tools=[emit])
    await agent.run("go")
    assistant = [m for m in agent.history if m.type == "assistant"]
    assert assistant[0].usage is not None and assistant[0].usage.input_side > 0
    tracker = agent.ctx.token_tracker
    assert tracker.last_error is not None
    # the estimate is anchored on the last response's real usage
    last = assistant[-1].usage
    assert last is not None and tracker.estimate(agent.history) == last.total


@pytest.mark.asyncio
async def test_tool_exception_becomes_an_error_result(
    server_factory: Callable[..., ScriptedMessagesServer], tmp_path: Path
) -> None:
    server = server_factory(scripted([tool_call("t1", "boom"), tool_call("t2", "nope")]))
    agent = new_agent(server, tmp_path, tools=[boom])
    await agent.run("go")
    sent = server.requests[1]["messages"][2]["content"]
    assert sent[0] == {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": "Error: RuntimeError: disk on fire",
        "is_error": True,
    }
    assert sent[1]["is_error"] is True and "no tool named 'nope'" in sent[1]["content"]


@pytest.mark.asyncio
async def test_a_tool_output_no_result_can_carry_is_an_error_result(
    server_factory: Callable[..., ScriptedMessagesServer], tmp_path: Path
) -> None:
    """A tool that returns bytes, or blocks JSON cannot write: the model sees that call's
    error, and the turn goes on with every other call's result recorded."""

    @tool(input_schema={"type": "object", "properties": {"kind": {"type": "string"}}})
    async def odd(kind: str) -> Any:
        """Returns what it is asked to."""
        return {"bytes": b"\xff", "blocks": [{"type": "text", "text": b"x"}]}.get(kind, "fine")

    calls = [
        tool_call(f"t{k}", "odd", kind=kind) for k, kind in enumerate(["ok", "bytes", "blocks"])
    ]
    server = server_factory(scripted(calls))
    agent = new_agent(server, tmp_path, tools=[odd])
    result = await agent.run("go")
    assert result.text == "all done"
    sent = server.requests[1]["messages"][2]["content"]
    assert sent[0] == {"type": "tool_result", "tool_use_id": "t0", "content": "fine"}
    assert sent[1]["is_error"] and "returned bytes, not text or blocks" in sent[1]["content"]
    assert sent[2]["is_error"] and "blocks JSON cannot carry" in sent[2]["content"]


@pytest.mark.asyncio
async def test_a_call_cut_off_at_max_tokens_is_not_run(
    server_factory: Callable[..., ScriptedMessagesServer], tmp_path: Path
) -> None:
    """A response that reached ``max_tokens`` may end in a half-written tool call: that call
    is answered with an error, never run on its possibly incomplete input; the calls before
    it are whole and run; the model is asked again."""
    ran: list[str] = []

    @tool(input_schema={"type": "object", "properties": {"cmd": {"type": "string"}}})
    async def shell(cmd: str) -> str:
        """Runs a command."""
        ran.append(cmd)
        return "ran"

    def script(body: dict[str, Any]) -> Reply:
        if len(body["messages"]) == 1:
            calls = [tool_call("t1", "shell", cmd="ls"), tool_call("t2", "shell", cmd="rm -rf /tm")]
            return Reply(calls, stop_reason="max_tokens")
        return Reply([{"type": "text", "text": "all done"}])

    server = server_factory(script)
    agent = new_agent(server, tmp_path, tools=[shell])
    result = await agent.run("go")
    assert ran == ["ls"] and result.text == "all done"
    first, cut = server.requests[1]["messages"][2]["content"]
    assert first["content"] == "ran"
    assert cut["is_error"] and "reached max_tokens" in cut["content"]


@pytest.mark.asyncio
async def test_cancellation_mid_tools_leaves_a_valid_history(
    server_factory: Callable[..., ScriptedMessagesServer], tmp_path: Path
) -> None:
    running = anyio.Event()

    @tool(input_schema={"type": "object", "properties": {}})
    async def hang() -> str:
        """Never returns."""
        running.set()
        await anyio.sleep_forever()
        return ""

    server = server_factory(scripted([tool_call("fast", "emit", n=5), tool_call("slow", "hang")]))
    agent = new_agent(server, tmp_path, tools=[emit, hang])
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def cancel_once_stuck() -> None:
                # cancelled while the slow call hangs (not by a timer, which a loaded machine
                # may reach before the tools even start), once the fast call has answered
                await running.wait()
                await anyio.wait_all_tasks_blocked()
                scope.cancel()

            tg.start_soon(cancel_once_stuck)
            await agent.run("go")
    assert scope.cancelled_caught
    results = agent.history[-1].content
    assert isinstance(results, list)
    assert [(b["tool_use_id"], b.get("is_error", False)) for b in results] == [
        ("fast", False),
        ("slow", True),
    ]
    assert results[1]["content"] == CANCELLED_RESULT
    assert check_pairing(to_api(agent.history)) == []
    # the transcript holds the same valid history
    loaded = load_transcript(tmp_path / "sess.jsonl")
    assert check_pairing(to_api(loaded.messages)) == []
    assert [m.uuid for m in loaded.messages] == [m.uuid for m in agent.history]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (ScriptError(529, "overloaded_error", "Overloaded"), "overloaded"),
        (
            ScriptError(
                400, "invalid_request_error", "prompt is too long: 210000 tokens > 200000 maximum"
            ),
            "prompt_too_long",
        ),
        (ScriptError(400, "invalid_request_error", "messages: bad"), "bad_request"),
    ],
)
async def test_api_errors_are_clear_and_lose_nothing(
    server_factory: Callable[..., ScriptedMessagesServer],
    tmp_path: Path,
    error: ScriptError,
    kind: str,
) -> None:
    server = server_factory(lambda body: error)
    agent = new_agent(server, tmp_path, tools=[emit])
    with pytest.raises(AgentAPIError) as info:
        await agent.run("hello")
    assert info.value.kind == kind and info.value.status == error.status
    assert info.value.request_id == "req_scripted_000001"
    assert error.message in str(info.value)
    loaded = load_transcript(tmp_path / "sess.jsonl")
    assert [m.content for m in loaded.messages] == ["hello"]


def _turns() -> list[list[dict[str, Any]]]:
    return [
        [tool_call(f"a{i}", "emit", n=9_000) for i in range(4)],
        [tool_call("b0", "emit", n=60_000), tool_call("b1", "emit", n=300)],
        [tool_call(f"c{i}", "emit", n=7_000) for i in range(3)],
        [tool_call("d0", "emit", n=100)],
    ]


@pytest.mark.asyncio
async def test_resume_gives_byte_identical_requests(
    server_factory: Callable[..., ScriptedMessagesServer], tmp_path: Path
) -> None:
    pipeline = Pipeline([ToolResultBudget(limit=20_000)])
    live_server = server_factory(scripted(*_turns()))
    live = new_agent(live_server, tmp_path / "live", tools=[emit], pipeline=pipeline)
    await live.run("go")

    # a second session stops after two model calls, then resumes from its transcript
    part_server = server_factory(scripted(*_turns()))
    part = new_agent(part_server, tmp_path / "part", tools=[emit], pipeline=pipeline)
    part.max_turns = 2
    await part.run("go")
    resumed = Agent.resume(
        tmp_path / "part" / "sess.jsonl",
        sdk_client(part_server.base_url),
        model="claude-test",
        pipeline=pipeline,
        root=tmp_path / "part" / "store",
        tools=[emit],
    )
    await resumed.run()

    def normalise(body: dict[str, Any], root: Path) -> str:
        return json.dumps(body["messages"]).replace(str(root), "<ROOT>")

    live_reqs = [normalise(b, tmp_path / "live") for b in live_server.requests]
    part_reqs = [normalise(b, tmp_path / "part") for b in part_server.requests]
    assert len(live_reqs) == len(part_reqs) == 5
    assert part_reqs == live_reqs
    assert "<persisted-output>" in live_reqs[-1]  # the budget really replaced something


@pytest.mark.asyncio
async def test_a_session_on_an_object_store_resumes_from_its_records(
    server_factory: Callable[..., ScriptedMessagesServer], tmp_path: Path
) -> None:
    """The library path of a fleet's agent: results and records on an object store
    (``SessionContext(store=..., transcript=...)``); another process resumes from the
    records alone (``Agent.resume_from``) and sends what an uninterrupted run sends."""
    pytest.importorskip("obstore", reason="the objectstore extra (obstore) is not installed")
    from obstore.store import MemoryStore

    from pipeline.store.sessions import open_session_state

    pipeline = Pipeline([ToolResultBudget(limit=20_000)])
    url = "memory:///agents"

    def agent_on(server: ScriptedMessagesServer, memory: MemoryStore, host: Path) -> Agent:
        storage = open_session_state(url, "sess", object_store=memory)
        ctx = SessionContext("sess", host, store=storage.store, transcript=storage.records)
        return Agent(
            sdk_client(server.base_url),
            model="claude-test",
            pipeline=pipeline,
            ctx=ctx,
            tools=[emit],
        )

    live_server = server_factory(scripted(*_turns()))
    await agent_on(live_server, MemoryStore(), tmp_path / "live").run("go")

    part_server, part_store = server_factory(scripted(*_turns())), MemoryStore()
    part = agent_on(part_server, part_store, tmp_path / "part")
    part.max_turns = 2
    await part.run("go")
    resumed = Agent.resume_from(
        open_session_state(url, "sess", object_store=part_store),
        sdk_client(part_server.base_url),
        model="claude-test",
        pipeline=pipeline,
        root=tmp_path / "elsewhere",  # a new host: nothing local carries over
        tools=[emit],
    )
    await resumed.run()

    live = [json.dumps(b["messages"]) for b in live_server.requests]
    part = [json.dumps(b["messages"]) for b in part_server.requests]
    assert len(live) == 5 and part == live
    big = next(
        b
        for m in part_server.requests[-1]["messages"]
        if isinstance(m["content"], list)
        for b in m["content"]
        if b.get("tool_use_id") == "b0"
    )["content"]
    uri = big.split("Full output saved to: ")[1].split("\n")[0]
    assert uri == "memory:///agents/sess/tool-results/b0.txt"
    # the read-back tool comes with an object store too, and reads the result by its URI
    readback = resumed.tools["read_persisted_output"]
    page = await readback.handler({"path": uri, "offset": 1, "limit": 1})
    assert page.startswith(MARK.strip())
    with pytest.raises(ValueError, match="no recorded messages"):
        Agent.resume_from(
            open_session_state(url, "other", object_store=part_store),
            sdk_client(part_server.base_url),
            model="claude-test",
            pipeline=pipeline,
        )


@pytest.mark.asyncio
async def test_resume_answers_tool_calls_a_crash_left_open(
    server_factory: Callable[..., ScriptedMessagesServer], tmp_path: Path
) -> None:
    log = tmp_path / "crashed.jsonl"
    writer = TranscriptWriter(log, "crashed")
    writer.append_messages(
        [
            Message.user("go"),
            Message.assistant([tool_call("x1", "emit", n=5)], message_id="msg_1", model="m"),
        ]
    )
    with log.open("a") as fh:
        fh.write('{"type": "user", "message": {"role": "us')  # torn by the crash
    server = server_factory(scripted())
    agent = Agent.resume(
        log,
        sdk_client(server.base_url),
        model="m",
        pipeline=Pipeline(default_stages()),
        root=tmp_path,
        tools=[emit],
    )
    await agent.run()
    sent = without_cache_control(server.requests[0]["messages"])
    assert sent[-1]["content"] == [
        {
            "type": "tool_result",
            "tool_use_id": "x1",
            "content": INTERRUPTED_RESULT,
            "is_error": True,
        }
    ]
    assert check_pairing(sent) == []
    reloaded = load_transcript(log, strict=False)
    # only the torn line is lost: the repair and the new turn were appended on a fresh line
    assert len(reloaded.problems) == 1
    assert [m.type for m in reloaded.messages] == ["user", "assistant", "user", "assistant"]
    assert reloaded.messages[2].content == sent[-1]["content"]


async def _observed_with(tmp_path: Path, *, pass_during_call: bool) -> tuple[int, int]:
    """One agent turn whose API call waits until (optionally) another pass has run on the
    agent's context; the turn's observed estimate and the request's length."""
    import threading

    from pipeline import TokenTracker
    from pipeline.testing import MemoryStore
    from tests.builders import assistant, results, tool_result, tool_use, user_text

    entered, release = threading.Event(), threading.Event()

    def script(body: dict[str, Any]) -> Reply:
        entered.set()
        release.wait(10)
        return Reply([{"type": "text", "text": "done"}])

    history = [user_text("start")]
    for t in range(2):  # parallel results over the budget: its output is a list it keeps
        history += [
            assistant(f"r{t}", tool_use(f"t{t}a"), tool_use(f"t{t}b")),
            results(tool_result(f"t{t}a", "a" * 4_000), tool_result(f"t{t}b", "b" * 4_000)),
        ]
    history.append(user_text("go on"))
    pipe = Pipeline([ToolResultBudget(limit=6_000)])
    ctx = SessionContext(
        "s", tmp_path / "store", store=MemoryStore(), token_tracker=TokenTracker("reference")
    )
    logs: list[Any] = []
    with ScriptedMessagesServer(script) as server:
        client = sdk_client(server.base_url)
        agent = Agent(
            client,
            model="claude-sonnet-4-6",
            pipeline=pipe,
            ctx=ctx,
            history=history,
            on_turn=logs.append,
            readback=False,
            cache=False,
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent.turn)
            while not entered.is_set():
                await anyio.sleep(0.01)
            if pass_during_call:  # say, a preview of the next request with a draft prompt
                await pipe.run([*agent.history, user_text("draft " + "x" * 20_000)], ctx)
            release.set()
    return logs[0].observation.estimate, len(logs[0].request)


@pytest.mark.anyio
async def test_a_pass_during_the_api_call_does_not_change_what_the_turn_observes(
    tmp_path: Path,
) -> None:
    """The tracker learns from the request the turn sent, even when another pass on the same
    context runs while the call is in flight (the stages bring their kept lists up to date in
    place: the turn must hold its own copy)."""
    alone = await _observed_with(tmp_path / "a", pass_during_call=False)
    during = await _observed_with(tmp_path / "b", pass_during_call=True)
    assert during == alone
