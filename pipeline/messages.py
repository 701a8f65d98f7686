"""The message model, wire normalisation (`to_api`) and the tool pairing check.

A :class:`Message` is one record of an agent's conversation as the agent keeps it (Claude Code
keeps one record per streamed content block, interleaved with progress and system records). The
Messages API sees something else: :func:`to_api` turns the records into the list of
``MessageParam`` dicts that ``client.messages.create(messages=...)`` accepts (SPEC §6).
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import uuid as _uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, cast

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic.types import MessageParam


__all__ = [
    "Block",
    "Content",
    "Message",
    "MessageType",
    "PairingError",
    "PairingProblem",
    "Usage",
    "check_pairing",
    "ensure_paired",
    "new_uuid",
    "now_timestamp",
    "thread_start",
    "to_api",
]

MessageType = Literal["user", "assistant", "progress", "attachment", "system"]
Block = dict[str, Any]
"""One content block: an anthropic block param dict (``{"type": "text", "text": ...}``...)."""
Content = str | list[Block]

_MESSAGE_TYPES: frozenset[str] = frozenset(
    ("user", "assistant", "progress", "attachment", "system")
)
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
        """Tokens the context holds after the response (SPEC §4): input side + output."""
        return self.input_side + self.output_tokens

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> Usage:
        """Build from an API ``usage`` object; missing or null counts are 0, bad types rejected."""
        values: dict[str, Any] = {name: raw.get(name) for name in _USAGE_FIELDS}
        return cls(**{name: value for name, value in values.items() if value is not None})

    def to_mapping(self) -> dict[str, int]:
        """The API's ``usage`` shape."""
        return dataclasses.asdict(self)


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


_DISTINCT_COMPARISONS = [0]


def distinct_comparisons() -> int:
    """How many times two distinct :class:`Message` objects have been compared for equality.

    ``list == list`` never calls ``__eq__`` on an identical pair, so an unchanged count across a
    list comparison that came out equal proves every position held the very same object: a
    C-level sweep instead of an identity check per element. (Comparisons in other threads can
    only make the count move, never hide one.)
    """
    return _DISTINCT_COMPARISONS[0]


def new_uuid() -> str:
    """A fresh random record uuid."""
    return str(_uuid.uuid4())


def stable_uuid(namespace: _uuid.UUID, name: str) -> str:
    """``uuid5(namespace, name)``, also for a name holding lone surrogates (text read from
    invalid UTF-8), which ``uuid.uuid5`` refuses to encode."""
    digest = hashlib.sha1(namespace.bytes + name.encode("utf-8", "surrogatepass")).digest()
    return str(_uuid.UUID(bytes=digest[:16], version=5))


@dataclass(frozen=True, slots=True)
class Message:
    """One conversation record.

    Immutable by convention: stages never mutate a message or its content, they build a new one
    with :meth:`with_content` (untouched messages pass through by reference). ``content`` holds
    anthropic block param dicts (or a plain string, as the API allows for user text).

    - ``user`` / ``assistant``: what the API sees, after :func:`to_api` merges records.
    - ``assistant`` also carries the API response ``message_id``, ``model`` and ``usage``;
      fragments of one streamed response share ``message_id``.
    - ``progress``: UI-only, dropped on the wire.
    - ``attachment``: context the agent adds (``content`` = the blocks it contributes); folded
      into the neighbouring user message on the wire.
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

    def __eq__(self, other: object) -> bool:
        # what the dataclass would generate, plus a count (see distinct_comparisons)
        if other.__class__ is not self.__class__:
            return NotImplemented
        _DISTINCT_COMPARISONS[0] += 1
        return bool(_fields(self) == _fields(other))

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

    def with_content(self, content: Content) -> Message:
        """A copy with new content and every other field kept."""
        return dataclasses.replace(self, content=content)

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
    def is_compact_boundary(self) -> bool:
        """A system record after which the conversation restarts from a summary."""
        return self.type == "system" and self.subtype == "compact_boundary"


_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(Message)))
"""Every field of a message, as a tuple (what equality compares)."""


# --------------------------------------------------------------------------------------------
# Wire normalisation
# --------------------------------------------------------------------------------------------


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


def block_type(block: object) -> object:
    """A content item's ``type``; ``None`` for an item that is not a block dict (stages skip
    those; ``to_api`` refuses them)."""
    return block.get("type") if isinstance(block, dict) else None


def _check_blocks(m: Message) -> None:
    if isinstance(m.content, list):
        for i, b in enumerate(m.content):
            if not isinstance(b, dict):
                raise ValueError(
                    f"record {m.uuid!r}: content item {i} is a {type(b).__name__}, "
                    "not a content block (dict)"
                )


def _user_blocks(m: Message) -> list[Block]:
    if m.type == "system":  # local_command output is shown to the model as user text
        text = m.content if isinstance(m.content, str) else ""
        return [{"type": "text", "text": text}] if text else list(m.blocks)
    return list(m.blocks)


def _hoist_tool_results(blocks: list[Block]) -> list[Block]:
    """tool_result blocks first (stable), then everything else in order.

    The API requires a user message's tool_results to precede its other blocks.
    """
    results = [b for b in blocks if b.get("type") == "tool_result"]
    if not results or len(results) == len(blocks):
        return blocks
    return results + [b for b in blocks if b.get("type") != "tool_result"]


def _join_at_seam(a: list[Block], b: list[Block]) -> list[Block]:
    """Concatenate two user block lists; a text/text seam gets a newline so the words don't fuse."""
    if a and b and a[-1].get("type") == "text" and b[0].get("type") == "text":
        last = dict(a[-1])
        last["text"] = str(last.get("text", "")) + "\n"
        return [*a[:-1], last, *b]
    return [*a, *b]


def _is_tool_result_only(entry: _WireEntry) -> bool:
    return (
        entry.role == "user"
        and bool(entry.blocks)
        and all(b.get("type") == "tool_result" for b in entry.blocks)
    )


@dataclass(slots=True)
class _WireEntry:
    role: Literal["user", "assistant"]
    blocks: list[Block]
    raw_text: str | None  # a lone user string stays a string, as the agent wrote it
    message_id: str | None = None
    merged: bool = False


def to_api(messages: Sequence[Message]) -> list[MessageParam]:
    """Normalise conversation records into the ``messages`` array of an API request (SPEC §6).

    - slice at the last compact boundary;
    - drop progress and system records (``local_command`` output is kept as user text);
    - fold attachments into the neighbouring user message;
    - merge consecutive user messages (tool_result blocks hoisted first, ``\\n`` at a text seam);
    - merge assistant fragments sharing a response id, also when other ids interleave: a
      fragment walks back past other-id assistants and tool_result-only user messages.

    The input is not modified; the output shares block dicts with it (do not mutate them).
    """
    wire = _Wire()
    for m in messages[thread_start(messages) :]:
        wire.add(m)
    return [_entry_to_param(e) for e in wire.entries]


class _Wire:
    """The wire entries being built, indexed so that a fragment finds its response in O(1).

    A fragment walks back from the end past other-id assistant entries and tool_result-only
    user entries, and merges into the first entry of its own id it meets. Walking costs the
    length of the history for every response once prompts are rare (an agent's tool loop is
    one long run of exactly those entries), which made ``to_api`` quadratic. The same answer in
    O(1): the walk reaches the latest entry of the fragment's id unless a user entry that is
    not tool_result-only (a barrier) lies after it. Only the last entry ever changes (user
    records merge into ``entries[-1]``; fragments only into assistant entries), so whether an
    earlier entry is a barrier is settled when the next entry is appended.
    """

    __slots__ = ("barrier", "entries", "latest")

    def __init__(self) -> None:
        self.entries: list[_WireEntry] = []
        self.latest: dict[str, int] = {}
        """response id -> index of the latest assistant entry of that id."""
        self.barrier = -1
        """Index of the last barrier among the entries before ``entries[-1]``."""

    def append(self, entry: _WireEntry) -> None:
        out = self.entries
        if out and out[-1].role == "user" and not _is_tool_result_only(out[-1]):
            self.barrier = len(out) - 1
        if entry.role == "assistant" and entry.message_id is not None:
            self.latest[entry.message_id] = len(out)
        out.append(entry)

    def add(self, m: Message) -> None:
        """Take the next record (after the last compact boundary)."""
        if m.type == "progress":
            return
        if m.type == "system" and m.subtype != "local_command":
            return
        _check_blocks(m)
        if m.type == "assistant":
            self.add_assistant(m)
            return
        # user, attachment, local_command: all become user content
        blocks = _user_blocks(m)
        if not blocks:  # the API rejects empty content; an empty record adds nothing
            return
        out = self.entries
        if out and out[-1].role == "user":
            prev = out[-1]
            prev.blocks = _hoist_tool_results(_join_at_seam(prev.blocks, blocks))
            prev.raw_text = None
            prev.merged = True
        else:
            raw = m.content if isinstance(m.content, str) and m.type == "user" else None
            self.append(_WireEntry("user", _hoist_tool_results(blocks), raw))

    def add_assistant(self, m: Message) -> None:
        if m.message_id is not None:
            i = self.latest.get(m.message_id)
            if i is not None:
                out = self.entries
                last = out[-1]
                blocked = self.barrier > i or (
                    last.role == "user" and len(out) - 1 > i and not _is_tool_result_only(last)
                )
                if not blocked:
                    entry = out[i]
                    entry.blocks = [*entry.blocks, *m.blocks]
                    entry.merged = True
                    return
        self.append(_WireEntry("assistant", list(m.blocks), None, m.message_id))


def _entry_to_param(e: _WireEntry) -> MessageParam:
    if e.raw_text is not None and not e.merged:
        return cast("MessageParam", {"role": e.role, "content": e.raw_text})
    return cast("MessageParam", {"role": e.role, "content": e.blocks})


# --------------------------------------------------------------------------------------------
# Pairing check
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PairingProblem:
    """One broken tool pairing in a request: which id, where, and what is wrong."""

    kind: Literal[
        "unanswered_tool_use", "orphan_tool_result", "duplicate_tool_result", "duplicate_tool_use"
    ]
    tool_use_id: str
    index: int  # index of the wire message that holds the offending block

    def __str__(self) -> str:
        return f"{self.kind} {self.tool_use_id!r} at message {self.index}"


class PairingError(ValueError):
    """A request the Messages API would reject for broken tool_use/tool_result pairing."""

    def __init__(self, problems: Sequence[PairingProblem]) -> None:
        self.problems = list(problems)
        shown = "; ".join(str(p) for p in self.problems[:10])
        more = f" (+{len(self.problems) - 10} more)" if len(self.problems) > 10 else ""
        super().__init__(f"broken tool pairing: {shown}{more}")


def _param_blocks(param: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    content = param.get("content")
    if isinstance(content, list):
        return [b for b in content if isinstance(b, Mapping)]
    return []


def check_pairing(request: Iterable[Mapping[str, Any]]) -> list[PairingProblem]:
    """Every tool_use answered by exactly one tool_result in the next user message, no orphans.

    Returns the problems found (empty when the request is valid).
    """
    params = list(request)
    problems: list[PairingProblem] = []
    seen_uses: set[str] = set()
    for i, param in enumerate(params):
        blocks = _param_blocks(param)
        if param.get("role") == "assistant":
            uses: list[str] = []
            for b in blocks:
                if b.get("type") == "tool_use":
                    uid = str(b.get("id"))
                    if uid in seen_uses:
                        problems.append(PairingProblem("duplicate_tool_use", uid, i))
                    seen_uses.add(uid)
                    uses.append(uid)
            if not uses:
                continue
            nxt = params[i + 1] if i + 1 < len(params) else None
            answered: dict[str, int] = {}
            if nxt is not None and nxt.get("role") == "user":
                for b in _param_blocks(nxt):
                    if b.get("type") == "tool_result":
                        tid = str(b.get("tool_use_id"))
                        answered[tid] = answered.get(tid, 0) + 1
            for uid in uses:
                if answered.get(uid, 0) == 0:
                    problems.append(PairingProblem("unanswered_tool_use", uid, i))
        elif param.get("role") == "user":
            prev = params[i - 1] if i > 0 else None
            prev_uses = (
                {
                    str(b.get("id"))
                    for b in (_param_blocks(prev) if prev is not None else [])
                    if b.get("type") == "tool_use"
                }
                if prev is not None and prev.get("role") == "assistant"
                else set()
            )
            counts: dict[str, int] = {}
            for b in blocks:
                if b.get("type") == "tool_result":
                    tid = str(b.get("tool_use_id"))
                    counts[tid] = counts.get(tid, 0) + 1
                    if tid not in prev_uses:
                        problems.append(PairingProblem("orphan_tool_result", tid, i))
                    elif counts[tid] == 2:
                        problems.append(PairingProblem("duplicate_tool_result", tid, i))
    return problems


def ensure_paired(request: Iterable[Mapping[str, Any]]) -> None:
    """Raise :class:`PairingError` naming every offending id if the pairing is broken."""
    problems = check_pairing(request)
    if problems:
        raise PairingError(problems)
