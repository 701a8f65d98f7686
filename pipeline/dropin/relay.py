"""Relaying an upstream response to the proxy's client: passed on as it arrives, its id and
usage read on the way for the conversation's session, its end reported (see
:func:`relay`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx2
from opentelemetry import trace
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pipeline.dropin.adapter import Call, WireSession
from pipeline.dropin.event_stream import EventStreamUsage
from pipeline.dropin.limits import MAX_ANSWER_BYTES
from pipeline.dropin.wire_request import CLIENT_LEFT, WireRequest
from pipeline.logs import get_logger
from pipeline.wire.encoding import loads_body

__all__ = ["relay"]

# length and hop-by-hop headers are the proxy's own business on its side
_DROP_RESPONSE = {"content-length", "connection", "transfer-encoding", "content-encoding"}


def relay(
    upstream: httpx2.Response,
    session: WireSession | None = None,
    call: Call | None = None,
    call_request: WireRequest | None = None,
    *,
    end: Callable[[str | None], None] | None = None,
    after: Callable[[], Awaitable[None]] | None = None,
    logger: Any = None,
    max_answer_bytes: int = MAX_ANSWER_BYTES,
) -> Response:
    """The upstream response passed on; a 200 from ``/v1/messages`` read for its id and usage
    on the way, and observed by the session (its record written where other workers read it
    before the client can see the end; on a store of this process alone, written with the
    token tracker's learning once the client has the response: ``observe_async(...,
    defer=True)``): an event stream passes chunk by chunk as it arrives, the chunk that
    completes the usage (``message_delta``) once observed; a JSON body is passed on whole
    once read, and observed after it where the session's records may wait for the client
    (``WireSession.records_wait``; the session's next pass waits for it:
    ``WireSession.answer_out``), before it elsewhere.
    ``end``: called once the body has gone by (or the client left), with the type of the
    error that cut the upstream's body (None: it was not cut); ``after``: awaited after that,
    once the client has the whole response (the session's
    :meth:`~pipeline.dropin.adapter.WireSession.settle`); ``logger``: where a body the
    upstream cut is told (default: the library's); ``max_answer_bytes``: past this many bytes
    a JSON body is no longer held to be read, but passed on as it comes, unread (a warning,
    ``wire.answer_too_large``): what an upstream answers cannot make the proxy hold more."""
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE}
    answered = session is not None and upstream.status_code == 200
    reader = _UsageReader(session, call, call_request) if session is not None and answered else None
    streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def body() -> AsyncIterator[bytes]:
        unread: tuple[bytes, object] | None = None  # a JSON answer the client has, to read
        try:
            held: list[bytes] = []
            size, unheld = 0, False
            cuts = _until_cut(upstream, relayed, call_request, logger or get_logger())
            async for chunk in cuts:
                if reader is None or unheld:
                    yield chunk
                elif streamed:
                    reader.events.feed(chunk)
                    if reader.events.final:
                        await reader.events.aclose()  # once; the client has not seen the end
                    yield chunk
                else:
                    held.append(chunk)
                    size += len(chunk)
                    if size > max_answer_bytes:  # no Messages answer is this large: not read
                        unheld = True
                        (logger or get_logger()).warning(
                            "wire.answer_too_large", bytes=size, max_answer_bytes=max_answer_bytes
                        )
                        yield b"".join(held)
                        held = []
            if reader is not None and not unheld and not (relayed.cut and not streamed):
                if streamed:
                    await reader.events.aclose()  # a stream that ended without message_delta
                else:
                    whole = b"".join(held)
                    if not reader.session.records_wait:
                        # its record first: another worker serving the next call must find
                        # it, or each record is durable before the proxy goes on
                        await reader.observe_json(whole)
                    else:  # read once the client has it; the next pass waits for that
                        unread = (whole, reader.session.answer_out())
                    relayed.whole = True  # the client has all once it has this
                    yield whole
            if not relayed.cut:
                # all of it has gone: the response ends here, before the request's end (its
                # span, metrics and log line) rather than after it
                relayed.whole = True
                yield b""
        except BaseException as exc:
            # closed, or cancelled while it waited on the upstream, before its end: the client
            # went away meanwhile
            left = isinstance(exc, GeneratorExit | anyio.get_cancelled_exc_class())
            if left and not (relayed.ended or relayed.cut):
                relayed.cut_by = CLIENT_LEFT
            raise
        finally:
            # each runs, whatever the one before it raised; the last pushed runs first
            async with contextlib.AsyncExitStack() as ends:
                if reader is not None:
                    # the client has the response (or has left): what waited for it, now
                    ends.push_async_callback(reader.session.catch_up)
                if end is not None:
                    ends.callback(end, relayed.cut_by)
                ends.push_async_callback(upstream.aclose)
                if unread is not None and reader is not None:
                    ends.callback(reader.session.answer_read, unread[1])
                    ends.push_async_callback(reader.observe_json, unread[0])

    relayed = _Relayed(
        body(),
        status_code=upstream.status_code,
        headers=headers,
        background=None if after is None else BackgroundTask(after),
    )
    relayed.held = reader is not None and not streamed
    return relayed


class _Relayed(StreamingResponse):
    """A relayed response that ends as the upstream's did: when the upstream's body was cut,
    the client's is cut too (its connection closed without the body's end), not ended clean."""

    cut = False
    cut_by: str | None = None
    """The type of the error that cut the upstream's body."""
    whole = False
    """Set by the body before it yields its last chunk, when it knows that one is the last: the
    chunk then ends the response, and what the body does after it (the request's end: its
    span, metrics and log line) is no longer between the client and its response."""
    ended = False
    """Whether the client was sent the response's end (else it went away before)."""
    held = False
    """Whether the body is read whole before any of it is sent (a JSON answer, recorded
    first): nothing is left for a client's leaving to stop, so no task listens for it."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.held:
            await super().__call__(scope, receive, send)
            return
        # Starlette streams in a task group with a second task listening for a disconnect (an
        # ASGI server before spec 2.4): two tasks and a cancel scope a request, for a body
        # that is sent in one piece once it is all here
        try:
            await self.stream_response(send)
        except OSError:  # a server of ASGI spec 2.4 tells a client gone so: as Starlette does
            raise ClientDisconnect() from None
        if self.background is not None:
            await self.background()

    async def stream_response(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        body = self.body_iterator
        try:
            async for chunk in body:
                more = not self.whole
                await send({"type": "http.response.body", "body": chunk, "more_body": more})
                if not more:
                    self.ended = True
                    break
            else:
                if not self.cut:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    self.ended = True
        finally:
            if isinstance(body, AsyncGenerator):
                # its end (the upstream closed, the request's end told): once the client has
                # all of it, or at once when sending to the client failed or was cancelled (a
                # client gone); shielded, since the server tells the response's end as a
                # disconnect, which cancels this task
                with anyio.CancelScope(shield=True):
                    await body.aclose()


async def _until_cut(
    upstream: httpx2.Response, relayed: _Relayed, request: WireRequest | None, logger: Any
) -> AsyncIterator[bytes]:
    """The upstream's body; a body cut on the way (the network, the upstream) ends it with one
    warning, marks the client's response cut and the request failed."""
    try:
        async for chunk in upstream.aiter_bytes():
            yield chunk
    except httpx2.TransportError as exc:
        relayed.cut, relayed.cut_by = True, type(exc).__name__
        if request is None:
            logger.warning("wire.upstream_cut", error=relayed.cut_by)
            return
        request.cut_off(relayed.cut_by)
        # the line names the request's trace, as its wire.request line does
        with trace.use_span(request.span, end_on_exit=False):
            logger.warning("wire.upstream_cut", error=relayed.cut_by)


class _UsageReader:
    """The response's id, model and usage, read as the bytes go by."""

    def __init__(
        self, session: WireSession, call: Call | None, request: WireRequest | None
    ) -> None:
        # what can wait until the client has the response waits for the relayed body's end
        self.events = EventStreamUsage(session, call, request, defer=True)
        self.session, self.call, self.request = session, call, request

    async def observe_json(self, body: bytes) -> None:
        """A JSON body's id and usage to the session (nothing when it holds none)."""
        try:
            message, _ = loads_body(body)  # msgspec's, the standard library's where it refuses
        except ValueError:
            return
        if not isinstance(message, dict):
            return
        usage, rid = message.get("usage"), message.get("id")
        model = message.get("model")
        if self.request is not None:
            self.request.observed(
                response_id=rid if isinstance(rid, str) else None,
                model=model if isinstance(model, str) else None,
                usage=usage if isinstance(usage, dict) else None,
                context_management=message.get("context_management"),
            )
        if isinstance(usage, dict) and isinstance(rid, str):
            # usage the tracker refuses is recorded without it (WireSession.observe_async)
            model = str(message.get("model"))
            await self.session.observe_async(rid, usage, model=model, call=self.call, defer=True)
