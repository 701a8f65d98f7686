"""The agent's tool calls: run concurrently, each traced as a GenAI ``execute_tool`` span and
passed through the per-tool gate as it is produced; every call answered, even on
cancellation."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping

import anyio

from pipeline.agent.results import GatedResult
from pipeline.context import SessionContext
from pipeline.gate import gate_tool_result
from pipeline.messages import Block, Message, now_timestamp
from pipeline.spans import content_safe_span
from pipeline.tools import Tool
from pipeline.tracing import (
    ATTR,
    SPAN_TOOL_EXECUTE,
    Decision,
    bounded_attribute,
    limit_attribute,
    size_facts,
    tool_span_name,
)

__all__ = ["CANCELLED_RESULT", "CUT_CALL_RESULT", "cut_call", "execute_tool_call", "run_tool_calls"]

CANCELLED_RESULT = "Tool execution was cancelled before it finished."


async def run_tool_calls(
    ctx: SessionContext,
    tools: Mapping[str, Tool],
    tool_uses: list[Block],
    gated: list[GatedResult],
    record: Callable[[list[Message]], Awaitable[None]],
    *,
    refused: Mapping[str, str] | None = None,
) -> None:
    """Run every tool call concurrently and ``record`` one user message answering them all,
    also when cancelled (a call that did not finish gets :data:`CANCELLED_RESULT`).
    ``refused``: calls not to run, by id, each answered with its error text instead."""
    done: dict[str, Block] = {
        tid: {"type": "tool_result", "tool_use_id": tid, "content": text, "is_error": True}
        for tid, text in (refused or {}).items()
    }
    try:
        async with anyio.create_task_group() as tg:
            for tu in tool_uses:
                if tu["id"] not in done:
                    tg.start_soon(execute_tool_call, ctx, tools, tu, done, gated)
    finally:
        blocks = [
            done.get(tu["id"])
            or {
                "type": "tool_result",
                "tool_use_id": tu["id"],
                "content": CANCELLED_RESULT,
                "is_error": True,
            }
            for tu in tool_uses
        ]
        with anyio.CancelScope(shield=True):
            await record([Message.user(blocks, timestamp=now_timestamp())])


async def execute_tool_call(
    ctx: SessionContext,
    tools: Mapping[str, Tool],
    tool_use: Block,
    done: dict[str, Block],
    gated_log: list[GatedResult],
) -> None:
    """Run one tool call, gate its result, put the answer in ``done`` and the gate's decision
    in ``gated_log``."""
    name = str(tool_use.get("name"))
    tool_use_id = str(tool_use["id"])
    with content_safe_span(
        ctx.tracer,
        tool_span_name(name),
        attributes={
            **ctx.span_attributes(),
            ATTR.OPERATION_NAME: SPAN_TOOL_EXECUTE,
            ATTR.TOOL_NAME: bounded_attribute(name),
            ATTR.TOOL_CALL_ID: bounded_attribute(tool_use_id),
            ATTR.TOOL_TYPE: "function",
        },
    ) as span:
        ctx.remember_tool_span(tool_use_id, span)
        block: Block = {"type": "tool_result", "tool_use_id": tool_use_id}
        t = tools.get(name)
        tool_input = tool_use.get("input")
        if t is None:
            block |= {"content": f"Error: there is no tool named {name!r}.", "is_error": True}
        elif not isinstance(tool_input, dict):
            block |= {"content": "Error: tool input must be a JSON object.", "is_error": True}
        else:
            try:
                block["content"] = _checked_output(await t.handler(tool_input))
            except Exception as exc:  # the model sees the error; the loop goes on
                block |= {"content": f"Error: {type(exc).__name__}: {exc}", "is_error": True}
                span.set_attribute(ATTR.ERROR, type(exc).__name__)
        gated = await gate_tool_result(
            block, tool_name=name, threshold=ctx.tool_policies.threshold(name), store=ctx.store
        )
        limit = limit_attribute(gated.threshold)
        replaced = gated.block.get("content") if gated.path is not None else None
        shown = len(replaced) if isinstance(replaced, str) else None
        facts = size_facts(gated.size, limit, replacement_chars=shown)
        span.set_attributes(
            {ATTR.DECISION: str(gated.decision), ATTR.REASON: str(gated.reason), **facts}
        )
        if gated.path is not None:
            span.set_attribute(ATTR.PATH, gated.path)
        if gated.decision in (Decision.PERSIST, Decision.PERSIST_FAILED):
            log = ctx.logger.info if gated.decision is Decision.PERSIST else ctx.logger.warning
            log(
                "tool_result_gate",
                decision=gated.decision,
                reason=gated.reason,
                tool_use_id=tool_use_id,
                tool_name=name,
                chars=gated.size,
                limit=limit,
                path=gated.path,
                error=gated.error,
            )
        gated_log.append(GatedResult(tool_use_id, name, gated.decision, gated.size, gated.path))
        done[tool_use_id] = gated.block


class ToolOutputError(TypeError):
    """A tool returned what is neither text nor JSON content blocks."""


def _checked_output(output: object) -> object:
    """``output`` when a tool_result can carry it (text, a list of JSON blocks, or None: an
    empty result); :class:`ToolOutputError` otherwise, which the model sees as the call's
    error -- the turn and the other calls' results go on."""
    if output is None or isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(b, dict) for b in output):
        try:
            json.dumps(output, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ToolOutputError(f"the tool returned blocks JSON cannot carry ({exc})") from None
        return output
    raise ToolOutputError(f"the tool returned {type(output).__name__}, not text or blocks")


CUT_CALL_RESULT = (
    "Error: not run: the response reached max_tokens while this call was written, so its "
    "input may be incomplete. Call the tool again."
)
"""What a tool call cut off by ``max_tokens`` is answered with, instead of being run."""


def cut_call(message: Message) -> dict[str, str]:
    """The call a response cut off at ``max_tokens`` may hold half-written (its last block,
    when that is a tool_use): never run on an input that may be incomplete."""
    blocks = message.blocks
    if message.stop_reason != "max_tokens" or not blocks:
        return {}
    last = blocks[-1]
    if last.get("type") != "tool_use" or not isinstance(last.get("id"), str):
        return {}
    return {last["id"]: CUT_CALL_RESULT}
