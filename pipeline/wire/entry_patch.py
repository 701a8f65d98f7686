"""Whether a stage's rewrite of a record can be patched into the wire entry built from it
(:class:`~pipeline.wire.cache.WireCache`): the record is placed on the wire where the old one
was (:func:`same_place`), the blocks it replaces are known (:func:`replaced_blocks`), and each
went into the entry as itself (:func:`swap_in`). Where any of it fails, the entry is built
again from its records."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from pipeline.messages import Block, Message
from pipeline.wire.encoding import encodable

__all__ = ["replaced_blocks", "same_place", "swap_in"]


def replaced_blocks(old: Message, new: Message) -> list[tuple[Any, Any]] | None:
    """(old block, new block) for each block of ``old`` that ``new`` replaces; None when the
    entry must be built again from its records: string content, or a new block the wire
    would not send as it is (one holding a lone surrogate)."""
    if not isinstance(old.content, list) or not isinstance(new.content, list):
        return None
    pairs = []
    for ob, nb in zip(old.content, new.content, strict=True):
        if ob is not nb:
            if encodable(nb) is not nb:
                return None
            pairs.append((ob, nb))
    return pairs


def swap_in(
    blocks: list[Block], records: Sequence[Message], pairs: list[tuple[Any, Any]]
) -> list[Block] | None:
    """An entry's ``blocks`` with each old block of ``pairs`` replaced by its new one, when
    every old block went into the entry as itself and only there: held once by the
    ``records`` the entry was built from (as they were then), and found among the blocks as
    itself -- not copied at a text seam, folded with a reminder, cleaned of a lone surrogate
    or moved before the prompt, all of which the wire decides by block types alone, so the
    new block goes where the old one went. None otherwise: the entry is built again."""
    held = [id(b) for m in records if isinstance(m.content, list) for b in m.content]
    # most entries hold no block object twice: then every old block is held once
    twice = Counter(held) if len(set(held)) != len(held) else None
    at = {id(b): k for k, b in enumerate(blocks)}
    out = list(blocks)
    for ob, nb in pairs:
        k = at.get(id(ob))
        if k is None or (twice is not None and twice[id(ob)] != 1):
            return None
        out[k] = nb
    return out


def same_place(old: Message, new: Message) -> bool:
    """Whether the wire places ``new`` where it placed ``old``, neither restarting the thread:
    what it decides a record's place by is the same -- its kind, subtype, response id, and its
    blocks' types and tool ids (or, for string content, whether there is any)."""
    if (
        old.type != new.type
        or old.subtype != new.subtype
        or old.message_id != new.message_id
        or new.restarts_thread
        or old.restarts_thread
    ):
        return False
    before, after = old.content, new.content
    if isinstance(before, str) or isinstance(after, str):
        return isinstance(before, str) and isinstance(after, str) and bool(before) == bool(after)
    if len(before) != len(after):
        return False
    for ob, nb in zip(before, after, strict=True):
        if ob is not nb:
            shape = _block_place(nb)
            if shape is None or shape != _block_place(ob):
                return False
        elif not isinstance(nb, dict):
            return False  # an item that is no block: the full path raises for it
    return True


def _block_place(block: Any) -> tuple[Any, str] | None:
    """A block's type and tool id (None: an item that is not a block)."""
    if not isinstance(block, dict):
        return None
    kind = block.get("type")
    tid = block.get("id") if kind == "tool_use" else block.get("tool_use_id")
    return kind, str(tid)  # as the pairing keys an id (1 == True, not "1")
