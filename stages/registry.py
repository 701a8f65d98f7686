"""Stages by name: build a pipeline from a plain config mapping or from CLI strings.

A strategy is chosen per slot with a spec string ``STRATEGY[:key=value[:key=value...]]``, e.g.
``microcompact=clear-oldest:keep=5`` or ``history_snip=off``. Values are read as int, float,
``true``/``false``, ``a+b+c`` (a tuple of strings), else a string. Strategies that need a
summariser (``summarize-spans``, ``summarize``) get the one passed to :func:`build_pipeline`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pipeline import Pipeline, Stage
from pipeline.summarizer import Summarizer
from stages.autocompact import Autocompact
from stages.baselines import ClearEveryTurn, HeadTailTruncate
from stages.context_collapse import ContextCollapse
from stages.history_snip import HistorySnip
from stages.microcompact import Microcompact, ServerSideMicrocompact
from stages.tool_result_budget import ToolResultBudget

__all__ = [
    "COMPARISON_POINTS",
    "SLOTS",
    "STRATEGIES",
    "build_pipeline",
    "build_stage",
    "comparison_pipeline",
    "parse_stage_spec",
]

SLOTS = ("tool_result_budget", "history_snip", "microcompact", "context_collapse", "autocompact")
OFF = "off"

STRATEGIES: dict[str, dict[str, Callable[..., Stage]]] = {
    "tool_result_budget": {"budget": ToolResultBudget},
    "history_snip": {HistorySnip.strategy: HistorySnip},
    "microcompact": {
        Microcompact.strategy: Microcompact,
        ServerSideMicrocompact.strategy: ServerSideMicrocompact,
        ClearEveryTurn.strategy: ClearEveryTurn,
    },
    "context_collapse": {ContextCollapse.strategy: ContextCollapse},
    "autocompact": {Autocompact.strategy: Autocompact},
}
"""Slot → strategy id → constructor. ``off`` removes a slot's stage."""

_NEEDS_SUMMARIZER: tuple[object, ...] = (ContextCollapse, Autocompact)


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


def build_stage(
    slot: str, strategy: str, summarizer: Summarizer | None = None, **kwargs: Any
) -> Stage:
    """The stage for ``slot`` using ``strategy``; ValueError naming what is unknown or bad."""
    if slot not in STRATEGIES:
        raise ValueError(f"unknown stage slot {slot!r}; slots are: {', '.join(SLOTS)}")
    choices = STRATEGIES[slot]
    if strategy not in choices:
        known = ", ".join([*choices, OFF])
        raise ValueError(f"unknown strategy {strategy!r} for {slot}; choose one of: {known}")
    factory = choices[strategy]
    if factory in _NEEDS_SUMMARIZER:
        kwargs["summarizer"] = summarizer
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{slot}={strategy}: {exc}") from None


def build_pipeline(
    config: Mapping[str, str | Mapping[str, Any]] | None = None,
    *,
    summarizer: Summarizer | None = None,
    per_message_chars: float = 200_000,
) -> Pipeline:
    """The default pipeline with the strategies ``config`` chooses, slot by slot.

    ``config`` maps a slot to a spec string (``"clear-oldest:keep=5"``, ``"off"``) or to a
    mapping ``{"strategy": "clear-oldest", "keep": 5}`` — what a config file holds.
    """
    stages: dict[str, Stage | None] = {
        "tool_result_budget": ToolResultBudget(limit=per_message_chars),
        "history_snip": HistorySnip(),
        "microcompact": Microcompact(),
        "context_collapse": ContextCollapse(),  # see default_stages: autocompact acts first
        "autocompact": Autocompact(summarizer, block=False),
    }
    for slot, choice in (config or {}).items():
        if slot not in stages:
            raise ValueError(f"unknown stage slot {slot!r}; slots are: {', '.join(SLOTS)}")
        if isinstance(choice, str):
            _, strategy, kwargs = parse_stage_spec(f"{slot}={choice}")
        else:
            kwargs = dict(choice)
            strategy = str(kwargs.pop("strategy", ""))
        stages[slot] = (
            None if strategy == OFF else build_stage(slot, strategy, summarizer, **kwargs)
        )
    return Pipeline(s for s in stages.values() if s is not None)


COMPARISON_POINTS: dict[str, str] = {
    "none": "no management: the conversation as it is",
    "truncate": "head+tail truncation of every tool result at 10K chars (Codex-style)",
    "clear-every-turn": "clear all but the newest 3 tool results every turn past 100K tokens "
    "(LangChain ContextEditing-style)",
    "default": "sluicegate's default pipeline",
}


def comparison_pipeline(name: str, *, per_message_chars: float = 200_000) -> Pipeline:
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
