"""An agent loop on ``anthropic.AsyncAnthropic`` that runs the pipeline before every call.

Each turn: the pipeline projects the history, ``to_api`` builds the request, the model answers,
its usage feeds the token tracker, every ``tool_use`` runs (parallel ones concurrently; not
one a ``max_tokens`` stop may have cut off, answered with an error instead), each
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
from anthropic.types import MessageParam, ToolParam
from opentelemetry.trace import Status, StatusCode
from structlog.contextvars import bound_contextvars

from pipeline.agent.execution import CANCELLED_RESULT, cut_call, run_tool_calls
from pipeline.agent.repair import INTERRUPTED_RESULT
from pipeline.agent.response import call_messages
from pipeline.agent.results import AgentAPIError, AgentResult, GatedResult, TurnLog
from pipeline.agent.resume import (
    load_for_resume,
    load_stored_for_resume,
    resumed,
    store_root_of,
)
from pipeline.agent.retry import RetryPolicy
from pipeline.context import SessionContext
from pipeline.core import Pipeline
from pipeline.kept_list import KeptList
from pipeline.messages import Block, Message, holds_compaction, now_timestamp
from pipeline.spans import content_safe_span
from pipeline.store.sessions import SessionStorage, readback_for
from pipeline.tokens import calibration_path_for
from pipeline.tools import Tool
from pipeline.tracing import (
    ATTR,
    SPAN_AGENT_INVOKE,
    SPAN_AGENT_TURN,
    agent_span_name,
    bounded_attribute,
)
from pipeline.wire.cache import WireCache
from pipeline.wire.caching import place_cache_breakpoint
from pipeline.wire.encoding import encodable
from pipeline.wire.request_fields import merge_betas, merge_request_fields

__all__ = ["CANCELLED_RESULT", "INTERRUPTED_RESULT", "Agent", "readback_for", "store_root_of"]

_MAX_BREAKPOINTS = 4  # the API's limit of cache_control blocks per request


AGENT_NAME = "sluicegate"
"""``gen_ai.agent.name`` of the agent loop's spans."""


_CALL_AGAIN = frozenset({"compaction", "pause_turn"})
"""Stop reasons after which the API expects the same request again, with the response."""


class Agent:
    """A tool-using agent whose every request goes through ``pipeline``.

    ``ctx`` carries the session: its store, ledger, transcript and tracer. ``retry``: how
    a failed call is retried (none by default: the client's own retries apply); ``cache``: ask
    the API to cache each request's prefix (a ``cache_control`` breakpoint on its last block,
    while the request holds fewer than four). Tools' declared
    ``max_result_size_chars`` are added to ``ctx.tool_policies``. With a file store or an
    object store (:class:`~pipeline.store.objects.ObjectToolResultStore`), the read-back tool for
    persisted outputs is registered automatically (never persisted itself).
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
        retry: RetryPolicy | None = None,
        cache: bool = True,
    ) -> None:
        self.retry = retry or RetryPolicy()
        self.cache = cache
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
        self._turns_running = 0
        self._ids: set[str] = set()
        self._response_ids: set[str] = set()
        self._ids_seen: tuple[int, Message | None] = (0, None)
        self.system = system
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        # kept: the pipeline's logs ask it where it changed instead of sweeping it every turn
        self.history: list[Message] = KeptList(history)
        self.tools: dict[str, Tool] = {}
        all_tools = list(tools)
        reader = readback_for(ctx.store) if readback else None
        if reader is not None:
            all_tools.append(reader.as_tool())
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
        root: str | os.PathLike[str] | None = None,
        tools: Iterable[Tool] = (),
        **kwargs: Any,
    ) -> Agent:
        """Continue a session from its transcript with byte-identical budget decisions.

        The ledger is rebuilt from the transcript; a torn last line (a crash mid-write) is
        skipped. The tool pairing is repaired as :func:`~pipeline.agent.repair.repair_pairing`
        says (a tool call left unanswered anywhere gets an error result, a late result moves
        to its call, an orphan goes); a history it cannot repair (a tool_use id used twice)
        raises :class:`~pipeline.wire.pairing.PairingError` before anything is written. ``root``:
        the store root; by default the one the transcript lives in
        (``<root>/<session>/transcript.jsonl``), else ``.sluicegate``.
        """
        loaded, writer, root = load_for_resume(transcript_path, root)
        return resumed(
            cls,
            loaded,
            client,
            transcript=writer,
            root=root,
            model=model,
            pipeline=pipeline,
            tools=tools,
            **kwargs,
        )

    @classmethod
    def resume_from(
        cls,
        storage: SessionStorage,
        client: anthropic.AsyncAnthropic,
        *,
        model: str,
        pipeline: Pipeline,
        root: str | os.PathLike[str] = ".sluicegate",
        tools: Iterable[Tool] = (),
        **kwargs: Any,
    ) -> Agent:
        """:meth:`resume` from a session's records wherever they live (an object store's
        record log: :func:`~pipeline.store.sessions.open_session_state`), its results in
        ``storage.store``; the session continues appending there. ``root``: the local
        directory of the token calibration. Blocking (the records are loaded): call it before
        the event loop runs, or in a worker thread. ``ValueError`` when nothing is recorded.
        Nothing locks the session: running two agents on it at once is the caller's to avoid.
        """
        return resumed(
            cls,
            load_stored_for_resume(storage),
            client,
            transcript=storage.records,
            root=root,
            store=storage.store,
            model=model,
            pipeline=pipeline,
            tools=tools,
            **kwargs,
        )

    # -- the loop ---------------------------------------------------------------------------
    @property
    def tool_definitions(self) -> list[ToolParam]:
        """What goes in ``tools=[...]``."""
        return [t.definition for t in self.tools.values()]

    async def run(self, prompt: str | None = None) -> AgentResult:
        """Add ``prompt`` (if any) and loop until ``end_turn``, ``max_turns`` or cancellation;
        a paused response (``stop_reason`` ``compaction`` or ``pause_turn``) is called again.

        Traced as one GenAI ``invoke_agent sluicegate`` span, the turns its children."""
        ctx = self.ctx
        with content_safe_span(
            ctx.tracer,
            agent_span_name(AGENT_NAME),
            attributes={
                ATTR.CONVERSATION_ID: ctx.session_id,
                ATTR.OPERATION_NAME: SPAN_AGENT_INVOKE,
                ATTR.AGENT_NAME: AGENT_NAME,
                ATTR.PROVIDER_NAME: "anthropic",
                ATTR.REQUEST_MODEL: self.model,
            },
        ):
            return await self._run(prompt)

    async def _run(self, prompt: str | None) -> AgentResult:
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
            if stop_reason in _CALL_AGAIN:
                continue  # the API paused (after a server compaction, or a server tool's turn)
            if not any(b.get("type") == "tool_use" for b in response_msg.blocks):
                break
        else:
            stop_reason = "max_turns"
        return AgentResult(stop_reason=stop_reason, turns=turns, text=text)

    async def turn(self) -> Message:
        """One model call and the tool calls it asks for. Returns the assistant message."""
        # the request cache's own list serves one turn at a time: a turn that starts while
        # another runs (two runs of one agent) sends a list of its own, as a retry must resend
        # the same request
        self._turns_running += 1
        try:
            return await self._turn(shared=self._turns_running == 1)
        finally:
            self._turns_running -= 1

    async def _turn(self, *, shared: bool) -> Message:
        ctx = self.ctx
        ctx.call = self.turns_done  # every span of this turn's pass carries it, every log line
        with (
            bound_contextvars(call=self.turns_done),
            content_safe_span(
                ctx.tracer,
                SPAN_AGENT_TURN,
                attributes={**ctx.span_attributes(), ATTR.REQUEST_MODEL: self.model},
            ) as span,
        ):
            definitions = self.tool_definitions  # built once a turn: counted, then sent
            ctx.token_tracker.set_request(system=self.system, tools=definitions)
            projected = await self.pipeline.run(self.history, ctx, shared=True)
            # held: the tracker observes it after the API call, and another pass on this context
            # (a preview of the next request, say) may run during that await and copy it first
            held = ctx.hold(projected)
            # the cache's own list, updated in place: a new list per turn grew with the history
            request = self._wire.to_api(projected, shared=shared)
            self._wire.ensure_paired()
            if self.cache and self._wire.breakpoints < _MAX_BREAKPOINTS:
                marked = place_cache_breakpoint(request)  # the stable prefix, read next turn
                if marked is not None and shared:
                    self._wire.replaced(marked)  # the next request restores that message
            estimated = ctx.report.estimated_tokens  # computed once, by the pipeline
            kwargs: dict[str, Any] = {}
            # what the caller gave goes over the wire too: it must encode like the messages
            if self.system is not None:
                kwargs["system"] = encodable(self.system)
            if self.tools:
                kwargs["tools"] = encodable(definitions)
            report = ctx.report  # what the stages asked of this request beyond its messages
            if report.request_extras:
                kwargs["extra_body"] = merge_request_fields({}, report.request_extras)
            if report.betas:
                kwargs["extra_headers"] = {"anthropic-beta": merge_betas(None, report.betas)}
            try:
                message = await self._call(request, kwargs)
            except AgentAPIError as error:
                span.set_attribute(ATTR.ERROR, error.kind)
                span.set_status(Status(StatusCode.ERROR, error.kind))
                ctx.logger.error(
                    "api_error", kind=error.kind, status=error.status, request_id=error.request_id
                )
                raise
            usage, model, message_id = message.usage, message.model, message.message_id
            assert usage is not None and model is not None and message_id is not None
            # the usage is of the request as sent (projected), not of the raw history
            observation = ctx.token_tracker.observe(
                held.messages,
                usage,
                model=model,
                tokens_freed=report.tokens_freed,
                compacted=holds_compaction(message),
            )
            held.release()  # (after a failed call, the next pass lets it go)
            if ctx.transcript is not None:  # resumable: keep the calibration with the session
                path = calibration_path_for(ctx.root, ctx.session_id, ctx.agent_id)
                await anyio.to_thread.run_sync(ctx.token_tracker.save, path)
            span.set_attribute(ATTR.RESPONSE_ID, bounded_attribute(message_id))
            # the SDK's own client span reports the GenAI usage: not repeated here (a backend
            # would count the cost twice); the context size it measured is ours to report
            span.set_attribute(ATTR.INPUT_SIDE_TOKENS, usage.input_side)
            await self._record([message])
            tool_uses = [b for b in message.blocks if b.get("type") == "tool_use"]
            gated: list[GatedResult] = []
            if tool_uses:
                await self._run_tools(tool_uses, gated, refused=cut_call(message))
            if self.on_turn is not None:
                self.on_turn(
                    TurnLog(
                        number=self.turns_done,
                        message_id=message_id,
                        request=list(request),  # the observer's own: the next turn reuses it
                        estimated_tokens=estimated,
                        usage=usage,
                        report=report,
                        gated=gated,
                        observation=observation,
                    )
                )
            self.turns_done += 1
            return message

    async def _call(self, request: list[MessageParam], kwargs: dict[str, Any]) -> Message:
        """The call, retried as :attr:`retry` allows; the response as a record."""
        attempt = 0
        while True:
            try:
                return await call_messages(
                    self.client,
                    request,
                    model=self.model,
                    max_tokens=self.max_tokens,
                    known_ids=self._known_ids,  # read when the response has arrived
                    **kwargs,
                )
            except AgentAPIError as error:
                attempt += 1
                wait = self.retry.wait_before(attempt, error.kind, error.retry_after)
                if wait is None:
                    raise
                self.ctx.logger.warning(
                    "api_retry", kind=error.kind, status=error.status, attempt=attempt, wait_s=wait
                )
                await anyio.sleep(wait)

    def _known_ids(self) -> tuple[set[str], set[str]]:
        """Every tool_use id of the history (a response reusing one could never be answered,
        and the ledger keys decisions by id) and every response id (one reused would merge
        two responses), kept up to date as the history grows."""
        history, seen = self.history, self._ids_seen
        if seen[0] > len(history) or (seen[0] and history[seen[0] - 1] is not seen[1]):
            self._ids.clear()  # not the history last seen grown: read it again
            self._response_ids.clear()
            seen = (0, None)
        for i in range(seen[0], len(history)):
            m = history[i]
            if m.type != "assistant":
                continue
            if m.message_id is not None:
                self._response_ids.add(m.message_id)
            if isinstance(m.content, list):
                self._ids.update(
                    b["id"]
                    for b in m.content
                    if b.get("type") == "tool_use" and isinstance(b.get("id"), str)
                )
        self._ids_seen = (len(history), history[-1] if history else None)
        return self._ids, self._response_ids

    async def _record(self, messages: list[Message]) -> None:
        self.history.extend(messages)
        if self.ctx.transcript is not None:
            await anyio.to_thread.run_sync(self.ctx.transcript.append_messages, messages)

    async def _run_tools(
        self, tool_uses: list[Block], gated: list[GatedResult], *, refused: dict[str, str]
    ) -> None:
        """Run every tool call concurrently (but those ``refused``, answered with their error);
        always answer each one, even on cancellation."""
        await run_tool_calls(self.ctx, self.tools, tool_uses, gated, self._record, refused=refused)
