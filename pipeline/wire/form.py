"""Wire form: the ``messages`` array of an API request, built from conversation records.

:func:`to_api` normalises the records a conversation keeps (one per streamed block, interleaved
with progress and system records) into the ``MessageParam`` dicts that
``client.messages.create(messages=...)`` accepts:

- slice at the last compact boundary;
- drop progress and system records (``local_command`` output is kept as user text);
- fold attachments into the neighbouring user message; a Claude Code 2.1 reminder
  (:data:`~pipeline.messages.REMINDER`) goes before the prompt it came with, or into the content
  of the tool result it follows (:func:`_fold_reminder`);
- merge consecutive user messages (tool_result blocks hoisted first, ``\\n`` at a text seam);
- merge assistant fragments sharing a response id, also when other ids interleave;
- replace lone surrogates (which no UTF-8 request can carry):
:func:`pipeline.wire.encoding.encodable`.

:class:`~pipeline.wire.cache.WireCache` is the same for a conversation that changes between
calls: it keeps the wire entries of the last call and redoes only what follows the first
changed record. The result always equals ``to_api(messages)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, cast

from pipeline.messages import Block, Message, thread_start
from pipeline.wire.deferred import resolved
from pipeline.wire.encoding import encodable

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic.types import MessageParam

__all__ = ["to_api", "wire_positions"]


def _check_blocks(m: Message) -> None:
    if isinstance(m.content, list):
        for i, b in enumerate(m.content):
            if not isinstance(b, dict):
                raise ValueError(
                    f"record {m.uuid!r}: content item {i} is a {type(b).__name__}, "
                    "not a content block (dict)"
                )


def _blocks(m: Message, share: bool) -> list[Block]:
    """``m``'s blocks for the wire: its own content list itself where ``share`` allows (the
    entries never change a list in place), else a copy."""
    blocks: list[Block] = encodable(m.blocks)
    return blocks if share and blocks is m.content else list(blocks)


def _user_blocks(m: Message, share: bool) -> list[Block]:
    if m.type == "system":  # local_command output is shown to the model as user text
        text = m.content if isinstance(m.content, str) else ""
        return [{"type": "text", "text": encodable(text)}] if text else _blocks(m, share)
    return _blocks(m, share)


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
        and not entry.lead
        and bool(entry.blocks)
        and all(b.get("type") == "tool_result" for b in entry.blocks)
    )


def _fold_reminder(blocks: list[Block], texts: list[str]) -> list[Block] | None:
    """``blocks`` with reminder ``texts`` added to the content of its last tool_result, as
    Claude Code 2.1 sends a reminder that follows tool results: a string content loses its
    trailing whitespace and gets ``"\\n\\n" + text`` per reminder, a list content one text
    block per reminder. None when
    ``blocks`` holds no tool_result (the reminder then goes before the prompt)."""
    for i in range(len(blocks) - 1, -1, -1):
        block = blocks[i]
        if block.get("type") != "tool_result":
            continue
        inner = resolved(block.get("content"))  # (an output held out of memory: its text)
        folded = dict(block)  # the record's block is shared: never edit it
        if isinstance(inner, list):
            folded["content"] = [*inner, *({"type": "text", "text": t} for t in texts)]
        else:
            folded["content"] = (inner.rstrip() if isinstance(inner, str) else "") + "".join(
                "\n\n" + t for t in texts
            )
        return [*blocks[:i], folded, *blocks[i + 1 :]]
    return None


_MERGED, _CLOSED = 1, 2


class _WireEntry:
    """One message of the wire form, and how it was made. ``lead``: reminders that go before
    the prompt's blocks (Claude Code 2.1 moves its attachments above the prompt they came
    with). Its two flags share one slot: an entry is kept for every message of a
    conversation held, and six slots make an object of 80 bytes where seven make one of 96."""

    __slots__ = ("_flags", "blocks", "lead", "message_id", "raw_text", "role")

    def __init__(
        self,
        role: Literal["user", "assistant"],
        blocks: list[Block],
        raw_text: str | None,  # a lone user string stays a string, as the agent wrote it
        message_id: str | None = None,
        *,
        merged: bool = False,
        closed: bool = False,
        lead: list[Block] | None = None,
    ) -> None:
        self.role = role
        self.blocks = blocks
        self.raw_text = raw_text
        self.message_id = message_id
        self.lead = lead
        self._flags = (_MERGED if merged else 0) | (_CLOSED if closed else 0)

    @property
    def merged(self) -> bool:
        """Made of more than one record, or changed after it was made."""
        return bool(self._flags & _MERGED)

    @merged.setter
    def merged(self, value: bool) -> None:
        self._flags = self._flags | _MERGED if value else self._flags & ~_MERGED

    @property
    def closed(self) -> bool:
        """A recorded whole message: nothing merges into it."""
        return bool(self._flags & _CLOSED)


def to_api(messages: Sequence[Message]) -> list[MessageParam]:
    """Normalise conversation records into the ``messages`` array of an API request.

    - slice at the last compact boundary;
    - drop progress and system records (``local_command`` output is kept as user text);
    - fold attachments into the neighbouring user message; a Claude Code 2.1 reminder
      (:data:`~pipeline.messages.REMINDER`) goes before the prompt it came with, or into the
      content of the tool result it follows;
    - merge consecutive user messages (tool_result blocks hoisted first, ``\\n`` at a text seam);
    - merge assistant fragments sharing a response id, also when other ids interleave: a
      fragment walks back past other-id assistants and tool_result-only user messages;
    - replace lone surrogates with U+FFFD (:func:`encodable`), so the request always encodes.

    The input is not modified; the output shares block dicts with it (do not mutate them).
    """
    wire = _Wire()
    for m in messages[thread_start(messages) :]:
        wire.add(m)
    return [_entry_to_param(e) for e in wire.entries]


def wire_positions(messages: Sequence[Message]) -> list[int]:
    """Per record: the index of the ``to_api`` message it goes into, -1 when the wire drops it
    (before the last compact boundary, progress and system records, empty content)."""
    start = thread_start(messages)
    wire = _Wire()
    return [-1] * start + [wire.add(m) for m in messages[start:]]


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

    __slots__ = ("_barriers", "_ids", "barrier", "entries", "latest", "share")

    def __init__(self, *, share: bool = False) -> None:
        self.share = share
        """An entry of one record holds the record's own content list (``WireCache``, whose
        requests' messages but the last are read-only), not a copy (``to_api``'s output may
        be changed by its caller: a list a message, 60-90 bytes, would be held twice)."""
        self.entries: list[_WireEntry] = []
        self.latest: dict[str, int] = {}
        """response id -> index of the latest assistant entry of that id."""
        self._ids: dict[str, list[int]] = {}
        """response id -> indices of every assistant entry of that id, for the ids that have
        more than one (a truncation falls back to the one before)."""
        self.barrier = -1
        """Index of the last barrier among the entries before ``entries[-1]``."""
        self._barriers: list[int] = []
        """Every such barrier, ascending (what ``barrier`` falls back to on a truncation)."""

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` entries, as they stood when entry ``n`` was appended (the caller
        guarantees no later record changed them). Costs the entries removed."""
        out = self.entries
        n = max(0, min(n, len(out)))
        for idx in range(len(out) - 1, n - 1, -1):
            e = out[idx]
            if e.role == "assistant" and e.message_id is not None and not e.closed:
                seen = self._ids.get(e.message_id)
                if seen is None:
                    del self.latest[e.message_id]
                    continue
                seen.pop()  # appended in order: the last is this one
                self.latest[e.message_id] = seen[-1]
                if len(seen) == 1:
                    del self._ids[e.message_id]
        del out[n:]
        barriers = self._barriers
        while barriers and barriers[-1] >= n - 1:
            barriers.pop()  # entries[n - 1] is the last one again: not settled
        self.barrier = barriers[-1] if barriers else -1

    def append(self, entry: _WireEntry) -> None:
        out = self.entries
        if out and out[-1].role == "user" and not _is_tool_result_only(out[-1]):
            self.barrier = len(out) - 1
            self._barriers.append(self.barrier)
        if entry.role == "assistant" and entry.message_id is not None and not entry.closed:
            before = self.latest.get(entry.message_id)
            if before is not None:
                self._ids.setdefault(entry.message_id, [before]).append(len(out))
            self.latest[entry.message_id] = len(out)
        out.append(entry)

    def add(self, m: Message) -> int:
        """Take the next record (after the last compact boundary); return the index of the
        entry it went into, -1 when the wire drops it. Where a record goes depends on its type,
        subtype, response id and its blocks' types alone (``WireCache`` relies on it to rebuild
        a message in place: keep ``pipeline.wire.entry_patch.same_place`` in step)."""
        if m.type == "progress":
            return -1
        if m.type == "system" and m.subtype != "local_command":
            return -1
        _check_blocks(m)
        if m.type == "assistant":
            return self.add_assistant(m)
        # user, attachment, local_command: all become user content
        blocks = _user_blocks(m, self.share)
        if not blocks:  # the API rejects empty content; an empty record adds nothing
            return -1
        if m.is_reminder:
            return self.add_reminder(blocks)
        out = self.entries
        if m.is_wire_message:
            self.append(
                _WireEntry(
                    "user",
                    blocks,
                    encodable(m.content) if isinstance(m.content, str) else None,
                    closed=True,
                )
            )
            return len(out) - 1
        if out and out[-1].role == "user" and not out[-1].closed:
            prev = out[-1]
            prev.blocks = _hoist_tool_results(_join_at_seam(prev.blocks, blocks))
            prev.raw_text = None
            prev.merged = True
        else:
            raw = encodable(m.content) if isinstance(m.content, str) and m.type == "user" else None
            self.append(_WireEntry("user", _hoist_tool_results(blocks), raw))
        return len(out) - 1

    def add_reminder(self, blocks: list[Block]) -> int:
        """A Claude Code 2.1 reminder: into the content of the last tool result of the user
        message it follows, else before that message's prompt (a user message of its own
        until the prompt comes)."""
        out = self.entries
        if out and out[-1].role == "user" and not out[-1].closed:
            prev = out[-1]
            texts = [str(b.get("text", "")) for b in blocks if b.get("type") == "text"]
            folded = _fold_reminder(prev.blocks, texts) if len(texts) == len(blocks) else None
            if folded is not None:
                prev.blocks = folded
            else:
                prev.lead = [*(prev.lead or ()), *blocks]
            prev.raw_text = None
            prev.merged = True
        else:
            self.append(_WireEntry("user", [], None, lead=blocks, merged=True))
        return len(out) - 1

    def add_assistant(self, m: Message) -> int:
        if m.message_id is not None and not m.is_wire_message:
            i = self.latest.get(m.message_id)
            if i is not None:
                out = self.entries
                last = out[-1]
                blocked = self.barrier > i or (
                    last.role == "user" and len(out) - 1 > i and not _is_tool_result_only(last)
                )
                if not blocked:
                    entry = out[i]
                    entry.blocks = [*entry.blocks, *encodable(m.blocks)]
                    entry.merged = True
                    return i
        closed = m.is_wire_message
        raw = encodable(m.content) if closed and isinstance(m.content, str) else None
        entry = _WireEntry("assistant", _blocks(m, self.share), raw, m.message_id, closed=closed)
        self.append(entry)
        return len(self.entries) - 1


def _entry_to_param(e: _WireEntry) -> MessageParam:
    if e.raw_text is not None and not e.merged:
        return cast("MessageParam", {"role": e.role, "content": e.raw_text})
    if e.lead:
        return cast("MessageParam", {"role": e.role, "content": _with_lead(e.lead, e.blocks)})
    return cast("MessageParam", {"role": e.role, "content": e.blocks})


def _with_lead(lead: list[Block], blocks: list[Block]) -> list[Block]:
    """The reminders, then the prompt's blocks, a ``\\n`` at a text seam (tool results first,
    should a tool result ever follow a reminder)."""
    return _hoist_tool_results(_join_at_seam(lead, blocks))
