"""When a conversation's token calibration is written (:class:`CalibrationSaves`).

The token tracker learns from every observed response; writing its state each time is a JSON
dump and a file write per call. It is written when the first call has been observed (a new
process starts warm), then at most every :data:`CALIBRATION_EVERY` seconds, and whenever the
owner asks (a conversation reloaded, a server shutting down). ``wrap`` writes it after every
call instead, on the call's own path and in place (:meth:`CalibrationSaves.rewrite`: a JSON
dump and a ``pwrite``, ~15 µs; the first write of a conversation creates the file): a program
run again starts where it stopped, and its stages that decide on estimates decide as it
would have; and once a call has returned, nothing new appears under the root on its account
(a program may remove its root right after). A write that fails is tried again at the next
chance. The calibration is an estimate, not a decision: a crash costs at most that much
learning.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.tokens import TokenTracker
from pipeline.tokens.state_file import rewrite_state, write_state

__all__ = ["CALIBRATION_EVERY", "CalibrationSaves", "load_calibration"]

CALIBRATION_EVERY = 2.0
"""Seconds between two writes of a conversation's token calibration."""


_REWRITING = threading.Lock()
"""Held around each in-place write and each load: a conversation opened again in this process
(a second client's thread) never reads a state half rewritten."""


def load_calibration(path: str | os.PathLike[str]) -> TokenTracker:
    """The tracker saved at ``path`` (:meth:`TokenTracker.load`; blocking), never while this
    process rewrites it in place."""
    with _REWRITING:
        return TokenTracker.load(path)


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

    def due(self, *, now: bool = False) -> dict[str, Any] | None:
        """The state to write when the tracker learned since the last write and that write is
        :data:`CALIBRATION_EVERY` seconds old (``now``: whatever its age); None otherwise."""
        at = time.monotonic()
        if not self._dirty or (not now and at - self._saved < CALIBRATION_EVERY):
            return None
        self._dirty, self._saved = False, at
        return self._state()

    def rewrite(self) -> None:
        """Write the state, when the tracker learned since the last write (blocking, ~15 µs:
        on the owner's thread), in place (:func:`~pipeline.tokens.state_file.rewrite_state`);
        the first time, a new file written atomically; not into a conversation removed
        meanwhile. A failed write is tried again after the next call."""
        state = self.due(now=True)
        if state is None:
            return
        with _REWRITING:
            done = rewrite_state(self.path, state)
            if done is None:  # none of its own yet (or something planted there: replaced)
                done = write_state(self.path, state, durable=False, parents=False)
        if not done:
            self._dirty = True

    def write(self, state: Mapping[str, Any], *, durable: bool = True) -> None:
        """Write ``state`` (blocking: a worker thread's job on an event loop); a write that
        fails (logged by the tracker) is tried again at the next chance."""
        if not TokenTracker.save_state(self.path, state, durable=durable):
            self._dirty = True
