"""An agent loop on ``anthropic.AsyncAnthropic`` that runs the pipeline before every call."""

from pipeline.agent.loop import CANCELLED_RESULT, INTERRUPTED_RESULT, Agent
from pipeline.agent.results import AgentAPIError, AgentResult, GatedResult, TurnLog

__all__ = [
    "CANCELLED_RESULT",
    "INTERRUPTED_RESULT",
    "Agent",
    "AgentAPIError",
    "AgentResult",
    "GatedResult",
    "TurnLog",
]
