"""The proxy's ``POST /v1/messages`` (:class:`MessagesRoute`): a request read, placed in its
conversation, passed through the conversation's stages and sent upstream, its answer relayed.

What the route holds are the app's parts (:func:`~pipeline.dropin.proxy.build_app` makes
them): the body reader and writer, the conversations, the upstream client, the metrics.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx2
from opentelemetry import propagate
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from pipeline.core import rereading_stages
from pipeline.dropin.adapter import WireSession
from pipeline.dropin.conversations import Conversations
from pipeline.dropin.group_sync import GroupSync
from pipeline.dropin.held_families import held_size
from pipeline.dropin.intake import MESSAGES, Intake, forwarded, unreachable
from pipeline.dropin.limits import MAX_MESSAGES
from pipeline.dropin.metrics import WireMetrics
from pipeline.dropin.relay import relay as _relay
from pipeline.dropin.store_news import PLACE_ATTEMPTS
from pipeline.dropin.sync_passes import LongPasses
from pipeline.dropin.tenancy import credential_of
from pipeline.dropin.upstream import Upstream, unless_left
from pipeline.dropin.wire_request import CLIENT_LEFT, WireRequest
from pipeline.wire.body_reader import BodyReader
from pipeline.wire.body_writer import BodyWriter
from pipeline.wire.held_outputs import hold_outputs as hold
from pipeline.wire.held_outputs import serving
from pipeline.wire.request_fields import merge_betas, merge_request_fields

__all__ = ["MessagesRoute"]


@dataclass(eq=False, slots=True)
class MessagesRoute:
    """``POST /v1/messages`` of the proxy (see :func:`~pipeline.dropin.proxy.build_app` for
    what each part and bound does)."""

    intake: Intake
    bodies: BodyReader
    parse_elsewhere: Callable[..., Awaitable[Any]]
    """Where a long body new to the reader is parsed (a worker thread, a few at a time)."""
    conversations: Conversations
    client: Upstream
    sent: BodyWriter
    metrics: WireMetrics
    logger: Any
    synced: GroupSync
    long_pass: int | None
    long_passes: LongPasses
    hold_outputs: bool
    max_answer_bytes: int

    async def __call__(self, request: Request) -> Response:
        """One Messages request, answered."""
        started = time.monotonic()
        raw = await self.intake.body_of(request, started)
        if isinstance(raw, Response):
            return raw
        serving(raw)  # where the outputs held in requests are read, for this request
        headers = dict(request.headers)
        try:
            # a long body new to the reader is parsed off the loop, which serves the others
            body, fast, source = await self.bodies.read_source_async(
                raw, scope=credential_of(headers), offload=self.parse_elsewhere
            )
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                raise ValueError("not a Messages request")
            if len(body["messages"]) > MAX_MESSAGES:  # as the API says of it
                raise ValueError(f"messages: at most {MAX_MESSAGES} messages in a request")
        except RecursionError:
            return self.intake.refused(
                started, 400, "invalid_request_error", "request body nested too deeply"
            )
        except ValueError as exc:  # what the API would say of it, before any upstream call
            return self.intake.refused(started, 400, "invalid_request_error", str(exc)[:300])
        for attempt in range(PLACE_ATTEMPTS):
            try:
                size = held_size(len(raw), len(body["messages"]))
                branch = await self.conversations.route(body, headers, unchanging=True, size=size)
            except ValueError as exc:
                return self.intake.refused(started, 400, "invalid_request_error", str(exc)[:300])
            except OSError as exc:  # its state cannot be read: the request goes as it came
                self.logger.warning("wire_session.load_failed", error=type(exc).__name__)
                try:
                    upstream_response = await unless_left(
                        request.receive, _send_as_is(self.client, request, raw)
                    )
                except httpx2.HTTPError as exc:
                    failed = unreachable(exc)
                    self.intake.logged(
                        started, failed.status_code, error=type(exc).__name__, chars_in=len(raw)
                    )
                    return failed
                if upstream_response is None:
                    self.intake.logged(started, 499, error=CLIENT_LEFT, chars_in=len(raw))
                    return Response(status_code=499)
                end = functools.partial(
                    self.intake.relayed_end, started, upstream_response.status_code,
                    forwarded_as_is=True, chars_in=len(raw),
                )  # fmt: skip
                return _relay(upstream_response, end=end, logger=self.logger)
            # one pass of a conversation at a time (with the check that no other worker moved
            # it on); its upstream call runs outside: a slow or abandoned one holds up nobody
            async with branch.call_lock:
                if attempt == PLACE_ATTEMPTS - 1:
                    self.conversations.still_moving(branch)
                elif not await self.conversations.current(branch):
                    continue  # another worker moved it on: place the request again
                session = branch.session
                call_request = WireRequest(
                    session,
                    body,
                    chars_in=len(raw),
                    metrics=self.metrics,
                    tenant=branch.tenant,
                    # its own trace, or its client's (a traceparent header): never whatever
                    # the server's task for it was made in (the previous request's, on a
                    # kept-alive connection whose next request was read during the last)
                    context=propagate.extract(request.headers),
                )
                with call_request.active():
                    passing = time.monotonic()
                    try:
                        if (
                            self.long_pass is not None
                            and session.first_pass(body) >= self.long_pass
                        ):
                            prepared, call = await self.long_passes.run(
                                functools.partial(session.prepare_call, body)
                            )
                        else:
                            prepared, call = await session.prepare_call(body)
                    except Exception as exc:  # answered as the API would: never a traceback
                        refusal = self.intake.pass_failed(exc, call_request, started)
                        return _settled(refusal, session, self.synced)
                    extras = session.ctx.report.request_extras
                    merged = merge_request_fields(prepared, extras)
                    # the client's fields are parsed objects, never changed; a stage's may be
                    kept = body.keys() - extras.keys()
                    content = self.sent.write(
                        branch.key, merged, fast=fast, unchanging=kept, source=source
                    )
                    # (only under stages that read an output once: pipeline.core)
                    readers = rereading_stages(session.pipeline)
                    if self.hold_outputs and fast and source is not None and not readers:
                        hold(source, session.first_new)
                    call_request.prepared(
                        session.ctx.report, time.monotonic() - passing, len(content)
                    )
            with call_request.active():
                try:
                    upstream_response = await unless_left(
                        request.receive, _send(self.client, request, session, content)
                    )
                except httpx2.HTTPError as exc:
                    failed = unreachable(exc)
                    call_request.end(status=failed.status_code, error=type(exc).__name__)
                    self.metrics.request(
                        status=failed.status_code, seconds=time.monotonic() - started
                    )
                    return _settled(failed, session, self.synced)
                if upstream_response is None:  # the call was cancelled with it
                    call_request.end(status=499, error=CLIENT_LEFT)
                    self.metrics.request(status=499, seconds=time.monotonic() - started)
                    return _settled(Response(status_code=499), session, self.synced)
                call_request.answered(upstream_response.status_code)
            done = functools.partial(
                _ended, call_request, self.metrics, started, upstream_response.status_code
            )
            return _relay(
                upstream_response,
                session,
                call,
                call_request,
                end=done,
                after=functools.partial(session.settle, self.synced),
                logger=self.logger,
                max_answer_bytes=self.max_answer_bytes,
            )
        raise AssertionError("unreachable: the last attempt always sends")


async def _send_as_is(client: Upstream, request: Request, raw: bytes) -> httpx2.Response:
    """The client's request upstream unchanged (its conversation's state cannot be read)."""
    query = request.scope.get("query_string", b"")
    return await client.send(client.request("POST", MESSAGES, query, forwarded(request), raw))


def _ended(
    request: WireRequest, metrics: WireMetrics, started: float, status: int, cut: str | None
) -> None:
    request.end(error=cut)  # the upstream's body cut (WireRequest.cut_off), or the client gone
    metrics.request(status=status, seconds=time.monotonic() - started)


def _settled(response: Response, session: WireSession, group: GroupSync) -> Response:
    """``response``, the session's records made durable once it has gone (what the pass
    wrote before the call failed: :meth:`~pipeline.dropin.adapter.WireSession.settle`)."""
    response.background = BackgroundTask(session.settle, group)
    return response


async def _send(
    client: Upstream, request: Request, session: WireSession, content: bytes
) -> httpx2.Response:
    """The prepared request upstream, with the beta header a stage asked for."""
    report = session.ctx.report
    headers = forwarded(request)
    if report.betas:
        headers["anthropic-beta"] = merge_betas(headers.get("anthropic-beta"), report.betas)
    query = request.scope.get("query_string", b"")
    return await client.send(client.request("POST", MESSAGES, query, headers, content))
