"""Wire form: the ``messages`` array of an API request, built from conversation records.

:func:`to_api` normalises the records a conversation keeps (one per streamed block, interleaved
with progress and system records) into the ``MessageParam`` dicts that
``client.messages.create(messages=...)`` accepts:

- slice at the last compact boundary;
- drop progress and system records (``local_command`` output is kept as user text);
- fold attachments into the neighbouring user message;
- merge consecutive user messages (tool_result blocks hoisted first, ``\\n`` at a text seam);
- merge assistant fragments sharing a response id, also when other ids interleave.

:class:`WireCache` is the same for a conversation that grows between calls: it keeps the wire
entries of the last call and, when the history only grew by records that reach nothing older
(:class:`pipeline.incremental.AppendWatch`), feeds just the new records -- only the last entry
of the previous request can change (consecutive user records merge into it). Anything else (an
edit, a late fragment of an older response, a compact boundary) rebuilds from scratch. The
result always equals ``to_api(messages)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from pipeline.incremental import AppendWatch
from pipeline.messages import Block, Message, thread_start
from pipeline.pairing import PairingError, PairingIndex

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic.types import MessageParam

__all__ = ["WireCache", "request_chars", "to_api"]


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
    """Normalise conversation records into the ``messages`` array of an API request.

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


class WireCache:
    """``to_api`` for one conversation across calls, at the cost of what changed.

    :attr:`chars` is ``request_chars`` of the last request and :attr:`pairing` its
    :func:`~pipeline.pairing.check_pairing`, both kept up to date the same way.

    The messages of a returned request are shared with the cache and with the next requests,
    except the last ``editable`` ones (default 2), which are new dicts with new content lists:
    a caller may edit those (say, add a ``cache_control`` breakpoint by replacing a block) but
    must not mutate the earlier ones. Block dicts are shared with the records, as with
    ``to_api``: never mutate those. (Copying every message on every call made a long session's
    requests quadratic, and kept the garbage collector busy with the copies.)
    """

    def __init__(self, *, editable: int = 2) -> None:
        self.editable = editable
        self._watch = AppendWatch()
        self._wire = _Wire()
        self._params: list[MessageParam] = []
        self._chars: list[int] = []
        self.chars = 0
        """Characters of visible text in the last request (see :func:`request_chars`)."""
        self.pairing = PairingIndex()
        """The pairing problems of the last request (see :meth:`ensure_paired`)."""

    def to_api(self, messages: Sequence[Message]) -> list[MessageParam]:
        """Exactly ``to_api(messages)`` (and raises where it raises)."""
        try:
            self._extend(messages)
        except BaseException:
            # a record to_api rejects (or a cancellation) midway: start over next time
            self._watch.invalidate()
            self._reset()
            raise
        params, k = self._params, self.editable
        if len(params) <= k:
            return [_fresh(p) for p in params]
        return [*params[:-k], *map(_fresh, params[-k:])] if k else list(params)

    def ensure_paired(self) -> None:
        """Raise :class:`~pipeline.pairing.PairingError` naming every offending id if the last
        request's tool pairing is broken (``ensure_paired`` at the cost of what changed)."""
        if self.pairing.count:
            raise PairingError(self.pairing.problems)

    def _reset(self) -> None:
        self._wire, self._params, self._chars, self.chars = _Wire(), [], [], 0
        self.pairing = PairingIndex()

    def _extend(self, messages: Sequence[Message]) -> None:
        grown = self._watch.advance(messages)
        if grown is None:
            self._reset()
            tail = messages[self._watch.start :]
        else:
            tail = messages[grown:]
        wire = self._wire
        keep = max(0, len(wire.entries) - 1)  # the last entry may take the new records
        for m in tail:
            wire.add(m)
        fresh = [_entry_to_param(e) for e in wire.entries[keep:]]
        del self._params[keep:]
        self._params += fresh
        self.chars -= sum(self._chars[keep:])
        del self._chars[keep:]
        counted = [_param_chars(p) for p in fresh]
        self._chars += counted
        self.chars += sum(counted)
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
