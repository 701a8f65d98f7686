"""Retries of a failed Messages API call, bounded in number and in wait.

The SDK waits as long as a ``retry-after`` header asks (up to about 50 days) and retries as many
times as it is told. The agent retries itself instead -- each retry logged -- and refuses a wait
longer than :attr:`RetryPolicy.max_wait`.
"""

from __future__ import annotations

import email.utils
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RETRYABLE_KINDS", "RetryPolicy", "retry_after_seconds"]

RETRYABLE_KINDS = frozenset({"overloaded", "rate_limited", "server", "connection", "timeout"})
"""The :class:`~pipeline.agent.results.AgentAPIError` kinds worth another try."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How the agent retries a call that failed with a retryable kind.

    ``retries``: how many more tries (0: none; the client's own retries still apply);
    ``max_wait``: the longest wait in seconds, ``retry-after`` included (a longer one fails the
    call at once); otherwise the wait doubles from ``base_delay`` up to ``max_delay``.
    """

    retries: int = 0
    max_wait: float = 60.0
    base_delay: float = 0.5
    max_delay: float = 8.0

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int):
            raise TypeError("retries must be an int")
        if not 0 <= self.retries <= 100:
            raise ValueError(f"retries must be from 0 to 100, got {self.retries}")
        for name in ("max_wait", "base_delay", "max_delay"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def wait_before(self, attempt: int, kind: str, retry_after: float | None) -> float | None:
        """Seconds to wait before retry number ``attempt`` (1-based); None: do not retry."""
        if attempt > self.retries or kind not in RETRYABLE_KINDS:
            return None
        if retry_after is not None:
            return retry_after if retry_after <= self.max_wait else None
        return min(self.base_delay * 2.0 ** min(attempt - 1, 30), self.max_delay, self.max_wait)


def retry_after_seconds(headers: Mapping[str, str] | None) -> float | None:
    """The wait a response asks for: ``retry-after-ms``, or ``retry-after`` in seconds or as
    an HTTP date; ``math.inf`` for one past any calendar; None when absent or unreadable."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms) / 1000
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value >= 0:
            return value
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            parsed = email.utils.parsedate_tz(raw)
            if parsed is None:
                return None
            value = email.utils.mktime_tz(parsed) - time.time()
        except (ValueError, OverflowError):  # a date no calendar holds: as good as never
            return math.inf
    if math.isnan(value):
        return None
    return max(value, 0.0)  # inf stays inf: longer than any max_wait, so no retry
