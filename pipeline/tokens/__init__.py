"""Token counting: the last real response's usage plus an estimate of what came after it."""

from pipeline.tokens.tracker import (
    CALIBRATION_FILE,
    IMAGE_TOKENS,
    ErrorStats,
    EstimateDetail,
    Method,
    Observation,
    TokenTracker,
    calibration_path_for,
    find_anchor,
    rough_tokens_for_messages,
    rough_tokens_for_text,
)

__all__ = [
    "CALIBRATION_FILE",
    "IMAGE_TOKENS",
    "ErrorStats",
    "EstimateDetail",
    "Method",
    "Observation",
    "TokenTracker",
    "calibration_path_for",
    "find_anchor",
    "rough_tokens_for_messages",
    "rough_tokens_for_text",
]
