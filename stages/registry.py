"""Stages by name: build a pipeline from a plain config mapping or from CLI strings.

A strategy is chosen per slot with a spec string ``STRATEGY[:key=value[:key=value...]]``, e.g.
``microcompact=clear-oldest:keep=5`` or ``history_snip=off``. Values are read as int, float,
``true``/``false``, ``a+b+c`` (a tuple of strings), else a string. Every pipeline starts from
:func:`stages.default_stages`; a chosen strategy gets the same shared settings the default one
would (``context_window``, ``incremental``, the budget's ``limit``; the summariser for the
strategies that summarise) unless the spec sets them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from pipeline import Pipeline, Stage
from pipeline.policies import DEFAULT_CONTEXT_WINDOW, MAX_TOOL_RESULTS_PER_MESSAGE_CHARS
from pipeline.summarizer import Summarizer
from stages import default_stages
from stages.autocompact import Autocompact
from stages.baselines import ClearEveryTurn, HeadTailTruncate
from stages.context_collapse import ContextCollapse
from stages.history_snip import HistorySnip
from stages.microcompact import Microcompact
from stages.server_compaction import ServerCompaction
from stages.server_microcompact import ServerSideMicrocompact
from stages.tool_result_budget import ToolResultBudget

__all__ = [
    "COMPARISON_POINTS",
    "OFF",
    "SLOTS",
    "STRATEGIES",
    "build_pipeline",
    "build_stage",
    "comparison_pipeline",
    "parse_stage_spec",
]

STRATEGIES: dict[str, dict[str, Callable[..., Stage]]] = {
    "tool_result_budget": {ToolResultBudget.strategy: ToolResultBudget},
    "history_snip": {HistorySnip.strategy: HistorySnip},
    "microcompact": {
        Microcompact.strategy: Microcompact,
        ServerSideMicrocompact.strategy: ServerSideMicrocompact,
        ClearEveryTurn.strategy: ClearEveryTurn,
    },
    "context_collapse": {ContextCollapse.strategy: ContextCollapse},
    "autocompact": {
        Autocompact.strategy: Autocompact,
        ServerCompaction.strategy: ServerCompaction,
    },
}
"""Slot → strategy id → constructor. ``off`` removes a slot's stage."""
SLOTS = tuple(STRATEGIES)
OFF = "off"


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text.replace("_", ""))
        except ValueError:
            pass
    if "+" in text:
        return tuple(part for part in text.split("+") if part)
    return text


def parse_stage_spec(spec: str) -> tuple[str, str, dict[str, Any]]:
    """``"microcompact=clear-oldest:keep=5"`` → ``("microcompact", "clear-oldest", {"keep": 5})``.

    Raises ``ValueError`` naming the malformed part.
    """
    slot, sep, rest = spec.partition("=")
    if not sep or not slot or not rest:
        raise ValueError(f"stage spec {spec!r}: expected SLOT=STRATEGY[:key=value...]")
    strategy, *pairs = rest.split(":")
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"stage spec {spec!r}: {pair!r} is not key=value")
        kwargs[key] = _value(value)
    return slot.strip(), strategy.strip(), kwargs


_NOT_SETTABLE = {
    "summarizer": "the summarizer is not settable in a stage spec: it is an object the code "
    "building the pipeline passes (build_pipeline(summarizer=...))",
}
"""Constructor parameters an option cannot set (not plain values), and why."""


def build_stage(
    slot: str,
    strategy: str,
    summarizer: Summarizer | None = None,
    *,
    shared: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Stage:
    """The stage for ``slot`` using ``strategy``; ``ValueError`` naming what is unknown or bad
    (an unknown option lists the valid ones).

    ``shared`` settings (and ``summarizer``) are passed to the constructor where it takes them;
    ``kwargs`` win over them.
    """
    return _build_stage(slot, strategy, summarizer, shared, kwargs)


def _build_stage(
    slot: str,
    strategy: str,
    summarizer: Summarizer | None,
    shared: Mapping[str, Any] | None,
    kwargs: Mapping[str, Any],
) -> Stage:
    if slot not in STRATEGIES:
        raise ValueError(f"unknown stage slot {slot!r}; slots are: {', '.join(SLOTS)}")
    choices = STRATEGIES[slot]
    if strategy not in choices:
        known = ", ".join([*choices, OFF])
        raise ValueError(f"unknown strategy {strategy!r} for {slot}; choose one of: {known}")
    factory = choices[strategy]
    accepted = inspect.signature(factory).parameters
    settable = [k for k in accepted if k not in _NOT_SETTABLE]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    for key in kwargs:
        if key in _NOT_SETTABLE:
            raise ValueError(f"{slot}={strategy}: {_NOT_SETTABLE[key]}")
        if key not in accepted and not takes_any:
            raise ValueError(
                f"{slot}={strategy}: unknown option {key!r}; options are: {', '.join(settable)}"
            )
    given = {"summarizer": summarizer, **(shared or {})}
    args = {k: v for k, v in given.items() if k in accepted} | dict(kwargs)
    try:
        return factory(**args)
    except TypeError as exc:
        raise ValueError(f"{slot}={strategy}: {exc}") from None


def build_pipeline(
    config: Mapping[str, str | Mapping[str, Any]] | None = None,
    *,
    summarizer: Summarizer | None = None,
    per_message_chars: float = MAX_TOOL_RESULTS_PER_MESSAGE_CHARS,
    context_window: int = DEFAULT_CONTEXT_WINDOW,
    incremental: bool = True,
) -> Pipeline:
    """:func:`stages.default_stages` with the strategies ``config`` chooses, slot by slot.

    ``config`` maps a slot to a spec string (``"clear-oldest:keep=5"``, ``"off"``) or to a
    mapping ``{"strategy": "clear-oldest", "keep": 5}`` — what a config file holds.
    """
    pipe = Pipeline(
        default_stages(
            context_window=context_window,
            per_message_chars=per_message_chars,
            summarizer=summarizer,
            incremental=incremental,
        )
    )
    shared = {
        "context_window": context_window,
        "incremental": incremental,
        "limit": per_message_chars,
    }
    for slot, choice in (config or {}).items():
        if slot not in STRATEGIES:
            raise ValueError(f"unknown stage slot {slot!r}; slots are: {', '.join(SLOTS)}")
        if isinstance(choice, str):
            _, strategy, kwargs = parse_stage_spec(f"{slot}={choice}")
        else:
            kwargs = dict(choice)
            strategy = str(kwargs.pop("strategy", ""))
        if strategy == OFF:
            pipe = pipe.remove(slot)
        else:
            # not through build_stage(**kwargs): an option named like one of its own
            # parameters (summarizer, shared) would collide with it
            stage = _build_stage(slot, strategy, summarizer, shared, kwargs)
            pipe = pipe.replace(slot, stage)
    return pipe


COMPARISON_POINTS: dict[str, str] = {
    "none": "no management: the conversation as it is",
    "truncate": "head+tail truncation of every tool result at 10K chars (Codex-style)",
    "clear-every-turn": "clear all but the newest 3 tool results every turn past 100K tokens "
    "(LangChain ContextEditing-style)",
    "default": "sluicegate's default pipeline",
}


def comparison_pipeline(
    name: str, *, per_message_chars: float = MAX_TOOL_RESULTS_PER_MESSAGE_CHARS
) -> Pipeline:
    """A built-in comparison point by name (see :data:`COMPARISON_POINTS`)."""
    if name == "none":
        return Pipeline([])
    if name == "truncate":
        return Pipeline([HeadTailTruncate(10_000)])
    if name == "clear-every-turn":
        return Pipeline([ClearEveryTurn(keep=3, trigger_tokens=100_000)])
    if name == "default":
        return build_pipeline(per_message_chars=per_message_chars)
    known = ", ".join(COMPARISON_POINTS)
    raise ValueError(f"unknown comparison point {name!r}; built in: {known}, or SLOT=STRATEGY")
