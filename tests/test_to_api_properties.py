"""Properties of `to_api` over generated record sequences.

Every generated block carries a unique marker (text, thinking, tool_use id, tool_result content)
so an output block can be traced back to the record it came from; the only change `to_api` may
make to a block is the ``\\n`` appended to a text block at a text/text seam.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import Message, to_api
from pipeline.wire.encoding import encodable
from pipeline.wire.pairing import check_pairing

PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

TOOL_ID_POOL = ["ta", "tb", "tc"]  # tool_result ids: sometimes repeated, sometimes unmatched
MESSAGE_ID_POOL = ["X", "Y", "Z", None]


# --------------------------------------------------------------------------------------------
# Markers
# --------------------------------------------------------------------------------------------


def marker(block: dict[str, Any]) -> tuple[str, str]:
    """The unique identity of a generated block (a seam newline does not change it)."""
    btype = block["type"]
    if btype == "text":
        return ("text", block["text"].removesuffix("\n"))
    if btype == "thinking":
        return ("thinking", block["thinking"])
    if btype == "tool_use":
        return ("tool_use", block["id"])
    if btype == "tool_result":
        return ("tool_result", block["content"])
    raise AssertionError(f"unexpected block {block!r}")


def param_blocks(param: Any) -> list[dict[str, Any]]:
    content = param["content"]
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return list(content)


def canonical(block: dict[str, Any]) -> str:
    return json.dumps(block, sort_keys=True)


# --------------------------------------------------------------------------------------------
# Arbitrary record sequences
# --------------------------------------------------------------------------------------------

_KINDS = (
    ["user_str"] * 3
    + ["user_text_list", "user_mixed", "user_empty"]
    + ["user_results"] * 4
    + ["assistant"] * 6
    + ["progress", "system", "local_command", "local_command_empty"]
    + ["attachment", "attachment", "attachment_empty"]
    + ["boundary", "summary"]
)


@st.composite
def record_sequences(draw: st.DrawFn) -> list[Message]:
    kinds = draw(st.lists(st.sampled_from(_KINDS), max_size=30))
    msgs: list[Message] = []
    for k, kind in enumerate(kinds):

        def tr(j: int, k: int = k) -> dict[str, Any]:
            tid = draw(st.sampled_from(TOOL_ID_POOL))
            return {"type": "tool_result", "tool_use_id": tid, "content": f"r{k}.{j}"}

        if kind == "user_str":
            msgs.append(Message.user(f"s{k}"))
        elif kind == "user_text_list":
            n = draw(st.integers(1, 2))
            msgs.append(Message.user([{"type": "text", "text": f"u{k}.{j}"} for j in range(n)]))
        elif kind == "user_mixed":
            blocks = [
                {"type": "text", "text": f"u{k}.0"},
                tr(1),
                {"type": "text", "text": f"u{k}.2"},
            ]
            msgs.append(Message.user(list(draw(st.permutations(blocks)))))
        elif kind == "user_empty":
            empty: Any = draw(st.sampled_from(["", []]))
            msgs.append(Message.user(empty))
        elif kind == "user_results":
            msgs.append(Message.user([tr(j) for j in range(draw(st.integers(1, 2)))]))
        elif kind == "assistant":
            blocks = []
            for j in range(draw(st.integers(1, 2))):
                btype = draw(st.sampled_from(["text", "thinking", "tool_use"]))
                if btype == "text":
                    blocks.append({"type": "text", "text": f"a{k}.{j}"})
                elif btype == "thinking":
                    blocks.append({"type": "thinking", "thinking": f"th{k}.{j}", "signature": "s"})
                else:
                    blocks.append(
                        {"type": "tool_use", "id": f"tu{k}.{j}", "name": "B", "input": {}}
                    )
            mid = draw(st.sampled_from(MESSAGE_ID_POOL))
            content: Any = blocks
            if len(blocks) == 1 and blocks[0]["type"] == "text" and draw(st.booleans()):
                content = blocks[0]["text"]  # assistant content as a plain string
            msgs.append(Message.assistant(content, message_id=mid))
        elif kind == "progress":
            msgs.append(Message(type="progress"))
        elif kind == "system":
            subtype = draw(st.sampled_from([None, "turn_duration", "informational"]))
            msgs.append(Message(type="system", subtype=subtype, content=f"sys{k}"))
        elif kind == "local_command":
            msgs.append(Message(type="system", subtype="local_command", content=f"lc{k}"))
        elif kind == "local_command_empty":
            msgs.append(Message(type="system", subtype="local_command", content=""))
        elif kind == "attachment":
            n = draw(st.integers(1, 2))
            msgs.append(
                Message(
                    type="attachment",
                    content=[{"type": "text", "text": f"at{k}.{j}"} for j in range(n)],
                )
            )
        elif kind == "attachment_empty":
            nothing: Any = draw(st.sampled_from(["", []]))
            msgs.append(Message(type="attachment", content=nothing))
        elif kind == "boundary":
            msgs.append(Message(type="system", subtype="compact_boundary", content="compacted"))
        else:  # summary
            msgs.append(Message.user(f"sum{k}", is_compact_summary=True))
    return msgs


def visible_records(msgs: Sequence[Message]) -> list[Message]:
    """The records the API sees: after the last compact boundary or summary, without
    progress, non-local-command system records and empty attachments/local commands."""
    start = 0
    for i, m in enumerate(msgs):
        if m.type == "system" and m.subtype == "compact_boundary":
            start = i + 1
        elif m.type == "user" and m.is_compact_summary:
            start = i
    out = []
    for m in msgs[start:]:
        if m.type == "progress":
            continue
        if m.type == "system" and (m.subtype != "local_command" or not m.content):
            continue
        if m.type == "attachment" and not m.content:
            continue
        out.append(m)
    return out


@dataclass
class Origin:
    position: int  # order of the block among all visible input blocks
    message_id: str | None  # the record's response id (assistant blocks)
    role: str


def origins(msgs: Sequence[Message]) -> dict[tuple[str, str], Origin]:
    table: dict[tuple[str, str], Origin] = {}
    for m in visible_records(msgs):
        role = "assistant" if m.type == "assistant" else "user"
        for b in m.blocks:
            key = marker(b)
            assert key not in table, "generator markers must be unique"
            table[key] = Origin(len(table), m.message_id, role)
    return table


def rebuild(out: Sequence[Any], table: dict[tuple[str, str], Origin]) -> list[Message]:
    """Messages back from wire params: the assistant id is that of the merged entry's records."""
    rebuilt = []
    for param in out:
        if param["role"] == "user":
            rebuilt.append(Message.user(param["content"]))
        else:
            ids = {table[marker(b)].message_id for b in param_blocks(param)}
            assert len(ids) == 1, "an assistant entry merges records of one response id only"
            rebuilt.append(Message.assistant(param["content"], message_id=ids.pop()))
    return rebuilt


# --------------------------------------------------------------------------------------------
# Properties over arbitrary sequences
# --------------------------------------------------------------------------------------------


def assert_tool_results_kept(msgs: Sequence[Message], out: Sequence[Any]) -> None:
    """The multiset of tool_result blocks sent equals the multiset of visible ones."""
    sent = Counter(
        canonical(b)
        for m in visible_records(msgs)
        for b in m.blocks
        if b.get("type") == "tool_result"
    )
    received = Counter(
        canonical(b) for p in out for b in param_blocks(p) if b.get("type") == "tool_result"
    )
    assert received == sent


def assert_every_block_once_with_its_role(
    table: dict[tuple[str, str], Origin], out: Sequence[Any]
) -> None:
    seen = Counter(marker(b) for p in out for b in param_blocks(p))
    assert seen == Counter(table.keys())
    for p in out:
        for b in param_blocks(p):
            assert table[marker(b)].role == p["role"]
            if b["type"] == "text" and b["text"].endswith("\n"):
                assert p["role"] == "user", "only user text gets a seam newline"


def assert_order_kept_except_hoisting(
    table: dict[tuple[str, str], Origin], out: Sequence[Any]
) -> None:
    for p in out:
        blocks = param_blocks(p)
        positions = [table[marker(b)].position for b in blocks]
        if p["role"] == "assistant":
            assert positions == sorted(positions)
            continue
        is_result = [b["type"] == "tool_result" for b in blocks]
        assert is_result == sorted(is_result, reverse=True), "tool_results come first"
        results = [pos for pos, r in zip(positions, is_result, strict=True) if r]
        others = [pos for pos, r in zip(positions, is_result, strict=True) if not r]
        assert results == sorted(results)
        assert others == sorted(others)


def assert_users_merged(out: Sequence[Any]) -> None:
    roles = [p["role"] for p in out]
    assert all(not (a == b == "user") for a, b in itertools.pairwise(roles)), roles
    for p in out:
        if isinstance(p["content"], str):
            assert p["role"] == "user", "only a lone user message may be a plain string"


@PROPERTY_SETTINGS
@given(record_sequences())
def test_to_api_is_idempotent(msgs: list[Message]) -> None:
    out = to_api(msgs)
    again = to_api(rebuild(out, origins(msgs)))
    assert again == out
    assert json.dumps(again) == json.dumps(out)


@PROPERTY_SETTINGS
@given(record_sequences())
def test_to_api_loses_nothing_and_reorders_only_by_hoisting(msgs: list[Message]) -> None:
    table = origins(msgs)
    out = to_api(msgs)
    assert_tool_results_kept(msgs, out)
    assert_every_block_once_with_its_role(table, out)
    assert_order_kept_except_hoisting(table, out)
    assert_users_merged(out)


# --------------------------------------------------------------------------------------------
# Well-formed conversations
# --------------------------------------------------------------------------------------------


@st.composite
def conversations(draw: st.DrawFn) -> list[Message]:
    """Claude Code shaped: one record per content block, one tool_result per user record,
    results written as soon as a tool ran (possibly before the response's next fragment),
    noise (progress, system, attachments, local commands) anywhere it can occur."""
    msgs: list[Message] = []
    n = iter(range(10**6))

    def noise() -> None:
        kind = draw(st.integers(0, 5))  # one draw: mostly nothing
        if kind == 4:
            msgs.append(Message(type="progress"))
        elif kind == 5:
            msgs.append(Message(type="system", subtype="turn_duration", content="1s"))

    def user_context() -> None:
        """Things that fold into the neighbouring user message."""
        kind = draw(st.sampled_from(["none", "none", "attachment", "local_command"]))
        if kind == "attachment":
            msgs.append(
                Message(type="attachment", content=[{"type": "text", "text": f"att{next(n)}"}])
            )
        elif kind == "local_command":
            msgs.append(Message(type="system", subtype="local_command", content=f"lc{next(n)}"))

    n_turns = draw(st.integers(1, 4))
    for turn in range(n_turns):
        last_turn = turn == n_turns - 1
        if turn > 0 and draw(st.integers(0, 5)) == 0:  # a compaction between turns
            msgs.append(Message(type="system", subtype="compact_boundary"))
            msgs.append(Message.user(f"summary{next(n)}", is_compact_summary=True))
        user_context()
        prompt = f"prompt{next(n)}"
        prompt_content: Any = draw(st.sampled_from([prompt, [{"type": "text", "text": prompt}]]))
        msgs.append(Message.user(prompt_content))
        user_context()
        noise()
        n_cycles = draw(st.integers(1, 3))
        stop_after_results = last_turn and draw(st.booleans())
        for cycle in range(n_cycles):
            final = cycle == n_cycles - 1
            with_tools = not final or stop_after_results
            rid = f"msg_{next(n)}"
            blocks: list[dict[str, Any]] = []
            if draw(st.booleans()):
                blocks.append({"type": "thinking", "thinking": f"th{next(n)}", "signature": "s"})
            if draw(st.booleans()) or not with_tools:
                blocks.append({"type": "text", "text": f"say{next(n)}"})
            tool_ids = [
                f"toolu_{next(n)}" for _ in range(draw(st.integers(1, 3)) if with_tools else 0)
            ]
            blocks += [{"type": "tool_use", "id": t, "name": "Bash", "input": {}} for t in tool_ids]
            pending: list[str] = []
            for block in blocks:
                msgs.append(Message.assistant([block], message_id=rid, model="m"))
                noise()
                if block["type"] == "tool_use":
                    pending.append(block["id"])
                flush = draw(st.booleans())
                if pending and flush:  # results written before the next fragment
                    for tid in draw(st.permutations(pending)):
                        msgs.append(
                            Message.user(
                                [
                                    {
                                        "type": "tool_result",
                                        "tool_use_id": tid,
                                        "content": f"out-{tid}",
                                    }
                                ]
                            )
                        )
                        noise()
                    pending = []
            for tid in draw(st.permutations(pending)):
                msgs.append(
                    Message.user(
                        [{"type": "tool_result", "tool_use_id": tid, "content": f"out-{tid}"}]
                    )
                )
                noise()
            if with_tools and draw(st.integers(0, 3)) == 0:
                user_context()  # e.g. a reminder attached to the results
    return msgs


@PROPERTY_SETTINGS
@given(conversations())
def test_well_formed_conversation_gives_alternating_paired_request(msgs: list[Message]) -> None:
    out = to_api(msgs)
    roles = [p["role"] for p in out]
    assert roles[0] == "user"
    assert all(a != b for a, b in itertools.pairwise(roles)), roles
    assert check_pairing(out) == []
    # Between the fragments of one response there are only tool results and dropped records,
    # so each response id becomes exactly one assistant message holding its blocks in order.
    expected: dict[str | None, list[dict[str, Any]]] = {}
    for m in visible_records(msgs):
        if m.type == "assistant":
            expected.setdefault(m.message_id, []).extend(m.blocks)
    assert [p["content"] for p in out if p["role"] == "assistant"] == list(expected.values())


# -- requests always encode ---------------------------------------------------------------------

_TEXT = st.text(
    alphabet=st.sampled_from(["a", "é", "日", "😀", "\ud800", "\udfff", "\udcff", "\n"]),
    max_size=6,
)
_VALUES = st.recursive(
    st.none() | st.integers() | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=10,
)


def _is_surrogate(c: str) -> bool:
    return 0xD800 <= ord(c) <= 0xDFFF


def _expected(value: Any) -> Any:
    """The rule: a lone surrogate becomes U+FFFD in text, its ``\\uXXXX`` escape in a key."""
    if isinstance(value, str):
        return "".join("\ufffd" if _is_surrogate(c) else c for c in value)
    if isinstance(value, dict):
        return {
            "".join(f"\\u{ord(c):04x}" if _is_surrogate(c) else c for c in k): _expected(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_expected(v) for v in value]
    return value


@settings(max_examples=500, deadline=None)
@given(_VALUES)
def test_encodable_leaves_nothing_that_utf8_refuses(value: Any) -> None:
    cleaned = encodable(value)
    json.dumps(cleaned, ensure_ascii=False).encode("utf-8")  # never raises
    assert cleaned == _expected(value)
    if json.dumps(value) == json.dumps(_expected(value)):
        assert cleaned is value  # nothing to clean: the very same object, no copy


@settings(max_examples=200, deadline=None)
@given(st.lists(_TEXT, min_size=1, max_size=4))
def test_a_request_with_lone_surrogates_always_encodes(texts: list[str]) -> None:
    messages = [Message.user(t or "x") for t in texts]
    json.dumps(to_api(messages), ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("length", [65_535, 65_536, 65_537, 300_000])
@pytest.mark.parametrize("where", [0, -1, None])
def test_long_texts_are_checked_whole_on_both_sides_of_the_encoding_limit(
    length: int, where: int | None
) -> None:
    """Texts up to 65,536 characters are tested by encoding them, longer ones by a search: a
    lone surrogate at either end is found both ways, and non-ASCII text without one is left
    as it is."""
    chars = ["\u00e9"] * length  # non-ASCII: no shortcut on the string's ASCII flag
    if where is not None:
        chars[where] = "\udc80"
    text = "".join(chars)
    cleaned = encodable({"type": "text", "text": text})
    if where is None:
        assert cleaned["text"] is text
    else:
        assert cleaned["text"].count("\ufffd") == 1 and len(cleaned["text"]) == length
        cleaned["text"].encode("utf-8")


class _LenientEncode(str):
    def encode(self, encoding: str = "utf-8", errors: str = "surrogatepass") -> bytes:
        return str.encode(self, encoding, errors)


class _NoLen(str):
    def __len__(self) -> int:
        raise TypeError("no len")


@pytest.mark.parametrize("kind", [_LenientEncode, _NoLen])
def test_a_str_subclass_is_checked_by_what_it_holds(kind: type[str]) -> None:
    """The check reads the string itself, not methods a subclass may override."""
    cleaned = encodable({"type": "text", "text": kind("caf\u00e9 \ud800")})
    assert cleaned["text"] == "caf\u00e9 \ufffd"
    json.dumps(cleaned, ensure_ascii=False).encode("utf-8")


def test_a_cleaned_key_never_meets_another() -> None:
    # the escape of a surrogate is itself text a key may hold
    cleaned = encodable({"\ud800": "first", "\\ud800": "second", "\\ud800\ufffd": "third"})
    assert sorted(cleaned.values()) == ["first", "second", "third"]
    json.dumps(cleaned, ensure_ascii=False).encode("utf-8")


def test_content_that_contains_itself_is_walked_once() -> None:
    """A tool input that refers to itself (built in code, never loaded) has no JSON form: the
    surrogate check walks it once and leaves it as it is, for the JSON encoder to refuse with
    its own error, rather than looping forever."""
    loop: dict[str, Any] = {"a": "x"}
    loop["self"] = loop
    ring: list[Any] = ["y"]
    ring.append(ring)
    for value in (loop, ring, {"blocks": [loop, ring]}):
        assert encodable(value) is value
    use = {"type": "tool_use", "id": "t1", "name": "Read", "input": loop}
    request = to_api([Message.assistant([use], message_id="r1")])
    with pytest.raises(ValueError, match="Circular reference"):
        json.dumps(request)
