"""Checks for the simple keyword arguments stages take (so config strings fail clearly)."""

from __future__ import annotations

__all__ = ["check_bool", "check_fraction", "check_int"]


def check_int(name: str, value: object, *, minimum: int = 0) -> int:
    """An int (not a bool) ``>= minimum``; ``ValueError`` naming the argument otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``True`` or ``False`` exactly; ``ValueError`` naming the argument otherwise."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_fraction(name: str, value: object) -> float:
    """A number in (0, 1]; ``ValueError`` naming the argument otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)
