"""sluicegate's machinery: the message model, the pipeline, the session context and the budget
ledger. Concrete stages live in the ``stages`` package."""

from pipeline.context import PassReport, PersistedResult, SessionContext
from pipeline.core import FunctionStage, Pipeline, PipelineHalt, Stage, StageError, stage
from pipeline.gate import GateOutcome, gate_tool_result
from pipeline.messages import (
    Message,
    PairingError,
    PairingProblem,
    Usage,
    check_pairing,
    ensure_paired,
    to_api,
)
from pipeline.policies import ToolPolicies
from pipeline.replacement import ReplacementRecord, ReplacementState
from pipeline.storage import FileToolResultStore, StoreError, ToolResultStore
from pipeline.tokens import TokenTracker
from pipeline.transcript import Transcript, TranscriptError, TranscriptWriter, load_transcript

__all__ = [
    "FileToolResultStore",
    "FunctionStage",
    "GateOutcome",
    "Message",
    "PairingError",
    "PairingProblem",
    "PassReport",
    "PersistedResult",
    "Pipeline",
    "PipelineHalt",
    "ReplacementRecord",
    "ReplacementState",
    "SessionContext",
    "Stage",
    "StageError",
    "StoreError",
    "TokenTracker",
    "ToolPolicies",
    "ToolResultStore",
    "Transcript",
    "TranscriptError",
    "TranscriptWriter",
    "Usage",
    "check_pairing",
    "ensure_paired",
    "gate_tool_result",
    "load_transcript",
    "stage",
    "to_api",
]
