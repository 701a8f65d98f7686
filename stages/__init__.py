"""The concrete stages, one file each, and the default order (SPEC §5)."""

from pipeline import Stage
from pipeline.summarizer import Summarizer
from stages.autocompact import Autocompact
from stages.context_collapse import ContextCollapse
from stages.history_snip import HistorySnip
from stages.microcompact import Microcompact, ServerSideMicrocompact
from stages.tool_result_budget import ToolResultBudget

__all__ = [
    "Autocompact",
    "ContextCollapse",
    "HistorySnip",
    "Microcompact",
    "ServerSideMicrocompact",
    "ToolResultBudget",
    "default_stages",
]


def default_stages(
    *,
    per_message_chars: float = 200_000,
    summarizer: Summarizer | None = None,
    incremental: bool = True,
) -> list[Stage]:
    """The five stages in order, cheapest and most cache-friendly first.

    A ``summarizer`` goes to autocompact; context collapse only observes here (its 90% commit
    point lies above autocompact's threshold, so with both summarising autocompact would always
    act first — configure collapse with a lower ``commit_fraction`` and ``autocompact=off`` to
    use it). The default autocompact does not block: pass ``Autocompact(block=True)`` to refuse
    requests past the blocking limit with ``ContextWindowExceeded``. ``incremental=False``
    makes every stage recompute from the whole history on each pass (same requests; the
    full-rescan baseline of ``tests/benchmarks/bench_pipeline.py``).
    """
    return [
        ToolResultBudget(limit=per_message_chars, incremental=incremental),
        HistorySnip(incremental=incremental),
        Microcompact(incremental=incremental),
        ContextCollapse(incremental=incremental),
        Autocompact(summarizer, block=False),
    ]
