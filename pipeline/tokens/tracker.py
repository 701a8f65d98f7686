"""Token counting: the last real response's usage plus an estimate of what came after (SPEC §4).

:class:`TokenTracker` answers "how many tokens would this context hold if sent now?" with one
of two methods:

- ``"calibrated"`` (the default): :class:`pipeline.tokens.calibrated.CalibratedEstimator` — prices
  content by character categories and content class, learns chars-per-token online from the
  usage deltas the session observes, and leans to over-counting (a 5 % margin cold, 2 % warm).
- ``"reference"``: SPEC §4 exactly — ``round(len/4)`` per block, 2 chars/token for JSON-family
  text, a fixed 2,000 for images and documents, ``tool_use`` = name + JSON input, thinking = its
  text, other blocks = their JSON; no usage anywhere ⇒ estimate everything.

Both anchor on the same rule (:func:`find_anchor`) and price the same segments
(:func:`pipeline.tokens.features.iter_segments`). The tracker keeps the errors of its
predictions (:meth:`TokenTracker.error_stats`), and its state is JSON-serialisable and can be
saved next to the session (:func:`calibration_path_for`) so a resumed session starts warm.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipeline.messages import Message, Usage, first_fragment
from pipeline.tokens.calibrated import (
    BIG_GROWTH,
    CalibratedEstimator,
    ErrorStats,
    EstimateDetail,
    Observation,
    compaction_restart,
)
from pipeline.tokens.features import (
    IMAGE_TOKENS,
    is_wire_visible,
    iter_segments,
    looks_like_json,
    model_family,
)
from pipeline.tracing import get_logger
from pipeline.wire import to_api

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic import AsyncAnthropic
    from anthropic.types import MessageParam

__all__ = [
    "CALIBRATION_FILE",
    "IMAGE_TOKENS",
    "ErrorStats",
    "EstimateDetail",
    "Method",
    "Observation",
    "TokenTracker",
    "calibration_path_for",
    "find_anchor",
    "rough_tokens_for_messages",
    "rough_tokens_for_text",
]

Method = Literal["calibrated", "reference"]
TRACKER_STATE_VERSION = 1
CALIBRATION_FILE = "token-calibration.json"

# ---------------------------------------------------------------------------------------------
# The reference estimate (SPEC §4)
# ---------------------------------------------------------------------------------------------


def rough_tokens_for_text(text: str) -> int:
    """``round(len/4)``; 2 chars/token for JSON-family text (dense punctuation)."""
    return round(len(text) / (2 if looks_like_json(text) else 4))


def rough_tokens_for_messages(messages: Iterable[Message]) -> int:
    """The reference rough estimate of the wire-visible content of ``messages``."""
    total = 0
    for m in messages:
        if is_wire_visible(m):
            for seg in iter_segments(m):
                total += IMAGE_TOKENS if seg.kind == "media" else rough_tokens_for_text(seg.text)
    return total


def find_anchor(messages: Sequence[Message]) -> tuple[int, Usage] | None:
    """The last real response's usage and the index of its FIRST fragment.

    Usage is read off the last assistant record that carries it (streaming snapshots: the
    latest is the most complete). Fragments of one response share an id and tool_results may
    sit between them; starting the estimate after the *last* fragment would miss those results,
    so walk back to the first. Records without an assistant id are walked past; a different id
    stops the walk. Synthetic assistant messages are never anchors.
    """
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.type != "assistant" or m.usage is None or m.is_synthetic:
            continue
        return first_fragment(messages, i), m.usage
    return None


def _reference_detail(
    messages: Sequence[Message], anchor: tuple[int, Usage] | None, model: str | None
) -> EstimateDetail:
    if anchor is None:
        part, anchor_total = rough_tokens_for_messages(messages), 0
        family, crossed = model_family(model), False
    else:
        i, usage = anchor
        part, anchor_total = rough_tokens_for_messages(messages[i + 1 :]), usage.total
        family = model_family(model or messages[i].model)
        crossed = compaction_restart(messages, i) is not None
    return EstimateDetail(
        total=anchor_total + part,
        anchor_total=anchor_total,
        estimated_part=part,
        response_adjustment=0.0,
        new_tokens=float(part),
        margin=0.0,
        family=family,
        # the reference prices across a compaction as if nothing happened (SPEC §4); the flag
        # only tells the error statistics that the call cannot be measured
        has_anchor=anchor is not None and not crossed,
        crossed_compaction=crossed,
    )


# ---------------------------------------------------------------------------------------------
# The tracker
# ---------------------------------------------------------------------------------------------


def calibration_path_for(
    root: str | os.PathLike[str], session_id: str, agent_id: str | None = None
) -> Path:
    """Where a session's tracker state lives: ``<root>/<session>/token-calibration.json``
    (``token-calibration-<agent_id>.json`` for a sub-agent, which has its own tracker)."""
    if agent_id is None:
        return Path(root) / session_id / CALIBRATION_FILE
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", agent_id)  # an id is never a path
    return Path(root) / session_id / f"token-calibration-{safe}.json"


class TokenTracker:
    """Context size before the next call: last usage + an estimate of everything after it.

    ``method="calibrated"`` (default) learns from every :meth:`observe`; ``"reference"`` is
    SPEC §4 and learns nothing. Both record their prediction errors. Typical loop::

        tokens = tracker.estimate(projected)              # before the call: budget decisions
        response = await client.messages.create(...)
        tracker.observe(projected, usage, model=model)    # the same messages the call saw
    """

    def __init__(
        self,
        method: Method = "calibrated",
        *,
        estimator: CalibratedEstimator | None = None,
        error_window: int = 512,
    ) -> None:
        if method not in ("calibrated", "reference"):
            raise ValueError(f"unknown token estimation method {method!r}")
        if method == "reference" and estimator is not None:
            raise ValueError("the reference method takes no estimator")
        self.method: Method = method
        self.estimator: CalibratedEstimator | None = (
            (estimator or CalibratedEstimator()) if method == "calibrated" else None
        )
        self.last_error: int | None = None
        """Estimate minus actual input tokens of the latest observed call."""
        self._errors: deque[tuple[str, int, int]] = deque(maxlen=error_window)
        """(family, estimated part, real growth) of recent measurable calls."""
        self._last_observed: tuple[int, Message] | None = None
        """Length and last message of the latest learned-from list (see :meth:`observe`)."""

    # -- estimating ---------------------------------------------------------------------------
    def estimate_detail(
        self, messages: Sequence[Message], *, model: str | None = None
    ) -> EstimateDetail:
        """The estimate with its parts. ``model``: the model about to be called (default: the
        anchor's model)."""
        anchor = find_anchor(messages)
        if self.estimator is None:
            return _reference_detail(messages, anchor, model)
        return self.estimator.estimate_detail(messages, anchor, model=model)

    def estimate(self, messages: Sequence[Message], *, model: str | None = None) -> int:
        """Tokens the context holds if ``messages`` were sent now."""
        return self.estimate_detail(messages, model=model).total

    def estimate_after_anchor(
        self, messages: Sequence[Message], *, model: str | None = None
    ) -> int:
        """Only the estimated part: what came after the last response."""
        if self.estimator is None:  # SPEC §4: everything after the anchor's first fragment
            anchor = find_anchor(messages)
            return rough_tokens_for_messages(
                messages if anchor is None else messages[anchor[0] + 1 :]
            )
        return self.estimate_detail(messages, model=model).estimated_part

    def tokens_for_messages(self, messages: Sequence[Message], *, model: str | None = None) -> int:
        """Tokens of the content of ``messages`` alone (no anchor, no overhead, no margin), in
        this tracker's units: to price a span that a stage removes or adds."""
        if self.estimator is None:
            return rough_tokens_for_messages(messages)
        return self.estimator.tokens_for_messages(messages, model=model)

    # -- learning -----------------------------------------------------------------------------
    def observe(
        self,
        messages_before_call: Sequence[Message],
        usage: Usage,
        *,
        model: str | None = None,
        tokens_freed: int = 0,
    ) -> Observation:
        """Feed the usage of the call made with ``messages_before_call`` (the messages as sent).

        ``model``: the model that served the call (default: the anchor's). ``tokens_freed``:
        tokens the stages removed in that pass from content the anchor's usage counted; the
        usage delta then mixes removals with additions, so it is neither learned from nor
        counted in the error statistics. Observing the same messages twice in a row (say,
        :meth:`count_with_api` and then the real call) learns once.
        """
        messages = messages_before_call
        last = self._last_observed
        skip: str | None = None
        if messages and last is not None and last[0] == len(messages) and last[1] is messages[-1]:
            skip = "already observed"
        elif tokens_freed > 0:
            skip = "stages removed anchored content"
        anchor = find_anchor(messages)
        if self.estimator is None:
            detail = _reference_detail(messages, anchor, model)
            learned, reason = False, skip or "reference: nothing to learn"
        else:
            detail, learned, reason = self.estimator.observe(
                messages, anchor, usage, model=model, skip=skip
            )
        if skip is None and messages:
            # holding the message (not its id) keeps the identity test sound
            self._last_observed = (len(messages), messages[-1])
        actual = usage.input_side
        self.last_error = detail.total - actual
        growth = None
        if detail.has_anchor and skip is None:
            growth = actual - detail.anchor_total
            self._errors.append((detail.family, detail.estimated_part, growth))
        return Observation(
            method=self.method,
            family=detail.family,
            estimate=detail.total,
            actual=actual,
            estimated_part=detail.estimated_part,
            real_growth=growth,
            learned=learned,
            reason=reason,
        )

    async def count_with_api(
        self,
        client: AsyncAnthropic,
        *,
        model: str,
        messages: Sequence[Message] | Sequence[MessageParam],
        system: Any = None,
        tools: Any = None,
        observe: bool = True,
        **extra: Any,
    ) -> int:
        """The exact input tokens of a request, from ``client.messages.count_tokens``.

        ``messages`` are conversation records (normalised with :func:`to_api`) or a request's
        ``messages`` array. With records and ``observe``, the count is fed back as an
        observation: it is the exact input side of that request. Never required — the
        estimate works without a client. API errors propagate (``anthropic.APIError``).
        """
        records = [m for m in messages if isinstance(m, Message)]
        as_records = bool(records) and len(records) == len(messages)
        request: Any = to_api(records) if as_records else list(messages)
        kwargs: dict[str, Any] = dict(extra)
        if system is not None:
            kwargs["system"] = system
        if tools:
            kwargs["tools"] = tools
        result = await client.messages.count_tokens(model=model, messages=request, **kwargs)
        count = int(result.input_tokens)
        if observe and as_records:
            self.observe(records, Usage(input_tokens=count), model=model)
        return count

    # -- reporting ----------------------------------------------------------------------------
    def ratios(self, family: str | None = None) -> dict[str, dict[str, float | None]]:
        """Current chars/token per content class (and, calibrated, multiplier, SD, chars seen).

        The reference's are fixed: 4 for text, 2 for JSON-family text.
        """
        if self.estimator is None:
            return {"text": {"chars_per_token": 4.0}, "json": {"chars_per_token": 2.0}}
        return self.estimator.ratios(family)

    def error_stats(self, *, family: str | None = None, min_growth: int = BIG_GROWTH) -> ErrorStats:
        """Errors of the estimated part (predicted before learning) on recent observed calls."""
        return ErrorStats.from_pairs(
            ((p, r) for f, p, r in self._errors if family is None or f == family),
            min_growth=min_growth,
        )

    # -- persistence --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: method, estimator state, recent errors."""
        return {
            "version": TRACKER_STATE_VERSION,
            "method": self.method,
            "estimator": None if self.estimator is None else self.estimator.state_dict(),
            "errors": [list(e) for e in self._errors],
            "error_window": self._errors.maxlen,
            "last_error": self.last_error,
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> TokenTracker:
        """Rebuild from :meth:`state_dict`; ValueError when the state is not one."""
        if state.get("version") != TRACKER_STATE_VERSION:
            raise ValueError(f"unsupported tracker state version {state.get('version')!r}")
        method = state.get("method")
        if method not in ("calibrated", "reference"):
            raise ValueError(f"unknown token estimation method {method!r}")
        raw = state.get("estimator")
        try:
            estimator = CalibratedEstimator.from_state_dict(raw) if raw is not None else None
            tracker = cls(method, estimator=estimator, error_window=int(state["error_window"]))
            tracker._errors.extend((str(f), int(p), int(r)) for f, p, r in state["errors"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed tracker state: {exc!r}") from None
        last = state.get("last_error")
        tracker.last_error = None if last is None else int(last)
        return tracker

    def for_subagent(self) -> TokenTracker:
        """A tracker for a sub-agent's conversation: what this one learned about how content
        tokenises (the multipliers per model family), none of what belongs to this
        conversation (its system-prompt-and-tools overhead, its error record)."""
        if self.estimator is None:
            return TokenTracker("reference", error_window=self._errors.maxlen or 512)
        state = self.estimator.state_dict()
        state["overhead"] = None
        estimator = CalibratedEstimator.from_state_dict(state)
        return TokenTracker(
            self.method, estimator=estimator, error_window=self._errors.maxlen or 512
        )

    def save(self, path: str | os.PathLike[str]) -> bool:
        """Write the state to ``path`` atomically (temp file, fsync, rename).

        Returns False, and logs a warning, when it cannot: the calibration is an optimisation
        and a failed save only means a resumed session starts cold, so it never fails a turn.
        """
        target = Path(path)
        data = json.dumps(self.state_dict(), separators=(",", ":"))
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
        try:
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                with open(tmp, "x", encoding="utf-8") as f:  # "x": never through a planted file
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)  # readers see the old state or the new, never half
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            get_logger().warning("token_calibration.save_failed", path=str(target), error=str(exc))
            return False
        return True

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, method: Method = "calibrated") -> TokenTracker:
        """The tracker saved at ``path``; a fresh ``method`` tracker when there is none.

        An unreadable or malformed file is logged and ignored (the session starts cold).
        """
        target = Path(path)
        try:
            state = json.loads(target.read_text(encoding="utf-8"))
            if not isinstance(state, Mapping):
                raise ValueError("not a JSON object")
            return cls.from_state_dict(state)
        except FileNotFoundError:
            return cls(method)
        except (OSError, ValueError) as exc:
            get_logger().warning("token_calibration.load_failed", path=str(target), error=str(exc))
            return cls(method)
