"""A stage's per-session state, restored from its records on first use, and the records a
resumed session repeats its decisions from."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, TypeVar

import anyio.to_thread

from pipeline.context import SessionContext

__all__ = ["record_decision", "session_state", "write_off_loop"]

S = TypeVar("S")


def session_state(
    ctx: SessionContext,
    stage: str,
    kind: type[S],
    restore: Callable[[list[Mapping[str, Any]]], S],
) -> S:
    """``ctx.stage_state[stage]``; on a session's first pass, ``restore`` builds it from the
    stage's records (empty for a new session, the transcript's for a resumed one). Stage
    objects are shared by sessions, so what a stage remembers about one lives here."""
    state = ctx.stage_state.get(stage)
    if not isinstance(state, kind):
        state = restore(ctx.records_for(stage))
        ctx.stage_state[stage] = state
    return state


async def record_decision(ctx: SessionContext, stage: str, data: Mapping[str, Any]) -> None:
    """Keep a decision for resume (``ctx.record``), the fsync'd append off the event loop.

    A failed write is logged, never raised: the decision stands in this process (it is in the
    stage's state); only a resume would lose it.
    """
    await write_off_loop(ctx, partial(ctx.record, stage, data), stage=stage)


async def write_off_loop(ctx: SessionContext, write: Callable[[], None], *, stage: str) -> None:
    """Run a transcript append: in a worker thread when there is a transcript (an fsync'd
    write must not block the event loop), else inline. An ``OSError`` is logged
    (``stage_record.write_failed``), never raised."""
    try:
        if ctx.transcript is None:
            write()
        else:
            await anyio.to_thread.run_sync(write)
    except OSError as exc:
        ctx.logger.error("stage_record.write_failed", stage=stage, error=type(exc).__name__)
