"""Retention of whole conversations (``pipeline.store.retention_conversations``): a conversation
directory the store wrote, untouched for longer than the age, goes whole, its records
included; anything else keeps it."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import httpx2

from pipeline import Pipeline
from pipeline.dropin.conversations import Conversations
from pipeline.store.retention import prune_store
from pipeline.testing import QuietLogger, Reply, ScriptedMessagesServer
from stages import ToolResultBudget
from tests.wire_support import proxy_process

HOUR = 3_600.0


def _age_all(root: Path, hours: float) -> None:
    when = time.time() - hours * HOUR
    for path in root.rglob("*"):
        if path.is_file():
            os.utime(path, (when, when))


def _conversations(root: Path, *openings: str) -> list[Path]:
    """A conversation per opening, one of them with a persisted result and a branch; the
    directories the store made for them."""

    async def main() -> None:
        registry = Conversations(
            pipeline=lambda: Pipeline([ToolResultBudget(3_000)]), root=root, logger=QuietLogger()
        )
        use = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}
        out = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x" * 5_000}
        for opening in openings:
            history: list[dict[str, Any]] = [{"role": "user", "content": opening}]
            history += [{"role": "assistant", "content": [use]}, {"role": "user", "content": [out]}]
            for messages in (history, [history[0], *_fork()]):
                body = {"model": "m", "max_tokens": 5, "messages": messages}
                branch = await registry.route(body, {"x-api-key": "sk-ant-A"})
                await branch.session.prepare_request(body)
                await branch.session.observe_async("msg_1", {"input_tokens": 9}, "m")

    anyio.run(main)
    return sorted(p for tenant in root.glob("t-*") for p in tenant.iterdir())


def _fork() -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": "then"}, {"role": "user", "content": "other way"}]


def test_an_idle_conversation_goes_whole_with_its_branches_records(tmp_path: Path) -> None:
    [conversation] = _conversations(tmp_path, "one-shot")
    names = {p.name for p in conversation.iterdir()}
    assert {"decisions.jsonl", "token-calibration.json", "tool-results"} <= names
    assert any(n.startswith("decisions.f") for n in names)  # the branch's records
    _age_all(tmp_path, 2)
    report = prune_store(tmp_path, max_age=timedelta(hours=1))
    assert not conversation.exists()
    assert report.removed_conversations == [conversation]
    assert [f.path.parent.name for f in report.removed] == ["tool-results"]
    assert (tmp_path / "tenant-secret").is_file()  # the store's own, not a conversation


def test_a_conversation_written_to_within_the_age_stays_whole(tmp_path: Path) -> None:
    [conversation] = _conversations(tmp_path, "going on")
    _age_all(tmp_path, 2)
    os.utime(conversation / "decisions.jsonl")  # its last call, just now
    report = prune_store(tmp_path, max_age=timedelta(hours=1))
    assert report.removed_conversations == []
    assert (conversation / "token-calibration.json").is_file()
    assert not (conversation / "tool-results").exists()  # old results go as ever


def test_anything_else_in_a_conversation_keeps_it(tmp_path: Path) -> None:
    foreign, linked, dry = _conversations(tmp_path, "a", "b", "c")
    (foreign / "notes.txt").write_text("mine")
    (linked / "decisions.jsonl").unlink()
    (linked / "decisions.jsonl").symlink_to(tmp_path / "tenant-secret")
    _age_all(tmp_path, 2)
    report = prune_store(tmp_path, max_age=timedelta(hours=1), dry_run=True)
    assert report.removed_conversations == [dry]
    assert dry.is_dir() and (dry / "decisions.jsonl").is_file()  # a dry run removes nothing
    report = prune_store(tmp_path, max_age=timedelta(hours=1))
    assert report.removed_conversations == [dry]
    assert (foreign / "notes.txt").is_file() and (foreign / "decisions.jsonl").is_file()
    assert (linked / "decisions.jsonl").is_symlink() and (tmp_path / "tenant-secret").is_file()


def test_the_proxy_forgets_one_shot_conversations_past_its_retention(tmp_path: Path) -> None:
    store = tmp_path / "store"

    def reply(_body: dict[str, Any]) -> Reply:
        return Reply([{"type": "text", "text": "ok"}])

    with ScriptedMessagesServer(reply) as upstream:
        with proxy_process(upstream.base_url, store, "--retain", "1h") as (url, _, _):
            for n in range(20):  # a batch classifier: one call each
                body = {
                    "model": "m",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": f"{n}"}],
                }
                assert httpx2.post(f"{url}/v1/messages", json=body).status_code == 200
        assert len([p for t in store.glob("t-*") for p in t.iterdir()]) == 20
        _age_all(store, 2)
        with proxy_process(upstream.base_url, store, "--retain", "1h") as (url, lines, _):
            pass  # pruned at start-up
    assert [p for t in store.glob("t-*") for p in t.iterdir()] == []
    assert "removed 20 idle conversation(s) whole" in "".join(lines)
