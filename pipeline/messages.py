"""The message model: :class:`Message` (one conversation record) and :class:`Usage`.

A :class:`Message` is one record of an agent's conversation as the agent keeps it (Claude Code
keeps one record per streamed content block, interleaved with progress and system records). The
Messages API sees something else: :func:`pipeline.wire.form.to_api` turns the records into the
``MessageParam`` dicts that ``client.messages.create(messages=...)`` accepts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import uuid as _uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

__all__ = [
    "COMPACTION_BLOCK",
    "REMINDER",
    "SYNTHETIC_MODEL",
    "WIRE_MESSAGE",
    "Block",
    "Content",
    "Message",
    "MessageType",
    "Usage",
    "block_type",
    "context_start",
    "first_fragment",
    "holds_compaction",
    "live_start",
    "new_uuid",
    "now_timestamp",
    "stable_uuid",
    "thread_start",
    "usage_compacted",
    "uuid5_text",
]

MessageType = Literal["user", "assistant", "progress", "attachment", "system"]
Block = dict[str, Any]
"""One content block: an anthropic block param dict (``{"type": "text", "text": ...}``...)."""
Content = str | list[Block]

_MESSAGE_TYPES: frozenset[str] = frozenset(
    ("user", "assistant", "progress", "attachment", "system")
)
REMINDER = "reminder"
"""``subtype`` of an attachment record that the agent renders as ``<system-reminder>`` text the
way Claude Code 2.1 does (a transcript's ``rendered`` attachments): on the wire it goes before
the prompt it came with, or into the content of the tool result it follows
(:func:`pipeline.wire.form.to_api`)."""
WIRE_MESSAGE = "wire"
"""``subtype`` of a user or assistant record that holds one whole message exactly as a call
sent it (recorded by Claude Code 2.1): on the wire it is that message, never merged with a
neighbour (:func:`pipeline.transcript.recorded.apply_recorded_wire`)."""
SYNTHETIC_MODEL = "<synthetic>"
"""Model name of assistant records that no API call produced (errors, interruptions)."""


_USAGE_FIELDS = (
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage reported by one API response."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    def __post_init__(self) -> None:
        for name in _USAGE_FIELDS:
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_TOKENS
            ):
                shown = _brief(value)
                raise ValueError(f"usage.{name} must be an integer from 0 to 10**12, got {shown}")

    @property
    def input_side(self) -> int:
        """Tokens the request occupied: input + cache writes + cache reads."""
        return self.input_tokens + self.cache_creation_input_tokens + self.cache_read_input_tokens

    @property
    def total(self) -> int:
        """Tokens the context holds after the response: input side + output."""
        return self.input_side + self.output_tokens

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> Usage:
        """Build from an API ``usage`` object; missing or null counts are 0, bad types rejected.

        A usage with ``iterations`` (server-side compaction, server tool loops) reports the
        context the response ends with in its last ``message`` iteration: that one is taken.
        A ``compaction`` iteration's input prices the summarising request, never the context;
        a response that paused after one (no ``message`` iteration after it) ends with the
        summary alone: its output tokens."""
        iterations = raw.get("iterations")
        if isinstance(iterations, list):
            steps = [i for i in iterations if isinstance(i, Mapping)]
            if steps and steps[-1].get("type") == "compaction":
                raw = {"output_tokens": steps[-1].get("output_tokens")}
            else:
                sampled = [i for i in steps if i.get("type") == "message"]
                if sampled:
                    raw = sampled[-1]
        values: dict[str, Any] = {name: raw.get(name) for name in _USAGE_FIELDS}
        return cls(**{name: value for name, value in values.items() if value is not None})

    def to_mapping(self) -> dict[str, int]:
        """The API's ``usage`` shape."""
        return dataclasses.asdict(self)


def usage_compacted(raw: Mapping[str, Any]) -> bool:
    """Whether an API ``usage`` object says the server compacted the context in that call
    (a ``compaction`` iteration): its input is not the request's, so nothing is learned from
    comparing the two."""
    iterations = raw.get("iterations")
    return isinstance(iterations, list) and any(
        isinstance(i, Mapping) and i.get("type") == "compaction" for i in iterations
    )


MAX_TOKENS = 10**12
"""Largest token count a usage may report: far above any context window, far below where
float arithmetic on it loses meaning."""


def _brief(value: object) -> str:
    """``repr`` for an error message: short, also for an int too long to print."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def now_timestamp() -> str:
    """The current UTC time as transcripts write it (ISO 8601, milliseconds, ``Z``)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def new_uuid() -> str:
    """A fresh random record uuid."""
    return str(_uuid.uuid4())


def stable_uuid(namespace: _uuid.UUID, name: str) -> str:
    """``uuid5(namespace, name)``, also for a name holding lone surrogates (text read from
    invalid UTF-8), which ``uuid.uuid5`` refuses to encode."""
    digest = hashlib.sha1(namespace.bytes + name.encode("utf-8", "surrogatepass")).digest()
    return uuid5_text(digest[:16])


_UUID5_KEEP = ((1 << 128) - 1) & ~(0xC000 << 48) & ~(0xF000 << 64)
_UUID5_MARK = 0x8000 << 48 | 5 << 76


def uuid5_text(raw: bytes) -> str:
    """``str(uuid.UUID(bytes=raw, version=5))`` (16 bytes, the variant and version bits set),
    without building the object: record names are made for every new message of a call."""
    if len(raw) != 16:
        raise ValueError("bytes is not a 16-char string")
    h = f"{int.from_bytes(raw, 'big') & _UUID5_KEEP | _UUID5_MARK:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@dataclass(frozen=True, slots=True, eq=False)
class Message:
    """One conversation record.

    Immutable by convention: stages never mutate a message or its content, they build a new one
    with :meth:`with_content` (untouched messages pass through by reference). ``content`` holds
    anthropic block param dicts (or a plain string, as the API allows for user text).

    Two records are equal only when they are the same object (and a record hashes by identity).
    Field-by-field equality would be misleading here: ``{"a": 1, "b": 2}`` equals
    ``{"b": 2, "a": 1}`` and ``1`` equals ``1.0``, yet they go over the wire as different bytes,
    and the stages' reuse of earlier work rests on "the same object, so the same bytes".
    :func:`pipeline.testing.assert_same_messages` compares records by their exact serialised
    fields.

    - ``user`` / ``assistant``: what the API sees, after ``to_api`` merges records.
    - ``assistant`` also carries the API response ``message_id``, ``model`` and ``usage``;
      fragments of one streamed response share ``message_id``.
    - ``progress``: UI-only, dropped on the wire.
    - ``attachment``: context the agent adds (``content`` = the blocks it contributes); folded
      into the neighbouring user message on the wire. ``subtype=REMINDER``: rendered as
      Claude Code 2.1 renders its attachments (see :data:`REMINDER`).
    - ``system``: dropped on the wire, except ``subtype="local_command"`` which is sent as user
      text; ``subtype="compact_boundary"`` marks where a compacted conversation restarts.
    """

    type: MessageType
    content: Content = ""
    uuid: str = field(default_factory=new_uuid)
    message_id: str | None = None
    model: str | None = None
    usage: Usage | None = None
    stop_reason: str | None = None
    subtype: str | None = None
    timestamp: str | None = None
    is_compact_summary: bool = False
    is_sidechain: bool = False
    is_meta: bool = False

    def __post_init__(self) -> None:
        if self.type not in _MESSAGE_TYPES:
            raise ValueError(f"unknown message type {self.type!r}")

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def user(cls, content: Content, **kw: Any) -> Message:
        """A user record (prompt text, or tool_result blocks)."""
        return cls(type="user", content=content, **kw)

    @classmethod
    def assistant(
        cls,
        content: Content,
        *,
        message_id: str | None = None,
        usage: Usage | None = None,
        **kw: Any,
    ) -> Message:
        """An assistant record; ``message_id`` is the API response id (one per API call)."""
        return cls(type="assistant", content=content, message_id=message_id, usage=usage, **kw)

    @classmethod
    def from_param(cls, param: Mapping[str, Any], **kw: Any) -> Message:
        """A record of one SDK ``MessageParam`` (``{"role", "content"}``), content as it is;
        ``ValueError`` naming what is wrong with a param the API would refuse too."""
        if not (type(param) is dict or isinstance(param, Mapping)):
            raise ValueError("a message param must be an object")
        role, content = param.get("role"), param.get("content")
        if role not in ("user", "assistant"):
            raise ValueError("a message param's role must be 'user' or 'assistant'")
        if isinstance(content, list):
            for b in content:  # (a loop: every message of a new conversation is read here)
                if not isinstance(b, dict):
                    raise ValueError("a message param's content holds a non-block")
        elif not isinstance(content, str):
            raise ValueError("a message param's content must be a string or a list of blocks")
        return cls(type=role, content=content, **kw)

    @classmethod
    def from_response(cls, response: Any, **kw: Any) -> Message:
        """The assistant record of an SDK response (``anthropic.types.Message``): its blocks as
        param dicts, its id, model, stop reason and usage. It trusts the response; the agent
        loop checks one first (:func:`pipeline.agent.response.message_from_response`)."""
        usage = getattr(response, "usage", None)
        return cls.assistant(
            [b.model_dump(mode="json", exclude_none=True) for b in response.content],
            message_id=response.id,
            usage=Usage.from_mapping(usage.model_dump()) if usage is not None else None,
            model=response.model,
            stop_reason=response.stop_reason,
            **kw,
        )

    def with_content(self, content: Content) -> Message:
        """A copy with new content and every other field kept."""
        if type(self) is not Message:  # a subclass may have fields of its own
            return dataclasses.replace(self, content=content)
        # every field by position: half the cost of dataclasses.replace, which stages pay
        # for every record they rewrite
        values = list(_field_values(self))
        values[_CONTENT_AT] = content
        return Message(*values)

    # -- views --------------------------------------------------------------------------------
    @property
    def blocks(self) -> list[Block]:
        """Content as a block list (a string becomes one text block)."""
        if isinstance(self.content, str):
            return [{"type": "text", "text": self.content}] if self.content else []
        return self.content

    @property
    def is_synthetic(self) -> bool:
        """An assistant record that no real API response produced."""
        return self.type == "assistant" and self.model == SYNTHETIC_MODEL

    @property
    def restarts_thread(self) -> bool:
        """A compact boundary, or a compact summary: the API's view of the conversation starts
        over here (see :func:`thread_start`)."""
        return self.is_compact_boundary or (self.type == "user" and self.is_compact_summary)

    @property
    def is_wire_message(self) -> bool:
        """One whole message as a call sent it (see :data:`WIRE_MESSAGE`)."""
        return self.subtype == WIRE_MESSAGE and self.type in ("user", "assistant")

    @property
    def is_reminder(self) -> bool:
        """An attachment rendered the Claude Code 2.1 way (see :data:`REMINDER`)."""
        return self.type == "attachment" and self.subtype == REMINDER

    @property
    def is_compact_boundary(self) -> bool:
        """A system record after which the conversation restarts from a summary."""
        return self.type == "system" and self.subtype == "compact_boundary"


_FIELDS = dataclasses.fields(Message)  # all positional (tests/test_messages.py checks it)
_field_values = operator.attrgetter(*(f.name for f in _FIELDS))
_CONTENT_AT = [f.name for f in _FIELDS].index("content")


def thread_start(messages: Sequence[Message]) -> int:
    """Index of the first message the API sees: after the last compact boundary.

    Claude Code 2.x writes a ``compact_boundary`` system record and then the summary; 1.x
    started a new chain at a summary user record. Both mark the same restart.
    """
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.is_compact_boundary:
            return i + 1
        if m.type == "user" and m.is_compact_summary:
            return i
    return 0


COMPACTION_BLOCK = "compaction"
"""The content block the API returns when it compacted the context on the server: the API
reads a request from the last one on."""


def holds_compaction(m: Message) -> bool:
    """An assistant message holding a server compaction block with a summary (one without is
    a no-op to the API)."""
    content = m.content
    return (
        m.type == "assistant"
        and isinstance(content, list)
        and any(
            isinstance(b, dict) and b.get("type") == COMPACTION_BLOCK and b.get("content")
            for b in content
        )
    )


def context_start(messages: Sequence[Message]) -> int:
    """Index of the first message the API reads: :func:`thread_start`, or the last message
    holding a server compaction block after it (the API ignores what precedes the block)."""
    start = thread_start(messages)
    for i in range(len(messages) - 1, start - 1, -1):
        if holds_compaction(messages[i]):
            return i
    return start


def live_start(messages: Sequence[Message]) -> int:
    """Index of the first message a stage may remove or summarise: after the last compact
    boundary, and after the message holding the last server compaction block (what precedes
    it the API no longer reads; the block itself must stay)."""
    start = context_start(messages)
    if start < len(messages) and holds_compaction(messages[start]):
        return start + 1
    return start


def block_type(block: object) -> object:
    """A content item's ``type``; ``None`` for an item that is not a block dict (stages skip
    those; ``to_api`` refuses them)."""
    return block.get("type") if isinstance(block, dict) else None


def first_fragment(messages: Sequence[Message], last: int, start: int = 0) -> int:
    """Index of the first record of the response whose record sits at ``last``.

    Streaming writes one record per content block, all with the response's id, and
    tool_results may sit between them: walk back past records without an assistant id, over
    fragments of the same id, and stop at another response (or at ``start``).
    """
    mid = messages[last].message_id
    first = last
    if mid is None:
        return first
    for j in range(last - 1, start - 1, -1):
        prior = messages[j]
        prior_id = prior.message_id if prior.type == "assistant" else None
        if prior_id == mid:
            first = j
        elif prior_id is not None:
            break
    return first
