"""What every call carries besides its messages -- the system prompt and the tool schemas -- and
how much of it an estimate must add.

A usage anchor counts them as they were at the anchor's call; so does an overhead the estimator
measured on a call without one. An estimate adds them whole when neither exists, else how much
they changed since. They are priced with the prior ratios, never the learned ones: a price that
moves as the session learns would make an unchanged prompt look changed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pipeline.messages import Message
from pipeline.tokens.calibrated import CalibratedEstimator
from pipeline.tokens.checks import check_int

__all__ = ["RequestOverhead", "request_text"]

_MAX = 10**12


def request_text(system: Any, tools: Any) -> str:
    """The system prompt's text and the tools' JSON: what a call sends besides its messages.
    Values of any other shape (a hostile request) count as absent."""
    if isinstance(system, str):
        parts = [system]
    elif isinstance(system, list | tuple):
        parts = [str(b.get("text", "")) for b in system if isinstance(b, Mapping)]
    else:
        parts = []
    if isinstance(tools, list | tuple) and tools:
        parts.append(json.dumps(list(tools), ensure_ascii=False, default=str))
    return "\n".join(parts)


class RequestOverhead:
    """The system prompt and tools of the next call, and what the session's usage has seen."""

    _pricer = CalibratedEstimator()
    """Prior ratios only (it never observes): the same text always gets the same price."""

    def __init__(self) -> None:
        self._current: tuple[object, object, str, int] | None = None
        """(system, tools, their text, its tokens) of the next call."""
        self.seen: int | None = None
        """Tokens of them at the latest observed call (None: unknown)."""
        self.at_overhead: int | None = None
        """Tokens of them when the estimator last measured its no-anchor overhead."""

    def set(self, system: Any, tools: Any) -> int:
        """Make these the next call's; their tokens (cached while the same objects, or equal
        text, come again)."""
        current = self._current
        if current is not None and current[0] is system and current[1] is tools:
            return current[3]
        if current is not None and current[0] == system and current[1] == tools:
            # equal new objects (each proxied request parses its own): a C-level comparison,
            # not a re-serialisation of every tool schema per call
            self._current = (system, tools, current[2], current[3])
            return current[3]
        text = request_text(system, tools)
        if current is not None and current[2] == text:
            tokens = current[3]
        else:
            tokens = self._pricer.tokens_for_messages([Message.user(text)]) if text else 0
        self._current = (system, tools, text, tokens)
        return tokens

    @property
    def tokens(self) -> int | None:
        """Tokens of the next call's system prompt and tools (None: never set)."""
        return None if self._current is None else self._current[3]

    def extra(self, *, has_anchor: bool, overhead_measured: bool) -> int:
        """Tokens an estimate must add for them."""
        now = self.tokens
        if now is None:
            return 0
        if has_anchor:
            return now - self.seen if self.seen is not None else 0
        if overhead_measured:
            base = self.at_overhead if self.at_overhead is not None else self.seen
            return now - base if base is not None else 0
        return now

    def skip_reason(self, *, has_anchor: bool) -> str | None:
        """Why a call must not be learned from, as far as they go (None: it may be)."""
        now = self.tokens
        if now is None or not has_anchor:
            return None
        if self.seen is None:
            return "system prompt and tools unknown at the anchor"
        if self.seen != now:
            return "system prompt or tools changed"
        return None

    def observed(self, *, overhead_measured_now: bool) -> None:
        """A call was observed with the current ones (and maybe the overhead measured on it)."""
        now = self.tokens
        if now is None:
            return
        self.seen = now
        if overhead_measured_now:
            self.at_overhead = now

    def state_dict(self) -> dict[str, int | None]:
        """What a resumed session needs: the tokens its usage has seen."""
        return {"seen": self.seen, "at_overhead": self.at_overhead}

    def load_state(self, state: Any) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` on anything else."""
        if not isinstance(state, Mapping) or set(state) - {"seen", "at_overhead"}:
            raise ValueError("request state must be {'seen', 'at_overhead'}")
        for key in ("seen", "at_overhead"):
            value = state.get(key)
            setattr(self, key, None if value is None else check_int(value, key, low=0, high=_MAX))

    def __repr__(self) -> str:
        return f"RequestOverhead(tokens={self.tokens}, seen={self.seen})"
