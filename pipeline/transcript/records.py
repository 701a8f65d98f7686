"""One record of a Claude Code JSONL transcript, parsed and checked (:func:`parse_message`,
:func:`replacement_entry`, :func:`check_depth`); reading a whole file is
:mod:`pipeline.transcript.read`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from pipeline.messages import REMINDER, Block, Content, Message, Usage, new_uuid
from pipeline.replacement import ReplacementRecord
from pipeline.tokens.checks import bounded_repr
from pipeline.transcript.deferred import read_deferred
from pipeline.wire.shared_strings import shared, shared_keys

__all__ = ["MAX_NESTING", "check_depth", "parse_message", "replacement_entry", "same_record"]


def _require_str(raw: Mapping[str, Any], key: str, *, optional: bool = True) -> str | None:
    value = raw.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {type(value).__name__}")
    return value


def _parse_blocks(content: Any, where: str) -> Content:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of blocks")
    blocks: list[Block] = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ValueError(f"{where}[{i}] is not a content block with a string 'type'")
        btype = block["type"] = shared(block["type"])
        if btype == "tool_use":
            if not isinstance(block.get("id"), str):
                raise ValueError(f"{where}[{i}]: tool_use without a string 'id'")
            block["id"] = shared(block["id"])
            if isinstance(block.get("name"), str):
                block["name"] = shared(block["name"])
            if isinstance(block.get("input"), dict):
                block["input"] = shared_keys(block["input"])
        if btype == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise ValueError(f"{where}[{i}]: tool_result without a string 'tool_use_id'")
            block["tool_use_id"] = shared(block["tool_use_id"])
            inner = block.get("content")
            if inner is not None and not isinstance(inner, str | list):
                raise ValueError(f"{where}[{i}]: tool_result content must be a string or a list")
            if isinstance(inner, list):
                if not all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in inner):
                    raise ValueError(f"{where}[{i}]: tool_result content holds a non-block")
                block["content"] = [shared_keys(b) for b in inner]
        blocks.append(shared_keys(block))
    return blocks


def _shared_opt(value: str | None) -> str | None:
    return None if value is None else shared(value)


def same_record(a: Message, b: Message) -> bool:
    """Whether two records of one uuid are the same record: every field written alike (as
    JSON: ``1`` is not ``1.0`` nor ``true``, and keys keep their order)."""
    return _written(a) == _written(b)


def _written(m: Message) -> str:
    usage = m.usage.to_mapping() if m.usage is not None else None
    fields = [getattr(m, f.name) for f in dataclasses.fields(m) if f.name != "usage"]
    return json.dumps([fields, usage], ensure_ascii=True, default=read_deferred)


def parse_message(raw: Mapping[str, Any]) -> Message:
    rtype = raw["type"]
    common: dict[str, Any] = {
        "uuid": _require_str(raw, "uuid") or new_uuid(),
        "timestamp": _require_str(raw, "timestamp"),
        "is_sidechain": bool(raw.get("isSidechain", False)),
        "is_meta": bool(raw.get("isMeta", False)),
    }
    if rtype in ("user", "assistant"):
        body = raw.get("message")
        if not isinstance(body, Mapping):
            raise ValueError(f"{rtype} record without a 'message' object")
        content = _parse_blocks(body.get("content"), "message.content")
        if rtype == "user":
            return Message(
                type="user",
                content=content,
                is_compact_summary=bool(raw.get("isCompactSummary", False)),
                **common,
            )
        usage_raw = body.get("usage")
        if usage_raw is not None and not isinstance(usage_raw, Mapping):
            raise ValueError("message.usage must be an object")
        return Message(
            type="assistant",
            content=content,
            message_id=_require_str(body, "id"),
            model=_shared_opt(_require_str(body, "model")),
            usage=Usage.from_mapping(usage_raw) if usage_raw is not None else None,
            stop_reason=_shared_opt(_require_str(body, "stop_reason")),
            **common,
        )
    if rtype == "system":
        content_raw = raw.get("content")
        return Message(
            type="system",
            content=content_raw if isinstance(content_raw, str) else "",
            subtype=_require_str(raw, "subtype"),
            **common,
        )
    if rtype == "attachment":
        rendered = raw.get("rendered")
        if rendered is not None:  # Claude Code 2.1: the text it sends, already rendered
            return Message(
                type="attachment", content=_rendered_blocks(rendered), subtype=REMINDER, **common
            )
        att = raw.get("attachment")
        att_content: Any = att.get("content") if isinstance(att, Mapping) else None
        content = _parse_blocks(att_content, "attachment.content") if att_content else ""
        return Message(type="attachment", content=content, **common)
    return Message(type="progress", **common)  # progress payloads are UI-only: not kept


def _rendered_blocks(rendered: Any) -> list[Block]:
    """The text blocks of a 2.1 attachment's ``rendered`` list (``[{"content": str}, ...]``)."""
    if not isinstance(rendered, list):
        raise ValueError("attachment 'rendered' must be a list")
    blocks: list[Block] = []
    for i, item in enumerate(rendered):
        text = item.get("content") if isinstance(item, Mapping) else None
        if not isinstance(text, str):
            raise ValueError(f"attachment rendered[{i}] has no string 'content'")
        if text:
            blocks.append({"type": "text", "text": text})
    return blocks


def replacement_entry(rep: Any) -> ReplacementRecord:
    """One ``content-replacement`` entry. The fields are checked here first, so that every
    value an error quotes is cut short (:func:`bounded_repr`): a hostile entry must not turn
    into a message of megabytes."""
    if not isinstance(rep, Mapping):
        raise ValueError("content-replacement entry is not an object")
    tool_use_id, replacement = rep.get("tool_use_id"), rep.get("replacement")
    kind = rep.get("kind", "tool-result")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise ValueError(f"replacement record: bad tool_use_id {bounded_repr(tool_use_id)}")
    if not isinstance(replacement, str):
        raise ValueError(
            f"replacement record {bounded_repr(tool_use_id)}: replacement is not a string"
        )
    if not isinstance(kind, str):
        raise ValueError(
            f"replacement record {bounded_repr(tool_use_id)}: bad kind {bounded_repr(kind)}"
        )
    return ReplacementRecord.from_json(rep)


MAX_NESTING = 256
"""Deepest JSON nesting a record may have. Real records stay under 20; anything deeper would
only reach recursion limits later (estimating, serialising a request), far from its line."""


def check_depth(raw: Any, line: str) -> None:
    """Refuse a record nested deeper than :data:`MAX_NESTING` (a cheap count rules out almost
    every line before any walk)."""
    if line.count("[") + line.count("{") <= MAX_NESTING:
        return
    stack: list[tuple[Any, int]] = [(raw, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_NESTING:
            raise ValueError(f"nested deeper than {MAX_NESTING} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
