"""A scripted local stand-in for the Anthropic Messages API, for demos and tests.

It listens on 127.0.0.1 on a random port and speaks enough of the HTTP API for the real
``anthropic`` SDK: ``POST /v1/messages`` (non-streaming) and ``POST /v1/messages/count_tokens``.
A *script* decides each reply from the request body, so a demo or a test drives the real client
code path over real HTTP with no key and no network. Every request body is recorded.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "RawReply",
    "Reply",
    "ScriptError",
    "ScriptedMessagesServer",
    "compaction_reply",
    "count_request_tokens",
    "sse_events",
]


@dataclass(frozen=True, slots=True)
class Reply:
    """One scripted assistant response. Usage is filled in by the server when not given;
    ``context_management``: what the API reports of the server-side edits it applied (in the
    message, or a stream's ``message_delta``), e.g. ``{"applied_edits": [{"type":
    "clear_tool_uses_20250919", "cleared_tool_uses": 2, "cleared_input_tokens": 900}]}``.
    A server compaction is a ``{"type": "compaction", "content": "<summary>"}`` block in
    ``content`` and a ``usage`` with ``iterations`` (``stop_reason="compaction"`` when paused)."""

    content: list[dict[str, Any]]
    stop_reason: str = "end_turn"
    usage: Mapping[str, Any] | None = None
    context_management: Mapping[str, Any] | None = None


def compaction_reply(
    summary: str,
    then: list[dict[str, Any]] | None = None,
    *,
    compacted_tokens: int = 150_000,
    summary_tokens: int = 2_000,
    context_tokens: int = 2_500,
    output_tokens: int = 50,
) -> Reply:
    """A response of a server that compacted the context, as the API sends one: a
    ``compaction`` block holding ``summary``, then the blocks of ``then`` -- or none, a paused
    response (``stop_reason="compaction"``) -- and a usage whose ``iterations`` hold the
    compaction (``compacted_tokens`` read, ``summary_tokens`` written) and, unless paused, the
    sampling that followed (``context_tokens`` in, ``output_tokens`` out), which the top-level
    counts repeat."""
    sampled = {
        "type": "message",
        "input_tokens": context_tokens if then else 0,
        "output_tokens": output_tokens if then else 0,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    compaction = {
        "type": "compaction",
        "input_tokens": compacted_tokens,
        "output_tokens": summary_tokens,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    usage: dict[str, Any] = {
        **{k: v for k, v in sampled.items() if k != "type"},
        "iterations": [compaction, sampled] if then else [compaction],
    }
    return Reply(
        [{"type": "compaction", "content": summary}, *(then or [])],
        stop_reason="end_turn" if then else "compaction",
        usage=usage,
    )


@dataclass(frozen=True, slots=True)
class ScriptError:
    """A scripted API error: HTTP status, error type and message (as the real API sends them)."""

    status: int
    type: str
    message: str
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RawReply:
    """A scripted reply sent byte for byte: a misbehaving API (a 200 with HTML, invalid JSON,
    a wrong shape) for tests of what a client does with it."""

    body: bytes
    status: int = 200
    content_type: str = "application/json"


Script = Callable[[dict[str, Any]], Reply | ScriptError | RawReply]


def count_request_tokens(body: Mapping[str, Any]) -> int:
    """A deterministic token count for a request: one token per 3 characters of its JSON.

    Not a tokenizer — a stable stand-in so usage figures move the way real ones do.
    """
    parts = {k: body.get(k) for k in ("system", "tools", "messages") if body.get(k) is not None}
    return max(1, math.ceil(len(json.dumps(parts, ensure_ascii=False)) / 3))


def _common_prefix_tokens(previous: Mapping[str, Any] | None, body: Mapping[str, Any]) -> int:
    """Tokens of the longest message prefix this request shares with the previous one."""
    if previous is None:
        return 0
    shared = []
    for a, b in zip(previous.get("messages", []), body.get("messages", []), strict=False):
        if a != b:
            break
        shared.append(a)
    if not shared:
        return 0
    prefix = {k: body.get(k) for k in ("system", "tools")}
    prefix["messages"] = shared
    return count_request_tokens(prefix)


class _Server(ThreadingHTTPServer):
    # many clients at once (a test of concurrent sessions): the default backlog of 5 would
    # reset connections the real API accepts
    request_queue_size = 1024
    daemon_threads = True


class ScriptedMessagesServer:
    """Serve scripted replies on ``base_url`` until :meth:`close` (also a context manager).

    ``requests`` holds every ``/v1/messages`` request body, in order, and ``request_headers``
    their HTTP headers (names in lower case); ``count_requests`` the ``count_tokens`` ones.
    Usage mimics prompt caching: the prefix shared with the previous request is reported as
    ``cache_read_input_tokens``, the rest as cache writes and input.
    """

    def __init__(self, script: Script, *, model: str = "claude-scripted") -> None:
        self.script = script
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self.request_headers: list[dict[str, str]] = []
        self.count_requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._run = secrets.token_hex(3)
        """This server's own part of every response id."""
        self._server = _Server(("127.0.0.1", 0), self._handler_class())
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` — pass as ``AsyncAnthropic(base_url=...)`` (and close
        that client in the event loop that used it: one the garbage collector finds later is
        closed in whichever loop runs then, which fails if its connections belong to another)."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> ScriptedMessagesServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- request handling -------------------------------------------------------------------
    def _reply(
        self, path: str, body: dict[str, Any], sent: Mapping[str, str] | None = None
    ) -> tuple[int, dict[str, Any] | RawReply, dict[str, str]]:
        request_id = f"req_scripted_{next(self._ids):06d}"
        headers = {"request-id": request_id}
        path = path.partition("?")[0]  # Claude Code posts to /v1/messages?beta=true
        if path.rstrip("/").endswith("/v1/messages/count_tokens"):
            with self._lock:
                self.count_requests.append(body)
            return 200, {"input_tokens": count_request_tokens(body)}, headers
        if not path.rstrip("/").endswith("/v1/messages"):
            return 404, _error("not_found_error", f"no route {path}"), headers
        with self._lock:
            previous = self.requests[-1] if self.requests else None
            self.requests.append(body)
            self.request_headers.append({k.lower(): v for k, v in (sent or {}).items()})
            number = len(self.requests)
        try:
            outcome = self.script(body)
        except Exception as exc:  # a broken script is a server error, as a real outage would be
            return 500, _error("api_error", f"script failed: {type(exc).__name__}"), headers
        if isinstance(outcome, RawReply):
            return outcome.status, outcome, headers
        if isinstance(outcome, ScriptError):
            return (
                outcome.status,
                _error(outcome.type, outcome.message),
                {**headers, **outcome.headers},
            )
        total = count_request_tokens(body)
        cached = min(_common_prefix_tokens(previous, body), total)
        usage = (
            dict(outcome.usage)
            if outcome.usage is not None
            else {
                "input_tokens": min(total - cached, 50),
                "cache_creation_input_tokens": max(0, total - cached - 50),
                "cache_read_input_tokens": cached,
                "output_tokens": max(1, math.ceil(len(json.dumps(outcome.content)) / 3)),
            }
        )
        message = {
            # unique as the API's are, also across servers: a session resumed against a new
            # one is never answered with an id one of its responses had
            "id": f"msg_scripted_{number:04d}_{self._run}",
            "type": "message",
            "role": "assistant",
            "model": str(body.get("model") or self.model),
            "content": outcome.content,
            "stop_reason": outcome.stop_reason,
            "stop_sequence": None,
            "usage": usage,
        }
        if outcome.context_management is not None:
            message["context_management"] = dict(outcome.context_management)
        if body.get("stream") is True:  # the same message as server-sent events
            return 200, RawReply(sse_events(message), content_type="text/event-stream"), headers
        return 200, message, headers

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw or b"{}")
                    if not isinstance(body, dict):
                        raise ValueError("body is not an object")
                except ValueError:
                    headers: dict[str, str] = {}
                    payload: dict[str, Any] | RawReply
                    status, payload = 400, _error("invalid_request_error", "bad JSON")
                else:
                    status, payload, headers = server._reply(self.path, body, dict(self.headers))
                if isinstance(payload, RawReply):
                    data, content_type = payload.body, payload.content_type
                else:
                    data, content_type = json.dumps(payload).encode(), "application/json"
                try:
                    self.send_response(status)
                    self.send_header("content-type", content_type)
                    self.send_header("content-length", str(len(data)))
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    # the client went away (an interrupted demo or test): nobody to answer, and
                    # a traceback on stderr would only be noise
                    self.close_connection = True

            def log_message(self, format: str, *args: Any) -> None:
                return  # keep test and demo output clean

        return Handler


def sse_events(message: Mapping[str, Any]) -> bytes:
    """``message`` as the Messages API streams it: ``message_start`` (input usage), each block
    as start / delta / stop, ``message_delta`` (stop reason, output usage), ``message_stop``."""
    usage = dict(message.get("usage") or {})
    output = usage.pop("output_tokens", 0)
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    edits = start.pop("context_management", None)
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"message": start})]
    for i, block in enumerate(message.get("content") or []):
        btype = block.get("type")
        if btype == "text":
            head, delta = {**block, "text": ""}, {"type": "text_delta", "text": block["text"]}
        elif btype == "tool_use":
            head = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        else:
            head, delta = block, None
        events.append(("content_block_start", {"index": i, "content_block": head}))
        if delta is not None:
            events.append(("content_block_delta", {"index": i, "delta": delta}))
        events.append(("content_block_stop", {"index": i}))
    stop = {"stop_reason": message.get("stop_reason"), "stop_sequence": None}
    ending: dict[str, Any] = {"delta": stop, "usage": {"output_tokens": output}}
    if edits is not None:  # the edits are known once the response is
        ending["context_management"] = edits
    events.append(("message_delta", ending))
    events.append(("message_stop", {}))
    return b"".join(
        f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()
        for name, data in events
    )


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


OFFLINE_ANSWER = "(an offline answer from pipeline.testing: set ANTHROPIC_API_KEY to ask the API)"


@contextlib.contextmanager
def messages_api(script: Script | None = None) -> Iterator[dict[str, str]]:
    """Keyword arguments for an ``anthropic`` client: ``{}`` when ``ANTHROPIC_API_KEY`` is set
    (the SDK reads its ``ANTHROPIC_*`` variables: the real API, or whatever
    ``ANTHROPIC_BASE_URL`` names), else a :class:`ScriptedMessagesServer` for the ``with``
    block and ``{"base_url": ..., "api_key": "offline"}`` for it. ``script``: its replies
    (default: every request answered with :data:`OFFLINE_ANSWER`). For examples and demos that
    run with no key and no network, and against the API once given a key."""
    if os.environ.get("ANTHROPIC_API_KEY"):
        yield {}
        return

    def answer(_body: dict[str, Any]) -> Reply:
        return Reply([{"type": "text", "text": OFFLINE_ANSWER}])

    with ScriptedMessagesServer(script or answer) as server:
        yield {"base_url": server.base_url, "api_key": "offline"}
