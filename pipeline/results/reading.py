"""Reading a record's tool_result blocks as the stages read them: what each one's output is
(the harness tail split off), whether the budget may decide on it, and its ledger key.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.messages import Block, Message, thread_start
from pipeline.results.keys import is_replacement_text, result_key
from pipeline.wire.deferred import resolved
from pipeline.wire.harness import last_result_index, split_tail

__all__ = [
    "ResultSlot",
    "answered_results",
    "candidate_size",
    "content_is_empty",
    "is_candidate",
    "is_candidate_content",
    "iter_tool_results",
    "last_response_start",
    "read_results",
]


def _content_has_image(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(b, Mapping) and b.get("type") == "image" for b in content
    )


def content_is_empty(content: Any) -> bool:
    """None, "", whitespace, ``[]``, or only blank text blocks."""
    content = resolved(content)
    if content is None:
        return True
    if isinstance(content, str):
        return not content.strip()
    if isinstance(content, list):
        return all(
            isinstance(b, Mapping)
            and b.get("type") == "text"
            and not str(b.get("text") or "").strip()
            for b in content
        )
    return False


def candidate_size(content: Any) -> int:
    """Characters a tool_result's content counts for: ``len(str)`` or the sum of its text blocks."""
    content = resolved(content)
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(b["text"])
            for b in content
            if isinstance(b, Mapping) and b.get("type") == "text" and isinstance(b.get("text"), str)
        )
    return 0


def is_candidate_content(core: Any) -> bool:
    """Output (a result's core: see :mod:`pipeline.wire.harness`) the budget may decide on: not
    blank (blank results get the placeholder, never a decision), not a replacement, no
    image."""
    if content_is_empty(core) or is_replacement_text(core):
        return False
    return not _content_has_image(core)


def is_candidate(block: Mapping[str, Any], *, last: bool = False) -> bool:
    """A tool_result the budget may decide on (``last``: it is the last tool_result of its
    record, whose harness tail is not part of the output: see :func:`read_results`)."""
    if block.get("type") != "tool_result":
        return False
    content = block.get("content")
    return is_candidate_content(split_tail(content)[0] if last else content)


@dataclass(frozen=True, slots=True)
class ResultSlot:
    """One tool_result block as the stages read it."""

    block: Mapping[str, Any]
    tool_use_id: str | None
    """None when the block has no string id (nothing can address it)."""
    core: Any
    """The tool's output: the content less the harness tail (:mod:`pipeline.wire.harness`)."""
    empty: bool
    key: str | None
    """The ledger key (:func:`~pipeline.results.keys.result_key`) of a candidate, None for
    anything else."""


def read_results(m: Message) -> Iterator[ResultSlot]:
    """Every tool_result block of a user record that is a mapping, in order, read as the stages
    read it: the harness tail split off the last one, a candidate keyed by id and digest."""
    if m.type != "user" or not isinstance(m.content, list):
        return
    last = last_result_index(m.content)
    for j, b in enumerate(m.content):
        if not (type(b) is dict or isinstance(b, Mapping)) or b.get("type") != "tool_result":
            continue
        tid = b.get("tool_use_id")
        content = b.get("content")
        core = split_tail(content)[0] if j == last else resolved(content)
        if not isinstance(tid, str):
            yield ResultSlot(b, None, core, content_is_empty(core), None)
        elif content_is_empty(core):
            yield ResultSlot(b, tid, core, True, None)
        elif is_candidate_content(core):
            yield ResultSlot(b, tid, core, False, result_key(tid, core, kept=core is content))
        else:
            yield ResultSlot(b, tid, core, False, None)


def iter_tool_results(messages: Iterable[Message]) -> Iterable[tuple[Message, Block]]:
    """Every tool_result block held by a user message, in order."""
    for m in messages:
        if m.type == "user" and isinstance(m.content, list):
            for b in m.content:
                if b.get("type") == "tool_result":
                    yield m, b


def last_response_start(messages: Sequence[Message]) -> int:
    """Index of the first record of the last real response (-1 if none). A response may be
    recorded in fragments with its tool results between them; none of those results was sent
    before the response was complete."""
    start = -1
    last_id: str | None = None
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.type != "assistant" or m.is_synthetic:
            continue
        if start == -1:
            start, last_id = i, m.message_id
        elif last_id is not None and m.message_id == last_id:
            start = i
        else:
            break
    return start


def answered_results(
    messages: Sequence[Message], first: int = 0, *, rebuilt: bool = False
) -> set[str]:
    """The ledger keys of the results in ``messages[first:]`` that stand before the last real
    response: the model answered after them, so they were sent (by position, as
    :meth:`ReplacementState.reconstruct` counts them). Reads from ``first`` on only.
    ``rebuilt``: the caller's ledger was just reconstructed from ``messages``, so it holds every
    such key from the thread's start on: only those before it are read."""
    last = last_response_start(messages)
    if rebuilt:
        last = min(last, thread_start(messages))
    keys: set[str] = set()
    for i in range(first, last):
        keys.update(slot.key for slot in read_results(messages[i]) if slot.key is not None)
    return keys
