"""The ``microcompact`` slot's server-side strategy (``server-clear``): the API clears old tool
results itself (Anthropic's context editing); nothing is edited locally."""

from __future__ import annotations

from typing import Any

from pipeline import Message, SessionContext
from pipeline.tracing import ATTR, Decision, Reason
from pipeline.wire.request_fields import ask_for_edit
from stages._shared import tool_results
from stages._shared.args import check_bool, check_int, check_names

__all__ = ["CLEAR_TOOL_USES_EDIT", "CONTEXT_MANAGEMENT_BETA", "ServerSideMicrocompact"]

CONTEXT_MANAGEMENT_BETA = "context-management-2025-06-27"
"""The ``anthropic-beta`` value that enables server-side context editing."""

CLEAR_TOOL_USES_EDIT = "clear_tool_uses_20250919"
"""The server-side context-editing strategy that clears old tool results."""


class ServerSideMicrocompact:
    """Stage (strategy ``"server-clear"``): let the API clear old tool results (context editing).

    Edits nothing locally. Each pass asks for Anthropic's ``clear_tool_uses_20250919`` edit in
    ``ctx.report.request_extras["context_management"]`` and adds the
    ``context-management-2025-06-27`` beta; the agent sends both with the request. When the
    request's input passes ``trigger_tokens``, the server replaces the oldest tool results
    (all tools but ``exclude_tools``; also their inputs if ``clear_tool_inputs``) with a
    placeholder, keeping the newest ``keep`` tool uses, and only if it can clear at least
    ``clear_at_least`` tokens (``0`` omits that floor).

    ``may_break_cache = False`` is a statement about THIS stage: the messages it returns are its
    input, byte for byte, so the local invariant "content once sent never changes" holds. The
    server may still invalidate its cached prefix when it clears; ``clear_at_least`` is the lever
    that keeps such breaks worth their cost. Defaults: the API's trigger (100,000 input tokens),
    the reference ``keep`` of 5 and the same 20,000-token floor as ``Microcompact``.

    Every pass emits ``microcompact.delegate`` (reason ``delegated``).
    """

    name = "microcompact"
    rereads_outputs = False
    """It reads the request it is given, never an output another stage took out of it
    (:func:`~pipeline.core.rereading_stages`)."""
    strategy = "server-clear"
    may_break_cache = False
    readonly_input = True

    def __init__(
        self,
        *,
        trigger_tokens: int = 100_000,
        keep: int = 5,
        clear_at_least: int = 20_000,
        exclude_tools: tuple[str, ...] | str = (),
        clear_tool_inputs: bool = False,
    ) -> None:
        self.trigger_tokens = check_int("trigger_tokens", trigger_tokens, minimum=1)
        self.keep = check_int("keep", keep)
        self.clear_at_least = check_int("clear_at_least", clear_at_least)
        self.exclude_tools = check_names("exclude_tools", exclude_tools, allow_empty=True)
        self.clear_tool_inputs = check_bool("clear_tool_inputs", clear_tool_inputs)

    def __repr__(self) -> str:
        return (
            f"ServerSideMicrocompact(trigger_tokens={self.trigger_tokens}, keep={self.keep}, "
            f"clear_at_least={self.clear_at_least}, exclude_tools={self.exclude_tools!r}, "
            f"clear_tool_inputs={self.clear_tool_inputs})"
        )

    def edit(self) -> dict[str, Any]:
        """The ``clear_tool_uses_20250919`` edit (``BetaClearToolUses20250919EditParam``).

        ``clear_at_least`` is left out when 0 and ``exclude_tools`` when empty, so the API's own
        defaults apply rather than an explicit "none"."""
        edit: dict[str, Any] = {
            "type": CLEAR_TOOL_USES_EDIT,
            "trigger": {"type": "input_tokens", "value": self.trigger_tokens},
            "keep": {"type": "tool_uses", "value": self.keep},
        }
        if self.clear_at_least:
            edit["clear_at_least"] = {"type": "input_tokens", "value": self.clear_at_least}
        if self.exclude_tools:
            edit["exclude_tools"] = list(self.exclude_tools)
        edit["clear_tool_inputs"] = self.clear_tool_inputs
        return edit

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        ask_for_edit(ctx.report, self.edit(), CONTEXT_MANAGEMENT_BETA)

        tokens = ctx.size_of(messages)
        ctx.decide(
            self.name,
            Decision.DELEGATE,
            Reason.DELEGATED,
            tokens_before=tokens,
            tokens_after=tokens,
            facts={
                ATTR.STRATEGY: self.strategy,
                ATTR.CLEARED: 0,
                ATTR.KEPT: sum(1 for m in messages for _ in tool_results(m)),
                ATTR.TRIGGER_TOKENS: self.trigger_tokens,
                ATTR.KEEP: self.keep,
                ATTR.CLEAR_AT_LEAST: self.clear_at_least,
                ATTR.OVER_TRIGGER: tokens >= self.trigger_tokens,
            },
        )
        return messages
