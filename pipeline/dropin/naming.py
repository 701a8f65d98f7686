"""How a request names its conversation: the hint it carries (the caller's explicit id, the
``x-sluicegate-session`` header, Claude Code's session) and the directory name of a family of
conversations (:mod:`pipeline.dropin.conversations` places requests by what they hold; the
hint only narrows where it looks)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from pipeline.store.files import validate_session_id

__all__ = ["SESSION_HEADER", "conversation_hint", "family_name"]

SESSION_HEADER = "x-sluicegate-session"
"""The request header a client names its conversation with (a hint: see
:mod:`pipeline.dropin.conversations`)."""

_CLAUDE_CODE_SESSION = re.compile(r"_session_([0-9a-fA-F-]{36})$")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_LABEL_CHARS = 48


def conversation_hint(
    body: Mapping[str, Any],
    *,
    explicit: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> str:
    """The hint a request carries of its conversation: ``explicit`` (the caller's argument),
    else the ``x-sluicegate-session`` header, else ``cc-<uuid>`` for Claude Code's session
    (``metadata.user_id``: a JSON object with ``session_id`` in 2.x, ``..._session_<uuid>``
    before), else ``""``. ``ValueError`` when an explicit id or the header is not a safe
    session id (``[A-Za-z0-9_.-]{1,128}``)."""
    chosen = explicit
    if chosen is None and headers is not None:
        chosen = next((v for k, v in headers.items() if k.lower() == SESSION_HEADER), None)
    if chosen is not None:
        return validate_session_id(chosen)
    claude_code = _claude_code_session(body.get("metadata"))
    return "" if claude_code is None else f"cc-{claude_code}"


def _claude_code_session(metadata: Any) -> str | None:
    user_id = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    if not isinstance(user_id, str):
        return None
    try:
        parsed = json.loads(user_id)
    except (ValueError, RecursionError):  # not Claude Code's: no hint
        parsed = None
    session = parsed.get("session_id") if isinstance(parsed, dict) else None
    if session is None:
        found = _CLAUDE_CODE_SESSION.search(user_id)
        session = found.group(1) if found else None
    if isinstance(session, str) and _UUID.fullmatch(session):
        return session.lower()
    return None


def family_name(hint: str, opening: bytes) -> str:
    """``<hint label>-<24 hex>`` (``fp-...`` without a hint): a directory name that shows the
    hint, bounded in length whatever the hint."""
    label = hint or "fp"
    if len(label) > _LABEL_CHARS:
        label = f"{label[:32]}_{hashlib.sha256(label.encode()).hexdigest()[:15]}"
    return f"{label}-{opening.hex()[:24]}"
