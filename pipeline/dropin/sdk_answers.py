"""What ``wrap``'s middleware does with a Messages response: reads a 200's message as the SDK
parses it (one that is not a message goes back as the SDK alone gives it), tells the request's
span and line what it says, lets the session observe its usage -- a streamed one's as the
caller reads the stream -- and settles the call's records after it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx2

from pipeline.dropin.adapter import Call, WireSession
from pipeline.dropin.event_stream import EventStreamUsage
from pipeline.dropin.thread_sync import SYNCS
from pipeline.dropin.wire_request import WireRequest

__all__ = [
    "observe",
    "observe_async",
    "read_answer",
    "read_answer_async",
    "settled",
    "settled_sync",
    "tap",
    "told",
]


async def read_answer_async(session: WireSession, response: Any) -> Any:
    """:func:`read_answer` for the async client."""
    try:
        return await response.parse()
    except (ValueError, anthropic.APIError) as exc:
        _answer_unread(session, exc)
        return None


def read_answer(session: WireSession, response: Any) -> Any:
    """A 200's message, parsed as the SDK parses it; None when it is not one (invalid JSON, a
    gateway's HTML): not observed, and the caller gets the response as the SDK alone gives it
    (``with_raw_response``'s text, or the SDK's own error)."""
    try:
        return response.parse()
    except (ValueError, anthropic.APIError) as exc:
        _answer_unread(session, exc)
        return None


def _answer_unread(session: WireSession, exc: Exception) -> None:
    session.ctx.logger.warning("wire_session.answer_unread", error=type(exc).__name__)


def told(seen: WireRequest, message: Any) -> None:
    """What a parsed response says of itself, to the request's span and line."""
    usage = getattr(message, "usage", None)
    rid, model = getattr(message, "id", None), getattr(message, "model", None)
    edits: Any = getattr(message, "context_management", None)
    if edits is not None and hasattr(edits, "model_dump"):
        edits = edits.model_dump(warnings=False)
    seen.observed(
        response_id=rid if isinstance(rid, str) else None,
        model=str(model) if model is not None else None,
        usage=usage.model_dump(warnings=False) if usage is not None else None,
        context_management=edits,
    )


def _usage_of(message: Any) -> dict[str, Any] | None:
    """A parsed reply's usage, to observe (None: it has none, or no id to record it by)."""
    usage = getattr(message, "usage", None)
    if usage is None or not isinstance(getattr(message, "id", None), str):
        return None
    return usage.model_dump(warnings=False)  # type: ignore[no-any-return]


def observe(session: WireSession, message: Any, call: Call | None) -> None:
    """The session observes a parsed reply's id and usage (recorded, learned from)."""
    usage = _usage_of(message)
    if usage is not None:
        session.observe(message.id, usage, model=str(message.model), call=call)


async def observe_async(session: WireSession, message: Any, call: Call | None) -> None:
    """:func:`observe`, the session's writes in a worker thread."""
    usage = _usage_of(message)
    if usage is not None:
        await session.observe_async(message.id, usage, model=str(message.model), call=call)


async def settled(session: WireSession) -> None:
    """The call's records made durable after it (and its calibration written), in the
    syncing thread where that is all there is, else here."""
    if not session.settle_in(SYNCS):
        await session.settle()


def settled_sync(session: WireSession) -> None:
    """:func:`settled` for the synchronous client."""
    if not session.settle_in(SYNCS):
        session.settle_sync()


class _AsyncTap(httpx2.AsyncByteStream):
    def __init__(self, inner: Any, reader: EventStreamUsage, seen: WireRequest) -> None:
        self.inner, self.reader, self.seen = inner, reader, seen

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            self.reader.feed(chunk)
            yield chunk
        await self.reader.aclose()  # the whole stream went by: its usage is complete
        await settled(self.reader.session)
        self.seen.end()

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        finally:
            self.seen.end()  # the caller left early: the request is over all the same


class _SyncTap(httpx2.SyncByteStream):
    def __init__(self, inner: Any, reader: EventStreamUsage, seen: WireRequest) -> None:
        self.inner, self.reader, self.seen = inner, reader, seen

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.reader.feed(chunk)
            yield chunk
        self.reader.close()
        settled_sync(self.reader.session)
        self.seen.end()

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.seen.end()


def tap(session: WireSession, http: Any, call: Call | None, seen: WireRequest) -> None:
    """Let the session observe a streamed response's usage as the caller reads it; the
    request ends with the stream."""
    reader = EventStreamUsage(session, call, seen)
    stream = http.stream
    http.stream = (
        _AsyncTap(stream, reader, seen)
        if isinstance(stream, httpx2.AsyncByteStream)
        else _SyncTap(stream, reader, seen)
    )
