"""The live demo: the agent loop on the real SDK against the scripted local Messages server.

The server answers with the responses of the generated demo session (ten parallel ~40K-char
job logs, a ~56K Read, an ~80K Bash output...) and the tools return that session's outputs, so
the budget meets realistic traffic over real HTTP with no key and no network.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline._cli.demo_session import DemoSession
from pipeline.agent import Agent, TurnLog
from pipeline.context import PersistedResult, SessionContext
from pipeline.core import Pipeline
from pipeline.messages import Block, Content
from pipeline.policies import (
    CLAUDE_CODE_DECLARED,
    UNDECLARED_MAX_RESULT_SIZE_CHARS,
    ToolPolicies,
)
from pipeline.testing import Reply, ScriptedMessagesServer, ScriptError
from pipeline.tools import Tool, ToolOutput
from pipeline.tracing import Decision, Reason, limit_attribute
from pipeline.transcript.replay import Call, CallResult

if TYPE_CHECKING:
    import anthropic

__all__ = ["LiveDemo", "call_result", "demo_replies", "demo_tools", "gate_persisted"]

SYSTEM_PROMPT = "You are a careful coding agent working in the ledgerline repository."


def demo_replies(session: DemoSession) -> list[Reply]:
    """The session's responses in order: one reply per response id, its fragments merged."""
    order: list[str] = []
    blocks: dict[str, list[Block]] = {}
    stops: dict[str, str] = {}
    for m in session.messages:
        if m.type != "assistant" or m.message_id is None:
            continue
        if m.message_id not in blocks:
            order.append(m.message_id)
            blocks[m.message_id] = []
        blocks[m.message_id].extend(m.blocks)
        if m.stop_reason:
            stops[m.message_id] = m.stop_reason
    return [Reply(blocks[i], stops.get(i, "tool_use")) for i in order]


def _outputs_by_call(session: DemoSession) -> dict[tuple[str, str], Content]:
    """(tool name, JSON of its input) → the output the session recorded for it."""
    uses: dict[str, tuple[str, str]] = {}
    outputs: dict[tuple[str, str], Content] = {}
    for m in session.messages:
        for b in m.blocks if m.type in ("assistant", "user") else []:
            if b.get("type") == "tool_use":
                uses[b["id"]] = (b["name"], json.dumps(b["input"], sort_keys=True))
            elif b.get("type") == "tool_result" and b["tool_use_id"] in uses:
                outputs[uses[b["tool_use_id"]]] = b.get("content") or ""
    return outputs


def demo_tools(session: DemoSession) -> list[Tool]:
    """One tool per tool name in the session, returning the recorded outputs.

    Each declares Claude Code's limit for its name (``Read`` never persisted, ``Bash`` 30,000,
    ``Grep`` 20,000, others the cap).
    """
    outputs = _outputs_by_call(session)
    tools: list[Tool] = []
    for name in sorted({n for n, _ in outputs}):

        def make(tool_name: str) -> Callable[[dict[str, Any]], Any]:
            async def handler(tool_input: dict[str, Any]) -> ToolOutput:
                key = (tool_name, json.dumps(tool_input, sort_keys=True))
                if key not in outputs:
                    raise ValueError(f"the demo has no recorded output for this {tool_name} call")
                out = outputs[key]
                return out if isinstance(out, str) else list(out)

            return handler

        tools.append(
            Tool(
                name=name,
                description=f"The demo's {name} tool (replays recorded output).",
                input_schema={"type": "object"},
                handler=make(name),
                max_result_size_chars=CLAUDE_CODE_DECLARED.get(
                    name, UNDECLARED_MAX_RESULT_SIZE_CHARS
                ),
            )
        )
    return tools


def call_result(log: TurnLog, previous_gate: list[PersistedResult]) -> CallResult:
    """A turn in the replay's terms. Results the gate persisted after the previous response are
    counted for this call: this is the first request that carries their replacement."""
    return CallResult(
        call=Call(log.number, log.message_id, -1, log.usage),
        request=log.request,
        estimated_tokens=log.estimated_tokens,
        persisted=[*previous_gate, *log.report.persisted],
        reapplied=log.report.reapplied,
        persist_failed=list(log.report.persist_failed),
        observations={} if log.observation is None else {"default": log.observation},
    )


def gate_persisted(log: TurnLog, policies: ToolPolicies | None = None) -> list[PersistedResult]:
    """The tool results the per-tool gate persisted after this turn's response (with the
    limit that applied, when ``policies`` are given)."""

    def limit(tool_name: str | None) -> int | None:
        return None if policies is None else limit_attribute(policies.threshold(tool_name))

    return [
        PersistedResult(
            g.tool_use_id, g.tool_name, g.chars, g.path, str(Reason.PER_TOOL), limit(g.tool_name)
        )
        for g in log.gated
        if g.decision == Decision.PERSIST and g.path is not None
    ]


@dataclass(slots=True)
class LiveDemo:
    """Runs the demo session live; ``on_call`` sees each call as a :class:`CallResult`."""

    session: DemoSession
    pipeline: Pipeline
    ctx: SessionContext
    on_call: Callable[[CallResult], None]

    def _script(self) -> Callable[[dict[str, Any]], Reply | ScriptError]:
        replies = demo_replies(self.session)

        def script(body: dict[str, Any]) -> Reply | ScriptError:
            k = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
            if k >= len(replies):
                return ScriptError(400, "invalid_request_error", "the demo script has ended")
            return replies[k]

        return script

    async def run(self, client_factory: Callable[[str], anthropic.AsyncAnthropic]) -> int:
        """Serve the script, run the agent to the end; return the number of calls made."""
        pending: list[PersistedResult] = []

        def observe(log: TurnLog) -> None:
            nonlocal pending
            self.on_call(call_result(log, pending))
            pending = gate_persisted(log, self.ctx.tool_policies)

        prompt = next(m for m in self.session.messages if m.type == "user")
        text = prompt.content if isinstance(prompt.content, str) else ""
        with ScriptedMessagesServer(self._script()) as server:
            # closed in the loop that opened its connections, not by the collector later
            async with client_factory(server.base_url) as client:
                agent = Agent(
                    client,
                    model="claude-sonnet-4-6",
                    pipeline=self.pipeline,
                    ctx=self.ctx,
                    tools=demo_tools(self.session),
                    system=SYSTEM_PROMPT,
                    max_turns=len(demo_replies(self.session)),
                    on_turn=observe,
                )
                result = await agent.run(text)
        return result.turns
