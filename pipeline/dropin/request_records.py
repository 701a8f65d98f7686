"""A request's records: the part of :class:`~pipeline.dropin.adapter.WireSession` that turns
each request's messages into the records the stages read -- the last request's own records for
as long as this one repeats it, a new record, named by the digest of it and every message
before it, for every message from the first that differs on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.dropin.observing import Call
from pipeline.dropin.session_log import Responses
from pipeline.kept_list import shared_start
from pipeline.messages import WIRE_MESSAGE, Message, uuid5_text
from pipeline.wire.digests import chain_of, opening_digest
from pipeline.wire.message_fields import MessageFields
from pipeline.wire.same_values import same_start

__all__ = ["RequestRecords", "Routed", "UnreadableMessage"]

Routed = tuple[Sequence[Any], list[bytes], "list[Any] | None", tuple[int, Sequence[Any]]]
"""What the router left for the next pass (:meth:`WireSession.routed`)."""


class UnreadableMessage(ValueError):
    """A request's message the pass cannot read (a role or a content the API refuses): the
    request is refused (the proxy: a 400) or goes as it came (``wrap``: the API judges it)."""


class RequestRecords:
    """A request's records (a mixin of :class:`~pipeline.dropin.adapter.WireSession`, which
    sets every attribute below)."""

    chain: list[bytes]
    opening: bytes | None
    last_call: Call | None
    _params: list[Any]
    _records: list[Message]
    _first_new: int
    _routed: Routed | None
    _fields: MessageFields
    _responses: Responses

    def routed(
        self,
        messages: Sequence[Any],
        chain: list[bytes],
        kept: list[Any] | None = None,
        checked: tuple[int, Sequence[Any]] = (0, ()),
    ) -> None:
        """The digests of ``messages`` as the router computed them
        (:mod:`pipeline.dropin.conversations`):
        when those very messages are prepared next, they are not digested again, and
        ``kept`` (a list of them that no one changes, the router's own) is the one this
        session keeps of them rather than a copy of its own. ``checked``: how many leading
        messages the router found to be the same values as those of a list (this session's
        last request, when it is that list: not compared again)."""
        self._routed = (messages, chain, kept, checked)

    @property
    def first_new(self) -> int:
        """Where the last request prepared stopped repeating the one before it: its first
        message new to this session."""
        return self._first_new

    def _sync(self, messages: Sequence[Any]) -> list[Message]:
        """The request's records: the last request's for as long as this one repeats it, a new
        record for every message from the first that differs on (digested from there on)."""
        prev, records = self._params, self._records
        same = shared_start(prev, messages)
        routed, self._routed = self._routed, None
        params: list[Any] | None = None
        if routed is not None and routed[0] is messages and len(routed[1]) == len(messages):
            chain, params = routed[1], routed[2]
            if params is messages:
                # a body reader's parse, kept as it is (a proxy's): where it parsed a message
                # again, what JSON tells apart counts (1 is not true); a caller's own list
                # (wrap's: every message a new dict each call) is compared by == alone
                checked, against = routed[3]
                same = same_start(prev, messages, same, checked if against is prev else 0)
        else:
            first = messages[0] if messages else None
            opening = self.opening or opening_digest(None, "", first)
            start = same if self._params and len(self.chain) >= same else 0
            chain = chain_of(messages, start, self.chain, opening=opening)
        # the same record where the request repeats the last one: the stages' work on it stands
        out = records[:same]
        out += [self._record(i, messages[i], chain[i]) for i in range(same, len(messages))]
        # what its messages carry besides role and content goes on with them
        self._fields.update(records[same:] if self._fields.by_name else (), out, messages, same)
        if params is None:  # (the router's list is as long as the chain checked above)
            params = list(messages)
        self._params, self._records, self.chain = params, out, chain
        self._first_new = same
        self.last_call = Call(len(messages), chain)
        return out

    def _record(self, index: int, param: Any, link: bytes) -> Message:
        # named by the digest of it and everything before it: the same in a new process, never
        # the name of a record that follows other messages (stages name records by uuid)
        uid = uuid5_text(link)
        try:
            if not (
                (type(param) is dict or isinstance(param, Mapping))
                and param.get("role") == "assistant"
            ):
                return Message.from_param(param, uuid=uid, subtype=WIRE_MESSAGE)
            # an answer this session did not observe: an id of its own place, so that two
            # equal answers (a model repeating a call with the same id) stay two messages --
            # the record's own name, one string for both (a history that came before this
            # process held an id string beside the name for each of its answers)
            response_id, usage = self._responses.get(index, (None, None))
            if response_id is None:
                response_id = uid
            return Message.from_param(
                param, uuid=uid, message_id=response_id, usage=usage, subtype=WIRE_MESSAGE
            )
        except ValueError as exc:
            raise UnreadableMessage(f"messages[{index}]: {exc}") from None
