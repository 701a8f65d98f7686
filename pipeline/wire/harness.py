"""Text a harness attached to a tool result: split off before a stage looks, put back after.

Claude Code appends ``<system-reminder>`` text to the content of the last tool_result of a user
message (a finished background agent's report, the list of agents, the tokens left): a string
content gets ``"\\n\\n<system-reminder>...</system-reminder>"`` per reminder, a block list one
text block per reminder. That text is the harness's, not the tool's. So that no stage hides it
from the model, every stage reads a result as its *core* (the tool's output) and its *tail*
(the harness's text): the budget measures, digests and persists the core only; whatever a stage
sends instead of a result (a replacement, a placeholder, a cleared marker) gets the tail back,
verbatim (:func:`with_tail`).

Only the last tool_result of a record can carry a tail (where the harness puts it), and a tail
is at most :data:`MAX_TAIL_CHARS`: tool output is attacker-controlled, and output shaped like a
reminder must not escape the budget unbounded. Reminders are peeled off the end where their
tags balance; one whose text quotes the tag (its tags do not balance) is still the harness's:
the tail then starts at the window's first ``\n\n<system-reminder>``. The split costs one scan
of the tail's window.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.wire.deferred import resolved

__all__ = [
    "MAX_TAIL_CHARS",
    "REMINDER_CLOSE",
    "REMINDER_OPEN",
    "last_result_index",
    "split_tail",
    "with_tail",
]

REMINDER_OPEN = "<system-reminder>"
REMINDER_CLOSE = "</system-reminder>"
_SEPARATOR = "\n\n"
_LEAD = _SEPARATOR + REMINDER_OPEN

MAX_TAIL_CHARS = 65_536
"""The most harness text one result may carry; a longer tail counts as the tool's output."""


def last_result_index(content: Any) -> int:
    """Index of the last tool_result block in a user record's content, -1 when none (only
    that block can carry a harness tail)."""
    if not isinstance(content, list):
        return -1
    for j in range(len(content) - 1, -1, -1):
        b = content[j]
        if (type(b) is dict or isinstance(b, Mapping)) and b.get("type") == "tool_result":
            return j
    return -1


def split_tail(content: Any) -> tuple[Any, Any]:
    """``(core, tail)`` of a tool_result's content: the tool's output and the harness text
    appended to it (a string, a list of text blocks, or None when there is none). ``core`` is
    ``content`` itself when there is no tail."""
    content = resolved(content)  # an output left in its file: its text
    if isinstance(content, str):
        at = _string_tail_start(content)
        return (content, None) if at < 0 else (content[:at], content[at:])
    if isinstance(content, list):
        at = _block_tail_start(content)
        return (content, None) if at < 0 else (content[:at], content[at:])
    return content, None


def with_tail(new: Any, tail: Any) -> Any:
    """``new`` content (what a stage sends instead of the core) with the harness ``tail`` put
    back as it came."""
    if tail is None:
        return new
    if isinstance(tail, str):
        if isinstance(new, str):
            return new + tail
        return [*new, {"type": "text", "text": tail}]
    head = [{"type": "text", "text": new}] if isinstance(new, str) else list(new)
    return [*head, *tail]


_TAG = re.compile(re.escape(REMINDER_OPEN) + "|" + re.escape(REMINDER_CLOSE))


def _string_tail_start(text: str) -> int:
    """Where the harness tail of a string content starts, -1 when it has none: whole
    reminders are peeled off the end while each closes the text before it (its tags balanced;
    whitespace after it allowed) and follows a ``\n\n``, within the last
    :data:`MAX_TAIL_CHARS`. Where what is left still ends in a closing tag (a reminder whose
    text quotes the tag, so that its tags do not balance), the tail starts at the first
    ``\n\n<system-reminder>`` of the window instead: harness text is never taken for the
    tool's (output shaped like it is kept whole, within the window)."""
    floor = max(0, len(text) - MAX_TAIL_CHARS)
    found = _balanced_tail_start(text, floor)
    left = _before_space(text, found if found >= 0 else len(text), floor)
    if text.endswith(REMINDER_CLOSE, floor, left):
        first = text.find(_LEAD, floor, left)
        if first >= 0:
            return first
    return found


def _balanced_tail_start(text: str, floor: int) -> int:
    """Where the reminders whose tags balance at the end of ``text[floor:]`` start (-1)."""
    end = _before_space(text, len(text), floor)
    if not text.endswith(REMINDER_CLOSE, floor, end):
        return -1
    tags = [(m.start(), m.group() == REMINDER_OPEN) for m in _TAG.finditer(text, floor, end)]
    found, depth = -1, 0
    for pos, opening in reversed(tags):
        if depth == 0 and (opening or pos + len(REMINDER_CLOSE) != end):
            break  # text between two reminders, or an opening tag that closes nothing
        depth += -1 if opening else 1
        if depth == 0:
            lead = pos - len(_SEPARATOR)
            if lead < floor or not text.startswith(_SEPARATOR, lead):
                break
            found = lead
            end = _before_space(text, lead, floor)
    return found


def _before_space(text: str, end: int, floor: int) -> int:
    """Where the whitespace that ends ``text[:end]`` begins (no copy of the text)."""
    while end > floor and text[end - 1].isspace():
        end -= 1
    return end


def _is_reminder_block(block: Any) -> bool:
    if not isinstance(block, Mapping) or set(block) != {"type", "text"}:
        return False  # a block with more fields (a cache breakpoint) is the client's own
    text = block.get("text")
    return (
        block.get("type") == "text"
        and isinstance(text, str)
        and text.startswith(REMINDER_OPEN)
        and _string_tail_start(_SEPARATOR + text.rstrip()) == 0
    )


def _block_tail_start(blocks: Sequence[Any]) -> int:
    """Where the trailing reminder blocks of a block-list content start, -1 when none."""
    at, size = len(blocks), 0
    while at > 0 and _is_reminder_block(blocks[at - 1]):
        size += len(blocks[at - 1]["text"])
        if size > MAX_TAIL_CHARS:
            break
        at -= 1
    return -1 if at == len(blocks) else at
