"""Comparison points for ``replay --compare``: what other harnesses do, as stages.

- :class:`HeadTailTruncate` — every tool result longer than ``max_chars`` keeps its head and
  tail with a marker in between (Codex-style truncation at 10K). Stateless and deterministic, so
  it never changes a result once sent; it loses the middle of every large output for good.
- :class:`ClearEveryTurn` — once the context passes ``trigger_tokens``, every turn clears all
  tool results but the newest ``keep`` (LangChain ContextEditing-style). It rewrites the prefix
  whenever one more result falls out of the window: the cache breaks nearly every turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline import Message, SessionContext
from pipeline.tracing import ATTR, Decision, Reason
from stages._shared import CLEARED_PLACEHOLDER, replace_results, tool_results
from stages._shared.args import check_int

__all__ = ["ClearEveryTurn", "HeadTailTruncate"]


class HeadTailTruncate:
    """Keep the first and last ``max_chars // 2`` characters of each long string result."""

    name = "truncate"
    strategy = "head-tail"
    may_break_cache = False  # a pure function of each result: what was sent stays the same
    readonly_input = True

    def __init__(self, max_chars: int = 10_000) -> None:
        self.max_chars = check_int("max_chars", max_chars, minimum=2)

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        half = self.max_chars // 2

        def cut(block: Mapping[str, Any]) -> str | None:
            text = block.get("content")
            if not isinstance(text, str) or len(text) <= self.max_chars:
                return None
            dropped = len(text) - 2 * half
            return f"{text[:half]}\n[... {dropped} characters truncated ...]\n{text[-half:]}"

        out = replace_results(messages, cut)
        if out is not messages:
            ctx.decide(self.name, Decision.TRUNCATE, Reason.OVER_TRIGGER)
        else:
            ctx.decide(self.name, Decision.SKIP, Reason.NOTHING_ELIGIBLE)
        return out


class ClearEveryTurn:
    """Past ``trigger_tokens``, clear every tool result but the newest ``keep``, every turn."""

    name = "microcompact"
    strategy = "clear-every-turn"
    may_break_cache = True
    readonly_input = True

    def __init__(self, keep: int = 3, trigger_tokens: int = 100_000) -> None:
        self.keep = check_int("keep", keep)
        self.trigger_tokens = check_int("trigger_tokens", trigger_tokens)

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        size = ctx.size_of(messages)
        if size < self.trigger_tokens:
            ctx.decide(self.name, Decision.SKIP, Reason.BELOW_TRIGGER, tokens_before=size)
            return messages
        ids = [b.get("tool_use_id") for m in messages for _, b in tool_results(m)]
        old = set(ids[: max(0, len(ids) - self.keep)])  # an id-less result counts, as None
        out = replace_results(
            messages, lambda b: CLEARED_PLACEHOLDER if b.get("tool_use_id") in old else None
        )
        changed = out is not messages
        ctx.decide(
            self.name,
            Decision.CLEAR if changed else Decision.SKIP,
            Reason.OVER_TRIGGER if changed else Reason.NOTHING_ELIGIBLE,
            tokens_before=size,
            facts={ATTR.CLEARED: len(old)},
        )
        return out
