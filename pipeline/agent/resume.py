"""Continuing a session: an :class:`~pipeline.agent.Agent` rebuilt from its records, with the
budget's ledger reconstructed and the tool pairing repaired, so its next requests are
byte-identical to what the session would have sent."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anthropic

from pipeline.agent.repair import repair_pairing
from pipeline.context import SessionContext
from pipeline.core import Pipeline
from pipeline.kept_list import KeptList
from pipeline.replacement import ReplacementState, decided_in
from pipeline.store.files import ToolResultStore
from pipeline.store.records import RecordLog
from pipeline.store.sessions import SessionStorage
from pipeline.tokens import TokenTracker, calibration_path_for
from pipeline.tools import Tool
from pipeline.transcript.read import Transcript, TranscriptWriter, load_transcript
from pipeline.wire.pairing import PairingError

if TYPE_CHECKING:
    from pipeline.agent.loop import Agent

__all__ = ["load_for_resume", "load_stored_for_resume", "resumed", "store_root_of"]


def store_root_of(transcript_path: str | os.PathLike[str], session_id: str) -> Path:
    """The store root a session's transcript belongs to: ``ROOT`` for
    ``ROOT/<session_id>/transcript.jsonl`` (wherever the caller stands), else ``.sluicegate``."""
    beside = Path(transcript_path).resolve().parent
    return beside.parent if beside.name == session_id else Path(".sluicegate")


def load_for_resume(
    transcript_path: str | os.PathLike[str], root: str | os.PathLike[str] | None
) -> tuple[Transcript, TranscriptWriter, str | os.PathLike[str]]:
    """A transcript to resume from (a torn last line skipped; ``ValueError`` when it names no
    session), the writer that goes on appending to it, and the store root (``root``, else
    :func:`store_root_of` the transcript)."""
    path = Path(transcript_path)
    loaded = load_transcript(path, strict=False)
    session_id = loaded.session_id
    if session_id is None:
        raise ValueError(f"{path}: no session id in the transcript")
    writer = TranscriptWriter(path, session_id)
    return loaded, writer, store_root_of(path, session_id) if root is None else root


def load_stored_for_resume(storage: SessionStorage) -> Transcript:
    """A session's records wherever they live, to resume from; ``ValueError`` when nothing is
    recorded."""
    loaded = storage.load()
    if loaded is None or not loaded.messages:
        raise ValueError(f"no recorded messages for session {storage.session_id!r}")
    loaded.session_id = storage.session_id
    return loaded


def resumed(
    cls: type[Agent],
    loaded: Transcript,
    client: anthropic.AsyncAnthropic,
    *,
    transcript: RecordLog,
    root: str | os.PathLike[str],
    model: str,
    pipeline: Pipeline,
    tools: Iterable[Tool],
    store: ToolResultStore | None = None,
    **kwargs: Any,
) -> Agent:
    """An agent on ``loaded``'s records: the ledger rebuilt from them, the pairing repaired
    (``PairingError`` when it cannot be), the saved calibration loaded, repaired trailing
    results appended to ``transcript``."""
    session_id = loaded.session_id
    assert session_id is not None
    repair = repair_pairing(loaded.messages)
    if repair.remaining:
        raise PairingError(repair.remaining)
    state = ReplacementState.reconstruct(
        repair.messages,
        loaded.replacement_records,
        decided=decided_in(loaded.stage_records),
    )
    ctx = SessionContext(
        session_id,
        root,
        store=store,
        replacement_state=state,
        # the calibration saved with the session: a resumed session does not start cold
        token_tracker=TokenTracker.load(calibration_path_for(root, session_id)),
        transcript=transcript,
        stage_records=loaded.stage_records,
    )
    if repair.answered or repair.dropped or repair.moved:
        ctx.logger.warning(
            "resume_repaired_pairing",
            answered=len(repair.answered),
            dropped=len(repair.dropped),
            moved=len(repair.moved),
        )
    agent = cls(client, model=model, pipeline=pipeline, ctx=ctx, tools=tools, **kwargs)
    agent.history = KeptList(repair.messages)
    if repair.trailing and ctx.transcript is not None:
        # at the end of the history they stand where a later load puts them
        ctx.transcript.append_messages(repair.trailing)
    return agent
