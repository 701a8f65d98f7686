"""``WireCache.to_api`` equals ``to_api`` on every call of a growing, sometimes edited history.

Records come from the same generator as ``to_api``'s own property (late fragments of earlier
responses, interleaved results, prompts, attachments, local commands, compact boundaries,
empty records). A history is fed in growing prefixes, as an agent or a replay calls; between
calls the caller sometimes edits, drops or reorders records, or starts a new list. Every
call's request must be ``to_api``'s, byte for byte, and :attr:`WireCache.chars` must be
``request_chars`` of it.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import Message, to_api
from pipeline.wire import WireCache, request_chars
from tests.builders import results, tool_result, tool_use, user_text
from tests.test_incremental import records

EXAMPLES = 1_500


@settings(max_examples=EXAMPLES, deadline=None)
@given(records(), st.lists(st.integers(0, 9), min_size=1, max_size=12), st.data())
def test_incremental_request_equals_to_api(
    history: list[Message], steps: list[int], data: st.DataObject
) -> None:
    cache = WireCache()
    view: list[Message] = []
    for step in steps:
        cut = data.draw(st.integers(len(view), max(len(view), len(history))))
        view = view + history[len(view) : cut]
        if step == 0 and view:  # an edit somewhere
            i = data.draw(st.integers(0, len(view) - 1))
            view[i] = user_text(f"edited {i}")
        elif step == 1 and view:  # a record dropped
            del view[data.draw(st.integers(0, len(view) - 1))]
        elif step == 2 and len(view) > 1:  # two swapped
            view[0], view[-1] = view[-1], view[0]
        elif step == 3:  # the same records in a new list
            view = list(view)
        request = cache.to_api(view)
        expected = to_api(view)
        assert json.dumps(request) == json.dumps(expected)
        assert cache.chars == request_chars(expected)


def test_a_grown_history_reuses_every_message_but_the_last() -> None:
    """The point of the cache: the request of a grown history shares the earlier message dicts,
    except the last one, which new user records may merge into."""
    cache = WireCache()
    history: list[Message] = [user_text("start")]
    for k in range(5):
        history += [
            Message.assistant([tool_use(f"u{k}")], message_id=f"r{k}"),
            results(tool_result(f"u{k}", "x" * k)),
        ]
    first = cache.to_api(history)
    history += [user_text("and more")]  # merges into the last user message
    second = cache.to_api(history)
    assert second == to_api(history)
    assert all(a is b for a, b in zip(first[:-1], second[:-1], strict=True))
    assert first[-1] is not second[-1] and len(first) == len(second)
    assert second is not cache.to_api(history)  # a new list on every call
