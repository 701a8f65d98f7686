"""The proxy leaves a held conversation's long tool outputs in the request that carries them
again (:mod:`pipeline.wire.held_outputs`): what it sends upstream is the same, request by
request, as when it holds every output in memory; it reads an output back only from the
request being served; and it holds none under a stage that reads outputs again."""

from __future__ import annotations

import base64
import contextvars
import gc
import json
import random
import re
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx2
import pytest

from pipeline import Pipeline
from pipeline.testing import Reply, ScriptedMessagesServer
from pipeline.wire.deferred import DeferredText, resolved
from pipeline.wire.encoding import dumps_body
from pipeline.wire.held_outputs import (
    BODY,
    HOLD_AT,
    OutputNotCarried,
    hold_outputs,
    serving,
    serving_scope,
)
from pipeline.wire.source import Source
from stages import HistorySnip, Microcompact, ToolResultBudget, default_stages
from tests.builders import tool_result, tool_use
from tests.wire_support import proxy

_TENANT = re.compile(r"t-[0-9a-f]{20}")
SIZES = (40, 900, HOLD_AT, 3_000, 12_000, 60_000)
"""Output lengths: under and at the line, long, and past the budget's 50K per tool."""


def _reply(_body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "ok"}])


def _output(rng: random.Random, tid: str) -> Any:
    size = rng.choice(SIZES)
    text = f"[{tid}] " + "".join(rng.choice('abcdefgh \n"\\é') for _ in range(64)) * (size // 64)
    roll = rng.random()
    if roll < 0.1:  # a harness's reminder after the output
        return text + "\n<system-reminder>the file changed</system-reminder>"
    if roll < 0.18:  # an output given as blocks
        return [{"type": "text", "text": text}]
    if roll < 0.22:  # a character past U+FFFF, escaped by some clients
        return text + "\U0001f916"
    return text


def _text(rng: random.Random, tag: str) -> str:
    size = rng.choice(SIZES[:4])
    return f"[{tag}] " + "".join(rng.choice('ijkl \n"é') for _ in range(32)) * (size // 32)


def _png(rng: random.Random) -> str:
    """A base64 PNG of a random size, padded: its header is what the token estimate reads."""
    width, height = rng.randrange(1, 4000), rng.randrange(1, 4000)
    head = b"\x89PNG\r\n\x1a\n" + struct.pack(">I4sII", 13, b"IHDR", width, height)
    return base64.b64encode(head + b"\x00" * rng.choice((50, 600, 9_000))).decode()


def _round(rng: random.Random, tag: str, k: int) -> list[dict[str, Any]]:
    """A call and its results, with (at random) the other blocks whose long texts the proxy
    holds: a tool call's long input, the answer's text and thinking, an image, a user's text."""
    ids = [f"toolu_{tag}_{k:03d}_{j}" for j in range(rng.choice((1, 1, 2, 4)))]
    name = rng.choice(("Bash", "Read", "Grep"))
    results: list[dict[str, Any]] = [tool_result(t, _output(rng, t)) for t in ids]
    if rng.random() < 0.15:
        results.append({"type": "text", "text": "<system-reminder>todo list</system-reminder>"})
    if rng.random() < 0.2:
        results.append({"type": "text", "text": _text(rng, tag)})
    if rng.random() < 0.15:
        source = {"type": "base64", "media_type": "image/png", "data": _png(rng)}
        results.append({"type": "image", "source": source})
    calls: list[dict[str, Any]] = []
    if rng.random() < 0.2:
        thinking = _text(rng, tag + "t")
        calls.append({"type": "thinking", "thinking": thinking, "signature": "Eo" * 200})
    if rng.random() < 0.3:
        calls.append({"type": "text", "text": _text(rng, tag + "a")})
    for t in ids:
        long = rng.random() < 0.4
        calls.append(
            tool_use(t, name, command=_text(rng, t) if long else "ls", n=3, file_path="/x")
        )
    return [{"role": "assistant", "content": calls}, {"role": "user", "content": results}]


def sessions(seed: int, steps: int = 36) -> Iterator[bytes]:
    """Request bodies as clients send them (compact JSON): conversations that grow, retry a
    call, fork from an earlier request, rewind, edit an earlier message and move a cache
    marker to their last message, in a random order."""
    rng = random.Random(seed)
    live: list[list[dict[str, Any]]] = []
    seen: list[list[dict[str, Any]]] = []
    for step in range(steps):
        move = rng.random()
        if not live or move < 0.08:
            msgs: list[dict[str, Any]] = [{"role": "user", "content": f"task {seed}.{step}"}]
            live.append(msgs)
        msgs = rng.choice(live)
        if move < 0.55 or len(msgs) < 3:
            msgs += _round(rng, f"{seed}_{step}", len(msgs))
        elif move < 0.65:
            pass  # the same request again (a retry)
        elif move < 0.75 and seen:
            msgs = [*rng.choice(seen)[:-2], *_round(rng, f"f{seed}_{step}", step)]
            live.append(msgs)  # a fork of an earlier request
        elif move < 0.85:
            del msgs[-2:]  # a rewind
            msgs += _round(rng, f"r{seed}_{step}", step)
        else:
            at = rng.randrange(1, len(msgs) - 1)
            if msgs[at]["role"] == "user" and isinstance(msgs[at]["content"], list):
                content = [dict(b) for b in msgs[at]["content"]]
                content.append({"type": "text", "text": f"edited at {step}"})
                msgs[at] = {"role": "user", "content": content}
        seen.append(list(msgs))
        sent = [dict(m) for m in msgs]
        if rng.random() < 0.5 and isinstance(sent[-1]["content"], list):
            last = [dict(b) for b in sent[-1]["content"]]
            last[-1]["cache_control"] = {"type": "ephemeral"}
            sent[-1] = {**sent[-1], "content": last}
        body = {"model": "m", "max_tokens": 5, "messages": sent}
        yield json.dumps(body, ensure_ascii=rng.random() < 0.2, separators=(",", ":")).encode()


PIPELINES: dict[str, Callable[[], Pipeline]] = {
    "default": lambda: Pipeline(default_stages(context_window=60_000)),
    "clearing": lambda: Pipeline(
        [
            ToolResultBudget(limit=30_000),
            HistorySnip(context_window=40_000, keep_recent_rounds=2),
            Microcompact(keep=2, trigger_tokens=4_000, min_reclaim_tokens=200),
        ]
    ),
}


def _sent_upstream(
    tmp_path: Path, name: str, bodies: list[bytes], *, hold: bool
) -> tuple[list[str], int]:
    """What the upstream was sent for ``bodies``, each as JSON text; outputs read back."""
    reads = BODY.reads
    with ExitStack() as stack:
        upstream = stack.enter_context(ScriptedMessagesServer(_reply))
        url = stack.enter_context(
            proxy(upstream.base_url, tmp_path / name, PIPELINES[name], hold_outputs=hold)
        )
        with httpx2.Client(timeout=60) as client:
            for raw in bodies:
                answer = client.post(
                    f"{url}/v1/messages", content=raw, headers={"content-type": "application/json"}
                )
                assert answer.status_code == 200, answer.text
        # the store's place and its tenant's name (under each store's own secret) aside
        root = str(tmp_path / name)
        sent = [
            _TENANT.sub("t-*", json.dumps(b).replace(root, "<root>")) for b in upstream.requests
        ]
    return sent, BODY.reads - reads


@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("seed", range(3))
def test_the_proxy_sends_the_same_requests_holding_outputs_in_them_or_in_memory(
    tmp_path: Path, name: str, seed: int
) -> None:
    bodies = list(sessions(seed))
    held, _reads = _sent_upstream(tmp_path / "held", name, bodies, hold=True)
    kept, _ = _sent_upstream(tmp_path / "kept", name, bodies, hold=False)
    assert len(held) == len(kept) == len(bodies)
    for k, (a, b) in enumerate(zip(held, kept, strict=True)):
        assert a == b, f"request {k} differs"


def _grown(
    tmp_path: Path, pipeline: Callable[[], Pipeline], sizes: list[int]
) -> tuple[list[int], int, int]:
    """A conversation grown a round a call through the proxy, its outputs ``sizes`` long: the
    outputs read back by each call, and the outputs the proxy holds as handles and as text at
    the end."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    reads: list[int] = []
    tag = f"toolu_grown_{uuid.uuid4().hex[:8]}_"  # this call's blocks among the process's
    with ExitStack() as stack:
        upstream = stack.enter_context(ScriptedMessagesServer(_reply))
        url = stack.enter_context(proxy(upstream.base_url, tmp_path, pipeline))
        with httpx2.Client(timeout=60) as client:
            for k, size in enumerate(sizes):
                tid = f"{tag}{k:03d}"
                messages.append({"role": "assistant", "content": [tool_use(tid)]})
                messages.append({"role": "user", "content": [tool_result(tid, "y" * size)]})
                body = {"model": "m", "max_tokens": 5, "messages": messages}
                before = BODY.reads
                assert client.post(f"{url}/v1/messages", json=body).status_code == 200
                reads.append(BODY.reads - before)
        gc.collect()
        # the test's own: its client's messages and what the test server parsed
        last = {
            id(b)
            for body in [*upstream.requests, {"messages": messages}]
            for m in body["messages"]
            if type(m["content"]) is list
            for b in m["content"]
        }
        # through the content lists: a dict of strings alone is not tracked by gc
        found = {
            id(b): b
            for o in gc.get_objects()
            if type(o) is list
            for b in o
            if type(b) is dict
            and str(b.get("tool_use_id")).startswith(tag)
            and b.get("type") == "tool_result"
            and id(b) not in last
        }
        blocks = list(found.values())
    handles = sum(type(b.get("content")) is DeferredText for b in blocks)
    texts = sum(type(b.get("content")) is str and len(b["content"]) >= HOLD_AT for b in blocks)
    return reads, handles, texts


def test_a_growing_conversation_holds_its_outputs_and_reads_none_back(tmp_path: Path) -> None:
    """Call after call, the outputs already passed on are handles (the last request's a call
    later), and nothing reads them."""
    reads, handles, texts = _grown(tmp_path, PIPELINES["default"], [5_000] * 20)
    assert (handles, texts) == (19, 1)  # the last message's output waits a call
    assert sum(reads) == 0


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_what_a_call_reads_back_does_not_grow_with_the_conversation(
    tmp_path: Path, name: str
) -> None:
    """What the stages read again (microcompact's oldest kept result, the outputs after a
    snip's cut, which the writer writes again, and the rounds a snip weighs when it acts: the
    token estimator keeps a message's vector only while calls price it) is a few outputs a
    call, never the history: no more late in the conversation than early."""
    sizes = [random.Random(k).choice((2_000, 8_000, 20_000)) for k in range(90)]
    reads, handles, texts = _grown(tmp_path, PIPELINES[name], sizes)
    assert texts == 1 and handles > 0
    assert sum(reads) <= 3 * len(sizes) and max(reads) <= 30, reads
    assert max(reads[60:]) <= max(reads[30:60]) + 2, reads


def test_no_output_is_held_under_a_stage_that_reads_outputs_again(tmp_path: Path) -> None:
    stages = lambda: Pipeline(default_stages(incremental=False))  # noqa: E731
    reads, handles, texts = _grown(tmp_path, stages, [5_000] * 3)
    assert handles == 0 and texts >= 3 and sum(reads) == 0


def _parsed(raw: bytes) -> tuple[list[Any], Source]:
    from pipeline.wire.body_reader import BodyReader

    _body, _fast, source = BodyReader().read_source(raw)
    assert source is not None
    return list(source.messages), source


def _body_of(*outputs: str) -> bytes:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for k, text in enumerate(outputs):
        messages.append({"role": "assistant", "content": [tool_use(f"t{k}")]})
        messages.append({"role": "user", "content": [tool_result(f"t{k}", text)]})
    # the last two wait a call
    messages += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "ok"}]
    return dumps_body({"model": "m", "messages": messages})


def test_a_held_output_is_read_from_the_request_being_served_only() -> None:
    """Read where the body being served carries it, it is its text; where another body is
    served, or none, it is :class:`OutputNotCarried`, never another output."""
    text = "é" * 1_500 + '\n"quoted"\\'
    raw = _body_of("short", text)
    messages, source = _parsed(raw)
    assert hold_outputs(source, 0) == 1
    handle = messages[4]["content"][0]["content"]
    assert type(handle) is DeferredText and type(messages[2]["content"][0]["content"]) is str

    def read_in(body: bytes | None) -> Any:
        def run() -> Any:
            with serving_scope():
                if body is not None:
                    serving(body)
                return resolved(handle)

        return contextvars.copy_context().run(run)

    assert read_in(raw) == text
    assert read_in(raw + b" ") == text  # the same bytes at the same place
    other = _body_of("short", "ë" * 1_500 + '\n"quoted"\\')  # the same length, other text
    for body in (other, _body_of("short"), None):
        with pytest.raises(OutputNotCarried, match="'t1' is not in the request being served"):
            read_in(body)


def test_the_body_served_is_let_go_of_when_its_request_ends() -> None:
    raw = _body_of("x" * 2_000)
    messages, source = _parsed(raw)
    hold_outputs(source, 0)
    handle = messages[2]["content"][0]["content"]

    def run() -> contextvars.Context:
        with serving_scope():
            serving(raw)
            assert resolved(handle) == "x" * 2_000
            kept = contextvars.copy_context()  # what a timer's callback would hold
        return kept

    kept = contextvars.copy_context().run(run)
    with pytest.raises(OutputNotCarried, match="no request is being served"):
        kept.run(resolved, handle)


def test_short_outputs_and_other_blocks_stay_as_they_are() -> None:
    text = "z" * (HOLD_AT - 1)
    raw = _body_of(text)
    messages, source = _parsed(raw)
    assert hold_outputs(source, 0) == 0
    assert messages[2]["content"][0]["content"] == text


PREVIEW = (
    "<persisted-output>\nOutput too large (40.0KB). Full output saved to: /tmp/x/toolu_p_000.txt"
    "\n\nPreview (first 2KB):\n" + "line of output\n" * 100 + "...\n</persisted-output>"
)


def _compact(messages: list[Any]) -> bytes:
    body = {"model": "m", "max_tokens": 5, "messages": messages}
    return json.dumps(body, separators=(",", ":")).encode()


def test_a_held_preview_a_client_sent_is_never_cleared_over(tmp_path: Path) -> None:
    """A ``<persisted-output>`` preview long enough to be held is still a preview to
    microcompact when it re-applies its clears after an edit: kept, as when it is in memory."""
    assert len(PREVIEW) >= HOLD_AT
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for k in range(6):
        tid = f"toolu_p_{k:03d}"
        msgs.append({"role": "assistant", "content": [tool_use(tid)]})
        msgs.append({"role": "user", "content": [tool_result(tid, f"{k} " + "y" * 5_000)]})
    bodies = [_compact(msgs[:k]) for k in (3, 5, 7, 9, 11, 13)]
    edited = json.loads(json.dumps(msgs))
    edited[2]["content"][0]["content"] = PREVIEW  # the client's own preview now
    bodies.append(_compact(edited))
    rewound = edited[:-2]
    for k in (50, 51):
        tid = f"toolu_q_{k:03d}"
        rewound.append({"role": "assistant", "content": [tool_use(tid)]})
        rewound.append({"role": "user", "content": [tool_result(tid, "z" * 5_000)]})
        bodies.append(_compact(rewound))
    held, _ = _sent_upstream(tmp_path / "held", "clearing", bodies, hold=True)
    kept, _ = _sent_upstream(tmp_path / "kept", "clearing", bodies, hold=False)
    assert held == kept
    last = json.loads(held[-1])["messages"][2]["content"][0]["content"]
    assert last == PREVIEW


def test_a_messages_request_to_another_path_leaves_no_body_behind(tmp_path: Path) -> None:
    """A base URL with a path (``/anthropic/v1/messages``) is served by the same handler: the
    body it names is let go of when the request ends, as on ``/v1/messages``."""
    from pipeline.wire import held_outputs

    def bodies_named() -> int:
        gc.collect()
        return sum(
            1 for o in gc.get_objects() if type(o) is held_outputs._Serving and o.raw is not None
        )

    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    with ExitStack() as stack:
        upstream = stack.enter_context(ScriptedMessagesServer(_reply))
        url = stack.enter_context(proxy(upstream.base_url, tmp_path, PIPELINES["default"]))
        with httpx2.Client(timeout=60) as client:
            for k in range(4):
                tid = f"toolu_{k:03d}"
                messages.append({"role": "assistant", "content": [tool_use(tid)]})
                messages.append({"role": "user", "content": [tool_result(tid, "y" * 50_000)]})
                for path in ("/anthropic/v1/messages", "/v1/messages/", "/v1/messages"):
                    answer = client.post(
                        url + path, json={"model": "m", "max_tokens": 5, "messages": messages}
                    )
                    assert answer.status_code == 200
        # while the proxy serves on (its work after an answer may still hold a body a while)
        deadline = time.monotonic() + 10
        while bodies_named() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bodies_named() == 0


def test_a_body_is_served_only_within_a_scope() -> None:
    with pytest.raises(RuntimeError, match="outside a serving_scope"):
        contextvars.copy_context().run(serving, b"{}")


def test_a_held_output_counts_its_characters_without_being_read() -> None:
    """The request's visible text (what its token estimate goes by) is the same held or not."""
    from pipeline.wire.chars import request_chars

    raw = _body_of("short", "w" * 3_000)
    messages, source = _parsed(raw)
    before = request_chars(messages)
    reads = BODY.reads
    assert hold_outputs(source, 0) == 1
    assert request_chars(messages) == before and BODY.reads == reads


def _every_kind(rng: random.Random) -> list[dict[str, Any]]:
    """Messages holding a long text of every kind the proxy leaves in the request."""
    long = 'naïve \\ "text"\n' * 40
    return [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "think " + long, "signature": "Eo" * 300},
                {"type": "text", "text": "answer " + long},
                tool_use("t0", "Write", file_path="/a", content="file " + long, n=2),
            ],
        },
        {
            "role": "user",
            "content": [
                tool_result("t0", "out " + long),
                {"type": "text", "text": "user " + long},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": _png(rng)},
                },
                {
                    "type": "document",
                    "source": {
                        "type": "base64",
                        "media_type": "application/pdf",
                        "data": "JVBE" * 100,
                    },
                },
            ],
        },
        {"role": "assistant", "content": "done"},  # the last two wait a call
        {"role": "user", "content": "ok"},
    ]


def test_every_reader_of_a_held_text_reads_what_it_would_in_memory() -> None:
    """The proxy's readers of a message's texts (token features and the rough estimate, the
    visible characters, the digests, the writer's encoding) give for a message whose long
    texts are held what they give for it in memory."""
    from pipeline.messages import Message
    from pipeline.tokens.features import content_vector
    from pipeline.tokens.priors import FEATURES
    from pipeline.tokens.reference import rough_tokens_for_messages
    from pipeline.wire.chars import param_chars
    from pipeline.wire.digests import message_digest
    from pipeline.wire.encoding import fast_encode

    messages = _every_kind(random.Random(3))
    raw = dumps_body({"model": "m", "messages": messages})
    parsed, source = _parsed(raw)
    assert hold_outputs(source, 0) == 8
    weights = [1.0] * len(FEATURES)
    with serving_scope():
        serving(raw)
        for held, kept in zip(parsed[1:3], messages[1:3], strict=True):
            assert held != kept  # handles in it
            a, b = Message.from_param(held), Message.from_param(kept)
            assert content_vector(a, weights).data == content_vector(b, weights).data
            assert rough_tokens_for_messages([a]) == rough_tokens_for_messages([b])
            assert message_digest(held) == message_digest(kept)
            assert fast_encode(held) == fast_encode(kept)
        # a held tool input counts its characters and quotes, not its escapes: not read back
        reads = BODY.reads
        assert param_chars(parsed[2]) == param_chars(messages[2])
        assert abs(param_chars(parsed[1]) - param_chars(messages[1])) <= long_escapes(messages)
        assert BODY.reads == reads


def long_escapes(messages: list[dict[str, Any]]) -> int:
    """What repr adds to a tool input's long value: one per escaped character."""
    value = messages[1]["content"][2]["input"]["content"]
    return len(repr(value)) - len(value) - 2


def test_a_held_text_of_another_block_is_never_read() -> None:
    """A text handle checks its place (block, path), its length and its CRC: the bytes of
    another message, or of this one with another text there, are :class:`OutputNotCarried`."""
    messages = _every_kind(random.Random(4))
    raw = dumps_body({"model": "m", "messages": messages})
    parsed, source = _parsed(raw)
    hold_outputs(source, 0)
    handle = parsed[1]["content"][1]["text"]
    assert type(handle) is DeferredText and handle.path == ("text",)
    changed = json.loads(json.dumps(messages))
    changed[1]["content"][1]["text"] = changed[1]["content"][1]["text"].replace("a", "b")
    with serving_scope():
        serving(raw)
        assert str(handle) == messages[1]["content"][1]["text"]
        serving(dumps_body({"model": "m", "messages": changed}))
        with pytest.raises(OutputNotCarried, match="text of block 1"):
            handle.read()


def test_a_growing_conversation_reads_none_of_its_held_texts_back(tmp_path: Path) -> None:
    """Rounds with every kind of long text, call after call under the default stages (none of
    which acts on so short a history): all held (the last two messages' a call later), none
    read back."""
    rng = random.Random(5)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    reads = 0
    with ExitStack() as stack:
        upstream = stack.enter_context(ScriptedMessagesServer(_reply))
        url = stack.enter_context(
            proxy(upstream.base_url, tmp_path, lambda: Pipeline(default_stages()))
        )
        with httpx2.Client(timeout=60) as client:
            for k in range(12):
                kinds = _every_kind(rng)[1:3]
                tid = f"toolu_every_{uuid.uuid4().hex[:8]}_{k}"
                kinds[0]["content"][2]["id"] = kinds[1]["content"][0]["tool_use_id"] = tid
                messages += kinds
                body = {"model": "m", "max_tokens": 5, "messages": messages}
                before = BODY.reads
                assert client.post(f"{url}/v1/messages", json=body).status_code == 200
                reads += BODY.reads - before
            gc.collect()
            handles = [o for o in gc.get_objects() if type(o) is DeferredText]
    assert reads == 0
    # seven or eight texts a round (an image may be short), the last round's a call later
    assert len({(h.offset, h.block, h.path) for h in handles}) >= 7 * 11


def test_a_held_input_is_checked_by_its_calls_id_whatever_else_the_block_holds() -> None:
    long = "x" * 300
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            # a stray "tool_use_id" on a call: its input is checked by the call's own "id"
            "content": [{**tool_use("t1", command=long), "tool_use_id": "zz"}],
        },
        {"role": "user", "content": [tool_result("t1", "ok")]},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    raw = dumps_body({"model": "m", "messages": messages})
    parsed, source = _parsed(raw)
    assert hold_outputs(source, 0) == 1
    with serving_scope():
        serving(raw)
        assert str(parsed[1]["content"][0]["input"]["command"]) == long


def test_a_long_input_name_is_not_kept_once_its_handle_is_gone() -> None:
    """The shared paths of input names are a few short ones: a client's long name lives as
    long as its handle."""
    from pipeline.wire import held_outputs

    name = "n" * 5_000
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "X", "input": {name: "v" * 300}}],
        },
        {"role": "user", "content": [tool_result("t", "ok")]},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    _parsed_messages, source = _parsed(dumps_body({"model": "m", "messages": messages}))
    assert hold_outputs(source, 0) == 1
    assert name not in held_outputs._INPUT_PATHS
    assert (
        "command" in held_outputs._input_path("command") and "command" in held_outputs._INPUT_PATHS
    )


def test_a_handle_keeps_its_place_in_one_int() -> None:
    """A handle is what a held conversation keeps for every long text: its offset, length,
    size and CRC-32 in one int, read back as they were given (each its own int beside the
    handle cost ~75 bytes more a handle); values past what it can hold are refused."""
    import tracemalloc

    source = object()
    given = [(10**12 + 7 * k, 2_900 + k, 2_800 + k, 2**32 - 1 - k) for k in range(5_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        handles = [
            DeferredText(source, o, n, 0, "toolu_x", c, crc)  # type: ignore[arg-type]
            for o, n, c, crc in given
        ]
        each = (tracemalloc.get_traced_memory()[0] - before) / len(given)
    finally:
        tracemalloc.stop()
    assert each < 140
    assert [(h.offset, h.length, h.chars, h.crc) for h in handles] == given
    for bad in ((-1, 1, 1, 0), (1 << 48, 1, 1, 0), (0, 1, 1 << 48, 0), (0, 1, 1, 1 << 32)):
        with pytest.raises(ValueError, match="deferred text"):
            DeferredText(source, bad[0], bad[1], 0, "t", bad[2], bad[3])  # type: ignore[arg-type]
