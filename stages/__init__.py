"""The concrete stages, one file each, and the default pipeline.

``default_stages()`` is the one list every default is read from (the registry, the command line
and ``build_pipeline`` derive from it)::

    tool_result_budget → history_snip → microcompact → context_collapse → autocompact

The budget runs first: it handles new large output, cheaply and without breaking the prompt
cache. The four later slots hold strategies; swap one with ``Pipeline.replace(slot, stage)``.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pipeline import Pipeline, Stage
from pipeline.policies import DEFAULT_CONTEXT_WINDOW, MAX_TOOL_RESULTS_PER_MESSAGE_CHARS
from pipeline.summarizer import Summarizer
from stages.autocompact import Autocompact
from stages.context_collapse import ContextCollapse
from stages.history_snip import HistorySnip
from stages.microcompact import Microcompact
from stages.server_compaction import ServerCompaction
from stages.server_microcompact import ServerSideMicrocompact
from stages.tool_result_budget import ToolResultBudget

__all__ = [
    "Autocompact",
    "ContextCollapse",
    "HistorySnip",
    "Microcompact",
    "ServerCompaction",
    "ServerSideMicrocompact",
    "ToolResultBudget",
    "default_stages",
    "wrap",
]

if TYPE_CHECKING:  # the SDK is heavy to import: only wrap() needs it, when called
    import anthropic

C = TypeVar("C", "anthropic.Anthropic", "anthropic.AsyncAnthropic")


def default_stages(
    *,
    context_window: int = DEFAULT_CONTEXT_WINDOW,
    per_message_chars: float = MAX_TOOL_RESULTS_PER_MESSAGE_CHARS,
    summarizer: Summarizer | None = None,
    incremental: bool = True,
) -> list[Stage]:
    """The five stages in order, cheapest and most cache-friendly first.

    ``context_window`` (tokens) goes to every stage that sizes itself by the window (history
    snip, context collapse, autocompact): one argument for a 1M-token model. A ``summarizer``
    goes to autocompact; context collapse only observes here (its 90% commit point lies above
    autocompact's threshold, so with both summarising autocompact would always act first --
    configure collapse with a lower ``commit_fraction`` and remove autocompact to use it).
    Autocompact does not block: ``Autocompact(block=True)`` refuses requests past the blocking
    limit with ``ContextWindowExceeded``. ``incremental=False`` makes every stage recompute from
    the whole history on each pass (same requests; the full-rescan baseline of the benchmarks).
    """
    return [
        ToolResultBudget(limit=per_message_chars, incremental=incremental),
        HistorySnip(context_window=context_window, incremental=incremental),
        Microcompact(incremental=incremental),
        ContextCollapse(context_window=context_window, incremental=incremental),
        Autocompact(summarizer, context_window=context_window),
    ]


def wrap(
    client: C,
    *,
    root: str | Path = ".sluicegate",
    session_id: str | None = None,
    context_window: int = DEFAULT_CONTEXT_WINDOW,
    **context: Any,
) -> C:
    """``client`` (sync or async) with every Messages request going through
    ``default_stages(context_window=...)`` -- see :func:`pipeline.dropin.wrap.wrap` for the layer
    and
    the sessions, and to choose other stages."""
    from pipeline.dropin.wrap import wrap as wrap_with

    return wrap_with(
        client,
        root=root,
        pipeline=lambda: Pipeline(default_stages(context_window=context_window)),
        session_id=session_id,
        **context,
    )
