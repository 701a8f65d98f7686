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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.messages import MAX_TOKENS, Message, Usage, context_start
from pipeline.tokens.anchor import compaction_restart, find_anchor
from pipeline.tokens.checks import (
    bounded_repr,
    check_int,
    check_keys,
    check_mapping,
    checked_config,
    checked_family,
    or_empty,
)
from pipeline.tokens.estimator import CallSeen
from pipeline.tokens.family import FamilyModel, dot
from pipeline.tokens.features import ContentVector, is_wire_visible, packed_vector
from pipeline.tokens.priors import (
    CLASS_INDEX,
    CLASSES,
    FEATURES,
    OTHER_FAMILY_SD_FLOOR,
    PRIOR_MULTIPLIER,
    PRIOR_SD,
    PRIOR_WEIGHTS,
    model_family,
)
from pipeline.tokens.stats import EstimateDetail

__all__ = ["STATE_VERSION", "CalibratedEstimator"]

STATE_VERSION = 1
_STRUCTURE = CLASS_INDEX["structure"]


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
    """Anchor usage + a calibrated estimate of what came after it; learns from each call: an
    :class:`~pipeline.tokens.Estimator`.

    The anchor is the caller's (:func:`pipeline.tokens.find_anchor`): this class only prices
    and learns. Messages are immutable by convention, so each one is vectorised once while
    it is in use (an LRU keyed by identity, the entry holding the message so its id cannot be
    reused; a vector no estimate used during the last call is let go of at the next one). An
    estimate depends on the records, the anchor, the model and what it has observed
    (:attr:`observations` counts the calls): it and the tracker reuse an answer until one of
    those changes, so set its options when making it, not between calls.
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
        self.families: dict[str, FamilyModel] = {}
        self.last_family: str | None = None
        self.overhead: int | None = None
        """System prompt + tool schemas, measured on a call without an anchor (its input side
        minus its messages). Added whenever there is no usable anchor."""
        self.compaction_extra = compaction_extra
        """What the harness adds after a compaction beyond the messages after the boundary
        (Claude Code restores recently read files). 0 by default: the library's own compaction
        sends exactly its messages. Re-measured on each first call after a compaction."""
        self._w = tuple(self.weights[f] for f in FEATURES)
        # keyed by the record itself (records hash by identity): no id to keep beside it; a
        # plain dict kept in use order (an entry ~36 bytes, an OrderedDict's ~84) and the
        # vector packed (~70 bytes, the array ~350): at 4,096 records a conversation, this
        # cache was the largest state a held conversation had after its content
        self._cache: dict[Message, bytes] = {}
        # the vectors the last call used (a call's end moves _cache here; one used again
        # moves back): a history priced whole once (a first estimate without an anchor, a
        # stage's first cut) is let go of two calls later, where a plain LRU kept it as long
        # as the conversation was held (~0.13x of a held conversation's wire text)
        self._older: dict[Message, bytes] = {}
        self._last_split: tuple[Usage | None, tuple[Message, ...], _Split] | None = None
        """The anchor usage, records from the anchor on and split of the latest estimate."""
        self._learned = 0
        """Counts :meth:`learn_from` calls: what an estimate depends on besides its split."""
        self._last_detail: tuple[_Split, str | None, int, EstimateDetail] | None = None
        self._cache_size = cache_size

    method = "calibrated"

    @property
    def observations(self) -> int:
        """Calls offered to :meth:`learn_from` so far (learned from or not): what an estimate reads
        besides the records, its anchor and the model."""
        return self._learned

    # -- content ------------------------------------------------------------------------------
    def vector(self, message: Message) -> ContentVector:
        """Base tokens per class of ``message`` (cached by identity)."""
        return ContentVector.unpack(self._packed(message))

    def _packed(self, message: Message) -> bytes:
        cache = self._cache
        hit = cache.pop(message, None)
        if hit is None:
            hit = self._older.pop(message, None)
            if hit is None:
                hit = packed_vector(message, self._w)
        cache[message] = hit  # the most recently used: last
        if len(cache) > self._cache_size:
            del cache[next(iter(cache))]  # the least recently used
        return hit

    def _visible_sum(self, messages: Sequence[Message]) -> tuple[ContentVector, int]:
        packed = [self._packed(m) for m in messages if is_wire_visible(m)]
        return ContentVector.sum_packed(packed), len(packed)

    def _split(self, messages: Sequence[Message], anchor: tuple[int, Usage] | None) -> _Split:
        # every stage of a pass asks about lists that share the records a split reads (from
        # the anchor on, or all of them before a first response): compare them, object by
        # object, with the last one's
        usage = anchor[1] if anchor is not None else None
        tail = tuple(messages[anchor[0] :] if anchor is not None else messages)
        last = self._last_split
        if last is not None and last[0] is usage and last[1] == tail:
            return last[2]
        split = self._split_uncached(messages, anchor)
        self._last_split = (usage, tail, split)
        return split

    def _split_uncached(
        self, messages: Sequence[Message], anchor: tuple[int, Usage] | None
    ) -> _Split:
        if anchor is None:
            start = context_start(messages)
            new, count = self._visible_sum(messages[start:])
            # a history cut at a compaction (what the pipeline's stages see) starts with it
            crossed = start > 0 or (bool(messages) and messages[0].restarts_thread)
            return _Split(None, None, ContentVector(), new, count, crossed=crossed)
        i, usage = anchor
        first = messages[i]
        restart = compaction_restart(messages, i)
        if restart is not None:  # the request was rebuilt: price from the restart, no anchor
            new, count = self._visible_sum(messages[restart:])
            return _Split(None, first.model, ContentVector(), new, count, crossed=True)
        answer: list[bytes] = []
        after: list[bytes] = []
        aid = first.message_id
        for j in range(i, len(messages)):
            m = messages[j]
            if m is first or (aid is not None and m.type == "assistant" and m.message_id == aid):
                answer.append(self._packed(m))
            elif is_wire_visible(m):
                after.append(self._packed(m))
        response, new = ContentVector.sum_packed(answer), ContentVector.sum_packed(after)
        return _Split(usage, first.model, response, new, len(after), crossed=False)

    # -- estimating ---------------------------------------------------------------------------
    def _margin(self, state: FamilyModel | None) -> float:
        n = state.n_obs if state is not None else 0
        return self.margin_floor + self.margin_cold / math.sqrt(1.0 + n)

    def _state_for_estimate(self, family: str) -> FamilyModel | None:
        state = self.families.get(family)
        if state is None and self.last_family is not None:
            # a family not seen yet in this session: the one in use so far is the best guess
            state = self.families.get(self.last_family)
        return state

    def _multipliers(self, state: FamilyModel | None) -> Sequence[float]:
        if state is not None:
            return state.mult
        return [self.prior_multiplier.get(c, 1.0) for c in CLASSES]

    def _new_tokens(self, mult: Sequence[float], split: _Split) -> float:
        tokens = dot(mult, split.new.tokens)
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
            adjustment = max(0.0, dot(mult, split.response.tokens) - out)
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
        self, messages: Sequence[Message], *, model: str | None = None
    ) -> EstimateDetail:
        """The estimate for ``messages`` from their usage anchor, decomposed.

        ``model``: the model about to be called (default: the anchor's, else the last seen).
        """
        return self._detail(self._split(messages, find_anchor(messages)), model)

    def tokens_for_messages(self, messages: Sequence[Message], *, model: str | None = None) -> int:
        """Calibrated tokens of the wire-visible content of ``messages`` alone: no anchor, no
        overhead, no margin (to price a span a stage removes or a message it adds)."""
        family = model_family(model) if model else (self.last_family or "other")
        mult = self._multipliers(self._state_for_estimate(family))
        return math.ceil(dot(mult, self._visible_sum(messages)[0].tokens))

    # -- learning -----------------------------------------------------------------------------
    def _state(self, family: str) -> FamilyModel:
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
        state = FamilyModel.from_prior(mult, sd)
        self.families[family] = state
        return state

    def learn_from(self, call: CallSeen) -> tuple[bool, str]:
        """Learn from one call: whether it learned, and why (not)."""
        split = self._split(call.messages, find_anchor(call.messages))
        # a call's end: the vectors no estimate used since the last one are let go of
        self._older, self._cache = self._cache, {}
        self._learned += 1  # whatever follows may change the state every estimate reads
        model, usage = call.model, call.usage
        family = model_family(model or split.anchor_model)
        in_side = usage.input_side
        if split.usage is None:
            state = self._state(family)
            content = self._new_tokens(state.mult, split)
            self.last_family = family
            if split.crossed and self.overhead is not None:
                self.compaction_extra = max(0, round(in_side - content - self.overhead))
                return False, "after a compaction: extra measured"
            self.overhead = max(0, round(in_side - content))
            return False, "no anchor: overhead measured"
        both_known = model is not None and split.anchor_model is not None
        if both_known and model_family(split.anchor_model) != family:
            # the system prompt changes with the model: this delta is not content
            self._state(family)
            self.last_family = family
            return False, "model family changed"
        state = self._state(family)
        self.last_family = family
        r_tokens, n_tokens = split.response.tokens, split.new.tokens
        x = [r_tokens[i] + n_tokens[i] for i in range(len(CLASSES))]
        if split.new_messages:
            x[_STRUCTURE] += self.weights["call"]
        r_chars, n_chars = split.response.chars, split.new.chars
        for i in range(len(CLASSES)):
            state.chars[i] += r_chars[i] + n_chars[i]
            state.base_tokens[i] += x[i]
        state.n_obs += 1
        if not self.learn:
            return False, "learning off"
        state.update(
            x,
            float(in_side - split.usage.input_side),
            abs_noise=self.abs_noise,
            rel_noise=self.rel_noise,
            clip_sigma=self.clip_sigma,
        )
        return True, "ok"

    # -- reporting ----------------------------------------------------------------------------
    def ratios(self, family: str | None = None) -> dict[str, dict[str, float | None]]:
        """Per class: multiplier, its standard deviation, chars seen, and the effective
        chars/token over this session (None for a class not seen yet)."""
        name = family or self.last_family or "other"
        state = self.families.get(name)
        if state is None:
            state = FamilyModel([self.prior_multiplier.get(c, 1.0) for c in CLASSES], [])
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
            "families": {name: model.to_json() for name, model in self.families.items()},
        }

    @classmethod
    def from_state_dict(cls, state: Any) -> CalibratedEstimator:
        """Rebuild from :meth:`state_dict`; ``ValueError`` on another version or on anything
        :meth:`state_dict` could not have written (:mod:`pipeline.tokens.checks`)."""
        state = check_mapping(state, "estimator state")
        version = state.get("version")
        if isinstance(version, bool) or version != STATE_VERSION:
            raise ValueError(f"unsupported estimator state version {bounded_repr(version)}")
        check_keys(
            state, "estimator state", ("version", "config", "last_family", "overhead", "families")
        )
        est = cls(**checked_config(or_empty(state.get("config"))))
        last_family = state.get("last_family")
        est.last_family = None if last_family is None else checked_family(last_family)
        overhead = state.get("overhead")
        est.overhead = (
            None if overhead is None else check_int(overhead, "overhead", low=0, high=MAX_TOKENS)
        )
        families = check_mapping(or_empty(state.get("families")), "families")
        for name, raw in families.items():
            est.families[checked_family(name)] = FamilyModel.from_json(raw, est.prior_multiplier)
        return est

    def for_subagent(self) -> CalibratedEstimator:
        """What this one learned about how content tokenises (the multipliers per model
        family), none of what belongs to this conversation (its system-prompt-and-tools
        overhead)."""
        # a copy, not a trip through from_state_dict: a configuration the caller chose is
        # theirs to keep, even where a saved file holding it would be refused
        clone = CalibratedEstimator(**self.state_dict()["config"])
        clone.last_family = self.last_family
        clone.families = {name: model.copy() for name, model in self.families.items()}
        return clone
