"""The calibrated estimator's model: text features, content classes, model families and the
priors fitted on real Claude Code usage (tokens per feature, multiplier start values and their
uncertainty)."""

from __future__ import annotations

__all__ = [
    "CLASSES",
    "CLASS_INDEX",
    "FAMILIES",
    "FEATURES",
    "FEATURE_INDEX",
    "OTHER_FAMILY_SD_FLOOR",
    "PRIOR_MULTIPLIER",
    "PRIOR_SD",
    "PRIOR_WEIGHTS",
    "model_family",
]


FEATURES: tuple[str, ...] = (
    "words",  # runs of ASCII letters
    "letters",  # ASCII letters
    "digits",
    "punct",  # ASCII characters that are not letters, digits or whitespace
    "ws_runs",  # runs of spaces/tabs/CR
    "newlines",
    "non_ascii",  # characters > U+007F
    "tool_blocks",  # one per tool_use and per tool_result block (ids, wrappers)
    "call",  # one per call: turn markers and what the harness adds each turn
)
FEATURE_INDEX: dict[str, int] = {name: i for i, name in enumerate(FEATURES)}
"""Position of each feature in :data:`FEATURES`."""

PRIOR_WEIGHTS: dict[str, float] = {
    # Tokens per unit of each feature: a Huber fit on the usage deltas of the 27 Claude Code
    # files of the research corpus (1,384 calls without compaction or model-family switch;
    # Claude Opus 4 / 4.6, Sonnet 4 / 4.5, Haiku 4.5). Read them as a whole, not one by one:
    # the features are collinear (a newline in a Read listing comes with a number and an arrow),
    # which is why whitespace runs carry a negative weight.
    "words": 1.6695,
    "letters": 0.0143,
    "digits": 0.7415,
    "punct": 0.5802,
    "ws_runs": -0.4726,
    "newlines": 2.5086,
    "non_ascii": 1.1715,
    "tool_blocks": 41.7952,
    "call": 16.4842,
}

CLASSES: tuple[str, ...] = (
    "prose",
    "code",  # code, logs, listings, paths: anything punctuation-dense that is not JSON
    "json",  # JSON-looking text and tool_use inputs
    "thinking",
    "error",  # tool_result with is_error (hook feedback may be shown to the model twice)
    "terminal",  # ANSI-escape-heavy terminal output
    "cjk",
    "base64",
    "structure",  # per-block and per-call overheads
    "media",  # images and documents
)
CLASS_INDEX: dict[str, int] = {name: i for i, name in enumerate(CLASSES)}
"""Position of each class in :data:`CLASSES` (and in a :class:`ContentVector`)."""

FAMILIES: tuple[str, ...] = ("opus", "sonnet", "haiku", "other")

PRIOR_MULTIPLIER: dict[str, float] = {c: 1.0 for c in CLASSES} | {"base64": 1.5}
"""Start value of each class multiplier. base64 had no corpus evidence: start pessimistic."""

PRIOR_SD: dict[str, float] = {
    "prose": 0.02,
    "code": 0.02,
    "json": 0.02,
    "structure": 0.02,
    "thinking": 0.3,
    "error": 1.0,
    "terminal": 0.3,
    "cjk": 0.3,
    "base64": 0.3,
    "media": 0.3,
}
"""Prior standard deviation of each multiplier. Small for the well-measured classes (sessions
sit within ~2 % of the corpus fit, so fast learning there only adds noise); large where the
cost depends on the harness (errors: hook output may be sent twice) or was never measured."""

OTHER_FAMILY_SD_FLOOR = 0.15
"""An unknown model family may have another tokenizer: every multiplier learns fast."""


def model_family(model: str | None) -> str:
    """``opus`` / ``sonnet`` / ``haiku`` by substring of the model name, else ``other``."""
    name = (model or "").lower()
    for family in ("opus", "sonnet", "haiku"):
        if family in name:
            return family
    return "other"
