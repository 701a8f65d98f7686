"""The wire-level adapter: a client that re-sends its own history gets the budget, the same
decisions on every call, and the same decisions in a new process."""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

from pipeline import Message, Pipeline, ToolPolicies, to_api
from pipeline.dropin import observing as observing_module
from pipeline.dropin.adapter import DECISIONS_FILE, WireSession
from pipeline.dropin.conversations import conversation_hint
from pipeline.store.sessions import SessionStates
from pipeline.testing import QuietLogger
from stages import ToolResultBudget, default_stages

LIMIT = 200_000


class Client:
    """A client loop as an SDK user writes it: its own history, sent whole every call, with
    its tools' outputs as they came (it never sees what the adapter sent)."""

    def __init__(self) -> None:
        self.params: list[dict[str, Any]] = [{"role": "user", "content": "fix the failing jobs"}]
        self.turn = 0

    def answer(self) -> tuple[str, dict[str, int]]:
        """The model's reply to the last request: parallel tool calls, then their results."""
        n = 3 + self.turn % 5
        ids = [f"toolu_{self.turn:02d}_{i}" for i in range(n)]
        self.params.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": t, "name": "get_log", "input": {"job": t}}
                    for t in ids
                ],
            }
        )
        self.params.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": t,
                        "content": f"[{t}]\n" + "log line\n" * (4_000 + 500 * i),
                    }
                    for i, t in enumerate(ids)
                ],
            }
        )
        self.turn += 1
        usage = {"input_tokens": 10 + self.turn, "output_tokens": 50}
        return f"msg_{self.turn:04d}", usage


def _session(root: Path, pipeline: Pipeline | None = None) -> WireSession:
    return WireSession(
        "conv-1",
        root,
        pipeline or Pipeline([ToolResultBudget(LIMIT)]),
        tool_policies=ToolPolicies.claude_code(),
        logger=QuietLogger(),
    )


async def _run(
    root: Path, calls: int, restart_at: int | None = None, small_window: bool = False
) -> list[str]:
    def pipeline() -> Pipeline:
        # a window small enough that history snip acts on the token estimate
        return Pipeline(default_stages(context_window=60_000)) if small_window else None

    client, session = Client(), _session(root, pipeline())
    sent: list[str] = []
    for call in range(calls):
        if call == restart_at:
            session = _session(root, pipeline())  # a new process: only the disk is left
        request = await session.prepare(client.params)
        sent.append(json.dumps(request))
        response_id, usage = client.answer()
        usage["input_tokens"] = len(sent[-1]) // 3  # denser than any estimate guesses
        session.observe(response_id, usage, model="claude-test")
    return sent


def _visible(result: dict[str, Any]) -> int:
    content = result["content"]
    return len(content) if isinstance(content, str) else 0


def test_a_resending_client_gets_the_budget_and_a_stable_prefix(tmp_path: Path) -> None:
    sent = [json.loads(r) for r in anyio.run(_run, tmp_path, 24)]
    persisted = 0
    for k, request in enumerate(sent):
        last = request[-1]["content"]
        if isinstance(last, list):
            assert sum(_visible(b) for b in last) <= LIMIT, k
            persisted += sum(str(b["content"]).startswith("<persisted-output>") for b in last)
        if k:
            # everything sent before is sent again, byte for byte
            before = sent[k - 1]
            assert json.dumps(request[: len(before)]) == json.dumps(before), k
    assert persisted > 10
    files = list((tmp_path / "conv-1" / "tool-results").iterdir())
    assert len(files) == persisted  # each persisted once, re-applied after


@pytest.mark.parametrize("small_window", [False, True])
def test_a_new_process_continues_with_the_same_bytes(tmp_path: Path, small_window: bool) -> None:
    live = anyio.run(_run, tmp_path / "a", 20, None, small_window)
    restarted = anyio.run(_run, tmp_path / "b", 20, 12, small_window)
    same_root = [r.replace(str(tmp_path / "a"), str(tmp_path / "b")) for r in live]
    assert restarted == same_root
    assert (tmp_path / "b" / "conv-1" / DECISIONS_FILE).exists()
    if small_window:  # the stages acted, before and after the restart
        assert "History snipped" in restarted[10] and "History snipped" in restarted[-1]


def test_unchanged_messages_are_the_same_records(tmp_path: Path) -> None:
    async def run() -> None:
        client, session = Client(), _session(tmp_path)
        await session.prepare(client.params)
        client.answer()
        first = list(session._records)
        # the client sends new objects (parsed JSON) that are equal: same records
        await session.prepare(json.loads(json.dumps(client.params)))
        assert all(a is b for a, b in zip(first, session._records, strict=False))
        assert len(session._records) == len(first) + 2

    anyio.run(run)


def test_the_chain_a_session_keeps_is_one_list_for_its_call_and_its_records(
    tmp_path: Path,
) -> None:
    """The digests of the last request's messages are one list for the session, the call
    prepared and, once its response is recorded, what the records hold (each copy was 8 bytes
    a message more for every conversation held); a later request gets a list of its own, so
    the call prepared before it keeps the digests it was prepared with."""

    async def run() -> None:
        client, session = Client(), _session(tmp_path)
        for _ in range(3):
            await session.prepare(client.params)
            call = session.last_call
            assert call is not None and call.chain is session.chain
            response_id, usage = client.answer()
            await session.observe_async(response_id, usage, "m", call=call)
            assert session._disk_chain is session.chain
        before = session.chain
        kept = list(before)
        await session.prepare(client.params)
        assert session.chain is not before and before == kept  # the call's list unchanged

    anyio.run(run)


def test_an_answer_the_session_did_not_observe_is_named_by_its_place(tmp_path: Path) -> None:
    """A history that came before the session (a proxy restarted, a client that kept its
    own): each answer's response id is its record's name -- the same one string, unique to
    its place -- and the one answer the session observed keeps the id it came with."""

    async def run() -> None:
        client, session = Client(), _session(tmp_path)
        for _ in range(3):
            client.answer()
        await session.prepare(client.params)
        answers = [r for r in session._records if r.type == "assistant"]
        assert len(answers) == 3
        assert all(r.message_id is r.uuid for r in answers)
        assert len({r.message_id for r in answers}) == 3
        response_id, usage = client.answer()
        session.observe(response_id, usage, model="claude-test")
        await session.prepare(client.params)
        assert session._records[-2].message_id == response_id
        assert [r.message_id for r in session._records if r.type == "assistant"][:3] == [
            r.uuid for r in answers
        ]

    anyio.run(run)


class _Family:
    """A family's other conversations, as a session asks them: how it asked."""

    def __init__(self, alone: bool) -> None:
        self.lone, self.asked = alone, list[set[str]]()

    def __call__(self, keys: Any) -> tuple[list[Any], set[str]]:
        self.asked.append(set(keys))
        return [], set(keys)

    def alone(self) -> bool:
        return self.lone


@pytest.mark.parametrize("alone", [True, False])
def test_results_answered_before_the_session_are_asked_of_the_family_only_if_it_has_others(
    tmp_path: Path, alone: bool
) -> None:
    """Results the model answered before this session saw them: the family's other
    conversations are asked how each was sent (in a worker thread) -- unless there is none,
    and either way each is recorded as sent whole."""

    async def run() -> tuple[list[set[str]], set[str]]:
        client, session = Client(), _session(tmp_path)
        family = session.elsewhere = _Family(alone)
        for _ in range(2):
            client.answer()
        client.params.append({"role": "assistant", "content": "done"})
        client.params.append({"role": "user", "content": "thanks"})
        await session.prepare(client.params)
        return family.asked, set(session.ctx.replacement_state.seen_ids)

    asked, seen = anyio.run(run)
    keys = {k for k in seen if k.startswith("toolu_")}
    assert len(keys) == 3 + 4  # every result of the two answered calls
    assert asked == ([] if alone else [keys])


@pytest.mark.parametrize(
    "bad",
    [[1], [{"role": "system", "content": "x"}], [{"role": "user", "content": 5}]],
)
def test_a_malformed_request_is_a_clear_error(tmp_path: Path, bad: list[Any]) -> None:
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        anyio.run(_session(tmp_path).prepare, bad)


def test_the_hint_a_request_carries() -> None:
    body = {"system": "you help", "messages": [{"role": "user", "content": "hi"}]}
    assert conversation_hint(body) == ""
    session = "de804c2f-1e20-4494-bd5b-ba955b3f60f1"
    user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": session})
    main = {**body, "metadata": {"user_id": user_id}}
    assert conversation_hint(main) == f"cc-{session}"
    legacy = {**body, "metadata": {"user_id": f"user_ab12_account_x_session_{session}"}}
    assert conversation_hint(legacy) == conversation_hint(main)
    assert conversation_hint(main, headers={"X-Sluicegate-Session": "mine"}) == "mine"
    given = conversation_hint(main, explicit="given", headers={"x-sluicegate-session": "x"})
    assert given == "given"
    forged = {**body, "metadata": {"user_id": json.dumps({"session_id": "../../etc"})}}
    assert conversation_hint(forged) == ""  # not a session id: no hint
    with pytest.raises(ValueError):
        conversation_hint(body, explicit="../../etc")
    with pytest.raises(ValueError):
        conversation_hint(body, headers={"x-sluicegate-session": "a/b"})


def test_converters_between_sdk_params_responses_and_records() -> None:
    import anthropic

    response = anthropic.types.Message.model_validate(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-test",
            "content": [{"type": "tool_use", "id": "t1", "name": "x", "input": {"a": 1}}],
            "stop_reason": "tool_use",
            "stop_sequence": None,
            "usage": {"input_tokens": 7, "output_tokens": 3},
        }
    )
    record = Message.from_response(response)
    assert (record.type, record.message_id, record.model) == ("assistant", "msg_1", "claude-test")
    assert record.content == [{"type": "tool_use", "id": "t1", "name": "x", "input": {"a": 1}}]
    assert record.usage is not None and record.usage.input_side == 7
    param = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
    }
    back = Message.from_param(param)
    assert back.type == "user" and back.content is param["content"]
    assert to_api([Message.user("go"), record, back])[1:] == [
        {"role": "assistant", "content": record.content},
        param,
    ]
    with pytest.raises(ValueError, match="role"):
        Message.from_param({"role": "system", "content": "x"})


@pytest.mark.parametrize("when", ["settle", "next pass"])
def test_usage_learned_after_the_response_leaves_the_tracker_as_learning_at_once(
    tmp_path: Path, when: str
) -> None:
    """``observe_async(defer=True)`` leaves the token tracker and the records as they were;
    both catch up in ``settle()`` or first thing in the next pass, and end as they would have
    at once: the same calibration, the same records in the same order -- also when the next
    request's system prompt is another (the last response is learned from under its own)."""

    async def run(root: Path, defer: bool) -> dict[str, Any]:
        # as the proxy opens it: appends written at once, made durable by settle()
        storage = SessionStates(root, fsync_each=False).open("s")
        session = await WireSession.open("s", root, Pipeline(default_stages()), storage=storage)
        tracker = session.ctx.token_tracker
        messages: list[dict[str, Any]] = [{"role": "user", "content": "start " * 50}]
        for k in range(5):
            system = "You are terse. " * (1 if k < 3 else 400)
            body = {"model": "m", "system": system, "messages": messages}
            _, call = await session.prepare_call(body)
            usage = {
                "input_tokens": 120 + 700 * k + 13 * k * k + 1500 * (k >= 3),
                "output_tokens": 9,
            }
            before, written = tracker.state_dict(), _records_of(root)
            await session.observe_async(f"msg_{k}", usage, "m", call=call, defer=defer)
            if defer:
                assert (tracker.state_dict(), _records_of(root)) == (before, written)  # not yet
                if when == "settle":
                    await session.settle()
                    assert tracker.state_dict() != before
                    assert len(_records_of(root)) > len(written)
            tool = f"toolu_{k:02d}"  # a result the budget decides on (and records) next pass
            messages = [
                *messages,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": tool, "name": "run", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": tool, "content": "line\n" * 60 * k}
                    ],
                },
            ]
        await session.prepare_call({"model": "m", "system": system, "messages": messages})
        return {"tracker": tracker.state_dict(), "records": _records_of(root)}

    at_once = anyio.run(run, tmp_path / "a", False)
    later = anyio.run(run, tmp_path / "b", True)
    assert later == at_once
    assert at_once["tracker"]["errors"]  # it did learn: each anchored call's error is kept
    kinds = [json.loads(r).get("stage") for r in at_once["records"]]
    assert kinds.count("wire_session.response") == 5
    assert kinds.count("tool_result_budget") >= 3  # the budget's, in among them


def test_responses_observed_at_once_and_deferred_are_each_learned_from(tmp_path: Path) -> None:
    """Two responses of one conversation observed at the same time with ``defer`` on a store
    whose appends wait (each made durable: written in a worker thread) are both learned from,
    in order, as observing each at once learns."""

    async def run(root: Path, defer: bool) -> dict[str, Any]:
        storage = SessionStates(root, fsync_each=True).open("s")
        session = await WireSession.open("s", root, Pipeline(default_stages()), storage=storage)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "start " * 50}]
        _, one = await session.prepare_call({"model": "m", "messages": messages})
        _, two = await session.prepare_call({"model": "m", "messages": messages})  # a retry
        async with anyio.create_task_group() as tg:
            for call, tokens in ((one, 111), (two, 222)):
                usage = {"input_tokens": tokens, "output_tokens": 1}
                observe = partial(session.observe_async, call=call, defer=defer)
                tg.start_soon(observe, f"msg_{tokens}", usage, "m")
        await session.settle()
        return session.ctx.token_tracker.state_dict()

    at_once = anyio.run(run, tmp_path / "a", False)
    assert anyio.run(run, tmp_path / "b", True) == at_once


def _records_of(root: Path) -> list[str]:
    """Every record line under ``root``, without the parts a process makes its own (times)."""
    lines = [line for f in sorted(root.rglob("*.jsonl")) for line in f.read_text().splitlines()]
    return [re.sub(r'"timestamp":"[^"]*"', "", line) for line in lines]


def test_a_pass_waits_for_an_answer_its_client_already_has(tmp_path: Path) -> None:
    """The proxy reads a JSON answer once its client has it (``answer_out``): the client's
    next request may come first. Its pass waits until the answer is observed
    (``answer_read``), and then knows the answer's id and usage."""

    async def run() -> None:
        storage = SessionStates(tmp_path, fsync_each=False).open("s")
        session = await WireSession.open("s", tmp_path, Pipeline(default_stages()), storage=storage)
        first: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
        _, call = await session.prepare_call({"model": "m", "messages": first})
        token = session.answer_out()
        after = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
        passed = anyio.Event()

        async def next_request() -> None:
            await session.prepare_call({"model": "m", "messages": after})
            passed.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(next_request)
            await anyio.sleep(0.05)
            assert not passed.is_set()  # it waits for the answer
            usage = {"input_tokens": 40, "output_tokens": 2}
            await session.observe_async("msg_answer", usage, "m", call=call, defer=True)
            session.answer_read(token)
        [answer] = [m for m in session._records if m.type == "assistant"]
        assert answer.message_id == "msg_answer" and answer.usage is not None

    anyio.run(run)


def test_a_pass_waits_for_an_answer_no_longer_than_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer told of and never read (nothing in the proxy leaves one so: the bound is a
    guard) holds the next pass up for ``ANSWER_WAIT`` once: the pass then goes on without
    it, later passes do not wait for it again, the conversation may be let go, and the
    answer's reading, should it come after all, changes nothing."""
    monkeypatch.setattr(observing_module, "ANSWER_WAIT", 0.3)

    async def run() -> tuple[float, float, bool]:
        storage = SessionStates(tmp_path, fsync_each=False).open("s")
        session = await WireSession.open("s", tmp_path, Pipeline(default_stages()), storage=storage)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
        await session.prepare_call({"model": "m", "messages": messages})
        token = session.answer_out()
        took = []
        for k in range(2):
            messages = [
                *messages,
                {"role": "assistant", "content": f"ok {k}"},
                {"role": "user", "content": "go"},
            ]
            started = anyio.current_time()
            with anyio.fail_after(5):
                await session.prepare_call({"model": "m", "messages": messages})
            took.append(anyio.current_time() - started)
        session.answer_read(token)  # late: nothing waits for it
        return took[0], took[1], session.answers_out

    first, second, still_out = anyio.run(run)
    assert 0.3 <= first < 0.55  # one wait, not one per step of the pass
    assert second < 0.2 and not still_out


@pytest.mark.parametrize(("fsync_each", "waits"), [(False, True), (True, False)])
def test_a_response_record_waits_for_the_client_only_where_appends_are_made_durable_later(
    tmp_path: Path, fsync_each: bool, waits: bool
) -> None:
    """``records_wait``: the proxy writes a response's record (and reads a JSON answer) once
    its client has the response only on a local store whose appends are made durable later;
    with ``fsync_each`` every record is durable before the proxy goes on, the answer's too."""

    async def run() -> bool:
        storage = SessionStates(tmp_path, fsync_each=fsync_each).open("s")
        session = await WireSession.open("s", tmp_path, Pipeline(default_stages()), storage=storage)
        return session.records_wait

    assert anyio.run(run) is waits
