"""sluicegate: decide what of an agent's conversation goes over the wire, before every call.

The library in one screen::

    Message, Usage            one conversation record; a response's token usage
    Pipeline, Stage, stage    ordered async stages (``stages.default_stages()`` is the default list)
    SessionContext            one session's shared state: ledger, token tracker, store, transcript
    to_api                    records -> the ``messages`` array of a Messages API request
    load_transcript           read a session transcript (Claude Code JSONL)
    TranscriptWriter          append to one
    ReplacementState          the ledger of what the model has seen (frozen budget decisions)
    TokenTracker              context size = last real usage + an estimate of what came after
    ToolPolicies              per-tool persistence thresholds
    ToolResultStore           where oversized results go (FileToolResultStore: local files)

The concrete stages live in the ``stages`` package; test doubles in ``pipeline.testing``; an
agent loop on the anthropic SDK in ``pipeline.agent``; replaying recorded sessions in
``pipeline.transcript.replay``.
"""

from pipeline.context import SessionContext
from pipeline.core import Pipeline, PipelineHalt, Stage, StageError, stage
from pipeline.messages import Message, Usage
from pipeline.policies import ToolPolicies
from pipeline.replacement import ReplacementState
from pipeline.store.files import FileToolResultStore, ToolResultStore
from pipeline.tokens import TokenTracker
from pipeline.transcript.read import TranscriptWriter, load_transcript
from pipeline.wire.form import to_api

__all__ = [
    "FileToolResultStore",
    "Message",
    "Pipeline",
    "PipelineHalt",
    "ReplacementState",
    "SessionContext",
    "Stage",
    "StageError",
    "TokenTracker",
    "ToolPolicies",
    "ToolResultStore",
    "TranscriptWriter",
    "Usage",
    "load_transcript",
    "stage",
    "to_api",
]
