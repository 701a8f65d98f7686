"""Token counting: the last real response's usage plus an estimate of what came after (SPEC §4).

``method="reference"`` is the reference behaviour: ``round(len/4)`` per block, 2 chars/token for
JSON-family text, a fixed 2,000 for images and documents.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pipeline.messages import Message, Usage

__all__ = ["IMAGE_TOKENS", "TokenTracker", "find_anchor", "rough_tokens_for_messages"]

IMAGE_TOKENS = 2_000
"""Fixed estimate for an image or document block: base64 length says nothing about tokens."""


def _looks_like_json(text: str) -> bool:
    s = text.strip()
    return len(s) >= 2 and ((s[0] == "{" and s[-1] == "}") or (s[0] == "[" and s[-1] == "]"))


def rough_tokens_for_text(text: str) -> int:
    """``round(len/4)``; 2 chars/token for JSON-family text (dense punctuation)."""
    return round(len(text) / (2 if _looks_like_json(text) else 4))


def _rough_tokens_for_block(block: Mapping[str, Any]) -> int:
    btype = block.get("type")
    if btype == "text":
        return rough_tokens_for_text(str(block.get("text") or ""))
    if btype in ("image", "document"):
        return IMAGE_TOKENS
    if btype == "tool_result":
        content = block.get("content")
        if isinstance(content, str):
            return rough_tokens_for_text(content)
        if isinstance(content, list):
            return sum(_rough_tokens_for_block(b) for b in content if isinstance(b, Mapping))
        return 0
    if btype == "tool_use":
        return rough_tokens_for_text(
            str(block.get("name") or "") + json.dumps(block.get("input"), ensure_ascii=False)
        )
    if btype == "thinking":
        return rough_tokens_for_text(str(block.get("thinking") or ""))
    if btype == "redacted_thinking":
        return rough_tokens_for_text(str(block.get("data") or ""))
    return rough_tokens_for_text(json.dumps(block, ensure_ascii=False, default=str))


def rough_tokens_for_messages(messages: Sequence[Message]) -> int:
    """The reference rough estimate of the wire-visible content of ``messages``."""
    total = 0
    for m in messages:
        if m.type == "progress" or (m.type == "system" and m.subtype != "local_command"):
            continue
        if isinstance(m.content, str):
            total += rough_tokens_for_text(m.content)
        else:
            total += sum(_rough_tokens_for_block(b) for b in m.content)
    return total


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
        if m.message_id is not None:
            j = i - 1
            while j >= 0:
                prior = messages[j]
                prior_id = prior.message_id if prior.type == "assistant" else None
                if prior_id == m.message_id:
                    i = j
                elif prior_id is not None:
                    break
                j -= 1
        return i, m.usage
    return None


class TokenTracker:
    """Context size before the next call: last usage + an estimate of everything after it."""

    def __init__(self, method: Literal["reference"] = "reference") -> None:
        if method != "reference":
            raise NotImplementedError(f"token estimation method {method!r} is not implemented")
        self.method = method
        self.last_error: int | None = None
        """Estimate minus actual input tokens of the latest observed call."""

    def estimate(self, messages: Sequence[Message]) -> int:
        """Tokens the context holds if ``messages`` were sent now."""
        anchor = find_anchor(messages)
        if anchor is None:
            return rough_tokens_for_messages(messages)
        i, usage = anchor
        return usage.total + rough_tokens_for_messages(messages[i + 1 :])

    def observe(self, messages_before: Sequence[Message], usage: Usage) -> None:
        """Feed the usage of a response to the call made with ``messages_before``."""
        self.last_error = self.estimate(messages_before) - usage.input_side

    def estimate_after_anchor(self, messages: Sequence[Message]) -> int:
        """Only the estimated part: what came after the last response."""
        anchor = find_anchor(messages)
        return rough_tokens_for_messages(messages if anchor is None else messages[anchor[0] + 1 :])
