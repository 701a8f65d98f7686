"""A stage's per-session state, restored from its records on first use, and the records a
resumed session repeats its decisions from.

A record comes from the transcript, a file that may be damaged or edited: the loader only
knows that a ``stage-record`` holds an object, so the shape of that object is checked by the
stage that wrote it (:func:`parse_records`), and so are the promises its decisions keep (a
restored removal never takes a record the stage would have kept: :func:`kept_uuids`). A
record that fails either is left out with a warning: the session goes on as if that decision
had never been made, and the stage decides again from the history it sees.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

from pipeline.context import SessionContext
from pipeline.gate import describe_error
from pipeline.messages import live_start
from pipeline.store.records import append_where_it_belongs
from pipeline.tokens.checks import bounded_repr
from stages._shared.rounds import RoundView

__all__ = [
    "RoundRecord",
    "RoundStage",
    "check_optional_str",
    "kept_uuids",
    "parse_records",
    "record_decision",
    "restore_round_records",
    "session_state",
    "write_off_loop",
]

S = TypeVar("S")
D = TypeVar("D")


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


def parse_records(
    ctx: SessionContext,
    stage: str,
    records: Iterable[Mapping[str, Any]],
    parse: Callable[[Mapping[str, Any]], D],
) -> list[D]:
    """``parse`` applied to each of a stage's restored records, in order. A record it rejects
    (``ValueError``, or any error a malformed shape raises on the way) is left out and logged
    (``stage_record.ignored``, with the stage, the record's position and the reason): a
    damaged record must cost at most that one decision, never the turn."""
    out: list[D] = []
    for index, data in enumerate(records):
        try:
            out.append(parse(data))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            reason = str(exc) if isinstance(exc, ValueError) else type(exc).__name__
            ctx.logger.warning(
                "stage_record.ignored", stage=stage, record=index, reason=reason[:300]
            )
    return out


def check_uuid_list(value: Any, name: str) -> tuple[str, ...]:
    """A non-empty list of non-empty strings (the uuids a decision names), as a tuple."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name!r} must be a non-empty list of uuids, got {bounded_repr(value)}")
    for u in value:
        if not isinstance(u, str) or not u:
            raise ValueError(f"{name!r} holds {bounded_repr(u)}, not a uuid")
    return tuple(value)


def check_optional_str(value: Any, name: str) -> str | None:
    """``value`` when it is a string or None (a field a record may leave out)."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name!r} must be a string or null, got {bounded_repr(value)}")
    return value


def kept_uuids(view: RoundView, keep_recent: int) -> frozenset[str]:
    """uuids of the records a stage that cuts whole rounds must keep in ``view``'s history:
    everything after the last compact boundary that is not in a round it may take -- the
    records before the first response (the first user message among them) and the protected
    rounds (:func:`~stages._shared.rounds.protected_rounds`: the first user message, the
    latest prompt, the usage anchor and the last ``keep_recent`` rounds)."""
    messages = view.messages
    takeable = [False] * len(messages)
    for s, e, protected in view.rounds(keep_recent):
        if not protected:
            takeable[s:e] = [True] * (e - s)
    start = live_start(messages)
    return frozenset(m.uuid for i, m in enumerate(messages) if i >= start and not takeable[i])


def check_not_kept(uuids: Iterable[str], kept: Collection[str], stage: str) -> None:
    """``ValueError`` when a restored decision names a record the stage keeps (a uuid shared
    with such a record counts: a removal by uuid would take both)."""
    hit = next((u for u in uuids if u in kept), None)
    if hit is not None:
        raise ValueError(f"names {bounded_repr(hit)}, a record {stage} always keeps")


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """What a recorded decision over whole rounds names: the records it took, and the usage
    anchor when it took them (its freed tokens count against that usage)."""

    uuids: tuple[str, ...]
    anchor: str | None


class RoundStage(Protocol):
    """A stage that takes whole old rounds, as :func:`restore_round_records` reads it."""

    name: str
    strategy: str
    keep_recent_rounds: int


def restore_round_records(
    ctx: SessionContext,
    stage: RoundStage,
    view: RoundView,
    records: list[Mapping[str, Any]],
    *,
    uuids_key: str,
    build: Callable[[RoundRecord, Mapping[str, Any]], D],
) -> list[D]:
    """The decisions ``stage`` recorded, checked as :func:`parse_records` checks them: each
    names its records under ``uuids_key`` (and its ``anchor``), none of them one the stage
    keeps in ``view``'s history (:func:`kept_uuids` with its ``keep_recent_rounds``: a forged
    or damaged record), and ``build`` makes the stage's decision of it (raising
    ``ValueError`` on the stage's own fields)."""
    if not records:
        return []
    kept = kept_uuids(view, stage.keep_recent_rounds)
    strategy = stage.strategy

    def parse(data: Mapping[str, Any]) -> D:
        if data.get("strategy", strategy) != strategy:
            raise ValueError(f"not a {strategy} record")
        uuids = check_uuid_list(data.get(uuids_key), uuids_key)
        anchor = check_optional_str(data.get("anchor"), "anchor")
        check_not_kept(uuids, kept, stage.name)
        return build(RoundRecord(uuids, anchor), data)

    return parse_records(ctx, stage.name, records, parse)


async def record_decision(ctx: SessionContext, stage: str, data: Mapping[str, Any]) -> None:
    """Keep a decision for resume (``ctx.record``), the fsync'd append off the event loop.

    A failed write is logged, never raised: the decision stands in this process (it is in the
    stage's state); only a resume would lose it.
    """
    await write_off_loop(ctx, partial(ctx.record, stage, data), stage=stage)


async def write_off_loop(ctx: SessionContext, write: Callable[[], None], *, stage: str) -> None:
    """Run a transcript append: in a worker thread when its appends may wait (an fsync'd
    write must not block the event loop: :func:`~pipeline.store.records.appends_block`), else
    inline. An ``OSError`` is logged (``stage_record.write_failed``), never raised."""
    try:
        await append_where_it_belongs(ctx.transcript, write)
    except OSError as exc:
        ctx.logger.error(
            "stage_record.write_failed",
            stage=stage,
            error=type(exc).__name__,
            detail=describe_error(exc),  # ENOSPC, EROFS: which failure, without content
        )
