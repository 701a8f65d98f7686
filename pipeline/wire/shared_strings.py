"""One string object for every equal short value or key a parsed message holds.

A JSON decoder makes a new string for every key and value it reads: a long conversation holds
thousands of copies of ``"tool_use"``, ``"tool_use_id"``, ``"role"``, and each tool id twice --
a third of a parsed message's overhead. The transcript reader and the wire's body reader share
them through these functions. Keys, types, roles and tool names are interned (a few values,
held by the interpreter's table); a tool id is shared through the ``ids`` a caller passes for
the messages it parses together (a call and its result come in one request): interned, every
id would hold an entry of that table (~40-80 bytes, and the table grows in steps of its whole
size) to spare a copy of ~80. Long values (content) are left alone: sharing them would cost a
hash of the content and keep nothing. Interned strings are freed once nothing holds them.
"""

from __future__ import annotations

import re
import sys
from typing import Any

__all__ = ["MAX_SHAPES", "SHARED_MAX", "keyed_alike", "shared", "shared_keys", "shared_message"]

SHARED_MAX = 64
"""Longest value :func:`shared` interns: ids, names and types, never content."""

_BLOCK_VALUES = frozenset({"type", "name"})
_IDS = frozenset({"id", "tool_use_id"})


def shared(value: str) -> str:
    """``value``, one object for every equal value when it is short (see the module)."""
    return sys.intern(value) if len(value) <= SHARED_MAX else value


def shared_keys(block: dict[str, Any]) -> dict[str, Any]:
    """``block`` with its keys interned, in their order, its key table shared with every
    other dict of the same keys in the same order (see :func:`keyed_alike`)."""
    if not all(type(k) is str for k in block):
        return {shared(k) if type(k) is str else k: v for k, v in block.items()}
    return keyed_alike(tuple(block), tuple(block.values()))


_SHAPE_KEY = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")
"""The keys a shared key table is made for: lower-case names (never an attribute of every
object's, such as ``__class__``)."""
MAX_SHAPES = 512
"""Key orders given a shared table at once, at most: past them, the table of orders starts
afresh (the dicts made keep their tables; an order in use again is given a new one), so that
a client sending many orders neither holds memory nor leaves later conversations without."""
_SHAPE_KEYS = 8
"""The most keys a shared table is made for."""
_shapes: dict[tuple[str, ...], type] = {}


def _shape(keys: tuple[str, ...]) -> type | None:
    """The class whose instances' attribute dicts share ``keys``' table (None: none is made,
    and nothing of ``keys`` is kept)."""
    if len(keys) > _SHAPE_KEYS or not all(_SHAPE_KEY.match(k) for k in keys):
        return None
    if len(_shapes) >= MAX_SHAPES:
        _shapes.clear()
    shape = _shapes[keys] = type("Shape", (), {"__module__": __name__})
    return shape


def keyed_alike(keys: tuple[str, ...], values: tuple[Any, ...] | list[Any]) -> dict[str, Any]:
    """``dict(zip(keys, values))``, a plain dict to every reader, whose key table is shared by
    every dict made here with the same keys in the same order: an object's attribute dict
    (the interpreter's split table), ~110 bytes for a block of three keys against ~190 for a
    dict of its own. A parsed message holds two or three small dicts and a held conversation
    keeps every message parsed. A dict given a key it has not, or its keys in another order,
    takes a table of its own as any dict would. Keys other than lower-case names of up to 32
    characters, and dicts of more than eight keys, get a dict of their own."""
    if len(keys) != len(values):  # (what zip's own check costs on every dict made)
        raise ValueError(f"{len(keys)} keys for {len(values)} values")
    shape = _shapes.get(keys) or _shape(keys)
    if shape is None:
        return {shared(k): v for k, v in zip(keys, values)}  # noqa: B905 - checked above
    attrs: dict[str, Any] = vars(shape())
    attrs.update(zip(keys, values))  # noqa: B905 - checked above
    return attrs


def _shared_block(block: Any, ids: dict[str, str]) -> Any:
    if type(block) is not dict:
        return block
    keys: list[str] = []
    values: list[Any] = []
    for key, value in block.items():
        if type(key) is not str:  # not from JSON: left as it is
            return block
        if type(value) is str:
            if key in _BLOCK_VALUES:
                value = shared(value)
            elif key in _IDS and len(value) <= SHARED_MAX:
                value = ids.setdefault(value, value)
        elif key == "input" and type(value) is dict:
            value = shared_keys(value) if value else {}
        elif key == "content" and type(value) is list:
            value = _shared_blocks(value, ids)
        keys.append(key)
        values.append(value)
    return keyed_alike(tuple(keys), values)


def _shared_blocks(blocks: list[Any], ids: dict[str, str]) -> list[Any]:
    # a copy sized to the list (a comprehension's leaves room for ~3 more items: 24 bytes a
    # one-block list, and a held conversation keeps every message's)
    out = blocks.copy()
    for i, block in enumerate(blocks):
        out[i] = _shared_block(block, ids)
    return out


def shared_message(message: Any, ids: dict[str, str] | None = None) -> Any:
    """A message parsed from a request (``{"role": ..., "content": ...}``) with its keys, its
    role and its blocks' types and tool names shared, its tool ids shared with the equal ones
    in ``ids`` (the ids of the messages parsed with it, which it adds to), and the same value
    otherwise (the same keys in the same order, content strings the same objects); anything
    else as it is."""
    if type(message) is not dict:
        return message
    if ids is None:
        ids = {}
    keys: list[str] = []
    values: list[Any] = []
    for key, value in message.items():
        if type(key) is not str:
            return message
        if key == "content" and type(value) is list:
            value = _shared_blocks(value, ids)
        elif key == "role" and type(value) is str:
            value = shared(value)
        keys.append(key)
        values.append(value)
    return keyed_alike(tuple(keys), values)
