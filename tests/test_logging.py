"""Library-grade logging: events reach the application's stdlib ``logging`` (never stdout), with
trace ids and call numbers; an application's own structlog set-up is respected; the command line
prints readable or JSON lines on stderr and leaves nothing installed behind it.

structlog's configuration is process-global and other tests change it (``capture_logs`` leaves
it "configured"): the scenario of an untouched interpreter runs in a subprocess, and the
in-process tests reset and restore it around themselves.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

from pipeline import Message, Usage
from pipeline._cli.app import main
from pipeline.context import SessionContext
from pipeline.core import Pipeline
from pipeline.logs import LOGGER_NAME, get_logger
from pipeline.testing import MemoryStore, SpanRecorder
from pipeline.transcript.replay import replay_messages
from stages.tool_result_budget import ToolResultBudget
from tests.cli_support import clean_env, parse_json_lines, run_cli

REPO = Path(__file__).resolve().parents[1]
EVENT = "tool_result_budget.decision"
SESSION = "log-session"

# ---------------------------------------------------------------------------------------------
# the scenario: one recorded session whose second call persists "a" and keeps "b"
# ---------------------------------------------------------------------------------------------


def session_messages() -> list[Message]:
    """Call 0 sees the prompt only; call 1 sees two 40,000-char results over a 50,000 budget:
    the larger one ("a") is persisted (an info event) and "b" is kept (a debug event); when the
    store fails, "a" is kept whole (a warning) and so is "b"."""
    uses = [
        {"type": "tool_use", "id": tid, "name": "Bash", "input": {"command": "x"}}
        for tid in ("a", "b")
    ]
    results = [
        {"type": "tool_result", "tool_use_id": tid, "content": tid * size}
        for tid, size in (("a", 41_000), ("b", 40_000))
    ]
    usage = Usage(input_tokens=100, output_tokens=10)
    return [
        Message.user("go"),
        Message.assistant(uses, message_id="r1", usage=usage, model="claude-test"),
        Message.user(results),
        Message.assistant([{"type": "text", "text": "done"}], message_id="r2", usage=usage),
    ]


async def replay_session(ctx: SessionContext) -> None:
    """Replay :func:`session_messages` through a 50,000-char budget."""
    pipe = Pipeline([ToolResultBudget(limit=50_000)])
    async for _ in replay_messages(session_messages(), pipe, ctx):
        pass


def run_failing_session(root: str) -> None:
    """The subprocess's scenario: the persist of "a" fails, the budget logs a warning."""
    ctx = SessionContext(SESSION, root, store=MemoryStore(failing={"a"}))
    anyio.run(replay_session, ctx)
    assert ctx.report.persist_failed == ["a"]


class Collect(logging.Handler):
    """A handler that keeps the records it is given (its level filters them, as any)."""

    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def events(self, name: str = EVENT) -> list[logging.LogRecord]:
        return [r for r in self.records if getattr(r, "event", None) == name]


@pytest.fixture
def root_collector() -> Iterator[tuple[Collect, Collect]]:
    """The application's logging set-up: the root logger at DEBUG with two handlers, one
    taking everything and one taking warnings and above."""
    root = logging.getLogger()
    everything, warnings = Collect(), Collect(logging.WARNING)
    saved_level = root.level
    root.setLevel(logging.DEBUG)
    root.addHandler(everything)
    root.addHandler(warnings)
    try:
        yield everything, warnings
    finally:
        root.removeHandler(everything)
        root.removeHandler(warnings)
        root.setLevel(saved_level)


@contextlib.contextmanager
def library_records() -> Iterator[Collect]:
    """The library logger's records at DEBUG, kept by one handler alone (not propagated: as the
    command line has it, whose handler formats them alone). Entered in the test itself: pytest
    puts its capturing handlers on a logger that does not propagate when the test starts."""
    library = logging.getLogger(LOGGER_NAME)
    keep, level, propagate = Collect(), library.level, library.propagate
    library.addHandler(keep)
    library.setLevel(logging.DEBUG)
    library.propagate = False
    try:
        yield keep
    finally:
        library.removeHandler(keep)
        library.setLevel(level)
        library.propagate = propagate


# ---------------------------------------------------------------------------------------------
# (a) an application that configured nothing
# ---------------------------------------------------------------------------------------------

_UNCONFIGURED = textwrap.dedent(
    """
    import logging, sys
    import structlog
    from tests.test_logging import run_failing_session
    if sys.argv[2] == "tagged":
        # the last-resort handler, made recognisable: every line must come through it
        tagged = logging.StreamHandler(sys.stderr)
        tagged.setFormatter(logging.Formatter("LAST-RESORT %(levelname)s %(message)s"))
        logging.lastResort = tagged
    run_failing_session(sys.argv[1])
    # the library configured nothing on its way
    assert logging.getLogger().handlers == [], logging.getLogger().handlers
    assert logging.getLogger("sluicegate").handlers == []
    assert not structlog.is_configured()
    """
)


@pytest.mark.parametrize("last_resort", ["plain", "tagged"])
def test_unconfigured_application_gets_warnings_on_stderr_and_nothing_on_stdout(
    tmp_path: Path, last_resort: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _UNCONFIGURED, str(tmp_path), last_resort],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=clean_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    # the warning alone: the debug event that keeps "b" is below the last resort's WARNING
    (line,) = proc.stderr.splitlines()
    prefix = "LAST-RESORT WARNING " if last_resort == "tagged" else ""
    assert line.startswith(f"{prefix}{EVENT} "), line
    assert "decision=persist_failed" in line and "tool_use_id=a" in line
    assert f"session_id={SESSION}" in line and "call=1" in line
    assert "ENOSPC" in line  # the error says which failure it was
    assert "a" * 100 not in line  # never the result's content


# ---------------------------------------------------------------------------------------------
# (b) an application that configured stdlib logging
# ---------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("structlog_unconfigured")
def test_events_reach_the_applications_handlers_with_fields_ids_and_call(
    tmp_path: Path, root_collector: tuple[Collect, Collect]
) -> None:
    everything, warnings = root_collector
    spans = SpanRecorder()
    ctx = SessionContext(SESSION, tmp_path, store=MemoryStore(), tracer=spans.tracer)
    anyio.run(replay_session, ctx)

    (persist,) = [r for r in everything.events() if r.__dict__["decision"] == "persist"]
    assert persist.name == LOGGER_NAME and persist.levelno == logging.INFO
    fields = persist.__dict__
    assert fields["tool_use_id"] == "a" and fields["chars"] == 41_000
    assert fields["session_id"] == SESSION and fields["call"] == 1
    assert fields["path"] == "/mem/a.txt"
    # a formatter that shows only the message still shows the event and its fields
    message = persist.getMessage()
    assert message.startswith(f"{EVENT} ") and "tool_use_id=a" in message and "call=1" in message
    # the ids of the span current when the event was logged, inside the call's pass
    contexts = {(s.context.trace_id, s.context.span_id): s for s in spans.spans}
    key = (int(fields["trace_id"], 16), int(fields["span_id"], 16))
    assert key in contexts, "trace_id/span_id name no span of the pass"
    (run,) = [s for s in spans.named("pipeline.run") if s.context.trace_id == key[0]]
    assert run.end_time is not None
    # the caller is the stage, not structlog's machinery
    assert persist.pathname.endswith("tool_result_budget.py")

    # debug events are produced when the application asks for them...
    (keep,) = [r for r in everything.events() if r.__dict__["decision"] == "keep"]
    assert keep.levelno == logging.DEBUG and keep.__dict__["tool_use_id"] == "b"
    # ...and the application's handler levels decide: the WARNING one got none of them
    assert [r for r in warnings.records if r.name.startswith(LOGGER_NAME)] == []


@pytest.mark.usefixtures("structlog_unconfigured")
def test_events_outside_a_span_have_no_ids_and_reserved_names_do_not_break_logging(
    root_collector: tuple[Collect, Collect],
) -> None:
    everything, _ = root_collector
    get_logger(session_id="s").warning("plain.event", name="clash", message="m", count=2)
    (record,) = everything.events("plain.event")
    assert "trace_id" not in record.__dict__ and "span_id" not in record.__dict__
    # LogRecord attributes cannot be set by ``extra``: such fields arrive renamed
    assert record.name == LOGGER_NAME
    assert record.__dict__["name_"] == "clash" and record.__dict__["message_"] == "m"
    assert record.__dict__["count"] == 2


@pytest.mark.usefixtures("structlog_unconfigured")
def test_a_disabled_event_formats_nothing(root_collector: tuple[Collect, Collect]) -> None:
    everything, _ = root_collector
    rendered: list[str] = []

    class Watched:
        def __repr__(self) -> str:
            rendered.append("repr")
            return "watched"

    library = logging.getLogger(LOGGER_NAME)
    saved = library.level
    library.setLevel(logging.WARNING)  # what an application that sets no level gets
    try:
        log = get_logger(session_id="s")
        log.debug("quiet.debug", value=Watched())
        log.info("quiet.info", value=Watched())
        assert rendered == [] and everything.events("quiet.debug") == []
        log.warning("loud.warning", value=Watched())  # the check above is not vacuous
        assert rendered == ["repr"] and len(everything.events("loud.warning")) == 1
    finally:
        library.setLevel(saved)


# ---------------------------------------------------------------------------------------------
# (c) an application that configured structlog
# ---------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("structlog_unconfigured")
def test_an_applications_structlog_configuration_gets_the_events(
    tmp_path: Path, root_collector: tuple[Collect, Collect]
) -> None:
    everything, _ = root_collector
    captured = structlog.testing.LogCapture()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, captured],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    spans = SpanRecorder()
    ctx = SessionContext(SESSION, tmp_path, store=MemoryStore(), tracer=spans.tracer)
    anyio.run(replay_session, ctx)

    decisions = [e for e in captured.entries if e["event"] == EVENT]
    # the application's own level filter applies: the debug "keep" is not there
    assert [e["decision"] for e in decisions] == ["persist"]
    (event,) = decisions
    assert event["log_level"] == "info" and event["tool_use_id"] == "a"
    assert event["session_id"] == SESSION and event["call"] == 1
    trace_ids = {format(s.context.trace_id, "032x") for s in spans.spans}
    assert event["trace_id"] in trace_ids
    # nothing went around the application's configuration to stdlib logging
    assert [r for r in everything.records if r.name.startswith(LOGGER_NAME)] == []


# ---------------------------------------------------------------------------------------------
# (d) the command line
# ---------------------------------------------------------------------------------------------

_READABLE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z \[(debug|info|warning|error)\s*\] [a-z_.]+( |$)"
)


@pytest.mark.parametrize("replay", [False, True], ids=["live", "replay"])
def test_cli_verbose_lines_are_readable_and_on_stderr_only(tmp_path: Path, replay: bool) -> None:
    proc = run_cli("demo", *(["--replay"] if replay else []), "-v", "--store", tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert any(EVENT in line for line in lines)
    for line in lines:
        assert _READABLE.match(line), f"not a readable log line: {line!r}"
        assert "\x1b" not in line  # not a terminal: no colours
    # stdout holds the table and nothing of the log
    assert any(line.split()[:2] == ["call", "message_id"] for line in proc.stdout.splitlines())
    assert EVENT not in proc.stdout and "[info" not in proc.stdout
    if replay:
        decided = [line for line in lines if EVENT in line]
        assert decided and all(re.search(r" call=\d+ ", line) for line in decided)


def test_cli_json_log_lines_carry_event_level_and_the_call_of_the_decision(
    tmp_path: Path,
) -> None:
    proc = run_cli("demo", "--replay", "--json", "-v", "--log-json", "--store", tmp_path)
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.strip()]
    assert events and all({"event", "level", "timestamp"} <= e.keys() for e in events)
    assert {e["level"] for e in events} <= {"info", "warning", "error"}  # -v: no debug
    calls, _summary = parse_json_lines(proc.stdout)
    persisted_in = {p["tool_use_id"]: c["call"] for c in calls for p in c["persisted"]}
    logged_in = {e["tool_use_id"]: e["call"] for e in events if e["event"] == EVENT}
    # each persist is logged under the call whose request it changed
    assert persisted_in and logged_in == persisted_in


def test_cli_log_level_follows_the_v_flags(tmp_path: Path) -> None:
    proc = run_cli("demo", "--replay", "--json", "-vv", "--log-json", "--store", tmp_path / "a")
    assert proc.returncode == 0, proc.stderr
    levels = {json.loads(line)["level"] for line in proc.stderr.splitlines() if line.strip()}
    assert "debug" in levels  # -vv
    quiet = run_cli("demo", "--replay", "--json", "--log-json", "--store", tmp_path / "b")
    assert quiet.returncode == 0 and quiet.stderr == ""  # nothing at WARNING in the demo


# ---------------------------------------------------------------------------------------------
# (e) main() in-process leaves nothing installed
# ---------------------------------------------------------------------------------------------


def _logging_state() -> tuple[Any, ...]:
    library = logging.getLogger(LOGGER_NAME)
    root = logging.getLogger()
    return (list(library.handlers), library.level, library.propagate, list(root.handlers))


@pytest.mark.usefixtures("structlog_unconfigured")
@pytest.mark.parametrize("app_structlog", [False, True], ids=["unconfigured", "configured"])
def test_main_twice_in_process_leaves_no_handler_and_restores_structlog(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], app_structlog: bool
) -> None:
    captured = structlog.testing.LogCapture()
    if app_structlog:
        structlog.configure(processors=[captured])
    before = _logging_state()
    for run in range(2):
        capsys.readouterr()
        args = ["demo", "--replay", "--json", "-v", "--log-json", "--store", tmp_path / str(run)]
        assert main([str(a) for a in args]) == 0
        err = capsys.readouterr().err
        events = [json.loads(line) for line in err.splitlines() if line.strip()]
        # printed once, on this run's stderr: no handler of an earlier run is left to repeat it
        assert [e["event"] for e in events].count("replay.start") == 1
        assert _logging_state() == before
    assert structlog.is_configured() is app_structlog
    if app_structlog:
        assert structlog.get_config()["processors"] == [captured]
        assert captured.entries == []  # the command's events went to its own stderr


def test_json_lines_take_every_line_on_stderr_and_give_the_loggers_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Under ``--log-json`` every stderr line is JSON: uvicorn's and the event loop's lines
    (and uvicorn's own handler, left by a readable run earlier in the process, is set aside),
    other libraries' records, Python's warnings and the command's own notices; afterwards
    the loggers and the warnings hook are as they were."""
    import warnings

    from pipeline._cli.logging_setup import SERVER_LOGGERS, configure_logging, say

    uvicorn_log = logging.getLogger("uvicorn")
    earlier = logging.StreamHandler(sys.stderr)  # what uvicorn's own configuration leaves
    propagated = uvicorn_log.propagate
    uvicorn_log.addHandler(earlier)
    uvicorn_log.propagate = False
    loggers = [logging.getLogger(name) for name in (*SERVER_LOGGERS, "")]
    before = [(list(lg.handlers), lg.propagate) for lg in loggers]
    hook = warnings.showwarning
    try:
        restore = configure_logging(0, json_lines=True)
        try:
            logging.getLogger("uvicorn.error").error("ASGI callable returned without completing")
            logging.getLogger("asyncio").warning("socket.accept() out of system resource")
            logging.getLogger("urllib3.connectionpool").warning("Connection pool is full")
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.warn("a coroutine was never awaited", RuntimeWarning, stacklevel=1)
            say("sluicegate: warning: 3 of 3 spans could not be exported", "telemetry.failed")
        finally:
            restore()
        assert [(list(lg.handlers), lg.propagate) for lg in loggers] == before
        assert warnings.showwarning is hook
    finally:
        uvicorn_log.removeHandler(earlier)
        uvicorn_log.propagate = propagated
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]  # all JSON
    assert [(x["event"], x["level"]) for x in lines[:3]] == [
        ("ASGI callable returned without completing", "error"),
        ("socket.accept() out of system resource", "warning"),
        ("Connection pool is full", "warning"),
    ]
    assert "a coroutine was never awaited" in lines[3]["event"]
    assert lines[4]["event"] == "telemetry.failed" and "3 of 3 spans" in lines[4]["detail"]
    assert len(lines) == 5


def test_a_failed_command_under_json_lines_says_so_in_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's last line (an error here) is JSON too under ``--log-json``."""
    code = main(["replay", str(tmp_path / "missing.jsonl"), "--log-json"])
    assert code != 0
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert lines[-1]["event"] == "cli.failed" and lines[-1]["level"] == "error"
    assert "missing.jsonl" in lines[-1]["detail"]


# ---------------------------------------------------------------------------------------------
# (g) the library's records written straight into the lines structlog's formatter writes
# ---------------------------------------------------------------------------------------------


class _Mixed(str, enum.Enum):  # noqa: UP042 (a mix-in formats unlike its value)
    A = "alpha"


class _Formats(str):
    def __format__(self, spec: str) -> str:
        return "FORMATTED"


class _Structlogged:
    def __structlog__(self) -> dict[str, int]:
        return {"custom": 1}


_VALUES: list[Any] = [
    0, -3, 2.5, float("nan"), True, None, "", "plain", "two words", "k=v", 'say "hi"', "it's",
    "tab\there", "line\nbreak", "bell\x07", "esc\x1b[31m", "café ☕", "𝄞", "\ud800", [1, "a"],
    {"k": [None]}, ("t",), b"raw", Path("/x y"), _Mixed.A, _Formats("abc"), _Structlogged(),
]  # fmt: skip


@pytest.mark.usefixtures("structlog_unconfigured")
@pytest.mark.parametrize("json_lines", [False, True], ids=["readable", "json"])
def test_library_lines_are_written_as_structlogs_formatter_writes_them(json_lines: bool) -> None:
    from pipeline._cli.logging_setup import log_formatter

    with library_records() as kept:
        log = get_logger(session_id="s-1")
        for i, value in enumerate(_VALUES):
            log.info("wire.request", value=value, n=i, status=200)
            log.warning(f"event.{i}", **{f"k{i}": value, "another": value})
        log.info("an event name longer than thirty characters", value=1)
        log.info("columns", exception="boom", stack="frames", logger="l", logger_name="n")
        log.error("reserved", name="a field named as a record's", msg="and another")
    records = kept.records
    formatter = log_formatter(json_lines)
    assert len(records) == 2 * len(_VALUES) + 3
    for record in records:
        fast, general = formatter.format(record), formatter.general.format(record)  # type: ignore[attr-defined]
        if json_lines:
            a, b = json.loads(fast), json.loads(general)
            assert list(a) == list(b) and a.pop("timestamp") and b.pop("timestamp")
            assert a == b or json.dumps(a) == json.dumps(b)  # NaN is not equal to itself
        else:
            assert fast.split(" ", 1)[1] == general.split(" ", 1)[1]
            assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z \[", fast)


@pytest.mark.usefixtures("structlog_unconfigured")
def test_a_record_of_the_library_pickles_with_its_message_by_any_protocol() -> None:
    import pickle

    with library_records() as kept:
        get_logger(session_id="s").info("ev.sent", ids=["a"])
    records = kept.records
    (record,) = records
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        again = pickle.loads(pickle.dumps(record, protocol))
        assert again.getMessage() == "ev.sent session_id=s ids=['a']"
