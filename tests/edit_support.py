"""Random sessions with caller edits, for the properties that check incremental passes against
from-scratch ones: a tape-driven generator, history edits, and a strategy of odd records."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pipeline import (
    Message,
    ReplacementState,
    SessionContext,
    ToolPolicies,
)
from pipeline.kept_list import KeptList
from pipeline.messages import REMINDER
from pipeline.testing import MemoryStore, QuietLogger
from tests.builders import assistant, results, tool_result, tool_use, user_text

SID = "incremental"
POLICIES = ToolPolicies(declared={"Bash": 120, "Read": math.inf}, cap=200)
TOOLS = ("Bash", "Read", "Other", "Other")
TAG = "<persisted-output>"
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
DOC = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "d"}}


class RecordingTracer:
    """Just enough of a tracer for the stage: records each span's name and attributes.

    (The SDK's in-memory exporter does the same at several times the cost per span.)
    """

    def __init__(self) -> None:
        self.spans: list[tuple[str, dict[str, Any]]] = []

    @contextlib.contextmanager
    def start_as_current_span(
        self, name: str, attributes: dict[str, Any] | None = None, **_kw: Any
    ) -> Iterator[RecordingSpan]:
        span = RecordingSpan(dict(attributes or {}))
        self.spans.append((name, span.attributes))
        yield span

    def start_span(
        self, name: str, attributes: dict[str, Any] | None = None, **_kw: Any
    ) -> RecordingSpan:
        span = RecordingSpan(dict(attributes or {}))
        self.spans.append((name, span.attributes))
        return span

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        spans, self.spans = self.spans, []
        return spans


@dataclasses.dataclass
class RecordingSpan:
    attributes: dict[str, Any]

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self.attributes.update(attributes)

    def end(self) -> None:
        pass


def _ctx(store: MemoryStore, state: ReplacementState | None, tracer: Any) -> SessionContext:
    return SessionContext(
        SID,
        "/nonexistent-root",  # the memory store never touches it
        store=store,
        replacement_state=state,
        tool_policies=POLICIES,
        tracer=tracer,
        logger=QuietLogger(),
    )


TAPE = st.binary(min_size=128, max_size=2_048)


CONTENT_KINDS = ("str",) * 5 + ("blocks", "blocks", "image", "doc", "empty", "blank", "tagged")


EMPTY_CONTENTS: tuple[Any, ...] = (None, "", [])


BLANK_CONTENTS: tuple[Any, ...] = ("  \n", [{"type": "text", "text": " "}])


SINGLE_KINDS = ("results", "assistant", "user", "progress", "attach", "reminder")


OPS = (
    ("turn",) * 6
    + ("replace", "replace", "insert", "delete", "truncate", "swap")
    + ("feed_back", "new_list", "new_ledger", "grow_ledger", "grow_ledger", "shrink_ledger")
    + ("shrink_ledger", "noop")
)


def reminder(text: str) -> Message:
    """A Claude Code 2.1 reminder attachment (as the loader builds it from ``rendered``)."""
    return Message(type="attachment", content=[{"type": "text", "text": text}], subtype=REMINDER)


class Gen:
    """Draws messages for one session; remembers ids so that some can be reused (hostile)."""

    def __init__(self, tape: bytes) -> None:
        self.tape = tape
        self.at = 0
        self.n = 0
        self.tool_ids: list[str] = []
        self.response_ids: list[str] = []

    def below(self, n: int) -> int:
        """0 <= k < n, read off the tape (0 once it is used up)."""
        chunk = self.tape[self.at : self.at + 2]
        self.at += 2
        return int.from_bytes(chunk, "big") % n if n > 1 else 0

    def pick(self, options: Sequence[Any]) -> Any:
        return options[self.below(len(options))]

    def one_in(self, n: int) -> bool:
        """True about once in ``n`` (False once the tape is used up)."""
        return self.below(n) == n - 1

    def shuffled(self, items: list[str]) -> list[str]:
        items = list(items)
        for i in range(len(items) - 1, 0, -1):
            j = self.below(i + 1)
            items[i], items[j] = items[j], items[i]
        return items

    def new_tool_id(self) -> str:
        if self.tool_ids and self.one_in(12):
            return str(self.pick(self.tool_ids))  # a reused id
        self.n += 1
        tid = f"t{self.n}"
        self.tool_ids.append(tid)
        return tid

    def response_id(self) -> str:
        if self.response_ids and self.one_in(6):
            return str(self.pick(self.response_ids))  # a late fragment of an earlier response
        rid = f"r{len(self.response_ids)}"
        self.response_ids.append(rid)
        return rid

    def content(self, tid: str) -> Any:
        kind = self.pick(CONTENT_KINDS)
        size = self.below(61) if self.below(2) == 0 else 60 + self.below(341)
        text = (f"<{tid}>" + "x" * size)[: max(size, 1)]
        if kind == "str":
            return text
        if kind == "blocks":
            half = len(text) // 2
            return [{"type": "text", "text": text[:half]}, {"type": "text", "text": text[half:]}]
        if kind == "image":
            return [{"type": "text", "text": text}, IMAGE]
        if kind == "doc":
            return [{"type": "text", "text": text}, DOC]
        if kind == "empty":
            return self.pick(EMPTY_CONTENTS)
        if kind == "blank":
            return self.pick(BLANK_CONTENTS)
        return TAG + text

    def result_block(self, tid: str) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.one_in(7):
            extra["is_error"] = True
        if self.one_in(7):
            extra["cache_control"] = {"type": "ephemeral"}
        return tool_result(tid, self.content(tid), **extra)

    def turn(self) -> list[Message]:
        """One response with parallel tool calls and their results, or a text exchange."""
        if self.one_in(5):
            return [
                assistant(self.response_id(), {"type": "text", "text": "answer"}),
                user_text(f"prompt {self.n}"),
            ]
        rid = self.response_id()
        ids = [self.new_tool_id() for _ in range(1 + self.below(4))]
        out: list[Message] = [assistant(rid, *(tool_use(t, self.pick(TOOLS)) for t in ids))]
        for tid in self.shuffled(ids):
            if self.one_in(4):
                out.append(Message(type="progress"))
            blocks = [self.result_block(tid)]
            if self.one_in(9):
                blocks.append({"type": "text", "text": "note"})
            out.append(results(*blocks))
        if self.one_in(6):
            out.append(Message(type="system", subtype="informational", content="hook"))
        return out

    def single(self) -> Message:
        """One message of any kind, to insert somewhere."""
        kind = self.pick(SINGLE_KINDS)
        if kind == "results":
            tid = str(self.pick(self.tool_ids)) if self.tool_ids else "t0"
            return results(self.result_block(tid))
        if kind == "assistant":
            tid = self.new_tool_id()
            return assistant(self.response_id(), tool_use(tid, self.pick(TOOLS)))
        if kind == "user":
            return user_text("interjection")
        if kind == "attach":
            return Message(type="attachment", content=[{"type": "text", "text": "ctx"}])
        if kind == "reminder":
            return reminder("<system-reminder>r</system-reminder>")
        return Message(type="progress")

    def edited(self, m: Message) -> Message:
        """A new object in place of ``m``: an edited copy, or an equal copy."""
        if self.one_in(3):
            event("edit: equal copy")
            return dataclasses.replace(m)
        if m.type == "user" and isinstance(m.content, list) and m.content:
            k = self.below(len(m.content))
            block = m.content[k]
            if block.get("type") == "tool_result":
                new = dict(block)
                if self.one_in(4):
                    new["tool_use_id"] = self.new_tool_id()
                else:
                    new["content"] = self.content(str(block["tool_use_id"]))
                event("edit: tool_result")
                return m.with_content([*m.content[:k], new, *m.content[k + 1 :]])
        if m.type == "assistant" and isinstance(m.content, list):
            if self.one_in(2):
                event("edit: response id")
                return dataclasses.replace(m, message_id=self.response_id())
            blocks = [
                {**b, "name": self.pick(TOOLS)} if b.get("type") == "tool_use" else b
                for b in m.content
            ]
            event("edit: tool names")
            return m.with_content(blocks)
        return self.single()


def start_history(gen: Gen, first: Message) -> list[Message]:
    """A new history holding ``first``: half the sessions keep it in a
    :class:`~pipeline.kept_list.KeptList` (as the replay and the agent do: the pipeline's logs
    ask it where it changed instead of comparing it), the other half in a plain list."""
    return KeptList([first]) if gen.one_in(2) else [first]


def edit_history(
    gen: Gen, history: list[Message], last_out: list[Message], op: str
) -> list[Message] | None:
    """Apply one caller edit ``op`` (a turn, replace, insert, delete, truncate, swap,
    mark_moved, feed_back, new_list); the history to go on with, or None for an op not
    handled here."""
    n = len(history)
    if op == "turn" or n < 2:
        history.extend(gen.turn())
    elif op == "replace":
        i = gen.below(n)
        history[i] = gen.edited(history[i])
    elif op == "insert":
        history.insert(gen.below(n + 1), gen.single())
    elif op == "delete":
        del history[gen.below(n)]
    elif op == "truncate":
        del history[1 + gen.below(n - 1) :]
    elif op == "swap":
        i, j = gen.below(n), gen.below(n)
        history[i], history[j] = history[j], history[i]
    elif op == "mark_moved":  # Claude Code: the last message changes (its cache_control
        # mark moves on to the new last one), then a turn
        history[-1] = gen.edited(history[-1])
        history.extend(gen.turn())
    elif op == "feed_back":  # the caller keeps the projected messages as its history
        return type(history)(last_out)  # a kept list stays one (see ``start_history``)
    elif op == "new_list":  # same messages, another list object
        return type(history)(history)
    else:
        return None
    return history


def run_sessions(run: Callable[[bytes], Awaitable[None]], examples: int) -> None:
    """``examples`` hypothesis-drawn tapes, each ``run`` as one session on one event loop."""
    with asyncio.Runner() as runner:

        @settings(
            max_examples=examples,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(TAPE)
        def session(tape: bytes) -> None:
            runner.run(run(tape))

        session()


RECORD_KINDS = st.sampled_from(
    ("asst",) * 3
    + ("asst_none", "results", "results", "results", "text", "mixed", "attach", "reminder")
    + ("progress",)
    + ("local", "system", "boundary", "empty")
)


RESPONSE_IDS = st.sampled_from(["X", "Y", "Z", "W"])


@st.composite
def records(draw: st.DrawFn) -> list[Message]:
    out: list[Message] = []
    for k in range(draw(st.integers(0, 40))):
        kind = draw(RECORD_KINDS)
        if kind in ("asst", "asst_none"):
            rid = draw(RESPONSE_IDS) if kind == "asst" else None
            out.append(Message.assistant([tool_use(f"u{k}")], message_id=rid))
        elif kind == "results":
            out.append(results(tool_result(f"u{k}", f"r{k}")))
        elif kind == "text":
            out.append(user_text(f"t{k}"))
        elif kind == "mixed":
            out.append(results(tool_result(f"u{k}", f"r{k}"), {"type": "text", "text": f"m{k}"}))
        elif kind == "attach":
            out.append(Message(type="attachment", content=[{"type": "text", "text": f"a{k}"}]))
        elif kind == "reminder":
            out.append(reminder(f"rem{k}"))
        elif kind == "local":
            out.append(Message(type="system", subtype="local_command", content=f"l{k}"))
        elif kind == "system":
            out.append(Message(type="system", subtype="informational", content="s"))
        elif kind == "boundary":
            out.append(Message(type="system", subtype="compact_boundary", content=""))
        elif kind == "empty":
            out.append(Message.user([]))
        else:
            out.append(Message(type="progress"))
    return out
