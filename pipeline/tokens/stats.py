"""What the token tracker reports: one estimate decomposed, one call's usage against it, and
error statistics over many calls."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BIG_GROWTH",
    "UNDERCOUNT_TOLERANCE",
    "ErrorStats",
    "EstimateDetail",
    "Observation",
    "nearest_rank",
    "rounded",
]

UNDERCOUNT_TOLERANCE = 0.10
"""An estimate more than 10 % below the real count is an under-count."""
BIG_GROWTH = 2_000
"""Relative errors are judged on calls whose real growth since the anchor is at least this:
on a growth of a few tokens a relative error says nothing."""


@dataclass(frozen=True, slots=True)
class EstimateDetail:
    """One estimate, decomposed."""

    total: int
    """Tokens the context would hold if the messages were sent now."""
    anchor_total: int
    """Usage total of the anchor (input side + output_tokens); 0 without a usable anchor."""
    estimated_part: int
    """``total - anchor_total``: the estimated tokens (margin included)."""
    response_adjustment: float
    """``max(0, tokens(anchor response) - output_tokens)`` before the margin (0: reference)."""
    new_tokens: float
    """Tokens of the wire-visible content after the anchor response, before the margin."""
    margin: float
    """The safety margin applied to the estimated part (0: reference)."""
    family: str
    has_anchor: bool
    """An anchor was found and no compaction lies between it and the end."""
    crossed_compaction: bool
    """A compaction lies after the anchor: the request was rebuilt, its usage does not apply."""
    request_overhead: int = 0
    """Tokens added for the system prompt and tool schemas the next call carries (see
    :meth:`~pipeline.tokens.TokenTracker.set_request`): all of them without an anchor, their
    change since the anchor's call with one. Included in ``total`` and ``estimated_part``."""


@dataclass(frozen=True, slots=True)
class Observation:
    """One call's usage against what the tracker predicted for it (before learning from it)."""

    method: str
    family: str
    estimate: int
    """The whole-context estimate for the call's messages."""
    actual: int
    """The call's input side (input + cache writes + cache reads)."""
    estimated_part: int
    """The estimated part of ``estimate`` (what came after the anchor)."""
    real_growth: int | None
    """``actual`` minus the anchor's usage total: what the estimated part had to guess. None
    when it cannot be measured (no anchor, a compaction since it, or stages removed content
    the anchor's usage counted)."""
    learned: bool
    reason: str

    @property
    def relative_error(self) -> float | None:
        """``(estimated part - real growth) / real growth``, when the growth is known and > 0."""
        if self.real_growth is None or self.real_growth <= 0:
            return None
        return (self.estimated_part - self.real_growth) / self.real_growth


def rounded(x: float | None) -> float | None:
    """``x`` to 4 decimals, for JSON reports; None stays None."""
    return None if x is None else round(x, 4)


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ascending ``sorted_values`` by the nearest-rank rule."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


@dataclass(frozen=True, slots=True)
class ErrorStats:
    """Errors of the estimated part against the real growth since the anchor.

    Relative figures are over the calls with growth >= ``min_growth``; token figures over all.
    A value is None when there is no call to compute it on.
    """

    calls: int
    min_growth: int
    big_calls: int
    median_signed: float | None
    median_abs: float | None
    p95_abs: float | None
    undercounted: int
    """Calls (growth >= ``min_growth``) whose estimate is more than 10 % below the growth."""
    undercount_share: float | None
    median_abs_tokens: float | None
    p95_abs_tokens: float | None

    @classmethod
    def from_pairs(
        cls, pairs: Iterable[tuple[float, float]], *, min_growth: int = BIG_GROWTH
    ) -> ErrorStats:
        """Statistics of ``(estimated part, real growth)`` pairs."""
        pairs = list(pairs)
        rel = [(p - r) / r for p, r in pairs if r >= min_growth and r > 0]
        abs_rel = sorted(abs(e) for e in rel)
        abs_tok = sorted(abs(p - r) for p, r in pairs)
        under = sum(1 for e in rel if e < -UNDERCOUNT_TOLERANCE)
        return cls(
            calls=len(pairs),
            min_growth=min_growth,
            big_calls=len(rel),
            median_signed=statistics.median(rel) if rel else None,
            median_abs=statistics.median(abs_rel) if rel else None,
            p95_abs=nearest_rank(abs_rel, 0.95) if rel else None,
            undercounted=under,
            undercount_share=under / len(rel) if rel else None,
            median_abs_tokens=statistics.median(abs_tok) if abs_tok else None,
            p95_abs_tokens=nearest_rank(abs_tok, 0.95) if abs_tok else None,
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-ready, rounded."""
        return {
            "calls": self.calls,
            "min_growth": self.min_growth,
            "big_calls": self.big_calls,
            "median_signed_rel_error": rounded(self.median_signed),
            "abs_rel_error_median": rounded(self.median_abs),
            "abs_rel_error_p95": rounded(self.p95_abs),
            "undercount_gt_10pct": self.undercounted,
            "undercount_gt_10pct_share": rounded(self.undercount_share),
            "abs_error_tokens_median": rounded(self.median_abs_tokens),
            "abs_error_tokens_p95": rounded(self.p95_abs_tokens),
        }
