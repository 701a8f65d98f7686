"""The estimator protocol: what :class:`~pipeline.tokens.tracker.TokenTracker` asks of the object
that prices content and learns from usage (one of two built in, or your own)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from pipeline.messages import Message, Usage
from pipeline.tokens.stats import EstimateDetail

__all__ = ["Estimator"]


@runtime_checkable
class Estimator(Protocol):
    """How a tracker prices what came after the anchor, and what it learns from usage."""

    method: str
    """``"calibrated"`` or ``"reference"`` (the name a saved state records)."""

    def estimate_detail(
        self,
        messages: Sequence[Message],
        anchor: tuple[int, Usage] | None,
        *,
        model: str | None = None,
    ) -> EstimateDetail:
        """The estimate for ``messages`` whose anchor is ``anchor``, decomposed."""
        ...

    def tokens_for_messages(self, messages: Sequence[Message], *, model: str | None = None) -> int:
        """Tokens of the content of ``messages`` alone (no anchor, overhead or margin)."""
        ...

    def observe(
        self,
        messages: Sequence[Message],
        anchor: tuple[int, Usage] | None,
        usage: Usage,
        *,
        model: str | None = None,
        skip: str | None = None,
    ) -> tuple[EstimateDetail, bool, str]:
        """Learn from one call (unless ``skip`` says why not): the estimate as it stood,
        whether it learned, and why (not)."""
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
