"""The pipeline machinery: ordering, editing, errors, concurrency, trio, tracing, logging."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import sniffio
import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

import stages
from pipeline import Message, Pipeline, SessionContext, Stage, StageError, TokenTracker, stage
from pipeline.core import FunctionStage
from pipeline.testing import MemoryStore, SpanRecorder, assert_same_messages
from pipeline.tracing import ATTR, start_current_span
from stages import Autocompact, ContextCollapse, HistorySnip, Microcompact
from tests.builders import assistant, results, tool_result, tool_use, user_text

DEFAULT_ORDER = [
    "tool_result_budget",
    "history_snip",
    "microcompact",
    "context_collapse",
    "autocompact",
]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def named(name: str) -> FunctionStage:
    async def identity(messages: list[Message], ctx: SessionContext) -> list[Message]:
        return messages

    return FunctionStage(name, identity)


def ctx_for(tmp_path: Path, session_id: str = "s1", **kw: Any) -> SessionContext:
    return SessionContext(session_id, tmp_path / "store", **kw)


def small_conversation() -> list[Message]:
    return [
        user_text("list files"),
        assistant("msg_1", tool_use("t1")),
        results(tool_result("t1", "a.txt\nb.txt")),
    ]


# --------------------------------------------------------------------------------------------
# Composition
# --------------------------------------------------------------------------------------------


def test_order_names_and_repr() -> None:
    a, b, c = named("a"), named("b"), named("c")
    pipe = Pipeline([a, b, c])
    assert pipe.names == ["a", "b", "c"]
    assert pipe.stages == (a, b, c)
    assert repr(pipe) == "Pipeline(a → b → c)"
    assert len(pipe) == 3
    assert pipe["b"] is b
    assert repr(Pipeline([])) == "Pipeline()"


def test_editing_returns_new_pipelines_and_leaves_the_original() -> None:
    a, b, c, d = named("a"), named("b"), named("c"), named("d")
    pipe = Pipeline([a, b, c])
    edits = {
        "replace": (pipe.replace("b", d), ["a", "d", "c"]),
        "insert_before": (pipe.insert_before("b", d), ["a", "d", "b", "c"]),
        "insert_after": (pipe.insert_after("b", d), ["a", "b", "d", "c"]),
        "insert_before_first": (pipe.insert_before("a", d), ["d", "a", "b", "c"]),
        "insert_after_last": (pipe.insert_after("c", d), ["a", "b", "c", "d"]),
        "remove": (pipe.remove("b"), ["a", "c"]),
        "append": (pipe.append(d), ["a", "b", "c", "d"]),
    }
    for what, (edited, names) in edits.items():
        assert isinstance(edited, Pipeline), what
        assert edited is not pipe, what
        assert edited.names == names, what
    assert pipe.names == ["a", "b", "c"]
    assert pipe.stages == (a, b, c)
    assert pipe.replace("b", d)["d"] is d


def test_replace_may_rename_and_keeps_position() -> None:
    pipe = Pipeline(stages.default_stages()).replace("microcompact", named("my_micro"))
    assert pipe.names == [
        "tool_result_budget",
        "history_snip",
        "my_micro",
        "context_collapse",
        "autocompact",
    ]


def test_duplicate_names_raise_value_error_naming_the_duplicate() -> None:
    with pytest.raises(ValueError, match=r"duplicate stage names: b$"):
        Pipeline([named("a"), named("b"), named("b")])
    pipe = Pipeline([named("a"), named("b")])
    with pytest.raises(ValueError, match=r"duplicate stage names: a$"):
        pipe.append(named("a"))
    with pytest.raises(ValueError, match=r"duplicate stage names: b$"):
        pipe.insert_before("a", named("b"))
    with pytest.raises(ValueError, match=r"duplicate stage names: a$"):
        pipe.replace("b", named("a"))
    # replacing a stage by one of the same name is not a duplicate
    assert pipe.replace("b", named("b")).names == ["a", "b"]


@pytest.mark.parametrize("op", ["replace", "insert_before", "insert_after", "remove", "getitem"])
def test_unknown_name_raises_key_error_listing_stages(op: str) -> None:
    pipe = Pipeline([named("a"), named("b")])
    with pytest.raises(KeyError) as info:
        if op == "remove":
            pipe.remove("nope")
        elif op == "getitem":
            pipe["nope"]
        else:
            getattr(pipe, op)("nope", named("c"))
    message = str(info.value)
    assert "'nope'" in message
    assert "stages are: a, b" in message


def test_non_stages_are_rejected() -> None:
    class NoName:
        async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
            return messages

    class NotCallable:
        name = "x"

    for bad in (object(), NoName(), NotCallable()):
        with pytest.raises(TypeError, match="is not a stage"):
            Pipeline([bad])  # type: ignore[list-item]


def test_a_stage_class_is_rejected_when_given_not_when_run() -> None:
    """A stage's class has its ``name`` and is callable: refused, naming the fix."""

    class Passing:
        name = "passing"

        async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
            return messages

    with pytest.raises(TypeError, match=r"Passing is a class: give a stage, Passing\(...\)"):
        Pipeline([Passing])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="is a class"):
        Pipeline([Passing()]).replace("passing", Passing)  # type: ignore[arg-type]


def test_function_stage_and_decorator() -> None:
    async def f(messages: list[Message], ctx: SessionContext) -> list[Message]:
        return messages

    wrapped = FunctionStage("f", f)
    assert wrapped.name == "f" and wrapped.fn is f and wrapped.may_break_cache is False
    assert isinstance(wrapped, Stage)

    @stage("redact", may_break_cache=True)
    async def redact(messages: list[Message], ctx: SessionContext) -> list[Message]:
        return messages

    assert isinstance(redact, FunctionStage)
    assert (redact.name, redact.may_break_cache) == ("redact", True)
    assert repr(redact) == "FunctionStage('redact')"
    with pytest.raises(ValueError, match="non-empty name"):
        FunctionStage("", f)


def test_default_stages_are_the_five_in_spec_order() -> None:
    default = stages.default_stages()
    assert [s.name for s in default] == DEFAULT_ORDER
    assert Pipeline(default).names == DEFAULT_ORDER
    assert repr(Pipeline(default)) == f"Pipeline({' → '.join(DEFAULT_ORDER)})"
    assert all(isinstance(s, Stage) for s in default)
    assert stages.default_stages() is not default  # a fresh list of fresh stages each time
    assert stages.default_stages()[0] is not default[0]


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_plain_async_functions_run_in_order(anyio_backend: str, tmp_path: Path) -> None:
    seen: list[tuple[str, int]] = []

    async def add_note(messages: list[Message], ctx: SessionContext) -> list[Message]:
        seen.append(("add_note", len(messages)))
        return [*messages, Message.user("note")]

    @stage("count")
    async def count(messages: list[Message], ctx: SessionContext) -> list[Message]:
        seen.append(("count", len(messages)))
        assert sniffio.current_async_library() == anyio_backend
        return messages

    msgs = small_conversation()
    out = await Pipeline([FunctionStage("add_note", add_note), count]).run(msgs, ctx_for(tmp_path))
    assert seen == [("add_note", 3), ("count", 4)]
    assert out[:3] == msgs and out[3].content == "note"
    assert len(msgs) == 3  # the input list is untouched
    assert out[0] is msgs[0]  # untouched messages pass by reference


@pytest.mark.anyio
async def test_a_tuple_input_is_accepted(anyio_backend: str, tmp_path: Path) -> None:
    msgs = tuple(small_conversation())
    out = await Pipeline([named("a")]).run(msgs, ctx_for(tmp_path))
    assert isinstance(out, list) and out == list(msgs)


@pytest.mark.anyio
async def test_a_raising_stage_surfaces_as_stage_error(anyio_backend: str, tmp_path: Path) -> None:
    async def boom(messages: list[Message], ctx: SessionContext) -> list[Message]:
        raise ZeroDivisionError("bad math")

    pipe = Pipeline([named("first"), FunctionStage("boom", boom), named("never")])
    with pytest.raises(StageError) as info:
        await pipe.run(small_conversation(), ctx_for(tmp_path))
    assert "'boom'" in str(info.value)
    assert "ZeroDivisionError" in str(info.value)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.anyio
@pytest.mark.parametrize("bad", [None, (), "text", {"messages": []}])
async def test_a_stage_returning_a_non_list_is_a_stage_error(
    anyio_backend: str, tmp_path: Path, bad: Any
) -> None:
    async def wrong(messages: list[Message], ctx: SessionContext) -> Any:
        return bad

    with pytest.raises(StageError, match=rf"stage 'wrong' returned {type(bad).__name__}"):
        await Pipeline([FunctionStage("wrong", wrong)]).run([], ctx_for(tmp_path))


@pytest.mark.anyio
@pytest.mark.parametrize("cls", [HistorySnip, Microcompact, ContextCollapse, Autocompact])
async def test_pass_through_stages_return_the_same_list(
    anyio_backend: str, tmp_path: Path, cls: type
) -> None:
    st = cls()
    msgs = small_conversation()
    assert await st(msgs, ctx_for(tmp_path)) is msgs
    assert await st([], ctx_for(tmp_path)) == []


@pytest.mark.anyio
async def test_default_pipeline_leaves_a_small_conversation_as_is(
    anyio_backend: str, tmp_path: Path
) -> None:
    msgs = small_conversation()
    out = await Pipeline(stages.default_stages()).run(msgs, ctx_for(tmp_path))
    assert out is msgs  # nothing to do: every stage returns its input itself


# --------------------------------------------------------------------------------------------
# Concurrency
# --------------------------------------------------------------------------------------------


def recording_stage(log: list[tuple[str, str]]) -> FunctionStage:
    async def record(messages: list[Message], ctx: SessionContext) -> list[Message]:
        tag = str(messages[0].content)
        log.append(("enter", tag))
        await anyio.sleep(0.05)
        log.append(("exit", tag))
        return messages

    return FunctionStage("record", record)


@pytest.mark.anyio
async def test_turns_of_one_session_are_serialised(anyio_backend: str, tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    pipe = Pipeline([recording_stage(log), named("after")])
    ctx = ctx_for(tmp_path)
    async with anyio.create_task_group() as tg:
        for tag in ("t1", "t2", "t3"):
            tg.start_soon(pipe.run, [Message.user(tag)], ctx)
    assert len(log) == 6
    for i in range(0, 6, 2):  # every enter is immediately followed by its own exit
        assert log[i][0] == "enter" and log[i + 1] == ("exit", log[i][1])
    assert sorted(tag for what, tag in log if what == "enter") == ["t1", "t2", "t3"]


@pytest.mark.anyio
async def test_different_sessions_run_concurrently(anyio_backend: str, tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    pipe = Pipeline([recording_stage(log)])
    async with anyio.create_task_group() as tg:
        tg.start_soon(pipe.run, [Message.user("a")], ctx_for(tmp_path, "sa"))
        tg.start_soon(pipe.run, [Message.user("b")], ctx_for(tmp_path, "sb"))
    assert [what for what, _ in log] == ["enter", "enter", "exit", "exit"]


@pytest.mark.anyio
async def test_a_cancelled_caller_runs_no_stage(anyio_backend: str, tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    pipe = Pipeline([recording_stage(log)])
    with anyio.CancelScope() as scope:
        scope.cancel()
        await pipe.run([Message.user("never")], ctx_for(tmp_path))
    assert scope.cancelled_caught and log == []


@pytest.mark.anyio
async def test_a_pass_started_from_inside_a_stage_of_the_same_session_raises(
    anyio_backend: str, tmp_path: Path
) -> None:
    """It could only wait for itself: the lock refuses it instead of hanging."""
    inner = Pipeline([named("inner")])

    async def reenter(messages: list[Message], ctx: SessionContext) -> list[Message]:
        await inner.run(messages, ctx)
        return messages

    ctx = ctx_for(tmp_path)
    with anyio.fail_after(5), pytest.raises(StageError, match="already held"):
        await Pipeline([FunctionStage("reenter", reenter)]).run([Message.user("x")], ctx)
    await inner.run([Message.user("after")], ctx)  # released on the way out


@pytest.mark.anyio
async def test_a_pass_waiting_for_the_lock_can_be_cancelled(
    anyio_backend: str, tmp_path: Path
) -> None:
    log: list[tuple[str, str]] = []
    pipe = Pipeline([recording_stage(log)])
    ctx = ctx_for(tmp_path)
    held, done = anyio.Event(), anyio.Event()

    async def other_pass() -> None:
        async with ctx.lock:  # another pass of the session holds it
            held.set()
            await done.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_pass)
        await held.wait()
        with anyio.move_on_after(0.05) as scope:
            await pipe.run([Message.user("waits")], ctx)
        done.set()
    assert scope.cancelled_caught and log == []
    await pipe.run([Message.user("after")], ctx)  # the lock was left free
    assert [what for what, _ in log] == ["enter", "exit"]


# --------------------------------------------------------------------------------------------
# Tracing and logging
# --------------------------------------------------------------------------------------------


@pytest.fixture
def spans() -> Iterator[SpanRecorder]:
    recorder = SpanRecorder()
    yield recorder
    recorder.provider.shutdown()


def _by_name(finished: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    (span,) = [s for s in finished if s.name == name]
    return span


def test_a_span_no_sdk_stands_behind_is_not_made_current(spans: SpanRecorder) -> None:
    with start_current_span(trace.NoOpTracer(), "noop") as span:
        assert span is trace.INVALID_SPAN and trace.get_current_span() is trace.INVALID_SPAN
    with spans.tracer.start_as_current_span("outer") as outer:
        with start_current_span(trace.NoOpTracer(), "noop") as span:
            # under a recorded span the no-op tracer's span carries its context: made current,
            # so that what runs inside still belongs to that trace
            assert not span.is_recording() and trace.get_current_span() is span
            assert span.get_span_context() == outer.get_span_context()
        with start_current_span(spans.tracer, "recorded", attributes={"k": 1}) as span:
            assert span.is_recording() and trace.get_current_span() is span
        with pytest.raises(ValueError), start_current_span(spans.tracer, "failed"):
            raise ValueError("secret content")
    finished = {s.name: s for s in spans.spans}
    assert set(finished) == {"outer", "recorded", "failed"}
    assert finished["recorded"].parent is not None
    assert finished["recorded"].parent.span_id == outer.get_span_context().span_id
    assert finished["recorded"].attributes == {"k": 1}
    assert finished["failed"].status.status_code is StatusCode.ERROR
    with (
        pytest.raises(ValueError),
        start_current_span(
            spans.tracer, "quiet", record_exception=False, set_status_on_exception=False
        ),
    ):
        raise ValueError("secret content")
    quiet = next(s for s in spans.spans if s.name == "quiet")
    assert not quiet.events and quiet.status.status_code is StatusCode.UNSET
    assert [e.name for e in finished["failed"].events] == ["exception"]


@pytest.mark.anyio
async def test_a_replayed_call_never_runs_in_the_callers_span(
    anyio_backend: str, tmp_path: Path, spans: SpanRecorder
) -> None:
    """Each replayed call is a trace of its own: with a library tracer that records nothing,
    what runs inside a call (a stage, a log line's trace ids) still does not see the span of
    the application that runs the replay."""
    from pipeline.transcript.replay import replay_messages

    seen: list[trace.SpanContext] = []

    async def look(messages: list[Message], ctx: SessionContext) -> list[Message]:
        seen.append(trace.get_current_span().get_span_context())
        return messages

    history = [user_text("go")]
    for t in range(3):
        history += [assistant(f"r{t}", tool_use(f"t{t}")), results(tool_result(f"t{t}", "x"))]
    ctx = ctx_for(tmp_path, tracer=trace.NoOpTracer())
    with spans.tracer.start_as_current_span("application"):
        calls = [r async for r in replay_messages(history, Pipeline([stage("look")(look)]), ctx)]
    assert len(calls) == len(seen) == 3
    assert not any(s.is_valid for s in seen)


@pytest.mark.anyio
async def test_spans_for_a_run_and_each_stage(
    anyio_backend: str,
    tmp_path: Path,
    spans: SpanRecorder,
) -> None:
    exporter = spans

    @stage("keep_last", may_break_cache=True)
    async def keep_last(messages: list[Message], ctx: SessionContext) -> list[Message]:
        return messages[-1:]

    # reference estimate, no usage anywhere: round(len / 4) per text block
    msgs = [
        Message(type="progress"),  # never counted
        Message.user("x" * 400),  # 100 tokens
        Message.assistant([{"type": "text", "text": "y" * 40}], message_id="m1"),  # 10
        Message.user("z" * 80),  # 20
    ]
    pipe = Pipeline([named("first"), keep_last, named("last")])
    ctx = ctx_for(tmp_path, "conv-42", tracer=spans.tracer, token_tracker=TokenTracker("reference"))
    out = await pipe.run(msgs, ctx)
    assert out == msgs[-1:]

    finished = exporter.get_finished_spans()
    assert sorted(s.name for s in finished) == sorted(
        ["pipeline.run", "stage.first", "stage.keep_last", "stage.last"]
    )
    run = _by_name(finished, "pipeline.run")
    assert run.parent is None
    assert run.instrumentation_scope is not None
    assert run.instrumentation_scope.name == "sluicegate"
    assert dict(run.attributes or {}) == {
        ATTR.CONVERSATION_ID: "conv-42",
        ATTR.MESSAGES_IN: 4,
        ATTR.MESSAGES_OUT: 1,
        ATTR.TOKENS_BEFORE: 130,
        ATTR.TOKENS_AFTER: 20,
    }
    assert "gen_ai.operation.name" not in (run.attributes or {})

    children = sorted(
        (s for s in finished if s.parent is not None), key=lambda s: s.start_time or 0
    )
    assert [s.name for s in children] == ["stage.first", "stage.keep_last", "stage.last"]
    for child in children:
        assert child.parent is not None
        assert child.parent.span_id == run.context.span_id
        assert child.context.trace_id == run.context.trace_id
        assert (child.attributes or {})[ATTR.CONVERSATION_ID] == "conv-42"
        assert child.status.status_code is StatusCode.UNSET
    first, middle, last = (dict(c.attributes or {}) for c in children)
    assert (first[ATTR.STAGE], first[ATTR.STAGE_CHANGED], first[ATTR.MESSAGES_OUT]) == (
        "first",
        False,
        4,
    )
    assert (middle[ATTR.STAGE_CHANGED], middle[ATTR.MESSAGES_OUT]) == (True, 1)
    assert (middle[ATTR.BREAKS_CACHE], first[ATTR.BREAKS_CACHE]) == (True, False)
    assert last[ATTR.MESSAGES_OUT] == 1


@pytest.mark.anyio
async def test_spans_of_the_default_pipeline(
    anyio_backend: str,
    tmp_path: Path,
    spans: SpanRecorder,
) -> None:
    exporter = spans
    ctx = ctx_for(tmp_path, tracer=spans.tracer)
    await Pipeline(stages.default_stages()).run(small_conversation(), ctx)
    finished = exporter.get_finished_spans()
    run = _by_name(finished, "pipeline.run")
    children = sorted(
        (s for s in finished if s.parent is not None and s.parent.span_id == run.context.span_id),
        key=lambda s: s.start_time or 0,
    )
    assert [s.name for s in children] == [f"stage.{n}" for n in DEFAULT_ORDER]


@pytest.mark.anyio
async def test_failing_stage_marks_spans_without_leaking_content(
    anyio_backend: str,
    tmp_path: Path,
    spans: SpanRecorder,
) -> None:
    exporter = spans
    secret = "SECRET-user-text-4711"

    @stage("leaky")
    async def leaky(messages: list[Message], ctx: SessionContext) -> list[Message]:
        raise ValueError(f"could not handle {secret}")

    ctx = ctx_for(tmp_path, tracer=spans.tracer)
    with pytest.raises(StageError, match=secret):  # the exception itself may say it
        await Pipeline([leaky]).run([Message.user(secret)], ctx)

    finished = exporter.get_finished_spans()
    assert {s.name for s in finished} == {"pipeline.run", "stage.leaky"}
    for s in finished:
        assert s.status.status_code is StatusCode.ERROR
        dumped = s.to_json()
        assert secret not in dumped, f"span {s.name} carries message content"
    assert _by_name(finished, "stage.leaky").status.description == "ValueError"


@pytest.mark.anyio
async def test_log_events_carry_the_current_trace_and_span_ids(
    anyio_backend: str,
    tmp_path: Path,
    spans: SpanRecorder,
) -> None:
    exporter = spans
    inside: list[trace.SpanContext] = []

    @stage("chatty")
    async def chatty(messages: list[Message], ctx: SessionContext) -> list[Message]:
        inside.append(trace.get_current_span().get_span_context())
        ctx.logger.info("inside_stage", n=len(messages))
        return messages

    with structlog.testing.capture_logs() as logs:
        ctx = ctx_for(tmp_path, "log-session", tracer=spans.tracer)
        await Pipeline([chatty]).run(small_conversation(), ctx)
        ctx.logger.info("outside_any_span")

    stage_span = _by_name(exporter.get_finished_spans(), "stage.chatty")
    assert inside == [stage_span.context]
    (event,) = [e for e in logs if e["event"] == "inside_stage"]
    assert event["trace_id"] == format(stage_span.context.trace_id, "032x")
    assert event["span_id"] == format(stage_span.context.span_id, "016x")
    assert event["session_id"] == "log-session" and event["n"] == 3
    (outside,) = [e for e in logs if e["event"] == "outside_any_span"]
    assert "trace_id" not in outside and "span_id" not in outside


# --------------------------------------------------------------------------------------------
# Who may edit which list: stages keep their output, the caller owns what run returns
# --------------------------------------------------------------------------------------------


def _persisting_turns(first: int, last: int) -> list[Message]:
    """Turns whose parallel results overflow a small budget (so the budget's output is its
    own list)."""
    out: list[Message] = [user_text("start")] if first == 0 else []
    for t in range(first, last):
        out += [
            assistant(f"r{t}", tool_use(f"t{t}a"), tool_use(f"t{t}b")),
            results(tool_result(f"t{t}a", "a" * 4_000), tool_result(f"t{t}b", "b" * 4_000)),
        ]
    return out


def _budget_ctx(tmp_path: Path) -> SessionContext:
    return SessionContext("owned", tmp_path / "store", store=MemoryStore())


async def _reference(history: list[Message], tmp_path: Path) -> list[Message]:
    fresh = SessionContext("reference", tmp_path / "ref", store=MemoryStore())
    return await Pipeline([stages.ToolResultBudget(limit=6_000)]).run(history, fresh)


@pytest.mark.anyio
async def test_a_stage_that_edits_its_input_cannot_corrupt_what_an_earlier_stage_keeps(
    anyio_backend: str, tmp_path: Path
) -> None:
    """A stage without ``readonly_input`` gets a copy: its in-place edit reaches the requests
    after it, never the budget's kept output (which would otherwise carry the edit into the
    next pass, where no stage made it)."""
    budget = stages.ToolResultBudget(limit=6_000)
    vandal_text = "edited in place"

    @stage("vandal")
    async def vandal(messages: list[Message], ctx: SessionContext) -> list[Message]:
        for i, m in enumerate(messages):
            messages[i] = Message.user(vandal_text, uuid=m.uuid)
        return messages

    ctx = _budget_ctx(tmp_path)
    history = _persisting_turns(0, 4)
    out = await Pipeline([budget, vandal]).run(history, ctx)
    assert ctx.report.persisted, "the budget must act for its output to be its own list"
    assert all(m.content == vandal_text for m in out)  # the edit applies where it was made

    history += _persisting_turns(4, 6)
    again = await Pipeline([budget]).run(history, ctx)  # the same budget cache, no vandal
    assert not any(m.content == vandal_text for m in again)
    assert_same_messages(again, await _reference(history, tmp_path))


@pytest.mark.anyio
async def test_the_caller_owns_the_list_run_returns(anyio_backend: str, tmp_path: Path) -> None:
    """What ``run`` returns is the caller's: vandalising it changes nothing in the next pass,
    and a later pass (which extends the stages' kept lists in place) never changes it."""
    pipe = Pipeline([stages.ToolResultBudget(limit=6_000)])
    ctx = _budget_ctx(tmp_path)
    history = _persisting_turns(0, 3)
    first = await pipe.run(history, ctx)
    assert first is not history and ctx.report.persisted
    kept = list(first)

    history += _persisting_turns(3, 5)
    second = await pipe.run(history, ctx)
    assert first == kept  # the next pass did not grow or patch the caller's list
    second.clear()
    second.append(user_text("the caller's own edit"))

    history += _persisting_turns(5, 7)
    third = await pipe.run(history, ctx)
    assert_same_messages(third, await _reference(history, tmp_path))


@pytest.mark.anyio
async def test_readonly_stages_get_the_list_itself_and_others_a_copy(
    anyio_backend: str, tmp_path: Path
) -> None:
    seen: dict[str, list[Message]] = {}

    @stage("plain")
    async def plain(messages: list[Message], ctx: SessionContext) -> list[Message]:
        seen["plain"] = messages
        return messages  # untouched: the pipeline hands on the list it was given

    class Trusting:
        name = "trusting"
        readonly_input = True

        async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
            seen["trusting"] = messages
            return messages

    @stage("promised", readonly_input=True)
    async def promised(messages: list[Message], ctx: SessionContext) -> list[Message]:
        seen["promised"] = messages
        return messages

    history = small_conversation()
    out = await Pipeline([plain, Trusting(), promised]).run(history, ctx_for(tmp_path))
    assert seen["plain"] is not history and seen["plain"] == history
    assert seen["trusting"] is history  # the copy, returned untouched, was not handed on
    assert seen["promised"] is history
    assert out is history
    for st in stages.default_stages():
        assert getattr(st, "readonly_input", False) is True, st.name


@pytest.mark.anyio
async def test_shared_run_returns_the_stages_own_list(anyio_backend: str, tmp_path: Path) -> None:
    """``shared=True`` skips the caller's copy: the list is the one the stages keep, brought up
    to date in place by the next pass (so read it before then)."""
    pipe = Pipeline([stages.ToolResultBudget(limit=6_000)])
    ctx = _budget_ctx(tmp_path)
    history = _persisting_turns(0, 2)
    first = await pipe.run(history, ctx, shared=True)
    history += _persisting_turns(2, 3)
    second = await pipe.run(history, ctx, shared=True)
    assert second is first and len(first) == len(history)  # grown in place
    assert_same_messages(second, await _reference(history, tmp_path))
    history += _persisting_turns(3, 4)
    copied = await pipe.run(history, ctx)
    assert copied is not first and copied == first


@pytest.mark.anyio
async def test_a_held_output_is_copied_only_by_a_pass_that_overlaps(
    anyio_backend: str, tmp_path: Path
) -> None:
    """``ctx.hold``: the holder reads the list as it was handed out; no copy is made unless
    another pass on the context starts while it is held, and none after it is released."""
    pipe = Pipeline([stages.ToolResultBudget(limit=6_000)])
    ctx = _budget_ctx(tmp_path)
    history = _persisting_turns(0, 2)
    out = await pipe.run(history, ctx, shared=True)
    held = ctx.hold(out)
    assert held.messages is out  # nothing overlapped: no copy
    snapshot = list(out)
    history += _persisting_turns(2, 3)
    await pipe.run(history, ctx, shared=True)  # overlaps: brings ``out`` up to date in place
    assert held.messages is not out and held.messages == snapshot and out != snapshot
    released = ctx.hold(out)
    released.release()
    history += _persisting_turns(3, 4)
    await pipe.run(history, ctx, shared=True)
    assert released.messages is out  # let go: never copied
