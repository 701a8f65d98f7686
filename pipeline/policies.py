"""Limits: the per-tool persistence thresholds, the per-message budget, the context window."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "CLAUDE_CODE_DECLARED",
    "DEFAULT_CONTEXT_WINDOW",
    "DEFAULT_MAX_RESULT_SIZE_CHARS",
    "MAX_TOOL_RESULTS_PER_MESSAGE_CHARS",
    "UNDECLARED_MAX_RESULT_SIZE_CHARS",
    "ToolPolicies",
]

DEFAULT_CONTEXT_WINDOW = 200_000
"""Tokens of the model's context window the size-triggered stages assume (one setting for all
of them: ``stages.default_stages(context_window=...)``)."""
DEFAULT_MAX_RESULT_SIZE_CHARS = 50_000
"""The per-tool cap: no finite declared limit goes above it (an operator override may)."""
MAX_TOOL_RESULTS_PER_MESSAGE_CHARS = 200_000
"""The per-message budget: all tool_results of one API-level user message together."""
UNDECLARED_MAX_RESULT_SIZE_CHARS = 100_000
"""What a tool that declares nothing counts as (→ the cap)."""

CLAUDE_CODE_DECLARED: Mapping[str, float] = {
    "Read": math.inf,
    "Bash": 30_000,
    "PowerShell": 30_000,
    "Grep": 20_000,
    "McpAuth": 10_000,
}
"""Claude Code's declared limits by tool name, used when replaying its transcripts."""


def _check_limit(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"limit for tool {name!r} must be a number, got {value!r}")
    if value <= 0:
        raise ValueError(f"limit for tool {name!r} must be > 0, got {value!r}")
    return float(value) if isinstance(value, float) else value


@dataclass(frozen=True, slots=True)
class ToolPolicies:
    """Which per-tool threshold applies to a tool's results.

    ``declared``: what each tool declares as its ``max_result_size_chars`` (``math.inf`` = never
    persist); ``overrides``: operator overrides by tool name; ``cap``: the default cap.
    """

    declared: Mapping[str, float] = field(default_factory=dict)
    overrides: Mapping[str, float] = field(default_factory=dict)
    cap: float = DEFAULT_MAX_RESULT_SIZE_CHARS

    def __post_init__(self) -> None:
        for name, value in self.declared.items():
            _check_limit(name, value)
        for name, value in self.overrides.items():
            if math.isinf(_check_limit(name, value)):  # ignored, it would mislead
                raise ValueError(
                    f"override for tool {name!r} must be finite (a tool that is never to be "
                    f"persisted declares math.inf), got {value!r}"
                )
        _check_limit("<cap>", self.cap)

    @classmethod
    def claude_code(cls, cap: float = DEFAULT_MAX_RESULT_SIZE_CHARS) -> ToolPolicies:
        """The reference values of a Claude Code session (``Read`` never persisted)."""
        return cls(declared=dict(CLAUDE_CODE_DECLARED), cap=cap)

    def with_declared(self, name: str, limit: float) -> ToolPolicies:
        """A copy where tool ``name`` declares ``limit``."""
        return ToolPolicies({**self.declared, name: limit}, self.overrides, self.cap)

    def threshold(self, tool_name: str | None) -> float:
        """Persist a result of this tool when its size is strictly greater than this.

        Precedence: a declared ``math.inf`` opts out; else a finite operator override > 0; else
        ``min(declared, cap)``, where a tool that declares nothing counts as 100,000.
        """
        declared = self.declared.get(tool_name or "", UNDECLARED_MAX_RESULT_SIZE_CHARS)
        if math.isinf(declared):
            return math.inf
        override = self.overrides.get(tool_name or "")
        if override is not None and math.isfinite(override) and override > 0:
            return override
        return min(declared, self.cap)

    def never_persist(self, tool_name: str | None) -> bool:
        """The tool opted out of persistence (``math.inf``)."""
        return math.isinf(self.threshold(tool_name))
