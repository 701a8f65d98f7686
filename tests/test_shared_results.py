"""``patch_results``: a clear's records rewritten in place, all or none, as one change."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from pipeline import Message
from pipeline.kept_list import KeptList
from stages._shared import patch_results
from tests.builders import results, tool_result, user_text


def _history(kept: bool) -> list[Message]:
    records = [results(tool_result(f"u{k}", f"out {k}")) for k in range(4)]
    records.insert(2, user_text("a prompt: no result to patch"))
    return KeptList(records) if kept else records


def _cleared(block: Mapping[str, Any]) -> str:
    return f"[cleared {block['tool_use_id']}]"


@pytest.mark.parametrize("kept", [True, False])
def test_a_position_named_twice_or_from_the_end_is_patched_once(kept: bool) -> None:
    history = _history(kept)
    before = list(history)
    stamp = history.stamp if isinstance(history, KeptList) else 0
    first = patch_results(history, _cleared, [4, 1, -1, 2, 1])
    assert first == 1
    assert [m is b for m, b in zip(history, before, strict=True)] == [
        True, False, True, True, False,
    ]  # fmt: skip
    assert history[1].content[0]["content"] == "[cleared u1]"  # type: ignore[index]
    assert history[4].content[0]["content"] == "[cleared u3]"  # type: ignore[index]
    assert history[1].uuid == before[1].uuid
    if isinstance(history, KeptList):
        assert history.stamp == stamp + 1 and history.changed_since(stamp) == 1


@pytest.mark.parametrize("kept", [True, False])
def test_nothing_to_patch_changes_nothing(kept: bool) -> None:
    history = _history(kept)
    before = list(history)
    assert patch_results(history, lambda b: None, range(5)) == 5
    assert patch_results(history, _cleared, [2]) == 5  # a prompt holds no result
    assert all(m is b for m, b in zip(history, before, strict=True))


def _boom(block: Mapping[str, Any]) -> str:
    if block["tool_use_id"] == "u3":
        raise RuntimeError("cannot clear")
    return "[cleared]"


@pytest.mark.parametrize("kept", [True, False])
@pytest.mark.parametrize(("at", "error"), [([0, 9], IndexError), ([0, 4], RuntimeError)])
def test_a_bad_position_or_a_failing_rewrite_changes_nothing(
    kept: bool, at: list[int], error: type[Exception]
) -> None:
    history = _history(kept)
    before = list(history)
    with pytest.raises(error):
        patch_results(history, _boom, at)
    assert all(m is b for m, b in zip(history, before, strict=True))
