"""What the stages ask of a request, merged with what the client sent: the client's own
fields are never dropped (``pipeline.wire.request_fields``), through ``wrap`` and the proxy."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

from pipeline import Pipeline
from pipeline.dropin.wrap import wrap
from pipeline.testing import Reply, ScriptedMessagesServer
from pipeline.wire.request_fields import merge_betas, merge_edits, merge_request_fields
from stages import ServerSideMicrocompact, ToolResultBudget
from tests.sdk_support import sdk_client
from tests.wire_support import proxy

THINKING = {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}
CLEARING = ServerSideMicrocompact(trigger_tokens=30_000, keep=2).edit()


def test_the_clients_edits_stay_and_clear_thinking_goes_first() -> None:
    body = {"model": "m", "context_management": {"edits": [THINKING]}}
    extras = {"context_management": {"edits": [CLEARING]}}
    merged = merge_request_fields(body, extras)
    assert merged["context_management"] == {"edits": [THINKING, CLEARING]}
    assert body == {"model": "m", "context_management": {"edits": [THINKING]}}  # not changed
    # the stages' edit first in their list still lands after the client's clear_thinking
    assert merge_edits([], [CLEARING, THINKING]) == [THINKING, CLEARING]


def test_an_edit_the_client_sent_is_not_sent_twice_and_its_values_win() -> None:
    own = {**CLEARING, "keep": {"type": "tool_uses", "value": 9}}
    merged = merge_request_fields(
        {"context_management": {"edits": [own]}}, {"context_management": {"edits": [CLEARING]}}
    )
    assert merged["context_management"]["edits"] == [own]


def test_other_fields_the_client_sent_win_and_missing_ones_are_added() -> None:
    merged = merge_request_fields({"metadata": {"user_id": "u"}}, {"metadata": {}, "x": 1})
    assert merged == {"metadata": {"user_id": "u"}, "x": 1}


def test_a_null_client_value_is_taken_as_not_sent() -> None:
    extras = {"context_management": {"edits": [CLEARING]}}
    merged = merge_request_fields({"context_management": None}, extras)
    assert merged["context_management"] == {"edits": [CLEARING]}


@pytest.mark.parametrize("hostile", ["clear everything", {"edits": "all"}, 7, [CLEARING]])
def test_a_malformed_client_value_goes_as_sent(hostile: Any) -> None:
    merged = merge_request_fields(
        {"context_management": hostile}, {"context_management": {"edits": [CLEARING]}}
    )
    assert merged["context_management"] == hostile


def test_a_compaction_request_gets_no_context_management() -> None:
    """A client's own compaction request (``compaction``) cannot carry ``context_management``
    (the API refuses the two together): the stages' edits are not added to it; a ``null``
    ``compaction`` is no compaction request."""
    extras = {"context_management": {"edits": [CLEARING]}, "x": 1}
    asked = merge_request_fields({"compaction": {"type": "summarize"}}, extras)
    assert asked == {"compaction": {"type": "summarize"}, "x": 1}
    merged = merge_request_fields({"compaction": None}, extras)
    assert merged["context_management"] == {"edits": [CLEARING]}


def test_betas_are_a_union() -> None:
    assert merge_betas(" b-2 ,a-1,,", ["c-3", "a-1"]) == "a-1,b-2,c-3"
    assert merge_betas(None, ["z", "z"]) == "z"


def _reply(_body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "ok"}])


async def _call(client: Any) -> None:
    await client.beta.messages.create(
        model="claude-test",
        max_tokens=64,
        messages=[{"role": "user", "content": "hello"}],
        context_management={"edits": [THINKING]},
        betas=["interleaved-thinking-2025-05-14"],
    )


def _assert_both_sent(server: ScriptedMessagesServer) -> None:
    (body,), (headers,) = server.requests, server.request_headers
    assert body["context_management"]["edits"][0] == THINKING
    assert [e["type"] for e in body["context_management"]["edits"]] == [
        "clear_thinking_20251015",
        "clear_tool_uses_20250919",
    ]
    betas = headers["anthropic-beta"].split(",")
    assert "interleaved-thinking-2025-05-14" in betas
    assert "context-management-2025-06-27" in betas


def _pipeline() -> Pipeline:
    return Pipeline([ToolResultBudget(), ServerSideMicrocompact(trigger_tokens=30_000, keep=2)])


Calls = Callable[[Any], Awaitable[None]]


def _through_wrap(tmp_path: Path, calls: Calls) -> ScriptedMessagesServer:
    """The upstream that ``calls`` reached with a wrapped SDK client."""
    with ScriptedMessagesServer(_reply) as server:
        anyio.run(calls, wrap(sdk_client(server.base_url), root=tmp_path, pipeline=_pipeline))
    return server


def _through_proxy(tmp_path: Path, calls: Calls) -> ScriptedMessagesServer:
    """The upstream that ``calls`` reached with an SDK client pointed at the proxy."""

    async def through(url: str) -> None:
        async with sdk_client(url) as client:
            await calls(client)

    with (
        ScriptedMessagesServer(_reply) as server,
        proxy(server.base_url, tmp_path, _pipeline) as url,
    ):
        anyio.run(through, url)
    return server


def test_wrap_keeps_the_clients_edits(tmp_path: Path) -> None:
    _assert_both_sent(_through_wrap(tmp_path, _call))


def test_the_proxy_keeps_the_clients_edits(tmp_path: Path) -> None:
    _assert_both_sent(_through_proxy(tmp_path, _call))


# --------------------------------------------------------------------------------------------
# a message's own fields besides role and content
# --------------------------------------------------------------------------------------------

_LONG = "o" * 60_000
"""A tool output past the budget's 50K: its message goes on with new content."""


def _history(note: str | None) -> list[dict[str, Any]]:
    use = {"type": "tool_use", "id": "toolu_f1", "name": "Bash", "input": {"command": "ls"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_f1", "content": _LONG}
    first: dict[str, Any] = {"role": "user", "content": "go"}
    if note is not None:
        first["x_note"] = note
    return [
        first,
        {"role": "assistant", "content": [use], "x_turn": [1, {"k": None}]},
        {"role": "user", "content": [result], "x_flag": True},
    ]


async def _calls_with_fields(client: Any) -> None:
    history = _history("a")
    for note in ("a", "b", None):
        history = [*_history(note), *history[3:]]
        await client.messages.create(model="claude-test", max_tokens=8, messages=history)
        history += [
            {"role": "assistant", "content": "ok", "x_said": len(history)},
            {"role": "user", "content": "more"},
        ]


def _assert_fields_sent(server: ScriptedMessagesServer) -> None:
    assert len(server.requests) == 3
    for k, (body, note) in enumerate(zip(server.requests, ("a", "b", None), strict=True)):
        sent = body["messages"]
        assert sent[0].get("x_note") == note, k  # an edit of that field alone, and its removal
        assert sent[1]["x_turn"] == [1, {"k": None}], k
        # the budget replaced the output: a new message, with the client's field all the same
        assert sent[2]["x_flag"] is True, k
        assert "<persisted-output>" in sent[2]["content"][0]["content"], k
        said = [m.get("x_said") for m in sent[3:] if m["role"] == "assistant"]
        assert said == [3 + 2 * i for i in range(k)], k
        assert [list(m)[:2] for m in sent] == [["role", "content"]] * len(sent), k


def test_wrap_sends_a_message_s_own_fields_on(tmp_path: Path) -> None:
    _assert_fields_sent(_through_wrap(tmp_path, _calls_with_fields))


def test_the_proxy_sends_a_message_s_own_fields_on(tmp_path: Path) -> None:
    """A field of a message besides role and content (one the API adds later, or one it
    refuses: then it refuses the request, as it would without the proxy) goes on as the
    client sent it: on a message the stages left alone, on one they changed, and changed or
    taken off in a later request."""
    _assert_fields_sent(_through_proxy(tmp_path, _calls_with_fields))


def _typed(value: Any) -> list[dict[str, Any]]:
    use = {"type": "tool_use", "id": "toolu_n1", "name": "f", "input": {"a": value}}
    result = {"type": "tool_result", "tool_use_id": "toolu_n1", "content": "r"}
    return [
        {"role": "user", "content": "go", "x_n": value},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "more"}]},
    ]


def test_the_proxy_sends_what_json_tells_apart_that_python_holds_equal(tmp_path: Path) -> None:
    """``1``, ``true`` and ``1.0`` (and ``0.0`` and ``-0.0``) are equal to Python: an earlier
    message whose only change is one of them is still a changed message, sent as it now is
    (before, what was built for the old one went on)."""
    values: list[Any] = [1, True, 1.0, 1, 0.0, -0.0]

    async def calls(client: Any) -> None:
        for value in values:
            await client.messages.create(model="m", max_tokens=8, messages=_typed(value))

    sent = [body["messages"] for body in _through_proxy(tmp_path, calls).requests]
    for got, value in zip(sent, values, strict=True):
        for seen in (got[0]["x_n"], got[1]["content"][0]["input"]["a"]):
            assert type(seen) is type(value) and repr(seen) == repr(value), (seen, value)


def test_the_proxy_compares_a_request_parsed_again_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose every message was parsed again (here: a body the fast parser refuses,
    a ``NaN``, parsed whole each time) is compared with the last one message by message where
    it is placed, and not a second time when its records are made."""
    import pipeline.wire.same_values as same_values

    looked: list[int] = []
    compare = same_values.same_value

    def counted(a: Any, b: Any) -> bool:
        looked.append(1)
        return compare(a, b)

    monkeypatch.setattr(same_values, "same_value", counted)
    turns = [{"role": "user", "content": "go"}]
    with (
        ScriptedMessagesServer(_reply) as server,
        proxy(server.base_url, tmp_path, _pipeline) as url,
        httpx2.Client(timeout=30) as client,
    ):
        for k in range(4):
            body = json.dumps({"model": "m", "max_tokens": 8, "temperature": float("nan")})
            sent = json.dumps(turns)
            raw = body[:-1] + ', "messages": ' + sent + "}"
            looked.clear()
            response = client.post(
                f"{url}/v1/messages", content=raw, headers={"content-type": "application/json"}
            )
            assert response.status_code == 200, response.text
            assert len(looked) == (len(turns) - 2 if k else 0), k  # the last request's, once
            turns += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"{k}"}]
