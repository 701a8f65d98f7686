"""Checks for the keyword arguments stages take, one style for all: a bad value is a
``ValueError`` naming the argument (constructors take simple values, so a registry can build
them from strings like ``microcompact=clear-oldest:keep=5``)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.summarizer import Summarizer

__all__ = [
    "check_below",
    "check_bool",
    "check_fraction",
    "check_int",
    "check_minutes",
    "check_names",
    "check_positive",
    "check_summarizer",
]


def check_int(name: str, value: object, *, minimum: int = 0) -> int:
    """An int (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``True`` or ``False`` exactly."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_fraction(name: str, value: object) -> float:
    """A number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def check_below(target_name: str, target: object, trigger_name: str, trigger: object) -> None:
    """``ValueError`` unless ``target`` is below ``trigger`` (fractions already checked): a stage
    that acts at the trigger must bring the context under it."""
    if not (isinstance(target, float) and isinstance(trigger, float) and target < trigger):
        raise ValueError(f"{target_name} ({target!r}) must be below {trigger_name} ({trigger!r})")


def check_positive(name: str, value: object) -> float:
    """A number > 0 (``math.inf`` allowed: no limit); an int stays an int."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return value


def check_seconds(name: str, value: object) -> float:
    """A number of seconds > 0, as a float (``math.inf``, or an int past any float: no
    limit)."""
    checked = check_positive(name, value)
    try:
        return float(checked)
    except OverflowError:
        return math.inf


def check_minutes(name: str, value: object) -> float:
    """A finite number of minutes ``>= 0``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a finite number of minutes >= 0, got {value!r}")
    return float(value)


def check_names(name: str, value: object, *, allow_empty: bool) -> tuple[str, ...]:
    """Tool names, deduplicated in order (a stable repr and stable request bytes).

    A lone string is one name (a config string ``exclude_tools=Read`` arrives as one), never
    iterated character by character.
    """
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a tuple of tool names, got {value!r}")
    names = tuple(value)
    for n in names:
        if not isinstance(n, str) or not n:
            raise ValueError(f"{name} must hold non-empty strings, got {n!r}")
    if not names and not allow_empty:
        raise ValueError(f"{name} must name at least one tool")
    return tuple(dict.fromkeys(names))


def check_summarizer(value: object) -> Summarizer | None:
    """``None``, or an object with an async ``summarize(messages)`` method."""
    if value is not None and not callable(getattr(value, "summarize", None)):
        raise ValueError(f"summarizer needs an async summarize(messages) method, got {value!r}")
    return value  # type: ignore[return-value]  # checked for the one method it needs
