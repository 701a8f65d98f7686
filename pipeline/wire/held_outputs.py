"""A held conversation's long texts left in the request that carries them
(:func:`hold_outputs`), read back from the request being served where a reader needs one.

A client re-sends its whole conversation on every call, and the body reader hands each message
of a repeated prefix back as the object it parsed before (:mod:`pipeline.wire.body_reader`),
at the same byte offset: the prefix is the same bytes from the body's first byte on. So a text
the proxy has passed on is in every later request of its conversation again, at the same
place, and the proxy need not hold it between calls. Once a request has been written, each
text of at least :data:`HOLD_AT` characters among its new messages (the last two messages' a
call later) -- a tool output, a tool call's input value, a text or thinking block, an image's
data -- becomes a :class:`~pipeline.wire.deferred.DeferredText` naming its message's bytes;
a reader that meets one (``str()``, :func:`~pipeline.wire.deferred.resolved`, the encoders'
hooks) parses it from the body being served (:func:`serving`). The body writer takes an
unchanged message's bytes from the request without reading it, so a growing conversation's
later calls read none; a stage that looks at an old output again (microcompact weighing its
oldest kept result, the messages after a snip's cut written again) reads a few.

A handle is read only from the request being served in this task, checked against its block's
tool id, its place in the block, its length and CRC-32: bytes that hold another text (a
request that no longer carries it) are :class:`OutputNotCarried`, never another
conversation's text. The proxy holds texts only under a pipeline whose stages never read one
again on a later pass (``rereads_outputs = False``: :func:`~pipeline.core.rereading_stages`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pipeline.wire.cache import EDITABLE
from pipeline.wire.deferred import OUTPUT, DeferredText, crc32_of
from pipeline.wire.shared_strings import SHARED_MAX
from pipeline.wire.source import Source

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
"""Characters from which a text is left in the request: a handle costs ~150 bytes, such a
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
        what = (
            f"the output of {handle.tool_use_id[:64]!r}"
            if handle.path == OUTPUT
            else f"the {'.'.join(handle.path)[:64]} of block {handle.block}"
        )
        return OutputNotCarried(
            f"{what} is not in the request being served" + (f": {why}" if why is not None else "")
        )


BODY = BodySource()
"""The one source: every handle reads the body its task serves."""


def hold_outputs(source: Source, first: int) -> int:
    """Leave the long texts of ``source``'s messages from ``first - 2`` on but the last two
    (``first``: the first new to its conversation) in its body: each becomes a handle naming
    its message's bytes. How many were left. The last two messages wait a call: the wire form
    hands them on as fresh copies (:data:`~pipeline.wire.cache.EDITABLE`), which the proxy may
    mark for the cache, so the next request's writer writes their bytes again, which reads
    their texts. The blocks are changed in place: every holder of the parsed message (the
    reader's kept body, the records, the wire form) lets go of the text.

    The texts left: a tool_result's output when it is a string (a block list is read by the
    harness split and the preview checks: left as it is), each string value of a tool call's
    input, a text block's text, a thinking block's text and signature, and the data of a
    base64 image or document -- each of :data:`HOLD_AT` characters and more."""
    messages, ends = source.messages, source.ends
    held = 0
    for i in range(max(0, first - EDITABLE), min(len(messages), len(ends)) - EDITABLE):
        message = messages[i]
        content = message.get("content") if type(message) is dict else None
        if type(content) is not list:
            continue
        start = ends[i - 1] if i else source.array_open
        length = ends[i] - start
        for k, block in enumerate(content):
            if type(block) is dict:
                held += _hold_block(block, k, start, length)
    return held


_TEXT = ("text",)
_THINKING = ("thinking",)
_SIGNATURE = ("signature",)
_DATA = ("source", "data")
_INPUT_PATHS: dict[str, tuple[str, str]] = {}
"""One path tuple for each input name met (a few: ``command``, ``content``, ``new_string``...);
names of at most :data:`~pipeline.wire.shared_strings.SHARED_MAX` characters."""
_INPUT_NAMES = 1024
"""Input names given a shared path, at most (past it, each handle has its own)."""


def _hold_block(block: dict[str, Any], k: int, start: int, length: int) -> int:
    kind = block.get("type")
    if kind == "tool_result":
        ident = block.get("tool_use_id")
        return type(ident) is str and _hold(block, "content", k, start, length, ident, OUTPUT)
    if kind == "tool_use":
        ident, given = block.get("id"), block.get("input")
        if type(ident) is not str or type(given) is not dict:
            return 0
        held = 0
        for name, value in given.items():
            if type(name) is str and type(value) is str and len(value) >= HOLD_AT:
                held += _hold(given, name, k, start, length, ident, _input_path(name))
        return held
    if kind == "text":
        return _hold(block, "text", k, start, length, "", _TEXT)
    if kind == "thinking":
        return _hold(block, "thinking", k, start, length, "", _THINKING) + _hold(
            block, "signature", k, start, length, "", _SIGNATURE
        )
    if kind in ("image", "document"):
        data = block.get("source")
        if type(data) is dict and data.get("type") == "base64":
            return _hold(data, "data", k, start, length, "", _DATA)
    return 0


def _input_path(name: str) -> tuple[str, str]:
    path = _INPUT_PATHS.get(name)
    if path is None:
        path = ("input", name)
        # a client's names, kept for the process's life: a few short ones, never a long one
        if len(name) <= SHARED_MAX and len(_INPUT_PATHS) < _INPUT_NAMES:
            _INPUT_PATHS[name] = path
    return path


def _hold(
    holder: dict[str, Any],
    key: str,
    k: int,
    start: int,
    length: int,
    ident: str,
    path: tuple[str, ...],
) -> bool:
    text = holder.get(key)
    if type(text) is not str or len(text) < HOLD_AT:
        return False
    holder[key] = DeferredText(BODY, start, length, k, ident, len(text), crc32_of(text), path)
    return True
