"""Hypothesis strategies for the JSON-like values a request carries (a message's content, a
tool call's input), odd leaves included: control characters, text that is not ASCII, integers
past 64 bits, NaN and the infinities, and nesting."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

__all__ = ["LEAVES", "json_values"]

LEAVES = st.one_of(
    st.text(alphabet='ab "\\\n\t\x00\x7f/'),
    st.text(alphabet="aé😀"),
    st.integers(),
    st.integers(min_value=2**63, max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
)
"""Leaves of the kinds the writers treat differently."""


def json_values(leaves: st.SearchStrategy[Any] = LEAVES) -> st.SearchStrategy[Any]:
    """Values of ``leaves``, lists and dicts of them (keys ASCII or not), up to 16 leaves."""
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(st.sampled_from("abé"), inner, max_size=3),
        ),
        max_leaves=16,
    )
