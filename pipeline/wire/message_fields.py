"""A message's own fields besides ``role`` and ``content``, sent on as the client wrote them.

A record (:class:`~pipeline.messages.Message`) holds a message's role and content: all of a
Messages API message today. A client's request may carry more on a message -- a field the API
adds later, or one it refuses, which it must then refuse as it would without this layer. The
records do not hold them (nor do the digests that tell conversations apart: a client that
moves or edits such a field has not started another conversation); :class:`MessageFields`
keeps them beside the records, by record name (``uuid``: a stage that edits a record's
content keeps its name), and :meth:`~pipeline.wire.cache.WireCache.to_api` writes them into
the message made of that one record, after its role and content.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.messages import Message

__all__ = ["MessageFields", "extra_fields"]

_OWN = frozenset({"role", "content"})


def extra_fields(param: Any) -> dict[str, Any] | None:
    """The fields of message ``param`` besides ``role`` and ``content``, in its order; None
    when it has none (or is not a mapping)."""
    # a message of two fields (or fewer) has none: role and content, or it is refused anyway
    if not (type(param) is dict or isinstance(param, Mapping)) or len(param) <= 2:
        return None
    extra = {k: v for k, v in param.items() if k not in _OWN}
    return extra or None


class MessageFields:
    """The extra fields of a conversation's current records, by record name: an entry for
    each record whose message had any (none at all for a client that sends only role and
    content), so at most one a message of the last request."""

    __slots__ = ("by_name",)

    def __init__(self) -> None:
        self.by_name: dict[str, dict[str, Any]] = {}
        """Record name -> the fields its message had besides role and content."""

    def update(
        self,
        dropped: Sequence[Message],
        records: Sequence[Message],
        params: Sequence[Any],
        start: int,
    ) -> None:
        """Records ``dropped`` (those the last request had from where this one differs) are
        gone; ``records[start:]`` are new, made from ``params[start:]``, in their order."""
        by_name = self.by_name
        if by_name:
            for record in dropped:
                by_name.pop(record.uuid, None)
        for k in range(start, len(records)):
            param = params[k]
            if type(param) is dict and len(param) <= 2:
                continue  # the common case, without a call
            extra = extra_fields(param)
            if extra is not None:
                by_name[records[k].uuid] = extra
