"""Token counting: the last real response's usage plus an estimate of what came after it.

- :class:`TokenTracker` holds one :class:`Estimator` (:class:`CalibratedEstimator`, the default,
  or :class:`ReferenceEstimator`) and the record of its errors;
- :func:`find_anchor` finds the usage the estimate starts from;
- :mod:`.features`, :mod:`.text_stats`, :mod:`.media` and :mod:`.priors` price content before
  calibration; :mod:`.family` is what calibration learns per model family; :mod:`.stats` holds
  the results.
"""

from pipeline.tokens.anchor import find_anchor
from pipeline.tokens.calibrated import CalibratedEstimator
from pipeline.tokens.estimator import CallSeen
from pipeline.tokens.media import IMAGE_TOKENS
from pipeline.tokens.reference import (
    ReferenceEstimator,
    rough_tokens_for_block,
    rough_tokens_for_messages,
    rough_tokens_for_text,
)
from pipeline.tokens.stats import ErrorStats, EstimateDetail, Observation
from pipeline.tokens.tracker import (
    CALIBRATION_FILE,
    Estimator,
    Method,
    TokenTracker,
    calibration_path_for,
)

__all__ = [
    "CALIBRATION_FILE",
    "IMAGE_TOKENS",
    "CalibratedEstimator",
    "CallSeen",
    "ErrorStats",
    "EstimateDetail",
    "Estimator",
    "Method",
    "Observation",
    "ReferenceEstimator",
    "TokenTracker",
    "calibration_path_for",
    "find_anchor",
    "rough_tokens_for_block",
    "rough_tokens_for_messages",
    "rough_tokens_for_text",
]
