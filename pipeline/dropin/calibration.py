"""When a conversation's token calibration is written (:class:`CalibrationSaves`).

The token tracker learns from every observed response; writing its state each time is a JSON
dump and a file write per call. It is written when the first call has been observed (a new
process starts warm), then at most every :data:`CALIBRATION_EVERY` seconds, whenever the
owner asks (a conversation reloaded, a server shutting down), and when the interpreter exits
(what it learned since its last write: a program run again starts where it stopped, and its
stages that decide on estimates decide as it would have). A write that fails is tried again
at the next chance. The calibration is an estimate, not a decision: a crash costs at most
that much learning.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.tokens import TokenTracker

__all__ = ["CALIBRATION_EVERY", "CalibrationSaves"]

CALIBRATION_EVERY = 2.0
"""Seconds between two writes of a conversation's token calibration."""


_UNSAVED: weakref.WeakSet[CalibrationSaves] = weakref.WeakSet()
"""The saves whose tracker learned since their last write: written at the interpreter's exit."""
_UNSAVED_LOCK = threading.Lock()


@atexit.register
def _write_unsaved() -> None:
    with _UNSAVED_LOCK:
        unsaved = list(_UNSAVED)
        _UNSAVED.clear()
    for saves in unsaved:
        state = saves.due(now=True)
        if state is not None:
            saves.write(state)


class CalibrationSaves:
    """The writes of one tracker's state to ``path``; ``state`` takes the tracker's state (on
    the owner's thread: the tracker is not to be read from another)."""

    def __init__(self, path: str | os.PathLike[str], state: Callable[[], dict[str, Any]]):
        self.path = path
        self._state = state
        self._dirty = False
        """The tracker learned since its state was last written."""
        self._saved = -math.inf
        """When it was last written (monotonic seconds)."""

    def learned(self) -> None:
        """The tracker learned from a call."""
        self._dirty = True
        with _UNSAVED_LOCK:
            _UNSAVED.add(self)

    def due(self, *, now: bool = False) -> dict[str, Any] | None:
        """The state to write when the tracker learned since the last write and that write is
        :data:`CALIBRATION_EVERY` seconds old (``now``: whatever its age); None otherwise."""
        at = time.monotonic()
        if not self._dirty or (not now and at - self._saved < CALIBRATION_EVERY):
            return None
        self._dirty, self._saved = False, at
        return self._state()

    def write(self, state: Mapping[str, Any], *, durable: bool = True) -> None:
        """Write ``state`` (blocking: a worker thread's job on an event loop); a write that
        fails (logged by the tracker) is tried again at the next chance."""
        if not TokenTracker.save_state(self.path, state, durable=durable):
            self._dirty = True
