"""How the ledger names a result and tells a replacement: the key (the tool_use_id and a
digest of the output) and the text a replacement is.

A decision is bound to what it decided on: the key for a result is its ``tool_use_id`` *and* a
digest of its output (:func:`result_key`), so a decision is re-applied only to the content it
was made from.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pipeline.wire.canonical import canonical_json
from pipeline.wire.deferred import DeferredText, resolved

__all__ = [
    "DIGEST_HEX",
    "KEY_SEPARATOR",
    "MAX_REPLACEMENT_CHARS",
    "PERSISTED_OUTPUT_CLOSING_TAG",
    "PERSISTED_OUTPUT_TAG",
    "content_digest",
    "is_replacement_text",
    "keys_shared",
    "result_key",
    "tool_use_id_of",
]

PERSISTED_OUTPUT_TAG = "<persisted-output>"
PERSISTED_OUTPUT_CLOSING_TAG = "</persisted-output>"

#: The longest text a genuine replacement can be: a 2,000-char preview, a path of up to 4,096
#: chars (PATH_MAX) and the frame around them.
MAX_REPLACEMENT_CHARS = 2_000 + 4_096 + 256


def is_replacement_text(content: Any) -> bool:
    """Text that can be a replacement written by a budget or a per-tool gate: it opens and
    closes with the tag and is no longer than a replacement can be.

    Tool output is attacker-controlled: a longer text that merely begins with the tag is
    ordinary output, gated and budgeted like any other (a short one that imitates a
    replacement is no larger than a real one). An output held out of memory
    (:class:`~pipeline.wire.deferred.DeferredText`) short enough to be one is read back, and
    its source's error (``OutputNotCarried``, ``TranscriptChanged``) raised when it cannot be.
    """
    if type(content) is DeferredText:  # an output held out of memory: read only if it may be one
        if content.chars > MAX_REPLACEMENT_CHARS:
            return False
        content = content.read()
    return (
        isinstance(content, str)
        and len(content) <= MAX_REPLACEMENT_CHARS
        and content.startswith(PERSISTED_OUTPUT_TAG)
        and content.rstrip().endswith(PERSISTED_OUTPUT_CLOSING_TAG)
    )


DIGEST_HEX = re.compile(r"[0-9a-f]{32}")
"""A key's digest part: 32 lowercase hex digits."""
KEY_SEPARATOR = "#"
"""Between a key's id and its digest."""


def content_digest(content: Any) -> str:
    """32 hex digits of SHA-256 over a result's output (its core: see
    :mod:`pipeline.wire.harness`): a string as it is, a block list as compact JSON with its keys
    sorted and without ``cache_control`` (a client moves its breakpoints between calls).
    ``ValueError`` for content nested too deeply to write."""
    content = resolved(content)
    if isinstance(content, str):
        data = b"s" + content.encode("utf-8", "surrogatepass")
    else:
        plain = (
            [_without_cache_control(b) for b in content] if isinstance(content, list) else content
        )
        data = b"j" + canonical_json(plain, what="tool result content")
    return hashlib.sha256(data).hexdigest()[:32]


def _without_cache_control(block: Any) -> Any:
    if isinstance(block, Mapping) and "cache_control" in block:
        return {k: v for k, v in block.items() if k != "cache_control"}
    return block


class _Shared:
    """What one request's results share: their keys by value, the digests of the outputs it
    holds. Closed at the request's end: a copy of its context that outlives it (a timer's
    callback, a worker's task) shares nothing more."""

    __slots__ = ("digests", "keys", "open")

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}
        self.digests: dict[str, str] = {}
        self.open = True

    def close(self) -> None:
        self.open = False
        self.keys.clear()
        self.digests.clear()


_SHARED: ContextVar[_Shared | None] = ContextVar("sluicegate_result_keys", default=None)


@contextmanager
def keys_shared() -> Iterator[None]:
    """Within it (a request's handling), the keys :func:`result_key` makes for one result are
    one string object, and an output's digest is taken once: a conversation first met with
    its history has its results keyed twice in its first request (its ledger rebuilt from
    where they stand, then the budget's scan), and both keys are kept as long as the
    conversation is held (~110 bytes a result), while a digest is a pass of SHA-256 over the
    output (~10 % of such a request's work). What it shares is let go of at its end (also by
    a copy of its context that outlives it: a timer's callback holds one)."""
    shared = _Shared()
    token = _SHARED.set(shared)
    try:
        yield
    finally:
        shared.close()
        _SHARED.reset(token)


def result_key(tool_use_id: str, core: Any, *, kept: bool = False) -> str:
    """The ledger's key for a result: its id and the digest of its output,
    ``<tool_use_id>#<32 hex>`` (the same object for the same result within
    :func:`keys_shared`). ``kept``: ``core`` is the very string the request holds (a block's
    own output, not one read back from its bytes or cut from a longer one): within
    :func:`keys_shared` its digest is taken once however often it is keyed, remembering it
    keeping nothing alive that the request does not hold anyway."""
    shared = _SHARED.get()
    if shared is None or not shared.open:
        return f"{tool_use_id}{KEY_SEPARATOR}{content_digest(core)}"
    if kept and type(core) is str:
        digests = shared.digests
        digest = digests.get(core)
        if digest is None:
            digest = digests[core] = content_digest(core)
    else:
        digest = content_digest(core)
    key = f"{tool_use_id}{KEY_SEPARATOR}{digest}"
    return shared.keys.setdefault(key, key)


def tool_use_id_of(key: str) -> str:
    """The ``tool_use_id`` part of a ledger key (a legacy key, a bare id, is the id)."""
    head, sep, tail = key.rpartition(KEY_SEPARATOR)
    return head if sep and DIGEST_HEX.fullmatch(tail) else key
