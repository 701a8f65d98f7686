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
- replace lone surrogates (which no UTF-8 request can carry): :func:`pipeline.encoding.encodable`.

:class:`WireCache` is the same for a conversation that changes between calls: it keeps the
wire entries of the last call and redoes only what follows the first changed record. The
result always equals ``to_api(messages)``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from pipeline.caching import param_breakpoints
from pipeline.encoding import encodable
from pipeline.incremental import InputLog
from pipeline.messages import Block, Message, thread_start
from pipeline.pairing import PairingError, PairingIndex

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic.types import MessageParam

__all__ = ["WireCache", "request_chars", "to_api", "wire_positions"]


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
        return [{"type": "text", "text": encodable(text)}] if text else list(encodable(m.blocks))
    return list(encodable(m.blocks))


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
        inner = block.get("content")
        folded = dict(block)  # the record's block is shared: never edit it
        if isinstance(inner, list):
            folded["content"] = [*inner, *({"type": "text", "text": t} for t in texts)]
        else:
            folded["content"] = (inner.rstrip() if isinstance(inner, str) else "") + "".join(
                "\n\n" + t for t in texts
            )
        return [*blocks[:i], folded, *blocks[i + 1 :]]
    return None


@dataclass(slots=True)
class _WireEntry:
    role: Literal["user", "assistant"]
    blocks: list[Block]
    raw_text: str | None  # a lone user string stays a string, as the agent wrote it
    message_id: str | None = None
    merged: bool = False
    closed: bool = False
    """A recorded whole message: nothing merges into it."""
    lead: list[Block] | None = None
    """Reminders that go before the prompt's blocks (Claude Code 2.1 moves its attachments
    above the prompt they came with)."""


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

    __slots__ = ("_barriers", "_ids", "barrier", "entries", "latest")

    def __init__(self) -> None:
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
        entry it went into, -1 when the wire drops it."""
        if m.type == "progress":
            return -1
        if m.type == "system" and m.subtype != "local_command":
            return -1
        _check_blocks(m)
        if m.type == "assistant":
            return self.add_assistant(m)
        # user, attachment, local_command: all become user content
        blocks = _user_blocks(m)
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
        entry = _WireEntry("assistant", list(encodable(m.blocks)), raw, m.message_id, closed=closed)
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


class WireCache:
    """``to_api`` for one conversation across calls, at the cost of what changed.

    :attr:`chars` is ``request_chars`` of the last request and :attr:`pairing` its
    :func:`~pipeline.pairing.check_pairing`, both kept up to date the same way.

    A call finds the first record that differs from the last call's input (one C-level
    identity sweep), rolls the wire entries back to the first one a changed record went into,
    and feeds the records from there: a history that only grew costs its new records, an edit
    (a stage clearing old results, say) what follows it. A changed or new compact boundary
    starts over.

    The messages of a returned request are shared with the cache and with the next requests,
    except the last ``editable`` ones (default 2), which are new dicts with new content lists:
    a caller may edit those (say, add a ``cache_control`` breakpoint by replacing a block) but
    must not mutate the earlier ones. Block dicts are shared with the records, as with
    ``to_api``: never mutate those. (Copying every message on every call made a long session's
    requests quadratic, and kept the garbage collector busy with the copies.)
    """

    def __init__(self, *, editable: int = 2) -> None:
        self.editable = editable
        self._log = InputLog()
        self._reset(0)
        self._fresh = True

    def to_api(self, messages: Sequence[Message]) -> list[MessageParam]:
        """Exactly ``to_api(messages)`` (and raises where it raises)."""
        try:
            self._extend(messages)
        except BaseException:
            # a record to_api rejects (or a cancellation) midway: start over next time
            self._log.clear()
            self._fresh = True
            raise
        params, k = self._params, self.editable
        if len(params) <= k:
            return [_fresh(p) for p in params]
        if not k:
            return list(params)
        # one slice, extended in place: unpacking a slice copies it twice (a cost that grows
        # with the history, paid on every call)
        out = params[:-k]
        out.extend(map(_fresh, params[-k:]))
        return out

    @property
    def tool_use_ids(self) -> AbstractSet[str]:
        """The tool_use ids of the last request (a live view)."""
        return self.pairing.tool_use_ids

    def ensure_paired(self) -> None:
        """Raise :class:`~pipeline.pairing.PairingError` naming every offending id if the last
        request's tool pairing is broken (``ensure_paired`` at the cost of what changed)."""
        if self.pairing.count:
            raise PairingError(self.pairing.problems)

    def _reset(self, start: int) -> None:
        self._wire = _Wire()
        self._start = start
        """Index of the first record the wire holds (after the last compact boundary)."""
        self._entry_of = array("q")
        """Per record from ``_start``: the entry it went into (-1: dropped)."""
        self._first_record = array("q")
        """Per entry: the index of the record that created it."""
        self._params: list[MessageParam] = []
        self._chars: list[int] = []
        self.chars = 0
        self._breakpoints: list[int] = []
        self.breakpoints = 0
        """Blocks of the last request that carry ``cache_control`` (the API allows four)."""
        """Characters of visible text in the last request (see :func:`request_chars`)."""
        self.pairing = PairingIndex()
        """The pairing problems of the last request (see :meth:`ensure_paired`)."""

    def _extend(self, messages: Sequence[Message]) -> None:
        n_old = len(self._log.inputs)
        first = self._log.take(messages)
        if first == n_old == len(messages) and not self._fresh:
            return  # the very same records
        restart = any(m.restarts_thread for m in messages[first:])
        # a change at the thread's first record (a summary, say) may move where it starts
        if self._fresh or restart or first <= self._start:
            self._fresh = False
            self._reset(thread_start(messages))
            self._feed(messages, self._start, 0)
            return
        entries = len(self._wire.entries)
        rollback, r0 = self._rollback(first)
        if rollback < entries:
            self._wire.truncate(rollback)
            del self._first_record[rollback:]
        del self._entry_of[r0 - self._start :]
        self._feed(messages, r0, min(rollback, entries))

    def _rollback(self, first: int) -> tuple[int, int]:
        """The first entry a record from ``first`` on went into, and the record to feed from:
        re-feeding starts at the record that created that entry (or at ``first``, if that comes
        sooner), so the first entry any record from there went into, and so on."""
        entry_of, start, first_record = self._entry_of, self._start, self._first_record
        r0, e = first, len(self._wire.entries)
        while True:
            low = min((x for x in entry_of[r0 - start :] if x >= 0), default=e)
            if low >= e:
                return e, r0
            e = low
            r0 = min(r0, first_record[e])

    def _feed(self, messages: Sequence[Message], r0: int, keep: int) -> None:
        """Add the records from ``r0`` on; refresh the params from entry ``keep`` and from the
        first entry a new record went into, whichever comes first."""
        wire, entry_of, first_record = self._wire, self._entry_of, self._first_record
        before = len(wire.entries)
        low = before
        for idx in range(r0, len(messages)):
            went = wire.add(messages[idx])
            entry_of.append(went)
            if went >= 0:
                low = min(low, went)
                if went == len(first_record):
                    first_record.append(idx)
        keep = min(keep, low, before)
        fresh = [_entry_to_param(e) for e in wire.entries[keep:]]
        del self._params[keep:]
        self._params += fresh
        self.chars -= sum(self._chars[keep:])
        del self._chars[keep:]
        counted = [_param_chars(p) for p in fresh]
        self._chars += counted
        self.chars += sum(counted)
        self.breakpoints -= sum(self._breakpoints[keep:])
        del self._breakpoints[keep:]
        marked = [param_breakpoints(p) for p in fresh]
        self._breakpoints += marked
        self.breakpoints += sum(marked)
        self.pairing.update(self._params, keep)


def _block_chars(block: Any) -> int:
    if not isinstance(block, dict):
        return 0
    btype = block.get("type")
    if btype == "text":
        return len(str(block.get("text") or ""))
    if btype == "thinking":
        return len(str(block.get("thinking") or ""))
    if btype == "tool_use":
        return len(str(block.get("name") or "")) + len(repr(block.get("input")))
    if btype == "tool_result":
        content = block.get("content")
        if isinstance(content, str):
            return len(content)
        if isinstance(content, list):
            return sum(_block_chars(b) for b in content)
    return 0


def request_chars(request: Sequence[MessageParam]) -> int:
    """Characters of text, thinking, tool input and tool output in a request (images: 0)."""
    return sum(map(_param_chars, request))


def _fresh(param: MessageParam) -> MessageParam:
    """A new message dict with a new content list (the blocks themselves are shared)."""
    content: Any = param["content"]
    fresh = {"role": param["role"], "content": content if isinstance(content, str) else [*content]}
    return cast("MessageParam", fresh)


def _param_chars(param: MessageParam) -> int:
    content: Any = param["content"]
    if isinstance(content, str):
        return len(content)
    return sum(_block_chars(b) for b in content)
