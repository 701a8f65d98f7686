"""When a conversation's token calibration is written (:class:`CalibrationSaves`).

The token tracker learns from every observed response; writing its state each time is a JSON
dump and a file write per call. It is written when the first call has been observed (a new
process starts warm), then at most every :data:`CALIBRATION_EVERY` seconds, and whenever the
owner asks (a conversation reloaded, a server shutting down). ``wrap`` writes it after every
call instead, off the caller's thread (:meth:`CalibrationSaves.stage`, the thread that makes
its records durable): a program run again starts where it stopped, and its stages that
decide on estimates decide as it would have. A write that fails is tried again at the next
chance. The calibration is an estimate, not a decision: a crash costs at most that much
learning.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.tokens import TokenTracker

__all__ = ["CALIBRATION_EVERY", "CalibrationSaves", "load_calibration"]

CALIBRATION_EVERY = 2.0
"""Seconds between two writes of a conversation's token calibration."""


_STAGED: weakref.WeakValueDictionary[str, CalibrationSaves] = weakref.WeakValueDictionary()
"""By calibration path: the saves with a state staged and maybe not written yet."""


def load_calibration(path: str | os.PathLike[str]) -> TokenTracker:
    """The tracker saved at ``path`` (:meth:`TokenTracker.load`; blocking), after writing the
    state this process staged for it, if one waits: a conversation opened again in the same
    process (a second client, one let go and loaded again) starts from what it learned last,
    not from the write before."""
    saves = _STAGED.get(os.fspath(path))
    if saves is not None:
        saves.write_staged()
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
        self._staging = threading.Lock()
        self._staged: dict[str, Any] | None = None
        """The state :meth:`stage` took, not yet written."""

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

    def stage(self) -> bool:
        """Take the state to write when the tracker learned since the last write, whatever that
        write's age (on the owner's thread); :meth:`write_staged` writes it (on any thread).
        Whether there is one."""
        state = self.due(now=True)
        if state is None:
            return False
        with self._staging:
            self._staged = state
        _STAGED[os.fspath(self.path)] = self
        return True

    def write_staged(self) -> None:
        """Write the state :meth:`stage` took last, if not written yet (blocking; no fsync:
        an estimate). Safe from any thread; the latest state staged wins."""
        with self._staging:
            state, self._staged = self._staged, None
        if state is not None:  # (not into a conversation removed meanwhile)
            TokenTracker.save_state(self.path, state, durable=False, parents=False)

    def write(self, state: Mapping[str, Any], *, durable: bool = True) -> None:
        """Write ``state`` (blocking: a worker thread's job on an event loop); a write that
        fails (logged by the tracker) is tried again at the next chance."""
        if not TokenTracker.save_state(self.path, state, durable=durable):
            self._dirty = True
