"""The concrete stages, one file each, and the default order (SPEC §5)."""

from pipeline import Stage
from stages.autocompact import Autocompact
from stages.context_collapse import ContextCollapse
from stages.history_snip import HistorySnip
from stages.microcompact import Microcompact
from stages.tool_result_budget import ToolResultBudget

__all__ = [
    "Autocompact",
    "ContextCollapse",
    "HistorySnip",
    "Microcompact",
    "ToolResultBudget",
    "default_stages",
]


def default_stages(*, per_message_chars: float = 200_000) -> list[Stage]:
    """The five stages in order, cheapest and most cache-friendly first."""
    return [
        ToolResultBudget(limit=per_message_chars),
        HistorySnip(),
        Microcompact(),
        ContextCollapse(),
        Autocompact(),
    ]
