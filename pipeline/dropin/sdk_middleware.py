"""The SDK middleware behind :func:`~pipeline.dropin.wrap.wrap` (:class:`SluicegateMiddleware`):
every Messages request of a wrapped client, once per HTTP attempt, through its conversation's
pipeline. The one module of the drop-ins that imports the anthropic SDK (heavy: ~0.8 s and
~60 MB resident), imported when a client is wrapped.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import anthropic
import anyio
import anyio.to_thread

from pipeline.core import Pipeline
from pipeline.dropin.adapter import Call, UnreadableMessage, WireSession
from pipeline.dropin.conversations import MAX_HELD, SESSION_HEADER, Branch, Conversations
from pipeline.dropin.metrics import WireMetrics
from pipeline.dropin.sdk_answers import (
    observe,
    observe_async,
    read_answer,
    read_answer_async,
    settled,
    settled_sync,
    tap,
    told,
)
from pipeline.dropin.store_news import PLACE_ATTEMPTS
from pipeline.dropin.sync_passes import LongPasses, in_worker, run_pass
from pipeline.dropin.tenancy import Tenancy
from pipeline.dropin.wire_request import WireRequest
from pipeline.results.keys import keys_shared
from pipeline.spans import beside_sdk_call
from pipeline.store.files import validate_session_id
from pipeline.store.sessions import SessionStates
from pipeline.wire.body_writer import BodyWriter
from pipeline.wire.request_fields import merge_betas, merge_request_fields

__all__ = ["SluicegateMiddleware", "sends_body_as_given"]


def _is_messages_call(request: Any) -> bool:
    url = str(request.url).split("?", 1)[0].rstrip("/")
    return (
        str(request.method).lower() == "post"
        and url.endswith("/v1/messages")
        and isinstance(request.json, Mapping)
        and isinstance(request.json.get("messages"), list)
    )


class SluicegateMiddleware(anthropic.Middleware):
    """The SDK middleware :func:`wrap` installs (usable directly with ``with_middleware``).

    ``pipeline``: a factory of the stages every conversation runs (called once per
    conversation; stage objects keep no per-session state, so a shared one is fine too).
    ``session_id``: a hint naming every request of this client (see
    :mod:`pipeline.dropin.conversations`: requests are still placed by their messages, so two
    conversations that open differently, or go different ways, never share a ledger).
    ``tenancy``: how requests are told apart by credential (default: by the API key the
    request carries; ``Tenancy(single=True)``: one tenant). ``client_headers``: the headers
    every request of the client goes with (its credentials, its default headers), read by
    :func:`wrap` from the client it wraps, for a request that reaches the middleware without
    them; a request's own headers win (the SDK puts the client's on each request first, so a
    ``with_options(api_key=...)`` copy's key is its tenant). ``max_conversations``: how many
    conversations are held in memory (the least recently used are let go past it, and load
    from their records when they come back).
    ``context``: keyword arguments of each session (``cache_breakpoint``, tool policies, a
    tracer, a logger). ``raw_bodies``: send each prepared body as the bytes the middleware
    writes, encoding only what is new in it since the conversation's last call
    (:class:`~pipeline.wire.body_writer.BodyWriter`), rather than as JSON the SDK encodes whole;
    only for a client that sends the body as it is given (:func:`wrap` tells: the first-party
    client, not Bedrock's, Vertex's or Foundry's, which rewrite it) and when this middleware is
    the last (one added after it would see the request without its JSON). ``extra_body`` is in
    the body by then (the SDK merges it first). ``long_pass``: an async client's conversation
    whose first pass in this process (one met first, a session resumed after a restart: ~0.1 s
    of CPU at 1,000 messages) takes at least this many messages has it run on an event loop of
    its own in a worker thread (two at a time), so the caller's loop goes on meanwhile; None
    (default): every pass on the caller's loop. Only for stages bound to no loop (no
    summarizer holding a client made on the caller's loop; the default stages are); ignored
    with an object store, whose client is the caller's loop's.
    """

    def __init__(
        self,
        *,
        root: str | Path = ".sluicegate",
        pipeline: Callable[[], Pipeline],
        session_id: str | None = None,
        tenancy: Tenancy | None = None,
        client_headers: Mapping[str, str] | None = None,
        metrics: WireMetrics | None = None,
        max_conversations: int | None = MAX_HELD,
        raw_bodies: bool = False,
        long_pass: int | None = None,
        **context: Any,
    ) -> None:
        if long_pass is not None and (isinstance(long_pass, bool) or long_pass < 1):
            raise ValueError(f"long_pass must be None or at least 1, got {long_pass!r}")
        self.metrics = metrics or WireMetrics()
        self.writer = BodyWriter() if raw_bodies else None
        self._writing = threading.Lock()  # a sync client's threads share the writer
        self.client_headers = dict(client_headers or {})
        if session_id is not None:
            validate_session_id(session_id)
        self.root = Path(root)
        self.pipeline = pipeline
        self.session_id = session_id
        self.context = context
        # each call's records written as it goes and made durable once, at the call's end
        context.setdefault("storage", SessionStates(self.root, fsync_each=False))
        self.conversations = Conversations(
            pipeline=pipeline,
            root=self.root,
            tenancy=tenancy,
            max_held=max_conversations,
            on_let_go=self._let_go,
            **context,
        )
        # an object store's client is bound to the loop that made it: its passes stay there
        self.long_pass = None if self.conversations.states.shared else long_pass
        self._long_passes = LongPasses()
        self._elsewhere: dict[tuple[str, str], threading.Event] = {}
        """By conversation, a long pass running on a loop of its own: set when it is through."""

    def _let_go(self, branch: Branch) -> None:
        if self.writer is not None:
            with self._writing:
                self.writer.forget(branch.key)

    def _outgoing(self, branch: Branch, request: Any, body: dict[str, Any]) -> Any:
        """The request to send: the prepared body, plus what a stage asked of the request
        (e.g. server-side clearing's ``context_management`` and its beta header)."""
        session = branch.session
        report = session.ctx.report
        body = merge_request_fields(body, report.request_extras)
        headers = _headers_out(request)
        if report.betas:
            headers["anthropic-beta"] = merge_betas(headers.get("anthropic-beta"), report.betas)
        options = request.options
        raw = (
            self.writer is not None
            and options.extra_json is None
            and options.files is None
            and options.content is None
        )
        # the SDK's copy deep-copies the body it is about to replace (the whole history, every
        # call): it copies none while it is away, and gets it back at once
        history, options.json_data = options.json_data, None
        try:
            outgoing = request.copy(body=None if raw else body, headers=headers)
        finally:
            options.json_data = history
        if raw:
            assert self.writer is not None
            with self._writing:
                outgoing.options.content = self.writer.write(branch.key, body, finite=True)
        return outgoing

    def _headers(self, request: Any) -> dict[str, str]:
        own = {k: v for k, v in (request.headers or {}).items() if isinstance(v, str)}
        return {**self.client_headers, **own}

    async def _current(self, branch: Branch) -> bool:
        """Whether ``branch``, routed with ``hold``, is as its records leave it; when another
        client of the store moved it on, it is loaded again and its hold let go (False: route
        the request again)."""
        with self._hold_kept_if(branch) as current:
            current[0] = await self.conversations.current(branch)
        return current[0]

    def _current_sync(self, branch: Branch) -> bool:
        """:meth:`_current` for the synchronous client (a load on its own loop)."""
        with self._hold_kept_if(branch) as current:
            current[0] = self.conversations.current_sync(branch, run_pass)
        return current[0]

    @contextlib.contextmanager
    def _hold_kept_if(self, branch: Branch) -> Iterator[list[bool]]:
        """The hold of ``branch`` let go unless the block sets the flag it is given (and let
        go when the block raises)."""
        kept = [False]
        try:
            yield kept
        finally:
            if not kept[0]:
                self.conversations.done(branch)

    def _routed(self, branch: Branch, request: Any) -> tuple[WireSession, WireRequest]:
        """The session of a call routed with ``hold``, and its request's span and line (the
        hold let go should these fail: the pass that lets it go would not run)."""
        try:
            return branch.session, self._request_of(branch, request)
        except BaseException:
            self.conversations.done(branch)
            raise

    def _request_of(self, branch: Branch, request: Any) -> WireRequest:
        """The request's span and log line, beside the SDK's own call span."""
        return WireRequest(
            branch.session,
            request.json,
            context=beside_sdk_call(),
            metrics=self.metrics,
            tenant=branch.tenant,
        )

    async def handle_async(self, request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
        """Prepare a Messages request, send it, let its session observe the response."""
        if not _is_messages_call(request):
            return await call_next(request)
        # held until its pass is through: its family is not let go meanwhile (its pass may
        # ask the family's other conversations how they sent a result)
        for attempt in range(PLACE_ATTEMPTS):
            branch = await self.conversations.route(
                request.json, self._headers(request), explicit=self.session_id, hold=True
            )
            if attempt == PLACE_ATTEMPTS - 1:
                self.conversations.still_moving(branch)
            elif await self._current(branch):
                break
        session, seen = self._routed(branch, request)
        with seen.active():
            passing = time.monotonic()
            # the call: what the response answers, whatever is prepared meanwhile
            try:
                if self.long_pass is None:
                    body, call = await _pass(session, request.json)
                else:
                    body, call = await self._pass_maybe_elsewhere(branch, request.json)
            except UnreadableMessage as exc:
                _unread(session, exc)
                response = await call_next(request.copy(headers=_headers_out(request)))
                seen.end(status=response.status_code)
                return response
            finally:
                self.conversations.done(branch)
            passed = time.monotonic() - passing
            outgoing = self._outgoing(branch, request, body)
            seen.prepared(session.ctx.report, passed, None)  # the upstream call begins
            response = await call_next(outgoing)
            seen.answered(response.status_code)
            if response.status_code == 200 and request.stream:
                tap(session, response.http_response, call, seen)  # it ends with the stream
                return response
            message = (
                await read_answer_async(session, response) if response.status_code == 200 else None
            )
            if message is not None:
                told(seen, message)
                await observe_async(session, message, call)
            await settled(session)  # the call's records made durable after it
        seen.end()
        return response

    async def _pass_maybe_elsewhere(
        self, branch: Branch, body: Mapping[str, Any]
    ) -> tuple[dict[str, Any], Call]:
        """A pass of ``branch`` under ``long_pass``: a long first one on a loop of its own.
        Passes of one conversation then take its call lock, on the caller's loop: a pass on
        another loop and one on the caller's would otherwise meet on the session's lock, which
        belongs to one loop only. One whose caller was cancelled outright (asyncio's own
        cancellation returns before the worker is through) is waited for by the next."""
        assert self.long_pass is not None
        session = branch.session
        async with branch.call_lock:
            running = self._elsewhere.get(branch.key)
            if running is not None:
                await anyio.to_thread.run_sync(running.wait)
            if session.first_pass(body) < self.long_pass:
                return await _pass(session, body)
            through = self._elsewhere[branch.key] = threading.Event()

            async def long_pass() -> tuple[dict[str, Any], Call]:
                try:
                    return await _pass(session, body)
                finally:
                    if self._elsewhere.get(branch.key) is through:
                        del self._elsewhere[branch.key]
                    through.set()

            return await self._long_passes.run(long_pass)

    def handle(self, request: Any, call_next: Callable[[Any], Any]) -> Any:
        """The synchronous client's path: the same work, the pipeline run on a private event
        loop in a worker thread (so a caller that has a running loop is not disturbed:
        :mod:`pipeline.dropin.sync_passes`), one thread at a time per conversation
        (:attr:`WireSession.sync_lock`)."""
        if not _is_messages_call(request):
            return call_next(request)
        for attempt in range(PLACE_ATTEMPTS):
            branch = self.conversations.route_sync(
                request.json,
                self._headers(request),
                explicit=self.session_id,
                build=in_worker,
                hold=True,
            )
            if attempt == PLACE_ATTEMPTS - 1:
                self.conversations.still_moving(branch)
            elif self._current_sync(branch):
                break
        session, seen = self._routed(branch, request)
        with seen.active():
            passing = time.monotonic()
            try:
                with session.sync_lock:
                    body, call = run_pass(lambda: _pass(session, request.json))
                    report = session.ctx.report
            except UnreadableMessage as exc:
                _unread(session, exc)
                response = call_next(request.copy(headers=_headers_out(request)))
                seen.end(status=response.status_code)
                return response
            finally:
                self.conversations.done(branch)
            passed = time.monotonic() - passing
            outgoing = self._outgoing(branch, request, body)
            seen.prepared(report, passed, None)  # the upstream call begins
            response = call_next(outgoing)
            seen.answered(response.status_code)
            if response.status_code == 200 and request.stream:
                tap(session, response.http_response, call, seen)  # it ends with the stream
                return response
            message = read_answer(session, response) if response.status_code == 200 else None
            if message is not None:
                told(seen, message)
                observe(session, message, call)
            settled_sync(session)  # the call's records made durable after it
        seen.end()
        return response


async def _pass(session: WireSession, body: Mapping[str, Any]) -> tuple[dict[str, Any], Call]:
    """``session``'s pass over ``body`` with its results' keys shared and each output the
    request holds digested once (:func:`~pipeline.results.keys.keys_shared`), on whatever
    loop runs it."""
    with keys_shared():
        return await session.prepare_call(body)


def _headers_out(request: Any) -> dict[str, Any]:
    """The request's headers, less the conversation's name, which never leaves."""
    headers: dict[str, Any] = {
        k: v for k, v in (request.headers or {}).items() if k.lower() != SESSION_HEADER
    }
    headers[SESSION_HEADER] = anthropic.omit
    return headers


def _unread(session: WireSession, exc: UnreadableMessage) -> None:
    """A request whose messages the pass cannot read (a role or a content the API would
    refuse): it goes as it came, and the API answers it as it would the SDK alone (a 400,
    ``anthropic.BadRequestError``); logged with the error's kind, never its text (which may
    quote the messages)."""
    session.ctx.logger.warning("wire.request_unread", error=type(exc).__name__)


def sends_body_as_given(client: Any) -> bool:
    """Whether ``client`` sends a request's body as it is given: the first-party client's
    hooks, which Bedrock's, Vertex's and Foundry's clients replace to rewrite the body."""
    base = (
        anthropic.AsyncAnthropic
        if isinstance(client, anthropic.AsyncAnthropic)
        else anthropic.Anthropic
    )
    kind = type(client)
    return isinstance(client, base) and all(
        getattr(kind, hook, None) is getattr(base, hook, None)
        for hook in ("_prepare_options", "_build_request", "_prepare_request")
    )
