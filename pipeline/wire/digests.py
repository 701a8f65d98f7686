"""Digests of a conversation's messages: what tells one conversation from another.

Each message is known by a 16-byte digest of itself and every message before it: a *chain*,
whose first link also holds the system prompt and the conversation's hint. Two requests whose
chains agree up to a position sent the same messages up to there. What a client moves between
calls does not count: ``cache_control`` anywhere, and Claude Code's billing-header line in the
system prompt (it differs between a conversation and its sub-agents).
:mod:`pipeline.dropin.conversations` places requests by them; a
:class:`~pipeline.dropin.adapter.WireSession` names its records by them, so a decision made on a
record never applies to a record that follows other messages.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.wire.canonical import canonical_json

__all__ = [
    "DIGEST_BYTES",
    "OpeningMemo",
    "chain_of",
    "chain_step",
    "message_digest",
    "opening_digest",
]

DIGEST_BYTES = 16
_ROOT = b"\x00" * DIGEST_BYTES
_BILLING_HEADER = "x-anthropic-billing-header:"


def _hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def _plain_blocks(content: Any) -> Any:
    """Content with ``cache_control`` off its blocks and off the blocks a tool_result holds:
    ``content`` itself when no block of it has one (the same JSON, no copy; a mapping that is
    not a dict is still made one, as the canonical writer takes dicts alone)."""
    if not isinstance(content, list):
        return content
    out: list[Any] | None = None if type(content) is list else []
    for i, b in enumerate(content):
        plain = _plain_block(b)
        if plain is not b and out is None:
            out = content[:i]
        if out is not None:
            out.append(plain)
    return content if out is None else out


def _plain_block(b: Any) -> Any:
    if type(b) is not dict and not isinstance(b, Mapping):
        return b
    inner = b.get("content")
    plain_inner = _plain_blocks(inner) if isinstance(inner, list) else inner
    if type(b) is dict and "cache_control" not in b and plain_inner is inner:
        return b
    plain = {k: v for k, v in b.items() if k != "cache_control"}
    if plain_inner is not inner:
        plain["content"] = plain_inner
    return plain


def message_digest(param: Any) -> bytes:
    """16 bytes that tell a message from any other, breakpoints (``cache_control``) aside;
    ``ValueError`` for content nested too deeply."""
    if type(param) is dict or isinstance(param, Mapping):
        value: Any = {"role": param.get("role"), "content": _plain_blocks(param.get("content"))}
    else:
        value = param
    return _hash(canonical_json(value))


def chain_step(previous: bytes, message: bytes) -> bytes:
    """The digest of a message and everything before it (``previous``: the digest up to the
    message before it)."""
    return _hash(previous + message)


def _system_digest(system: Any) -> bytes:
    if isinstance(system, str):
        kept: Any = "\n".join(
            line for line in system.split("\n") if not line.startswith(_BILLING_HEADER)
        )
    elif isinstance(system, list):
        kept = [
            b
            for b in _plain_blocks(system)
            if not (
                isinstance(b, Mapping)
                and isinstance(b.get("text"), str)
                and b["text"].startswith(_BILLING_HEADER)
            )
        ]
    else:
        kept = system
    return _hash(canonical_json(kept))


def opening_digest(system: Any, hint: str, first: Any) -> bytes:
    """The first link of a chain: the system prompt (billing line and breakpoints aside), the
    hint and the first message (None for a request without messages)."""
    seed = _hash(_system_digest(system) + hint.encode("utf-8", "surrogatepass"))
    return chain_step(seed, message_digest(first) if first is not None else _ROOT)


class OpeningMemo:
    """:func:`opening_digest` for requests whose values are never changed in place (a body
    reader's parse, which hands on the very objects of an earlier body for text that repeats):
    a system prompt and first message that are the same objects as a recent request's give
    that request's digest without being digested again (the system prompt alone is often
    tens of kilobytes, read on every call). Keeps the last ``size``; safe from many threads."""

    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._kept: OrderedDict[tuple[int, int, str], tuple[Any, Any, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def digest(self, system: Any, hint: str, first: Any) -> bytes:
        """``opening_digest(system, hint, first)``."""
        key = (id(system), id(first), hint)
        with self._lock:
            kept = self._kept.get(key)
            # the objects are held while kept: an id is not another's until they are let go
            if kept is not None and kept[0] is system and kept[1] is first:
                self._kept.move_to_end(key)
                return kept[2]
        digest = opening_digest(system, hint, first)
        with self._lock:
            self._kept[key] = (system, first, digest)
            self._kept.move_to_end(key)
            while len(self._kept) > self._size:
                self._kept.popitem(last=False)
        return digest


def chain_of(
    messages: Sequence[Any], start: int = 0, base: Sequence[bytes] = (), *, opening: bytes
) -> list[bytes]:
    """The chain of ``messages``: ``base`` (the chain of ``messages[:start]``) extended over
    the rest, the first link ``opening``."""
    chain = list(base[:start])
    for i in range(start, len(messages)):
        chain.append(opening if i == 0 else chain_step(chain[-1], message_digest(messages[i])))
    return chain
