"""What the stages ask of a request beyond its messages, merged with what the client sent.

A stage that delegates to the API (server-side clearing, server-side compaction) asks for
request fields in ``ctx.report.request_extras`` and for betas in ``ctx.report.betas``. The
proxy, ``wrap`` and the agent put them on the request with :func:`merge_request_fields` and
:func:`merge_betas`, so that the client's own fields are never dropped:

- ``context_management``: the client's edits are kept as sent, in their order; a stage's edit
  is appended after them unless the client already sent an edit of that ``type`` (the client's
  own value wins); then ``clear_thinking_20251015`` is moved first, where the API requires it.
  The client's other ``context_management`` keys stay as sent.
- any other field: added when the client did not send it (or sent ``null``), left as sent
  when it did.
- betas: the union of the client's ``anthropic-beta`` values and the stages', sorted.

A client ``context_management`` of ``null`` is taken as not sent. One that is not an object,
or whose ``edits`` is not a list, is sent as the client sent it (the API judges it); the
stages' edits are then not added. Nor are they to a compaction request (a client's own
``compaction``, not ``null``): the API refuses ``context_management`` beside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.context import PassReport

__all__ = [
    "CLEAR_THINKING_EDIT",
    "ask_for_edit",
    "merge_betas",
    "merge_edits",
    "merge_request_fields",
]

CLEAR_THINKING_EDIT = "clear_thinking_20251015"
"""The edit the API requires first in ``context_management.edits`` when others are given."""

_CONTEXT_MANAGEMENT = "context_management"
_COMPACTION = "compaction"


def merge_request_fields(body: Mapping[str, Any], extras: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` with the fields the stages asked for (``extras``) merged in (see the module)."""
    merged = dict(body)
    for name, value in extras.items():
        if name == _CONTEXT_MANAGEMENT and body.get(_COMPACTION) is not None:
            continue  # a compaction request: the API takes no context_management with it
        if merged.get(name) is None:  # absent, or null: the client set nothing
            merged[name] = value
        elif name == _CONTEXT_MANAGEMENT:
            merged[name] = _merge_context_management(merged[name], value)
    return merged


def merge_edits(client: Iterable[Any], stages: Iterable[Any]) -> list[Any]:
    """The client's edits, then each stage edit of a ``type`` not given yet, with
    ``clear_thinking_20251015`` first."""
    edits = list(client)
    given = {_type_of(e) for e in edits}
    for edit in stages:
        kind = _type_of(edit)
        if kind is None or kind not in given:
            edits.append(edit)
            given.add(kind)
    # a stable sort: every other edit keeps its place
    return sorted(edits, key=lambda e: _type_of(e) != CLEAR_THINKING_EDIT)


def ask_for_edit(report: PassReport, edit: Mapping[str, Any], beta: str) -> None:
    """A stage asks for the server-side ``edit`` (and the ``beta`` that enables it) on this
    pass's request: added to ``report.request_extras["context_management"]``, replacing an
    edit of the same ``type`` another stage asked for earlier in the pass."""
    existing = report.request_extras.get(_CONTEXT_MANAGEMENT)
    config: dict[str, Any] = dict(existing) if isinstance(existing, Mapping) else {}
    earlier = config.get("edits")
    kind = _type_of(edit)
    kept = [e for e in (earlier if isinstance(earlier, list) else []) if _type_of(e) != kind]
    config["edits"] = [*kept, dict(edit)]
    report.request_extras[_CONTEXT_MANAGEMENT] = config
    if beta not in report.betas:
        report.betas.append(beta)


def merge_betas(given: str | None, betas: Iterable[str]) -> str:
    """An ``anthropic-beta`` value holding the client's betas (``given``, comma-separated) and
    the ones a stage asked for, each once, sorted."""
    client = (b.strip() for b in (given or "").split(","))
    return ",".join(sorted({*betas, *filter(None, client)}))


def _merge_context_management(client: Any, stages: Any) -> Any:
    if not isinstance(client, Mapping) or not isinstance(stages, Mapping):
        return client
    edits = client.get("edits", [])
    if not isinstance(edits, list):
        return client
    merged = {**stages, **client}
    merged["edits"] = merge_edits(edits, stages.get("edits") or [])
    return merged


def _type_of(edit: Any) -> str | None:
    kind = edit.get("type") if isinstance(edit, Mapping) else None
    return kind if isinstance(kind, str) else None
