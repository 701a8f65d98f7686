"""What the calibrated estimator learns per model family: one multiplier per content class and
its covariance, updated from each call's usage delta by a robust Kalman (recursive least
squares) step."""

from __future__ import annotations

import math
import operator
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.tokens.checks import (
    MAX_MULTIPLIER,
    check_int,
    check_keys,
    check_mapping,
    check_number,
    check_numbers,
    check_psd,
)
from pipeline.tokens.priors import CLASSES

__all__ = ["FamilyModel", "dot"]

_MIN_MULTIPLIER = 0.05
_MAX_VARIANCE = 1e6
_MAX_COUNT = 1e15
"""Characters and base tokens a session may have seen per class (far above any session)."""


def dot(a: Sequence[float], b: Sequence[float]) -> float:
    """The dot product of two equally long vectors (``ValueError`` if they are not)."""
    if len(a) != len(b):
        raise ValueError(f"dot of vectors of {len(a)} and {len(b)} elements")
    # the products added by sum(): in a loop's order (compensated from Python 3.12 on);
    # FamilyModel.update adds its sums alike
    total: float = sum(map(operator.mul, a, b))
    return total


def _no_negative_zero(row: Sequence[float]) -> array[float]:
    """``row`` as doubles, -0.0 read as 0.0 (the same number): :meth:`FamilyModel.update`
    leaves a row it has no gain for as it is, which is the step's own result only where no
    entry is -0.0 (-0.0 - -0.0 is 0.0); a step itself never makes one from 0.0 and finite
    numbers."""
    return array("d", [v + 0.0 for v in row])


class FamilyModel:
    """What one model family has learned in this session."""

    __slots__ = ("base_tokens", "chars", "mult", "n_obs", "p")

    def __init__(self, mult: Sequence[float], p: Sequence[Sequence[float]]) -> None:
        # arrays of doubles, not lists of floats: every held conversation has one of these
        # per model family (a float object and its slot are 32 bytes, a double 8: ~5.2 KB
        # a model as lists, ~2.4 KB as arrays), and a double holds a float's value exactly
        self.mult = array("d", mult)
        """One multiplier per class, on the base tokens."""
        self.p = [_no_negative_zero(row) for row in p]
        """Covariance of the multipliers."""
        self.n_obs = 0
        self.chars = array("d", bytes(8 * len(CLASSES)))  # for the chars/token report
        self.base_tokens = array("d", bytes(8 * len(CLASSES)))

    @classmethod
    def from_prior(cls, mult: list[float], sd: Sequence[float]) -> FamilyModel:
        """A model starting at ``mult``, with independent prior standard deviations ``sd``."""
        d = len(CLASSES)
        return cls(mult, [[(sd[i] ** 2 if i == j else 0.0) for j in range(d)] for i in range(d)])

    def update(
        self, x: list[float], y: float, *, abs_noise: float, rel_noise: float, clip_sigma: float
    ) -> None:
        """One robust step of ``y ~ mult . x``: the innovation is clipped at ``clip_sigma``
        sigmas, so a hidden injection of a few thousand tokens cannot yank the ratios."""
        p, mul = self.p, operator.mul
        if len(x) != len(CLASSES):
            raise ValueError(f"dot of vectors of {len(CLASSES)} and {len(x)} elements")
        # each sum as dot() adds it (by sum(), from 0.0): the same floats, without a call each
        px = [sum(map(mul, row, x), 0.0) for row in p]
        s = sum(map(mul, x, px), 0.0)
        y_hat = sum(map(mul, self.mult, x), 0.0)
        s += abs_noise**2 + (rel_noise * max(y_hat, 0.0)) ** 2
        if not (math.isfinite(s) and s > 0.0 and math.isfinite(y)):
            return  # a degenerate step teaches nothing; raising here would fail the turn
        cut = clip_sigma * math.sqrt(s)
        innovation = max(-cut, min(cut, y - y_hat))
        gain = [v / s for v in px]
        stepped = zip(self.mult, gain, strict=True)
        mult = [max(_MIN_MULTIPLIER, m + g * innovation) for m, g in stepped]
        if not all(map(math.isfinite, mult)):
            return
        self.mult = array("d", mult)
        # a row whose gain is 0.0 (a class no content of the step touches, nor any class
        # correlated with one) would only have +-0.0 taken off each entry: left as it is, the
        # same floats, since no entry is -0.0 (see _no_negative_zero)
        self.p = [
            row if not g else array("d", map(operator.sub, row, map(g.__mul__, px)))
            for row, g in zip(p, gain, strict=True)
        ]

    def copy(self) -> FamilyModel:
        """An independent copy (lists copied, never shared)."""
        model = FamilyModel(self.mult, self.p)
        model.n_obs = self.n_obs
        model.chars = array("d", self.chars)
        model.base_tokens = array("d", self.base_tokens)
        return model

    def to_json(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        return {
            "mult": dict(zip(CLASSES, self.mult, strict=True)),
            "p": [row.tolist() for row in self.p],
            "n_obs": self.n_obs,
            "chars": self.chars.tolist(),
            "base_tokens": self.base_tokens.tolist(),
        }

    @classmethod
    def from_json(cls, raw: Any, prior: Mapping[str, float]) -> FamilyModel:
        """Rebuild from :meth:`to_json` (a class missing from ``mult`` starts at ``prior``);
        ``ValueError`` on anything :meth:`to_json` could not have written: a wrong shape, a
        multiplier that is not finite and > 0, a covariance that is not one, a negative count."""
        d = len(CLASSES)
        raw = check_mapping(raw, "family")
        check_keys(raw, "family", ("mult", "p", "n_obs", "chars", "base_tokens"))
        mult = check_mapping(raw.get("mult"), "family mult")
        check_keys(mult, "family mult", CLASSES)
        mults = [
            check_number(
                mult.get(c, prior.get(c, 1.0)),
                f"multiplier {c!r}",
                low=0.0,
                high=MAX_MULTIPLIER,
                low_open=True,
            )
            for c in CLASSES
        ]
        rows = raw.get("p")
        if not isinstance(rows, list) or len(rows) != d:
            raise ValueError("state covariance does not match the class list")
        p = [
            check_numbers(row, f"covariance row {i}", d, low=-_MAX_VARIANCE, high=_MAX_VARIANCE)
            for i, row in enumerate(rows)
        ]
        check_psd(p, "state covariance")
        model = cls(mults, p)
        model.n_obs = check_int(raw.get("n_obs", 0), "n_obs", low=0, high=10**12)
        if "chars" in raw:
            chars = check_numbers(raw["chars"], "chars", d, low=0.0, high=_MAX_COUNT)
            model.chars = array("d", chars)
        if "base_tokens" in raw:
            base = check_numbers(raw["base_tokens"], "base_tokens", d, low=0.0, high=_MAX_COUNT)
            model.base_tokens = array("d", base)
        return model
