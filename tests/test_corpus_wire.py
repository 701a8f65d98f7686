"""Replay every real Claude Code session of the corpus call by call and check the wire requests.

For each API call (each distinct assistant response id) the conversation as it stood just before
the call goes through a pipeline and `to_api`. Every request must be one the Messages API accepts
(tool pairing, strict user/assistant alternation starting with user), and consecutive requests must
share their prefix — the prompt cache depends on it — except where the session was compacted.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

from pipeline import Message, Pipeline, SessionContext, Stage, load_transcript, to_api
from pipeline.transcript.read import Transcript
from pipeline.transcript.replay import CallResult, find_calls, replay_messages
from pipeline.wire.pairing import check_pairing
from stages import Autocompact, ContextCollapse, HistorySnip, Microcompact, default_stages
from tests.conftest import corpus_params, corpus_sessions

pytestmark = pytest.mark.corpus


@functools.cache
def _load(path: Path) -> Transcript:
    return load_transcript(path, strict=True)


class Watched:
    """A stage wrapper that remembers whether the stage changed its input in the last pass."""

    def __init__(self, inner: Stage) -> None:
        self.inner = inner
        self.name = inner.name
        self.may_break_cache = bool(getattr(inner, "may_break_cache", False))
        self.readonly_input = getattr(inner, "readonly_input", False)
        self.changed = False

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        out = await self.inner(messages, ctx)
        self.changed = out is not messages
        return out


def _default() -> list[Stage]:
    return list(default_stages())


def _pass_through() -> list[Stage]:
    return [HistorySnip(), Microcompact(), ContextCollapse(), Autocompact()]


PIPELINES: dict[str, Callable[[], list[Stage]]] = {
    "default": _default,
    "pass_through": _pass_through,
}


def _quiet_logger() -> Any:
    """The budget stage logs a debug event per decision; keep the replay output short."""
    return structlog.wrap_logger(
        structlog.PrintLogger(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )


def _first_text(param: Any) -> str:
    content = param["content"]
    if isinstance(content, str):
        return content
    return next((b["text"] for b in content if b.get("type") == "text"), "")


def _blocks(param: Any) -> list[Any]:
    content = param["content"]
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _extends(prev: Any, nxt: Any) -> bool:
    """``nxt`` is ``prev`` or ``prev`` with more blocks (and maybe a seam newline) at its end."""
    if prev == nxt:
        return True
    if prev["role"] != nxt["role"]:
        return False
    pb, nb = _blocks(prev), _blocks(nxt)
    if len(nb) < len(pb) or nb[: len(pb) - 1] != pb[:-1]:
        return False
    last, same = pb[-1], nb[len(pb) - 1]
    return bool(same == last) or (
        last.get("type") == same.get("type") == "text" and same["text"] == last["text"] + "\n"
    )


def _compacted_between(messages: Sequence[Message], start: int, end: int) -> bool:
    return any(
        m.is_compact_boundary or (m.type == "user" and m.is_compact_summary)
        for m in messages[start:end]
    )


async def _replay(messages: list[Message], stages: list[Stage], root: Path) -> list[dict[str, Any]]:
    watched = [Watched(s) for s in stages]
    pipe = Pipeline(watched)
    ctx = SessionContext("corpus", root, logger=_quiet_logger())
    out: list[dict[str, Any]] = []
    result: CallResult
    async for result in replay_messages(messages, pipe, ctx):
        out.append(
            {
                "result": result,
                "changed": any(w.changed for w in watched),
                "cache_broken": any(w.changed and w.may_break_cache for w in watched),
            }
        )
    return out


@pytest.mark.parametrize("pipeline_name", sorted(PIPELINES))
@pytest.mark.parametrize("path", corpus_params())
def test_replayed_requests_are_valid_and_prefix_stable(
    path: Path, pipeline_name: str, tmp_path: Path
) -> None:
    transcript = _load(path)
    messages = transcript.messages
    assert transcript.problems == []
    assert transcript.repeated == transcript.out_of_order == []  # Claude Code writes neither
    calls = find_calls(messages)
    assert calls, "every corpus session made at least one API call"

    replayed = anyio.run(_replay, messages, PIPELINES[pipeline_name](), tmp_path)
    assert [r["result"].call for r in replayed] == calls

    prefix_checked = compacted = 0
    prev: list[Any] | None = None
    prev_index = 0
    for r in replayed:
        result: CallResult = r["result"]
        request: list[Any] = result.request
        where = f"call {result.call.number} ({result.call.message_id})"

        assert check_pairing(request) == [], where
        roles = [p["role"] for p in request]
        assert roles and roles[0] == "user", where
        assert all(a != b for a, b in itertools.pairwise(roles)), where
        if not r["changed"]:  # every stage passed its input through
            assert request == to_api(messages[: result.call.index]), where

        if prev is not None:
            if _compacted_between(messages, prev_index, result.call.index):
                summary = next(
                    m
                    for m in reversed(messages[: result.call.index])
                    if m.type == "user" and m.is_compact_summary
                )
                assert isinstance(summary.content, str)
                assert _first_text(request[0]).startswith(summary.content), where
                compacted += 1
            elif not r["cache_broken"]:
                # The previous request, except its last message, is an exact prefix of this
                # one; the last may have grown (a fragment of a response still streaming).
                assert len(request) >= len(prev), where
                assert request[: len(prev) - 1] == prev[:-1], where
                assert _extends(prev[-1], request[len(prev) - 1]), where
                prefix_checked += 1
        prev, prev_index = request, result.call.index

    # the compaction exemption is used no more often than the session was compacted
    assert compacted <= sum(m.type == "user" and m.is_compact_summary for m in messages)
    broken = sum(r["cache_broken"] for r in replayed[1:])
    assert prefix_checked + compacted + broken == len(calls) - 1


def test_the_corpus_holds_more_than_a_thousand_calls() -> None:
    files = corpus_sessions()
    if not files:
        pytest.skip("no corpus")
    total = sum(len(find_calls(_load(f).messages)) for f in files)
    assert total > 1000
