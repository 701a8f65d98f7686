"""What the agent loop reports: API errors, one log per model call, how a run ended."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anthropic

from pipeline.context import PassReport
from pipeline.messages import Usage
from pipeline.tokens import Observation

if TYPE_CHECKING:
    from anthropic.types import MessageParam

__all__ = ["AgentAPIError", "AgentResult", "GatedResult", "TurnLog"]


class AgentAPIError(RuntimeError):
    """The Messages API refused a call. Everything recorded before the call is kept.

    ``kind``: ``overloaded``, ``prompt_too_long``, ``bad_request``, ``rate_limited``,
    ``authentication``, ``permission``, ``not_found``, ``server``, ``connection``, ``timeout``.
    """

    def __init__(
        self, kind: str, message: str, *, status: int | None, request_id: str | None
    ) -> None:
        self.kind = kind
        self.status = status
        self.request_id = request_id
        super().__init__(f"{kind} (status {status}, request id {request_id}): {message}")

    @classmethod
    def from_sdk(cls, exc: anthropic.APIError) -> AgentAPIError:
        """Classify an SDK exception."""
        if isinstance(exc, anthropic.APITimeoutError):
            return cls("timeout", str(exc), status=None, request_id=None)
        if isinstance(exc, anthropic.APIConnectionError):
            return cls("connection", str(exc), status=None, request_id=None)
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
        return cls(kind, message, status=status, request_id=request_id)


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
