"""Helpers for the tests of the stages that remove or summarise rounds (history snip, context
collapse): contexts with span capture, agentic histories, wire checks, a hypothesis strategy."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from pipeline import (
    Message,
    Pipeline,
    SessionContext,
    TokenTracker,
    Usage,
    to_api,
)
from pipeline.testing import SpanRecorder
from pipeline.tokens import rough_tokens_for_messages
from pipeline.wire.pairing import check_pairing
from tests.builders import tool_result, tool_use


class Spans(SpanRecorder):
    """Decision spans of one context."""

    def decisions(self, stage: str) -> list[dict[str, Any]]:
        """Attributes of every ``<stage>.<decision>`` span, in order."""
        return [dict(a) for a in self.decision_attributes(stage)]


def make_ctx(tmp_path: Path, spans: Spans | None = None, **kw: Any) -> SessionContext:
    """A context; the reference token tracker unless one is given, so figures are exact."""
    kw.setdefault("session_id", "s1")
    kw.setdefault("token_tracker", TokenTracker("reference"))
    return SessionContext(root=tmp_path / "store", tracer=spans.tracer if spans else None, **kw)


def roles_alternate(request: Sequence[Any]) -> bool:
    return all(a["role"] != b["role"] for a, b in itertools.pairwise(request))


def wire_ok(messages: Sequence[Message]) -> bool:
    request = to_api(messages)
    return check_pairing(request) == [] and roles_alternate(request)


def dump(messages: Sequence[Message]) -> str:
    return json.dumps(to_api(messages), sort_keys=True)


def answered(history: list[Message], sent: list[Message], n: int, chars: int) -> list[Message]:
    """``history`` plus the model's reply to the request ``sent`` (usage counts ``sent``, as the
    API would) and the tool_result of its call ``n``."""
    reply = Message.assistant(
        [{"type": "text", "text": f"step {n}"}, tool_use(f"t{n}", command=f"cmd {n}")],
        message_id=f"m{n}",
        model="claude-test",
        uuid=f"a{n}",
    )
    usage = Usage(input_tokens=rough_tokens_for_messages(sent), output_tokens=20)
    out = f"out {n} " + "x" * chars
    return [
        *history,
        dataclasses.replace(reply, usage=usage),
        Message.user([tool_result(f"t{n}", out)], uuid=f"r{n}"),
    ]


def agentic(rounds: int, chars: int = 1_000) -> list[Message]:
    """A task prompt and ``rounds`` tool rounds; every response carries realistic usage."""
    history = [Message.user("Fix the failing tests.", uuid="first")]
    for n in range(rounds):
        history = answered(history, history, n, chars)
    return history


async def run(stage: Any, history: list[Message], ctx: SessionContext) -> list[Message]:
    """One pass of ``stage`` alone, as the pipeline would run it."""
    return list(await Pipeline([stage]).run(history, ctx))


@st.composite
def histories(draw: st.DrawFn) -> list[Message]:
    """Alternating, fully paired histories: grouped or streamed responses (a record per block,
    results after each call or after all of them), results split over records, progress and
    system noise, prompts, usage or none."""
    ids = itertools.count()

    def uid() -> str:
        return f"x{next(ids)}"

    def pad() -> str:
        return "x" * draw(st.integers(0, 600))

    msgs = [Message.user("task " + pad(), uuid="first")]
    with_usage = draw(st.booleans())
    rounds = draw(st.integers(0, 14))
    for r in range(rounds):
        mid, start = f"m{r}", len(msgs)
        tools = [f"t{r}.{j}" for j in range(draw(st.integers(0, 3)))]
        text = {"type": "text", "text": f"say {r} " + pad()}
        shape = draw(st.sampled_from(["grouped", "interleaved", "fragments_first"]))
        if tools and shape != "grouped":  # streamed: a record per block, as Claude Code writes
            msgs.append(Message.assistant([text], message_id=mid, uuid=uid()))
            results = []
            for t in tools:
                msgs.append(Message.assistant([tool_use(t)], message_id=mid, uuid=uid()))
                if draw(st.booleans()):
                    msgs.append(Message(type="progress", uuid=uid()))
                result = Message.user([tool_result(t, f"out {t} " + pad())], uuid=uid())
                if shape == "interleaved":  # each result right after its call
                    msgs.append(result)
                else:
                    results.append(result)
            msgs += results
        else:
            msgs.append(
                Message.assistant([text, *map(tool_use, tools)], message_id=mid, uuid=uid())
            )
            cut = draw(st.integers(0, len(tools)))
            for part in (tools[:cut], tools[cut:]):
                if part:
                    blocks = [tool_result(t, f"out {t} " + pad()) for t in part]
                    msgs.append(Message.user(blocks, uuid=uid()))
        if draw(st.booleans()):
            msgs.append(Message(type="system", subtype="turn_duration", content="1s", uuid=uid()))
        if (not tools and r < rounds - 1) or draw(st.booleans()):
            msgs.append(Message.user(f"prompt {r} " + pad(), uuid=uid()))
        if with_usage:  # on the last fragment: what the request before this response held
            last = max(i for i in range(start, len(msgs)) if msgs[i].type == "assistant")
            usage = Usage(input_tokens=rough_tokens_for_messages(msgs[:start]), output_tokens=9)
            msgs[last] = dataclasses.replace(msgs[last], usage=usage)
    assert wire_ok(msgs)
    return msgs


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
