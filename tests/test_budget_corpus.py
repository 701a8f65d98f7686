"""The budget on real Claude Code sessions, with limits low enough to make it work hard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from pipeline import Pipeline, SessionContext, ToolPolicies, load_transcript
from pipeline.gate import is_persistable, persist_content
from pipeline.results.keys import PERSISTED_OUTPUT_TAG
from pipeline.results.reading import candidate_size
from pipeline.store.files import FileToolResultStore
from pipeline.transcript.replay import replay_messages
from pipeline.wire.pairing import check_pairing
from stages import ToolResultBudget
from tests.conftest import CORPUS, corpus_params

PER_MESSAGE = 20_000
PER_TOOL = 8_000
_PATH = re.compile(r"Full output saved to: (.+)\n")


def _originals(messages: list[Any]) -> dict[str, Any]:
    return {
        b["tool_use_id"]: b.get("content")
        for m in messages
        if m.type == "user" and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    }


def _tool_names(messages: list[Any]) -> dict[str, str]:
    return {
        b["id"]: b.get("name", "")
        for m in messages
        if m.type == "assistant" and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_use"
    }


@pytest.mark.parametrize("path", corpus_params())
@pytest.mark.asyncio
async def test_low_limits_bound_stable_and_lossless(path: Path, tmp_path: Path) -> None:
    transcript = load_transcript(path)
    policies = ToolPolicies.claude_code(cap=PER_TOOL)
    ctx = SessionContext(transcript.session_id or "s", tmp_path / "store", tool_policies=policies)
    # the budget's own guarantees; later stages may change the sent prefix (may_break_cache)
    pipe = Pipeline([ToolResultBudget(limit=PER_MESSAGE)])
    originals = _originals(transcript.messages)
    names = _tool_names(transcript.messages)
    previous: list[Any] | None = None
    persisted = 0
    calls = 0
    async for result in replay_messages(transcript.messages, pipe, ctx):
        calls += 1
        request = result.request
        assert check_pairing(request) == []
        for param in request:
            if param["role"] != "user" or isinstance(param["content"], str):
                continue
            visible = 0
            for block in param["content"]:
                if block.get("type") != "tool_result":  # type: ignore[union-attr]
                    continue
                content = block.get("content")  # type: ignore[union-attr]
                tid = block["tool_use_id"]  # type: ignore[index]
                if isinstance(content, str) and content.startswith(PERSISTED_OUTPUT_TAG):
                    continue
                if policies.never_persist(names.get(tid)) or not is_persistable(content):
                    continue
                # a per-tool threshold bounds each one; the budget bounds their sum
                assert candidate_size(content) <= policies.threshold(names.get(tid))
                visible += candidate_size(content)
            assert visible <= PER_MESSAGE, f"call {result.call.number}: {visible} chars visible"
        if previous is not None and len(request) > 1:
            # prefix-stable: every earlier message but the newest is sent again unchanged
            assert request[: len(previous) - 1] == previous[:-1] or len(request) < len(previous)
        previous = request
        for p in result.persisted:
            persisted += 1
            original = originals[p.tool_use_id]
            stored = Path(p.path).read_text(encoding="utf-8")
            expected = (
                original
                if isinstance(original, str)
                else json.dumps(original, indent=2, ensure_ascii=False)
            )
            assert stored == expected
    assert calls == len(
        {
            m.message_id
            for m in transcript.messages
            if m.type == "assistant" and m.message_id and not m.is_synthetic
        }
    )
    # every replacement made is re-applied on every later call (the ledger only grows)
    assert len(ctx.replacement_state.replacements) == persisted


REAL = CORPUS / "claude-code_marot-spotter" / "8463c716-a2ea-4c14-9efa-87158ebd9f20.jsonl"


@pytest.mark.skipif(not REAL.exists(), reason="corpus absent")
@pytest.mark.asyncio
async def test_matches_claude_codes_own_persisted_output(tmp_path: Path) -> None:
    """Claude Code 2.1.39 persisted a 141 KB Bash output in this session: same text, our path."""
    record = next(
        json.loads(line) for line in REAL.open(encoding="utf-8") if "<persisted-output>" in line
    )
    (block,) = [b for b in record["message"]["content"] if b["type"] == "tool_result"]
    real: str = block["content"]
    original: str = record["toolUseResult"]["stdout"]  # what the tool produced (stderr empty)
    real_path = _PATH.search(real).group(1)  # type: ignore[union-attr]
    store = FileToolResultStore(tmp_path, record["sessionId"])
    ours = await persist_content(store, block["tool_use_id"], original)
    assert ours.replacement == real.replace(real_path, ours.path)
    assert Path(ours.path).read_text(encoding="utf-8") == original
    assert ours.path.endswith(f"{record['sessionId']}/tool-results/{block['tool_use_id']}.txt")

    # and through the stage, as the per-tool gate of a Bash result over its 30,000 threshold
    ctx = SessionContext(
        record["sessionId"], tmp_path / "via-stage", tool_policies=ToolPolicies.claude_code()
    )
    from tests.builders import assistant, results, tool_result, tool_use

    msgs = [
        assistant("r", tool_use(block["tool_use_id"], "Bash")),
        results(tool_result(block["tool_use_id"], original)),
    ]
    out = await Pipeline([ToolResultBudget()]).run(msgs, ctx)
    sent = out[1].content[0]["content"]  # type: ignore[index]
    assert sent == real.replace(real_path, _PATH.search(sent).group(1))  # type: ignore[union-attr]
