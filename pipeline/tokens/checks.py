"""Checks for a saved tracker state read back from disk.

A calibration file is only an optimisation, but its numbers feed every estimate: a NaN, an
infinity or a negative multiplier read back from a damaged (or planted) file would turn into a
crash mid-turn or a negative context size, so that the size-triggered stages never fire. Every
field is checked here and anything unexpected is a ``ValueError`` (the loader then starts cold).
Messages name the field and a bounded picture of the value (:func:`bounded_repr`, which the
transcript loader quotes values with too), never the whole value.
"""

from __future__ import annotations

import itertools
import math
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.messages import MAX_TOKENS
from pipeline.tokens.priors import CLASSES, FAMILIES, FEATURES

__all__ = [
    "MAX_MULTIPLIER",
    "bounded_repr",
    "bounded_text",
    "check_int",
    "check_keys",
    "check_mapping",
    "check_number",
    "check_numbers",
    "check_psd",
    "checked_config",
    "checked_family",
    "or_empty",
]

_SHOWN = 80
MAX_MULTIPLIER = 1_000.0
"""The largest multiplier a saved state may hold: a class priced at 1,000 times its base
tokens is a damaged file, not something a session learned."""


class _ShortRepr(reprlib.Repr):
    """``reprlib`` limits, without its two costs on hostile values: it sorts a whole dict
    before showing a few keys, and prints an int of any size in full first."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict = 3, 6, 6, 4
        self.maxstring, self.maxother = limit, limit

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 64:
            return f"<an integer of {x.bit_length()} bits>"
        return repr(x)

    def repr_dict(self, x: dict[Any, Any], level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        shown = [
            f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
            for k, v in itertools.islice(x.items(), self.maxdict)
        ]
        if len(x) > self.maxdict:
            shown.append("...")
        return "{" + ", ".join(shown) + "}"


def bounded_repr(value: object, limit: int = _SHOWN) -> str:
    """``repr(value)`` for an error message: at most ``limit`` characters and ``…``, and cheap
    whatever the value (a list of millions of items, a string of megabytes, a huge int)."""
    text = _ShortRepr(limit).repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def bounded_text(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters (an error message that may quote a value)."""
    return text if len(text) <= limit else text[:limit] + "…"


def check_mapping(value: Any, name: str) -> Mapping[str, Any]:
    """``value`` when it is a mapping with string keys."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be an object, got {type(value).__name__}")
    if not all(isinstance(k, str) for k in value):
        raise ValueError(f"{name} has a key that is not a string")
    return value


def check_keys(value: Mapping[str, Any], name: str, allowed: Sequence[str]) -> None:
    """Every key of ``value`` is one of ``allowed``."""
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise ValueError(f"{name} has an unknown key {bounded_repr(unknown[0])}")


def check_number(
    value: Any,
    name: str,
    *,
    low: float,
    high: float,
    low_open: bool = False,
) -> float:
    """A finite real number in ``[low, high]`` (``(low, high]`` with ``low_open``), as a float.

    JSON ints count; booleans do not (``True`` is an int to Python, never a number here).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if isinstance(value, int) and abs(value) > 2**63:
        raise ValueError(f"{name} is out of range: {bounded_repr(value)}")
    number = float(value)
    too_low = number <= low if low_open else number < low
    if not math.isfinite(number) or too_low or number > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {bounded_repr(value)}")
    return number


def check_int(value: Any, name: str, *, low: int, high: int) -> int:
    """An integer in ``[low, high]``; a float only when it is integral (JSON does not tell
    ``3`` from ``3.0`` apart in every writer)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ValueError(f"{name} must be an integer, got {bounded_repr(value)}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {bounded_repr(value)}")
    return int(value)


def check_numbers(value: Any, name: str, length: int, *, low: float, high: float) -> list[float]:
    """A list of exactly ``length`` numbers, each in ``[low, high]``."""
    if not isinstance(value, list) or len(value) != length:
        raise ValueError(f"{name} must be a list of {length} numbers")
    return [check_number(v, f"{name}[{i}]", low=low, high=high) for i, v in enumerate(value)]


def check_psd(matrix: Sequence[Sequence[float]], name: str) -> None:
    """``matrix`` is symmetric and positive semi-definite (within rounding).

    A covariance that is not would make the learning step take the square root of a negative
    variance, or divide by a zero one, on the first call after the resume.
    """
    d = len(matrix)
    scale = max([1.0, *(abs(matrix[i][i]) for i in range(d))])
    tol = 1e-9 * scale
    for i in range(d):
        for j in range(i):
            if abs(matrix[i][j] - matrix[j][i]) > tol:
                raise ValueError(f"{name} is not symmetric")
    # Cholesky of matrix + tol*I: fails when some direction has a clearly negative variance
    low = [[0.0] * d for _ in range(d)]
    for i in range(d):
        for j in range(i + 1):
            s = matrix[i][j] + (tol if i == j else 0.0)
            s -= sum(low[i][k] * low[j][k] for k in range(j))
            if i == j:
                if s <= 0.0:
                    raise ValueError(f"{name} is not a covariance (not positive semi-definite)")
                low[i][i] = math.sqrt(s)
            else:
                low[i][j] = s / low[j][j]


_CONFIG_KEYS = (
    "weights",
    "prior_sd",
    "prior_multiplier",
    "margin_floor",
    "margin_cold",
    "rel_noise",
    "abs_noise",
    "clip_sigma",
    "learn",
    "compaction_extra",
    "cache_size",
)
_MAX_WEIGHT = 10_000.0
"""Tokens per unit of a feature: the fitted ones are under 42."""
_NON_NEGATIVE_WEIGHTS = ("tool_blocks", "call")
"""Weights added as they are (not floored like a text's): a negative one could make an estimate
negative."""


def checked_config(raw: Any) -> dict[str, Any]:
    """The constructor arguments a saved ``config`` holds, each checked: finite, in a range
    that keeps every estimate finite and >= 0 and every learning step defined."""
    config = check_mapping(raw, "config")
    check_keys(config, "config", _CONFIG_KEYS)
    out: dict[str, Any] = {}
    if "weights" in config:
        weights = check_mapping(config["weights"], "weights")
        check_keys(weights, "weights", FEATURES)
        out["weights"] = {
            f: check_number(
                weights.get(f),
                f"weight {f!r}",
                low=0.0 if f in _NON_NEGATIVE_WEIGHTS else -_MAX_WEIGHT,
                high=_MAX_WEIGHT,
            )
            for f in FEATURES
        }
    if "prior_sd" in config:
        sd = check_mapping(config["prior_sd"], "prior_sd")
        check_keys(sd, "prior_sd", CLASSES)
        out["prior_sd"] = {
            c: check_number(v, f"prior_sd {c!r}", low=0.0, high=100.0) for c, v in sd.items()
        }
    if "prior_multiplier" in config:
        pm = check_mapping(config["prior_multiplier"], "prior_multiplier")
        check_keys(pm, "prior_multiplier", CLASSES)
        out["prior_multiplier"] = {
            c: check_number(
                v, f"prior_multiplier {c!r}", low=0.0, high=MAX_MULTIPLIER, low_open=True
            )
            for c, v in pm.items()
        }
    ranges = {
        "margin_floor": (0.0, 10.0),
        "margin_cold": (0.0, 10.0),
        "rel_noise": (0.0, 100.0),
        # > 0: the variance of a learning step must never be 0 (a division by it follows)
        "abs_noise": (1e-3, 1e9),
        "clip_sigma": (1e-3, 1e3),
    }
    for key, (low, high) in ranges.items():
        if key in config:
            out[key] = check_number(config[key], key, low=low, high=high)
    if "learn" in config:
        if not isinstance(config["learn"], bool):
            raise ValueError("learn must be true or false")
        out["learn"] = config["learn"]
    if "compaction_extra" in config:
        out["compaction_extra"] = check_int(
            config["compaction_extra"], "compaction_extra", low=0, high=MAX_TOKENS
        )
    if "cache_size" in config:
        out["cache_size"] = check_int(config["cache_size"], "cache_size", low=1, high=10**7)
    return out


def or_empty(value: Any) -> Any:
    """``{}`` for a field left out (or null); anything else as it is, for the checks to judge
    (``[]`` or ``0`` is not an empty object)."""
    return {} if value is None else value


def checked_family(value: Any) -> str:
    """A model family name :func:`~pipeline.tokens.priors.model_family` can return."""
    if not isinstance(value, str) or value not in FAMILIES:
        raise ValueError(f"unknown model family {bounded_repr(value)}")
    return value
