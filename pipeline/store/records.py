"""Where a session's records go: the narrow protocol every transcript backend implements.

A session appends three kinds of records as it goes -- the conversation's messages, the budget's
``content-replacement`` entries and stages' ``stage-record`` decisions -- and a resumed session
(or another worker) loads them back to repeat every decision byte for byte. The local backend is
:class:`~pipeline.transcript.read.TranscriptWriter` (one JSONL file); the object-store backend is
:class:`~pipeline.store.object_records.ObjectRecordLog` (one immutable object per append).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import anyio.to_thread

from pipeline.messages import Message
from pipeline.replacement import ReplacementRecord

__all__ = ["RecordLog", "append_where_it_belongs", "appends_block", "flush_held", "hold_back"]

_R = TypeVar("_R")


@runtime_checkable
class RecordLog(Protocol):
    """An append-only log of a session's records.

    The methods block (a file's ``fsync``, an object store's request): callers on an event loop
    run them in a worker thread. An append either lands whole or raises ``OSError``; callers
    that must not fail a turn log that and go on (the decision stands in this process, only a
    resume would lose it).
    """

    def append_messages(self, messages: Sequence[Message]) -> None:
        """Append messages, chaining ``parentUuid`` from the last message this log knows."""
        ...

    def append_replacements(self, records: Sequence[ReplacementRecord]) -> None:
        """Append one ``content-replacement`` entry holding ``records`` (no-op when empty)."""
        ...

    def append_stage_record(self, stage: str, data: Mapping[str, Any]) -> None:
        """Append a ``stage-record``: a stage's decision a resumed session must repeat."""
        ...


def appends_block(log: object) -> bool:
    """Whether an append to ``log`` may wait long enough that an event loop must not make it
    itself: True unless the log says otherwise with an ``append_blocks`` attribute (a local
    file whose appends are made durable later, in one ``fsync`` off the loop, says False: an
    append is then a write to the page cache, cheaper than a hand-off to a worker thread)."""
    return bool(getattr(log, "append_blocks", True))


def hold_back(log: object | None, stage: str, data: Mapping[str, Any]) -> bool:
    """Leave a ``stage-record`` that a crash may lose without harm (a new process finds the
    decision again) to ``log``'s next write, where the log can hold one back: a local file whose
    appends are made durable later has an ``append_stage_record_later`` that says whether it
    took it. False: the caller appends it as any other."""
    later = getattr(log, "append_stage_record_later", None)
    return bool(later is not None and later(stage, data))


def flush_held(log: object | None) -> None:
    """Write what ``log`` holds back (:func:`hold_back`) now, where it holds anything (a log
    that can hold records back has a ``write_held``)."""
    write_held = getattr(log, "write_held", None)
    if write_held is not None:
        write_held()


async def append_where_it_belongs(log: object | None, append: Callable[..., _R], *args: Any) -> _R:
    """``append(*args)``, an append to ``log``: in a worker thread where it may wait
    (:func:`appends_block`), else here (no log, or one whose appends are a page-cache write:
    a hand-off would cost more)."""
    if log is not None and appends_block(log):
        return await anyio.to_thread.run_sync(append, *args)
    return append(*args)
