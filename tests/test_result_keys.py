"""A result's ledger key is its id and the SHA-256 of its output, inside a request's scope
(``keys_shared``, where an output met twice is digested once) as outside it; what the scope
keeps is let go of at its end."""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pipeline.results.keys import keys_shared, result_key


def by_definition(tool_use_id: str, core: Any) -> str:
    if isinstance(core, str):
        data = b"s" + core.encode("utf-8", "surrogatepass")
    else:
        text = json.dumps(core, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        data = b"j" + text.encode("utf-8", "surrogatepass")
    return f"{tool_use_id}#{hashlib.sha256(data).hexdigest()[:32]}"


class Text(str):
    """An output that is a string, not exactly ``str``."""


outputs = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1),
    st.builds(Text, st.text()),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text()}), max_size=3),
)


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), outputs), min_size=1, max_size=8))
def test_a_key_in_a_request_is_the_key_by_definition(results: list[tuple[str, Any]]) -> None:
    # each output again as another object of the same value: a digest kept by value
    again = [(i, "".join(list(c)) if type(c) is str else c) for i, c in results]
    with keys_shared():
        inside = [result_key(i, c) for i, c in results + again]
    assert inside == [by_definition(i, c) for i, c in results + again]
    assert [result_key(i, c) for i, c in results] == inside[: len(results)]


def test_one_result_keyed_twice_is_one_string_and_the_scope_lets_go() -> None:
    output = "".join(["out", "put " * 1_000])  # an object of its own
    held = sys.getrefcount(output)
    with keys_shared():
        first, second = result_key("t", output), result_key("t", "".join(list(output)))
        assert first is second
        assert sys.getrefcount(output) > held  # its digest is kept while the request lasts
    assert sys.getrefcount(output) == held
