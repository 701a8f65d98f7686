"""The reference estimator: a fixed rough count after the anchor, as Claude Code makes it.

``round(len/4)`` per text, 2 chars/token for JSON-family text, a fixed 2,000 for images and
documents, ``tool_use`` = name + JSON input, thinking = its text, other blocks = their JSON
(written as ``JSON.stringify`` writes it: no spaces); no usage anywhere: estimate everything.
It learns nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pipeline.messages import Message, context_start
from pipeline.tokens.anchor import compaction_restart, find_anchor
from pipeline.tokens.estimator import CallSeen
from pipeline.tokens.features import Segment, block_segments, is_wire_visible, iter_segments
from pipeline.tokens.media import IMAGE_TOKENS
from pipeline.tokens.priors import model_family
from pipeline.tokens.stats import EstimateDetail
from pipeline.tokens.text_stats import looks_like_json
from pipeline.wire.deferred import resolved

__all__ = [
    "ReferenceEstimator",
    "rough_tokens_for_block",
    "rough_tokens_for_messages",
    "rough_tokens_for_text",
]


def rough_tokens_for_text(text: str) -> int:
    """``round(len/4)`` as JavaScript's ``Math.round`` rounds (a half up, where Python's
    ``round`` goes to the even: 10 chars are 3 tokens, not 2); 2 chars/token for JSON-family
    text (dense punctuation)."""
    per = 2 if looks_like_json(text) else 4
    return (2 * len(text) + per) // (2 * per)


def rough_tokens_for_messages(messages: Iterable[Message]) -> int:
    """The reference rough estimate of the wire-visible content of ``messages``."""
    return sum(map(_rough_tokens, messages))


def rough_tokens_for_block(block: Mapping[str, Any]) -> int:
    """The reference rough estimate of one content block of a wire-visible message (a
    message's estimate is the sum over its blocks; an item that is not a block costs 0)."""
    if not isinstance(block, Mapping):
        return 0
    if block.get("type") == "tool_result":
        content = resolved(block.get("content"))
        if isinstance(content, str):  # the commonest block: its wrapper is free, its text not
            return rough_tokens_for_text(content)
    return _priced(block_segments(block))


def _rough_tokens(m: Message) -> int:
    return _priced(iter_segments(m)) if is_wire_visible(m) else 0


def _priced(segments: Iterable[Segment]) -> int:
    """The rough count of some segments: a fixed price per image or document, text by length."""
    total = 0
    for seg in segments:
        total += IMAGE_TOKENS if seg.kind == "media" else rough_tokens_for_text(seg.text)
    return total


_MEMO_SIZE = 1_024

NOTHING_TO_LEARN = "reference: nothing to learn"
"""Why the reference estimator learns from no call."""


class ReferenceEstimator:
    """The fixed rough count (see the module docstring): an :class:`~pipeline.tokens.Estimator`
    that never learns."""

    method = "reference"

    def __init__(self) -> None:
        # the records after the anchor are priced on every estimate of a call (and the
        # response's own fragments on every call until the next one): each once, by identity
        self._memo: dict[int, tuple[Message, int]] = {}

    def _rough(self, messages: Sequence[Message]) -> int:
        if len(messages) > _MEMO_SIZE // 2:  # a whole history (no anchor): priced once, as is
            return rough_tokens_for_messages(messages)
        memo, total = self._memo, 0
        for m in messages:
            hit = memo.get(id(m))
            if hit is None or hit[0] is not m:
                if len(memo) >= _MEMO_SIZE:
                    memo.clear()  # only the records after an anchor are looked up again
                hit = memo[id(m)] = (m, _rough_tokens(m))
            total += hit[1]
        return total

    def estimate_detail(
        self, messages: Sequence[Message], *, model: str | None = None
    ) -> EstimateDetail:
        """The anchor's usage total plus the rough count of everything after its first record."""
        anchor = find_anchor(messages)
        if anchor is None:
            start = context_start(messages)
            part, anchor_total = self._rough(messages[start:]), 0
            family, crossed = model_family(model), False
        else:
            i, usage = anchor
            part, anchor_total = self._rough(messages[i + 1 :]), usage.total
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
            # the reference prices across a compaction as if nothing happened; the flag only
            # tells the error statistics that the call cannot be measured
            has_anchor=anchor is not None and not crossed,
            crossed_compaction=crossed,
        )

    def tokens_for_messages(self, messages: Sequence[Message], *, model: str | None = None) -> int:
        """The rough count of ``messages`` alone."""
        return rough_tokens_for_messages(messages)

    def learn_from(self, call: CallSeen) -> tuple[bool, str]:
        """Nothing is learned."""
        return False, NOTHING_TO_LEARN

    def ratios(self, family: str | None = None) -> dict[str, dict[str, float | None]]:
        """The fixed ratios: 4 chars/token for text, 2 for JSON-family text."""
        return {"text": {"chars_per_token": 4.0}, "json": {"chars_per_token": 2.0}}

    def state_dict(self) -> dict[str, Any] | None:
        """Nothing to keep."""
        return None

    @classmethod
    def from_state_dict(cls, state: Any) -> ReferenceEstimator:
        """A reference estimator (it has no state: ``state`` must be None, as
        :meth:`state_dict` writes it; ``ValueError`` otherwise)."""
        if state is not None:
            raise ValueError("a reference estimator has no state")
        return cls()

    def for_subagent(self) -> ReferenceEstimator:
        """A reference estimator (it has no state)."""
        return ReferenceEstimator()
