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

import sys
from typing import Any

__all__ = ["SHARED_MAX", "shared", "shared_keys", "shared_message"]

SHARED_MAX = 64
"""Longest value :func:`shared` interns: ids, names and types, never content."""

_BLOCK_VALUES = frozenset({"type", "name"})
_IDS = frozenset({"id", "tool_use_id"})


def shared(value: str) -> str:
    """``value``, one object for every equal value when it is short (see the module)."""
    return sys.intern(value) if len(value) <= SHARED_MAX else value


def shared_keys(block: dict[str, Any]) -> dict[str, Any]:
    """``block`` with its keys interned, in their order."""
    return {sys.intern(k): v for k, v in block.items()}


def _shared_block(block: Any, ids: dict[str, str]) -> Any:
    if type(block) is not dict:
        return block
    out: dict[str, Any] = {}
    for key, value in block.items():
        if type(key) is not str:  # not from JSON: left as it is
            return block
        if type(value) is str:
            if key in _BLOCK_VALUES:
                value = shared(value)
            elif key in _IDS and len(value) <= SHARED_MAX:
                value = ids.setdefault(value, value)
        elif key == "input" and type(value) is dict:
            value = {shared(k) if type(k) is str else k: v for k, v in value.items()}
        elif key == "content" and type(value) is list:
            value = [_shared_block(b, ids) for b in value]
        out[sys.intern(key)] = value
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
    out: dict[str, Any] = {}
    for key, value in message.items():
        if type(key) is not str:
            return message
        if key == "content" and type(value) is list:
            value = [_shared_block(b, ids) for b in value]
        elif key == "role" and type(value) is str:
            value = shared(value)
        out[sys.intern(key)] = value
    return out
