"""The incremental wire form: :class:`WireCache` builds each call's request at the cost of what
changed since the last call, equal to :func:`pipeline.wire.form.to_api` of the whole history
(and counts its visible text as it goes: :func:`~pipeline.wire.chars.request_chars`)."""

from __future__ import annotations

import operator
from array import array
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import compress, count
from typing import TYPE_CHECKING, Any, cast

from pipeline.kept_list import InputLog
from pipeline.messages import Message, thread_start
from pipeline.wire.caching import param_breakpoints
from pipeline.wire.chars import param_chars, request_chars
from pipeline.wire.entry_patch import replaced_blocks, same_place, swap_in
from pipeline.wire.form import _entry_to_param, _Wire, _WireEntry
from pipeline.wire.pairing import PairingError, PairingIndex

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic.types import MessageParam

__all__ = ["EDITABLE", "WireCache", "request_chars"]

_NO_FIELDS: Mapping[str, Mapping[str, Any]] = {}

EDITABLE = 2
"""The last messages of a request a :class:`WireCache` hands on as fresh copies, by default."""


class WireCache:
    """``to_api`` for one conversation across calls, at the cost of what changed.

    :attr:`chars` is ``request_chars`` of the last request and :attr:`pairing` its
    :func:`~pipeline.wire.pairing.check_pairing`, both kept up to date the same way.

    A call finds the first record that differs from the last call's input (one C-level
    identity sweep, or the list's own journal for a :class:`~pipeline.kept_list.KeptList`). Old
    records replaced by records of the same wire shape (the same kinds of blocks and tool ids:
    a stage clearing old results) rebuild only the messages they went into. Otherwise it rolls
    the wire entries back to the first one a changed record went into and feeds the records
    from there: a history that only grew costs its new records, another edit what follows it.
    A changed or new compact boundary starts over.

    The messages of a returned request are shared with the cache and with the next requests,
    except the last ``editable`` ones (default 2), which are new dicts with new content lists:
    a caller may edit those (say, add a ``cache_control`` breakpoint by replacing a block) but
    must not mutate the earlier ones. Block dicts are shared with the records, as with
    ``to_api``, and so is the content list of a message made of one record's blocks (unlike
    ``to_api``, which copies it): never mutate those. (Copying every message on every call
    made a long session's requests quadratic, and kept the garbage collector busy with the
    copies.)
    """

    def __init__(self, *, editable: int = EDITABLE, track_dropped: bool = False) -> None:
        self.editable = editable
        self.track_dropped = track_dropped
        self.dropped: list[Any] = []
        """With ``track_dropped``: the tool_result blocks the last request no longer carries
        that the one before carried (a stage cleared or removed them), each as itself."""
        self._log = InputLog()
        self._shared: list[MessageParam] = []
        """The list ``to_api(shared=True)`` returns (its first ``_shared_plain`` are params)."""
        self._shared_plain = 0
        self._changed_from = 0
        """The first param refreshed since the last shared request."""
        self._reset(0)
        self._fresh = True
        self._given: dict[int, Any] = {}
        self._fields: Mapping[str, Mapping[str, Any]] = _NO_FIELDS

    def to_api(
        self,
        messages: Sequence[Message],
        *,
        shared: bool = False,
        given: Sequence[Any] = (),
        fields: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> list[MessageParam]:
        """Exactly ``to_api(messages)`` (and raises where it raises), but for ``fields``.

        ``given``: message params the records were made from (``Message.from_param``, which
        keeps a param's content list): a new message of one record whose param is exactly
        ``{"role": ..., "content": that list}`` is that param itself, not an equal copy (a
        proxy's request holds each message once: the dict the client's body was parsed into).
        The caller must not change them, as it must not change the requests' messages. A
        param given with fields besides role and content is taken as it is, those too.

        ``fields``: by record name, what a record's message had besides role and content
        (:class:`~pipeline.wire.message_fields.MessageFields`), written after them into the
        message made of that one record. A record's fields are read when its message is made:
        a record the cache holds keeps the message it made (a request whose message differs
        only there is a new record, :class:`~pipeline.dropin.adapter.WireSession`'s).

        ``shared=True`` returns the cache's own list, brought up to date in place (at the cost
        of what changed) rather than a new one: it is valid until the next call, which changes
        it. For a caller that is done with each request before it asks for the next (a replay
        printing each call): a new list of every message per call is the part of a long
        session's request that grows with the history.
        """
        # by content list: a param is taken only where its list is the entry's own
        self._given = {id(p["content"]): p for p in given if _plain(p)}
        self._fields = fields or _NO_FIELDS
        if self.dropped:
            self.dropped = []
        try:
            self._extend(messages)
        except BaseException:
            # a record to_api rejects (or a cancellation) midway: start over next time
            self._log.clear()
            self._fresh = True
            raise
        finally:
            self._given, self._fields = {}, _NO_FIELDS
        params, k = self._params, self.editable
        if shared:
            return self._shared_list()
        if len(params) <= k:
            return [_fresh(p) for p in params]
        if not k:
            return list(params)
        # one slice, extended in place: unpacking a slice copies it twice (a cost that grows
        # with the history, paid on every call)
        out = params[:-k]
        out.extend(map(_fresh, params[-k:]))
        return out

    def _shared_list(self) -> list[MessageParam]:
        """The shared request: params up to the last ``editable``, fresh copies after; only
        the part from the first param refreshed since the last shared request is rewritten."""
        out, params = self._shared, self._params
        tail = max(0, len(params) - self.editable)
        keep = min(self._changed_from, self._shared_plain, tail)
        del out[keep:]
        out += params[keep:tail]
        out.extend(map(_fresh, params[max(keep, tail) :]))
        self._shared_plain, self._changed_from = tail, len(params)
        return out

    def replaced(self, index: int) -> None:
        """The caller replaced message ``index`` of the last shared request (say, by a copy that
        carries a ``cache_control`` breakpoint,
        :func:`~pipeline.wire.caching.place_cache_breakpoint`):
        the next shared request puts the cache's own message back there."""
        self._shared_plain = max(0, min(self._shared_plain, index))

    @property
    def tool_use_ids(self) -> AbstractSet[str]:
        """The tool_use ids of the last request (a live view)."""
        return self.pairing.tool_use_ids

    def ensure_paired(self) -> None:
        """Raise :class:`~pipeline.wire.pairing.PairingError` naming every offending id if the last
        request's tool pairing is broken (``ensure_paired`` at the cost of what changed)."""
        if self.pairing.count:
            raise PairingError(self.pairing.problems)

    def _reset(self, start: int) -> None:
        self._wire = _Wire(share=True)
        self._start = start
        """Index of the first record the wire holds (after the last compact boundary)."""
        # indexes of records and entries in 4 bytes each (a conversation of 2**31 records is
        # past any memory), as the counts of breakpoints below
        self._entry_of = array("i")
        """Per record from ``_start``: the entry it went into (-1: dropped)."""
        self._first_record = array("i")
        """Per entry: the index of the record that created it."""
        self._last_record = array("i")
        """Per entry: the index of the last record that went into it."""
        self._params: list[MessageParam] = []
        self._changed_from = 0
        self._chars = array("q")
        """Per entry: the characters of its visible text (8 bytes each; an int object of ~32
        bytes each in a list)."""
        self.chars = 0
        """Characters of visible text in the last request (see :func:`request_chars`)."""
        self._breakpoints = array("i")
        """Per entry: its blocks that carry ``cache_control``."""
        self.breakpoints = 0
        """Blocks of the last request that carry ``cache_control`` (the API allows four)."""
        self.pairing = PairingIndex()
        """The pairing problems of the last request (see :meth:`ensure_paired`)."""

    def _extend(self, messages: Sequence[Message]) -> None:
        n_old = len(self._log.inputs)
        first = self._log.take(messages)
        if first == n_old == len(messages) and not self._fresh:
            return  # the very same records
        removed = self._log.removed
        if (
            not self._fresh
            and first > self._start
            and removed
            and len(removed) <= len(messages) - first
            and self._patch(messages, first, removed)
        ):
            first = n_old  # what is left is new records
            if first == len(messages):
                return
        restart = any(m.restarts_thread for m in messages[first:])
        # a change at the thread's first record (a summary, say) may move where it starts
        if self._fresh or restart or first <= self._start:
            self._fresh = False
            before = self._params
            self._reset(thread_start(messages))
            self._feed(messages, self._start, 0)
            self._note_dropped(before, self._params)
            return
        entries = len(self._wire.entries)
        rollback, r0 = self._rollback(first)
        if rollback < entries:
            self._wire.truncate(rollback)
            del self._first_record[rollback:]
            del self._last_record[rollback:]
        del self._entry_of[r0 - self._start :]
        self._feed(messages, r0, min(rollback, entries))

    def _patch(self, messages: Sequence[Message], first: int, removed: Sequence[Message]) -> bool:
        """Old records replaced in place by records of the same wire shape (a stage clearing old
        results: new content, the same kinds of blocks and ids; new records may follow): rebuild
        only the entries they went into. Every decision the wire takes from a record's shape
        (which entry it joins, merges, barriers, pairing) is unchanged, so the other entries and
        the pairing stand. False (nothing changed) when the edit is not that, or touches too
        much for it to pay."""
        kept = messages[first : first + len(removed)]
        changed = list(compress(count(first), map(operator.is_not, removed, kept)))
        if 2 * len(changed) > len(removed):  # then feeding them again is as cheap
            return False
        start, entry_of = self._start, self._entry_of
        before = {i: removed[i - first] for i in changed}  # the changed records as they were
        # per entry to patch: (old block, new block) of each block its changed records replaced
        replaced: dict[int, list[tuple[Any, Any]]] = {}
        rebuild: set[int] = set()
        for i, old in before.items():
            new = messages[i]
            if not same_place(old, new):
                return False
            e = entry_of[i - start]
            if e >= 0:
                pairs = replaced_blocks(old, new)
                if pairs is None:
                    rebuild.add(e)
                else:
                    replaced.setdefault(e, []).extend(pairs)
        rebuilt: dict[int, _WireEntry] = {}
        for e in replaced.keys() | rebuild:
            sources = [
                r
                for r in range(self._first_record[e], self._last_record[e] + 1)
                if entry_of[r - start] == e
            ]
            entry = self._wire.entries[e]
            if e not in rebuild:
                was_built_from = [before.get(r, messages[r]) for r in sources]
                blocks = swap_in(entry.blocks, was_built_from, replaced[e])
                if blocks is not None:
                    entry.blocks = blocks  # a new list: earlier requests hold the old one
                    rebuilt[e] = entry
                    continue
            part = _Wire(share=True)
            try:
                for r in sources:
                    part.add(messages[r])
            except ValueError:  # content it cannot send: the full path says so
                return False
            if len(part.entries) != 1:
                return False
            rebuilt[e] = part.entries[0]
        for e, entry in rebuilt.items():
            self._wire.entries[e] = entry
            was = self._params[e]
            param = self._params[e] = self._param(entry, e, messages)
            self._note_dropped((was,), (param,))
            chars, marks = param_chars(param), param_breakpoints(param)
            self.chars += chars - self._chars[e]
            self.breakpoints += marks - self._breakpoints[e]
            self._chars[e], self._breakpoints[e] = chars, marks
        if rebuilt:
            self._changed_from = min(self._changed_from, min(rebuilt))
        return True

    def _param(self, entry: _WireEntry, e: int, messages: Sequence[Message]) -> MessageParam:
        """Entry ``e``'s param: the given param whose content list it holds, if one is, else
        a new one (with its record's fields, where it is made of one record that has any)."""
        param = _entry_to_param(entry)
        content: Any = param["content"]
        theirs = self._given.get(id(content)) if type(content) is list else None
        if theirs is not None and theirs["content"] is content and theirs["role"] == param["role"]:
            return cast("MessageParam", theirs)
        if self._fields:
            first = self._first_record[e]
            if first == self._last_record[e]:
                extra = self._fields.get(messages[first].uuid)
                if extra:
                    return cast("MessageParam", {**param, **extra})
        return param

    def _note_dropped(self, old: Sequence[Any], new: Sequence[Any]) -> None:
        """With ``track_dropped``: add the tool_result blocks of params ``old`` that the
        params ``new`` replacing them do not hold to :attr:`dropped`."""
        if not self.track_dropped or not old:
            return  # (a slice of the params is made only for a caller that tracks)
        kept = {id(b) for p in new for b in _result_blocks(p)}
        self.dropped += [b for p in old for b in _result_blocks(p) if id(b) not in kept]

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
        last_record = self._last_record
        before = len(wire.entries)
        low = before
        for idx in range(r0, len(messages)):
            went = wire.add(messages[idx])
            entry_of.append(went)
            if went >= 0:
                low = min(low, went)
                if went == len(first_record):
                    first_record.append(idx)
                    last_record.append(idx)
                else:
                    last_record[went] = idx
        keep = min(keep, low, before)
        fresh = [self._param(e, j, messages) for j, e in enumerate(wire.entries[keep:], keep)]
        self._changed_from = min(self._changed_from, keep)
        if self.track_dropped:
            self._note_dropped(self._params[keep:], fresh)
        del self._params[keep:]
        self._params += fresh
        self.chars -= sum(self._chars[keep:])
        del self._chars[keep:]
        counted = [param_chars(p) for p in fresh]
        self._chars.extend(counted)
        self.chars += sum(counted)
        self.breakpoints -= sum(self._breakpoints[keep:])
        del self._breakpoints[keep:]
        marked = [param_breakpoints(p) for p in fresh]
        self._breakpoints.extend(marked)
        self.breakpoints += sum(marked)
        self.pairing.update(self._params, keep)


def _result_blocks(param: Any) -> list[Any]:
    content = param["content"]
    if type(content) is not list:
        return []
    return [b for b in content if type(b) is dict and b.get("type") == "tool_result"]


def _plain(param: Any) -> bool:
    """A param ``{"role": ..., "content": [...]}``, role first: what ``to_api`` makes of a
    record made from it (its blocks sent as they are), and the fields it has besides."""
    return (
        type(param) is dict
        and next(iter(param), None) == "role"
        and type(param.get("content")) is list
    )


def _fresh(param: MessageParam) -> MessageParam:
    """A new message dict with a new content list (the blocks themselves are shared), and
    the fields the message has besides."""
    content: Any = param["content"]
    fresh: dict[str, Any] = {
        "role": param["role"],
        "content": content if isinstance(content, str) else [*content],
    }
    if len(param) > 2:
        fresh = {**cast("dict[str, Any]", param), **fresh}
    return cast("MessageParam", fresh)
