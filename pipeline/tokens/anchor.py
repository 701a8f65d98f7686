"""The usage anchor: the last real response, whose usage the context size starts from."""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.messages import Message, Usage, context_start, first_fragment, holds_compaction

__all__ = ["compaction_restart", "find_anchor"]


def find_anchor(messages: Sequence[Message]) -> tuple[int, Usage] | None:
    """The last real response's usage and the index of its FIRST fragment.

    Usage is read off the last assistant record that carries it (streaming snapshots: the
    latest is the most complete). Fragments of one response share an id and tool_results may
    sit between them; starting the estimate after the *last* fragment would miss those results,
    so walk back to the first. Records without an assistant id are walked past; a different id
    stops the walk. Synthetic assistant messages are never anchors.
    """
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.type != "assistant" or m.usage is None or m.is_synthetic:
            continue
        return first_fragment(messages, i), m.usage
    return None


def compaction_restart(messages: Sequence[Message], after: int) -> int | None:
    """Where the API's view restarts, when a compaction point (a compact boundary, or a server
    compaction block in a later response) lies after index ``after``."""
    # on the tail only: no scan of the whole session
    offset = context_start(messages[after:])
    if offset > 0:
        return after + offset
    first = messages[after] if after < len(messages) else None
    if first is not None and holds_compaction(first) and first.usage and not first.usage.input_side:
        # a response paused after compacting: its usage is the summary alone, without the
        # system prompt and tools a usage anchor already counts -- price from it, unanchored
        return after
    return None
