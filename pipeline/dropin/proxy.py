"""A reverse proxy in front of the Messages API, for programs that are not Python.

Point a client at it (``ANTHROPIC_BASE_URL=http://127.0.0.1:8787``, Claude Code included): a
``POST /v1/messages`` goes through its conversation's :class:`~pipeline.dropin.adapter.WireSession`
(found by the request's credential and messages: :mod:`pipeline.dropin.conversations`), then
upstream; every other path (``count_tokens``, models, batches) is passed through untouched.
Auth and ``anthropic-*`` headers go upstream as they came; upstream errors come back as the
upstream gave them; a streamed response is passed on chunk by chunk as it arrives (never
buffered) while its usage is read for the session's token tracker. ``GET /healthz`` answers
``ok``. Each API key's conversations are its own (:mod:`pipeline.dropin.tenancy`).

An ASGI app on Starlette (the ``proxy`` extra: ``pip install '.[proxy]'``); ``python -m
pipeline proxy`` serves it with uvicorn. Persisted outputs are files on the proxy's host: the
model reads them back only where the client's tools see that file system (Claude Code on the
same machine does).

A fleet. With ``storage="s3://bucket/prefix"`` every proxy given that URL shares the sessions'
results and decisions, and a conversation may move between them at any call. A proxy keeps
each conversation in memory and, before each call, asks whether another worker recorded
since (one HEAD of the next record number): when another worker served it, the session is
loaded again (only the new record objects are read). The response's record is written
before the client sees the response end (an event stream's ``message_delta`` is held back
until then; a JSON body is passed on whole once read), so the worker serving the next call
finds it.

The store never fails a request, and its outage never changes what the model has seen. A
result that cannot be persisted waits in the local spool (``<root>/spool``: see
:mod:`pipeline.store.spool`) under the URI the store would have given it; a record that cannot
be written is logged (``stage_record.write_failed``) and the call goes on; a conversation whose
records cannot be read (``conversations.load_failed``) or whose news cannot be listed
(``wire_session.refresh_failed``) goes on from what this proxy knows, deciding the results no
record tells it of as the fleet did (:attr:`~pipeline.dropin.adapter.WireSession.rederive`).
Only a request whose tenant cannot be told (the store's tenancy secret never read) is sent
upstream as the client sent it (``wire_session.load_failed``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route, request_response

from pipeline.core import Pipeline
from pipeline.dropin.conversations import (
    MAX_HELD,
    MAX_HELD_BYTES,
    Branch,
    Conversations,
)
from pipeline.dropin.group_sync import GroupSync
from pipeline.dropin.held_families import MAX_BRANCHES
from pipeline.dropin.intake import MESSAGES, Intake, ServingScope, error, forwarded, unreachable
from pipeline.dropin.limits import (
    BODY_TIMEOUT,
    MAX_ANSWER_BYTES,
    MAX_BODY_BYTES,
    MAX_UPSTREAM_CONNECTIONS,
    UPSTREAM_TIMEOUT,
)
from pipeline.dropin.messages_route import MessagesRoute
from pipeline.dropin.metrics import WireMetrics
from pipeline.dropin.relay import relay as _relay
from pipeline.dropin.sync_passes import LongPasses
from pipeline.dropin.tenancy import Tenancy
from pipeline.dropin.upstream import Upstream
from pipeline.logs import get_logger
from pipeline.store.sessions import SessionStates
from pipeline.store.spool import SPOOL_DIR
from pipeline.wire.body_reader import BodyReader
from pipeline.wire.body_writer import BodyWriter
from pipeline.wire.kept_bodies import MAX_KEPT_BYTES

__all__ = [
    "DEFAULT_UPSTREAM",
    "LONG_PASS",
    "MAX_BODY_BYTES",
    "MAX_UPSTREAM_CONNECTIONS",
    "PARSES_AT_ONCE",
    "UPSTREAM_TIMEOUT",
    "build_app",
]

DEFAULT_UPSTREAM = "https://api.anthropic.com"

_PASSTHROUGH = "/{path:path}"

_CONNECT_TIMEOUT = 30.0
_KEPT_ALIVE = 100


PARSES_AT_ONCE = 2
"""Long new request bodies parsed off the server's loop at once."""
LONG_PASS = 200
"""The command line's ``long_pass`` (:func:`build_app`): a first pass over this many messages
costs ~20 ms of CPU, what running it on a loop of its own adds (~1 ms) is small beside it."""


def build_app(
    *,
    pipeline: Callable[[], Pipeline],
    root: str | Path = ".sluicegate",
    upstream: str = DEFAULT_UPSTREAM,
    transport: httpx2.AsyncBaseTransport | None = None,
    background: Sequence[Callable[[], Coroutine[Any, Any, object]]] = (),
    storage: SessionStates | str | os.PathLike[str] | None = None,
    tenancy: Tenancy | None = None,
    metrics: WireMetrics | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout: float = BODY_TIMEOUT,
    max_answer_bytes: int = MAX_ANSWER_BYTES,
    upstream_timeout: float = UPSTREAM_TIMEOUT,
    max_conversations: int | None = MAX_HELD,
    max_held_bytes: int | None = MAX_HELD_BYTES,
    max_branches: int = MAX_BRANCHES,
    max_upstream_connections: int = MAX_UPSTREAM_CONNECTIONS,
    fsync_each: bool = False,
    long_pass: int | None = None,
    upstream_client: str = "auto",
    hold_outputs: bool = True,
    **context: Any,
) -> Starlette:
    """The proxy as an ASGI app. ``pipeline``: a factory of each conversation's stages;
    ``context``: keyword arguments of each session's ``SessionContext``; ``transport``: how to
    reach the upstream (tests pass one; default: the network); ``background``: tasks run for
    the app's lifetime, started when it starts and cancelled when it shuts down (periodic
    store pruning, say). A background task must handle its own errors: one that raises takes
    the server down with it. ``storage``: where the sessions' results and decisions live -- a
    :class:`~pipeline.store.sessions.SessionStates` or a location for one (a directory,
    ``s3://bucket/prefix``); by default the files under ``root``, which always holds the token
    calibration (local to each host). ``tenancy``: how requests are told apart by credential
    (default: by API key, under the store's secret; ``Tenancy(single=True)``: one tenant).
    ``metrics``: where requests are counted (default: the global meter provider's; see
    :mod:`pipeline.dropin.metrics`). Each request is one ``wire.request`` span, kept open until its
    response has gone by, and one ``wire.request`` log event (:mod:`pipeline.dropin.wire_request`).
    ``max_body_bytes``: the largest request body read (a larger one is refused with 413
    before it is all read); a compressed body (``content-encoding``) is refused with 415;
    ``body_timeout``: seconds a body may take to arrive whole after its head (then 408
    ``timeout_error`` and its connection closed: a body sent a few bytes at a time holds no
    connection for long); ``max_answer_bytes``: the largest JSON answer read whole for its
    usage (a larger one is passed on as it comes, unread: ``wire.answer_too_large``). A
    ``POST`` to a path ending in ``/v1/messages`` (a client whose base URL has a path, a
    trailing slash, doubled slashes) is a Messages request, sent upstream to ``/v1/messages``;
    a path with a ``.`` or ``..`` segment (also percent-encoded) is refused with 400.
    ``hold_outputs``: leave a held conversation's long texts (tool outputs and inputs, texts,
    thinking, image data) in the request that carries them again, rather than in memory
    (:mod:`pipeline.wire.held_outputs`; only under stages that never read one again).
    ``upstream_timeout``: seconds an upstream call may take to answer (then 504
    ``timeout_error``); a client that goes away meanwhile cancels it. A conversation is held
    for one call's pass only, never while its upstream call runs. ``max_conversations``: how
    many conversations are held in memory (:class:`~pipeline.dropin.conversations.Conversations`'
    ``max_held``); ``max_held_bytes``: what their last requests may come to, each
    counted as its body's bytes and 2 KiB a message (its ``max_held_bytes``;
    :func:`~pipeline.dropin.held_families.held_size`); the conversations held and what their
    last requests come to are the metrics ``sluicegate.conversations.held`` and
    ``sluicegate.conversations.held.size``). ``max_branches``: how many conversations of one
    family -- forks, edits, rewinds of one conversation -- are held (its ``max_branches``).
    ``max_upstream_connections``: how many upstream calls run at once (one
    more waits for one to end, within ``upstream_timeout``). ``upstream_client``: the HTTP
    client upstream calls go out with (:data:`~pipeline.dropin.upstream.CLIENTS`; ``auto``:
    aiohttp where it is installed and the environment names no proxy). ``fsync_each``: how a local
    store's records are made durable -- False (default): each is written before the proxy goes
    on (a crash of the process loses none) and the call's are synced after its response has
    gone by, with those of the calls that end within 0.1 s (off the request's path:
    :mod:`pipeline.dropin.group_sync`; a machine that loses power in that moment may lose those
    calls' records); True: each before the proxy goes on. An object store's are always
    written before the response ends. ``long_pass``: a conversation's first pass in this
    process (one the proxy meets first, a session resumed after a restart: ~0.1 s of CPU at
    1,000 messages) over at least this many messages runs on an event loop of its own in a
    worker thread (:class:`~pipeline.dropin.sync_passes.LongPasses`), so that the server's loop
    goes on serving other requests meanwhile; None (default): every pass on the server's loop.
    Only for stages and a store whose async work is bound to no loop: a local store, and no
    summarizer or stage holding a client made on the server's loop (the command line's)."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
    if long_pass is not None and (isinstance(long_pass, bool) or long_pass < 1):
        raise ValueError(f"long_pass must be None or at least 1, got {long_pass!r}")
    if not upstream_timeout > 0:  # NaN too
        raise ValueError(f"upstream_timeout must be a positive number, got {upstream_timeout}")
    if not body_timeout > 0:
        raise ValueError(f"body_timeout must be a positive number, got {body_timeout}")
    metrics = metrics or WireMetrics()
    logger = context.get("logger") or get_logger()
    intake = Intake(metrics, logger, max_body_bytes, body_timeout)
    logged = intake.logged
    # request bodies parsed in the size of what is new in them (see pipeline.wire.body_reader)
    bodies = BodyReader(
        max_bodies=max_conversations or MAX_HELD,
        # what it keeps of bodies no conversation held sent last (refused ones, say) is within
        # the same bound as the conversations held
        max_bytes=min(MAX_KEPT_BYTES, max_held_bytes or MAX_KEPT_BYTES),
    )
    # long new bodies parsed in worker threads, two at a time (they share the interpreter)
    parse_elsewhere = functools.partial(
        anyio.to_thread.run_sync, limiter=anyio.CapacityLimiter(PARSES_AT_ONCE)
    )
    # and written in the size of what is new in them (see pipeline.wire.body_writer)
    sent = BodyWriter()
    if isinstance(storage, SessionStates):
        states = storage
    elif storage is not None and "://" in os.fspath(storage):
        # an object store: what it cannot take waits in the local root (pipeline.store.spool)
        states = SessionStates(storage, spool=Path(root) / SPOOL_DIR)
    else:
        states = SessionStates(storage or root, fsync_each=fsync_each)
    if states.shared:  # the object store's client is bound to the server's loop
        long_pass = None
    long_passes = LongPasses()
    # a local store's records made durable for many calls at once (pipeline.dropin.group_sync)
    synced = GroupSync()
    conversations = Conversations(
        pipeline=pipeline,
        root=root,
        storage=states,
        tenancy=tenancy,
        max_held=max_conversations,
        max_held_bytes=max_held_bytes,
        max_branches=max_branches,
        on_let_go=functools.partial(_let_go, bodies, sent),
        **context,
    )
    metrics.watch_held(conversations, lambda c: (c.held, c.held_bytes))
    if max_upstream_connections < 1:
        raise ValueError(
            f"max_upstream_connections must be at least 1, got {max_upstream_connections}"
        )
    client = Upstream(
        upstream,
        timeout=upstream_timeout,
        connect=min(upstream_timeout, _CONNECT_TIMEOUT),
        max_connections=max_upstream_connections,
        kept_alive=min(max_upstream_connections, _KEPT_ALIVE),
        transport=transport,
        client=upstream_client,
    )

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    messages = MessagesRoute(
        intake=intake,
        bodies=bodies,
        parse_elsewhere=parse_elsewhere,
        conversations=conversations,
        client=client,
        sent=sent,
        metrics=metrics,
        logger=logger,
        synced=synced,
        long_pass=long_pass,
        long_passes=long_passes,
        hold_outputs=hold_outputs,
        max_answer_bytes=max_answer_bytes,
    )

    async def passthrough(request: Request) -> Response:
        started = time.monotonic()
        # the route is the template (a client picks the path: no metric series per path)
        where = {"method": request.method, "route": _PASSTHROUGH, "path": request.url.path[:256]}
        segments = request.url.path.split("/")
        if any(part in (".", "..") for part in segments):  # decoded: %2E%2E is ".." here
            logged(started, 400, error="invalid_request_error", **where)
            return error(400, "invalid_request_error", "a path may not hold . or .. segments")
        if request.method == "POST" and [p for p in segments if p][-2:] == ["v1", "messages"]:
            return await messages(request)  # a Messages request under another spelling
        content = await intake.body_of(request, started, **where)
        if isinstance(content, Response):
            return content
        # the path as the client wrote it: decoded, %252e would become a dot segment upstream
        raw_path = request.scope.get("raw_path") or request.url.path.encode()
        upstream_request = client.request(
            request.method, raw_path.decode("latin-1"), request.scope.get("query_string", b""),
            forwarded(request), content,
        )  # fmt: skip
        try:
            answer = await client.send(upstream_request)
        except httpx2.HTTPError as exc:
            logged(started, 502, error=type(exc).__name__, **where)
            return unreachable(exc)
        end = functools.partial(intake.relayed_end, started, answer.status_code, **where)
        return _relay(answer, end=end, logger=logger)

    async def drain_spool() -> None:
        """Results spooled while the store was down reach it even without traffic."""
        while True:
            await anyio.sleep(SPOOL_DRAIN_EVERY)
            await _drained(states)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            for task in background:
                tasks.start_soon(task)
            if states.spool is not None:
                tasks.start_soon(drain_spool)
            tasks.start_soon(synced.run)
            yield
            tasks.cancel_scope.cancel()
        await synced.flush()  # the last calls' records
        await client.aclose()  # graceful shutdown: the server has drained its requests
        for branch in conversations.branches():  # what they learned since their last save
            await branch.session.save_calibration()
        await _drained(states, force=True)

    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route(MESSAGES, ServingScope(request_response(messages)), methods=["POST"]),
        Route(
            _PASSTHROUGH,
            # (a Messages request to another path is served by ``messages`` from there)
            ServingScope(request_response(passthrough)),
            methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
        ),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


SPOOL_DRAIN_EVERY = 5.0
"""Seconds between two drains of the spool without traffic (each call's end asks for one)."""


async def _drained(states: SessionStates, *, force: bool = False) -> None:
    """One drain of the spool in a worker thread; a failure of the local disk is logged."""
    try:
        await anyio.to_thread.run_sync(functools.partial(states.drain_spool, force=force))
    except OSError as exc:
        get_logger().error("store.spool_failed", error=type(exc).__name__)


def _let_go(bodies: BodyReader, sent: BodyWriter, branch: Branch) -> None:
    """What the reader and the writer keep of a conversation goes with it: its last request as
    parsed, the body last written for it."""
    bodies.forget(branch.params)
    sent.forget(branch.key)
