"""What a Claude Code 2.1 transcript records about each API call, and how the loader uses it.

Claude Code 2.1 writes, next to the conversation records, what each call really sent:

- ``api-request-shape``: the system prompt and tool schemas, once per distinct shape (by hash);
- ``api-request``: one per call: model, ``max_tokens``, thinking, betas, and the shape's hash;
- ``api-request-blob``: the exact content of the user message that call sent (attachments
  rendered, reminders folded into tool results).

:class:`RecordedRequest` keeps the first two per call, so the token tracker can count the system
prompt and tools each call carried. Each ``api-request`` also says which messages the call sent,
as a chain: the first ``keep`` messages of the call it builds on (``base``), then the messages
whose hashes it lists in ``tail``: a blob carries its hash; a response the transcript holds as
assistant records has none to look up.

:func:`apply_recorded_wire` makes the wire rebuild exact with them: where the records of a call
do not render to what the call recorded sending, they are replaced by records holding the
recorded messages (the recording wins; the count is reported).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.messages import WIRE_MESSAGE, Block, Message, stable_uuid
from pipeline.wire.encoding import encodable
from pipeline.wire.form import _entry_to_param, _Wire

__all__ = [
    "API_REQUEST",
    "API_REQUEST_BLOB",
    "API_REQUEST_SHAPE",
    "IGNORED_RECORD_TYPES",
    "RecordedBlob",
    "RecordedRequest",
    "apply_recorded_wire",
    "parse_blob",
    "parse_request",
    "parse_shape",
]

API_REQUEST = "api-request"
API_REQUEST_SHAPE = "api-request-shape"
API_REQUEST_BLOB = "api-request-blob"

IGNORED_RECORD_TYPES: frozenset[str] = frozenset(
    {
        "queue-operation",  # prompts queued while a turn runs (the prompt itself is a user record)
        "last-prompt",  # a pointer for the UI's history
        "tools-used",  # which tools the session has called so far
        "atis-latch",  # client state
        "cost-state",  # running cost totals
        "mode",  # permission mode changes
        "file-history-snapshot",  # file backups for undo
        "summary",  # 1.x session titles
        "custom-title",
    }
)
"""Record types that are known and hold nothing the API saw: skipped on purpose. Any other
type the loader does not know is counted as unknown (never fatal)."""


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One ``api-request`` record: the parameters of one call, besides its messages."""

    position: int
    """How many thread records were loaded before it: the call was made with those."""
    model: str | None
    system: Any = None
    """The system prompt (the shape's ``system``), None when the shape was not recorded."""
    tools: Sequence[Any] = ()
    """The tool schemas (the shape's ``tools``)."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """The other recorded parameters (``max_tokens``, ``thinking``, ``betas``...)."""
    request_id: str | None = None
    base: str | None = None
    """The ``request_id`` of the call whose messages this one starts with."""
    keep: int = 0
    """How many of the base call's messages this call sent first."""
    tail: tuple[str, ...] | None = None
    """Hashes of the messages it sent after those (None: no chain recorded)."""
    line: int = 0
    """Its line in the transcript (orders it among the blobs written at the same place)."""


@dataclass(frozen=True, slots=True)
class RecordedBlob:
    """One ``api-request-blob``: a message (usually the user message) a call sent."""

    position: int
    role: str
    content: str | list[Block]
    digest: str | None = None
    line: int = 0


def parse_shape(raw: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """``(hash, shape)`` of an ``api-request-shape`` record; ``ValueError`` naming the bad field."""
    digest, shape = raw.get("shapeHash"), raw.get("shape")
    if not isinstance(digest, str) or not isinstance(shape, Mapping):
        raise ValueError("api-request-shape needs a string 'shapeHash' and an object 'shape'")
    if not isinstance(shape.get("tools", []), list):
        raise ValueError("api-request-shape: 'tools' must be a list")
    return digest, shape


def parse_request(
    raw: Mapping[str, Any], shapes: Mapping[str, Mapping[str, Any]], position: int, line: int = 0
) -> RecordedRequest:
    """A :class:`RecordedRequest` from an ``api-request`` record and the shapes read so far."""
    params = raw.get("params")
    if not isinstance(params, Mapping):
        raise ValueError("api-request without a 'params' object")
    model = params.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("api-request: 'params.model' must be a string")
    shape = shapes.get(raw["shapeHash"]) if isinstance(raw.get("shapeHash"), str) else None
    # a request may carry its system and tools itself (no shape record)
    source: Mapping[str, Any] = shape if shape is not None else params
    tools = source.get("tools") or ()
    if not isinstance(tools, list | tuple):
        raise ValueError("api-request: 'tools' must be a list")
    rest = {k: v for k, v in params.items() if k not in ("model", "system", "tools", "messages")}
    tail, keep = raw.get("tail"), raw.get("keep", 0)
    if tail is not None and not (isinstance(tail, list) and all(isinstance(h, str) for h in tail)):
        raise ValueError("api-request: 'tail' must be a list of hashes")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError("api-request: 'keep' must be a count")
    ids = [raw.get(k) if isinstance(raw.get(k), str) else None for k in ("id", "base")]
    return RecordedRequest(
        position,
        model,
        source.get("system"),
        tools,
        rest,
        request_id=ids[0],
        base=ids[1],
        keep=keep,
        tail=None if tail is None else tuple(tail),
        line=line,
    )


def parse_blob(raw: Mapping[str, Any], position: int, line: int = 0) -> RecordedBlob:
    """A :class:`RecordedBlob` from an ``api-request-blob`` record."""
    message = raw.get("message")
    role = message.get("role") if isinstance(message, Mapping) else None
    if role not in ("user", "assistant"):
        raise ValueError("api-request-blob needs a user or assistant 'message'")
    assert isinstance(message, Mapping)
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in content):
            raise ValueError("api-request-blob: content holds a non-block")
    elif not isinstance(content, str):
        raise ValueError("api-request-blob: content must be a string or a list of blocks")
    digest = raw.get("hash") if isinstance(raw.get("hash"), str) else None
    return RecordedBlob(position, str(role), content, digest, line)


_WIRE_NAMESPACE = uuid.UUID("5b0c9f5e-0f7e-4c53-9a55-2f1f6bb0c6d1")


@dataclass(slots=True)
class WireCheck:
    """What :func:`apply_recorded_wire` found."""

    replaced: int = 0
    """Recorded messages put in place of records that did not render to them."""
    left_out: int = 0
    """Records left out because they rendered messages beyond what the call recorded sending."""
    unverified: int = 0
    """Calls whose rebuild differs from the recording where no blob holds what was sent (an
    assistant message only known by its hash): left as the records render it."""

    @property
    def changed(self) -> bool:
        """Whether the recording changed the records at all."""
        return bool(self.replaced or self.left_out)


def apply_recorded_wire(
    messages: list[Message],
    requests: Sequence[RecordedRequest],
    blobs: Sequence[RecordedBlob],
) -> tuple[list[Message], list[RecordedRequest], WireCheck]:
    """``messages`` changed so that each recorded call's messages rebuild exactly.

    The records are fed to the wire builder in order (afresh at each compaction, as the calls
    were); at each ``api-request`` the messages the call recorded sending (its chain, or else
    the blobs written since the call before) are compared, as JSON text, with the ones the
    records render to. Equal: nothing changes. Different from message ``j`` on, with every
    recorded message from there in a blob: the records that went into messages ``j``... are
    replaced by one record per recorded message (:data:`~pipeline.messages.WIRE_MESSAGE`: sent
    as it is, never merged with a neighbour); records that render messages after the last one a
    call sent are left out. The requests come back with their positions moved accordingly. One
    pass over the records; the comparison costs each call's new messages only.
    """
    check = WireCheck()
    if not requests and not blobs:
        return messages, list(requests), check
    by_hash = {b.digest: b for b in blobs if b.digest is not None}
    records: list[Message] = list(messages)
    """The records, then the ones made here (indices from ``len(messages)`` on)."""
    inserted: dict[int, list[int]] = {}
    """original position -> the records made to go before it."""
    origin: dict[int, int] = {}
    """made record -> the original position it goes before."""
    dropped: set[int] = set()
    wire = _Wire()
    members: list[list[int]] = []
    """Per wire entry: the records that went into it."""

    def feed(i: int) -> None:
        nonlocal wire, members
        m = records[i]
        if m.restarts_thread:
            wire, members = _Wire(), []
        went = wire.add(m)
        if went == len(members):
            members.append([i])
        elif went >= 0:
            members[went].append(i)

    events = sorted(  # file order: a blob belongs to the next request written after it
        [(r.position, r.line, 1, n) for n, r in enumerate(requests)]
        + [(b.position, b.line, 0, n) for n, b in enumerate(blobs)]
    )
    fed = 0
    since: list[RecordedBlob] = []
    for position, _, kind, n in events:
        while fed < min(position, len(messages)):
            feed(fed)
            fed += 1
        if kind == 0:
            since.append(blobs[n])
            continue
        request = requests[n]
        expected: list[tuple[str | None, RecordedBlob | None]]
        if request.tail is not None:
            keep = request.keep
            expected = [(h, by_hash.get(h)) for h in request.tail]
        else:
            expected = [(b.digest, b) for b in since]
            keep = max(0, len(wire.entries) - len(expected))
        since = []
        first = _first_difference(wire, keep, expected)
        if first is None:
            continue
        rest = expected[first - keep :] if first >= keep else []
        covered = sorted({i for group in members[first:] for i in group})
        if (
            first < keep
            or any(blob is None for _, blob in rest)
            or any(_is_response(records[i]) for i in covered)
        ):
            # what was sent is not all in blobs, or making it exact would drop a response
            # (a call of its own): left as the records render it
            check.unverified += 1
            continue
        dropped.update(covered)
        if not rest:  # the records render messages after the last one the call sent
            check.left_out += len(covered)
        at = min((origin.get(i, i) for i in covered), default=fed)
        wire.truncate(first)
        del members[first:]
        seed = records[covered[0]].uuid if covered else str(at)
        for k, (digest, blob) in enumerate(rest):
            assert blob is not None
            name = f"{n}:{k}:{request.request_id}:{digest}:{seed}"
            made = _wire_message(blob, stable_uuid(_WIRE_NAMESPACE, name))
            records.append(made)
            origin[len(records) - 1] = at
            inserted.setdefault(at, []).append(len(records) - 1)
            feed(len(records) - 1)
            check.replaced += 1
    if not dropped and not inserted:
        return messages, list(requests), check
    out: list[Message] = []
    moved: list[int] = []
    """Per original position: where it is in ``out`` (what precedes a request there)."""
    for i in range(len(messages) + 1):
        out.extend(records[j] for j in inserted.get(i, ()) if j not in dropped)
        moved.append(len(out))
        if i < len(messages) and i not in dropped:
            out.append(messages[i])
    placed = [
        dataclasses.replace(r, position=moved[min(r.position, len(messages))]) for r in requests
    ]
    return out, placed, check


def _is_response(m: Message) -> bool:
    """A record of a real API response (a call of its own in a replay)."""
    return (
        m.type == "assistant"
        and m.message_id is not None
        and not m.is_synthetic
        and not m.is_wire_message
    )


def _wire_message(blob: RecordedBlob, uid: str) -> Message:
    content = encodable(blob.content)
    if blob.role == "assistant":
        return Message.assistant(content, uuid=uid, subtype=WIRE_MESSAGE)
    return Message.user(content, uuid=uid, subtype=WIRE_MESSAGE)


def _first_difference(
    wire: _Wire, keep: int, expected: Sequence[tuple[str | None, RecordedBlob | None]]
) -> int | None:
    """The first wire entry from ``keep`` on that differs from the recorded messages, or None
    when they all agree (and there are no more entries). A message known only by its hash (a
    response the transcript has as assistant records, not as a blob) cannot be compared: any
    entry there agrees."""
    entries = wire.entries
    if keep > len(entries):  # the call kept more than the records render: cannot be matched
        return len(entries)
    for k, (_, blob) in enumerate(expected):
        e = keep + k
        if e >= len(entries):
            return e
        if blob is None:
            continue
        param = _entry_to_param(entries[e])
        if param["role"] != blob.role or _json(param["content"]) != _json(encodable(blob.content)):
            return e
    end = keep + len(expected)
    return end if len(entries) > end else None


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)
