"""Stages and the pipeline that runs them in order, with a span per pass and per stage."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from opentelemetry.trace import Status, StatusCode

from pipeline.context import SessionContext
from pipeline.messages import Message
from pipeline.tracing import (
    ATTR,
    SPAN_PIPELINE_RUN,
    span_if,
    stage_span_name,
    start_current_span,
)

__all__ = [
    "FunctionStage",
    "Pipeline",
    "PipelineHalt",
    "Stage",
    "StageError",
    "rereading_stages",
    "stage",
]

StageFn = Callable[[list[Message], SessionContext], Awaitable[list[Message]]]


@runtime_checkable
class Stage(Protocol):
    """A named async step: messages in, messages out.

    A stage never mutates its input; untouched messages pass through by reference. A stage may
    set ``may_break_cache = True`` when it can change content the model has already seen.

    The list a stage returns is read-only for whoever receives it, and valid until the stage's
    next pass on the same session: the library's stages keep their output and extend it in
    place on the next pass, so that a history that only grew costs what is new rather than a
    copy of the whole list per stage. :meth:`Pipeline.run` hands its caller a list of its own.
    A stage that sets ``readonly_input = True`` promises never to mutate its input list (the
    library's stages do); any other stage is given a copy, so that a stage that edits its
    input in place cannot corrupt what an earlier stage keeps. A stage that sets
    ``rereads_outputs = False`` promises that a later pass never reads a tool output it has
    already met, nor any other long text of a message it has met (a tool call's input value, a
    text, a thinking block, an image's data): a replay may then put outputs back in their
    file, a proxy leave those texts in the requests that carry them
    (:func:`rereading_stages`). A reader that may meet one anyway gets its text with ``str()``
    or :func:`pipeline.wire.deferred.resolved`, which read it back.
    """

    name: str

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        """Return the projected messages."""
        ...


class StageError(RuntimeError):
    """A stage raised or returned something that is not a message list; names the stage.
    ``stage``: its name; ``cause``: the type of what it raised (or returned), which, unlike
    the message, never holds content."""

    def __init__(self, message: str, *, stage: str = "", cause: str = "") -> None:
        super().__init__(message)
        self.stage = stage
        self.cause = cause


class PipelineHalt(RuntimeError):
    """A stage's deliberate refusal to let this request go (e.g. the context is over the
    blocking limit). Passed through unwrapped, so callers can catch it by type."""


class FunctionStage:
    """Adapter: a plain ``async def f(messages, ctx)`` becomes a named stage."""

    def __init__(
        self,
        name: str,
        fn: StageFn,
        *,
        may_break_cache: bool = False,
        readonly_input: bool = False,
    ) -> None:
        if not name:
            raise ValueError("a stage needs a non-empty name")
        self.name = name
        self.fn = fn
        self.may_break_cache = may_break_cache
        self.readonly_input = readonly_input

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        return await self.fn(messages, ctx)

    def __repr__(self) -> str:
        return f"FunctionStage({self.name!r})"


def _reads_input_only(st: object) -> bool:
    """Whether ``st`` promised never to mutate its input list (``readonly_input = True``)."""
    return getattr(st, "readonly_input", False) is True


def stage(
    name: str, *, may_break_cache: bool = False, readonly_input: bool = False
) -> Callable[[StageFn], FunctionStage]:
    """Decorator form of :class:`FunctionStage`: ``@stage("redact")``; ``readonly_input=True``
    when the function never edits the list it is given (it then gets that list, not a copy)."""

    def wrap(fn: StageFn) -> FunctionStage:
        return FunctionStage(
            name, fn, may_break_cache=may_break_cache, readonly_input=readonly_input
        )

    return wrap


class Pipeline:
    """An ordered, immutable list of stages. Editing methods return a new pipeline.

    ``repr`` shows the order: ``Pipeline(tool_result_budget → history_snip → ...)``.
    """

    def __init__(self, stages: Iterable[Stage]) -> None:
        self._stages: tuple[Stage, ...] = tuple(stages)
        for s in self._stages:
            if isinstance(s, type):  # its class attributes look like a stage's
                raise TypeError(f"{s.__name__} is a class: give a stage, {s.__name__}(...)")
            if not isinstance(getattr(s, "name", None), str) or not callable(s):
                raise TypeError(f"{s!r} is not a stage (needs a str .name and async __call__)")
        names = [s.name for s in self._stages]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate stage names: {', '.join(dupes)}")

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages, in order."""
        return self._stages

    @property
    def names(self) -> list[str]:
        """The stage names, in order."""
        return [s.name for s in self._stages]

    def __getitem__(self, name: str) -> Stage:
        return self._stages[self._index(name)]

    def __len__(self) -> int:
        return len(self._stages)

    def __repr__(self) -> str:
        return f"Pipeline({' → '.join(self.names)})"

    def _index(self, name: str) -> int:
        for i, s in enumerate(self._stages):
            if s.name == name:
                return i
        raise KeyError(f"no stage named {name!r}; stages are: {', '.join(self.names)}")

    def replace(self, name: str, new: Stage) -> Pipeline:
        """Swap the stage called ``name`` for ``new`` (which may carry another name)."""
        i = self._index(name)
        return Pipeline((*self._stages[:i], new, *self._stages[i + 1 :]))

    def insert_before(self, name: str, new: Stage) -> Pipeline:
        """Insert ``new`` right before the stage called ``name``."""
        i = self._index(name)
        return Pipeline((*self._stages[:i], new, *self._stages[i:]))

    def insert_after(self, name: str, new: Stage) -> Pipeline:
        """Insert ``new`` right after the stage called ``name``."""
        i = self._index(name)
        return Pipeline((*self._stages[: i + 1], new, *self._stages[i + 1 :]))

    def append(self, new: Stage) -> Pipeline:
        """Add ``new`` at the end."""
        return Pipeline((*self._stages, new))

    def remove(self, name: str) -> Pipeline:
        """Drop the stage called ``name``."""
        i = self._index(name)
        return Pipeline((*self._stages[:i], *self._stages[i + 1 :]))

    async def run(
        self, messages: Sequence[Message], ctx: SessionContext, *, shared: bool = False
    ) -> list[Message]:
        """Run every stage in order on ``messages`` for one turn of ``ctx``'s session.

        Turns of one session are serialised on ``ctx.lock`` (do not call ``run`` from inside a
        stage with the same context). A caller whose anyio cancel scope is cancelled stops
        before the pass starts (a bare asyncio ``task.cancel()`` lands at the pass's first await
        that yields); an uncontended pass does not yield to the event loop unless a stage awaits
        something that does (a store write, a summariser).

        Returns the projected messages, a list the caller owns (or ``messages`` itself when no
        stage changed anything); the input is untouched.
        ``shared=True`` returns the last stage's own list instead of a copy of it, for a caller
        that only reads it before the next pass of the session (the list changes in place on
        that pass: never pass it back as the next input, and to read it after an await another
        pass may run in, :meth:`~pipeline.context.SessionContext.hold` it): one copy of the
        history less per call.

        The stages see what the API will see: the records from the last compact boundary (or
        compact summary) on, the boundary included; what lies before it is never sent, so no
        stage decides anything about it.
        """
        current = messages if isinstance(messages, list) else list(messages)
        async with ctx.lock:  # a cancelled caller stops here; an uncontended pass never waits
            ctx.copy_held()  # before anything here changes a list a caller holds
            own = current if not ctx.thread_start(current) else None  # the caller's list
            if own is None:  # what follows the last compaction: a list the context keeps
                current = ctx.thread_start.tail
            ctx.begin_pass(current)
            # The SDK's default exception handling would put the exception text (which may
            # quote message content) into the span's status and an event: set the status here.
            with start_current_span(
                ctx.tracer,
                SPAN_PIPELINE_RUN,
                attributes={**ctx.span_attributes(), ATTR.MESSAGES_IN: len(current)},
                record_exception=False,
                set_status_on_exception=False,
            ) as run_span:
                ctx.report.recording = recording = run_span.is_recording()
                if recording:
                    estimate = ctx.token_tracker.estimate(current)
                    run_span.set_attribute(ATTR.TOKENS_BEFORE, estimate)
                try:
                    for st in self._stages:
                        current = await self._run_stage(st, current, ctx)
                except Exception as exc:
                    run_span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                    raise
                run_span.set_attribute(ATTR.MESSAGES_OUT, len(current))
                ctx.report.estimated_tokens = ctx.size_of(current)
                run_span.set_attribute(ATTR.TOKENS_AFTER, ctx.report.estimated_tokens)
        # a stage's output is kept (and extended in place) by that stage: one copy for the caller
        return current if shared or current is own else list(current)

    @staticmethod
    async def _run_stage(st: Stage, messages: list[Message], ctx: SessionContext) -> list[Message]:
        recording = ctx.report.recording
        with span_if(
            recording,
            ctx.tracer,
            stage_span_name(st.name),
            # built only for a span that records: a pass runs every stage
            attributes={
                **ctx.span_attributes(),
                ATTR.STAGE: st.name,
                ATTR.BREAKS_CACHE: bool(getattr(st, "may_break_cache", False)),
            }
            if recording
            else None,
            # exception text may quote message content: never let the SDK record it
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            given = messages if _reads_input_only(st) else list(messages)
            try:
                out = await st(given, ctx)
                if out is not messages and out is given and given == messages:
                    # its copy, untouched (identity sweep): hand on the list itself, so that
                    # later stages see no change and reuse their work
                    out = messages
            except PipelineHalt as exc:
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                raise
            except Exception as exc:
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                raise StageError(
                    f"stage {st.name!r} failed: {type(exc).__name__}: {exc}",
                    stage=st.name,
                    cause=type(exc).__name__,
                ) from exc
            if not isinstance(out, list):
                span.set_status(Status(StatusCode.ERROR, "StageError"))
                raise StageError(
                    f"stage {st.name!r} returned {type(out).__name__}, expected list[Message]",
                    stage=st.name,
                    cause=type(out).__name__,
                )
            span.set_attribute(ATTR.STAGE_CHANGED, out is not messages)
            span.set_attribute(ATTR.MESSAGES_OUT, len(out))
        return out


def rereading_stages(pipeline: Pipeline) -> list[str]:
    """The stages of ``pipeline`` that may read a tool output (or another long text of a
    message) again on a later pass (their ``rereads_outputs`` is not False): such texts must
    stay in memory under them."""
    return [s.name for s in pipeline.stages if getattr(s, "rereads_outputs", True) is not False]
