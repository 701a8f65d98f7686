"""Where a history may be cut, and its rounds: the functions the history snip and the context
collapse cut by, held to their definitions over random histories (the definitions written
plainly here, one scan each, as the model)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.messages import COMPACTION_BLOCK, Message, Usage, block_type, live_start
from pipeline.tokens import find_anchor
from stages._shared.rounds import RoundView, api_rounds, is_prompt, protected_rounds, safe_cuts
from tests.builders import assistant, results, tool_result, tool_use, user_text


class _Id(str):
    """An id of a ``str`` subclass: the pairing keys it by its characters."""


def _model_safe_cuts(messages: list[Message]) -> list[bool]:
    spans: dict[str, list[int]] = {}
    for i, m in enumerate(messages):
        keys: list[str] = []
        if m.type == "assistant":
            if m.message_id is not None:
                keys.append("r:" + m.message_id)
            keys += [
                "t:" + b["id"]
                for b in m.blocks
                if block_type(b) == "tool_use" and isinstance(b.get("id"), str)
            ]
        elif m.type == "user":
            keys += [
                "t:" + b["tool_use_id"]
                for b in m.blocks
                if block_type(b) == "tool_result" and isinstance(b.get("tool_use_id"), str)
            ]
        for k in keys:
            spans.setdefault(k, []).append(i)
    # a cut at p splits a key whose records stand on both sides of it
    return [
        not any(min(at) < p <= max(at) for at in spans.values()) for p in range(len(messages) + 1)
    ]


def _model_rounds(messages: list[Message], ok: list[bool]) -> list[tuple[int, int]]:
    n = len(messages)
    cuts = [p for p in range(live_start(messages), n) if ok[p] and messages[p].type == "assistant"]
    return list(zip(cuts, [*cuts[1:], n], strict=True)) if cuts else []


def _model_protected(
    messages: list[Message], rounds: list[tuple[int, int]], keep_recent: int
) -> set[int]:
    start = live_start(messages)
    keep = set(range(max(0, len(rounds) - keep_recent), len(rounds)))
    users = [i for i in range(start, len(messages)) if messages[i].type == "user"]
    prompts = [i for i in range(start, len(messages)) if is_prompt(messages[i])]
    anchor = find_anchor(messages)
    for idx in users[:1] + prompts[-1:] + ([anchor[0]] if anchor else []):
        keep.update(r for r, (s, e) in enumerate(rounds) if s <= idx < e)
    return keep


@st.composite
def histories(draw: st.DrawFn) -> list[Message]:
    """Turns of responses (fragments of one id, parallel tool calls, text; some with usage,
    so the latest is the anchor), their results (some late, some missing, some with an id of a
    subclass or none), prompts, and now and then a compact boundary, a compaction block, a
    string content, an item that is no block or a block whose id field is not a tool's."""
    out: list[Message] = [user_text("start")]
    pending: list[str] = []
    for t in range(draw(st.integers(0, 14))):
        kind = draw(st.sampled_from(["tools", "tools", "text", "prompt", "odd", "late"]))
        rid = f"r{draw(st.integers(0, t))}"  # an id seen before: a fragment of that response
        if kind == "tools":
            # a tool id now and then the same as a response id, or as an earlier tool id
            names = st.sampled_from([f"t{t}_{{}}", "r{}", "t0_{}"])
            tids = list(
                dict.fromkeys(draw(names).format(j) for j in range(draw(st.integers(1, 3))))
            )
            usage = Usage(input_tokens=10 * t) if draw(st.booleans()) else None
            out.append(assistant(rid, *(tool_use(x, "X") for x in tids), usage=usage))
            answered = draw(st.lists(st.sampled_from(tids), unique=True))
            for x in answered:
                tid: Any = _Id(x) if draw(st.booleans()) else x
                out.append(results(tool_result(tid, "out")))
            pending += [x for x in tids if x not in answered]
        elif kind == "late" and pending:
            out.append(results(tool_result(pending.pop(0), "late")))
        elif kind == "text":
            out.append(assistant(rid, {"type": "text", "text": "ok"}))
        elif kind == "prompt":
            out.append(user_text(f"prompt {t}"))
        else:
            odd = draw(
                st.sampled_from(["boundary", "compaction", "string", "item", "no id", "not a tool"])
            )
            if odd == "boundary":
                out.append(Message(type="system", subtype="compact_boundary", content=""))
            elif odd == "compaction":
                block = {"type": COMPACTION_BLOCK, "content": "summary"}
                out.append(assistant(rid, block))
            elif odd == "string":
                out.append(Message.assistant("plain", message_id=rid))
            elif odd == "item":
                items: list[Any] = ["not a block", {"type": "text", "text": "x"}]
                out.append(Message.user(items))
            elif odd == "not a tool":  # a tool's id field on another block pairs nothing
                tid = pending[0] if pending else "t0_0"
                out.append(assistant(rid, {"type": "text", "text": "x", "id": tid}))
                out.append(results({"type": "text", "text": "y", "tool_use_id": tid}))
            else:
                out.append(results({"type": "tool_result", "tool_use_id": 7, "content": "x"}))
    return out


@settings(max_examples=300, deadline=None)
@given(histories(), st.integers(1, 4))
def test_cuts_and_rounds_are_as_defined(messages: list[Message], keep_recent: int) -> None:
    ok = safe_cuts(messages)
    assert ok == _model_safe_cuts(messages)
    rounds = api_rounds(messages, ok)
    assert rounds == _model_rounds(messages, ok)
    assert api_rounds(messages, ok, live_start(messages)) == rounds
    keep = protected_rounds(messages, rounds, keep_recent)
    assert keep == _model_protected(messages, rounds, keep_recent)
    view = RoundView(messages, lambda _m: 0)
    assert view.rounds(keep_recent) == [(s, e, i in keep) for i, (s, e) in enumerate(rounds)]
