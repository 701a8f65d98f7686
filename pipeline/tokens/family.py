"""What the calibrated estimator learns per model family: one multiplier per content class and
its covariance, updated from each call's usage delta by a robust Kalman (recursive least
squares) step."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.tokens.priors import CLASSES

__all__ = ["FamilyModel", "dot"]

_MIN_MULTIPLIER = 0.05


def dot(a: Sequence[float], b: Sequence[float]) -> float:
    """The dot product of two equally long vectors."""
    return sum(x * y for x, y in zip(a, b, strict=True))


class FamilyModel:
    """What one model family has learned in this session."""

    __slots__ = ("base_tokens", "chars", "mult", "n_obs", "p")

    def __init__(self, mult: list[float], p: list[list[float]]) -> None:
        self.mult = mult
        """One multiplier per class, on the base tokens."""
        self.p = p
        """Covariance of the multipliers."""
        self.n_obs = 0
        self.chars = [0.0] * len(CLASSES)  # seen per class, for the chars/token report
        self.base_tokens = [0.0] * len(CLASSES)

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
        d = len(CLASSES)
        p = self.p
        px = [dot(p[i], x) for i in range(d)]
        s = dot(x, px)
        y_hat = dot(self.mult, x)
        s += abs_noise**2 + (rel_noise * max(y_hat, 0.0)) ** 2
        cut = clip_sigma * math.sqrt(s)
        innovation = max(-cut, min(cut, y - y_hat))
        gain = [v / s for v in px]
        self.mult = [max(_MIN_MULTIPLIER, self.mult[i] + gain[i] * innovation) for i in range(d)]
        self.p = [[p[i][j] - gain[i] * px[j] for j in range(d)] for i in range(d)]

    def to_json(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        return {
            "mult": dict(zip(CLASSES, self.mult, strict=True)),
            "p": [list(row) for row in self.p],
            "n_obs": self.n_obs,
            "chars": list(self.chars),
            "base_tokens": list(self.base_tokens),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], prior: Mapping[str, float]) -> FamilyModel:
        """Rebuild from :meth:`to_json` (a class missing from ``mult`` starts at ``prior``);
        ``ValueError`` when the shapes do not match the class list."""
        d = len(CLASSES)
        mult = raw["mult"]
        model = cls(
            [float(mult.get(c, prior.get(c, 1.0))) for c in CLASSES],
            [[float(v) for v in row] for row in raw["p"]],
        )
        if len(model.p) != d or any(len(row) != d for row in model.p):
            raise ValueError("state covariance does not match the class list")
        model.n_obs = int(raw.get("n_obs", 0))
        model.chars = [float(v) for v in raw.get("chars", model.chars)]
        model.base_tokens = [float(v) for v in raw.get("base_tokens", model.base_tokens)]
        if len(model.chars) != d or len(model.base_tokens) != d:
            raise ValueError("state counts do not match the class list")
        return model
