"""A circuit breaker for an object store: once the store is known to be down, it is not asked
again for a cool-down, and a call meanwhile fails at once (:class:`StoreBreaker`).

A store that stops answering costs each call its timeout and retries (several seconds with
:func:`~pipeline.store.sessions.in_turn_options`, ~30 s a turn when a turn makes several);
without memory of the failure every call of every conversation pays that again for as long
as the store hangs. The breaker remembers. It opens on a call that failed slowly (it waited on
the store: a timeout) or on the ``failures``-th quick failure in a row (the store refuses
everything); one quick failure alone does not open it, so a transient error costs only the
write it hit, not the records of the rest of its call. While open every call fails fast with
:class:`~pipeline.store.files.StoreError` (what callers already handle: a load that fails forwards
the request as the client sent it, a record that cannot be written is logged) until the
cool-down has passed; then one call probes the store (the others still fail fast), and its
success closes the breaker. An answer is not a failure: nothing at a key, a key that already
exists.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from pipeline.store.files import STORE_COOL_DOWN, StoreError
from pipeline.store.objects import ObjectStoreAPI, is_create_conflict

if TYPE_CHECKING:
    from obstore import GetOptions, GetResult, ListResult, ObjectMeta, PutMode, PutResult

__all__ = ["StoreBreaker"]

_T = TypeVar("_T")


class StoreBreaker:
    """``store`` (an :class:`~pipeline.store.objects.ObjectStoreAPI`) behind a circuit breaker;
    itself one. ``cool_down``: seconds after the store is found down during which no call
    reaches it; ``slow``: a failure after this many seconds finds it down; ``failures``: so do
    this many quick failures in a row; ``clock``: where the time comes from (monotonic
    seconds). Thread-safe."""

    def __init__(
        self,
        store: ObjectStoreAPI,
        *,
        cool_down: float = STORE_COOL_DOWN,
        slow: float = 1.0,
        failures: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not cool_down >= 0:  # NaN too
            raise ValueError(f"cool_down must be zero or more seconds, got {cool_down}")
        if not slow >= 0:
            raise ValueError(f"slow must be zero or more seconds, got {slow}")
        if failures < 1:
            raise ValueError(f"failures must be at least 1, got {failures}")
        self.store = store
        self.cool_down = cool_down
        self.slow = slow
        """A failure after this many seconds opens the breaker at once."""
        self.failures = failures
        """This many quick failures in a row open it."""
        self._clock = clock
        self._lock = threading.Lock()
        self._failed_at: float | None = None
        self._in_a_row = 0
        self._probing = False
        self.skipped = 0
        """Calls failed at once since the store last failed (for logs and tests)."""

    @property
    def open(self) -> bool:
        """Whether the store is being skipped now (it failed within the cool-down)."""
        with self._lock:
            return self._failed_at is not None and (
                self._probing or self._clock() - self._failed_at < self.cool_down
            )

    def _enter(self) -> bool:
        """Whether this call may go to the store (and is the probe); raises when skipped."""
        with self._lock:
            if self._failed_at is None:
                return False
            since = self._clock() - self._failed_at
            if since >= self.cool_down and not self._probing:
                self._probing = True
                return True
            self.skipped += 1
        wait = max(0.0, self.cool_down - since)
        raise StoreError(
            errno.EIO,
            f"the store failed {since:.0f} s ago: not asked again"
            + (f" for {wait:.0f} s" if wait else " until a probe answers"),
        )

    def _left(self, probe: bool, started: float, exc: BaseException | None) -> None:
        with self._lock:
            if probe:
                self._probing = False
            if exc is None or _is_answer(exc):
                self._failed_at = None
                self._in_a_row = 0
                self.skipped = 0
            elif isinstance(exc, Exception):  # a cancellation says nothing of the store
                now = self._clock()
                self._in_a_row += 1
                if probe or now - started >= self.slow or self._in_a_row >= self.failures:
                    self._failed_at = now

    def _call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        probe = self._enter()
        started = self._clock()
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            self._left(probe, started, exc)
            raise
        self._left(probe, started, None)
        return result

    def put(self, path: str, file: bytes, *, mode: PutMode | None = None) -> PutResult:
        """The store's ``put``, unless skipped."""
        return self._call(self.store.put, path, file, mode=mode)

    def get(self, path: str, *, options: GetOptions | None = None) -> GetResult:
        """The store's ``get``, unless skipped (the body's read is the caller's)."""
        return self._call(self.store.get, path, options=options)

    def head(self, path: str) -> ObjectMeta:
        """The store's ``head``, unless skipped."""
        return self._call(self.store.head, path)

    def list(
        self, prefix: str | None = None, *, offset: str | None = None
    ) -> Iterator[Sequence[ObjectMeta]]:
        """The store's ``list``, unless skipped. A listing is lazy: it reaches the store when
        read, so each batch is read under the breaker, and the first is what counts as a
        probe's answer (asking for the listing alone proves nothing)."""
        probe = self._enter()
        started = self._clock()
        try:
            batches = iter(self.store.list(prefix, offset=offset))
            batch = next(batches, None)
        except BaseException as exc:
            self._left(probe, started, exc)
            raise
        self._left(probe, started, None)
        while batch is not None:
            yield batch
            batch = self._call(next, batches, None)

    def list_with_delimiter(self, prefix: str | None = None) -> ListResult[Sequence[ObjectMeta]]:
        """The store's ``list_with_delimiter``, unless skipped."""
        return self._call(self.store.list_with_delimiter, prefix)

    def delete(self, paths: str | Sequence[str]) -> None:
        """The store's ``delete``, unless skipped."""
        self._call(self.store.delete, paths)


def _is_answer(exc: BaseException) -> bool:
    """Whether ``exc`` is the store answering (nothing there, already there), not failing."""
    return isinstance(exc, FileNotFoundError) or is_create_conflict(exc)
