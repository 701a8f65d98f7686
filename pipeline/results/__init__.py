"""A record's tool results as the stages read them (:mod:`.reading`: each one's output, the
harness tail split off, whether the budget may decide on it) and the ledger's key for each
(:mod:`.keys`: its id and a digest of its output; what a replacement text is)."""

from pipeline.results.keys import (
    MAX_REPLACEMENT_CHARS,
    PERSISTED_OUTPUT_TAG,
    content_digest,
    is_replacement_text,
    result_key,
    tool_use_id_of,
)
from pipeline.results.reading import (
    ResultSlot,
    answered_results,
    candidate_size,
    content_is_empty,
    is_candidate,
    is_candidate_content,
    read_results,
)

__all__ = [
    "MAX_REPLACEMENT_CHARS",
    "PERSISTED_OUTPUT_TAG",
    "ResultSlot",
    "answered_results",
    "candidate_size",
    "content_digest",
    "content_is_empty",
    "is_candidate",
    "is_candidate_content",
    "is_replacement_text",
    "read_results",
    "result_key",
    "tool_use_id_of",
]
