"""Comparison points for ``replay --compare``: what other harnesses do, as stages.

- :class:`HeadTailTruncate` — every tool result longer than ``max_chars`` keeps its head and
  tail with a marker in between (Codex-style truncation at 10K). Stateless and deterministic, so
  it never changes a result once sent; it loses the middle of every large output for good.
- :class:`ClearEveryTurn` — once the context passes ``trigger_tokens``, every turn clears all
  tool results but the newest ``keep`` (LangChain ContextEditing-style). It rewrites the prefix
  whenever one more result falls out of the window: the cache breaks nearly every turn.
"""

from __future__ import annotations

from typing import Any

from pipeline import Message, SessionContext
from pipeline.tracing import emit_decision

__all__ = ["CLEARED", "ClearEveryTurn", "HeadTailTruncate"]

CLEARED = "[Old tool result content cleared]"


def _map_results(messages: list[Message], change: Any) -> list[Message]:
    """Apply ``change(block) -> new content | None`` to every tool_result; same list if none."""
    out: list[Message] | None = None
    for i, m in enumerate(messages):
        if m.type != "user" or not isinstance(m.content, list):
            continue
        blocks = None
        for j, b in enumerate(m.content):
            if b.get("type") != "tool_result":
                continue
            new = change(b)
            if new is not None and new != b.get("content"):
                blocks = blocks or list(m.content)
                blocks[j] = {**b, "content": new}
        if blocks is not None:
            out = out or list(messages)
            out[i] = m.with_content(blocks)
    return messages if out is None else out


class HeadTailTruncate:
    """Keep the first and last ``max_chars // 2`` characters of each long string result."""

    name = "truncate"
    strategy = "head-tail"
    may_break_cache = False  # a pure function of each result: what was sent stays the same

    def __init__(self, max_chars: int = 10_000) -> None:
        if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 2:
            raise ValueError(f"max_chars must be an integer >= 2, got {max_chars!r}")
        self.max_chars = max_chars

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        half = self.max_chars // 2

        def cut(block: dict[str, Any]) -> str | None:
            text = block.get("content")
            if not isinstance(text, str) or len(text) <= self.max_chars:
                return None
            dropped = len(text) - 2 * half
            return f"{text[:half]}\n[... {dropped} characters truncated ...]\n{text[-half:]}"

        out = _map_results(messages, cut)
        emit_decision(
            ctx.tracer,
            self.name,
            conversation_id=ctx.session_id,
            decision="truncated" if out is not messages else "skip",
            reason="over_max_chars" if out is not messages else "nothing_long",
        )
        return out


class ClearEveryTurn:
    """Past ``trigger_tokens``, clear every tool result but the newest ``keep``, every turn."""

    name = "microcompact"
    strategy = "clear-every-turn"
    may_break_cache = True

    def __init__(self, keep: int = 3, trigger_tokens: int = 100_000) -> None:
        for arg, value in (("keep", keep), ("trigger_tokens", trigger_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{arg} must be a non-negative integer, got {value!r}")
        self.keep = keep
        self.trigger_tokens = trigger_tokens

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        size = ctx.token_tracker.estimate(messages) - ctx.report.tokens_freed
        if size < self.trigger_tokens:
            emit_decision(
                ctx.tracer,
                self.name,
                conversation_id=ctx.session_id,
                decision="skip",
                reason="below_trigger",
                tokens_before=size,
            )
            return messages
        ids = [
            b.get("tool_use_id")
            for m in messages
            if m.type == "user" and isinstance(m.content, list)
            for b in m.content
            if b.get("type") == "tool_result"
        ]
        old = set(ids[: max(0, len(ids) - self.keep)])
        out = _map_results(messages, lambda b: CLEARED if b.get("tool_use_id") in old else None)
        emit_decision(
            ctx.tracer,
            self.name,
            conversation_id=ctx.session_id,
            decision="cleared" if out is not messages else "skip",
            reason="over_trigger" if out is not messages else "nothing_eligible",
            tokens_before=size,
            cleared=len(old),
        )
        return out
