"""The estimator protocol: what :class:`~pipeline.tokens.tracker.TokenTracker` asks of the object
that prices content and learns from usage (one of two built in, or your own)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pipeline.messages import Message, Usage
from pipeline.tokens.stats import EstimateDetail

__all__ = ["CallSeen", "Estimator"]


@dataclass(frozen=True, slots=True)
class CallSeen:
    """One call an estimator may learn from: what it saw, what it cost, and the estimate the
    estimator made of it beforehand."""

    messages: Sequence[Message]
    """The messages as sent."""
    usage: Usage
    """The call's usage."""
    model: str | None
    """The model that served it (None: the anchor's)."""
    before: EstimateDetail
    """The estimator's own estimate of ``messages``, made before the call."""


@runtime_checkable
class Estimator(Protocol):
    """How a tracker prices what came after the anchor, and what it learns from usage."""

    method: str
    """``"calibrated"`` or ``"reference"`` (the name a saved state records)."""

    def estimate_detail(
        self, messages: Sequence[Message], *, model: str | None = None
    ) -> EstimateDetail:
        """The estimate for ``messages`` from their usage anchor
        (:func:`~pipeline.tokens.find_anchor`), decomposed."""
        ...

    def tokens_for_messages(self, messages: Sequence[Message], *, model: str | None = None) -> int:
        """Tokens of the content of ``messages`` alone (no anchor, overhead or margin)."""
        ...

    def learn_from(self, call: CallSeen) -> tuple[bool, str]:
        """Learn from one call the tracker did not rule out: whether it learned, and why (not).
        The tracker never asks for a call it already knows to be confounded."""
        ...

    def ratios(self, family: str | None = None) -> dict[str, dict[str, float | None]]:
        """Chars/token per content class (and whatever else the estimator knows of them)."""
        ...

    def state_dict(self) -> dict[str, Any] | None:
        """JSON-serialisable state (None: nothing to keep)."""
        ...

    def for_subagent(self) -> Estimator:
        """An estimator for a sub-agent's conversation, starting from what this one learned."""
        ...
