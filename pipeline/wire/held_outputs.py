"""A held conversation's long tool outputs left in the request that carries them
(:func:`hold_outputs`), read back from the request being served where a reader needs one.

A client re-sends its whole conversation on every call, and the body reader hands each message
of a repeated prefix back as the object it parsed before (:mod:`pipeline.wire.body_reader`),
at the same byte offset: the prefix is the same bytes from the body's first byte on. So the
text of an output the proxy has passed on is in every later request of its conversation again,
at the same place, and the proxy need not hold it between calls. Once a request has been
written, each tool_result output of at least :data:`HOLD_AT` characters among its new messages
(the last message's a call later) becomes a :class:`~pipeline.wire.deferred.DeferredText`
naming its message's bytes; a reader that meets one (:func:`~pipeline.wire.deferred.resolved`,
the encoders' hooks) parses it from the body being served (:func:`serving`). The body writer
takes an unchanged message's bytes from the request without reading it, so a growing
conversation's later calls read none; a stage that looks at an old output again (microcompact
weighing its oldest kept result, the messages after a snip's cut written again) reads a few.

A handle is read only from the request being served in this task, checked against the output's
length and CRC-32: bytes that hold another output (a request that no longer carries it) are
:class:`OutputNotCarried`, never another conversation's text. The proxy holds outputs only
under a pipeline whose stages never read an output again on a later pass (``rereads_outputs =
False``: :func:`~pipeline.core.rereading_stages`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pipeline.wire.body_writer import Source
from pipeline.wire.deferred import DeferredText, crc32_of

__all__ = [
    "BODY",
    "HOLD_AT",
    "BodySource",
    "OutputNotCarried",
    "hold_outputs",
    "serving",
    "serving_scope",
]

HOLD_AT = 256
"""Characters from which an output is left in the request: a handle costs ~150 bytes, such a
string 300 and more (from 1,024 characters, real Claude Code sessions held 0.06x of their wire
text more)."""


class _Serving:
    """The body a request's task serves, let go of when the request ends (a context may
    outlive its task: a timer's callback holds a copy)."""

    __slots__ = ("raw",)

    def __init__(self) -> None:
        self.raw: bytes | None = None


_SERVING: ContextVar[_Serving | None] = ContextVar("sluicegate_serving", default=None)
_LEADING = re.compile(rb"[ \t\n\r,\[]*")


class OutputNotCarried(ValueError):
    """A held output was read where the request being served does not carry it."""


def serving(raw: bytes) -> None:
    """Make ``raw`` the request body held outputs are read from, for this task (a request's
    handler and what it runs: worker threads and passes get a copy of its context) until the
    :func:`serving_scope` it runs in ends; ``RuntimeError`` outside one (nothing would let go
    of the body: a copy of the context, a timer's, may outlive the request)."""
    box = _SERVING.get()
    if box is None:
        raise RuntimeError("serving() outside a serving_scope()")
    box.raw = raw


@contextmanager
def serving_scope() -> Iterator[None]:
    """A request's whole handling, its response sent included: the body :func:`serving`
    names within it is let go of at its end."""
    box = _Serving()
    token = _SERVING.set(box)
    try:
        yield
    finally:
        box.raw = None
        _SERVING.reset(token)


class BodySource:
    """The request body being served (:func:`serving`), where held outputs are read back."""

    def __init__(self) -> None:
        self.reads = 0
        """Outputs read back so far (a conversation's later calls read none)."""

    def message(self, offset: int, length: int) -> Any:
        """The message in the ``length`` bytes at ``offset`` of the body being served (after
        the ``[`` or ``,`` and spaces before it)."""
        self.reads += 1
        box = _SERVING.get()
        raw = box.raw if box is not None else None
        if raw is None:
            raise OSError("no request is being served")
        data = raw[offset : offset + length]
        skip = _LEADING.match(data)
        return json.loads(data[skip.end() if skip else 0 :])

    def unreadable(self, handle: DeferredText, why: str | None) -> ValueError:
        """:class:`OutputNotCarried`."""
        return OutputNotCarried(
            f"the output of {handle.tool_use_id[:64]!r} is not in the request being served"
            + (f": {why}" if why is not None else "")
        )


BODY = BodySource()
"""The one source: every handle reads the body its task serves."""


def hold_outputs(source: Source, first: int) -> int:
    """Leave the long text outputs of ``source``'s messages from ``first - 1`` on but the last
    (``first``: the first new to its conversation) in its body: each becomes a handle naming
    its message's bytes. How many were left. The last message waits a call: the next request
    sends it without the cache marker the proxy may have added, so its bytes are written again,
    which reads its outputs. The blocks are changed in place: every holder of the parsed
    message (the reader's kept body, the records, the wire form) lets go of the text."""
    messages, ends = source.messages, source.ends
    held = 0
    for i in range(max(0, first - 1), min(len(messages), len(ends)) - 1):
        message = messages[i]
        content = message.get("content") if type(message) is dict else None
        if type(content) is not list:
            continue
        start = ends[i - 1] if i else source.array_open
        for k, block in enumerate(content):
            if type(block) is not dict or block.get("type") != "tool_result":
                continue
            text = block.get("content")
            tool_use_id = block.get("tool_use_id")
            if type(text) is not str or len(text) < HOLD_AT or type(tool_use_id) is not str:
                continue
            block["content"] = DeferredText(
                BODY, start, ends[i] - start, k, tool_use_id, len(text), crc32_of(text)
            )
            held += 1
    return held
