"""What a wire session writes and makes durable (:class:`SessionWrites`): its records as each
call goes, then, off the response's path, the ``fsync`` of them, the token calibration, and on
an object store the spool's results and the call's snapshot."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio.to_thread

from pipeline.context import SessionContext
from pipeline.dropin.calibration import CalibrationSaves
from pipeline.dropin.group_sync import GroupSync
from pipeline.dropin.thread_sync import ThreadSync
from pipeline.gate import describe_error
from pipeline.replacement import ReplacementRecord
from pipeline.store.records import flush_held
from pipeline.store.sessions import SessionStorage

__all__ = ["SessionWrites"]


class SessionWrites:
    """The writes of one session to ``storage``, logged through ``ctx``'s logger; ``saves``:
    when its token calibration is written. A failure is logged, never raised."""

    def __init__(self, storage: SessionStorage, saves: CalibrationSaves, ctx: SessionContext):
        self.storage = storage
        self.saves = saves
        self.ctx = ctx

    def appended(self, stage: str, data: Mapping[str, Any] | Sequence[ReplacementRecord]) -> bool:
        """Append a stage record, or (a sequence) replacement records (blocking); whether it
        was written. A failure is logged (``stage_record.write_failed``, which one without
        content), never raised."""
        transcript = self.ctx.transcript
        if transcript is None:
            return False
        if isinstance(data, Mapping):
            return self._logged(stage, transcript.append_stage_record, stage, data)
        return self._logged(stage, transcript.append_replacements, data)

    def flush_held(self) -> bool:
        """Write the records the session's log holds back (a stage's decision that a crash
        may lose without harm) now (blocking): whether nothing failed. A failure is logged,
        never raised."""
        return self._logged("held", flush_held, self.ctx.transcript)

    def _logged(self, stage: str, write: Callable[..., object], *args: Any) -> bool:
        """``write(*args)``; False, logged (which failure, without content), when it fails."""
        try:
            write(*args)
        except OSError as exc:
            self.ctx.logger.error(
                "stage_record.write_failed",
                stage=stage,
                error=type(exc).__name__,
                detail=describe_error(exc),
            )
            return False
        return True

    def learned(self) -> dict[str, Any] | None:
        """The tracker learned from a response: the calibration to write now (blocking), when
        nothing writes it later (a store whose appends were each durable: nothing settles)."""
        self.saves.learned()
        return self.saves.due() if self.storage.sync is None else None

    async def save_calibration(self) -> None:
        """Write the token calibration now if it learned since its last write (a worker
        thread writes it). For a server shutting down or a conversation loaded again: writes
        are spaced :data:`~pipeline.dropin.calibration.CALIBRATION_EVERY` apart otherwise."""
        state = self.saves.due(now=True)
        if state is not None:
            await anyio.to_thread.run_sync(self.saves.write, state)

    async def settle(self, group: GroupSync | None = None) -> None:
        """:meth:`~pipeline.dropin.adapter.WireSession.settle`."""
        if not self._settles:
            return
        storage = self.storage
        state = self.saves.due() if storage.sync is not None else None
        only_sync = state is None and storage.drain is None and storage.compact is None
        if group is not None and group.running and only_sync:
            group.add(self.sync_records)
            return
        await anyio.to_thread.run_sync(self._settled, state)

    def settle_in(self, syncer: ThreadSync) -> bool:
        """:meth:`settle_sync` with the records' ``fsync`` handed to ``syncer``'s thread, when
        that and the calibration are all there is (a local store whose appends were written
        at once); the calibration written here after every call that taught it something,
        in place (a process that ends, or loads the conversation again, finds it; nothing is
        left to write under the root once the call returns). False, doing nothing, when there
        is more (an object store's spool and snapshot): the caller settles itself."""
        storage = self.storage
        if storage.sync is None or storage.drain is not None or storage.compact is not None:
            return False
        syncer.add(self.sync_records)
        self.saves.rewrite()  # each call's: a program run again decides as this one would
        return True

    def settle_sync(self) -> None:
        """:meth:`settle`, blocking (the synchronous client's path)."""
        if not self._settles:
            return
        state = self.saves.due() if self.storage.sync is not None else None
        self._settled(state)

    @property
    def _settles(self) -> bool:
        storage = self.storage
        return not (storage.sync is None and storage.drain is None and storage.compact is None)

    def sync_records(self) -> None:
        """Make the records appended so far durable (blocking); a failure is logged."""
        sync = self.storage.sync
        if sync is not None:
            try:
                sync()
            except OSError as exc:
                self.ctx.logger.error(
                    "stage_record.sync_failed", error=type(exc).__name__, detail=describe_error(exc)
                )

    def _settled(self, calibration: Mapping[str, Any] | None) -> None:
        drain = self.storage.drain
        self.sync_records()
        if calibration is not None:  # an estimate, not a decision: no fsync
            self.saves.write(calibration, durable=False)
        if drain is not None:
            try:
                drain()
            except OSError as exc:  # the local spool itself failed: its results wait on
                self.ctx.logger.error("store.spool_failed", error=type(exc).__name__)
        if self.storage.compact is not None:
            try:
                self.storage.compact()
            except OSError as exc:  # a cache: a worker new to the conversation reads records
                self.ctx.logger.warning("records.snapshot_failed", error=type(exc).__name__)
