"""What the proxy does with a request around any conversation (:class:`Intake`): reads its
body within the bound, answers it with an error shaped as the API's, counts and logs it; and
the headers a request goes upstream with: a header sent on several lines goes as one, its
values joined as HTTP joins them (``a, b``); a credential on several lines is refused, since the
request would be placed under one and checked upstream under another. A Messages request is
served within a scope (:class:`ServingScope`) that names its body as the one held outputs are
read from (:mod:`pipeline.wire.held_outputs`) and lets go of it once the response has gone.

A request refused here (too large, compressed, cut off, its body too slow, a credential on
two header lines, not a Messages request) never reaches
a conversation or the upstream: it is counted (the ``http.server.request.duration`` histogram) and
logged (``wire.request``) like any other, with the error's kind and never the body. So is a
request whose pipeline pass failed (:meth:`Intake.pass_failed`): answered as the API would,
before anything goes upstream.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import anyio
import httpx2
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pipeline.core import PipelineHalt, StageError
from pipeline.dropin.conversations import SESSION_HEADER
from pipeline.dropin.metrics import WireMetrics
from pipeline.dropin.tenancy import CREDENTIAL_HEADERS
from pipeline.dropin.wire_request import CLIENT_LEFT, WireRequest
from pipeline.results.keys import keys_shared
from pipeline.wire.held_outputs import serving_scope

__all__ = ["MESSAGES", "Intake", "ServingScope", "error", "forwarded", "unreachable"]

MESSAGES = "/v1/messages"
"""The Messages API's path: where a Messages request goes upstream, whatever its spelling."""

_JOINS = {"cookie": "; "}
"""How the lines of a header are joined, where not with a comma."""
# hop-by-hop and length headers are the proxy's own business on each side; the conversation's
# name is the proxy's alone (the API never needs it)
_DROP_REQUEST = {
    "host",
    "content-length",
    "connection",
    "accept-encoding",
    "transfer-encoding",
    SESSION_HEADER,
}


class Intake:
    """A proxy's request-level bookkeeping (see the module). ``logger``: a structlog-style
    logger; ``max_body_bytes``: the largest body read (one larger is refused with 413 before
    it is all read); ``body_timeout``: seconds a body may take to arrive whole (then 408)."""

    def __init__(
        self, metrics: WireMetrics, logger: Any, max_body_bytes: int, body_timeout: float
    ) -> None:
        self.metrics = metrics
        self.logger = logger
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    def logged(
        self,
        started: float,
        status: int,
        *,
        error: str | None = None,
        method: str = "POST",
        route: str = MESSAGES,
        **fields: Any,
    ) -> None:
        """A request ended (``started``: its ``time.monotonic()``): counted and logged, a
        warning when it failed or its body was cut after its status."""
        seconds = time.monotonic() - started
        if error is not None:
            fields["error"] = error
        self.metrics.request(status=status, seconds=seconds, method=method, route=route)
        if route != MESSAGES:  # a request relayed as it is: which one
            fields["method"] = method
        # a failure, or an error under a status that says otherwise (a body cut after a 200)
        failed = status >= 500 or (error is not None and status < 400)
        log = self.logger.warning if failed else self.logger.info
        log("wire.request", status=status, ms=round(seconds * 1000, 3), **fields)

    def refused(self, started: float, status: int, kind: str, message: str) -> Response:
        """A request answered here, before any conversation: counted and logged."""
        self.logged(started, status, error=kind)
        return error(status, kind, message)

    def pass_failed(self, exc: Exception, call: WireRequest, started: float) -> Response:
        """The answer to a request whose pass failed, as the API would put it, counted and
        logged once (its ``wire.request`` line and span say the error): a request the pass
        cannot read or a stage refused (``PipelineHalt``: ``Autocompact(block=True)``) is a 400;
        a stage that failed, or anything else, a 500 naming the stage and the exception's type
        -- never its message, which can hold content (nor a traceback, which would print it)."""
        if isinstance(exc, ValueError | PipelineHalt):
            status, kind, message = 400, "invalid_request_error", str(exc)[:300]
        elif isinstance(exc, StageError):
            status, kind = 500, "api_error"
            message = f"stage {exc.stage[:100]!r} failed ({exc.cause}); nothing was sent upstream"
        else:
            status, kind = 500, "api_error"
            message = f"the proxy failed ({type(exc).__name__}); nothing was sent upstream"
            frame = traceback.extract_tb(exc.__traceback__)[-1:]
            where = f"{frame[0].filename}:{frame[0].lineno}" if frame else None
            self.logger.error("wire.pass_failed", error=type(exc).__name__, where=where)
        call.end(status=status, error=kind if status == 400 else type(exc).__name__)
        self.metrics.request(status=status, seconds=time.monotonic() - started)
        return error(status, kind, message)

    def relayed_end(self, started: float, status: int, cut: str | None, **fields: Any) -> None:
        """A relayed response has gone by: logged, a warning with the error when the
        upstream cut its body."""
        self.logged(started, status, error=cut, **fields)

    async def body_of(self, request: Request, started: float, **where: Any) -> bytes | Response:
        """The request's body, or the response that refuses it (too large, compressed, a
        credential on two lines, not in whole within :attr:`body_timeout`: 408, its connection
        closed; its client gone before it was in)."""
        for name in CREDENTIAL_HEADERS:
            if len(request.headers.getlist(name)) > 1:
                self.logged(started, 400, error="invalid_request_error", **where)
                message = f"the {name} header was sent more than once: send one credential"
                return error(400, "invalid_request_error", message, close=True)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            message = f"content-encoding {encoding[:40]} is not supported: send the body as it is"
            self.logged(started, 415, error="invalid_request_error", **where)
            return error(415, "invalid_request_error", message)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return self._too_large(started, int(declared), **where)
        chunks, size = [], 0
        try:
            with anyio.fail_after(self.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        return self._too_large(started, size, **where)
                    chunks.append(chunk)
        except ClientDisconnect:  # gone before its body was in: nobody to answer
            self.logged(started, 499, error=CLIENT_LEFT, **where)
            return Response(status_code=499)
        except TimeoutError:
            self.logged(started, 408, error="request_timeout", **where)
            message = f"the request body did not arrive within {self.body_timeout:g} s"
            return error(408, "timeout_error", message, close=True)
        return b"".join(chunks)

    def _too_large(self, started: float, size: int, **where: Any) -> Response:
        self.logged(started, 413, error="request_too_large", **where)
        message = f"request body of {size} bytes or more is over the limit of {self.max_body_bytes}"
        return error(413, "request_too_large", message)


def forwarded(request: Request) -> dict[str, str]:
    """The headers ``request`` goes upstream with: its own, but the hop's and the proxy's; one
    sent on several lines as one (``a, b``; a cookie's ``a; b``), as HTTP reads them, a value
    repeated once (a header sent twice alike stays valid)."""
    lines: dict[str, dict[str, None]] = {}
    for name, value in request.headers.items():  # every line, names in lower case
        if name not in _DROP_REQUEST:
            lines.setdefault(name, {})[value] = None
    return {name: _JOINS.get(name, ", ").join(values) for name, values in lines.items()}


def unreachable(exc: httpx2.HTTPError) -> Response:
    """The answer to a request whose upstream call failed, as the API reports an outage or a
    timeout (504 ``timeout_error``, else 502 ``api_error``), so a client retries it as one."""
    if isinstance(exc, httpx2.TimeoutException) and not isinstance(exc, httpx2.ConnectTimeout):
        return error(
            504, "timeout_error", f"upstream did not answer in time ({type(exc).__name__})"
        )
    return error(502, "api_error", f"upstream unreachable ({type(exc).__name__})")


def error(status: int, kind: str, message: str, *, close: bool = False) -> Response:
    """An error response shaped as the API's (``{"type": "error", "error": {...}}``);
    ``close``: its connection closed after it (the rest of its request is not read)."""
    headers = {"connection": "close"} if close else None
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status, headers=headers)


class ServingScope:
    """An ASGI app (a route of the proxy's) run within
    :func:`~pipeline.wire.held_outputs.serving_scope`: the body a request named as the one its
    held outputs are read from is let go of once its response has gone; and within
    :func:`~pipeline.results.keys.keys_shared`: a result keyed twice in it is one string."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with serving_scope(), keys_shared():
            await self.app(scope, receive, send)
