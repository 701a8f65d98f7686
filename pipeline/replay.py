"""Replay a recorded session through a pipeline, call by call, as a live loop would have run it.

For each API call in the transcript (each distinct assistant response id, in order) the
conversation as it stood just before that call is run through the pipeline with ONE session
context carried across calls, then normalised to wire form. The call's recorded usage is then
fed to the session's token tracker, as a live loop would, and to a reference tracker, so the
replay measures both estimators on the recorded calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.context import PersistedResult, SessionContext
from pipeline.core import Pipeline
from pipeline.messages import Message, Usage, to_api
from pipeline.tokens import Observation, TokenTracker

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic.types import MessageParam

__all__ = ["Call", "CallResult", "find_calls", "replay_messages", "request_chars"]


@dataclass(frozen=True, slots=True)
class Call:
    """One API call found in a transcript."""

    number: int
    message_id: str
    index: int
    """Index of the response's first record: the call saw ``messages[:index]``."""
    usage: Usage | None
    """The response's usage (its last record's), None if no record carried any."""
    model: str | None = None
    """The model that served the call (its first record's)."""


@dataclass(slots=True)
class CallResult:
    """What the pipeline sent for one call."""

    call: Call
    request: list[MessageParam]
    estimated_tokens: int
    persisted: list[PersistedResult] = field(default_factory=list)
    reapplied: int = 0
    persist_failed: list[str] = field(default_factory=list)
    observations: dict[str, Observation] = field(default_factory=dict)
    """The recorded call's usage against each estimator (``"default"``: the session's tracker,
    ``"reference"``: SPEC §4), each estimating the projected request before learning from it.
    Not in the JSON line: the summary reports them."""

    @property
    def actual_tokens(self) -> int | None:
        """Input + cache_creation + cache_read tokens the API reported for this call."""
        return self.call.usage.input_side if self.call.usage is not None else None

    @property
    def request_chars(self) -> int:
        """Characters of visible text in the request (see :func:`request_chars`)."""
        return request_chars(self.request)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` line of the CLI contract."""
        return {
            "call": self.call.number,
            "message_id": self.call.message_id,
            "estimated_tokens": self.estimated_tokens,
            "actual_tokens": self.actual_tokens,
            "persisted": [
                {"tool_use_id": p.tool_use_id, "chars": p.chars, "path": p.path}
                for p in self.persisted
            ],
            "reapplied": self.reapplied,
            "request_chars": self.request_chars,
        }


def find_calls(messages: Sequence[Message]) -> list[Call]:
    """Every distinct assistant response id, in order of first appearance.

    Synthetic assistant records (no API call made them) and records without an id are not calls.
    Streaming writes one record per content block; their usage snapshots grow, so the last
    record's usage is the response's.
    """
    first: dict[str, int] = {}
    usage: dict[str, Usage] = {}
    for i, m in enumerate(messages):
        if m.type != "assistant" or m.message_id is None or m.is_synthetic:
            continue
        first.setdefault(m.message_id, i)
        if m.usage is not None:
            usage[m.message_id] = m.usage
    return [
        Call(number=n, message_id=mid, index=idx, usage=usage.get(mid), model=messages[idx].model)
        for n, (mid, idx) in enumerate(sorted(first.items(), key=lambda kv: kv[1]))
    ]


def _block_chars(block: Any) -> int:
    if not isinstance(block, dict):
        return 0
    btype = block.get("type")
    if btype == "text":
        return len(str(block.get("text") or ""))
    if btype == "thinking":
        return len(str(block.get("thinking") or ""))
    if btype == "tool_use":
        return len(str(block.get("name") or "")) + len(repr(block.get("input")))
    if btype == "tool_result":
        content = block.get("content")
        if isinstance(content, str):
            return len(content)
        if isinstance(content, list):
            return sum(_block_chars(b) for b in content)
    return 0


def request_chars(request: Sequence[MessageParam]) -> int:
    """Characters of text, thinking, tool input and tool output in a request (images: 0)."""
    total = 0
    for param in request:
        content: Any = param["content"]
        if isinstance(content, str):
            total += len(content)
        else:
            total += sum(_block_chars(b) for b in content)
    return total


async def replay_messages(
    messages: Sequence[Message], pipeline: Pipeline, ctx: SessionContext
) -> AsyncIterator[CallResult]:
    """Yield, call by call, what ``pipeline`` would have sent for the recorded session.

    After each call the tracker of ``ctx`` observes the call's recorded usage, so its estimates
    for the next calls (and the stages' decisions) use what a live loop would have learned.
    """
    reference = TokenTracker("reference")
    for call in find_calls(messages):
        before = list(messages[: call.index])
        projected = await pipeline.run(before, ctx)
        report = ctx.report
        result = CallResult(
            call=call,
            request=to_api(projected),
            estimated_tokens=report.estimated_tokens,
            persisted=list(report.persisted),
            reapplied=report.reapplied,
            persist_failed=list(report.persist_failed),
        )
        if call.usage is not None:
            # as a live loop: the request as projected is what the usage is paired with (the
            # recorded harness applied the same budget); a pass whose stages removed content
            # the anchor's usage counted is neither learned from nor measured
            freed = report.tokens_freed
            result.observations = {
                name: tracker.observe(projected, call.usage, model=call.model, tokens_freed=freed)
                for name, tracker in (("default", ctx.token_tracker), ("reference", reference))
            }
        yield result
