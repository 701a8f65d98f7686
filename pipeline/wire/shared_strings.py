"""One string object for every equal short value or key a parsed message holds.

A JSON decoder makes a new string for every key and value it reads: a long conversation holds
thousands of copies of ``"tool_use"``, ``"tool_use_id"``, ``"role"``, and each tool id twice --
a third of a parsed message's overhead. The transcript reader and the wire's body reader share
them through these functions. Long values (content) are left alone: interning them would cost
a hash of the content and keep nothing. Interned strings are freed once nothing holds them.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["SHARED_MAX", "shared", "shared_keys", "shared_message"]

SHARED_MAX = 64
"""Longest value :func:`shared` interns: ids, names and types, never content."""

_BLOCK_VALUES = frozenset({"type", "id", "name", "tool_use_id"})


def shared(value: str) -> str:
    """``value``, one object for every equal value when it is short (see the module)."""
    return sys.intern(value) if len(value) <= SHARED_MAX else value


def shared_keys(block: dict[str, Any]) -> dict[str, Any]:
    """``block`` with its keys interned, in their order."""
    return {sys.intern(k): v for k, v in block.items()}


def _shared_block(block: Any) -> Any:
    if type(block) is not dict:
        return block
    out: dict[str, Any] = {}
    for key, value in block.items():
        if type(key) is not str:  # not from JSON: left as it is
            return block
        if key in _BLOCK_VALUES and type(value) is str:
            value = shared(value)
        elif key == "input" and type(value) is dict:
            value = {shared(k) if type(k) is str else k: v for k, v in value.items()}
        elif key == "content" and type(value) is list:
            value = [_shared_block(b) for b in value]
        out[sys.intern(key)] = value
    return out


def shared_message(message: Any) -> Any:
    """A message parsed from a request (``{"role": ..., "content": ...}``) with its keys, its
    role and its blocks' types, ids and tool names shared, and the same value otherwise (the
    same keys in the same order, content strings the same objects); anything else as it is."""
    if type(message) is not dict:
        return message
    out: dict[str, Any] = {}
    for key, value in message.items():
        if type(key) is not str:
            return message
        if key == "content" and type(value) is list:
            value = [_shared_block(b) for b in value]
        elif key == "role" and type(value) is str:
            value = shared(value)
        out[sys.intern(key)] = value
    return out
