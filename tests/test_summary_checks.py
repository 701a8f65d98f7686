"""A summary as the summarising stages take it (``pipeline.summarizer.ask_summary``): text,
in time; and the ``summary_timeout`` they accept."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from pipeline.summarizer import (
    SummaryError,
    SummaryTimeout,
    ask_summary,
)
from stages._shared.args import check_seconds
from tests.builders import HostileSummarizer


class _Shown(str):
    """A str subclass that shows itself as something else."""

    def __str__(self) -> str:
        return "OTHER"


class _Answers:
    def __init__(self, reply: Any) -> None:
        self.reply = reply

    async def summarize(self, messages: Sequence[Any]) -> Any:
        return self.reply


def test_a_str_subclass_is_taken_as_its_text() -> None:
    text = anyio.run(ask_summary, _Answers(_Shown("the summary")), [], 5.0)
    assert text == "the summary" and type(text) is str


@pytest.mark.parametrize("reply", [b"bytes", None, ["a"], 7])
def test_what_is_not_text_is_a_summary_error(reply: Any) -> None:
    with pytest.raises(SummaryError, match="not str"):
        anyio.run(ask_summary, _Answers(reply), [], 5.0)


def test_no_answer_in_time_is_a_summary_timeout() -> None:
    with pytest.raises(SummaryTimeout, match=r"within 0\.05 s"):
        anyio.run(ask_summary, HostileSummarizer(hang=True), [], 0.05)


@pytest.mark.parametrize(
    ("given", "taken"), [(1, 1.0), (0.5, 0.5), (math.inf, math.inf), (10**400, math.inf)]
)
def test_a_summary_timeout_is_seconds_above_zero(given: Any, taken: float) -> None:
    assert check_seconds("summary_timeout", given) == taken


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "5", True, None])
def test_a_bad_summary_timeout_is_refused_by_name(bad: Any) -> None:
    with pytest.raises(ValueError, match="summary_timeout"):
        check_seconds("summary_timeout", bad)
