"""``--dump-requests``: each request serialised from per-message fragments, byte for byte what
``json.dumps(request, ensure_ascii=False, indent=2)`` writes; deltas that rebuild every request;
a call selection."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import Message
from pipeline._cli.dumps import RequestDumper, parse_calls
from pipeline.wire.cache import WireCache
from tests.builders import results, tool_result, tool_use, user_text
from tests.cli_support import run_cli
from tests.edit_support import records


def _full(request: list[Any]) -> bytes:
    try:
        return json.dumps(request, ensure_ascii=False, indent=2).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(request, indent=2).encode("ascii")


def _rebuild(directory: Path) -> dict[int, list[Any]]:
    """Every request of a delta dump, rebuilt call by call."""
    requests: dict[int, list[Any]] = {}
    previous: list[Any] = []
    for path in sorted(directory.glob("*.json")):
        delta = json.loads(path.read_bytes())
        previous = previous[: delta["prefix"]] + delta["messages"]
        requests[delta["call"]] = previous
    return requests


@settings(max_examples=150, deadline=None)
@given(records(), st.lists(st.integers(1, 8), min_size=1, max_size=6), st.data())
def test_fragments_give_the_bytes_of_the_whole_array(
    tmp_path_factory: pytest.TempPathFactory,
    history: list[Message],
    steps: list[int],
    data: st.DataObject,
) -> None:
    """Through a WireCache (shared messages, fresh copies at the end), including edits that
    force it to rebuild: every full file is the whole array's JSON, and the deltas rebuild
    every request."""
    base = tmp_path_factory.mktemp("dumps")
    full, delta = base / "full", base / "delta"
    full.mkdir()
    delta.mkdir()
    dumpers = [RequestDumper(full), RequestDumper(delta, format="delta")]
    cache = WireCache()
    view: list[Message] = []
    sent: dict[int, list[Any]] = {}
    for call, step in enumerate(steps):
        view = view + history[len(view) : len(view) + step]
        if data.draw(st.booleans()) and view:
            view[data.draw(st.integers(0, len(view) - 1))] = user_text(f"edited {call}")
        try:
            request = cache.to_api(view)
        except ValueError:  # a record to_api refuses: nothing is sent
            continue
        sent[call] = json.loads(json.dumps(request))
        for d in dumpers:
            d.dump(call, request)
        assert (full / f"{call:04d}.json").read_bytes() == _full(request)
    assert _rebuild(delta) == sent


def test_dump_calls_selects_and_rejects_bad_specs() -> None:
    assert parse_calls("0, 5,10-12") == {0, 5, 10, 11, 12}
    for bad in ("", "x", "5-2", "-1", "1-"):
        with pytest.raises(ValueError):
            parse_calls(bad)


def test_the_cli_writes_the_selected_calls_in_either_form(tmp_path: Path) -> None:
    history = [user_text("go")]
    for k in range(6):
        history += [
            Message.assistant([tool_use(f"u{k}")], message_id=f"r{k}"),
            results(tool_result(f"u{k}", f"out {k} " * 50)),
        ]
    history.append(Message.assistant([{"type": "text", "text": "done"}], message_id="end"))
    from pipeline import TranscriptWriter

    path = tmp_path / "s.jsonl"
    TranscriptWriter(path, "s").append_messages(history)
    full, part, delta = tmp_path / "full", tmp_path / "part", tmp_path / "delta"
    for args in (
        ("--dump-requests", full),
        ("--dump-requests", part, "--dump-calls", "1,3-4"),
        ("--dump-requests", delta, "--dump-format", "delta"),
    ):
        proc = run_cli("replay", path, "--json", "--store", tmp_path / "store", *args)
        assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in full.glob("*.json"))
    assert len(names) == 7
    assert sorted(p.name for p in part.glob("*.json")) == ["0001.json", "0003.json", "0004.json"]
    for name in ("0001.json", "0003.json", "0004.json"):
        assert (part / name).read_bytes() == (full / name).read_bytes()
    rebuilt = _rebuild(delta)
    assert rebuilt == {int(n[:4]): json.loads((full / n).read_bytes()) for n in names}
    assert sum(p.stat().st_size for p in delta.glob("*.json")) < sum(
        p.stat().st_size for p in full.glob("*.json")
    )
    proc = run_cli("replay", path, "--dump-requests", tmp_path / "x", "--dump-calls", "3-1")
    assert proc.returncode == 2 and "--dump-calls" in proc.stderr
