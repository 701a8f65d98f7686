"""The token tracker: every docs/behaviour.md §4 reference rule, and properties of both methods.

The reference figures are computed by hand from the rule (``round(len/4)``, JSON-family text 2
chars/token, 2,000 per image or document), never by calling the code under test.
"""

from __future__ import annotations

import json
import re
from array import array
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import Message, SessionContext, TokenTracker, Usage
from pipeline.messages import SYNTHETIC_MODEL
from pipeline.tokens import (
    IMAGE_TOKENS,
    ReferenceEstimator,
    find_anchor,
    rough_tokens_for_block,
    rough_tokens_for_messages,
    rough_tokens_for_text,
    text_stats,
)
from pipeline.tokens.features import ContentVector
from pipeline.tokens.text_stats import looks_like_json
from tests.builders import assistant, results, tool_result, tool_use, user_text
from tests.json_values import json_values

METHODS = ("reference", "calibrated")
U = Usage(
    input_tokens=10, cache_creation_input_tokens=200, cache_read_input_tokens=3_000, output_tokens=7
)
IMAGE: dict[str, Any] = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "A" * 9},
}
PDF = {
    "type": "document",
    "source": {"type": "base64", "media_type": "application/pdf", "data": ""},
}


def _js(value: object) -> str:
    """``JSON.stringify(value)``: compact, non-ASCII as it is (how the reference writes JSON)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def ref() -> TokenTracker:
    return TokenTracker("reference")


# ---------------------------------------------------------------------------------------------
# Reference rules
# ---------------------------------------------------------------------------------------------


def test_usage_total_is_input_plus_cache_writes_plus_cache_reads_plus_output() -> None:
    msgs = [user_text("hi"), assistant("m1", {"type": "text", "text": "yo"}, usage=U)]
    assert ref().estimate(msgs) == 10 + 200 + 3_000 + 7
    assert ref().estimate_after_anchor(msgs) == 0


def test_default_method_is_calibrated_and_reference_is_selectable() -> None:
    assert TokenTracker().method == "calibrated"
    assert SessionContext("s", "/nonexistent").token_tracker.method == "calibrated"
    assert ref().method == "reference" and isinstance(ref().estimator, ReferenceEstimator)
    with pytest.raises(ValueError):
        TokenTracker("len/4")  # type: ignore[arg-type]


def test_text_is_round_len_over_4() -> None:
    # as JavaScript's Math.round, a half up: 2 chars -> 0.5 -> 1; 6 -> 1.5 -> 2; 10 -> 2.5 -> 3
    # (Python's round() would give 0, 2, 2: halves to the even)
    assert [rough_tokens_for_text("x" * n) for n in (0, 1, 2, 3, 6, 10, 1002, 400)] == [
        0,
        0,
        1,
        1,
        2,
        3,
        251,
        100,
    ]


def test_everything_after_the_anchor_is_estimated() -> None:
    msgs = [
        user_text("a" * 4_000),  # before the anchor: counted by its usage, not estimated
        assistant("m1", {"type": "text", "text": "b" * 40}, usage=U),
        user_text("c" * 400),
    ]
    assert ref().estimate(msgs) == U.total + 100
    assert ref().estimate_after_anchor(msgs) == 100


def test_same_id_backtrack_across_interleaved_tool_results() -> None:
    msgs = [
        user_text("go"),
        assistant("m1", tool_use("t1", "Bash", command="ls")),  # first fragment, no usage
        results(tool_result("t1", "r" * 400)),  # between the fragments: must be estimated
        assistant("m1", tool_use("t2", "Bash", command="pwd"), usage=U),  # usage on the last
        results(tool_result("t2", "s" * 80)),
    ]
    anchor = find_anchor(msgs)
    assert anchor is not None and anchor == (1, U)
    second_fragment = rough_tokens_for_text("Bash" + _js({"command": "pwd"}))
    assert ref().estimate(msgs) == U.total + 100 + second_fragment + 20


def test_records_without_an_id_are_walked_past_and_another_id_stops_the_walk() -> None:
    walk_past = [
        assistant("m1", {"type": "text", "text": "first"}),
        Message(type="progress"),  # no assistant id: walked past
        results(tool_result("t", "x")),
        assistant("m1", {"type": "text", "text": "last"}, usage=U),
    ]
    assert find_anchor(walk_past) == (0, U)
    stopped = [
        assistant("m1", {"type": "text", "text": "older fragment"}),
        assistant("m2", {"type": "text", "text": "another response"}),  # a different id stops
        assistant("m1", {"type": "text", "text": "last"}, usage=U),
    ]
    assert find_anchor(stopped) == (2, U)


def test_the_latest_usage_snapshot_of_a_response_is_its_usage() -> None:
    early = Usage(input_tokens=10, output_tokens=1)
    msgs = [
        assistant("m1", {"type": "text", "text": "a"}, usage=early),
        assistant("m1", {"type": "text", "text": "b"}, usage=U),
    ]
    assert find_anchor(msgs) == (0, U)
    assert ref().estimate(msgs) == U.total + 0  # "b" is 1 char: round(0.25) = 0


def test_synthetic_messages_are_never_anchors_but_are_counted() -> None:
    synthetic = Message.assistant(
        [{"type": "text", "text": "z" * 40}],
        message_id="syn",
        usage=Usage(input_tokens=999_999),
        model=SYNTHETIC_MODEL,
    )
    msgs = [user_text("go"), assistant("m1", {"type": "text", "text": "ok"}, usage=U), synthetic]
    assert find_anchor(msgs) == (1, U)
    assert ref().estimate(msgs) == U.total + 10
    assert find_anchor([user_text("go"), synthetic]) is None


def test_images_and_documents_are_a_fixed_2000_whatever_their_size() -> None:
    big_image = dict(IMAGE, source=dict(IMAGE["source"], data="Q" * 1_000_000))
    msgs = [
        Message.user([IMAGE, {"type": "text", "text": "abcd"}]),
        Message.user([big_image, PDF]),
        results(tool_result("t1", [IMAGE, {"type": "text", "text": "x" * 8}])),
    ]
    assert IMAGE_TOKENS == 2_000
    assert rough_tokens_for_messages(msgs) == 2_000 + 1 + 2_000 + 2_000 + 2_000 + 2


_TEXTS = st.sampled_from(["", "ok", "x" * 9, "{}", ' {"a": 1} ', "[1]", "é" * 7, "\ud800"])
_BLOCKS = st.recursive(
    st.one_of(
        st.builds(lambda t: {"type": "text", "text": t}, _TEXTS),
        st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": "s"}, _TEXTS),
        st.just(IMAGE),
        st.builds(lambda t: tool_use("u", "Read", arg=t), _TEXTS),
        st.builds(lambda t: {"type": "server_tool_use", "name": t}, _TEXTS),
        st.sampled_from(["junk", 7, None]),  # not a block: skipped
    ),
    lambda inner: st.builds(
        lambda c, err: {"type": "tool_result", "tool_use_id": "u", "content": c, "is_error": err},
        st.one_of(_TEXTS, st.none(), st.integers(), st.lists(inner, max_size=3)),
        st.booleans(),
    ),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_BLOCKS, max_size=4))
def test_a_message_costs_the_sum_of_its_blocks(blocks: list[dict[str, Any]]) -> None:
    """What a microcompact clear counts block by block (cached per block) is what the whole
    message counts (tool_result text has a shortcut of its own)."""
    total = rough_tokens_for_messages([Message.user(blocks)])
    assert sum(map(rough_tokens_for_block, blocks)) == total


def test_json_family_text_is_2_chars_per_token() -> None:
    obj = json.dumps({"k": "v" * 94})  # 103 chars
    assert rough_tokens_for_text(obj) == 52  # round(51.5), not round(103 / 4)
    assert rough_tokens_for_text("  [1, 2, 3, 4]\n") == round(15 / 2)  # blanks around count
    assert rough_tokens_for_text("{ not closed") == round(12 / 4)
    assert rough_tokens_for_text("{}") == 1 and rough_tokens_for_text("{") == 0
    padded = " " * 600 + "{" + "x" * 1_000 + "}" + "\n" * 600  # long, padded: still JSON
    assert rough_tokens_for_text(padded) == round(len(padded) / 2)


def test_tool_use_is_name_plus_json_input_thinking_is_its_text_others_their_json() -> None:
    use = tool_use("t1", "Read", file_path="/src/main.py")
    thinking = {"type": "thinking", "thinking": "t" * 40, "signature": "s" * 400}
    redacted = {"type": "redacted_thinking", "data": "d" * 80}
    other = {"type": "server_tool_use", "id": "srv", "name": "web_search", "input": {"q": "x"}}
    msg = Message.assistant([use, thinking, redacted, other], message_id="m1")
    expected = (
        round(len("Read" + _js({"file_path": "/src/main.py"})) / 4)
        + 10  # the thinking text only, not the signature
        + 20
        + round(len(_js(other)) / 2)  # a block's JSON is JSON-family text
    )
    assert rough_tokens_for_messages([msg]) == expected


def test_tool_result_string_and_block_list_contents() -> None:
    msg = results(
        tool_result("a", "x" * 40),
        tool_result("b", [{"type": "text", "text": "y" * 80}, {"type": "text", "text": "z" * 4}]),
        tool_result("c", None),
    )
    assert rough_tokens_for_messages([msg]) == 10 + 20 + 1


def test_progress_and_system_records_are_not_sent_local_command_output_is() -> None:
    msgs = [
        Message(type="progress", content="p" * 400),
        Message(type="system", subtype="informational", content="s" * 400),
        Message(type="system", subtype="local_command", content="l" * 40),
        Message(type="attachment", content=[{"type": "text", "text": "a" * 80}]),
    ]
    assert rough_tokens_for_messages(msgs) == 10 + 20


def test_without_usage_everything_is_estimated() -> None:
    msgs = [
        user_text("a" * 400),
        assistant("m1", {"type": "text", "text": "b" * 40}),  # no usage: not an anchor
        user_text("c" * 80),
    ]
    assert find_anchor(msgs) is None
    assert ref().estimate(msgs) == ref().estimate_after_anchor(msgs) == 100 + 10 + 20


def test_reference_observe_records_the_error_and_learns_nothing() -> None:
    tracker = ref()
    msgs = [
        user_text("go"),
        assistant("m1", {"type": "text", "text": "ok"}, usage=U),
        user_text("q" * 8_000),  # reference: 2,000
    ]
    obs = tracker.observe(msgs, Usage(input_tokens=U.total + 3_000))
    assert (obs.estimated_part, obs.real_growth, obs.learned) == (2_000, 3_000, False)
    assert tracker.last_error == U.total + 2_000 - (U.total + 3_000)
    stats = tracker.error_stats()
    assert (stats.calls, stats.big_calls, stats.undercounted) == (1, 1, 1)
    assert stats.median_signed == pytest.approx(-1 / 3)
    assert tracker.estimate(msgs) == U.total + 2_000  # nothing learned
    assert tracker.ratios() == {"text": {"chars_per_token": 4.0}, "json": {"chars_per_token": 2.0}}


def test_looks_like_json_never_copies_but_agrees_with_strip() -> None:
    for text in ["", " ", "{", "{}", " [ ] ", "x" * 2_000, " " * 300 + "[" + "1," * 400 + "1]"]:
        s = text.strip()
        expected = len(s) >= 2 and (s[0] + s[-1] in ("{}", "[]"))
        assert looks_like_json(text) is expected, text[:20]


@given(
    st.text(alphabet=" \n\t{}[]ab", max_size=40),
    st.integers(0, 700),
    st.text(alphabet=" \n\t{}[]ab", max_size=40),
)
def test_looks_like_json_matches_the_strip_rule(head: str, middle: int, tail: str) -> None:
    text = head + "m" * middle + tail  # long texts exercise the no-copy path
    s = text.strip()
    assert looks_like_json(text) is (len(s) >= 2 and s[0] + s[-1] in ("{}", "[]"))


# ---------------------------------------------------------------------------------------------
# Properties of both methods
# ---------------------------------------------------------------------------------------------

_TEXT = st.one_of(
    st.text(alphabet=st.sampled_from(list("abcXYZ019 \n\t{}[]():;,.\"'→é中\x1b")), max_size=300),
    st.text(alphabet=" \t", max_size=40),  # blank runs weigh negative in the base model
)
_USAGE = st.builds(
    Usage,
    input_tokens=st.integers(0, 50_000),
    output_tokens=st.integers(0, 5_000),
    cache_creation_input_tokens=st.integers(0, 5_000),
    cache_read_input_tokens=st.integers(0, 50_000),
)
_IDS = st.sampled_from(["m1", "m2", "m3", "m4"])


@st.composite
def _content_message(draw: st.DrawFn) -> Message:
    """Any message that adds content and carries no usage (so it cannot become an anchor)."""
    kind = draw(st.sampled_from(["user", "result", "assistant", "image", "attach", "system"]))
    text = draw(_TEXT)
    if kind == "user":
        return Message.user(text)
    if kind == "result":
        content: Any = draw(st.one_of(st.just(text), st.just([{"type": "text", "text": text}])))
        return results(tool_result("t", content, is_error=draw(st.booleans())))
    if kind == "assistant":
        blocks = draw(
            st.sampled_from(
                [
                    [{"type": "text", "text": text}],
                    [{"type": "thinking", "thinking": text}],
                    [tool_use("t", "Bash", command=text)],
                ]
            )
        )
        return Message.assistant(blocks, message_id=draw(_IDS), model="claude-sonnet-4-5")
    if kind == "image":
        return Message.user([IMAGE, PDF])
    if kind == "attach":
        return Message(type="attachment", content=[{"type": "text", "text": text}])
    subtype = draw(st.sampled_from(["local_command", "informational"]))
    return Message(type="system", subtype=subtype, content=text)


@st.composite
def _response(draw: st.DrawFn) -> Message:
    """An assistant record with usage: a real response, or a synthetic one."""
    model = draw(st.sampled_from(["claude-opus-4-6", "claude-haiku-4-5", SYNTHETIC_MODEL, "gpt"]))
    return Message.assistant(
        [{"type": "text", "text": draw(_TEXT)}],
        message_id=draw(_IDS),
        usage=draw(_USAGE),
        model=model,
    )


_CONVERSATION = st.lists(st.one_of(_content_message(), _response()), max_size=12)


def _warm(method: str, conversation: list[Message]) -> TokenTracker:
    """A tracker that has observed every call of ``conversation`` (multipliers moved)."""
    tracker = TokenTracker(method)  # type: ignore[arg-type]
    for i, m in enumerate(conversation):
        if m.type == "assistant" and m.usage is not None and not m.is_synthetic:
            tracker.observe(conversation[:i], m.usage, model=m.model)
    return tracker


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    conversation=_CONVERSATION,
    added=st.lists(_content_message(), min_size=1, max_size=4),
    history=_CONVERSATION,
)
def test_adding_content_never_lowers_the_estimate(
    method: str, conversation: list[Message], added: list[Message], history: list[Message]
) -> None:
    tracker = _warm(method, history)
    before = tracker.estimate(conversation)
    after = tracker.estimate([*conversation, *added])
    assert after >= before >= 0
    assert tracker.estimate_after_anchor([*conversation, *added]) >= 0


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=_CONVERSATION, history=_CONVERSATION)
def test_the_estimate_is_never_negative(
    method: str, conversation: list[Message], history: list[Message]
) -> None:
    # compaction points included: the estimate restarts there, it never goes below 0
    boundary = Message(type="system", subtype="compact_boundary", content="")
    tracker = _warm(method, history)
    for msgs in (conversation, [*conversation, boundary], [boundary, *conversation]):
        detail = tracker.estimate_detail(msgs)
        assert detail.total >= 0 and detail.estimated_part >= 0
        assert detail.total == detail.anchor_total + detail.estimated_part


@settings(max_examples=100, deadline=None)
@given(conversation=_CONVERSATION)
def test_the_reference_is_anchor_total_plus_rough_tokens_after_the_first_fragment(
    conversation: list[Message],
) -> None:
    anchor = find_anchor(conversation)
    if anchor is None:
        expected = rough_tokens_for_messages(conversation)
    else:
        expected = anchor[1].total + rough_tokens_for_messages(conversation[anchor[0] + 1 :])
    assert ref().estimate(conversation) == expected


# ---------------------------------------------------------------------------------------------
# What the estimators remember between estimates
# ---------------------------------------------------------------------------------------------


def test_the_reference_prices_each_record_by_its_own_content() -> None:
    """Records are priced once and remembered by identity: a record replaced by another (the
    same uuid, new content: a stage's edit) is priced by the new content."""
    estimator = ReferenceEstimator()
    old = results(tool_result("t1", "x" * 400))
    new = Message.user([tool_result("t1", "y" * 800)], uuid=old.uuid)
    head = [user_text("a" * 40)]
    assert estimator.estimate_detail([*head, old]).estimated_part == 10 + 100
    assert estimator.estimate_detail([*head, new]).estimated_part == 10 + 200
    assert estimator.estimate_detail([*head, old]).estimated_part == 10 + 100
    for n in range(3_000):  # past what it remembers: still right
        assert estimator.estimate_detail([user_text("b" * (4 * n))]).estimated_part == n


@pytest.mark.parametrize("method", METHODS)
def test_an_estimate_follows_every_change_to_a_kept_list(method: str) -> None:
    """A kept list (a stage's output, changed in place between estimates) gets what a fresh
    list of its records gets after every change to it, a call observed or a new request."""
    from pipeline.kept_list import KeptList

    tracker = TokenTracker(method)  # type: ignore[arg-type]
    history = KeptList(
        [user_text("go"), assistant("r1", tool_use("t1"), usage=U), results(tool_result("t1", "a"))]
    )

    def fresh() -> int:
        return TokenTracker.estimate(tracker, list(history))  # a plain list: never remembered

    other = TokenTracker(method)  # type: ignore[arg-type]
    opening = KeptList([user_text("go")])  # no usage yet: the system prompt counts whole
    alone = other.estimate(opening)
    other.set_request(system="a system prompt " * 100)
    assert other.estimate(opening) == other.estimate([*opening]) > alone
    first = tracker.estimate(history)
    assert tracker.estimate(history) == first == fresh()
    history.append(user_text("more words " * 200))
    assert tracker.estimate(history) == fresh() > first
    history[2] = results(tool_result("t1", "b" * 4_000))
    assert tracker.estimate(history) == fresh()
    del history[3:]
    assert tracker.estimate(history) == fresh()
    history.append(user_text("the next prompt " * 300))
    before = tracker.estimate(history)
    tracker.observe(history, Usage(input_tokens=9_000))
    assert tracker.estimate(history) == fresh()
    if method == "calibrated":
        assert tracker.estimate(history) != before  # it learned: the estimate moved


@settings(max_examples=300)
@given(
    run=st.text(alphabet=st.sampled_from("aZ09+/=_-" + "bcdXYZ12345"), min_size=64, max_size=400)
)
def test_a_base64_run_is_judged_by_its_share_of_capitals_digits_and_separators(run: str) -> None:
    """The blob test counts capitals, digits and path separators of a run; counted by
    deleting bytes, it agrees with counting each character."""
    n = len(run)
    upper = sum(c.isupper() for c in run)
    digits = sum(c.isdigit() for c in run)
    separators = sum(c in "/-_" for c in run)
    expected = upper >= 0.15 * n and digits >= 0.05 * n and separators <= 0.05 * n
    assert text_stats._random_looking(run) is expected


@settings(max_examples=300)
@given(
    letters=st.text(alphabet=st.sampled_from("aZQxb"), min_size=58, max_size=90),
    digits=st.lists(st.tuples(st.integers(0, 200), st.sampled_from("0123456789")), max_size=8),
    blank=st.sampled_from(["", " ", "\n"]),
)
def test_the_base64_share_counts_every_random_looking_run(
    letters: str, digits: list[tuple[int, str]], blank: str
) -> None:
    """Runs of 64 or more base64 characters that look random make the share; a text with
    too few digits for any run to qualify is passed over without looking at its runs, with
    the same result."""
    text = letters
    for at, digit in digits:  # a few digits here and there: around the least a blob holds
        text = text[:at] + digit + text[at:]
    text = text[: len(text) // 2] + blank + text[len(text) // 2 :]
    runs = re.findall(r"[A-Za-z0-9+/=_-]{64,}", text)
    blanks = text.count(" ")
    expected = 0.0
    if len(text) >= 64 and blanks < 0.02 * len(text):
        expected = sum(len(r) for r in runs if text_stats._random_looking(r)) / len(text)
    assert text_stats.text_stats(text).base64_share == expected


@settings(max_examples=200)
@given(
    st.lists(
        st.lists(
            st.floats(allow_nan=False, allow_infinity=False, width=64) | st.just(0.0),
            min_size=len(ContentVector().data),
            max_size=len(ContentVector().data),
        ),
        max_size=40,
    )
)
def test_packed_vectors_add_as_add_does(columns: list[list[float]]) -> None:
    """Packed (the classes a vector has) and summed, or unpacked: the same bits as adding
    each vector in turn; a class a vector lacks is not kept."""
    vectors = []
    for values in columns:
        v = ContentVector()
        v.data = array("d", values)
        vectors.append(v)
    one_by_one = ContentVector()
    for v in vectors:
        one_by_one.add(v)
    packed = [v.pack() for v in vectors]
    assert ContentVector.sum_packed(packed).data.tobytes() == one_by_one.data.tobytes()
    assert ContentVector.sum_of(vectors).data.tobytes() == one_by_one.data.tobytes()
    half = len(ContentVector().data) // 2
    for v, p in zip(vectors, packed, strict=True):
        assert ContentVector.unpack(p).data.tobytes() == (ContentVector.sum_of([v])).data.tobytes()
        assert len(p) == 17 * sum(1 for i in range(half) if v.data[i] or v.data[half + i])


def test_a_tool_calls_numbers_are_counted_as_javascript_writes_them() -> None:
    """``JSON.stringify`` writes ``1.0`` as ``1`` and a NaN as ``null``: a tool call's input
    is counted from that text, not from Python's (``1.0``, ``NaN``)."""

    def call(value: Any) -> dict[str, Any]:
        return {
            "type": "tool_use",
            "id": "t",
            "name": "n",
            "input": {f"k{i}": value for i in range(20)},
        }

    assert rough_tokens_for_block(call(1.0)) == rough_tokens_for_block(call(1))
    assert rough_tokens_for_block(call(float("nan"))) == rough_tokens_for_block(call(None))
    assert rough_tokens_for_block(call(2.5)) > rough_tokens_for_block(call(2))


@settings(max_examples=400, deadline=None)
@given(json_values())
def test_a_tool_calls_text_is_its_inputs_json_as_javascript_writes_it(given_input: Any) -> None:
    """A tool call's input priced as ``JSON.stringify`` writes it, whichever way it is written
    here (an input of ASCII strings and integers by msgspec, anything else through the
    standard library): the same text."""
    from pipeline.tokens.features import _JSON, _as_javascript, _call_text

    block = {"type": "tool_use", "id": "t", "name": "Bash", "input": given_input}
    assert _call_text(block) == "Bash" + _JSON.encode(_as_javascript(given_input))
