"""The proxy's request path does only what a request needs: records written before it goes on,
made durable after the response has gone by (the calls that end together in one group);
request bodies read and written by the fast JSON codec, with the standard library's behaviour
wherever the two would differ."""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest

from pipeline import Pipeline
from pipeline.dropin.conversations import SESSION_HEADER as SESSION
from pipeline.dropin.session_log import RESPONSE_RECORD
from pipeline.testing import Reply, ScriptedMessagesServer
from pipeline.transcript.read import load_transcript
from pipeline.transcript.writer import TranscriptPathError, TranscriptWriter
from pipeline.wire.encoding import dumps_body, loads_body
from stages import default_stages
from tests.wire_support import proxy


def _ok(_body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "ok"}])


def _conversation(size: int) -> list[dict[str, Any]]:
    call = {"type": "tool_use", "id": "t1", "name": "x", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "y" * size}
    return [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]


def test_no_fsync_before_the_client_has_its_response(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fsync of what each call writes (its records, the token calibration) waits until
    the client holds the response: one on the request's path would wait in vain (the client
    is still waiting) and be seen so. (A persisted result's file, and the store's secret made
    once, are durable before the request that names them goes.)"""
    answered = threading.Event()
    seen: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if "decisions" in name or "calibration" in name:  # what every call writes
            seen.append(answered.wait(3))  # the response first, or this fsync held it up
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with (
        ScriptedMessagesServer(_ok) as up,
        proxy(up.base_url, tmp_path, lambda: Pipeline(default_stages())) as url,
    ):
        client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
        for size in (60_000, 100):  # one persists its result, one keeps it
            answered.clear()
            client.messages.create(model="m", max_tokens=5, messages=_conversation(size))  # type: ignore[arg-type]
            answered.set()
            client = anthropic.Anthropic(
                base_url=url,
                api_key="k",
                max_retries=0,
                default_headers={"x-sluicegate-session": "b"},
            )
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert seen, "the calls were never made durable"
    assert all(seen), f"{seen.count(False)} of {len(seen)} fsyncs ran before the response"
    # and every record is there for a new process: written before the response ended
    decisions = list(tmp_path.rglob("decisions.jsonl"))
    assert len(decisions) == 2
    loaded = [load_transcript(path, strict=False) for path in decisions]
    assert all(any(r.stage == RESPONSE_RECORD for r in t.stage_records) for t in loaded)
    assert any(t.replacement_records for t in loaded)


def test_a_writer_without_fsync_each_append_is_read_back_at_once_and_synced_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s" / "decisions.jsonl"
    writer = TranscriptWriter(path, "s", fsync_each=False)
    calls: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd)))
    writer.append_stage_record("x", {"a": 1})
    writer.append_stage_record("x", {"a": 2})
    assert calls == []
    assert [r.data["a"] for r in load_transcript(path).stage_records] == [1, 2]
    writer.sync()
    writer.sync()  # nothing appended since: nothing to do
    assert len(calls) == 1
    # a link planted in its place is refused, as an append refuses it
    writer.append_stage_record("x", {"a": 3})
    path.rename(tmp_path / "moved.jsonl")
    path.symlink_to(tmp_path / "moved.jsonl")
    with pytest.raises(TranscriptPathError):
        writer.sync()


def test_the_proxy_can_still_fsync_each_record_before_going_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    answered = threading.Event()
    seen: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if "decisions" in os.path.basename(os.readlink(f"/proc/self/fd/{fd}")):
            seen.append(answered.is_set())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with (
        ScriptedMessagesServer(_ok) as up,
        proxy(up.base_url, tmp_path, lambda: Pipeline(default_stages()), fsync_each=True) as url,
    ):
        client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
        client.messages.create(model="m", max_tokens=5, messages=_conversation(60_000))  # type: ignore[arg-type]
        answered.set()
    assert False in seen  # durable before the response, as asked


@pytest.mark.parametrize(
    ("raw", "fast"),
    [
        (b'{"a": "caf\\u00e9", "b": [1, 2.5, null, true]}', True),
        (b'{"a": NaN}', False),
        (b'{"a": Infinity}', False),
        (b'{"a": 123456789012345678901234567890, "b": -18446744073709551617}', True),
        (b'{"a": 1e400}', False),
        (b'{"a": "\\ud800"}', False),
    ],
)
def test_bodies_parse_as_the_standard_library_parses_them(raw: bytes, fast: bool) -> None:
    value, was_fast = loads_body(raw)
    assert was_fast is fast
    expected = json.loads(raw)
    assert json.dumps(value) == json.dumps(expected)  # NaN != NaN: compare the writing
    again, _ = loads_body(dumps_body(value, fast=was_fast))
    assert json.dumps(again) == json.dumps(expected)


@pytest.mark.parametrize("raw", [b"", b"{", b'{"a": 1,}', b"[" * 100_000 + b"]" * 100_000])
def test_bad_bodies_are_refused_as_before(raw: bytes) -> None:
    with pytest.raises((ValueError, RecursionError)):
        json.loads(raw)
    with pytest.raises((ValueError, RecursionError)):
        loads_body(raw)


def test_a_value_outside_fast_json_is_written_by_the_standard_library() -> None:
    assert json.loads(dumps_body({"n": 2**70})) == {"n": 2**70}
    assert dumps_body({"s": "\ud800"}) == json.dumps({"s": "\ud800"}).encode()
    assert b"NaN" in dumps_body({"x": math.nan}, fast=False)


def test_a_nan_in_a_request_reaches_the_upstream_as_nan(tmp_path: Path) -> None:
    """What the fast codec cannot read goes as the standard library writes it: a NaN stays a
    NaN (the fast writer would make it null), for the API to judge."""
    with (
        ScriptedMessagesServer(_ok) as up,
        proxy(up.base_url, tmp_path, lambda: Pipeline(default_stages())) as url,
    ):
        body = (
            b'{"model": "m", "max_tokens": 5, "temperature": NaN,'
            b' "messages": [{"role": "user", "content": "hi"}]}'
        )
        response = httpx2.post(
            url + "/v1/messages", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 200
        assert math.isnan(up.requests[0]["temperature"])
        text = "caf\u00e9 \u2603"
        ok = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": text}]}
        response = httpx2.post(url + "/v1/messages", content=json.dumps(ok).encode())
        assert response.status_code == 200
        assert up.requests[1]["messages"][0]["content"] == text


def test_a_call_that_fails_upstream_still_makes_its_records_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with proxy(free_port_url(), tmp_path, lambda: Pipeline(default_stages())) as url:
        client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
        with pytest.raises(anthropic.APIStatusError):
            client.messages.create(model="m", max_tokens=5, messages=_conversation(60_000))  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while "decisions.jsonl" not in synced and time.monotonic() < deadline:
            time.sleep(0.02)
    assert "decisions.jsonl" in synced  # the persist's record, made durable after the 502


def test_calls_that_end_together_are_made_durable_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two conversations call back to back: their records are synced in groups (each file once
    per group, fewer syncs than calls), and what the last group left is synced by the
    shutdown -- each file's last sync covers all it holds."""
    synced: list[tuple[str, int]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith("decisions.jsonl"):
            synced.append((path, os.fstat(fd).st_size))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    calls = 0
    with (
        ScriptedMessagesServer(_ok) as up,
        proxy(up.base_url, tmp_path, lambda: Pipeline(default_stages())) as url,
    ):
        clients = [
            anthropic.Anthropic(
                base_url=url, api_key="k", max_retries=0, default_headers={SESSION: name}
            )
            for name in ("a", "b")
        ]
        history = _conversation(100)
        for _ in range(15):
            history = [
                *history,
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "on"},
            ]
            for client in clients:
                client.messages.create(model="m", max_tokens=5, messages=history)  # type: ignore[arg-type]
                calls += 1
    monkeypatch.setattr(os, "fsync", real_fsync)
    files = {path for path, _ in synced}
    assert len(files) == 2
    assert len(synced) < calls  # grouped: per call, it was one each
    for path in files:
        last = max(size for p, size in synced if p == path)
        assert last == os.path.getsize(path)  # the shutdown synced what the last group left


def test_an_app_served_without_its_lifespan_syncs_each_call_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mounted in another app (whose lifespan does not run the proxy's), nothing groups the
    syncs: each call's records are synced after it, as they were before groups."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("decisions.jsonl"):
            synced.append("decisions")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with (
        ScriptedMessagesServer(_ok) as up,
        proxy(
            up.base_url,
            tmp_path,
            lambda: Pipeline(default_stages()),
            around=lambda app: Starlette(routes=[Mount("/", app)]),
        ) as url,
    ):
        client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
        history = _conversation(100)
        for call in range(4):
            history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "on"}]
            client.messages.create(model="m", max_tokens=5, messages=history)  # type: ignore[arg-type]
            deadline = time.monotonic() + 5
            while len(synced) <= call and time.monotonic() < deadline:
                time.sleep(0.01)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert len(synced) == 4


def free_port_url() -> str:
    """An upstream nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_wrap_makes_a_calls_records_durable_with_one_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Each record is written as the call goes and synced once after it (in the process's
    sync thread: ``SYNCS.flush()`` runs what waits); the calibration is saved without an
    fsync (before: one per record, and one for the calibration)."""
    import anyio

    from pipeline.dropin.wrap import SYNCS
    from stages import wrap

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(str(tmp_path)):  # this test's files only
            synced.append(os.path.basename(path))
        real_fsync(fd)

    with ScriptedMessagesServer(_ok) as up:
        history = _conversation(60_000)
        if kind == "sync":
            client = wrap(anthropic.Anthropic(base_url=up.base_url, api_key="k"), root=tmp_path)
            client.messages.create(model="m", max_tokens=5, messages=history)  # type: ignore[arg-type]
            SYNCS.flush()
            monkeypatch.setattr(os, "fsync", fsync)
            history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
            client.messages.create(model="m", max_tokens=5, messages=history)  # type: ignore[arg-type]
            SYNCS.flush()
        else:

            async def main() -> None:
                nonlocal history
                base = anthropic.AsyncAnthropic(base_url=up.base_url, api_key="k")
                async with wrap(base, root=tmp_path) as client:
                    await client.messages.create(model="m", max_tokens=5, messages=history)  # type: ignore[arg-type]
                    SYNCS.flush()
                    monkeypatch.setattr(os, "fsync", fsync)
                    history += [
                        {"role": "assistant", "content": "ok"},
                        {"role": "user", "content": "more"},
                    ]
                    await client.messages.create(model="m", max_tokens=5, messages=history)  # type: ignore[arg-type]
                    SYNCS.flush()

            anyio.run(main)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert [name for name in synced if "calibration" in name] == []
    assert [name for name in synced if "decisions" in name] == ["decisions.jsonl"]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_wrapped_call_returns_before_its_records_are_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The call's records are written before it returns and made durable after it: an fsync
    held up does not hold up the call, and the records are synced once it is let go."""
    import anyio

    from pipeline.dropin.wrap import SYNCS
    from stages import wrap

    go = threading.Event()
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(str(tmp_path)) and "decisions" in path:  # this test's log only
            go.wait(10)  # a slow disk
            synced.append(os.path.basename(path))
        real_fsync(fd)

    history = _conversation(60_000)
    with ScriptedMessagesServer(_ok) as up:
        SYNCS.flush()  # what earlier tests' calls left to sync is theirs
        monkeypatch.setattr(os, "fsync", fsync)
        started = time.monotonic()
        if kind == "sync":
            client = wrap(anthropic.Anthropic(base_url=up.base_url, api_key="k"), root=tmp_path)
            client.messages.create(model="m", max_tokens=5, messages=history)  # type: ignore[arg-type]
        else:

            async def main() -> None:
                base = anthropic.AsyncAnthropic(base_url=up.base_url, api_key="k")
                async with wrap(base, root=tmp_path) as client:
                    await client.messages.create(model="m", max_tokens=5, messages=history)  # type: ignore[arg-type]

            anyio.run(main)
        took = time.monotonic() - started
        written = sum(len(p.read_bytes()) for p in tmp_path.rglob("decisions.jsonl"))
        go.set()
        SYNCS.flush()
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert took < 5  # the call did not wait for the held-up fsync
    assert written  # its records were written before it returned
    assert synced == ["decisions.jsonl"]


def test_the_token_calibration_is_saved_at_most_every_two_seconds_and_at_shutdown(
    tmp_path: Path,
) -> None:
    """A conversation's calibration is saved once its first call is observed (a new process
    starts warm), then at most every CALIBRATION_EVERY seconds (not a JSON dump and a file
    write per call), and whatever it learned since is saved when the proxy shuts down."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    with ScriptedMessagesServer(_ok) as upstream:
        with proxy(upstream.base_url, tmp_path, lambda: Pipeline(default_stages())) as url:
            client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
            saved: list[bytes] = []
            for k in range(5):
                reply = client.messages.create(model="m", max_tokens=5, messages=history)
                history += [
                    {"role": "assistant", "content": [{"type": "text", "text": reply.id}]},
                    {"role": "user", "content": f"and {k} " + "word " * 400},
                ]
                deadline = time.monotonic() + 2  # saved after the response, off its path
                while not (found := list(tmp_path.rglob("*calibration*.json"))):
                    assert time.monotonic() < deadline, "no calibration saved"
                    time.sleep(0.01)
                (path,) = found
                time.sleep(0.05)  # a save of this call, were there one, has happened
                saved.append(path.read_bytes())
            assert len(set(saved)) == 1  # five calls within two seconds: one save, the first
        final = path.read_bytes()  # the proxy has shut down
    assert final != saved[0]
    assert json.loads(final) != json.loads(saved[0])
