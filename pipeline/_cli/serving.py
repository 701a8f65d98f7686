"""How ``proxy`` serves its app with uvicorn: bounds on what a connection may hold (the HTTP
protocols it serves on, and their bounds on a request: :mod:`pipeline._cli.http_protocols`).

- **Connections below the descriptor limit.** The soft limit on open files is raised to the
  hard one at start (:func:`raise_open_files`); :func:`connection_cap` is how many client
  connections to serve at once so that each, with its upstream connection, fits under it.
- **No call opens its records again.** Each conversation held keeps its record file open
  between calls (:mod:`pipeline.transcript.open_files`); :func:`records_held_open` is how
  many: one for each conversation the proxy holds, within an eighth of the descriptors. Past
  the library's default bound (64), each call of a proxy serving more conversations closed
  another's file and opened its own again (~10 system calls).
- **One line, not a flood.** At the descriptor limit asyncio logs every failed ``accept``
  with a traceback; :class:`OnceIn` lets one such record through per interval. It also tries
  the listening socket again a second later, even once the server has closed it (a traceback
  at shutdown): :class:`AcceptRetryAfterClose` drops that record.
"""

from __future__ import annotations

import logging
import resource
import time

from pipeline.transcript.open_files import MAX_OPEN

__all__ = [
    "AcceptRetryAfterClose",
    "OnceIn",
    "connection_cap",
    "raise_open_files",
    "records_held_open",
]

_RESERVED = 64
"""Descriptors kept out of the connection cap besides the record files held open: the store's
other files, logs, the listening socket."""
_MOST_OPEN_FILES = 1_048_576
"""Where the soft limit is raised to when the hard one is unlimited."""


def raise_open_files() -> int:
    """Raise the soft limit on open files to the hard one (as far as the system lets); the
    soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _MOST_OPEN_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass  # a container may forbid it: the limit stays as it was
    return _MOST_OPEN_FILES if soft == resource.RLIM_INFINITY else soft


def records_held_open(open_files: int, conversations: int) -> int:
    """How many record files to keep open between calls under ``open_files`` descriptors:
    one for each of the ``conversations`` held, within an eighth of the descriptors, and
    never fewer than the library's default (:data:`~pipeline.transcript.open_files.MAX_OPEN`)."""
    return max(MAX_OPEN, min(conversations, open_files // 8))


def connection_cap(open_files: int, records: int = MAX_OPEN) -> int:
    """How many client connections fit under ``open_files`` descriptors: each may hold an
    upstream connection too, and some are kept for the rest -- ``records`` record files held
    open and a few more (at least 16)."""
    return max(16, (open_files - _RESERVED - records) // 2)


class OnceIn(logging.Filter):
    """Lets one record whose message holds ``text`` through per ``interval`` seconds, and
    says how many it held back; every other record passes."""

    def __init__(self, text: str, interval: float = 10.0) -> None:
        super().__init__()
        self.text = text
        self.interval = interval
        self._last = -float("inf")
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.text not in record.getMessage():
            return True
        now = time.monotonic()
        if now - self._last < self.interval:
            self._held += 1
            return False
        if self._held:
            record.msg = f"{record.msg} ({self._held} more like it held back)"
        self._last, self._held = now, 0
        record.exc_info = None  # the same traceback each time: the line says it all
        record.exc_text = None
        return True


class AcceptRetryAfterClose(logging.Filter):
    """Drops asyncio's record of an accept retried on a listening socket already closed (the
    retry after a failed accept fires during shutdown: ``Invalid file descriptor: -1``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (
            "_start_serving" in record.getMessage()
            and isinstance(exc, ValueError)
            and "Invalid file descriptor" in str(exc)
        )
