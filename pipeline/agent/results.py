"""What the agent loop reports: API errors, one log per model call, how a run ended."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anthropic

from pipeline.agent.retry import retry_after_seconds
from pipeline.context import PassReport
from pipeline.messages import Usage
from pipeline.tokens import Observation

if TYPE_CHECKING:
    from anthropic.types import MessageParam

__all__ = ["AgentAPIError", "AgentResult", "GatedResult", "TurnLog"]


class AgentAPIError(anthropic.APIError):
    """The Messages API refused a call, or answered with something that is not a message.
    Everything recorded before the call is kept; nothing of the failed call is recorded.

    An ``anthropic.APIError``, so ``except anthropic.APIError`` catches it. ``kind``:
    ``overloaded``, ``prompt_too_long``, ``bad_request``, ``rate_limited``, ``authentication``,
    ``permission``, ``not_found``, ``server``, ``connection``, ``timeout``, ``bad_response``
    (a 200 whose body is not a well-formed message: see
    :func:`~pipeline.agent.response.message_from_response`).
    """

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        status: int | None,
        request_id: str | None,
        request: Any = None,
        body: object | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.kind = kind
        self.status = status
        self.request_id = request_id
        self.retry_after = retry_after
        """Seconds the API asked to wait before a retry (``retry-after``), if it said."""
        super().__init__(
            f"{kind} (status {status}, request id {request_id}): {message}", request, body=body
        )

    def __str__(self) -> str:
        return self.message

    @classmethod
    def from_sdk(cls, exc: anthropic.APIError) -> AgentAPIError:
        """Classify an SDK exception."""
        request = getattr(exc, "request", None)
        if isinstance(exc, anthropic.APITimeoutError):
            return cls("timeout", str(exc), status=None, request_id=None, request=request)
        if isinstance(exc, anthropic.APIConnectionError):
            return cls("connection", str(exc), status=None, request_id=None, request=request)
        status = getattr(exc, "status_code", None)
        request_id = getattr(exc, "request_id", None)
        body = getattr(exc, "body", None)
        detail = ""
        if isinstance(body, Mapping):
            err = body.get("error")
            if isinstance(err, Mapping):
                detail = str(err.get("message") or "")
        message = detail or str(exc)
        kinds = {
            529: "overloaded",
            429: "rate_limited",
            401: "authentication",
            403: "permission",
            404: "not_found",
        }
        kind = kinds.get(status or 0, "server" if (status or 0) >= 500 else "bad_request")
        if status in (400, 413) and "prompt is too long" in message.lower():
            kind = "prompt_too_long"
        response = getattr(exc, "response", None)
        headers = getattr(response, "headers", None)
        return cls(
            kind,
            message,
            status=status,
            request_id=request_id,
            request=request,
            body=body,
            retry_after=retry_after_seconds(headers),
        )


@dataclass(frozen=True, slots=True)
class GatedResult:
    """What the per-tool gate did to one tool result as it was produced."""

    tool_use_id: str
    tool_name: str
    decision: str
    chars: int
    path: str | None


@dataclass(frozen=True, slots=True)
class TurnLog:
    """One model call, as an observer (``Agent(on_turn=...)``) sees it."""

    number: int
    message_id: str
    request: list[MessageParam]
    """The exact ``messages`` sent."""
    estimated_tokens: int
    """The tracker's estimate of the request before it was sent."""
    usage: Usage
    report: PassReport
    """What the pipeline's stages did in the pass that built the request."""
    gated: list[GatedResult]
    """The per-tool gate's decisions on the tool results this response asked for."""
    observation: Observation | None = None
    """The session tracker's estimate of this request held against the response's usage."""


@dataclass(frozen=True, slots=True)
class AgentResult:
    """How a run ended."""

    stop_reason: str
    """The model's last ``stop_reason``, or ``max_turns``."""
    turns: int
    """Model calls made in this run."""
    text: str
    """Text of the last assistant response."""
