"""A reverse proxy in front of the Messages API, for programs that are not Python.

Point a client at it (``ANTHROPIC_BASE_URL=http://127.0.0.1:8787``, Claude Code included): a
``POST /v1/messages`` goes through its conversation's :class:`~pipeline.adapter.WireSession`
(named by the ``x-sluicegate-session`` header, Claude Code's ``metadata.user_id`` session or the
conversation's fingerprint), then upstream; every other path (``count_tokens``, models,
batches) is passed through untouched. Auth and ``anthropic-*`` headers go upstream as they
came; upstream errors come back as the upstream gave them; a streamed response is passed on
chunk by chunk as it arrives (never buffered) while its usage is read for the session's token
tracker. ``GET /healthz`` answers ``ok``.

An ASGI app on Starlette (the ``proxy`` extra: ``pip install '.[proxy]'``); ``python -m
pipeline proxy`` serves it with uvicorn. Persisted outputs are files on the proxy's host: the
model reads them back only where the client's tools see that file system (Claude Code on the
same machine does).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from pipeline.adapter import EventStreamUsage, WireSession, beta_header, session_id_for
from pipeline.core import Pipeline
from pipeline.tracing import ATTR

__all__ = ["DEFAULT_UPSTREAM", "build_app"]

DEFAULT_UPSTREAM = "https://api.anthropic.com"

# hop-by-hop and length headers are the proxy's own business on each side
_DROP_REQUEST = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}
_DROP_RESPONSE = {"content-length", "connection", "transfer-encoding", "content-encoding"}


def build_app(
    *,
    pipeline: Callable[[], Pipeline],
    root: str | Path = ".sluicegate",
    upstream: str = DEFAULT_UPSTREAM,
    transport: httpx2.AsyncBaseTransport | None = None,
    background: Sequence[Callable[[], Coroutine[Any, Any, object]]] = (),
    **context: Any,
) -> Starlette:
    """The proxy as an ASGI app. ``pipeline``: a factory of each conversation's stages;
    ``context``: keyword arguments of each session's ``SessionContext``; ``transport``: how to
    reach the upstream (tests pass one; default: the network); ``background``: tasks run for
    the app's lifetime, started when it starts and cancelled when it shuts down (periodic
    store pruning, say). A background task must handle its own errors: one that raises takes
    the server down with it."""
    sessions: dict[str, WireSession] = {}
    locks: dict[str, anyio.Lock] = {}
    client = httpx2.AsyncClient(
        base_url=upstream.rstrip("/"), timeout=httpx2.Timeout(600.0), transport=transport
    )

    def session_for(sid: str) -> WireSession:
        session = sessions.get(sid)
        if session is None:
            session = WireSession(sid, root, pipeline(), **context)
            sessions[sid] = session
            locks[sid] = anyio.Lock()
        return session

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def messages(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                raise ValueError("not a Messages request")
            sid = session_id_for(body, headers=dict(request.headers))
        except ValueError as exc:  # what the API would say of it, before any upstream call
            return _error(400, "invalid_request_error", str(exc)[:300])
        session = session_for(sid)
        async with locks[sid]:  # one call of a conversation at a time, as a client makes them
            with session.request_span(len(body["messages"])) as span:
                try:
                    prepared = await session.prepare_request(body)
                except ValueError as exc:
                    return _error(400, "invalid_request_error", str(exc)[:300])
                try:
                    upstream_response = await _send(client, request, session, prepared)
                except httpx2.HTTPError as exc:
                    return _unreachable(exc)
                span.set_attribute(ATTR.HTTP_STATUS, upstream_response.status_code)
        return _relay(upstream_response, session)

    async def passthrough(request: Request) -> Response:
        upstream_request = client.build_request(
            request.method, request.url.path, params=request.query_params,
            headers=_forwarded(request), content=await request.body(),
        )  # fmt: skip
        try:
            return _relay(await client.send(upstream_request, stream=True), None)
        except httpx2.HTTPError as exc:
            return _unreachable(exc)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            for task in background:
                tasks.start_soon(task)
            yield
            tasks.cancel_scope.cancel()
        await client.aclose()  # graceful shutdown: the server has drained its requests

    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/{path:path}", passthrough, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


async def _send(
    client: httpx2.AsyncClient, request: Request, session: WireSession, prepared: dict[str, Any]
) -> httpx2.Response:
    """The prepared request upstream, with what a stage asked of it (extras, beta header)."""
    report = session.ctx.report
    prepared.update(report.request_extras)
    headers = _forwarded(request)
    if report.betas:
        headers["anthropic-beta"] = beta_header(headers.get("anthropic-beta"), report.betas)
    upstream_request = client.build_request(
        "POST", request.url.path, params=request.query_params, headers=headers,
        content=json.dumps(prepared).encode("utf-8"),
    )  # fmt: skip
    return await client.send(upstream_request, stream=True)


def _forwarded(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}


def _unreachable(exc: httpx2.HTTPError) -> Response:
    # as the API reports an outage, so a client retries it as one
    return _error(502, "api_error", f"upstream unreachable ({type(exc).__name__})")


def _error(status: int, kind: str, message: str) -> Response:
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status)


def _relay(upstream: httpx2.Response, session: WireSession | None) -> Response:
    """The upstream response passed on as it arrives; a 200 from ``/v1/messages`` read for
    its id and usage on the way (a JSON body once complete, an event stream event by event)."""
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE}
    reader = _UsageReader(session) if session is not None and upstream.status_code == 200 else None
    streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_bytes():
                if reader is not None:
                    reader.feed(chunk, streamed)
                yield chunk
            if reader is not None:
                reader.close(streamed)
        finally:
            await upstream.aclose()

    return StreamingResponse(body(), status_code=upstream.status_code, headers=headers)


class _UsageReader:
    """The response's id, model and usage, read as the bytes go by."""

    def __init__(self, session: WireSession) -> None:
        self.events = EventStreamUsage(session)
        self.session = session
        self.buffer: list[bytes] = []

    def feed(self, chunk: bytes, streamed: bool) -> None:
        if streamed:
            self.events.feed(chunk)
        else:
            self.buffer.append(chunk)  # a JSON body: read once it is complete

    def close(self, streamed: bool) -> None:
        if streamed:
            self.events.close()
            return
        try:
            message = json.loads(b"".join(self.buffer))
        except ValueError:
            return
        usage, rid = message.get("usage"), message.get("id")
        if isinstance(usage, dict) and isinstance(rid, str):
            try:
                self.session.observe(rid, usage, model=str(message.get("model")))
            except ValueError:
                return
