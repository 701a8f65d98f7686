"""Property tests of the tool-result budget over random multi-turn sessions (invariants 1-6
of docs/behaviour.md).

A generated session is a sequence of turns. A tool turn is one assistant response (one message id,
split into one or more records) with N parallel tool_use blocks, followed by the tool_result
records, one per record, in completion order -- sometimes with progress records or later fragments
of the same response interleaved, sometimes with a user remark after them. A text turn is an
assistant text and a new prompt. The simulated agent runs ``Pipeline([ToolResultBudget(limit)])``
on the whole history before every model call (and, now and then, mid-turn) with ONE
``SessionContext`` (a real ``FileToolResultStore``, a real ``TranscriptWriter``), and at a random
turn boundary a second session resumes from the transcript file and runs alongside.

Everything the stage decides is checked against an independent model written from the
contract (docs/behaviour.md):
the replacement text (§3) is rebuilt here from scratch, and the set of results persisted in each
pass is recomputed from §2.4. Limits are tiny (hundreds to a few thousand chars) so hypothesis
reaches the edges quickly.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pipeline import (
    FileToolResultStore,
    Message,
    Pipeline,
    ReplacementState,
    SessionContext,
    ToolPolicies,
    TranscriptWriter,
    load_transcript,
    to_api,
)
from pipeline.gate import persist_content
from pipeline.replacement import ReplacementRecord, decided_in
from pipeline.results.keys import content_digest
from pipeline.testing import QuietLogger
from pipeline.wire.pairing import check_pairing
from stages import ToolResultBudget
from stages.tool_result_budget import Candidate, collect_groups, select_fresh_to_replace
from tests.builders import assistant, key, results, tool_result, tool_use, user_text

SID = "prop-session"
TAG = "<persisted-output>"
PREVIEW_CHARS = 2_000

# Small thresholds so that hypothesis reaches the edges fast: Bash and Grep declare limits under
# the cap, Read opts out (never persisted), Other declares nothing (-> the cap).
POLICIES = ToolPolicies(declared={"Bash": 1_000, "Grep": 600, "Read": math.inf}, cap=1_200)
THRESHOLD = {"Bash": 1_000, "Grep": 600, "Read": math.inf, "Other": 1_200}
TOOLS = ("Bash", "Grep", "Read", "Other")
LIMITS = (3_000, 3_000, 1_500, 800, 5_000)
# every pass fsyncs store files and the transcript: a RAM-backed temp dir keeps the file fast
FAST_TMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True)


# --------------------------------------------------------------------------------------------
# The contract, rewritten independently of the implementation
# --------------------------------------------------------------------------------------------


def spec_is_empty(content: Any) -> bool:
    """docs/behaviour.md §1.2 step 1: None, "", whitespace, [], or only blank text blocks."""
    if content is None:
        return True
    if isinstance(content, str):
        return content.strip() == ""
    return isinstance(content, list) and all(
        b.get("type") == "text" and not str(b.get("text", "")).strip() for b in content
    )


def spec_has_image(content: Any) -> bool:
    return isinstance(content, list) and any(b.get("type") == "image" for b in content)


def spec_is_candidate(content: Any) -> bool:
    """docs/behaviour.md §2.2."""
    if spec_is_empty(content) or spec_has_image(content):
        return False
    # a replacement: the tag at both ends, no longer than preview + PATH_MAX + frame; any
    # other text that merely starts with the tag is ordinary (attacker-controlled) output
    return not (
        isinstance(content, str)
        and content.startswith(TAG)
        and content.rstrip().endswith("</persisted-output>")
        and len(content) <= 2_000 + 4_096 + 256
    )


def spec_key(tool_use_id: str, content: Any) -> str:
    """§2.3: the ledger knows a result by its id and a digest of its output (the generator
    never appends a harness tail, so the output is the whole content): 32 hex digits of
    SHA-256 over ``s`` + a string, or ``j`` + a block list as compact JSON, keys sorted,
    ``cache_control`` left out. A decision binds to that output only."""
    if isinstance(content, str):
        data = b"s" + content.encode("utf-8")
    else:
        plain = [{k: v for k, v in b.items() if k != "cache_control"} for b in content]
        text = json.dumps(plain, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        data = b"j" + text.encode("utf-8")
    return f"{tool_use_id}#{hashlib.sha256(data).hexdigest()[:32]}"


def spec_size(content: Any) -> int:
    """docs/behaviour.md §1.2 step 3."""
    if isinstance(content, str):
        return len(content)
    return sum(len(b["text"]) for b in content if b.get("type") == "text")


def spec_persistable(content: Any) -> bool:
    return isinstance(content, str) or all(b.get("type") == "text" for b in content)


def spec_serialise(content: Any) -> tuple[str, str]:
    """What lands in the store: the string as is, or the block list as 2-space JSON."""
    if isinstance(content, str):
        return content, "txt"
    return json.dumps(content, indent=2, ensure_ascii=False), "json"


def spec_format_size(n: int) -> str:
    """§3: ``N bytes`` under 1024, else KB/MB/GB, one decimal (JS toFixed), ``.0`` dropped."""
    if n < 1024:
        return f"{n} bytes"
    value = Fraction(n, 1024)
    unit = "KB"
    if value >= 1024:
        value, unit = value / 1024, "MB"
        if value >= 1024:
            value, unit = value / 1024, "GB"
    tenths = math.floor(value * 10 + Fraction(1, 2))  # toFixed: a tie goes to the larger
    whole, frac = divmod(tenths, 10)
    return f"{whole}{unit}" if frac == 0 else f"{whole}.{frac}{unit}"


def spec_preview(text: str) -> tuple[str, bool]:
    """§3: whole text up to 2,000 chars; else cut at the last newline past 1,000, or 2,000."""
    if len(text) <= PREVIEW_CHARS:
        return text, False
    head = text[:PREVIEW_CHARS]
    newline = head.rfind("\n")
    return (text[:newline] if newline > 1_000 else head), True


def spec_replacement(path: str, text: str) -> str:
    preview, more = spec_preview(text)
    return (
        f"<persisted-output>\nOutput too large ({spec_format_size(len(text))}). "
        f"Full output saved to: {path}\n\nPreview (first 2KB):\n{preview}"
        + ("\n...\n" if more else "\n")
        + "</persisted-output>"
    )


_REPLACEMENT_HEAD = re.compile(
    r"<persisted-output>\nOutput too large \(([^)]*)\)\. Full output saved to: (.*)\n\n"
    r"Preview \(first 2KB\):\n"
)


def spec_greedy(
    eligible: Sequence[tuple[str, int, bool]], frozen_size: int, limit: float
) -> list[str]:
    """§2.4 step 3 over (id, size, persistable) in group order: largest first, stable."""
    remaining = frozen_size + sum(size for _i, size, _p in eligible)
    chosen: list[str] = []
    if remaining <= limit:
        return chosen
    for tid, size, persistable in sorted(eligible, key=lambda e: e[1], reverse=True):
        if remaining <= limit:
            break
        if not persistable:
            continue
        chosen.append(tid)
        remaining -= size
    return chosen


# --------------------------------------------------------------------------------------------
# Session generator
# --------------------------------------------------------------------------------------------

IMAGE_BLOCK = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
}
DOC_BLOCK = {
    "type": "document",
    "source": {"type": "text", "media_type": "text/plain", "data": "a document"},
}
EMPTIES: tuple[Any, ...] = (None, "", "  \n\t", [], [{"type": "text", "text": " \n"}])

SIZES = st.one_of(
    st.integers(0, 300),
    st.sampled_from(
        [
            599,
            600,
            601,
            799,
            800,
            801,
            999,
            1_000,
            1_001,
            1_023,
            1_024,
            1_025,
            1_199,
            1_200,
            1_201,
            1_280,
            1_499,
            1_500,
            1_501,
            1_999,
            2_000,
            2_001,
            2_002,
            2_560,
            2_999,
            3_001,
        ]
    ),
    st.integers(300, 1_600),
    st.integers(1_600, 6_000),
)
NEWLINES = st.lists(
    st.one_of(st.integers(0, 6_000), st.integers(995, 1_006), st.integers(1_995, 2_004)),
    max_size=4,
)
CHARS = st.sampled_from(["a", "x", "é", "字", "😀", "\t", '"', "\\", "<"])
KINDS = st.sampled_from(
    ["str"] * 6 + ["blocks"] * 3 + ["image", "doc", "empty", "lookalike", "error"]
)


@st.composite
def result_contents(draw: st.DrawFn, tid: str) -> tuple[Any, dict[str, Any]]:
    """A tool_result's content (sized to straddle the thresholds) and extra block fields."""
    kind = draw(KINDS)
    size = draw(SIZES)
    chars = list((f"[{tid}]" + draw(CHARS) * size)[:size])
    for pos in draw(NEWLINES):
        if pos < size:
            chars[pos] = "\n"
    text = "".join(chars)
    extra: dict[str, Any] = {}
    if draw(st.integers(0, 5)) == 0:
        extra["cache_control"] = {"type": "ephemeral"}
    content: Any
    if kind == "str":
        content = text
    elif kind == "error":
        content, extra["is_error"] = text, True
    elif kind == "blocks":
        n = draw(st.integers(1, 3))
        cuts = [0, *sorted(draw(st.integers(0, size)) for _ in range(n - 1)), size]
        content = [{"type": "text", "text": text[a:b]} for a, b in itertools.pairwise(cuts)]
    elif kind == "image":
        content = [{"type": "text", "text": text}, IMAGE_BLOCK]
    elif kind == "doc":  # a candidate that cannot be persisted
        content = [{"type": "text", "text": text}, DOC_BLOCK]
    elif kind == "empty":
        content = draw(st.sampled_from(EMPTIES))
    else:  # output that starts with the tag: a candidate unless it can be a replacement
        content = TAG + text + draw(st.sampled_from(["", "\n</persisted-output>"]))
    return content, extra


class Session:
    """A generated conversation: events in order, and what the generator knows about each id."""

    def __init__(
        self,
        limit: int,
        events: list[tuple[str, Any]],  # ("msg", Message) | ("pass", None) | ("end", turn)
        tool_of: dict[str, str],
        turn_of: dict[str, int],
        original: dict[str, Any],
        resume_after: int | None,
    ) -> None:
        self.limit = limit
        self.events = events
        self.tool_of = tool_of
        self.turn_of = turn_of
        self.original = original
        self.resume_after = resume_after
        # the model's ledger keys: each candidate by its id and its output (ids are unique here)
        self.key_of = {
            tid: spec_key(tid, content)
            for tid, content in original.items()
            if spec_is_candidate(content)
        }

    def __repr__(self) -> str:  # readable falsifying examples
        lines = [f"Session(limit={self.limit}, resume_after={self.resume_after})"]
        for kind, payload in self.events:
            if kind != "msg":
                lines.append(f"  -- {kind} {payload if payload is not None else ''}")
                continue
            m: Message = payload
            if isinstance(m.content, str):
                lines.append(f"  {m.type}: {m.content!r}")
                continue
            parts = []
            for b in m.content:
                if b["type"] == "tool_use":
                    parts.append(f"tool_use {b['id']} {b['name']}")
                elif b["type"] == "tool_result":
                    c = b.get("content")
                    desc = (
                        f"str[{len(c)}]{'(tag)' if c.startswith(TAG) else ''}"
                        if isinstance(c, str)
                        else f"list{[x['type'] for x in c]}[{spec_size(c)}]"
                        if isinstance(c, list)
                        else repr(c)
                    )
                    flags = "".join(
                        f" {k}" for k in b if k not in ("type", "tool_use_id", "content")
                    )
                    parts.append(f"tool_result {b['tool_use_id']} {desc}{flags}")
                else:
                    parts.append(b["type"])
            lines.append(f"  {m.type}({m.message_id or ''}): {', '.join(parts)}")
        return "\n".join(lines)


@st.composite
def sessions(draw: st.DrawFn, max_turns: int = 5) -> Session:
    limit = draw(st.sampled_from(LIMITS))
    n_turns = draw(st.integers(1, max_turns))
    events: list[tuple[str, Any]] = [("msg", user_text("start"))]
    tool_of: dict[str, str] = {}
    turn_of: dict[str, int] = {}
    original: dict[str, Any] = {}

    def emit_result(tid: str) -> None:
        if draw(st.integers(0, 3)) == 0:
            events.append(("msg", Message(type="progress")))
        content, extra = draw(result_contents(tid))
        original[tid] = content
        events.append(("msg", results(tool_result(tid, content, **extra))))
        if draw(st.integers(0, 7)) == 0:  # the agent runs the pipeline mid-turn
            events.append(("pass", None))

    for t in range(n_turns):
        mid = f"msg_{t:02d}"
        if t > 0 and draw(st.integers(0, 5)) == 0:
            events.append(("msg", assistant(mid, {"type": "text", "text": f"answer {t}"})))
            events.append(("msg", user_text(f"prompt {t}")))
            events.append(("end", t))
            continue
        n = draw(st.integers(1, 6))
        ids = [f"toolu_{t:02d}_{i}" for i in range(n)]
        for tid in ids:
            tool_of[tid] = draw(st.sampled_from(TOOLS))
            turn_of[tid] = t
        fragments: list[list[str]] = []
        for tid in ids:
            if not fragments or draw(st.booleans()):
                fragments.append([])
            fragments[-1].append(tid)
        if draw(st.booleans()):
            events.append(("msg", assistant(mid, {"type": "text", "text": f"let me look {t}"})))
        pending: list[str] = []
        for k, frag in enumerate(fragments):
            events.append(("msg", assistant(mid, *(tool_use(i, tool_of[i]) for i in frag))))
            pending += frag
            if k < len(fragments) - 1 and draw(st.booleans()):
                # results of early tools arrive before the rest of the response has streamed
                early = draw(st.permutations(pending))[: draw(st.integers(0, len(pending)))]
                for tid in early:
                    emit_result(tid)
                    pending.remove(tid)
        for tid in draw(st.permutations(pending)):
            emit_result(tid)
        if draw(st.integers(0, 5)) == 0:
            events.append(("msg", user_text(f"also, remark {t}")))
        events.append(("end", t))
    resume_after = draw(st.one_of(st.none(), st.integers(0, n_turns - 1)))
    return Session(limit, events, tool_of, turn_of, original, resume_after)


# --------------------------------------------------------------------------------------------
# One simulated session (live or resumed) and the per-pass checks
# --------------------------------------------------------------------------------------------


class NoIOStore:
    """A store that must not be called (a pass with nothing new does no I/O)."""

    async def persist(self, tool_use_id: str, text: str, ext: str) -> str:
        raise AssertionError(f"unexpected persist of {tool_use_id!r}")


def _tool_results(messages: Sequence[Message]) -> list[dict[str, Any]]:
    return [
        b
        for m in messages
        if m.type == "user" and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    ]


@dataclass
class Runner:
    """One session context and the invariant checks of every pass it runs."""

    name: str
    ctx: SessionContext
    session: Session
    store_dir: Path
    transcript_path: Path
    pipe: Pipeline
    sent: dict[str, str] = field(default_factory=dict)
    previous_request: list[Any] | None = None
    passes: int = 0

    async def run_pass(self, history: list[Message]) -> list[Any]:
        s = self.session
        ctx = self.ctx
        limit = s.limit
        before = ctx.replacement_state.copy()
        snapshot = list(history)
        inp = history
        out = await self.pipe.run(inp, ctx)
        after = ctx.replacement_state
        self.passes += 1
        where = f"[{self.name} pass {self.passes}]"

        # the input is never mutated
        assert inp == snapshot, where

        # -- shape: only tool_result content may change; other fields kept -----------------
        assert len(out) == len(inp), where
        for m_in, m_out in zip(inp, out, strict=True):
            if m_out is m_in:
                continue
            assert m_out.uuid == m_in.uuid and m_out.type == m_in.type == "user", where
            assert isinstance(m_in.content, list) and isinstance(m_out.content, list), where
            assert len(m_out.content) == len(m_in.content), where
            for b_in, b_out in zip(m_in.content, m_out.content, strict=True):
                if b_out is b_in:
                    continue
                assert b_in["type"] == "tool_result", where
                assert {k: v for k, v in b_out.items() if k != "content"} == {
                    k: v for k, v in b_in.items() if k != "content"
                }, where

        # -- grouping: collect_groups agrees with the turns and with the wire -----------------
        candidates = [
            b["tool_use_id"] for b in _tool_results(inp) if spec_is_candidate(b.get("content"))
        ]
        expected_groups: list[list[str]] = []
        for tid in candidates:
            if expected_groups and s.turn_of[expected_groups[-1][0]] == s.turn_of[tid]:
                expected_groups[-1].append(tid)
            else:
                expected_groups.append([tid])
        groups = [[c.tool_use_id for c in g] for g in collect_groups(inp)]
        assert groups == expected_groups, where
        request_in = to_api(inp)
        wire_groups = [
            ids
            for p in request_in
            if p["role"] == "user"
            and (
                ids := [
                    b["tool_use_id"]
                    for b in p["content"]
                    if isinstance(b, Mapping)
                    and b.get("type") == "tool_result"
                    and spec_is_candidate(b.get("content"))
                ]
            )
        ]
        assert wire_groups == expected_groups, where

        # -- the exact decision: §2.4 recomputed ------------------------------------------------
        k = s.key_of  # the ledger knows a result by its id and output (§2.3)
        expected_new: dict[str, str] = {}  # id -> "per_tool" | "per_message"
        for group in expected_groups:
            fresh = [i for i in group if k[i] not in before.seen_ids]
            if not fresh:
                continue
            bounded = [i for i in fresh if s.tool_of[i] != "Read"]
            for i in bounded:
                c = s.original[i]
                if spec_persistable(c) and spec_size(c) > THRESHOLD[s.tool_of[i]]:
                    expected_new[i] = "per_tool"
            eligible = [
                (i, spec_size(s.original[i]), spec_persistable(s.original[i]))
                for i in bounded
                if i not in expected_new
            ]
            # a never-persist tool's result is out of the sum, on this pass or a later one
            frozen_size = sum(
                spec_size(s.original[i])
                for i in group
                if k[i] in before.seen_ids
                and k[i] not in before.replacements
                and s.tool_of[i] != "Read"
            )
            for i in spec_greedy(eligible, frozen_size, limit):
                expected_new[i] = "per_message"
            # what kinds of group this run reached (shown by --hypothesis-show-statistics)
            over = frozen_size + sum(size for _i, size, _p in eligible) > limit
            if frozen_size and eligible:
                event("group: frozen and fresh together")
            if over and frozen_size > limit:
                event("group: frozen alone over the limit")
            if over and any(not p for _i, _s, p in eligible):
                event("group: over, with a non-persistable result")
            if over and len(bounded) < len(fresh):
                event("group: over, with a never-persist (Read) result")
        for reason in sorted(set(expected_new.values())):
            event(f"pass persisted {reason}")
        new_keys = set(after.replacements) - set(before.replacements)
        expected_keys = {k[i] for i in expected_new}
        assert new_keys == expected_keys, (where, sorted(new_keys), sorted(expected_keys))
        assert {p.tool_use_id: p.reason for p in ctx.report.persisted} == expected_new, where
        assert ctx.report.persist_failed == [], where
        for rkey, text in before.replacements.items():
            assert after.replacements[rkey] == text, where
        assert after.seen_ids == before.seen_ids | {k[i] for i in candidates}, where
        assert set(after.replacements) <= after.seen_ids, where

        # -- (3) nothing lost + exact replacement text ------------------------------------
        for b in _tool_results(out):
            tid = b["tool_use_id"]
            orig = s.original[tid]
            new = b.get("content")
            if spec_is_empty(orig):
                assert new == f"({s.tool_of[tid]} completed with no output)", where
            elif spec_is_candidate(orig) and k[tid] in after.replacements:
                assert spec_persistable(orig), where
                assert new == after.replacements[k[tid]], where
                assert after.replacement_for(tid, orig) == new, where
                text, ext = spec_serialise(orig)
                match = _REPLACEMENT_HEAD.match(new)
                assert match is not None, (where, new[:200])
                path = match.group(2)
                assert path == str((self.store_dir / f"{tid}.{ext}").absolute()), where
                assert Path(path).read_bytes() == text.encode("utf-8"), where
                assert new == spec_replacement(path, text), where
            else:
                assert new == orig, where
        assert not [p for p in self.store_dir.glob(".tmp-*")], where

        # -- (2) budget bound on every wire user message that held a fresh result ----------
        request = to_api(out)
        for p in request:
            if p["role"] != "user" or isinstance(p["content"], str):
                continue
            ids = [
                b["tool_use_id"]
                for b in p["content"]
                if b.get("type") == "tool_result"
                and spec_is_candidate(s.original[b["tool_use_id"]])
            ]
            if not any(k[i] not in before.seen_ids for i in ids):
                continue
            visible = [i for i in ids if s.tool_of[i] != "Read" and k[i] not in after.replacements]
            visible_chars = sum(spec_size(s.original[i]) for i in visible)
            fresh_persistable_visible = [
                i
                for i in visible
                if k[i] not in before.seen_ids and spec_persistable(s.original[i])
            ]
            # over the limit only when nothing more could be persisted: the frozen ones alone
            # exceed it, or the excess is content that cannot be persisted
            assert visible_chars <= limit or not fresh_persistable_visible, (
                where,
                visible_chars,
                fresh_persistable_visible,
            )

        # -- (4) pairing preserved -----------------------------------------------------------
        problems_in = check_pairing(request_in)
        assert check_pairing(request) == problems_in, where

        # -- (1) cache stability --------------------------------------------------------------
        for p in request:
            if isinstance(p["content"], str):
                continue
            for b in p["content"]:
                if b.get("type") == "tool_result":
                    sent_id, value = b["tool_use_id"], _dumps(b)
                    assert self.sent.setdefault(sent_id, value) == value, (where, sent_id)
        if self.previous_request is not None:
            prev = self.previous_request
            stable = max(len(prev) - 2, 0)
            assert _dumps(request[:stable]) == _dumps(prev[:stable]), where
        self.previous_request = request

        # -- (5) idempotence --------------------------------------------------------------------
        nothing_to_apply = not any(
            k.get(b["tool_use_id"]) in after.replacements or spec_is_empty(b.get("content"))
            for b in _tool_results(inp)
        )
        if nothing_to_apply:
            assert out is inp, where
        state_now = after.copy()
        transcript_size = self.transcript_path.stat().st_size
        again = await self.pipe.run(inp, ctx)
        assert again == out and _dumps(to_api(again)) == _dumps(request), where
        assert (again is inp) == nothing_to_apply, where
        assert ctx.replacement_state == state_now, where
        assert ctx.report.persisted == [] and ctx.report.persist_failed == [], where
        assert self.transcript_path.stat().st_size == transcript_size, where
        if not any(spec_is_empty(b.get("content")) for b in _tool_results(inp)):
            # the projection is a fixed point: nothing new, nothing to apply, no I/O
            probe = SessionContext(
                SID,
                ctx.root,
                store=NoIOStore(),
                replacement_state=state_now.copy(),
                tool_policies=POLICIES,
                logger=QuietLogger(),
            )
            assert await self.pipe.run(out, probe) is out, where
            assert probe.replacement_state == state_now, where
        return request


def _make_ctx(root: Path, transcript: Path, state: ReplacementState | None) -> SessionContext:
    return SessionContext(
        SID,
        root / "store",
        replacement_state=state,
        transcript=TranscriptWriter(transcript, SID),
        tool_policies=POLICIES,
        logger=QuietLogger(),
    )


async def simulate(session: Session, root: Path) -> None:
    pipe = Pipeline([ToolResultBudget(session.limit)])
    store_dir = root / "store" / SID / "tool-results"
    live_path = root / "live.jsonl"
    live_ctx = _make_ctx(root, live_path, None)
    assert isinstance(live_ctx.store, FileToolResultStore)
    live = Runner("live", live_ctx, session, store_dir, live_path, pipe)
    history: list[Message] = []
    unwritten: list[Message] = []
    resumed: Runner | None = None
    resumed_history: list[Message] = []
    for kind, payload in session.events:
        if kind == "msg":
            history.append(payload)
            unwritten.append(payload)
            if resumed is not None:
                resumed_history.append(payload)
            continue
        # the agent records the new messages before calling the model
        assert live_ctx.transcript is not None
        live_ctx.transcript.append_messages(unwritten)
        unwritten = []
        # a model call: both sessions project the conversation; resumed first on odd passes
        order = [live] if resumed is None else [live, resumed]
        if resumed is not None and live.passes % 2:
            order.reverse()
        requests = {}
        for runner in order:
            requests[runner.name] = await runner.run_pass(
                history if runner is live else resumed_history
            )
        if resumed is not None:
            assert _dumps(requests["resumed"]) == _dumps(requests["live"]), "resume diverged"
        if kind == "end" and payload == session.resume_after:
            # -- (6) resume from the transcript the live session wrote --------------------------
            loaded = load_transcript(live_path)
            assert loaded.problems == []
            assert _dumps(to_api(loaded.messages)) == _dumps(to_api(history))
            state = ReplacementState.reconstruct(
                loaded.messages,
                loaded.replacement_records,
                decided=decided_in(loaded.stage_records),
            )
            assert state.replacements == live_ctx.replacement_state.replacements
            # (blank results are not candidates: neither the stage nor reconstruct decides them
            # -- see test_reconstruct_agrees_with_the_stage_on_blank_results)
            live_seen = set(live_ctx.replacement_state.seen_ids)
            assert state.seen_ids == live_seen
            resumed_path = root / "resumed.jsonl"
            shutil.copyfile(live_path, resumed_path)
            resumed = Runner(
                "resumed",
                _make_ctx(root, resumed_path, state),
                session,
                store_dir,
                resumed_path,
                pipe,
                sent=dict(live.sent),
                previous_request=requests["live"],
            )
            resumed_history = list(loaded.messages)
            event(f"resumed, with {len(state.replacements)} replacement(s) restored")
            first = await resumed.run_pass(resumed_history)
            assert _dumps(first) == _dumps(requests["live"]), "resumed request differs"
            assert resumed.ctx.replacement_state.seen_ids == live_seen


@pytest.mark.slow
@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(sessions())
def test_live_and_resumed_sessions_hold_invariants_1_to_6(session: Session) -> None:
    root = Path(tempfile.mkdtemp(prefix="sluicegate-prop-", dir=FAST_TMP))
    try:
        anyio.run(simulate, session, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Smaller properties: the selection walk and the replacement text, many cases each
# --------------------------------------------------------------------------------------------


@settings(max_examples=1_000, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([0, 1, 500, 999, 1_000, 1_001, 2_500]), st.booleans())
        | st.tuples(st.integers(0, 5_000), st.booleans()),
        max_size=10,
    ),
    st.integers(0, 8_000),
    st.integers(1, 10_000),
)
def test_selection_walk_matches_spec(
    items: list[tuple[int, bool]], frozen_size: int, limit: int
) -> None:
    fresh = [
        Candidate(0, f"t{i}", "Other", "x", size, persistable)
        for i, (size, persistable) in enumerate(items)
    ]
    selected = [c.tool_use_id for c in select_fresh_to_replace(fresh, frozen_size, limit)]
    expected = spec_greedy(
        [(c.tool_use_id, c.size, c.persistable) for c in fresh], frozen_size, limit
    )
    assert selected == expected
    remaining = frozen_size + sum(c.size for c in fresh if c.tool_use_id not in selected)
    unpersistable = sum(c.size for c in fresh if not c.persistable)
    # it stops as soon as the rest fits, and only fails to fit when it ran out of options
    if remaining > limit:
        assert all(c.tool_use_id in selected for c in fresh if c.persistable)
        assert frozen_size + unpersistable == remaining
    elif selected:
        last = next(c for c in fresh if c.tool_use_id == selected[-1])
        assert remaining + last.size > limit


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.integers(0, 2_100),
        st.sampled_from([1_023, 1_024, 1_025, 1_280, 1_997, 1_998, 1_999, 2_000, 2_001, 2_002]),
        st.integers(2_000, 12_000),
    ),
    NEWLINES,
    CHARS,
    st.booleans(),
)
def test_persisted_text_and_replacement_match_spec(
    size: int, newlines: list[int], char: str, as_blocks: bool
) -> None:
    chars = list(char * size)
    for pos in newlines:
        if pos < size:
            chars[pos] = "\n"
    text = "".join(chars)
    content: Any = [{"type": "text", "text": text}] if as_blocks else text
    root = Path(tempfile.mkdtemp(prefix="sluicegate-repl-", dir=FAST_TMP))
    try:
        store = FileToolResultStore(root, SID)
        persisted = anyio.run(persist_content, store, "toolu_r", content)
        serialised, ext = spec_serialise(content)
        expected_path = str((root / SID / "tool-results" / f"toolu_r.{ext}").absolute())
        assert persisted.path == expected_path
        assert Path(expected_path).read_bytes() == serialised.encode("utf-8")
        assert persisted.replacement == spec_replacement(expected_path, serialised)
        assert persisted.replacement.startswith(TAG)
        assert persisted.replacement.endswith("</persisted-output>")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@settings(max_examples=1_000, deadline=None)
@given(
    st.one_of(
        st.integers(0, 5_000),
        st.integers(0, 2**40),
        st.integers(0, 4_000).map(lambda k: (1_024 * k + 512) // 10),  # near .x5 ties
        st.sampled_from([1_023, 1_024, 1_280, 51_200, 60_000, 1_048_575, 1_048_576, 1_073_741_824]),
    )
)
def test_size_format_matches_spec(n: int) -> None:
    from pipeline.gate import format_size

    assert format_size(n) == spec_format_size(n)


def test_size_format_examples_from_spec() -> None:
    assert spec_format_size(51_200) == "50KB"
    assert spec_format_size(60_000) == "58.6KB"
    assert spec_format_size(1_023) == "1023 bytes"
    assert spec_format_size(1_280) == "1.3KB"  # 1.25 exactly: toFixed rounds the tie up
    from pipeline.gate import format_size

    for n in (51_200, 60_000, 1_023, 1_024, 1_280, 2_097_152):
        assert format_size(n) == spec_format_size(n)


# --------------------------------------------------------------------------------------------
# The seed examples, spelled out
# --------------------------------------------------------------------------------------------


def _ctx(root: Path, policies: ToolPolicies | None = None, **kw: Any) -> SessionContext:
    return SessionContext(
        SID,
        root,
        tool_policies=policies or ToolPolicies.claude_code(),
        logger=QuietLogger(),
        **kw,
    )


def _contents(messages: Sequence[Message]) -> dict[str, Any]:
    return {b["tool_use_id"]: b.get("content") for b in _tool_results(messages)}


def _parallel_turn(mid: str, sizes: Sequence[int], tool: str = "Glob") -> list[Message]:
    ids = [f"tr_{i}" for i in range(len(sizes))]
    return [
        assistant(mid, *(tool_use(i, tool) for i in ids)),
        *(
            results(tool_result(i, (f"<{i}>" + "y" * size)[:size]))
            for i, size in zip(ids, sizes, strict=True)
        ),
    ]


@pytest.mark.anyio
async def test_ten_parallel_40k_results_persist_the_first_five_at_the_default_limit(
    tmp_path: Path,
) -> None:
    history = [user_text("go"), *_parallel_turn("msg_1", [40_000] * 10)]
    ctx = _ctx(tmp_path)
    out = await Pipeline([ToolResultBudget()]).run(history, ctx)
    sent = _contents(out)
    persisted = [tid for tid, c in sent.items() if c.startswith(TAG)]
    # equal sizes: the walk is stable, so the first five in message order go
    assert persisted == ["tr_0", "tr_1", "tr_2", "tr_3", "tr_4"]
    assert sum(len(c) for c in sent.values() if not c.startswith(TAG)) == 200_000
    for tid in persisted:
        path = _REPLACEMENT_HEAD.match(sent[tid])
        assert path is not None and Path(path.group(2)).read_text() == _contents(history)[tid]
        assert path.group(1) == "39.1KB"
    assert [p.reason for p in ctx.report.persisted] == ["per_message"] * 5


@pytest.mark.anyio
async def test_largest_results_go_first_and_ties_keep_message_order(tmp_path: Path) -> None:
    sizes = [39_000, 41_000, 40_000, 40_500, 39_500, 40_000, 38_000, 42_000, 40_000, 39_999]
    history = [user_text("go"), *_parallel_turn("msg_1", sizes)]
    ctx = _ctx(tmp_path)
    out = await Pipeline([ToolResultBudget()]).run(history, ctx)
    sent = _contents(out)
    # 399,999 total: 42,000, 41,000, 40,500, then two of the three 40,000s (tr_2, tr_5, not tr_8)
    assert [p.tool_use_id for p in ctx.report.persisted] == ["tr_7", "tr_1", "tr_3", "tr_2", "tr_5"]
    visible = sum(len(c) for c in sent.values() if not c.startswith(TAG))
    assert visible == 196_499 <= 200_000
    assert not sent["tr_8"].startswith(TAG)


def test_interleaved_streams_group_as_the_wire_merges_them() -> None:
    history = [
        assistant("X", tool_use("A")),
        results(tool_result("A", "result A")),
        assistant("Y", tool_use("B")),
        results(tool_result("B", "result B")),
        assistant("X", tool_use("C")),
        results(tool_result("C", "result C")),
    ]
    groups = [[c.tool_use_id for c in g] for g in collect_groups(history)]
    assert groups == [["A"], ["B", "C"]]
    wire = to_api(history)
    wire_ids = [
        [b["tool_use_id"] for b in p["content"] if b.get("type") == "tool_result"]
        for p in wire
        if p["role"] == "user"
    ]
    assert wire_ids == groups


@pytest.mark.anyio
async def test_progress_records_between_parallel_results_do_not_split_the_group(
    tmp_path: Path,
) -> None:
    history = [
        user_text("go"),
        assistant("msg_1", tool_use("a", "Glob"), tool_use("b", "Glob"), tool_use("c", "Glob")),
        Message(type="progress"),
        results(tool_result("a", "a" * 1_500)),
        Message(type="progress"),
        Message(type="progress"),
        results(tool_result("b", "b" * 1_400)),
        Message(type="system", content="hook ran", subtype="informational"),
        results(tool_result("c", "c" * 1_300)),
        Message(type="progress"),
    ]
    assert [[c.tool_use_id for c in g] for g in collect_groups(history)] == [["a", "b", "c"]]
    ctx = _ctx(tmp_path)
    out = await Pipeline([ToolResultBudget(3_000)]).run(history, ctx)
    # 4,200 > 3,000 in ONE group: the largest goes; split groups would each fit
    assert [p.tool_use_id for p in ctx.report.persisted] == ["a"]
    assert check_pairing(to_api(out)) == []


@pytest.mark.anyio
async def test_frozen_results_over_the_limit_are_never_changed(tmp_path: Path) -> None:
    history = [
        user_text("go"),
        assistant("msg_1", tool_use("a", "Glob"), tool_use("b", "Glob"), tool_use("c", "Glob")),
        results(tool_result("a", "a" * 3_000)),
        results(tool_result("b", "b" * 3_000)),
    ]
    # the model has seen a and b whole (e.g. an earlier pass sent them): they are frozen
    state = ReplacementState(seen_ids={key("a", "a" * 3_000), key("b", "b" * 3_000)})
    ctx = _ctx(tmp_path, replacement_state=state)
    pipe = Pipeline([ToolResultBudget(5_000)])
    out = await pipe.run(history, ctx)
    assert out is history  # 6,000 > 5,000 but nothing may change: overage accepted
    assert not (tmp_path / SID).exists()

    # a late parallel result joins the same group: frozen alone exceed the limit, so the fresh
    # one is persisted and the frozen ones still stay whole
    history = [*history, results(tool_result("c", "c" * 1_000))]
    out = await pipe.run(history, ctx)
    sent = _contents(out)
    assert sent["a"] == "a" * 3_000 and sent["b"] == "b" * 3_000
    assert sent["c"].startswith(TAG)
    assert [p.tool_use_id for p in ctx.report.persisted] == ["c"]


@pytest.mark.anyio
async def test_never_persist_tool_is_left_whole_and_excluded_from_the_sum(tmp_path: Path) -> None:
    def turn(mid: str, sizes: tuple[int, int]) -> list[Message]:
        r, g1, g2 = f"{mid}_read", f"{mid}_g1", f"{mid}_g2"
        return [
            assistant(mid, tool_use(r, "Read"), tool_use(g1, "Glob"), tool_use(g2, "Glob")),
            results(tool_result(r, "r" * 10_000)),
            results(tool_result(g1, "g" * sizes[0])),
            results(tool_result(g2, "h" * sizes[1])),
        ]

    ctx = _ctx(tmp_path)  # claude_code(): Read never persisted
    pipe = Pipeline([ToolResultBudget(3_000)])
    # 10,000 + 1,500 + 1,400 > 3,000, but without Read it is 2,900: nothing goes
    history = [user_text("go"), *turn("m1", (1_500, 1_400))]
    out = await pipe.run(history, ctx)
    assert out is history
    assert ctx.replacement_state.classify(key("m1_read", "r" * 10_000)) == "frozen"
    # without Read 3,500 > 3,000: only the 2,000 goes; Read stays whole
    history += [*turn("m2", (2_000, 1_500))]
    out = await pipe.run(history, ctx)
    sent = _contents(out)
    assert sent["m2_read"] == "r" * 10_000
    assert [p.tool_use_id for p in ctx.report.persisted] == ["m2_g1"]
    assert sent["m2_g2"] == "h" * 1_500


@pytest.mark.anyio
@pytest.mark.parametrize("records_format", ["bound", "legacy"])
async def test_resume_uses_stored_replacements_verbatim_and_skips_dropped_ids(
    tmp_path: Path, records_format: str
) -> None:
    legacy = "<persisted-output>\nan older template, path /old/layout/kept.txt\n</persisted-output>"
    history = [
        user_text("summary of an earlier, compacted part"),
        assistant("m1", tool_use("kept", "Glob"), tool_use("small", "Glob")),
        results(tool_result("kept", "k" * 5_000)),
        results(tool_result("small", "s" * 10)),
    ]
    # "bound": records carry the digest of the output they replaced; "legacy": records written
    # before results were bound to their content (a bare id: the result with that id)
    bound = records_format == "bound"
    records = [
        ReplacementRecord(
            "gone",
            "<persisted-output>\ncompacted away\n</persisted-output>",
            digest=content_digest("g" * 5_000) if bound else None,
        ),
        ReplacementRecord("kept", legacy, digest=content_digest("k" * 5_000) if bound else None),
    ]
    state = ReplacementState.reconstruct(history, records)
    kept = key("kept", "k" * 5_000)
    assert state.replacements == {kept: legacy}  # "gone" is no longer a candidate: skipped
    assert state.seen_ids == {kept}  # "small" came after the last response: decided again
    ctx = _ctx(tmp_path, store=NoIOStore(), replacement_state=state)
    out = await Pipeline([ToolResultBudget(3_000)]).run(history, ctx)
    # never rebuilt: a new template or path layout cannot shift the cached prefix
    assert _contents(out) == {"kept": legacy, "small": "s" * 10}
    assert ctx.report.reapplied == 1 and ctx.report.persisted == []


# --------------------------------------------------------------------------------------------
# Bugs found by the properties above, pinned as regression tests
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_reconstruct_agrees_with_the_stage_on_blank_results(tmp_path: Path) -> None:
    history = [
        user_text("go"),
        assistant("msg_1", tool_use("a", "Glob"), tool_use("b", "Glob")),
        results(tool_result("a", "  \n\t")),
        results(tool_result("b", [{"type": "text", "text": " "}])),
    ]
    ctx = _ctx(tmp_path)
    await Pipeline([ToolResultBudget(3_000)]).run(history, ctx)
    assert ReplacementState.reconstruct(history, []) == ctx.replacement_state


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["user", "assistant"])
async def test_malformed_blocks_get_a_clear_error_or_a_safe_fallback(
    tmp_path: Path, where: str
) -> None:
    if where == "user":
        history = [
            user_text("go"),
            assistant("msg_1", tool_use("a", "Glob")),
            Message.user(["stray string", tool_result("a", "")]),  # type: ignore[list-item]
        ]
    else:
        history = [
            user_text("go"),
            Message.assistant(["stray string", tool_use("a", "Glob")], message_id="m"),  # type: ignore[list-item]
            results(tool_result("a", "x")),
        ]
    try:
        await Pipeline([ToolResultBudget(3_000)]).run(history, _ctx(tmp_path))
    except Exception as exc:  # a clear error names the problem; an internal crash does not
        cause = exc.__cause__ or exc
        assert not isinstance(cause, AttributeError | KeyError | TypeError), repr(cause)


@pytest.mark.anyio
async def test_a_reused_tool_use_id_never_gets_another_results_replacement(tmp_path: Path) -> None:
    history = [
        user_text("go"),
        assistant("m1", tool_use("dup", "Glob")),
        results(tool_result("dup", "A" * 5_000)),
        assistant("m2", tool_use("dup", "Glob")),
        results(tool_result("dup", "B" * 100)),
    ]
    out = await Pipeline([ToolResultBudget(3_000)]).run(history, _ctx(tmp_path))
    second = _tool_results(out)[1]["content"]
    if second.startswith(TAG):
        match = _REPLACEMENT_HEAD.match(second)
        assert match is not None
        assert Path(match.group(2)).read_text(encoding="utf-8") == "B" * 100
    else:
        assert second == "B" * 100
