"""The ``autocompact`` slot's server-side strategy (``server-compact``): the API summarises
the older context itself (Anthropic's compaction); nothing is edited locally."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline import Message, SessionContext
from pipeline.messages import COMPACTION_BLOCK
from pipeline.tracing import ATTR, Decision, Reason
from pipeline.wire.request_fields import ask_for_edit
from stages._shared import DEFAULT_CONTEXT_WINDOW, session_state
from stages._shared.args import check_bool, check_int

__all__ = ["COMPACTION_BETA", "COMPACT_EDIT", "ServerCompaction"]

COMPACTION_BETA = "compact-2026-01-12"
"""The ``anthropic-beta`` value that enables server-side compaction."""

COMPACT_EDIT = "compact_20260112"
"""The server-side context-management edit that compacts the context."""

_OUTPUT_RESERVE = 20_000  # the window kept for the reply, as the local strategy keeps it


class ServerCompaction:
    """Stage (strategy ``"server-compact"``): let the API compact the context (compaction).

    Edits nothing locally. Each pass asks for Anthropic's ``compact_20260112`` edit in
    ``ctx.report.request_extras["context_management"]`` and adds the ``compact-2026-01-12``
    beta; the agent, ``wrap`` and the proxy send both, merged with the client's own. When a
    request's input passes ``trigger_tokens``, the API summarises what came before into a
    ``compaction`` block at the start of its response and answers from the summary; the client
    sends the block back with the rest of the history, and the API reads the request from the
    block on (so does the token tracker). ``pause_after_compaction``: the API stops after the
    summary (``stop_reason="compaction"``) and the agent calls again; ``instructions``: what
    the summary should keep.

    ``trigger_tokens`` defaults to where the local strategy compacts: ``context_window`` less
    the reply's reserve (``min(max_output_tokens, 20,000)``) and ``buffer_tokens``. The API may
    refuse a trigger below its own minimum; that is its error, sent back as it came.

    Every pass emits one ``autocompact.<decision>`` span: ``compact`` (``server_compacted``)
    on the pass whose last assistant message holds a compaction block not told before, else
    ``delegate`` (``delegated``); with the trigger, whether the estimate is over it, and how
    many compaction blocks the history holds. ``may_break_cache``: the messages it returns are
    its input, byte for byte; the API's compaction starts a new cached prefix at the block.
    """

    name = "autocompact"
    rereads_outputs = False
    """It reads the request it is given, never an output another stage took out of it
    (:func:`~pipeline.core.rereading_stages`)."""
    strategy = "server-compact"
    may_break_cache = False
    readonly_input = True

    def __init__(
        self,
        *,
        context_window: int = DEFAULT_CONTEXT_WINDOW,
        max_output_tokens: int = 32_000,
        buffer_tokens: int = 13_000,
        trigger_tokens: int | None = None,
        instructions: str | None = None,
        pause_after_compaction: bool = False,
    ) -> None:
        check_int("context_window", context_window, minimum=1)
        check_int("max_output_tokens", max_output_tokens)
        check_int("buffer_tokens", buffer_tokens)
        if trigger_tokens is None:
            trigger_tokens = (
                context_window - min(max_output_tokens, _OUTPUT_RESERVE) - buffer_tokens
            )
            if trigger_tokens <= 0:
                raise ValueError(f"context_window {context_window} leaves no room to compact")
        self.trigger_tokens = check_int("trigger_tokens", trigger_tokens, minimum=1)
        if instructions is not None and not isinstance(instructions, str):
            raise ValueError(f"instructions must be a string, got {type(instructions).__name__}")
        self.instructions = instructions
        self.pause_after_compaction = check_bool("pause_after_compaction", pause_after_compaction)

    def __repr__(self) -> str:
        return (
            f"ServerCompaction(trigger_tokens={self.trigger_tokens}, "
            f"instructions={'set' if self.instructions else None}, "
            f"pause_after_compaction={self.pause_after_compaction})"
        )

    def edit(self) -> dict[str, Any]:
        """The ``compact_20260112`` edit (``BetaCompact20260112EditParam``); ``instructions``
        and ``pause_after_compaction`` only when set, so the API's defaults apply otherwise."""
        edit: dict[str, Any] = {
            "type": COMPACT_EDIT,
            "trigger": {"type": "input_tokens", "value": self.trigger_tokens},
        }
        if self.instructions:
            edit["instructions"] = self.instructions
        if self.pause_after_compaction:
            edit["pause_after_compaction"] = True
        return edit

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        ask_for_edit(ctx.report, self.edit(), COMPACTION_BETA)
        seen = session_state(ctx, self.name, _Seen, _Seen.restore)
        blocks = sum(1 for m in messages if m.type == "assistant" for _ in _compactions(m))
        newest = _newest_compaction(messages)
        tokens = ctx.size_of(messages)
        # the server compacted in the last response: its block, not one told before
        if newest is not None and newest != seen.last:
            decision, reason = Decision.COMPACT, Reason.SERVER_COMPACTED
        else:
            decision, reason = Decision.DELEGATE, Reason.DELEGATED
        seen.last = newest
        ctx.decide(
            self.name,
            decision,
            reason,
            tokens_before=tokens,
            tokens_after=tokens,
            facts={
                ATTR.STRATEGY: self.strategy,
                ATTR.TRIGGER_TOKENS: self.trigger_tokens,
                ATTR.OVER_TRIGGER: tokens >= self.trigger_tokens,
                ATTR.SERVER_COMPACTIONS: blocks,
            },
        )
        return messages


@dataclass(slots=True)
class _Seen:
    """The compaction block the session's last pass told of (its summary's digest)."""

    last: str | None = None

    @classmethod
    def restore(cls, _records: list[Mapping[str, Any]]) -> _Seen:
        return cls()


def _compactions(m: Message) -> list[Mapping[str, Any]]:
    content = m.content
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, Mapping) and b.get("type") == COMPACTION_BLOCK]


def _newest_compaction(messages: list[Message]) -> str | None:
    """The digest of the compaction block in the last assistant message, if it holds one (a
    block the server made in the last response: older ones were told when they came, or
    before a restart)."""
    for m in reversed(messages):
        if m.type != "assistant":
            continue
        found = _compactions(m)
        if not found:
            return None
        summary = str(found[-1].get("content") or "")
        return hashlib.sha256(summary.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return None
