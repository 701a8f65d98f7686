"""Tool results in a message list: find them, and replace their content by id."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from pipeline.kept_list import KeptList
from pipeline.messages import Block, Message
from pipeline.wire.harness import last_result_index, split_tail, with_tail

__all__ = [
    "CLEARED_PLACEHOLDER",
    "ContentFor",
    "by_id",
    "patch_message",
    "replace_results",
    "result_ids",
    "tool_results",
]

CLEARED_PLACEHOLDER = "[Old tool result content cleared]"
"""What a cleared tool_result's content becomes (Claude Code's text, byte for byte)."""

ContentFor = Callable[[Mapping[str, Any]], Any]
"""A tool_result block -> the content to send instead, or ``None`` to leave it as it is."""


def tool_results(m: Message) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """(block index, block) of every tool_result block of a user record (non-blocks skipped)."""
    if m.type == "user" and isinstance(m.content, list):
        for j, b in enumerate(m.content):
            # a dict is a Mapping: tested first, past the slower abstract-class check
            if (type(b) is dict or isinstance(b, Mapping)) and b.get("type") == "tool_result":
                yield j, b


def result_ids(messages: Sequence[Message]) -> list[str]:
    """The tool_use_id of every tool_result in ``messages``, in order (string ids only)."""
    return [
        tid
        for m in messages
        for _, b in tool_results(m)
        if isinstance(tid := b.get("tool_use_id"), str)
    ]


def by_id(texts: Mapping[str, str]) -> ContentFor:
    """Replace the content of each tool_result whose id ``texts`` names by that text."""

    def content_for(block: Mapping[str, Any]) -> str | None:
        tid = block.get("tool_use_id")
        return texts.get(tid) if isinstance(tid, str) else None

    return content_for


def patch_message(m: Message, content_for: ContentFor) -> Message:
    """``m`` with the tool_results ``content_for`` names carrying their new content; ``m``
    itself when nothing changes. Every other block field (``tool_use_id``, ``is_error``,
    ``cache_control``) is kept -- a client's breakpoint inside the content replaced goes onto
    the block -- and so is text a harness appended to the last result
    (:mod:`pipeline.wire.harness`): the new content takes the place of the tool's output only.
    ``content_for`` is called once per tool_result block, in order."""
    blocks: list[Block] | None = None
    last = last_result_index(m.content)
    for j, b in tool_results(m):
        new = content_for(b)
        if new is None:
            continue
        if j == last:
            new = with_tail(new, split_tail(b.get("content"))[1])
        if b.get("content") == new:
            continue
        if blocks is None:
            blocks = list(m.content)  # type: ignore[arg-type]  # tool_results: a list
        mark = None if "cache_control" in b else _inner_mark(b.get("content"), new)
        blocks[j] = {**b, "content": new} if mark is None else {**b, "content": new, **mark}
    return m if blocks is None else m.with_content(blocks)


def _inner_mark(old: Any, new: Any) -> dict[str, Any] | None:
    """The client's cache breakpoint on a block inside a result's content that its new
    content no longer holds (the last, where several), to go on the result's block instead:
    the request keeps as many breakpoints, about where the client put them."""
    if not isinstance(old, list) or _marked(new) is not None:
        return None
    mark = _marked(old)
    return None if mark is None else {"cache_control": mark}


def _marked(content: Any) -> Any:
    if isinstance(content, list):
        for block in reversed(content):
            if isinstance(block, Mapping) and block.get("cache_control") is not None:
                return block["cache_control"]
    return None


def patch_results(messages: list[Message], content_for: ContentFor, at: Iterable[int]) -> int:
    """:func:`replace_results` in place, on a list the caller owns (a stage's kept output: its
    readers ask it what changed, rather than compare it with a copy): the first position that
    changed (``len(messages)`` if none). A position named twice (or from the end) is patched
    as the record it already patched; a bad position, or ``content_for`` raising, changes
    nothing. A :class:`KeptList` notes it as one change."""
    n = len(messages)
    changes: dict[int, Message] = {}
    for i in at:
        j = operator.index(i)
        j = j + n if j < 0 else j
        if not 0 <= j < n:
            raise IndexError("list index out of range")
        m = changes.get(j, messages[j])
        patched = patch_message(m, content_for)
        if patched is not m:
            changes[j] = patched
    if isinstance(messages, KeptList):
        messages.put(changes.items())
    else:
        for j, patched in changes.items():
            messages[j] = patched
    return min(changes, default=n)


def replace_results(
    messages: list[Message], content_for: ContentFor, at: Iterable[int] | None = None
) -> list[Message]:
    """A new list where the tool_results ``content_for`` names carry their new content.

    Messages that need no change are the same objects; if nothing changes, the input list
    itself (a stage returns its input when it changed nothing). ``at``: the only positions
    that can change, when the caller knows them (the rest are not looked at).
    """
    out: list[Message] | None = None
    for i in range(len(messages)) if at is None else at:
        m = messages[i]
        patched = patch_message(m, content_for)
        if patched is not m:
            if out is None:
                out = KeptList(messages)  # a stage keeps it: its readers ask what changed
            out[i] = patched
    return messages if out is None else out
