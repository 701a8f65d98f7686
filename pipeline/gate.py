"""The per-tool gate and the replacement text of a persisted result.

``gate_tool_result`` is what an agent loop calls when a tool returns; the budget stage uses the
same pieces for results it is the first to see.
"""

from __future__ import annotations

import errno
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from pipeline.results.keys import (
    PERSISTED_OUTPUT_CLOSING_TAG,
    PERSISTED_OUTPUT_TAG,
    is_replacement_text,
)
from pipeline.results.reading import candidate_size, content_is_empty
from pipeline.store.files import ToolResultStore
from pipeline.tracing import Decision, Reason
from pipeline.wire.deferred import DeferredText, resolved

__all__ = [
    "PREVIEW_SIZE_CHARS",
    "GateOutcome",
    "Persisted",
    "build_replacement",
    "describe_error",
    "empty_result_text",
    "format_size",
    "gate_tool_result",
    "generate_preview",
    "is_persistable",
    "persist_content",
]

PREVIEW_SIZE_CHARS = 2_000


def _js_fixed1(x: float) -> str:
    """``Number.prototype.toFixed(1)`` with a trailing ``.0`` dropped.

    JS rounds the exact binary value half-up; Python's ``format`` rounds half-even, which
    differs on exact ties such as 0.25 KB.
    """
    text = str(Decimal(x).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))
    return text[:-2] if text.endswith(".0") else text


def format_size(chars: int) -> str:
    """``N bytes`` under 1024, else KB / MB / GB with one decimal, ``.0`` dropped."""
    kb = chars / 1024
    if kb < 1:
        return f"{chars} bytes"
    if kb < 1024:
        return f"{_js_fixed1(kb)}KB"
    mb = kb / 1024
    if mb < 1024:
        return f"{_js_fixed1(mb)}MB"
    return f"{_js_fixed1(mb / 1024)}GB"


def generate_preview(text: str, max_chars: int = PREVIEW_SIZE_CHARS) -> tuple[str, bool]:
    """The first ``max_chars``, cut back to the last newline when it lies past the half."""
    if len(text) <= max_chars:
        return text, False
    head = text[:max_chars]
    last_newline = head.rfind("\n")
    cut = last_newline if last_newline > max_chars * 0.5 else max_chars
    return text[:cut], True


def build_replacement(path: str, original_chars: int, preview: str, has_more: bool) -> str:
    """The exact text the model sees instead of a persisted result."""
    return (
        f"{PERSISTED_OUTPUT_TAG}\n"
        f"Output too large ({format_size(original_chars)}). Full output saved to: {path}\n\n"
        f"Preview (first 2KB):\n{preview}"
        + ("\n...\n" if has_more else "\n")
        + PERSISTED_OUTPUT_CLOSING_TAG
    )


def empty_result_text(tool_name: str | None) -> str:
    """What an empty result becomes: an empty tool_result can make a model end its turn."""
    return f"({tool_name or 'tool'} completed with no output)"


def is_persistable(content: Any) -> bool:
    """A string, or a block list of text blocks only."""
    if isinstance(content, str) or type(content) is DeferredText:
        return True
    return isinstance(content, list) and all(
        isinstance(b, Mapping) and b.get("type") == "text" for b in content
    )


@dataclass(frozen=True, slots=True)
class Persisted:
    """A result written to the store, and the text the model sees in its place."""

    path: str
    chars: int
    replacement: str
    spooled: bool = False
    """Held in a local spool until the store answers again (an object store in an outage:
    :mod:`pipeline.store.spool`); a store says so with an optional ``spooled(path)`` method."""


async def persist_content(store: ToolResultStore, tool_use_id: str, content: Any) -> Persisted:
    """Write ``content`` to the store and build its replacement text.

    Strings go to ``.txt`` as they are; text-block lists to ``.json``, pretty-printed with a
    2-space indent. Raises ``ValueError`` for non-persistable content and whatever the store
    raises when the write fails.
    """
    if not is_persistable(content):
        raise ValueError("only strings and lists of text blocks can be persisted")
    content = resolved(content)  # an output left in its file: its text
    if isinstance(content, str):
        text, ext = content, "txt"
    else:
        text, ext = json.dumps(content, indent=2, ensure_ascii=False), "json"
    path = await store.persist(tool_use_id, text, ext)
    preview, has_more = generate_preview(text)
    spooled = getattr(store, "spooled", None)
    return Persisted(
        path=path,
        chars=len(text),
        replacement=build_replacement(path, len(text), preview, has_more),
        spooled=bool(spooled(path)) if callable(spooled) else False,
    )


def describe_error(exc: BaseException) -> str:
    """A failed write, told apart without its message: ``OSError: ENOSPC (No space left on
    device)`` -- the errno name and text say which failure it was, and carry no content (the
    message of an arbitrary exception might)."""
    name = type(exc).__name__
    if isinstance(exc, OSError) and exc.errno is not None:
        code = errno.errorcode.get(exc.errno, str(exc.errno))
        return f"{name}: {code} ({exc.strerror})" if exc.strerror else f"{name}: {code}"
    return name


@dataclass(frozen=True, slots=True)
class GateOutcome:
    """What the per-tool gate did to one tool_result block."""

    block: dict[str, Any]
    """The block to send: the input block itself when unchanged."""
    decision: Decision
    """``persist``, ``persist_failed``, ``keep``, ``fill_empty`` or ``skip_unbounded_tool``."""
    reason: Reason
    size: int
    threshold: float
    path: str | None = None
    error: str | None = None


def _has_image(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(b, Mapping) and b.get("type") == "image" for b in content
    )


async def gate_tool_result(
    block: dict[str, Any],
    *,
    tool_name: str | None,
    threshold: float,
    store: ToolResultStore,
) -> GateOutcome:
    """Apply the per-tool gate to a fresh tool_result block, in this order: an empty result
    gets a placeholder; images and earlier replacements (:func:`is_replacement_text`) go as
    they are; a never-persist
    tool's result is skipped; results at or under the threshold and block lists holding a
    non-text block go as they are; anything else is persisted (a failed write sends the
    original). See docs/behaviour.md §1.2."""
    content = block.get("content")
    if content_is_empty(content):
        filled = {**block, "content": empty_result_text(tool_name)}
        return GateOutcome(filled, Decision.FILL_EMPTY, Reason.EMPTY, 0, threshold)
    if _has_image(content):
        return GateOutcome(block, Decision.KEEP, Reason.IMAGE, 0, threshold)
    size = candidate_size(content)
    if is_replacement_text(content):
        return GateOutcome(block, Decision.KEEP, Reason.ALREADY_REPLACED, size, threshold)
    if math.isinf(threshold):
        skip = Decision.SKIP_UNBOUNDED_TOOL
        return GateOutcome(block, skip, Reason.NEVER_PERSIST, size, threshold)
    if size <= threshold:
        return GateOutcome(block, Decision.KEEP, Reason.PER_TOOL, size, threshold)
    if not is_persistable(content):
        return GateOutcome(block, Decision.KEEP, Reason.NOT_PERSISTABLE, size, threshold)
    tool_use_id = str(block.get("tool_use_id"))
    try:
        persisted = await persist_content(store, tool_use_id, content)
    except Exception as exc:  # any storage failure: send the original, report it
        error = describe_error(exc)
        failed = Decision.PERSIST_FAILED
        return GateOutcome(block, failed, Reason.PER_TOOL, size, threshold, error=error)
    replaced = {**block, "content": persisted.replacement}
    return GateOutcome(
        replaced, Decision.PERSIST, Reason.PER_TOOL, size, threshold, path=persisted.path
    )
