"""An agent loop on ``anthropic.AsyncAnthropic`` that runs the pipeline before every call.

Each turn: the pipeline projects the history, ``to_api`` builds the request, the model answers,
its usage feeds the token tracker, every ``tool_use`` runs (parallel ones concurrently), each
result passes the per-tool gate as it is produced, and the results are appended in tool_use
order. The transcript (Claude Code JSONL) is appended as the loop goes, so a session can be
resumed with byte-identical budget decisions. The loop takes a :class:`Pipeline`; it never names
a concrete stage.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import anthropic
import anyio
import anyio.to_thread
from anthropic.types import ToolParam
from opentelemetry.trace import Status, StatusCode

from pipeline.agent.results import AgentAPIError, AgentResult, GatedResult, TurnLog
from pipeline.context import SessionContext
from pipeline.core import Pipeline
from pipeline.gate import gate_tool_result
from pipeline.messages import Block, Message, Usage, now_timestamp
from pipeline.readback import PersistedOutputReader
from pipeline.replacement import ReplacementState, decided_in
from pipeline.storage import FileToolResultStore
from pipeline.tokens import TokenTracker, calibration_path_for
from pipeline.tools import Tool
from pipeline.tracing import ATTR, SPAN_AGENT_TURN, SPAN_TOOL_EXECUTE, Decision, tool_span_name
from pipeline.transcript import TranscriptWriter, load_transcript
from pipeline.wire import WireCache, to_api

__all__ = ["CANCELLED_RESULT", "INTERRUPTED_RESULT", "Agent"]

CANCELLED_RESULT = "Tool execution was cancelled before it finished."
INTERRUPTED_RESULT = "Tool execution was interrupted (the session stopped before it finished)."


def _blocks_of(response: anthropic.types.Message) -> list[Block]:
    return [b.model_dump(mode="json", exclude_none=True) for b in response.content]


class Agent:
    """A tool-using agent whose every request goes through ``pipeline``.

    ``ctx`` carries the session: its store, ledger, transcript and tracer. Tools' declared
    ``max_result_size_chars`` are added to ``ctx.tool_policies``. With a file store, the
    read-back tool for persisted outputs is registered automatically (never persisted itself).
    """

    def __init__(
        self,
        client: anthropic.AsyncAnthropic,
        *,
        model: str,
        pipeline: Pipeline,
        ctx: SessionContext,
        tools: Iterable[Tool] = (),
        system: str | None = None,
        max_tokens: int = 4096,
        max_turns: int = 25,
        history: Sequence[Message] = (),
        readback: bool = True,
        on_turn: Callable[[TurnLog], None] | None = None,
    ) -> None:
        options = getattr(client, "open_telemetry", None)
        if isinstance(options, Mapping):
            # the SDK's own client span then carries gen_ai.conversation.id too
            client = client.with_options(
                open_telemetry={**options, "conversation_id": ctx.session_id}  # type: ignore[arg-type]
            )
        self.client = client
        self.on_turn = on_turn
        self.turns_done = 0
        self.model = model
        self.pipeline = pipeline
        self.ctx = ctx
        self._wire = WireCache()  # each request built from what changed since the last one
        self.system = system
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        self.history: list[Message] = list(history)
        self.tools: dict[str, Tool] = {}
        all_tools = list(tools)
        if readback and isinstance(ctx.store, FileToolResultStore):
            all_tools.append(PersistedOutputReader(ctx.store.directory).as_tool())
        for t in all_tools:
            self.add_tool(t)

    def add_tool(self, t: Tool) -> None:
        """Offer one more tool; its declared limit joins the session's tool policies."""
        if t.name in self.tools:
            raise ValueError(f"two tools are named {t.name!r}")
        self.tools[t.name] = t
        self.ctx.tool_policies = self.ctx.tool_policies.with_declared(
            t.name, t.max_result_size_chars
        )

    # -- resume -----------------------------------------------------------------------------
    @classmethod
    def resume(
        cls,
        transcript_path: str | os.PathLike[str],
        client: anthropic.AsyncAnthropic,
        *,
        model: str,
        pipeline: Pipeline,
        root: str | os.PathLike[str] = ".sluicegate",
        tools: Iterable[Tool] = (),
        **kwargs: Any,
    ) -> Agent:
        """Continue a session from its transcript with byte-identical budget decisions.

        The ledger is rebuilt from the transcript; a torn last line (a crash
        mid-write) is skipped; tool calls the crash left unanswered get an error result.
        """
        loaded = load_transcript(transcript_path, strict=False)
        if loaded.session_id is None:
            raise ValueError(f"{transcript_path}: no session id in the transcript")
        state = ReplacementState.reconstruct(
            loaded.messages,
            loaded.replacement_records,
            decided=decided_in(loaded.stage_records),
        )
        ctx = SessionContext(
            loaded.session_id,
            root,
            replacement_state=state,
            # the calibration saved with the session: a resumed session does not start cold
            token_tracker=TokenTracker.load(calibration_path_for(root, loaded.session_id)),
            transcript=TranscriptWriter(transcript_path, loaded.session_id),
            stage_records=loaded.stage_records,
        )
        agent = cls(client, model=model, pipeline=pipeline, ctx=ctx, tools=tools, **kwargs)
        agent.history = list(loaded.messages)
        missing = agent._unanswered_tool_uses()
        if missing:
            repair = Message.user(
                timestamp=now_timestamp(),
                content=[
                    {
                        "type": "tool_result",
                        "tool_use_id": tid,
                        "content": INTERRUPTED_RESULT,
                        "is_error": True,
                    }
                    for tid in missing
                ],
            )
            agent.history.append(repair)
            if ctx.transcript is not None:
                ctx.transcript.append_messages([repair])
        return agent

    def _unanswered_tool_uses(self) -> list[str]:
        """tool_use ids of the last response that no later tool_result answers."""
        request = to_api(self.history)
        if not request or request[-1]["role"] != "assistant":
            return []
        content: Any = request[-1]["content"]
        if isinstance(content, str):
            return []
        return [b["id"] for b in content if b.get("type") == "tool_use"]

    # -- the loop ---------------------------------------------------------------------------
    @property
    def tool_definitions(self) -> list[ToolParam]:
        """What goes in ``tools=[...]``."""
        return [t.definition for t in self.tools.values()]

    async def run(self, prompt: str | None = None) -> AgentResult:
        """Add ``prompt`` (if any) and loop until ``end_turn``, ``max_turns`` or cancellation."""
        if prompt is not None:
            await self._record([Message.user(prompt, timestamp=now_timestamp())])
        stop_reason = "max_turns"
        text = ""
        turns = 0
        while turns < self.max_turns:
            turns += 1
            response_msg = await self.turn()
            stop_reason = response_msg.stop_reason or "end_turn"
            text = "".join(
                b.get("text", "") for b in response_msg.blocks if b.get("type") == "text"
            )
            if not any(b.get("type") == "tool_use" for b in response_msg.blocks):
                break
        else:
            stop_reason = "max_turns"
        return AgentResult(stop_reason=stop_reason, turns=turns, text=text)

    async def turn(self) -> Message:
        """One model call and the tool calls it asks for. Returns the assistant message."""
        ctx = self.ctx
        with ctx.tracer.start_as_current_span(
            SPAN_AGENT_TURN,
            attributes={ATTR.CONVERSATION_ID: ctx.session_id, ATTR.REQUEST_MODEL: self.model},
            record_exception=False,  # exception text may quote content: status set by hand
            set_status_on_exception=False,
        ) as span:
            projected = await self.pipeline.run(self.history, ctx)
            request = self._wire.to_api(projected)
            self._wire.ensure_paired()
            estimated = ctx.report.estimated_tokens  # computed once, by the pipeline
            kwargs: dict[str, Any] = {}
            if self.system is not None:
                kwargs["system"] = self.system
            if self.tools:
                kwargs["tools"] = self.tool_definitions
            report = ctx.report  # what the stages asked of this request beyond its messages
            if report.request_extras:
                kwargs["extra_body"] = dict(report.request_extras)
            if report.betas:
                kwargs["extra_headers"] = {"anthropic-beta": ",".join(sorted(set(report.betas)))}
            try:
                response = await self.client.messages.create(
                    model=self.model, max_tokens=self.max_tokens, messages=request, **kwargs
                )
            except anthropic.APIError as exc:
                error = AgentAPIError.from_sdk(exc)
                span.set_attribute(ATTR.ERROR, error.kind)
                span.set_status(Status(StatusCode.ERROR, error.kind))
                ctx.logger.error(
                    "api_error", kind=error.kind, status=error.status, request_id=error.request_id
                )
                raise error from exc
            usage = Usage.from_mapping(response.usage.model_dump())
            message = Message.assistant(
                _blocks_of(response),
                message_id=response.id,
                usage=usage,
                model=response.model,
                stop_reason=response.stop_reason,
                timestamp=now_timestamp(),  # the idle-gap triggers read these
            )
            # the usage is of the request as sent (projected), not of the raw history
            observation = ctx.token_tracker.observe(
                projected, usage, model=response.model, tokens_freed=report.tokens_freed
            )
            if ctx.transcript is not None:  # resumable: keep the calibration with the session
                path = calibration_path_for(ctx.root, ctx.session_id, ctx.agent_id)
                await anyio.to_thread.run_sync(ctx.token_tracker.save, path)
            span.set_attribute(ATTR.RESPONSE_ID, response.id)
            span.set_attribute(ATTR.USAGE_INPUT_TOKENS, usage.input_side)
            span.set_attribute(ATTR.USAGE_OUTPUT_TOKENS, usage.output_tokens)
            await self._record([message])
            tool_uses = [b for b in message.blocks if b.get("type") == "tool_use"]
            gated: list[GatedResult] = []
            if tool_uses:
                await self._run_tools(tool_uses, gated)
            if self.on_turn is not None:
                self.on_turn(
                    TurnLog(
                        number=self.turns_done,
                        message_id=response.id,
                        request=request,
                        estimated_tokens=estimated,
                        usage=usage,
                        report=report,
                        gated=gated,
                        observation=observation,
                    )
                )
            self.turns_done += 1
            return message

    async def _record(self, messages: list[Message]) -> None:
        self.history.extend(messages)
        if self.ctx.transcript is not None:
            await anyio.to_thread.run_sync(self.ctx.transcript.append_messages, messages)

    async def _run_tools(self, tool_uses: list[Block], gated: list[GatedResult]) -> None:
        """Run every tool call concurrently; always answer each one, even on cancellation."""
        done: dict[str, Block] = {}
        try:
            async with anyio.create_task_group() as tg:
                for tu in tool_uses:
                    tg.start_soon(self._run_one, tu, done, gated)
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
                await self._record([Message.user(blocks, timestamp=now_timestamp())])

    async def _run_one(
        self, tool_use: Block, done: dict[str, Block], gated_log: list[GatedResult]
    ) -> None:
        ctx = self.ctx
        name = str(tool_use.get("name"))
        tool_use_id = str(tool_use["id"])
        with ctx.tracer.start_as_current_span(
            tool_span_name(name),
            attributes={
                ATTR.CONVERSATION_ID: ctx.session_id,
                ATTR.OPERATION_NAME: SPAN_TOOL_EXECUTE,
                ATTR.TOOL_NAME: name,
                ATTR.TOOL_CALL_ID: tool_use_id,
            },
        ) as span:
            block: Block = {"type": "tool_result", "tool_use_id": tool_use_id}
            t = self.tools.get(name)
            tool_input = tool_use.get("input")
            if t is None:
                block |= {"content": f"Error: there is no tool named {name!r}.", "is_error": True}
            elif not isinstance(tool_input, dict):
                block |= {"content": "Error: tool input must be a JSON object.", "is_error": True}
            else:
                try:
                    block["content"] = await t.handler(tool_input)
                except Exception as exc:  # the model sees the error; the loop goes on
                    block |= {"content": f"Error: {type(exc).__name__}: {exc}", "is_error": True}
                    span.set_attribute(ATTR.ERROR, type(exc).__name__)
            gated = await gate_tool_result(
                block, tool_name=name, threshold=ctx.tool_policies.threshold(name), store=ctx.store
            )
            span.set_attribute(ATTR.DECISION, str(gated.decision))
            span.set_attribute(ATTR.REASON, str(gated.reason))
            span.set_attribute(ATTR.CHARS, gated.size)
            if gated.path is not None:
                span.set_attribute(ATTR.PATH, gated.path)
            if gated.decision in (Decision.PERSIST, Decision.PERSIST_FAILED):
                log = ctx.logger.info if gated.decision is Decision.PERSIST else ctx.logger.warning
                log(
                    "tool_result_gate",
                    decision=gated.decision,
                    tool_use_id=tool_use_id,
                    tool_name=name,
                    chars=gated.size,
                    path=gated.path,
                    error=gated.error,
                )
            gated_log.append(GatedResult(tool_use_id, name, gated.decision, gated.size, gated.path))
            done[tool_use_id] = gated.block
