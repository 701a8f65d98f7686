"""The ledger of what the model has seen: ``ReplacementState`` and its records.

Once a tool_result has been sent whole, changing it later would change the cached prompt prefix;
once it has been replaced, the same replacement string must be sent forever after. The state
remembers both, and the records written to the transcript let a resumed session rebuild it.

A decision is bound to what it decided on: the ledger's key for a result is its
``tool_use_id`` *and* a digest of its output (:func:`~pipeline.results.keys.result_key`), so
a decision is re-applied only to the content it was made from. A result that reuses an id
with other content -- a client's own ids repeated, a conversation mistaken for another -- is
a new result, decided on its own, never sent another result's replacement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol, Self

from pipeline.messages import Message, thread_start
from pipeline.results.keys import DIGEST_HEX, KEY_SEPARATOR, result_key, tool_use_id_of
from pipeline.results.reading import last_response_start, read_results
from pipeline.tokens.checks import bounded_repr
from pipeline.wire.harness import split_tail

__all__ = [
    "DECIDED_RECORD_STAGE",
    "ReplacementRecord",
    "ReplacementState",
    "decided_in",
    "decided_record",
]


#: The ``stage`` of the ``stage-record`` a budget pass writes with the results it decided to send
#: whole (``{"decided": [[tool_use_id, digest], ...]}``; ``{"seen": [ids]}`` before results were
#: bound to their content): a resumed session freezes exactly those, wherever they stand.
DECIDED_RECORD_STAGE = "tool_result_budget"


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
                    and DIGEST_HEX.fullmatch(pair[1])
                ):
                    decided.add(f"{pair[0]}{KEY_SEPARATOR}{pair[1]}")
        seen = record.data.get("seen")
        if isinstance(seen, list):
            decided.update(f"{t}{KEY_SEPARATOR}" for t in seen if isinstance(t, str))
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
        elif tid + KEY_SEPARATOR == key:
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
    and the digest of that output (:func:`~pipeline.results.keys.content_digest`; None in a
    record written before results were bound to their content)."""

    tool_use_id: str
    replacement: str
    kind: str = "tool-result"
    digest: str | None = None

    @property
    def key(self) -> str:
        """The ledger key of the result it replaced (the bare id for a legacy record)."""
        if self.digest is None:
            return self.tool_use_id
        return f"{self.tool_use_id}{KEY_SEPARATOR}{self.digest}"

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
        if digest is not None and not (isinstance(digest, str) and DIGEST_HEX.fullmatch(digest)):
            raise ValueError(f"replacement record {shown}: bad digest {bounded_repr(digest)}")
        return cls(tool_use_id=tool_use_id, replacement=replacement, kind=kind, digest=digest)


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
    """``seen_ids``: the key (:func:`~pipeline.results.keys.result_key`: id and output digest)
    of every result that passed a budget decision; ``replacements``: the subset that was
    replaced, mapped to the exact string the model was shown.

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
        core = split_tail(content)[0]
        return self.replacements.get(result_key(tool_use_id, core, kept=core is content))

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
        last_response = last_response_start(messages)
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
                legacy = first_key[tid] == key and f"{tid}{KEY_SEPARATOR}" in decided
                if i < last_response or key in decided or legacy:
                    sent.add(key)
        state.seen_ids |= sent
        if keep_absent:
            state.seen_ids |= {k for k in decided if DIGEST_HEX.fullmatch(k.rpartition("#")[2])}
        for record in records:
            if record.kind != "tool-result":
                continue
            key = record.key if record.digest is not None else first_key.get(record.tool_use_id)
            kept = keep_absent and record.digest is not None
            if key is not None and (key in present or kept):
                state.record_replacement(key, record.replacement)
        return state
