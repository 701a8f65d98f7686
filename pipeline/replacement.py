"""The ledger of what the model has seen: ``ReplacementState`` and its records.

Once a tool_result has been sent whole, changing it later would change the cached prompt prefix;
once it has been replaced, the same replacement string must be sent forever after. The state
remembers both, and the records written to the transcript let a resumed session rebuild it.

A decision is bound to what it decided on: the ledger's key for a result is its
``tool_use_id`` *and* a digest of its output (:func:`result_key`), so a decision is re-applied
only to the content it was made from. A result that reuses an id with other content -- a
client's own ids repeated, a conversation mistaken for another -- is a new result, decided on
its own, never sent another result's replacement.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol, Self

from pipeline.messages import Block, Message, thread_start
from pipeline.tokens.checks import bounded_repr
from pipeline.wire.canonical import canonical_json
from pipeline.wire.harness import last_result_index, split_tail

__all__ = [
    "DECIDED_RECORD_STAGE",
    "MAX_REPLACEMENT_CHARS",
    "PERSISTED_OUTPUT_TAG",
    "ReplacementRecord",
    "ReplacementState",
    "ResultSlot",
    "answered_results",
    "candidate_size",
    "content_digest",
    "is_candidate",
    "is_candidate_content",
    "is_replacement_text",
    "iter_tool_results",
    "read_results",
    "result_key",
    "tool_use_id_of",
]

PERSISTED_OUTPUT_TAG = "<persisted-output>"
PERSISTED_OUTPUT_CLOSING_TAG = "</persisted-output>"

#: The longest text a genuine replacement can be: a 2,000-char preview, a path of up to 4,096
#: chars (PATH_MAX) and the frame around them.
MAX_REPLACEMENT_CHARS = 2_000 + 4_096 + 256


def is_replacement_text(content: Any) -> bool:
    """Text that can be a replacement written by a budget or a per-tool gate: it opens and
    closes with the tag and is no longer than a replacement can be.

    Tool output is attacker-controlled: a longer text that merely begins with the tag is
    ordinary output, gated and budgeted like any other (a short one that imitates a
    replacement is no larger than a real one).
    """
    return (
        isinstance(content, str)
        and len(content) <= MAX_REPLACEMENT_CHARS
        and content.startswith(PERSISTED_OUTPUT_TAG)
        and content.rstrip().endswith(PERSISTED_OUTPUT_CLOSING_TAG)
    )


#: The ``stage`` of the ``stage-record`` a budget pass writes with the results it decided to send
#: whole (``{"decided": [[tool_use_id, digest], ...]}``; ``{"seen": [ids]}`` before results were
#: bound to their content): a resumed session freezes exactly those, wherever they stand.
DECIDED_RECORD_STAGE = "tool_result_budget"

_DIGEST = re.compile(r"[0-9a-f]{32}")
_KEY_SEPARATOR = "#"


def content_digest(content: Any) -> str:
    """32 hex digits of SHA-256 over a result's output (its core: see
    :mod:`pipeline.wire.harness`): a string as it is, a block list as compact JSON with its keys
    sorted and without ``cache_control`` (a client moves its breakpoints between calls).
    ``ValueError`` for content nested too deeply to write."""
    if isinstance(content, str):
        data = b"s" + content.encode("utf-8", "surrogatepass")
    else:
        plain = (
            [_without_cache_control(b) for b in content] if isinstance(content, list) else content
        )
        data = b"j" + canonical_json(plain, what="tool result content")
    return hashlib.sha256(data).hexdigest()[:32]


def _without_cache_control(block: Any) -> Any:
    if isinstance(block, Mapping) and "cache_control" in block:
        return {k: v for k, v in block.items() if k != "cache_control"}
    return block


def result_key(tool_use_id: str, core: Any) -> str:
    """The ledger's key for a result: its id and the digest of its output,
    ``<tool_use_id>#<32 hex>``."""
    return f"{tool_use_id}{_KEY_SEPARATOR}{content_digest(core)}"


def tool_use_id_of(key: str) -> str:
    """The ``tool_use_id`` part of a ledger key (a legacy key, a bare id, is the id)."""
    head, sep, tail = key.rpartition(_KEY_SEPARATOR)
    return head if sep and _DIGEST.fullmatch(tail) else key


class _StageRecordLike(Protocol):
    @property
    def stage(self) -> str: ...

    @property
    def data(self) -> Mapping[str, Any]: ...


def decided_in(stage_records: Iterable[_StageRecordLike]) -> set[str]:
    """The results budget passes recorded as decided and sent whole, as ledger keys; a record
    written before results were bound to their content names ids only, given as
    ``<tool_use_id>#`` (never a key: a key has 32 hex digits after its ``#``), which
    :meth:`ReplacementState.reconstruct` binds to the first result with that id. Malformed
    entries are ignored (the result then counts as unsent and is decided again,
    deterministically)."""
    decided: set[str] = set()
    for record in stage_records:
        if record.stage != DECIDED_RECORD_STAGE:
            continue
        pairs = record.data.get("decided")
        if isinstance(pairs, list):
            for pair in pairs:
                if (
                    isinstance(pair, list)
                    and len(pair) == 2
                    and isinstance(pair[0], str)
                    and isinstance(pair[1], str)
                    and _DIGEST.fullmatch(pair[1])
                ):
                    decided.add(f"{pair[0]}{_KEY_SEPARATOR}{pair[1]}")
        seen = record.data.get("seen")
        if isinstance(seen, list):
            decided.update(f"{t}{_KEY_SEPARATOR}" for t in seen if isinstance(t, str))
    return decided


def decided_record(keys: Iterable[str]) -> dict[str, Any]:
    """The data of the stage record naming ``keys`` as decided and sent whole (a bare id, from
    a ledger rebuilt from records that had no digests, goes as such a record did)."""
    pairs: list[list[str]] = []
    bare: list[str] = []
    for key in keys:
        tid = tool_use_id_of(key)
        if tid == key:
            bare.append(key)
        elif tid + _KEY_SEPARATOR == key:
            bare.append(tid)  # decided_in's form of a legacy id
        else:
            pairs.append([tid, key[len(tid) + 1 :]])
    data: dict[str, Any] = {"decided": pairs}
    if bare:
        data["seen"] = bare
    return data


@dataclass(frozen=True, slots=True)
class ReplacementRecord:
    """One replaced tool_result: the exact string the model was shown instead of the output,
    and the digest of that output (:func:`content_digest`; None in a record written before
    results were bound to their content)."""

    tool_use_id: str
    replacement: str
    kind: str = "tool-result"
    digest: str | None = None

    @property
    def key(self) -> str:
        """The ledger key of the result it replaced (the bare id for a legacy record)."""
        if self.digest is None:
            return self.tool_use_id
        return f"{self.tool_use_id}{_KEY_SEPARATOR}{self.digest}"

    def to_json(self) -> dict[str, str]:
        """The transcript shape: ``{"kind", "tool_use_id", "digest", "replacement"}``."""
        out = {"kind": self.kind, "tool_use_id": self.tool_use_id}
        if self.digest is not None:
            out["digest"] = self.digest
        out["replacement"] = self.replacement
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ReplacementRecord:
        """Parse a record; raise ``ValueError`` naming the bad field."""
        tool_use_id = raw.get("tool_use_id")
        replacement = raw.get("replacement")
        kind = raw.get("kind", "tool-result")
        digest = raw.get("digest")
        if not isinstance(tool_use_id, str) or not tool_use_id:
            raise ValueError(f"replacement record: bad tool_use_id {bounded_repr(tool_use_id)}")
        shown = bounded_repr(tool_use_id)
        if not isinstance(replacement, str):
            raise ValueError(f"replacement record {shown}: replacement is not a string")
        if not isinstance(kind, str):
            raise ValueError(f"replacement record {shown}: bad kind {bounded_repr(kind)}")
        if digest is not None and not (isinstance(digest, str) and _DIGEST.fullmatch(digest)):
            raise ValueError(f"replacement record {shown}: bad digest {bounded_repr(digest)}")
        return cls(tool_use_id=tool_use_id, replacement=replacement, kind=kind, digest=digest)


def _content_has_image(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(b, Mapping) and b.get("type") == "image" for b in content
    )


def content_is_empty(content: Any) -> bool:
    """None, "", whitespace, ``[]``, or only blank text blocks."""
    if content is None:
        return True
    if isinstance(content, str):
        return not content.strip()
    if isinstance(content, list):
        return all(
            isinstance(b, Mapping)
            and b.get("type") == "text"
            and not str(b.get("text") or "").strip()
            for b in content
        )
    return False


def candidate_size(content: Any) -> int:
    """Characters a tool_result's content counts for: ``len(str)`` or the sum of its text blocks."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(b["text"])
            for b in content
            if isinstance(b, Mapping) and b.get("type") == "text" and isinstance(b.get("text"), str)
        )
    return 0


def is_candidate_content(core: Any) -> bool:
    """Output (a result's core: see :mod:`pipeline.wire.harness`) the budget may decide on: not
    blank (blank results get the placeholder, never a decision), not a replacement, no
    image."""
    if content_is_empty(core) or is_replacement_text(core):
        return False
    return not _content_has_image(core)


def is_candidate(block: Mapping[str, Any], *, last: bool = False) -> bool:
    """A tool_result the budget may decide on (``last``: it is the last tool_result of its
    record, whose harness tail is not part of the output: see :func:`read_results`)."""
    if block.get("type") != "tool_result":
        return False
    content = block.get("content")
    return is_candidate_content(split_tail(content)[0] if last else content)


@dataclass(frozen=True, slots=True)
class ResultSlot:
    """One tool_result block as the stages read it."""

    block: Mapping[str, Any]
    tool_use_id: str | None
    """None when the block has no string id (nothing can address it)."""
    core: Any
    """The tool's output: the content less the harness tail (:mod:`pipeline.wire.harness`)."""
    empty: bool
    key: str | None
    """The ledger key (:func:`result_key`) of a candidate, None for anything else."""


def read_results(m: Message) -> Iterator[ResultSlot]:
    """Every tool_result block of a user record that is a mapping, in order, read as the stages
    read it: the harness tail split off the last one, a candidate keyed by id and digest."""
    if m.type != "user" or not isinstance(m.content, list):
        return
    last = last_result_index(m.content)
    for j, b in enumerate(m.content):
        if not isinstance(b, Mapping) or b.get("type") != "tool_result":
            continue
        tid = b.get("tool_use_id")
        content = b.get("content")
        core = split_tail(content)[0] if j == last else content
        if not isinstance(tid, str):
            yield ResultSlot(b, None, core, content_is_empty(core), None)
        elif content_is_empty(core):
            yield ResultSlot(b, tid, core, True, None)
        elif is_candidate_content(core):
            yield ResultSlot(b, tid, core, False, result_key(tid, core))
        else:
            yield ResultSlot(b, tid, core, False, None)


def iter_tool_results(messages: Iterable[Message]) -> Iterable[tuple[Message, Block]]:
    """Every tool_result block held by a user message, in order."""
    for m in messages:
        if m.type == "user" and isinstance(m.content, list):
            for b in m.content:
                if b.get("type") == "tool_result":
                    yield m, b


def _last_response_start(messages: Sequence[Message]) -> int:
    """Index of the first record of the last real response (-1 if none). A response may be
    recorded in fragments with its tool results between them; none of those results was sent
    before the response was complete."""
    start = -1
    last_id: str | None = None
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.type != "assistant" or m.is_synthetic:
            continue
        if start == -1:
            start, last_id = i, m.message_id
        elif last_id is not None and m.message_id == last_id:
            start = i
        else:
            break
    return start


def answered_results(
    messages: Sequence[Message], first: int = 0, *, rebuilt: bool = False
) -> set[str]:
    """The ledger keys of the results in ``messages[first:]`` that stand before the last real
    response: the model answered after them, so they were sent (by position, as
    :meth:`ReplacementState.reconstruct` counts them). Reads from ``first`` on only.
    ``rebuilt``: the caller's ledger was just reconstructed from ``messages``, so it holds every
    such key from the thread's start on: only those before it are read."""
    last = _last_response_start(messages)
    if rebuilt:
        last = min(last, thread_start(messages))
    keys: set[str] = set()
    for i in range(first, last):
        keys.update(slot.key for slot in read_results(messages[i]) if slot.key is not None)
    return keys


class _Counter:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


class _CountedSet(set[str]):
    """A set that counts every change through its methods (so a cache can tell in O(1) that
    nothing changed since it last looked)."""

    __slots__ = ("_changes",)

    def __init__(self, items: Iterable[str], changes: _Counter) -> None:
        super().__init__(items)
        self._changes = changes

    def _changed(self) -> None:
        self._changes.value += 1

    def add(self, item: str) -> None:
        self._changed()
        super().add(item)

    def discard(self, item: object) -> None:
        self._changed()
        super().discard(item)

    def remove(self, item: str) -> None:
        self._changed()
        super().remove(item)

    def pop(self) -> str:
        self._changed()
        return super().pop()

    def clear(self) -> None:
        self._changed()
        super().clear()

    def update(self, *others: Iterable[str]) -> None:
        self._changed()
        super().update(*others)

    def difference_update(self, *others: Iterable[Any]) -> None:
        self._changed()
        super().difference_update(*others)

    def intersection_update(self, *others: Iterable[Any]) -> None:
        self._changed()
        super().intersection_update(*others)

    def symmetric_difference_update(self, other: Iterable[str]) -> None:
        self._changed()
        super().symmetric_difference_update(other)

    def __ior__(self, other: AbstractSet[str]) -> Self:  # type: ignore[override,misc]
        self._changed()
        return super().__ior__(other)

    def __iand__(self, other: AbstractSet[object]) -> Self:
        self._changed()
        return super().__iand__(other)

    def __isub__(self, other: AbstractSet[object]) -> Self:
        self._changed()
        return super().__isub__(other)

    def __ixor__(self, other: AbstractSet[str]) -> Self:  # type: ignore[override,misc]
        self._changed()
        return super().__ixor__(other)


class _CountedDict(dict[str, str]):
    """A dict that counts every change through its methods (see :class:`_CountedSet`)."""

    __slots__ = ("_changes",)

    def __init__(self, items: Mapping[str, str], changes: _Counter) -> None:
        super().__init__(items)
        self._changes = changes

    def _changed(self) -> None:
        self._changes.value += 1

    def __setitem__(self, key: str, value: str) -> None:
        self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self._changed()
        super().__delitem__(key)

    def pop(self, key: str, *default: Any) -> Any:
        self._changed()
        return super().pop(key, *default)

    def popitem(self) -> tuple[str, str]:
        self._changed()
        return super().popitem()

    def clear(self) -> None:
        self._changed()
        super().clear()

    def update(self, *args: Any, **kwargs: str) -> None:
        self._changed()
        super().update(*args, **kwargs)

    def setdefault(self, key: str, default: str = "") -> str:
        self._changed()
        return super().setdefault(key, default)

    def __ior__(self, other: Any) -> Self:  # type: ignore[override,misc]
        self._changed()
        return super().__ior__(other)


class ReplacementState:
    """``seen_ids``: the key (:func:`result_key`: id and output digest) of every result that
    passed a budget decision; ``replacements``: the subset that was replaced, mapped to the
    exact string the model was shown.

    Both may be read and changed like a set and a dict (or assigned anew); :attr:`version`
    moves with every change, so a stage can tell in O(1) that the ledger is as it left it.
    """

    __slots__ = ("_changes", "_replacements", "_seen_ids")

    def __init__(
        self, seen_ids: Iterable[str] = (), replacements: Mapping[str, str] | None = None
    ) -> None:
        self._changes = _Counter()
        self._seen_ids = _CountedSet(seen_ids, self._changes)
        self._replacements = _CountedDict(replacements or {}, self._changes)

    @property
    def seen_ids(self) -> set[str]:
        """The key of every result that passed a budget decision, replaced or not."""
        return self._seen_ids

    @seen_ids.setter
    def seen_ids(self, value: Iterable[str]) -> None:
        self._changes.value += 1
        self._seen_ids = _CountedSet(value, self._changes)

    @property
    def replacements(self) -> dict[str, str]:
        """Result key -> the exact text the model was shown instead of the output."""
        return self._replacements

    @replacements.setter
    def replacements(self, value: Mapping[str, str]) -> None:
        self._changes.value += 1
        self._replacements = _CountedDict(value, self._changes)

    @property
    def version(self) -> int:
        """Moves with every change of :attr:`seen_ids` or :attr:`replacements`."""
        return self._changes.value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReplacementState):
            return NotImplemented
        return self.seen_ids == other.seen_ids and self.replacements == other.replacements

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return (
            f"ReplacementState(seen_ids={set(self.seen_ids)!r}, "
            f"replacements={dict(self.replacements)!r})"
        )

    def copy(self) -> ReplacementState:
        """An independent copy (a sub-agent starts from its parent's state)."""
        return ReplacementState(self.seen_ids, self.replacements)

    def classify(self, key: str) -> str:
        """``"must_reapply"``, ``"frozen"`` or ``"fresh"`` for a result key."""
        if key in self.replacements:
            return "must_reapply"
        if key in self.seen_ids:
            return "frozen"
        return "fresh"

    def record_replacement(self, key: str, replacement: str) -> None:
        """Mark seen and replaced in one step: no observer sees one without the other."""
        self.replacements[key] = replacement
        self.seen_ids.add(key)

    def replacement_for(self, tool_use_id: str, content: Any) -> str | None:
        """The text the model was shown instead of this result (its content as the client
        sends it, harness tail included or not), None when it was not replaced."""
        return self.replacements.get(result_key(tool_use_id, split_tail(content)[0]))

    @classmethod
    def reconstruct(
        cls,
        messages: Sequence[Message],
        records: Iterable[ReplacementRecord],
        *,
        decided: AbstractSet[str] = frozenset(),
        keep_absent: bool = False,
    ) -> ReplacementState:
        """Rebuild the state of a resumed session.

        A candidate is seen (frozen unless replaced) when a pass recorded it as decided
        (``decided``: see :func:`decided_in`) or when it stands before the last real response
        (it was sent). Any other candidate may never have been sent (the process can die
        between recording a result and recording the budget's decision on it), so it stays
        fresh and the next pass decides it again: deterministically, so it matches what was
        sent if the request did go out, and the files already written are reused. Replacements
        are restored only for results still present as candidates with the output they were
        made from (id and digest), and the stored strings are used verbatim, never rebuilt.
        Results before the last compaction are never sent again, so they are not present. A
        record written before results were bound to their content (a bare id) binds to the
        first present result with that id. ``keep_absent``: restore the decisions on results
        the history does not hold too (a request that is not the whole conversation: a retry of
        an earlier one); bound to their output, they apply only to it, should it come.
        """
        state = cls()
        last_response = _last_response_start(messages)
        present: set[str] = set()
        first_key: dict[str, str] = {}  # tool_use_id -> key of its first present result
        sent: set[str] = set()
        for i in range(thread_start(messages), len(messages)):
            for slot in read_results(messages[i]):
                key, tid = slot.key, slot.tool_use_id
                if key is None or tid is None:
                    continue
                present.add(key)
                first_key.setdefault(tid, key)
                legacy = first_key[tid] == key and f"{tid}{_KEY_SEPARATOR}" in decided
                if i < last_response or key in decided or legacy:
                    sent.add(key)
        state.seen_ids |= sent
        if keep_absent:
            state.seen_ids |= {k for k in decided if _DIGEST.fullmatch(k.rpartition("#")[2])}
        for record in records:
            if record.kind != "tool-result":
                continue
            key = record.key if record.digest is not None else first_key.get(record.tool_use_id)
            kept = keep_absent and record.digest is not None
            if key is not None and (key in present or kept):
                state.record_replacement(key, record.replacement)
        return state
