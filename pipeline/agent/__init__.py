"""An agent loop on ``anthropic.AsyncAnthropic`` that runs the pipeline before every call."""

from pipeline.agent.lock import SessionBusyError, session_lock
from pipeline.agent.loop import CANCELLED_RESULT, Agent, store_root_of
from pipeline.agent.repair import INTERRUPTED_RESULT, PairingRepair, repair_pairing
from pipeline.agent.results import AgentAPIError, AgentResult, GatedResult, TurnLog
from pipeline.agent.retry import RetryPolicy

__all__ = [
    "CANCELLED_RESULT",
    "INTERRUPTED_RESULT",
    "Agent",
    "AgentAPIError",
    "AgentResult",
    "GatedResult",
    "PairingRepair",
    "RetryPolicy",
    "SessionBusyError",
    "TurnLog",
    "repair_pairing",
    "session_lock",
    "store_root_of",
]
