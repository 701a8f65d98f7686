"""What a wire session's log holds and how a session starts again from it: the response
records (where each answer stands, its id and usage, the digests of the messages sent), a
fork record's inherited decisions, and the ledger rebuilt from them
(:class:`~pipeline.dropin.adapter.WireSession` writes them; a new process, another worker or a
branch reads them here)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.dropin.inheritance import FORK_RECORD, Inherited
from pipeline.logs import get_logger
from pipeline.messages import Message, Usage
from pipeline.replacement import (
    DECIDED_RECORD_STAGE,
    ReplacementRecord,
    ReplacementState,
    decided_in,
    decided_record,
)
from pipeline.results.keys import tool_use_id_of
from pipeline.transcript.read import StageRecord, Transcript

__all__ = [
    "RESPONSE_RECORD",
    "Expanded",
    "carried_records",
    "decisions",
    "expand",
    "holds_fork",
    "rebuild",
    "response_record",
    "responses_in",
]

RESPONSE_RECORD = "wire_session.response"
"""The stage record of an observed response: where its answer stands, its id and usage, and
the digests of the request's messages from where they changed (``chain_from``, ``chain``)."""

Responses = dict[int, tuple[str, Usage | None]]
"""The responses a session observed, by where their answers stand: id and usage."""


@dataclass(frozen=True, slots=True)
class Expanded:
    """A loaded log made whole: its records with what a fork record inherited put first, the
    chain of the messages it recorded sending, and whether it holds a response of its own."""

    transcript: Transcript
    chain: list[bytes]
    served: bool


def expand(loaded: Transcript, session_id: str) -> Expanded:
    """``loaded`` with what a fork record in it inherited put first, and the chain of the
    messages it recorded sending (the fork record's, then its own calls')."""
    records = loaded.stage_records
    fork = next((r.data for r in records if r.stage == FORK_RECORD), None)
    if fork is None:  # its own record could not be written: a response record carries it
        fork = next(
            (
                r.data["fork"]
                for r in records
                if r.stage == RESPONSE_RECORD and isinstance(r.data.get("fork"), Mapping)
            ),
            None,
        )
    own = [r for r in records if r.stage != FORK_RECORD]
    chain: list[bytes] = []
    if fork is not None:
        got, problems = Inherited.from_record(fork)
        if problems:
            get_logger(session_id=session_id).warning(
                "wire_session.record_unreadable", record=FORK_RECORD, parts=problems[:20]
            )
        loaded = dataclasses.replace(
            loaded,
            replacement_records=[*got.replacement_records, *loaded.replacement_records],
            stage_records=[*got.stage_records, *own],
        )
        chain = list(got.chain)
    else:
        loaded = dataclasses.replace(loaded, stage_records=own)
    for record in own:
        if record.stage == RESPONSE_RECORD:
            _restore_chain(chain, record.data)
    served = any(r.stage == RESPONSE_RECORD for r in own)
    return Expanded(loaded, chain, served)


def _restore_chain(chain: list[bytes], data: Mapping[str, Any]) -> None:
    start, digests = data.get("chain_from"), data.get("chain")
    if not isinstance(start, int) or isinstance(start, bool) or not isinstance(digests, list):
        return
    if not 0 <= start <= len(chain):
        return
    parsed = []
    for text in digests:
        try:
            parsed.append(bytes.fromhex(text))
        except (ValueError, TypeError):
            break  # what follows a bad link cannot be placed
    chain[start:] = parsed


def responses_in(records: Iterable[StageRecord]) -> Responses:
    """The responses the response records among ``records`` name (a malformed usage: none)."""
    found: Responses = {}
    for record in records:
        if record.stage != RESPONSE_RECORD:
            continue
        data = record.data
        index, rid, usage = data.get("index"), data.get("id"), data.get("usage")
        if not isinstance(index, int) or not isinstance(rid, str):
            continue
        try:
            parsed = Usage.from_mapping(usage) if isinstance(usage, Mapping) else None
        except ValueError:
            parsed = None
        found[index] = (rid, parsed)
    return found


def response_record(
    index: int,
    response_id: str,
    usage: Mapping[str, Any] | None,
    chain: Sequence[bytes],
    start: int | None,
    fork: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The record of a response whose answer stands at ``index``: its id, its usage, the
    digests of the request's messages from ``start``, where they part from what the records
    hold (none when the two are the same), and ``fork``, a fork record that could not be
    written on its own."""
    data: dict[str, Any] = {"index": index, "id": response_id}
    if usage is not None:
        data["usage"] = dict(usage)
    if fork is not None:
        data["fork"] = fork
    if start is not None:
        # the messages this conversation sent, from where the records differ: for a new
        # process or another worker to place its requests (see pipeline.dropin.conversations)
        data["chain_from"] = start
        data["chain"] = [c.hex() for c in chain[start:]]
    return data


def rebuild(records: Sequence[Message], restored: Transcript) -> tuple[ReplacementState, set[str]]:
    """A new process's ledger, or a conversation's that went another way: from the recorded
    decisions and this request's history -- all of them, also on results it does not hold (a
    retry of an earlier one): each applies only to its own output. And the results it counts
    as sent whole only by where they stand (the model answered after them), to be recorded as
    decided: a later request that holds one last (a retry of an earlier one, after another
    restart) must not decide it again."""
    decided = decided_in(restored.stage_records)
    state = ReplacementState.reconstruct(
        records, restored.replacement_records, decided=decided, keep_absent=True
    )
    return state, state.seen_ids - decided - state.replacements.keys()


def holds_fork(loaded: Transcript) -> bool:
    """Whether a log holds what a branch inherited (its fork record, or a response record that
    carries it)."""
    return any(
        r.stage == FORK_RECORD or (r.stage == RESPONSE_RECORD and "fork" in r.data)
        for r in loaded.stage_records
    )


def decisions(
    restored: Transcript | None, state: ReplacementState, results: Collection[str] | None
) -> tuple[list[ReplacementRecord], set[str]]:
    """The decisions on the results whose ledger keys are ``results`` (default all) of a
    session whose ledger is ``state``, or, while it is ``restored`` (loaded, not yet rebuilt),
    those records: their replacement records, and the keys of those it sent whole. Each lookup
    is one step, whatever another thread does; with ``results``, only those are looked up
    (never a copy of the whole ledger)."""
    if restored is not None:  # loaded, not yet rebuilt: its records are the ledger
        records = list(restored.replacement_records)
        seen = decided_in(restored.stage_records)
    else:
        if results is None:
            replacements, seen = dict(state.replacements), set(state.seen_ids)
        else:
            ids = {tool_use_id_of(k) for k in results}
            # a ledger rebuilt from records without digests holds bare ids
            asked = {*results, *ids, *(f"{i}#" for i in ids)}
            replacements = {k: t for k in asked if (t := state.replacements.get(k)) is not None}
            seen = {k for k in results if k in state.seen_ids}
        records = [
            ReplacementRecord(tid, text, digest=key[len(tid) + 1 :] or None)
            for key, text in replacements.items()
            for tid in (tool_use_id_of(key),)
        ]
    if results is not None:
        keep = set(results)
        ids = {tool_use_id_of(k) for k in keep}
        records = [r for r in records if (r.key in keep if r.digest else r.tool_use_id in ids)]
        seen &= keep
    return records, seen


def carried_records(
    stage_records: Iterable[StageRecord], responses: Responses, seen: set[str], at: int
) -> list[StageRecord]:
    """The stage records a conversation that shares the first ``at`` messages of one with
    ``stage_records`` and ``responses`` takes with it: the other's stages' own, one record of
    the results ``seen`` sent whole, and the responses to its calls within those messages."""
    kept = [
        r
        for r in stage_records
        if r.stage not in (FORK_RECORD, RESPONSE_RECORD, DECIDED_RECORD_STAGE)
    ]
    if seen:
        kept.append(StageRecord(DECIDED_RECORD_STAGE, decided_record(seen)))
    for index in sorted(i for i in responses if i < at):
        rid, usage = responses[index]
        data: dict[str, Any] = {"index": index, "id": rid}
        if usage is not None:
            data["usage"] = usage.to_mapping()
        kept.append(StageRecord(RESPONSE_RECORD, data))
    return kept
