"""The calibrated estimator: pricing, online learning, persistence/resume, count_tokens, report.

Agent and count_tokens tests run the real anthropic SDK against the local scripted server.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeline.tokens.features as features
import pipeline.tokens.priors as priors
from pipeline import Message, Pipeline, SessionContext, TokenTracker, TranscriptWriter, Usage
from pipeline._cli.app import main
from pipeline.agent import Agent
from pipeline.kept_list import KeptList
from pipeline.testing import Reply, ScriptedMessagesServer, count_request_tokens
from pipeline.tokens import (
    IMAGE_TOKENS,
    CalibratedEstimator,
    CallSeen,
    ErrorStats,
    EstimateDetail,
    ReferenceEstimator,
    calibration_path_for,
)
from pipeline.tokens.family import FamilyModel
from pipeline.tokens.features import content_vector
from pipeline.tokens.media import image_size, image_tokens
from pipeline.tokens.priors import model_family
from pipeline.tokens.reference import NOTHING_TO_LEARN
from pipeline.tokens.state_file import decode_state
from pipeline.tokens.text_stats import text_class, text_stats
from pipeline.tools import tool
from pipeline.wire.form import to_api
from stages import default_stages
from tests.builders import assistant, results, tool_result, tool_use, user_text
from tests.cli_support import CALL_KEYS
from tests.sdk_support import sdk_client

CODE = "def f(x):\n    return x + 1  # add one\n" * 40  # ~1.6K chars of code
SONNET = "claude-sonnet-4-5"


def conversation(output_tokens: int = 10_000, model: str = SONNET) -> list[Message]:
    """Prompt, a response with usage, and a tool result after it."""
    return [
        user_text("please read the file"),
        Message.assistant(
            [tool_use("t1", "Read", file_path="/a.py")],
            message_id="m1",
            usage=Usage(
                input_tokens=5, cache_read_input_tokens=20_000, output_tokens=output_tokens
            ),
            model=model,
        ),
        results(tool_result("t1", CODE)),
    ]


# ---------------------------------------------------------------------------------------------
# Pricing
# ---------------------------------------------------------------------------------------------


def test_nothing_after_a_final_response_is_its_usage_total() -> None:
    msgs = conversation()[:2]  # output_tokens 10,000 covers the short response
    assert TokenTracker().estimate(msgs) == msgs[1].usage.total  # type: ignore[union-attr]


def test_a_streaming_snapshot_of_output_tokens_is_replaced_by_the_priced_response() -> None:
    long_answer = "The parser fails because the lexer drops trailing tokens. " * 50
    snapshot = Usage(input_tokens=100, output_tokens=1)  # what Claude Code's last record says
    msgs = [user_text("why?"), Message.assistant(long_answer, message_id="m1", usage=snapshot)]
    detail = TokenTracker().estimate_detail(msgs)
    assert detail.response_adjustment > 400  # ~3,000 chars of prose cost hundreds of tokens
    assert detail.total > snapshot.total + 400
    assert TokenTracker("reference").estimate(msgs) == snapshot.total  # the reference trusts it


def test_the_cold_estimate_leans_over_by_a_5_percent_margin() -> None:
    tracker = TokenTracker()
    msgs = conversation()
    detail = tracker.estimate_detail(msgs)
    assert detail.margin == pytest.approx(0.05)
    assert detail.estimated_part == math.ceil(
        (detail.response_adjustment + detail.new_tokens) * 1.05
    )
    # code prices well above the reference's len/4 (real tokenizers: ~2.5-3 chars/token)
    assert detail.new_tokens > len(CODE) / 3.2


def test_without_an_anchor_the_estimate_is_the_content_plus_the_measured_overhead() -> None:
    tracker = TokenTracker()
    first = [user_text("hello " * 100)]
    detail = tracker.estimate_detail(first)
    cold = detail.total
    obs = tracker.observe(first, Usage(input_tokens=cold + 3_000), model=SONNET)
    assert obs.reason == "no anchor: overhead measured" and obs.real_growth is None
    assert tracker.estimator is not None
    # system prompt + tools: the input side minus the content (priced without the margin)
    assert tracker.estimator.overhead == round(cold + 3_000 - detail.new_tokens)
    assert tracker.estimate(first) >= cold + tracker.estimator.overhead


def test_a_compaction_since_the_anchor_restarts_the_estimate() -> None:
    msgs = [
        *conversation(),
        Message(type="system", subtype="compact_boundary", content=""),
        Message.user("summary of the conversation", is_compact_summary=True),
    ]
    detail = TokenTracker().estimate_detail(msgs)
    assert detail.crossed_compaction and not detail.has_anchor and detail.anchor_total == 0
    assert 0 < detail.total < 100  # the summary only: the old usage no longer applies
    obs = TokenTracker("reference").observe(msgs, Usage(input_tokens=5_000))
    assert obs.real_growth is None  # not measurable for either method


def test_images_are_priced_from_their_pixel_size() -> None:
    def png(w: int, h: int) -> str:
        ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
        chunk = struct.pack(">I", 13) + b"IHDR" + ihdr
        raw = b"\x89PNG\r\n\x1a\n" + chunk + struct.pack(">I", zlib.crc32(chunk[4:]))
        return base64.b64encode(raw + b"\0" * 64).decode()

    gif = base64.b64encode(b"GIF89a" + struct.pack("<HH", 300, 200) + b"\0" * 40).decode()
    jpeg = base64.b64encode(
        b"\xff\xd8\xff\xe0\x00\x04ab\xff\xc0\x00\x11\x08"
        + struct.pack(">HH", 480, 640)
        + b"\0" * 40
    ).decode()
    webp = base64.b64encode(
        b"RIFF\0\0\0\0WEBPVP8X"
        + b"\0" * 8
        + (799).to_bytes(3, "little")
        + (599).to_bytes(3, "little")
    ).decode()
    assert image_size(png(1920, 1080)) == (1920, 1080)
    assert image_size(gif) == (300, 200)
    assert image_size(jpeg) == (640, 480)
    assert image_size(webp) == (800, 600)

    def block(data: str) -> dict[str, Any]:
        return {"type": "image", "source": {"type": "base64", "data": data}}

    # resized to 1568 on the long edge, then to 1.15 MP: 1.15M / 750 tokens
    assert image_tokens(block(png(1920, 1080))) == 1_534
    assert image_tokens(block(png(200, 200))) == math.ceil(200 * 200 / 750)
    assert image_tokens(block("not an image")) == IMAGE_TOKENS
    assert image_tokens({"type": "image", "source": {"type": "url", "url": "x"}}) == IMAGE_TOKENS


def test_documents_with_text_are_priced_as_text_others_at_2000() -> None:
    text_doc = {"type": "document", "source": {"type": "text", "data": "word " * 400}}
    pdf = {"type": "document", "source": {"type": "base64", "data": "JVBERi0" * 10_000}}
    w = tuple(priors.PRIOR_WEIGHTS[f] for f in priors.FEATURES)
    media = priors.CLASS_INDEX["media"]
    assert content_vector(Message.user([pdf]), w).tokens[media] == IMAGE_TOKENS
    priced = content_vector(Message.user([text_doc]), w)
    assert priced.tokens[media] == 0 and 300 < sum(priced.tokens) < 1_000


def test_text_statistics_are_exact_when_short_and_sampled_when_long() -> None:
    st = text_stats("ab cd\n12 é!")
    words, letters, digits, punct, ws_runs, newlines, non_ascii, *_ = st.features
    assert (words, letters, digits, punct, ws_runs, newlines, non_ascii) == (2, 4, 2, 1, 2, 1, 1)
    unit = "fn main() {\n    let x = vec![1, 2, 3];\n}\n"
    exact = text_stats(unit * 300)  # < 16 KB: counted exactly
    sampled = text_stats(unit * 30_000)  # ~1.3 MB: 32 windows of 512 chars
    for e, s in zip(exact.features, sampled.features, strict=True):
        assert s == pytest.approx(e * 100, rel=0.03)


def _counted_by_hand(sample: str) -> tuple[int, ...]:
    """words, letters, digits, other ASCII, blank runs, newlines, non-ASCII chars of ``sample``,
    one character at a time (the definitions the fast counts must meet)."""
    counts = dict.fromkeys(("word", "a", "0", ".", "ws", "nl", "u"), 0)
    previous = ""
    for ch in sample:
        kind = (
            "u"
            if not ch.isascii()
            else "a"
            if ch.isalpha()
            else "0"
            if ch.isdigit()
            else "nl"
            if ch == "\n"
            else "ws"
            if ch in " \t\r\f\v"
            else "."
        )
        if kind == "a" and previous != "a":
            counts["word"] += 1
        if kind == "ws" and previous != "ws":
            counts["ws"] += 1
        if kind != "ws":
            counts[kind] += 1
        previous = kind
    return tuple(counts.values())


_ALPHABET = st.sampled_from(
    [
        *("a", "Z", "7", " ", "\t", "\n", "\r", "-", "{", "é", "中", "😀", "\ud800", "\x1b", "_"),
        # CJK from each range, and neighbours that share a UTF-8 lead byte with one but are not
        *("ア", "㐀", "한", "！", "豈", "、", "→", "\ufb01", "\ud7b0", "\uffff"),
    ]
)
_CJK_RANGES = ((0x3040, 0x30FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xAC00, 0xD7AF))
_CJK_RANGES += ((0xF900, 0xFAFF), (0xFF00, 0xFFEF))


@given(st.lists(_ALPHABET, max_size=300).map("".join), st.integers(0, 3))
@settings(max_examples=400, deadline=None)
def test_text_statistics_match_a_count_by_hand(text: str, pad: int) -> None:
    # padding to just below and above the exact limit exercises the masks at full length
    text = text + "😀" * (pad * 5_461) if pad else text
    st_ = text_stats(text)
    words, letters, digits, other, ws_runs, newlines, non_ascii, *_ = st_.features
    if len(text) <= 16_384:
        by_hand = _counted_by_hand(text)
        assert (words, letters, digits, other, ws_runs, newlines, non_ascii) == by_hand
        cjk = sum(any(lo <= ord(ch) <= hi for lo, hi in _CJK_RANGES) for ch in text)
        assert st_.cjk == cjk
    else:  # sampled: every count scaled, never negative
        assert min(st_.features) >= 0 and non_ascii > 0
    assert st_.chars == len(text)


@pytest.mark.parametrize(
    ("text", "kind", "expected"),
    [
        ("The quick brown fox jumps over the lazy dog and keeps running home", "text", "prose"),
        ("if (x) { y[i] = f(a, b); } // done;", "text", "code"),
        ('{"key": [1, 2, 3], "other": null}', "text", "json"),
        ("anything", "json", "json"),
        ("\x1b[31mred\x1b[0m \x1b[32mgreen\x1b[0m", "text", "terminal"),
        ("这是一个中文句子，用来测试分类。", "text", "cjk"),
        (base64.b64encode(bytes(range(256)) * 4).decode(), "text", "base64"),
        ("let me think", "thinking", "thinking"),
        ("exit code 1", "error", "error"),
    ],
)
def test_content_classes(text: str, kind: Any, expected: str) -> None:
    assert text_class(text, text_stats(text), kind=kind) == expected


def test_model_families() -> None:
    assert [
        model_family(m) for m in ("claude-opus-4-6", "Claude-Sonnet-4", "claude-haiku-4-5")
    ] == [
        "opus",
        "sonnet",
        "haiku",
    ]
    assert model_family(None) == model_family("gpt-5") == "other"


def test_a_huge_session_is_never_serialised_to_json(monkeypatch: pytest.MonkeyPatch) -> None:
    # 10 MB of tool output: only the small tool_use inputs may be serialised to JSON
    dumped: list[int] = []
    real_encode = json.JSONEncoder.encode

    def spy(self: json.JSONEncoder, obj: Any) -> str:
        out = real_encode(self, obj)
        dumped.append(len(out))
        return out

    def fast_spy(obj: Any) -> bytes:
        out = real_fast(obj)
        dumped.append(len(out))
        return out

    # what json.dumps and the estimators' own encoders go through (a tool call's input of
    # ASCII strings and integers by msgspec)
    monkeypatch.setattr(json.JSONEncoder, "encode", spy)
    real_fast = features._FAST_JSON
    monkeypatch.setattr(features, "_FAST_JSON", fast_spy)
    big = "x = compute(1, 2)\n" * 50_000  # ~900 KB
    msgs: list[Message] = [user_text("go")]
    for i in range(12):
        msgs.append(assistant(f"m{i}", tool_use(f"t{i}", "Bash", command="make")))
        msgs.append(results(tool_result(f"t{i}", big)))
    for tracker in (TokenTracker("calibrated"), TokenTracker("reference")):
        assert tracker.estimate(msgs) > 200_000
    assert dumped and max(dumped) < 100


# ---------------------------------------------------------------------------------------------
# Learning
# ---------------------------------------------------------------------------------------------


def _session_step(msgs: list[Message], n: int, usage: Usage, model: str) -> list[Message]:
    """The response to the last call (with ``usage``), and a new code tool result after it."""
    return [
        *msgs,
        Message.assistant(
            [tool_use(f"t{n}", "Bash")], message_id=f"m{n}", usage=usage, model=model
        ),
        results(tool_result(f"t{n}", CODE * 2)),
    ]


def test_it_learns_a_denser_tokenizer_from_the_usage_deltas() -> None:
    """A model whose tokenizer costs 40 % more than the priors: the error shrinks as it learns."""
    truth = CalibratedEstimator(margin_floor=0.0, margin_cold=0.0, learn=False)
    tracker = TokenTracker()
    model = "some-other-model"  # unknown family: every multiplier learns fast
    msgs: list[Message] = [user_text("start")]
    context = 1_000
    errors: list[float] = []
    for n in range(25):
        msgs = _session_step(msgs, n, Usage(input_tokens=context, output_tokens=8), model)
        # what the next call really costs: 1.4 x the priced growth since the anchor
        growth = 1.4 * truth.estimate_detail(msgs).estimated_part
        context += 8 + round(growth)
        obs = tracker.observe(msgs, Usage(input_tokens=context), model=model)
        assert obs.relative_error is not None
        errors.append(obs.relative_error)
    assert errors[0] < -0.2  # cold: the priors under-count this tokenizer by ~25 %
    assert all(abs(e) < 0.1 for e in errors[-5:])
    ratios = tracker.ratios("other")
    assert ratios["code"]["multiplier"] is not None and ratios["code"]["multiplier"] > 1.2
    assert ratios["code"]["chars_per_token"] is not None and ratios["code"]["chars"]
    assert ratios["cjk"]["chars_per_token"] is None  # never seen
    stats = tracker.error_stats()
    assert stats.calls == 25 and stats.big_calls == 25 and 0 < stats.undercounted < 10


def test_a_kept_list_estimate_is_reused_only_while_nothing_it_reads_changed() -> None:
    """A tracker answers a kept list it estimated before from memory: never once the list
    changed in place (also at the same length and last record), the tracker observed, the
    estimator was swapped or another model was asked for. Each answer equals that of a plain
    copy of the list, which is always estimated afresh."""
    tracker = TokenTracker()
    kept = KeptList(conversation())

    def fresh(model: str | None = None) -> EstimateDetail:
        return tracker.estimate_detail(list(kept), model=model)

    first = tracker.estimate_detail(kept)
    assert tracker.estimate_detail(kept) is first and first == fresh()
    default = tracker.estimator
    tracker.estimator = CalibratedEstimator(margin_cold=0.3)  # as many observations: none
    assert tracker.estimate_detail(kept) == fresh() != first
    tracker.estimator = default
    kept.append(user_text("and the tests too " * 40))
    grown = tracker.estimate_detail(kept)
    assert grown == fresh() and grown.total > first.total
    kept[2] = results(tool_result("t1", CODE * 3))  # in place: same length, same last record
    assert tracker.estimate_detail(kept) == fresh() != grown
    opus = tracker.estimate_detail(kept, model="claude-opus-4-6")
    assert opus == fresh("claude-opus-4-6") and opus.family != grown.family
    before = tracker.estimate_detail(kept)
    stamp = kept.stamp
    seen = tracker.observe(kept, Usage(input_tokens=before.total * 2), model=SONNET)
    assert seen.learned and kept.stamp == stamp  # the same list: only the estimator changed
    learned = tracker.estimate_detail(kept)
    assert learned == fresh() != before
    tracker.estimator = ReferenceEstimator()
    assert tracker.estimate_detail(kept) == fresh() != learned


def test_an_estimator_shared_by_trackers_is_asked_again_after_either_observes() -> None:
    shared = CalibratedEstimator()
    a, b = TokenTracker(estimator=shared), TokenTracker(estimator=shared)
    kept = KeptList(conversation())
    before = a.estimate_detail(kept)
    assert b.observe(kept, Usage(input_tokens=before.total * 2), model=SONNET).learned
    assert a.estimate_detail(kept) == a.estimate_detail(list(kept)) != before


def test_an_estimator_of_another_kind_is_asked_every_time() -> None:
    """Only the built-in estimators' answers are reused: another kind may read more than the
    records and what it observed (here, how often it was asked)."""

    class Counting(CalibratedEstimator):
        asked = 0

        def estimate_detail(self, messages: Any, *, model: str | None = None) -> EstimateDetail:
            self.asked += 1
            detail = super().estimate_detail(messages, model=model)
            return dataclasses.replace(detail, total=detail.total + self.asked)

    tracker = TokenTracker(estimator=Counting())
    kept = KeptList(conversation())
    first, second = tracker.estimate_detail(kept), tracker.estimate_detail(kept)
    assert second.total == first.total + 1


def test_only_measurable_calls_are_learned_from() -> None:
    tracker = TokenTracker()
    usage = Usage(input_tokens=25_000)
    freed = tracker.observe(conversation(), usage, model=SONNET, tokens_freed=500)
    assert (freed.learned, freed.real_growth, freed.reason) == (
        False,
        None,
        "stages removed anchored content",
    )
    switched = tracker.observe(conversation(), usage, model="claude-opus-4-6")
    assert (switched.learned, switched.reason) == (False, "model family changed")
    assert switched.real_growth is not None  # measured, but not learned from
    msgs = conversation()
    ok = tracker.observe(msgs, usage, model=SONNET)
    assert ok.learned and ok.reason == "ok"
    again = tracker.observe(msgs, usage, model=SONNET)  # the same messages: learned once
    assert (again.learned, again.reason, again.real_growth) == (False, "already observed", None)
    assert tracker.error_stats().calls == 2


def test_error_statistics_of_known_pairs() -> None:
    # (estimated part, real growth): relative errors on growth >= 2,000 only
    pairs = [(900, 1_000), (1_500, 2_000), (2_900, 3_000), (4_400, 4_000), (5_000, 5_000)]
    stats = ErrorStats.from_pairs(pairs)
    assert (stats.calls, stats.big_calls, stats.undercounted) == (5, 4, 1)
    assert stats.median_abs == pytest.approx((1 / 30 + 0.1) / 2)
    assert stats.p95_abs == pytest.approx(0.25)  # nearest rank: the largest of 4
    assert stats.undercount_share == pytest.approx(0.25)
    assert stats.median_abs_tokens == 100 and stats.p95_abs_tokens == 500
    empty = ErrorStats.from_pairs([])
    assert empty.median_abs is None and empty.to_json()["abs_rel_error_median"] is None


# ---------------------------------------------------------------------------------------------
# Persistence
# ---------------------------------------------------------------------------------------------


def _trained(method: str) -> TokenTracker:
    tracker = TokenTracker(method)  # type: ignore[arg-type]
    msgs: list[Message] = [user_text("start")]
    tracker.observe(msgs, Usage(input_tokens=900), model=SONNET)
    context = 1_000
    for n in range(8):
        msgs = _session_step(msgs, n, Usage(input_tokens=context, output_tokens=8), SONNET)
        context += 1_500 + 97 * n
        tracker.observe(msgs, Usage(input_tokens=context), model=SONNET)
    return tracker


@pytest.mark.parametrize("method", ["calibrated", "reference"])
def test_state_dict_round_trip_gives_identical_estimates(method: str) -> None:
    tracker = _trained(method)
    clone = TokenTracker.from_state_dict(json.loads(json.dumps(tracker.state_dict())))
    probes = [conversation(), conversation()[:1], conversation(output_tokens=1)]
    for msgs in probes:
        assert clone.estimate_detail(msgs) == tracker.estimate_detail(msgs)
    assert clone.ratios() == tracker.ratios()
    assert clone.error_stats() == tracker.error_stats()
    assert clone.state_dict() == tracker.state_dict()
    if method == "calibrated":  # not cold: learned multipliers, a measured overhead
        assert clone.estimator is not None and clone.estimator.overhead is not None
        assert clone.estimator.families[model_family(SONNET)].n_obs == 8
        assert clone.estimate(probes[0]) != TokenTracker().estimate(probes[0])


def test_a_subagent_tracker_starts_from_what_the_parent_learned(tmp_path: Path) -> None:
    """The multipliers carry over (tokenisation is the model's); the overhead (the parent's
    system prompt and tools) and the parent's error record do not."""
    parent = SessionContext("s", tmp_path, token_tracker=_trained("calibrated"))
    child = parent.for_subagent("agent-1").token_tracker
    assert child.estimator is not None and parent.token_tracker.estimator is not None
    assert child.ratios() == parent.token_tracker.ratios()
    assert child.estimator.families[model_family(SONNET)].n_obs == 8
    assert child.estimator.overhead is None and parent.token_tracker.estimator.overhead
    assert child.error_stats().calls == 0
    msgs = conversation()
    assert child.estimate(msgs) != TokenTracker().estimate(msgs)  # not cold
    reference = SessionContext("r", tmp_path, token_tracker=TokenTracker("reference"))
    assert reference.for_subagent("agent-2").token_tracker.method == "reference"


def test_malformed_state_is_rejected() -> None:
    with pytest.raises(ValueError):
        TokenTracker.from_state_dict({"version": 99})
    state = TokenTracker().state_dict()
    state["estimator"]["families"] = {"opus": {"mult": {}, "p": [[1.0]]}}
    with pytest.raises(ValueError):
        TokenTracker.from_state_dict(state)


def test_save_is_atomic_and_load_falls_back_to_a_cold_tracker(tmp_path: Path) -> None:
    path = calibration_path_for(tmp_path / "root", "sess")
    assert path == tmp_path / "root" / "sess" / "token-calibration.json"
    tracker = _trained("calibrated")
    assert tracker.save(path)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    assert TokenTracker.load(path).state_dict() == tracker.state_dict()
    assert TokenTracker.load(tmp_path / "missing.json").state_dict() == TokenTracker().state_dict()
    path.write_text("{not json")
    assert TokenTracker.load(path).state_dict() == TokenTracker().state_dict()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert tracker.save(blocked / "state.json") is False  # logged, never raised
    assert calibration_path_for("r", "s", "agent-1").name == "token-calibration-agent-1.json"
    assert calibration_path_for("r", "s", "../x").name == "token-calibration-.._x.json"


@tool(input_schema={"type": "object", "properties": {"n": {"type": "integer"}}})
async def emit(n: int) -> str:
    """Emit about n characters of code-like output."""
    return (CODE * (n // len(CODE) + 1))[:n]


def _scripted(turns: int) -> Callable[[dict[str, Any]], Reply]:
    def script(body: dict[str, Any]) -> Reply:
        k = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if k < turns:
            call = {"type": "tool_use", "id": f"t{k}", "name": "emit", "input": {"n": 3_000}}
            return Reply([call], stop_reason="tool_use")
        return Reply([{"type": "text", "text": "done"}])

    return script


@pytest.fixture
def server() -> Iterator[ScriptedMessagesServer]:
    with ScriptedMessagesServer(_scripted(4)) as s:
        yield s


@pytest.mark.asyncio
async def test_a_resumed_agent_session_does_not_start_cold(
    server: ScriptedMessagesServer, tmp_path: Path
) -> None:
    log, root = tmp_path / "sess.jsonl", tmp_path / "store"
    ctx = SessionContext("sess", root, transcript=TranscriptWriter(log, "sess"))
    agent = Agent(
        sdk_client(server.base_url),
        model="claude-scripted",
        pipeline=Pipeline(default_stages()),
        ctx=ctx,
    )
    agent.add_tool(emit)
    await agent.run("go")
    live = agent.ctx.token_tracker
    assert live.estimator is not None and live.estimator.families["other"].n_obs >= 3
    saved = decode_state(calibration_path_for(root, "sess").read_bytes())
    assert saved == json.loads(json.dumps(live.state_dict()))

    resumed = Agent.resume(
        log,
        sdk_client(server.base_url),
        model="claude-scripted",
        pipeline=Pipeline(default_stages()),
        root=root,
    )
    tracker = resumed.ctx.token_tracker
    assert tracker.state_dict() == saved  # warm: what the live session had learned
    assert tracker.estimate(resumed.history) == live.estimate(agent.history)
    assert tracker.error_stats().calls == live.error_stats().calls > 0
    resumed.add_tool(emit)
    await resumed.run("once more")  # and it keeps learning and saving
    assert decode_state(calibration_path_for(root, "sess").read_bytes()) != saved


@pytest.mark.asyncio
async def test_count_tokens_through_the_real_sdk(server: ScriptedMessagesServer) -> None:
    client = sdk_client(server.base_url)
    tracker = TokenTracker()
    tools = [emit.definition]
    first = [user_text("hello there " * 50)]
    n = await tracker.count_with_api(
        client, model=SONNET, messages=first, system="be brief", tools=tools
    )
    (body,) = server.count_requests
    assert n == count_request_tokens(body)  # the server's exact count, returned as is
    assert body["messages"] == to_api(first) and body["system"] == "be brief"
    assert body["tools"] == tools and body["model"] == SONNET
    assert tracker.estimator is not None and tracker.estimator.overhead is not None  # fed back

    msgs = conversation()
    before = tracker.error_stats().calls
    n2 = await tracker.count_with_api(client, model=SONNET, messages=msgs)
    assert n2 == count_request_tokens(server.count_requests[-1])
    assert tracker.error_stats().calls == before + 1  # an observation with a real growth
    # the real call on the same messages does not learn the same delta twice
    assert tracker.observe(msgs, Usage(input_tokens=n2), model=SONNET).reason == "already observed"

    raw = to_api(msgs)  # a request's messages array: counted, but nothing to learn from
    n3 = await tracker.count_with_api(client, model=SONNET, messages=raw)
    assert n3 == n2 and tracker.error_stats().calls == before + 1


# ---------------------------------------------------------------------------------------------
# The replay report
# ---------------------------------------------------------------------------------------------


def test_replay_reports_the_estimated_part_for_both_estimators(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--replay", "--json", "--store", str(tmp_path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    calls, summary = lines[:-1], lines[-1]["summary"]
    assert all(set(c) == CALL_KEYS for c in calls)  # the per-call contract is unchanged
    part = summary["estimated_part"]
    assert set(part) == {"default", "reference"}
    for stats in part.values():
        assert stats["calls"] == len(calls) - 1  # every call but the first has an anchor
        assert stats["min_growth"] == 2_000 and stats["abs_error_tokens_median"] is not None
    assert part["default"] != part["reference"]

    assert main(["demo", "--replay", "--store", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "estimated part vs real growth since the last response (4 calls measured" in out
    assert "\n  default  : median |error| " in out and "\n  reference: median |error| " in out


def _textbook_step(
    mult: list[float],
    p: list[list[float]],
    x: list[float],
    y: float,
    *,
    abs_noise: float,
    rel_noise: float,
    clip_sigma: float,
) -> tuple[list[float], list[list[float]]]:
    """One robust Kalman step written out in full: every row of the covariance updated."""
    d = len(mult)
    px = [sum(p[i][j] * x[j] for j in range(d)) for i in range(d)]
    s = sum(x[i] * px[i] for i in range(d))
    y_hat = sum(mult[i] * x[i] for i in range(d))
    s += abs_noise**2 + (rel_noise * max(y_hat, 0.0)) ** 2
    if not (math.isfinite(s) and s > 0.0 and math.isfinite(y)):
        return mult, p
    cut = clip_sigma * math.sqrt(s)
    innovation = max(-cut, min(cut, y - y_hat))
    gain = [v / s for v in px]
    new = [max(0.05, mult[i] + gain[i] * innovation) for i in range(d)]
    if not all(math.isfinite(m) for m in new):
        return mult, p
    return new, [[p[i][j] - gain[i] * px[j] for j in range(d)] for i in range(d)]


_CLASS_COUNT = len(priors.CLASSES)
_STEP = st.tuples(
    st.dictionaries(
        st.integers(0, _CLASS_COUNT - 1),
        st.floats(0.0, 50_000.0, allow_nan=False),
        min_size=1,
        max_size=4,
    ),
    st.floats(-5_000.0, 80_000.0, allow_nan=False),
)


@given(
    st.lists(st.sampled_from([0.02, 0.1, 0.3]), min_size=_CLASS_COUNT, max_size=_CLASS_COUNT),
    st.lists(_STEP, min_size=1, max_size=30),
    st.sampled_from([0.0, 20.0]),
)
@settings(max_examples=300, deadline=None)
def test_a_calibration_step_is_the_textbook_step_float_for_float(
    sd: list[float], steps: list[tuple[dict[int, float], float]], abs_noise: float
) -> None:
    """The estimator's step skips the covariance rows a step leaves alone (no gain) and sums
    each row in one pass: every multiplier and covariance entry must still be the very float
    the full step gives (``repr`` tells 0.0 from -0.0)."""
    model = FamilyModel.from_prior([1.0] * _CLASS_COUNT, sd)
    mult, p = list(model.mult), [list(row) for row in model.p]
    for values, y in steps:
        x = [values.get(i, 0.0) for i in range(_CLASS_COUNT)]
        kw = {"abs_noise": abs_noise, "rel_noise": 0.02, "clip_sigma": 3.0}
        model.update(x, y, **kw)
        mult, p = _textbook_step(mult, p, x, y, **kw)
        assert repr(model.mult.tolist()) == repr(mult)
        assert repr([row.tolist() for row in model.p]) == repr(p)


def test_a_loaded_negative_zero_covariance_steps_as_the_textbook_step() -> None:
    """A step leaves a row with no gain as it is, which is the textbook's result only where
    no entry is -0.0 (-0.0 - -0.0 is 0.0): a model read from a state whose covariance holds
    -0.0 holds 0.0 there (the same number), and steps float for float as the full step."""
    prior = FamilyModel.from_prior([1.0] * _CLASS_COUNT, [0.1] * _CLASS_COUNT)
    raw = prior.to_json()
    raw["p"][1][2] = raw["p"][2][1] = -0.0
    model = FamilyModel.from_json(json.loads(json.dumps(raw)), {})
    assert all(repr(v) != "-0.0" for row in model.p for v in row)
    mult, p = list(model.mult), [list(row) for row in model.p]
    # class 0 alone: the rows of classes 1 and 2 get no gain, their -0.0 pairs a negative px
    for x0, y in ((500.0, 900.0), (300.0, -50.0)):
        x = [x0] + [0.0] * (_CLASS_COUNT - 1)
        x[3] = 40.0
        kw = {"abs_noise": 20.0, "rel_noise": 0.02, "clip_sigma": 3.0}
        model.update(x, y, **kw)
        mult, p = _textbook_step(mult, p, x, y, **kw)
        assert repr(model.mult.tolist()) == repr(mult)
        assert repr([row.tolist() for row in model.p]) == repr(p)


def test_a_family_model_holds_its_numbers_as_doubles() -> None:
    """Every held conversation keeps a model per model family: its multipliers, covariance
    and counts are arrays of doubles (~2.4 KB a model after a step; lists of floats ~5.2 KB),
    and its state reads back as the numbers it learned."""
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        prior = [0.1] * _CLASS_COUNT
        models = [FamilyModel.from_prior([1.0] * _CLASS_COUNT, prior) for _ in range(100)]
        x = [1.0 + i for i in range(_CLASS_COUNT)]
        for m in models:
            m.update(x, 100.0, abs_noise=60.0, rel_noise=0.2, clip_sigma=2.0)
        each = (tracemalloc.get_traced_memory()[0] - before) / len(models)
    finally:
        tracemalloc.stop()
    assert each < 3_000
    again = FamilyModel.from_json(models[0].to_json(), {})
    assert again.to_json() == models[0].to_json() == json.loads(json.dumps(models[0].to_json()))


def test_an_estimator_is_asked_to_learn_only_from_calls_the_tracker_did_not_rule_out() -> None:
    """The tracker hands an estimator each call it may learn from, with the estimate the
    estimator made of it beforehand; a call seen twice in a row, one after a pass removed
    anchored content, or one the server compacted never reaches it, and what the tracker
    reports of every call is the estimate made before it."""

    class Recording(ReferenceEstimator):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[CallSeen] = []

        def learn_from(self, call: CallSeen) -> tuple[bool, str]:
            self.calls.append(call)
            return super().learn_from(call)

    est = Recording()
    tracker = TokenTracker(estimator=est)
    msgs: list[Message] = [user_text("go")]
    sent, offered = 2_000, 0
    for i in range(40):
        usage = Usage(input_tokens=3, cache_read_input_tokens=sent)
        freed = 500 if i % 7 == 3 else 0
        before = est.estimate_detail(msgs, model=SONNET)
        obs = tracker.observe(msgs, usage, model=SONNET, tokens_freed=freed, compacted=i == 11)
        assert obs.estimate == before.total
        if freed or i == 11:
            assert len(est.calls) == offered and not obs.learned
        else:
            offered += 1
            call = est.calls[-1]
            assert len(est.calls) == offered
            assert call.messages is msgs and call.usage is usage and call.before == before
            assert obs.reason == NOTHING_TO_LEARN
        if i % 5 == 0 and not freed:  # the same messages observed twice in a row
            assert tracker.observe(msgs, usage).reason == "already observed"
            assert len(est.calls) == offered
        msgs.append(assistant(f"m{i}", tool_use(f"t{i}", "Bash", command=f"step {i}"), usage=usage))
        msgs.append(results(tool_result(f"t{i}", "out " * (50 * i))))
        sent += 400 + 60 * i
    assert offered == 40 - 6 - 1


def test_the_vector_cache_keeps_little_a_record() -> None:
    """What the estimator's cache of token vectors holds a record: its entry in a plain dict
    (the record is its own key) and the vector packed, ~105 bytes; an OrderedDict of arrays
    held ~440 (the largest state a held conversation had after its content)."""
    import gc
    import tracemalloc

    records = [Message.user(f"result {i}: " + "x" * 200) for i in range(2_000)]
    estimator = CalibratedEstimator(cache_size=4_096)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for m in records:
            estimator.vector(m)
        cached = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert all(estimator._packed(m) is estimator._packed(m) for m in records[-10:])
    assert cached / len(records) < 150


def test_the_vector_cache_lets_go_of_a_history_no_call_has_priced_since() -> None:
    """A history priced whole once (a first estimate without an anchor) is not kept for as long
    as the conversation is: two calls that price only what came after their anchor later,
    only those vectors are held -- and every estimate is what a fresh estimator gives."""
    tracker = TokenTracker("calibrated")
    estimator = tracker.estimator
    assert isinstance(estimator, CalibratedEstimator)
    history = [user_text(f"note {i}: " + "x" * (50 + i)) for i in range(300)]
    tracker.estimate_detail(history, model=SONNET)
    assert all(m in estimator._cache for m in history)
    messages = list(history)
    for call in range(3):
        answer = Message.assistant(
            [tool_use(f"t{call}", "Read", file_path="/a.py")],
            message_id=f"m{call}",
            usage=Usage(input_tokens=9_000 + 500 * call, output_tokens=40),
            model=SONNET,
        )
        messages += [answer, results(tool_result(f"t{call}", CODE))]
        before = tracker.estimate_detail(messages, model=SONNET)
        fresh = CalibratedEstimator.from_state_dict(estimator.state_dict())
        assert TokenTracker(estimator=fresh).estimate(messages, model=SONNET) == before.total
        tracker.observe(messages, Usage(input_tokens=10_000 + 600 * call), model=SONNET)
    held = set(estimator._cache) | set(estimator._older)
    assert not held & set(history)
    assert held <= set(messages[-6:])


def test_the_vector_cache_lets_go_of_the_least_recently_used() -> None:
    """Bounded at ``cache_size`` records; a record priced again is kept over older ones, and
    what it gives is what pricing it afresh gives."""
    records = [Message.user(f"result {i}: " + "x" * (20 + i)) for i in range(5)]
    estimator = CalibratedEstimator(cache_size=3)
    for m in records[:3]:
        estimator.vector(m)
    estimator.vector(records[0])
    estimator.vector(records[3])
    assert list(estimator._cache) == [records[2], records[0], records[3]]
    for m in records:
        fresh = content_vector(m, estimator._w)
        assert estimator.vector(m).data.tobytes() == fresh.data.tobytes()
    assert len(estimator._cache) == 3
    assert CalibratedEstimator(cache_size=0).vector(records[0]).tokens[0] > 0
