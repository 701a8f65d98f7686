"""A result's ledger key is its id and the SHA-256 of its output, inside a request's scope
(``keys_shared``, where an output the request holds is digested once) as outside it; what the
scope keeps is let go of at its end, and an output read back or cut for the key is not kept."""

from __future__ import annotations

import contextvars
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import anthropic
import anyio
from hypothesis import given
from hypothesis import strategies as st

from pipeline import Message, Pipeline, SessionContext
from pipeline.dropin.wrap import wrap
from pipeline.results.keys import keys_shared, result_key
from pipeline.testing import Reply, ScriptedMessagesServer
from tests.sdk_support import sdk_client


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
    st.sampled_from(["", "a", "ab", "abc", "b", "ba"]),  # prefixes of one another
    st.text(),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1),
    st.builds(Text, st.text()),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text()}), max_size=3),
)


@given(
    st.lists(st.tuples(st.sampled_from(["a", "b"]), outputs, st.booleans()), min_size=1, max_size=8)
)
def test_a_key_in_a_request_is_the_key_by_definition(results: list[tuple[str, Any, bool]]) -> None:
    # each output again as another object of the same value: a digest kept by value
    again = [(i, "".join(list(c)) if type(c) is str else c, k) for i, c, k in results]
    with keys_shared():
        inside = [result_key(i, c, kept=k) for i, c, k in results + again]
    assert inside == [by_definition(i, c) for i, c, _k in results + again]
    assert [result_key(i, c) for i, c, _k in results] == inside[: len(results)]


def test_outputs_that_begin_alike_keep_their_own_digests() -> None:
    outputs = ["a", "ab", "abc", "b", "ab"]
    with keys_shared():
        keys = [result_key("t", output, kept=True) for output in outputs]
    assert keys == [by_definition("t", output) for output in outputs]


def test_one_result_keyed_twice_is_one_string_and_the_scope_lets_go() -> None:
    output = "".join(["out", "put " * 1_000])  # an object of its own
    held = sys.getrefcount(output)
    with keys_shared():
        first = result_key("t", output, kept=True)
        second = result_key("t", "".join(list(output)), kept=True)
        assert first is second
        assert sys.getrefcount(output) > held  # its digest is kept while the request lasts
        later = contextvars.copy_context()  # a callback's copy, run after the request
    assert sys.getrefcount(output) == held
    assert later.run(result_key, "t", output, kept=True) == first
    assert sys.getrefcount(output) == held  # the copy shares nothing once the request ended


def test_an_output_read_back_or_cut_is_not_kept() -> None:
    output = "".join(["read", " back" * 1_000])
    held = sys.getrefcount(output)
    with keys_shared():
        result_key("t", output)
        assert sys.getrefcount(output) == held


def test_a_pass_under_wrap_shares_its_keys(tmp_path: Path) -> None:
    """A pass of a wrapped client -- synchronous, asynchronous, a long first pass on a loop of
    its own -- keys one result as one string, as the proxy's requests do."""
    seen: list[bool] = []

    class Keys:
        name = "keys"

        async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
            output = "".join(["out", "put"])
            seen.append(result_key("t", output) is result_key("t", "".join(list(output))))
            return messages

    def script(_body: dict[str, Any]) -> Reply:
        return Reply([{"type": "text", "text": "done"}])

    ask = [{"role": "user", "content": "go"}]
    with ScriptedMessagesServer(script) as server:
        sync = wrap(
            anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0),
            root=tmp_path / "a",
            pipeline=lambda: Pipeline([Keys()]),
        )
        sync.messages.create(model="m", max_tokens=5, messages=ask)  # type: ignore[arg-type]
        for long_pass in (None, 1):
            client = wrap(
                sdk_client(server.base_url),
                root=tmp_path / f"b{long_pass}",
                pipeline=lambda: Pipeline([Keys()]),
                long_pass=long_pass,
            )

            async def call(client: anthropic.AsyncAnthropic = client) -> None:
                await client.messages.create(model="m", max_tokens=5, messages=ask)  # type: ignore[arg-type]

            anyio.run(call)
    assert seen == [True, True, True]
