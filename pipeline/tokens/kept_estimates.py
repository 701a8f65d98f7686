"""A tracker's memory of its latest estimates of kept lists: every stage of a pass estimates the
list it is handed, most often one that an earlier stage (or the pipeline) estimated already.

A :class:`~pipeline.kept_list.KeptList` counts its changes (its ``stamp``), records are
immutable, and a built-in estimator's answer changes only when it observes a call (through any
tracker that shares it): the same list at the same stamp, the same estimator with the same
observations and the same model give the same answer. Any other estimator is asked every time.
"""

from __future__ import annotations

from typing import Any

from pipeline.kept_list import KeptList
from pipeline.messages import Message
from pipeline.tokens.calibrated import CalibratedEstimator
from pipeline.tokens.estimator import Estimator
from pipeline.tokens.reference import ReferenceEstimator
from pipeline.tokens.stats import EstimateDetail

__all__ = ["KeptEstimates"]

_KEPT = 4
"""Lists whose latest estimate is remembered (a pass estimates its input and a few stage
outputs, each several times)."""


def _observations(estimator: Estimator) -> int | None:
    """What a built-in estimator's estimates read besides the records, the anchor and the
    model (None: an estimator of another kind, whose state is unknown)."""
    if type(estimator) is ReferenceEstimator:
        return 0  # it never learns
    # exactly the built-in class: a subclass may read more than what it observed
    if isinstance(estimator, CalibratedEstimator) and type(estimator) is CalibratedEstimator:
        return estimator.observations
    return None


class KeptEstimates:
    """The estimator's detail for a kept list, reused while nothing it depends on changed."""

    def __init__(self) -> None:
        self._latest: dict[int, tuple[KeptList[Message], tuple[Any, ...], EstimateDetail]] = {}
        """id -> (the list, what its estimate depended on, the estimate)."""

    def detail(
        self, estimator: Estimator, messages: KeptList[Message], model: str | None
    ) -> EstimateDetail:
        """``estimator.estimate_detail`` of ``messages`` at their anchor, from memory when it
        would give the same answer again."""
        seen = _observations(estimator)
        if seen is None:
            return estimator.estimate_detail(messages, model=model)
        # the estimator itself is compared by identity (the built-in ones define no __eq__)
        state = (messages.stamp, estimator, seen, model)
        latest = self._latest
        hit = latest.get(id(messages))
        if hit is not None and hit[0] is messages and hit[1] == state:
            return hit[2]
        detail = estimator.estimate_detail(messages, model=model)
        if id(messages) not in latest and len(latest) >= _KEPT:
            del latest[next(iter(latest))]  # the oldest: dicts keep insertion order
        latest[id(messages)] = (messages, state, detail)
        return detail
