"""``apply_recorded_wire`` at its edges: chains that do not fit the records, retries written at
the same place, records without ids, and what it must never do (crash, drop a response, make
two records with one uuid)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline import load_transcript, to_api
from pipeline.transcript.replay import find_calls

S = "s1"


def _env(n: int, rtype: str, **kw: Any) -> dict[str, Any]:
    uid = f"00000000-0000-4000-8000-{n:012d}"
    return {"type": rtype, "uuid": uid, "sessionId": S, "timestamp": "2026-01-01T00:00:00Z", **kw}


def _user(n: int, content: Any) -> dict[str, Any]:
    return _env(n, "user", message={"role": "user", "content": content})


def _assistant(n: int, mid: str, text: str, tokens: int = 10) -> dict[str, Any]:
    message = {
        "id": mid,
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [{"type": "text", "text": text}],
        "usage": {"input_tokens": tokens, "output_tokens": 1},
    }
    return _env(n, "assistant", message=message)


def _blob(digest: str | None, message: dict[str, Any]) -> dict[str, Any]:
    line: dict[str, Any] = {"type": "api-request-blob", "message": message}
    if digest is not None:
        line["hash"] = digest
    return line


def _request(rid: str | None, tail: list[str] | None, keep: int = 0) -> dict[str, Any]:
    line: dict[str, Any] = {"type": "api-request", "params": {"model": "m"}, "keep": keep}
    if rid is not None:
        line["id"] = rid
    if tail is not None:
        line["tail"] = tail
    return line


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def _call_wire(path: Path, k: int = 0) -> str:
    t = load_transcript(path)
    return json.dumps(to_api(t.messages[: find_calls(t.messages)[k].index]))


def test_a_chain_keeping_more_than_the_records_hold_is_unverified(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        [
            _user(1, "hello"),
            _blob("h1", {"role": "user", "content": "hello"}),
            _request("r1", ["h1"], 5),
        ],
    )
    for strict in (True, False):
        t = load_transcript(path, strict=strict)
        assert (t.wire_check.unverified, t.wire_check.replaced) == (1, 0)
        assert to_api(t.messages) == [{"role": "user", "content": "hello"}]


def test_a_message_the_records_lost_is_added_from_its_blob(tmp_path: Path) -> None:
    lost = {"role": "user", "content": "context the records lost"}
    path = _write(
        tmp_path / "t.jsonl",
        [
            _user(1, "hello"),
            _blob("h1", {"role": "user", "content": "hello"}),
            _blob("h2", lost),
            _request("r1", ["h1", "h2"]),
            _assistant(2, "msg_1", "hi"),
        ],
    )
    assert load_transcript(path).wire_check.replaced == 1
    assert _call_wire(path) == json.dumps([{"role": "user", "content": "hello"}, lost])


def test_a_retry_written_at_the_same_place_wins(tmp_path: Path) -> None:
    """Two requests before one response (a retry that sent something else): the call's
    messages are the last request's, with or without a chain."""
    one, two = {"role": "user", "content": "HELLO-1"}, {"role": "user", "content": "HELLO-2"}
    for chain in (True, False):
        path = _write(
            tmp_path / f"t{chain}.jsonl",
            [
                _user(1, "hello"),
                _blob("h1", one),
                _request("r1", ["h1"] if chain else None),
                _blob("h2", two),
                _request("r2", ["h2"] if chain else None),
                _assistant(2, "msg_1", "hi"),
            ],
        )
        assert _call_wire(path) == json.dumps([two]), chain
        assert [r.position for r in load_transcript(path).requests] == [1, 1]


def test_a_retry_differing_in_its_second_message_keeps_the_first(tmp_path: Path) -> None:
    a, b, c = ({"role": "user", "content": x} for x in "ABC")
    path = _write(
        tmp_path / "t.jsonl",
        [
            _user(1, "hello"),
            _blob("ha", a),
            _blob("hb", b),
            _request("r1", ["ha", "hb"]),
            _blob("hc", c),
            _request("r2", ["ha", "hc"]),
            _assistant(2, "msg_1", "hi"),
        ],
    )
    assert _call_wire(path) == json.dumps([a, c])


def test_made_records_never_share_a_uuid(tmp_path: Path) -> None:
    lines: list[dict[str, Any]] = []
    for i in range(3):  # no request ids, no hashes: nothing else tells them apart
        lines += [
            _user(2 * i + 1, f"p{i}"),
            _blob(None, {"role": "user", "content": f"P{i}"}),
            _request(None, None),
            _assistant(2 * i + 2, f"m{i}", "a"),
        ]
    t = load_transcript(_write(tmp_path / "t.jsonl", lines))
    assert t.wire_check.replaced == 3
    assert max(Counter(m.uuid for m in t.messages).values()) == 1


def test_a_response_is_never_dropped_to_match_a_recording(tmp_path: Path) -> None:
    """A later call re-sent the history with the first prompt changed: matching it would drop
    the first response's records (a call of their own), so the call is reported instead."""
    path = _write(
        tmp_path / "t.jsonl",
        [
            _user(1, "hello"),
            _blob("h1", {"role": "user", "content": "hello"}),
            _request("r1", ["h1"]),
            _assistant(2, "msg_1", "hi", 100),
            _user(3, "again"),
            _blob("h1b", {"role": "user", "content": "hello (edited)"}),
            _blob("ha", {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}),
            _blob("h3", {"role": "user", "content": "again"}),
            _request("r2", ["h1b", "ha", "h3"]),
            _assistant(4, "msg_2", "ok", 200),
        ],
    )
    t = load_transcript(path)
    assert t.wire_check.unverified == 1
    assert [c.message_id for c in find_calls(t.messages)] == ["msg_1", "msg_2"]
    assert [r.position for r in t.requests] == [c.index for c in find_calls(t.messages)]
