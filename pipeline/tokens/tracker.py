"""The token tracker: the context size before the next call, as the last real response's usage
plus an estimate of what came after it.

:class:`TokenTracker` holds one :class:`Estimator`:

- :class:`~pipeline.tokens.calibrated.CalibratedEstimator` (the default, ``"calibrated"``):
  prices content by character categories and content class, learns chars-per-token online from
  the usage deltas the session observes, and leans to over-counting (a 5 % margin cold, 2 %
  warm);
- :class:`~pipeline.tokens.reference.ReferenceEstimator` (``"reference"``): Claude Code's
  fixed rough count; learns nothing.

Both anchor on the same rule (:func:`~pipeline.tokens.anchor.find_anchor`) and price the same
segments (:func:`~pipeline.tokens.features.iter_segments`). The tracker keeps the errors of its
predictions (:meth:`TokenTracker.error_stats`), and its state is JSON-serialisable and can be
saved next to the session (:func:`calibration_path_for`) so a resumed session starts warm.
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipeline.kept_list import KeptList
from pipeline.logs import get_logger
from pipeline.messages import MAX_TOKENS, Message, Usage
from pipeline.tokens.calibrated import CalibratedEstimator
from pipeline.tokens.checks import (
    bounded_repr,
    bounded_text,
    check_int,
    check_keys,
    check_mapping,
)
from pipeline.tokens.estimator import CallSeen, Estimator
from pipeline.tokens.kept_estimates import KeptEstimates
from pipeline.tokens.reference import ReferenceEstimator
from pipeline.tokens.request import RequestOverhead
from pipeline.tokens.state_file import (
    CALIBRATION_FILE,
    calibration_path_for,
    decode_state,
    read_state_file,
    write_state,
)
from pipeline.tokens.stats import BIG_GROWTH, ErrorStats, EstimateDetail, Observation
from pipeline.wire.form import to_api

if TYPE_CHECKING:  # the SDK is heavy to import; only its types are used here
    from anthropic import AsyncAnthropic
    from anthropic.types import MessageParam

__all__ = ["CALIBRATION_FILE", "Estimator", "Method", "TokenTracker", "calibration_path_for"]

Method = Literal["calibrated", "reference"]
TRACKER_STATE_VERSION = 1
MAX_ERROR_WINDOW = 1_000_000
"""The largest ``error_window`` a saved state may ask for (the default is 512)."""
_STATE_KEYS = (
    "version",
    "method",
    "estimator",
    "errors",
    "error_window",
    "last_error",
    "request",
)


_ESTIMATORS: dict[str, Any] = {"calibrated": CalibratedEstimator, "reference": ReferenceEstimator}


class TokenTracker:
    """Context size before the next call: last usage + an estimate of everything after it.

    ``method="calibrated"`` (default) learns from every :meth:`observe`; ``"reference"``
    learns nothing; or pass any :class:`Estimator` as ``estimator``. Both record their
    prediction errors. Typical loop::

        tokens = tracker.estimate(projected)              # before the call: budget decisions
        response = await client.messages.create(...)
        tracker.observe(projected, usage, model=model)    # the same messages the call saw
    """

    def __init__(
        self,
        method: Method | None = None,
        *,
        estimator: Estimator | None = None,
        error_window: int = 512,
    ) -> None:
        if method is not None and method not in _ESTIMATORS:
            raise ValueError(f"unknown token estimation method {method!r}")
        if estimator is None:
            estimator = _ESTIMATORS[method or "calibrated"]()
        elif method is not None and method != estimator.method:
            raise ValueError(f"a {method} tracker was given a {estimator.method} estimator")
        self.estimator: Estimator = estimator
        self.last_error: int | None = None
        """Estimate minus actual input tokens of the latest observed call."""
        self._errors: deque[tuple[str, int, int]] = deque(maxlen=error_window)
        """(family, estimated part, real growth) of recent measurable calls."""
        self._last_observed: tuple[int, Message] | None = None
        """Length and last message of the latest learned-from list (see :meth:`observe`)."""
        self.request = RequestOverhead()
        """The system prompt and tools of the next call (see :meth:`set_request`)."""
        self._kept = KeptEstimates()
        """The latest estimates of kept lists, reused while unchanged (see its module)."""

    @property
    def method(self) -> str:
        """``"calibrated"`` or ``"reference"``: the estimator's name."""
        return self.estimator.method

    # -- the request around the messages -------------------------------------------------------
    def set_request(self, *, system: Any = None, tools: Sequence[Any] | None = None) -> int:
        """Tell the tracker what the next calls carry besides their messages: the system prompt
        (a string or text blocks) and the tool schemas. Returns their tokens.

        Every call sends them, and the messages alone leave them out: a first call's estimate
        (no usage yet) adds them whole, a later one adds how much they changed since the call
        its usage came from (an anchor's usage already counts them). A call whose system prompt
        or tools changed since its anchor's is not learned from. Priced with the prior ratios
        (an unchanged prompt keeps its price), cached while the same or equal objects come
        again: pass new objects when they change (an object edited in place after it was
        passed is not seen).
        """
        return self.request.set(system, tools)

    @property
    def request_tokens(self) -> int | None:
        """Tokens of the system prompt and tools last given to :meth:`set_request`."""
        return self.request.tokens

    def _overhead_measured(self) -> bool:
        return getattr(self.estimator, "overhead", None) is not None

    def _with_request(self, detail: EstimateDetail, extra: int | None = None) -> EstimateDetail:
        """``detail`` plus the system prompt and tools (see :meth:`set_request`)."""
        if extra is None:
            extra = self.request.extra(
                has_anchor=detail.has_anchor, overhead_measured=self._overhead_measured()
            )
        if not extra:
            return detail
        return dataclasses.replace(
            detail,
            total=detail.total + extra,
            estimated_part=detail.estimated_part + extra,
            request_overhead=extra,
        )

    # -- estimating ---------------------------------------------------------------------------
    def estimate_detail(
        self, messages: Sequence[Message], *, model: str | None = None
    ) -> EstimateDetail:
        """The estimate with its parts. ``model``: the model about to be called (default: the
        anchor's model)."""
        if isinstance(messages, KeptList):
            detail = self._kept.detail(self.estimator, messages, model)
        else:
            detail = self.estimator.estimate_detail(messages, model=model)
        return self._with_request(detail)

    def estimate(self, messages: Sequence[Message], *, model: str | None = None) -> int:
        """Tokens the context holds if ``messages`` were sent now."""
        return self.estimate_detail(messages, model=model).total

    def estimate_after_anchor(
        self, messages: Sequence[Message], *, model: str | None = None
    ) -> int:
        """Only the estimated part: what came after the last response."""
        return self.estimate_detail(messages, model=model).estimated_part

    def tokens_for_messages(self, messages: Sequence[Message], *, model: str | None = None) -> int:
        """Tokens of the content of ``messages`` alone (no anchor, no overhead, no margin), in
        this tracker's units: to price a span that a stage removes or adds."""
        return self.estimator.tokens_for_messages(messages, model=model)

    # -- learning -----------------------------------------------------------------------------
    def observe(
        self,
        messages_before_call: Sequence[Message],
        usage: Usage,
        *,
        model: str | None = None,
        tokens_freed: int = 0,
        compacted: bool = False,
    ) -> Observation:
        """Feed the usage of the call made with ``messages_before_call`` (the messages as sent).

        ``model``: the model that served the call (default: the anchor's). ``tokens_freed``:
        tokens the stages removed in that pass from content the anchor's usage counted; the
        usage delta then mixes removals with additions, so it is neither learned from nor
        counted in the error statistics. ``compacted``: the server compacted the context in
        that call (its usage is of the compacted context, not of the request): not learned
        from either. Observing the same messages twice in a row (say,
        :meth:`count_with_api` and then the real call) learns once.
        """
        messages = messages_before_call
        last = self._last_observed
        skip: str | None = None
        if messages and last is not None and last[0] == len(messages) and last[1] is messages[-1]:
            skip = "already observed"
        elif tokens_freed > 0:
            skip = "stages removed anchored content"
        elif compacted:
            skip = "the server compacted the context"
        # priced as the estimate stood before the call, before the estimator learns from it
        before = self.estimator.estimate_detail(messages, model=model)
        if skip is None:
            skip = self.request.skip_reason(has_anchor=before.has_anchor)
        measured = self._overhead_measured()
        extra = self.request.extra(has_anchor=before.has_anchor, overhead_measured=measured)
        if skip is None:
            learned, reason = self.estimator.learn_from(CallSeen(messages, usage, model, before))
        else:
            learned, reason = False, skip
        detail = self._with_request(before, extra)
        # a call without an anchor (and no compaction) is where an overhead gets measured
        fresh = not before.has_anchor and not before.crossed_compaction and skip is None
        self.request.observed(overhead_measured_now=fresh)
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
            "estimator": self.estimator.state_dict(),
            "errors": [list(e) for e in self._errors],
            "error_window": self._errors.maxlen,
            "last_error": self.last_error,
            "request": self.request.state_dict(),
        }

    @classmethod
    def from_state_dict(cls, state: Any) -> TokenTracker:
        """Rebuild from :meth:`state_dict`; ``ValueError`` when the state is not one.

        Every field is checked (finite numbers, sane ranges, the right shapes): whatever is
        wrong with ``state``, the error is a ``ValueError``, never another type.
        """
        try:
            return cls._from_checked_state(state)
        except ValueError:
            raise
        except (ArithmeticError, LookupError, TypeError, AttributeError, RecursionError) as exc:
            # the checks should leave nothing for these; a state they missed is still only
            # a malformed state to the caller
            raise ValueError(f"malformed tracker state: {type(exc).__name__}") from None

    @classmethod
    def _from_checked_state(cls, state: Any) -> TokenTracker:
        state = check_mapping(state, "tracker state")
        version = state.get("version")
        if isinstance(version, bool) or version != TRACKER_STATE_VERSION:
            raise ValueError(f"unsupported tracker state version {bounded_repr(version)}")
        check_keys(state, "tracker state", _STATE_KEYS)
        method = state.get("method")
        if not isinstance(method, str) or method not in _ESTIMATORS:
            raise ValueError(f"unknown token estimation method {bounded_repr(method)}")
        estimator = _ESTIMATORS[method].from_state_dict(state.get("estimator"))
        window = check_int(state.get("error_window"), "error_window", low=1, high=MAX_ERROR_WINDOW)
        tracker = cls(estimator=estimator, error_window=window)
        errors = state.get("errors")
        if not isinstance(errors, list):
            raise ValueError("errors must be a list")
        for i, entry in enumerate(errors[-window:]):
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
                raise ValueError(f"errors[{i}] must be [family, estimated part, real growth]")
            family, part, growth = entry
            tracker._errors.append(
                (
                    family,
                    check_int(part, f"errors[{i}] estimated part", low=0, high=MAX_TOKENS),
                    check_int(growth, f"errors[{i}] growth", low=-MAX_TOKENS, high=MAX_TOKENS),
                )
            )
        last = state.get("last_error")
        tracker.last_error = (
            None
            if last is None
            else check_int(last, "last_error", low=-MAX_TOKENS, high=MAX_TOKENS)
        )
        if state.get("request") is not None:  # absent from states saved before it existed
            tracker.request.load_state(state["request"])
        return tracker

    def for_subagent(self) -> TokenTracker:
        """A tracker for a sub-agent's conversation: what this one learned about how content
        tokenises, none of what belongs to this conversation (its overhead, its errors)."""
        return TokenTracker(
            estimator=self.estimator.for_subagent(), error_window=self._errors.maxlen or 512
        )

    def save(self, path: str | os.PathLike[str]) -> bool:
        """Write the state to ``path`` atomically (temp file, fsync, rename).

        Returns False, and logs a warning, when it cannot: the calibration is an optimisation
        and a failed save only means a resumed session starts cold, so it never fails a turn.
        """
        return self.save_state(path, self.state_dict())

    @staticmethod
    def save_state(
        path: str | os.PathLike[str],
        state: Mapping[str, Any],
        *,
        durable: bool = True,
        parents: bool = True,
    ) -> bool:
        """Write a :meth:`state_dict` taken earlier, as :meth:`save` does: the snapshot is
        taken on the event loop, the write (an fsync) goes to a worker thread. ``durable=False``:
        without the fsync; ``parents=False``: not into a directory gone meanwhile (see
        :func:`~pipeline.tokens.state_file.write_state`)."""
        return write_state(path, state, durable=durable, parents=parents)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, method: Method = "calibrated") -> TokenTracker:
        """The tracker saved at ``path``; a fresh ``method`` tracker when there is none.

        An unreadable or malformed file is logged and ignored (the session starts cold): not
        valid JSON or not matching its check (read while another process rewrote it), not a
        state :meth:`from_state_dict` accepts, not a regular file, or larger
        than :data:`MAX_STATE_BYTES`.
        """
        target = Path(path)
        try:
            state = decode_state(read_state_file(target))
            return cls.from_state_dict(state)
        except FileNotFoundError:
            return cls(method)
        except (OSError, ValueError, RecursionError) as exc:
            # RecursionError: JSON nested too deeply for the decoder
            reason = bounded_text(str(exc))
            get_logger().warning("token_calibration.load_failed", path=str(target), error=reason)
            return cls(method)
