"""The calibrated token estimator: learns chars-per-token online from the session's own usage.

The context before the next call is the usage total of the last real response (the *anchor*,
found by :func:`pipeline.tokens.find_anchor`) plus an estimate of what was added after it.
:class:`CalibratedEstimator` makes that estimate from the base tokens of
:mod:`pipeline.tokens.features`, times one multiplier per content class and model family, and
learns the multipliers from each call's usage delta with a robust Kalman (recursive least
squares) step: ``input_side(call) - input_side(anchor)`` against the class vector of what was
added (the anchor response, re-sent, plus everything after it).

Two things the reference does not do:

- **The anchor response is priced, not trusted.** Claude Code writes one record per content
  block and the last record's ``output_tokens`` is often a streaming snapshot (1, 8, 25...), so
  the estimate adds ``max(0, tokens(anchor response) - output_tokens)``.
- **It leans to over-counting.** The estimated part is multiplied by
  ``1 + margin_floor + margin_cold / sqrt(1 + n_obs)``: 5 % cold, falling to 2 % as the family's
  observations accrue. Under-counting is the dangerous direction (compaction fires too late,
  the API rejects the request); a larger margin would not catch the misses that remain (content
  the transcript does not show), it would only move the median.

The state (multipliers, covariances, measured overheads) is JSON-serialisable
(:meth:`CalibratedEstimator.state_dict`), so a resumed session does not start cold.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.messages import Message, Usage, thread_start
from pipeline.tokens.features import (
    CLASS_INDEX,
    CLASSES,
    FEATURES,
    OTHER_FAMILY_SD_FLOOR,
    PRIOR_MULTIPLIER,
    PRIOR_SD,
    PRIOR_WEIGHTS,
    ContentVector,
    content_vector,
    is_wire_visible,
    model_family,
)

__all__ = [
    "BIG_GROWTH",
    "STATE_VERSION",
    "UNDERCOUNT_TOLERANCE",
    "CalibratedEstimator",
    "ErrorStats",
    "EstimateDetail",
    "Observation",
    "compaction_restart",
    "nearest_rank",
    "rounded",
]

STATE_VERSION = 1
UNDERCOUNT_TOLERANCE = 0.10
"""An estimate more than 10 % below the real count is an under-count."""
BIG_GROWTH = 2_000
"""Relative errors are judged on calls whose real growth since the anchor is at least this:
on a growth of a few tokens a relative error says nothing."""

_STRUCTURE = CLASS_INDEX["structure"]
_MIN_MULTIPLIER = 0.05


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EstimateDetail:
    """One estimate, decomposed."""

    total: int
    """Tokens the context would hold if the messages were sent now."""
    anchor_total: int
    """Usage total of the anchor (input side + output_tokens); 0 without a usable anchor."""
    estimated_part: int
    """``total - anchor_total``: the estimated tokens (margin included)."""
    response_adjustment: float
    """``max(0, tokens(anchor response) - output_tokens)`` before the margin (0: reference)."""
    new_tokens: float
    """Tokens of the wire-visible content after the anchor response, before the margin."""
    margin: float
    """The safety margin applied to the estimated part (0: reference)."""
    family: str
    has_anchor: bool
    """An anchor was found and no compaction lies between it and the end."""
    crossed_compaction: bool
    """A compaction lies after the anchor: the request was rebuilt, its usage does not apply."""


@dataclass(frozen=True, slots=True)
class Observation:
    """One call's usage against what the tracker predicted for it (before learning from it)."""

    method: str
    family: str
    estimate: int
    """The whole-context estimate for the call's messages."""
    actual: int
    """The call's input side (input + cache writes + cache reads)."""
    estimated_part: int
    """The estimated part of ``estimate`` (what came after the anchor)."""
    real_growth: int | None
    """``actual`` minus the anchor's usage total: what the estimated part had to guess. None
    when it cannot be measured (no anchor, a compaction since it, or stages removed content
    the anchor's usage counted)."""
    learned: bool
    reason: str

    @property
    def relative_error(self) -> float | None:
        """``(estimated part - real growth) / real growth``, when the growth is known and > 0."""
        if self.real_growth is None or self.real_growth <= 0:
            return None
        return (self.estimated_part - self.real_growth) / self.real_growth


def rounded(x: float | None) -> float | None:
    """``x`` to 4 decimals, for JSON reports; None stays None."""
    return None if x is None else round(x, 4)


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ascending ``sorted_values`` by the nearest-rank rule."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


@dataclass(frozen=True, slots=True)
class ErrorStats:
    """Errors of the estimated part against the real growth since the anchor.

    Relative figures are over the calls with growth >= ``min_growth``; token figures over all.
    A value is None when there is no call to compute it on.
    """

    calls: int
    min_growth: int
    big_calls: int
    median_signed: float | None
    median_abs: float | None
    p95_abs: float | None
    undercounted: int
    """Calls (growth >= ``min_growth``) whose estimate is more than 10 % below the growth."""
    undercount_share: float | None
    median_abs_tokens: float | None
    p95_abs_tokens: float | None

    @classmethod
    def from_pairs(
        cls, pairs: Iterable[tuple[float, float]], *, min_growth: int = BIG_GROWTH
    ) -> ErrorStats:
        """Statistics of ``(estimated part, real growth)`` pairs."""
        pairs = list(pairs)
        rel = [(p - r) / r for p, r in pairs if r >= min_growth and r > 0]
        abs_rel = sorted(abs(e) for e in rel)
        abs_tok = sorted(abs(p - r) for p, r in pairs)
        under = sum(1 for e in rel if e < -UNDERCOUNT_TOLERANCE)
        return cls(
            calls=len(pairs),
            min_growth=min_growth,
            big_calls=len(rel),
            median_signed=statistics.median(rel) if rel else None,
            median_abs=statistics.median(abs_rel) if rel else None,
            p95_abs=nearest_rank(abs_rel, 0.95) if rel else None,
            undercounted=under,
            undercount_share=under / len(rel) if rel else None,
            median_abs_tokens=statistics.median(abs_tok) if abs_tok else None,
            p95_abs_tokens=nearest_rank(abs_tok, 0.95) if abs_tok else None,
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-ready, rounded."""
        return {
            "calls": self.calls,
            "min_growth": self.min_growth,
            "big_calls": self.big_calls,
            "median_signed_rel_error": rounded(self.median_signed),
            "abs_rel_error_median": rounded(self.median_abs),
            "abs_rel_error_p95": rounded(self.p95_abs),
            "undercount_gt_10pct": self.undercounted,
            "undercount_gt_10pct_share": rounded(self.undercount_share),
            "abs_error_tokens_median": rounded(self.median_abs_tokens),
            "abs_error_tokens_p95": rounded(self.p95_abs_tokens),
        }


def compaction_restart(messages: Sequence[Message], after: int) -> int | None:
    """Where the API's view restarts, when a compaction point lies after index ``after``."""
    # the wire normalisation's own rule, on the tail only: no scan of the whole session
    offset = thread_start(messages[after:])
    return after + offset if offset > 0 else None


# ---------------------------------------------------------------------------------------------
# The estimator
# ---------------------------------------------------------------------------------------------


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


class _FamilyState:
    """What one model family has learned in this session."""

    __slots__ = ("base_tokens", "chars", "mult", "n_obs", "p")

    def __init__(self, mult: list[float], p: list[list[float]]) -> None:
        self.mult = mult
        """One multiplier per class, on the base tokens."""
        self.p = p
        """Covariance of the multipliers."""
        self.n_obs = 0
        self.chars = [0.0] * len(CLASSES)  # seen per class, for the chars/token report
        self.base_tokens = [0.0] * len(CLASSES)


@dataclass(slots=True)
class _Split:
    """A message list cut at its anchor."""

    usage: Usage | None
    """The anchor's usage; None without an anchor or across a compaction."""
    anchor_model: str | None
    response: ContentVector
    """Every fragment of the anchor response, its first included."""
    new: ContentVector
    """The other wire-visible content after the anchor (or after the restart point)."""
    new_messages: int
    crossed: bool


class CalibratedEstimator:
    """Anchor usage + a calibrated estimate of what came after it; learns from each call.

    The anchor is the caller's (:func:`pipeline.tokens.find_anchor`): this class only prices
    and learns. Messages are immutable by convention, so each one is vectorised once (an LRU
    keyed by identity; the entry holds the message so its id cannot be reused).
    """

    def __init__(
        self,
        *,
        weights: Mapping[str, float] | None = None,
        prior_sd: Mapping[str, float] | None = None,
        prior_multiplier: Mapping[str, float] | None = None,
        margin_floor: float = 0.02,
        margin_cold: float = 0.03,
        rel_noise: float = 0.2,
        abs_noise: float = 60.0,
        clip_sigma: float = 2.0,
        learn: bool = True,
        compaction_extra: int = 0,
        cache_size: int = 4096,
    ) -> None:
        self.weights = dict(PRIOR_WEIGHTS if weights is None else weights)
        self.prior_sd = dict(PRIOR_SD if prior_sd is None else prior_sd)
        self.prior_multiplier = dict(
            PRIOR_MULTIPLIER if prior_multiplier is None else prior_multiplier
        )
        self.margin_floor = margin_floor
        self.margin_cold = margin_cold
        self.rel_noise = rel_noise
        """Observation noise relative to the predicted growth."""
        self.abs_noise = abs_noise
        """Observation noise in tokens (hidden per-turn harness text)."""
        self.clip_sigma = clip_sigma
        """Innovations are clipped at this many sigmas: a hidden 3k-token injection must not
        yank the ratios."""
        self.learn = learn
        self.families: dict[str, _FamilyState] = {}
        self.last_family: str | None = None
        self.overhead: int | None = None
        """System prompt + tool schemas, measured on a call without an anchor (its input side
        minus its messages). Added whenever there is no usable anchor."""
        self.compaction_extra = compaction_extra
        """What the harness adds after a compaction beyond the messages after the boundary
        (Claude Code restores recently read files). 0 by default: the library's own compaction
        sends exactly its messages. Re-measured on each first call after a compaction."""
        self._w = tuple(self.weights[f] for f in FEATURES)
        self._cache: OrderedDict[int, tuple[Message, ContentVector]] = OrderedDict()
        self._last_split: tuple[Usage, tuple[Message, ...], _Split] | None = None
        """The anchor usage, records from the anchor on and split of the latest estimate."""
        self._learned = 0
        """Counts :meth:`observe` calls: what an estimate depends on besides its split."""
        self._last_detail: tuple[_Split, str | None, int, EstimateDetail] | None = None
        self._cache_size = cache_size

    # -- content ------------------------------------------------------------------------------
    def vector(self, message: Message) -> ContentVector:
        """Base tokens per class of ``message`` (cached by identity)."""
        key = id(message)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is message:
            self._cache.move_to_end(key)
            return hit[1]
        vec = content_vector(message, self._w)
        self._cache[key] = (message, vec)
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return vec

    def _visible_sum(self, messages: Sequence[Message]) -> tuple[ContentVector, int]:
        total = ContentVector()
        count = 0
        for m in messages:
            if is_wire_visible(m):
                total.add(self.vector(m))
                count += 1
        return total, count

    def _split(self, messages: Sequence[Message], anchor: tuple[int, Usage] | None) -> _Split:
        if anchor is not None:
            # every stage of a pass asks about lists that share the records from the anchor on
            # (the part a split reads): compare them, object by object, with the last one
            tail = tuple(messages[anchor[0] :])
            last = self._last_split
            if last is not None and last[0] is anchor[1] and last[1] == tail:
                return last[2]
            split = self._split_uncached(messages, anchor)
            self._last_split = (anchor[1], tail, split)
            return split
        return self._split_uncached(messages, anchor)

    def _split_uncached(
        self, messages: Sequence[Message], anchor: tuple[int, Usage] | None
    ) -> _Split:
        if anchor is None:
            new, count = self._visible_sum(messages[thread_start(messages) :])
            return _Split(None, None, ContentVector(), new, count, crossed=False)
        i, usage = anchor
        first = messages[i]
        restart = compaction_restart(messages, i)
        if restart is not None:  # the request was rebuilt: price from the restart, no anchor
            new, count = self._visible_sum(messages[restart:])
            return _Split(None, first.model, ContentVector(), new, count, crossed=True)
        response, new, count = ContentVector(), ContentVector(), 0
        aid = first.message_id
        for j in range(i, len(messages)):
            m = messages[j]
            if m is first or (aid is not None and m.type == "assistant" and m.message_id == aid):
                response.add(self.vector(m))
            elif is_wire_visible(m):
                new.add(self.vector(m))
                count += 1
        return _Split(usage, first.model, response, new, count, crossed=False)

    # -- estimating ---------------------------------------------------------------------------
    def _margin(self, state: _FamilyState | None) -> float:
        n = state.n_obs if state is not None else 0
        return self.margin_floor + self.margin_cold / math.sqrt(1.0 + n)

    def _state_for_estimate(self, family: str) -> _FamilyState | None:
        state = self.families.get(family)
        if state is None and self.last_family is not None:
            # a family not seen yet in this session: the one in use so far is the best guess
            state = self.families.get(self.last_family)
        return state

    def _multipliers(self, state: _FamilyState | None) -> Sequence[float]:
        if state is not None:
            return state.mult
        return [self.prior_multiplier.get(c, 1.0) for c in CLASSES]

    def _new_tokens(self, mult: Sequence[float], split: _Split) -> float:
        tokens = _dot(mult, split.new.tokens)
        if split.new_messages:  # a new turn: its markers and per-turn harness text
            tokens += self.weights["call"] * mult[_STRUCTURE]
        return tokens

    def _detail(self, split: _Split, model: str | None) -> EstimateDetail:
        last = self._last_detail
        if last is not None and last[0] is split and last[1] == model and last[2] == self._learned:
            return last[3]
        detail = self._detail_uncached(split, model)
        self._last_detail = (split, model, self._learned, detail)
        return detail

    def _detail_uncached(self, split: _Split, model: str | None) -> EstimateDetail:
        name = model or split.anchor_model
        family = model_family(name) if name else (self.last_family or "other")
        state = self._state_for_estimate(family)
        mult = self._multipliers(state)
        margin = self._margin(state)
        new_tokens = self._new_tokens(mult, split)
        if split.usage is None:
            part = new_tokens * (1.0 + margin) + (self.overhead or 0)
            if split.crossed:
                part += self.compaction_extra
            anchor_total, adjustment = 0, 0.0
        else:
            out = split.usage.output_tokens
            anchor_total = split.usage.total
            adjustment = max(0.0, _dot(mult, split.response.tokens) - out)
            part = (adjustment + new_tokens) * (1.0 + margin)
        estimated = math.ceil(part)
        return EstimateDetail(
            total=anchor_total + estimated,
            anchor_total=anchor_total,
            estimated_part=estimated,
            response_adjustment=adjustment,
            new_tokens=new_tokens,
            margin=margin,
            family=family,
            has_anchor=split.usage is not None,
            crossed_compaction=split.crossed,
        )

    def estimate_detail(
        self,
        messages: Sequence[Message],
        anchor: tuple[int, Usage] | None,
        *,
        model: str | None = None,
    ) -> EstimateDetail:
        """The estimate for ``messages`` whose anchor is ``anchor``, decomposed.

        ``model``: the model about to be called (default: the anchor's, else the last seen).
        """
        return self._detail(self._split(messages, anchor), model)

    def tokens_for_messages(self, messages: Sequence[Message], *, model: str | None = None) -> int:
        """Calibrated tokens of the wire-visible content of ``messages`` alone: no anchor, no
        overhead, no margin (to price a span a stage removes or a message it adds)."""
        family = model_family(model) if model else (self.last_family or "other")
        mult = self._multipliers(self._state_for_estimate(family))
        return math.ceil(_dot(mult, self._visible_sum(messages)[0].tokens))

    # -- learning -----------------------------------------------------------------------------
    def _state(self, family: str) -> _FamilyState:
        """The family's state, created from the priors (or the session's current family)."""
        state = self.families.get(family)
        if state is not None:
            return state
        sd = [self.prior_sd.get(c, 0.1) for c in CLASSES]
        if family == "other":
            sd = [max(s, OTHER_FAMILY_SD_FLOOR) for s in sd]
        mult = [self.prior_multiplier.get(c, 1.0) for c in CLASSES]
        if self.last_family is not None and self.last_family in self.families:
            # a model switch inside a session: Claude 4.x share a tokenizer, so start from
            # what this session has learned so far (with a fresh prior covariance)
            mult = list(self.families[self.last_family].mult)
        d = len(CLASSES)
        p = [[(sd[i] ** 2 if i == j else 0.0) for j in range(d)] for i in range(d)]
        state = _FamilyState(mult, p)
        self.families[family] = state
        return state

    def observe(
        self,
        messages: Sequence[Message],
        anchor: tuple[int, Usage] | None,
        usage: Usage,
        *,
        model: str | None = None,
        skip: str | None = None,
    ) -> tuple[EstimateDetail, bool, str]:
        """Learn from one call: ``messages`` is what it saw, ``usage`` its usage.

        Returns the estimate as it stood before learning, whether it learned, and why (not).
        ``skip``: the caller knows the delta is confounded (say, stages removed content the
        anchor's usage counted); nothing is learned and ``skip`` is the reason.
        """
        split = self._split(messages, anchor)
        detail = self._detail(split, model)
        self._learned += 1  # whatever follows may change the state every estimate reads
        if skip is not None:
            return detail, False, skip
        family = model_family(model or split.anchor_model)
        in_side = usage.input_side
        if split.usage is None:
            state = self._state(family)
            content = self._new_tokens(state.mult, split)
            self.last_family = family
            if split.crossed and self.overhead is not None:
                self.compaction_extra = max(0, round(in_side - content - self.overhead))
                return detail, False, "after a compaction: extra measured"
            self.overhead = max(0, round(in_side - content))
            return detail, False, "no anchor: overhead measured"
        both_known = model is not None and split.anchor_model is not None
        if both_known and model_family(split.anchor_model) != family:
            # the system prompt changes with the model: this delta is not content
            self._state(family)
            self.last_family = family
            return detail, False, "model family changed"
        state = self._state(family)
        self.last_family = family
        x = [split.response.tokens[i] + split.new.tokens[i] for i in range(len(CLASSES))]
        if split.new_messages:
            x[_STRUCTURE] += self.weights["call"]
        for i in range(len(CLASSES)):
            state.chars[i] += split.response.chars[i] + split.new.chars[i]
            state.base_tokens[i] += x[i]
        state.n_obs += 1
        if not self.learn:
            return detail, False, "learning off"
        self._kalman(state, x, float(in_side - split.usage.input_side))
        return detail, True, "ok"

    def _kalman(self, state: _FamilyState, x: list[float], y: float) -> None:
        """One robust recursive-least-squares step of ``y ~ mult . x``."""
        d = len(CLASSES)
        p = state.p
        px = [_dot(p[i], x) for i in range(d)]
        s = _dot(x, px)
        y_hat = _dot(state.mult, x)
        s += self.abs_noise**2 + (self.rel_noise * max(y_hat, 0.0)) ** 2
        cut = self.clip_sigma * math.sqrt(s)
        innovation = max(-cut, min(cut, y - y_hat))
        gain = [v / s for v in px]
        state.mult = [max(_MIN_MULTIPLIER, state.mult[i] + gain[i] * innovation) for i in range(d)]
        state.p = [[p[i][j] - gain[i] * px[j] for j in range(d)] for i in range(d)]

    # -- reporting ----------------------------------------------------------------------------
    def ratios(self, family: str | None = None) -> dict[str, dict[str, float | None]]:
        """Per class: multiplier, its standard deviation, chars seen, and the effective
        chars/token over this session (None for a class not seen yet)."""
        name = family or self.last_family or "other"
        state = self.families.get(name)
        if state is None:
            state = _FamilyState([self.prior_multiplier.get(c, 1.0) for c in CLASSES], [])
        out: dict[str, dict[str, float | None]] = {}
        for i, c in enumerate(CLASSES):
            tokens = state.base_tokens[i] * state.mult[i]
            variance = state.p[i][i] if state.p else self.prior_sd.get(c, 0.1) ** 2
            out[c] = {
                "multiplier": state.mult[i],
                "sd": math.sqrt(max(0.0, variance)),
                "chars": state.chars[i],
                "chars_per_token": state.chars[i] / tokens
                if state.chars[i] and tokens > 0
                else None,
            }
        return out

    # -- persistence --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: configuration, priors, learned multipliers, overheads."""
        return {
            "version": STATE_VERSION,
            "config": {
                "weights": dict(self.weights),
                "prior_sd": dict(self.prior_sd),
                "prior_multiplier": dict(self.prior_multiplier),
                "margin_floor": self.margin_floor,
                "margin_cold": self.margin_cold,
                "rel_noise": self.rel_noise,
                "abs_noise": self.abs_noise,
                "clip_sigma": self.clip_sigma,
                "learn": self.learn,
                "compaction_extra": self.compaction_extra,
            },
            "last_family": self.last_family,
            "overhead": self.overhead,
            "families": {
                name: {
                    "mult": dict(zip(CLASSES, st.mult, strict=True)),
                    "p": [list(row) for row in st.p],
                    "n_obs": st.n_obs,
                    "chars": list(st.chars),
                    "base_tokens": list(st.base_tokens),
                }
                for name, st in self.families.items()
            },
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> CalibratedEstimator:
        """Rebuild from :meth:`state_dict`; ValueError on another version or a bad shape."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported estimator state version {state.get('version')!r}")
        est = cls(**dict(state.get("config") or {}))
        est.last_family = state.get("last_family")
        overhead = state.get("overhead")
        est.overhead = None if overhead is None else int(overhead)
        d = len(CLASSES)
        for name, raw in (state.get("families") or {}).items():
            mult = raw["mult"]
            st = _FamilyState(
                [float(mult.get(c, est.prior_multiplier.get(c, 1.0))) for c in CLASSES],
                [[float(v) for v in row] for row in raw["p"]],
            )
            if len(st.p) != d or any(len(row) != d for row in st.p):
                raise ValueError("state covariance does not match the class list")
            st.n_obs = int(raw.get("n_obs", 0))
            st.chars = [float(v) for v in raw.get("chars", st.chars)]
            st.base_tokens = [float(v) for v in raw.get("base_tokens", st.base_tokens)]
            if len(st.chars) != d or len(st.base_tokens) != d:
                raise ValueError("state counts do not match the class list")
            est.families[str(name)] = st
        return est
