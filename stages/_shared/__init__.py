"""The parts every stage shares, in one place: tool results and replace-by-id (:mod:`.results`),
rounds and cut points (:mod:`.rounds`), per-session state and decision records
(:mod:`.records`), the reusable last output (:mod:`.projection`) and the pass of a projecting
stage (:mod:`.projection_pass`). The argument checks are imported from :mod:`.args` itself."""

from pipeline.policies import DEFAULT_CONTEXT_WINDOW
from stages._shared.projection import Projection
from stages._shared.projection_pass import ProjectionPass, ProjectionState
from stages._shared.records import record_decision, session_state, write_off_loop
from stages._shared.results import (
    CLEARED_PLACEHOLDER,
    ContentFor,
    by_id,
    patch_message,
    patch_results,
    replace_results,
    result_ids,
    tool_results,
)
from stages._shared.rounds import (
    Price,
    RoundView,
    anchor_uuid,
    api_rounds,
    cut_indices,
    freed_before_anchor,
    is_prompt,
    last_response,
    priced_before,
    protected_rounds,
    safe_cuts,
)

__all__ = [
    "CLEARED_PLACEHOLDER",
    "DEFAULT_CONTEXT_WINDOW",
    "ContentFor",
    "Price",
    "Projection",
    "ProjectionPass",
    "ProjectionState",
    "RoundView",
    "anchor_uuid",
    "api_rounds",
    "by_id",
    "cut_indices",
    "freed_before_anchor",
    "is_prompt",
    "last_response",
    "patch_message",
    "patch_results",
    "priced_before",
    "protected_rounds",
    "record_decision",
    "replace_results",
    "result_ids",
    "safe_cuts",
    "session_state",
    "tool_results",
    "write_off_loop",
]
