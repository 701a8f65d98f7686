"""The command line against hostile input and a hostile environment: option values that used
to crash, paths that cannot be written, a stdout that cannot be written, control characters in
transcript fields, transcripts whose requests the API would reject, request dumps over
earlier ones; and a fuzz of the option values.

Every failure must be one ``sluicegate: error: ...`` line on stderr and a documented exit code
(0 ok, 1 failed part-way, 2 bad usage or input), never a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pipeline import Message, TranscriptWriter, Usage
from pipeline._cli.app import main
from pipeline._cli.compare import RunStats, load_prices
from pipeline._cli.dumps import RequestDumper
from pipeline._cli.safe_text import terminal_safe
from stages.registry import build_pipeline
from tests.builders import results, tool_result, tool_use, user_text
from tests.cli_support import clean_env, parse_json_lines

HOSTILE = "\x1b]0;PWNED\x07\x1b[2J\x1b[31m"
"""Retitles the terminal, clears it and turns what follows red, if printed raw."""
BIG_READ_CHARS = 120_000
"""A Read result (never persisted) this big: ~40K tokens, a request dump over 100 KB."""


def run_main(*args: str | Path) -> tuple[int, str, str]:
    """``main([...])`` in-process with its own stdout/stderr (usable inside hypothesis, where
    capsys is not): exit code (argparse's included), stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def assert_clean_error(code: int, err: str, expected: int, *fragments: str) -> None:
    """Exit ``expected`` with one error line naming every fragment, and no traceback."""
    assert code == expected, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def _usage(tokens: int, output: int = 20) -> Usage:
    return Usage(input_tokens=3, cache_read_input_tokens=tokens, output_tokens=output)


def small_session(path: Path, *, big_read: bool = False) -> Path:
    """A three-call session: a Bash run, a Read (``BIG_READ_CHARS`` long with ``big_read``),
    an answer."""
    read = "line of the file\n" * (BIG_READ_CHARS // 17 if big_read else 20)
    history = [
        user_text("look at the build"),
        Message.assistant(
            [tool_use("toolu_a", "Bash", command="make")], message_id="msg_a", usage=_usage(900)
        ),
        results(tool_result("toolu_a", "ok\n" * 50)),
        Message.assistant(
            [tool_use("toolu_b", "Read", file_path="/src/x.py")],
            message_id="msg_b",
            usage=_usage(1_000),
        ),
        results(tool_result("toolu_b", read)),
        Message.assistant(
            [{"type": "text", "text": "done"}],
            message_id="msg_c",
            usage=_usage(1_000 + len(read) // 3),
        ),
    ]
    TranscriptWriter(path, "small").append_messages(history)
    return path


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small session, written once per module (tests only read it)."""
    return small_session(tmp_path_factory.mktemp("s") / "small.jsonl")


@pytest.fixture(scope="module")
def big_session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small session with its big Read."""
    return small_session(tmp_path_factory.mktemp("b") / "big.jsonl", big_read=True)


def file_in_the_way(tmp_path: Path) -> Path:
    """A regular file: a path under it cannot be written, even by root (NotADirectory)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    return blocker


# ---------------------------------------------------------------------------------------------
# Option combinations that crashed
# ---------------------------------------------------------------------------------------------

BLOCKING = "autocompact=summarize:block=true:context_window=40000"


def test_blocking_autocompact_is_a_clean_error_naming_the_stage_and_limit(
    big_session: Path, tmp_path: Path
) -> None:
    code, out, err = run_main(
        "replay", big_session, "--json", "--store", tmp_path / "a", "--stage", BLOCKING
    )
    assert_clean_error(code, err, 1, "call 2", "autocompact", "blocking limit of 17,000 tokens")
    assert [json.loads(line)["call"] for line in out.splitlines()] == [0, 1]
    code, _, err = run_main(
        "replay", big_session, "--store", tmp_path / "b", "--compare", f"none,{BLOCKING}"
    )
    assert_clean_error(code, err, 1, f"pipeline {BLOCKING!r}", "autocompact", "blocking limit")


@pytest.mark.parametrize(
    "spec",
    [
        "context_collapse=summarize-spans:summarizer=x",
        "autocompact=summarize:summarizer=x",
    ],
)
def test_summarizer_is_not_settable_from_a_stage_spec(
    session: Path, tmp_path: Path, spec: str
) -> None:
    code, _, err = run_main("replay", session, "--store", tmp_path, "--stage", spec)
    assert_clean_error(code, err, 2, "--stage", "summarizer is not settable")
    code, _, err = run_main("replay", session, "--store", tmp_path, "--compare", spec)
    assert_clean_error(code, err, 2, "--compare", "summarizer is not settable")
    with pytest.raises(ValueError, match="summarizer is not settable"):
        build_pipeline({"autocompact": {"strategy": "summarize", "summarizer": object()}})


def test_an_unknown_stage_option_lists_the_valid_ones(session: Path, tmp_path: Path) -> None:
    code, _, err = run_main(
        "replay", session, "--store", tmp_path, "--stage", "microcompact=clear-oldest:bogus=1"
    )
    assert_clean_error(code, err, 2, "unknown option 'bogus'", "options are:", "keep", "tools")
    # an option named like one of the builder's own parameters is just as unknown
    with pytest.raises(ValueError, match="unknown option 'shared'; options are: keep"):
        build_pipeline({"microcompact": "clear-oldest:shared=1"})


@pytest.mark.parametrize("value", [",,,", "", " , "])
def test_compare_naming_no_pipeline_is_a_usage_error(
    session: Path, tmp_path: Path, value: str
) -> None:
    code, out, err = run_main("replay", session, "--store", tmp_path, "--compare", value)
    assert code == 2 and "Traceback" not in err
    assert "--compare" in err and "name at least one pipeline" in err
    assert out == ""  # not a plain replay instead


def test_plot_and_prices_need_compare(session: Path, tmp_path: Path) -> None:
    prices = tmp_path / "p.json"
    prices.write_text("not json")
    for flag, value in (("--plot", tmp_path / "x.png"), ("--prices", prices)):
        code, out, err = run_main("replay", session, "--store", tmp_path, flag, value)
        assert_clean_error(code, err, 2, f"{flag} requires --compare")
        assert out == ""


def test_plot_paths_that_cannot_be_written_are_refused_before_the_replays(
    session: Path, tmp_path: Path
) -> None:
    blocker = file_in_the_way(tmp_path)
    cases = {
        tmp_path: "is a directory",  # used to write <dir>.png beside it
        tmp_path / "sizes.xyz": "unsupported format 'xyz'",
        tmp_path / "sizes": "no file extension",
        blocker / "sizes.png": "not a directory",
    }
    for path, message in cases.items():
        code, out, err = run_main(
            "replay", session, "--store", tmp_path / "st", "--compare", "none", "--plot", path
        )
        assert_clean_error(code, err, 2, "--plot", message)
        assert out == ""
    assert not (tmp_path.parent / f"{tmp_path.name}.png").exists()
    good = tmp_path / "sizes.svg"
    code, _, err = run_main(
        "replay", session, "--store", tmp_path / "st2", "--compare", "none", "--plot", good
    )
    assert code == 0, err
    assert good.read_bytes().lstrip().startswith(b"<?xml")
    assert [p.name for p in tmp_path.glob(".sizes*")] == []  # no temporary file left


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ('{"input": -3, "output": 15}', "input"),
        ('{"input": NaN, "output": 15}', "input"),
        ('{"input": 3, "output": Infinity}', "output"),
        ('{"input": 3, "output": -Infinity}', "output"),
        ('{"input": 3, "output": "15"}', "output"),
        ('{"input": true, "output": 15}', "input"),
        ('{"input": 3, "output": 15, "cache_read_factor": NaN}', "cache_read_factor"),
        ('{"input": 3, "output": 15, "discount": 1}', "discount"),
        ('{"input": 1' + "0" * 400 + ', "output": 15}', "input"),
    ],
)
def test_bad_prices_are_refused_naming_the_entry(
    session: Path, tmp_path: Path, entry: str, named: str
) -> None:
    table = tmp_path / "prices.json"
    table.write_text(f'{{"sonnet": {{"input": 3, "output": 15}}, "claude": {entry}}}')
    with pytest.raises(ValueError, match=named):
        load_prices(table)
    code, out, err = run_main(
        "replay", session, "--json", "--store", tmp_path, "--compare", "none", "--prices", table
    )
    assert_clean_error(code, err, 2, "--prices", "'claude'", named)
    assert out == ""


def test_prices_must_be_a_regular_file(session: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "prices.json"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    replay = [sys.executable, "-m", "pipeline", "replay", str(session), "--compare", "none"]
    for path in (fifo, tmp_path):
        proc = subprocess.run(
            [*replay, "--store", str(tmp_path / "s"), "--prices", str(path)],
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=60,
            check=False,
        )
        assert proc.returncode == 2
        assert proc.stderr == f"sluicegate: error: --prices {path}: not a regular file\n"


def test_compare_json_is_always_valid_json() -> None:
    row = RunStats("x", cost_usd=math.inf).row()
    assert row["cost_usd"] is None
    json.dumps(row, allow_nan=False)
    assert RunStats("y", cost_usd=math.nan).row()["cost_usd"] is None


@pytest.mark.parametrize("flag", ["--store", "--dump-requests", "--plot", "--prices"])
def test_an_empty_path_is_a_usage_error_not_the_current_directory(
    session: Path, tmp_path: Path, flag: str
) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    extra = ["--compare", "none"] if flag in ("--plot", "--prices") else []
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "replay", str(session), *extra, flag, ""],
        capture_output=True,
        text=True,
        cwd=work,
        env=clean_env(PYTHONPATH=str(Path(__file__).resolve().parents[1])),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"argument {flag}: expected a path, got an empty value" in proc.stderr
    assert list(work.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# demo with paths that cannot be written
# ---------------------------------------------------------------------------------------------


def _demo_path_cases(tmp_path: Path) -> list[tuple[list[str | Path], str]]:
    blocker = file_in_the_way(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return [
        (["--out", blocker / "x.jsonl"], "--out"),
        (["--out", tmp_path], "is a directory"),
        (["--out", fifo], "not a regular file"),  # replacing it would unlink it
        (["--store", blocker], "--store"),
        (["--store", blocker / "sub"], "--store"),
        (["--dump-requests", blocker / "d"], "--dump-requests"),
        (["--dump-requests", blocker], "--dump-requests"),
    ]


@pytest.mark.parametrize("replay", [False, True], ids=["live", "replay"])
def test_demo_refuses_unwritable_paths_before_any_work(tmp_path: Path, replay: bool) -> None:
    for args, fragment in _demo_path_cases(tmp_path):
        store = [] if "--store" in args else ["--store", tmp_path / "store"]
        flags = ["--replay"] if replay else []
        code, out, err = run_main("demo", "--json", *flags, *store, *args)
        assert_clean_error(code, err, 2, fragment)
        assert out == "", args  # refused before the session ran
        assert os.path.exists(tmp_path / "fifo")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 directory")
def test_demo_refuses_a_read_only_directory(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        for args in (["--out", ro / "x.jsonl"], ["--store", ro], ["--dump-requests", ro / "d"]):
            store = [] if "--store" in args else ["--store", tmp_path / "store"]
            code, out, err = run_main("demo", "--json", *store, *args)
            assert_clean_error(code, err, 2, "cannot write there")
            assert out == ""
    finally:
        ro.chmod(0o700)


# ---------------------------------------------------------------------------------------------
# stdout that cannot be written
# ---------------------------------------------------------------------------------------------


def _shell(command: str) -> subprocess.CompletedProcess[str]:
    env = clean_env(PY=sys.executable)
    return subprocess.run(
        ["sh", "-c", command],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize(
    "args",
    [["--json"], [], ["--json", "--compare", "none,default"], ["--compare", "none"]],
    ids=["json", "table", "compare-json", "compare-table"],
)
def test_a_full_stdout_is_one_error_line_and_exit_1(
    session: Path, tmp_path: Path, args: list[str]
) -> None:
    extra = " ".join(args)
    proc = _shell(f'"$PY" -m pipeline replay {session} --store {tmp_path} {extra} > /dev/full')
    assert proc.returncode == 1
    assert (
        proc.stderr
        == "sluicegate: error: cannot write to standard output: No space left on device\n"
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("command", ["--help", "replay --help", "proxy --help"])
def test_help_on_a_full_stdout_is_one_error_line_and_exit_1(command: str) -> None:
    proc = _shell(f'"$PY" -m pipeline {command} > /dev/full')
    assert proc.returncode == 1
    assert (
        proc.stderr
        == "sluicegate: error: cannot write to standard output: No space left on device\n"
    )


def test_help_and_usage_errors_keep_their_exit_codes() -> None:
    assert _shell('"$PY" -m pipeline --help > /dev/null').returncode == 0
    usage = _shell('"$PY" -m pipeline --no-such-option')
    assert usage.returncode == 2
    assert "sluicegate: error:" in usage.stderr


def test_a_closed_stdout_is_one_error_line_and_exit_1(session: Path, tmp_path: Path) -> None:
    proc = _shell(f'"$PY" -m pipeline replay {session} --json --store {tmp_path} >&-')
    assert proc.returncode == 1
    assert proc.stderr == "sluicegate: error: standard output is closed\n"


def test_a_reader_that_goes_away_still_ends_quietly(tmp_path: Path) -> None:
    history = [user_text("go")]
    for k in range(1_500):  # ~200 KB of JSON lines: more than a pipe holds
        history += [
            Message.assistant([tool_use(f"u{k}")], message_id=f"r{k}", usage=_usage(900 + k)),
            results(tool_result(f"u{k}", "ok")),
        ]
    transcript = tmp_path / "long.jsonl"
    TranscriptWriter(transcript, "long").append_messages(history)
    proc = _shell(f'"$PY" -m pipeline replay {transcript} --json --store {tmp_path} | head -c 10')
    assert proc.returncode == 0  # head's status
    assert proc.stdout == '{"call": 0'
    assert proc.stderr == ""


# ---------------------------------------------------------------------------------------------
# Control characters from the transcript
# ---------------------------------------------------------------------------------------------


def hostile_session(path: Path) -> Path:
    """A session whose response id, tool_use id and tool name hold terminal escapes; its one
    tool result (60K chars) is over the per-tool cap, so it is persisted."""
    uid = "toolu_" + HOSTILE
    history = [
        user_text("go"),
        Message.assistant(
            [tool_use(uid, "Tool" + HOSTILE)], message_id="msg_" + HOSTILE, usage=_usage(900)
        ),
        results(tool_result(uid, "y" * 60_000)),
        Message.assistant(
            [{"type": "text", "text": "done"}], message_id="msg_end", usage=_usage(3_000)
        ),
    ]
    TranscriptWriter(path, "hostile").append_messages(history)
    return path


def test_control_characters_are_escaped_in_readable_output(tmp_path: Path) -> None:
    transcript = hostile_session(tmp_path / "hostile.jsonl")
    code, out, err = run_main("replay", transcript, "--store", tmp_path / "ok", "-v")
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\x1b" not in err
    assert "msg_\\x1b]0;PWNED\\x07\\x1b[2J\\x1b[31m" in out
    assert "+ persisted" in out and "Tool\\x1b]0;PWNED" in out
    # a store that refuses the write: the "persist failed" line and the warning log line
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "hostile").write_text("in the way")
    code, out, err = run_main("replay", transcript, "--store", blocked)
    assert code == 0, err
    assert "! persist failed for toolu_\\x1b]0;PWNED\\x07" in out
    assert "tool_result_budget.decision" in err and "toolu_\\x1b]0;PWNED" in err
    assert "\x1b" not in out and "\x1b" not in err and "\x07" not in err


def test_json_output_keeps_the_exact_values(tmp_path: Path) -> None:
    transcript = hostile_session(tmp_path / "hostile.jsonl")
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "hostile").write_text("in the way")
    code, out, err = run_main("replay", transcript, "--json", "--store", blocked, "--log-json")
    assert code == 0, err
    calls, _ = parse_json_lines(out)
    assert calls[0]["message_id"] == "msg_" + HOSTILE
    assert "\x1b" not in out  # JSON escapes it: \u001b
    logged = [json.loads(line) for line in err.splitlines()]
    assert any(e.get("tool_use_id") == "toolu_" + HOSTILE for e in logged)


def test_terminal_safe() -> None:
    assert terminal_safe("msg_01ABC é 日本 😀") == "msg_01ABC é 日本 😀"
    assert terminal_safe("a\x1bb\x07\x9b\u202e\ud83d\n") == "a\\x1bb\\x07\\x9b\\u202e\\ud83d\\n"
    # a valid id may be a megabyte long: one line shows its start and its length
    assert terminal_safe("L" * 1_000_000) == "L" * 300 + "…(1,000,000 chars)"
    assert terminal_safe("\x1b" * 400, limit=2) == "\\x1b\\x1b…(400 chars)"


# ---------------------------------------------------------------------------------------------
# Requests the API would reject: the pairing check
# ---------------------------------------------------------------------------------------------


def unpaired_session(path: Path) -> Path:
    """A tool_result recorded before the tool_use it answers: from call 1 on, every request
    holds an orphan result (and, from call 2, an unanswered tool_use)."""
    history = [
        user_text("go"),
        Message.assistant([tool_use("toolu_a")], message_id="msg_a", usage=_usage(900)),
        results(tool_result("toolu_a", "a"), tool_result("toolu_late", "too early")),
        Message.assistant([tool_use("toolu_late")], message_id="msg_b", usage=_usage(950)),
        results(tool_result("toolu_b", "b")),
        Message.assistant(
            [{"type": "text", "text": "done"}], message_id="msg_c", usage=_usage(990)
        ),
    ]
    TranscriptWriter(path, "unpaired").append_messages(history)
    return path


def test_replay_reports_broken_pairing(tmp_path: Path) -> None:
    transcript = unpaired_session(tmp_path / "unpaired.jsonl")
    code, out, err = run_main("replay", transcript, "--json", "--store", tmp_path / "a")
    assert code == 0, err  # the replay itself succeeded; the transcript is what is broken
    _, summary = parse_json_lines(out)
    assert summary["calls_with_pairing_problems"] == 2
    assert summary["pairing_problems"] >= 2
    warnings = err.strip().splitlines()
    assert len(warnings) == 2
    assert warnings[0].startswith("sluicegate: warning: call 1: ")
    assert "orphan_tool_result 'toolu_late'" in warnings[0]
    assert warnings[1].startswith("sluicegate: warning: call 2: ")
    code, out, err = run_main("replay", transcript, "--store", tmp_path / "b")
    assert code == 0 and "broken tool pairing" in out and "in 2 of 3 calls" in out


def test_pairing_warnings_stop_after_twenty_calls(tmp_path: Path) -> None:
    """An orphan early in a long session is in every later request: twenty warnings, then
    only the count."""
    history = [user_text("go"), results(tool_result("toolu_ghost", "orphan"))]
    for k in range(30):
        history += [
            Message.assistant([tool_use(f"u{k}")], message_id=f"r{k}", usage=_usage(900 + k)),
            results(tool_result(f"u{k}", "ok")),
        ]
    transcript = tmp_path / "ghost.jsonl"
    TranscriptWriter(transcript, "ghost").append_messages(history)
    code, out, err = run_main("replay", transcript, "--json", "--store", tmp_path / "s")
    assert code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 21 and "only counted" in lines[-1]
    assert parse_json_lines(out)[1]["calls_with_pairing_problems"] == 30


def test_a_clean_session_reports_no_pairing_problem(session: Path, tmp_path: Path) -> None:
    code, out, err = run_main("replay", session, "--json", "--store", tmp_path)
    assert code == 0 and err == ""
    _, summary = parse_json_lines(out)
    assert summary["pairing_problems"] == summary["calls_with_pairing_problems"] == 0


# ---------------------------------------------------------------------------------------------
# Request dumps
# ---------------------------------------------------------------------------------------------


def test_dumps_never_overwrite_an_earlier_run_or_the_input(session: Path, tmp_path: Path) -> None:
    dumps = tmp_path / "d"
    dumps.mkdir()
    # the transcript itself, named as a dump would be, in the dump directory
    named_like_a_dump = dumps / "0000.json"
    shutil.copy(session, named_like_a_dump)
    before = named_like_a_dump.read_bytes()
    code, out, err = run_main(
        "replay", named_like_a_dump, "--store", tmp_path / "s", "--dump-requests", dumps
    )
    assert_clean_error(code, err, 2, "--dump-requests", "0000.json", "empty or new directory")
    assert named_like_a_dump.read_bytes() == before and out == ""
    # an earlier run's dumps, too
    again = tmp_path / "again"
    code, _, err = run_main("replay", session, "--store", tmp_path / "s2", "--dump-requests", again)
    assert code == 0, err
    code, _, err = run_main("replay", session, "--store", tmp_path / "s3", "--dump-requests", again)
    assert_clean_error(code, err, 2, "already holds 3 request dump(s)")
    # other files do not count
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, _, err = run_main("replay", session, "--store", tmp_path / "s4", "--dump-requests", other)
    assert code == 0, err


def test_demo_never_writes_its_transcript_where_a_dump_goes(tmp_path: Path) -> None:
    dumps = tmp_path / "d"
    code, out, err = run_main(
        "demo",
        "--replay",
        "--store",
        tmp_path / "s",
        "--out",
        dumps / "0001.json",
        "--dump-requests",
        dumps,
    )
    assert_clean_error(code, err, 2, "--out", "--dump-requests would replace it")
    assert out == "" and list(dumps.iterdir()) == []


def _limit_file_size() -> None:  # in the child, before exec: files stop growing at 100 KB
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))


def test_a_dump_that_cannot_be_completed_leaves_no_partial_file(
    big_session: Path, tmp_path: Path
) -> None:
    dumps = tmp_path / "d"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pipeline", "replay", str(big_session), "--json"),
            *("--store", str(tmp_path / "s"), "--dump-requests", str(dumps)),
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        preexec_fn=_limit_file_size,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "cannot write" in proc.stderr and "0002.json" in proc.stderr
    names = sorted(p.name for p in dumps.iterdir())
    assert names == ["0000.json", "0001.json"]  # call 2 (over 100 KB) is absent, not cut
    for name in names:
        json.loads((dumps / name).read_bytes())


def test_the_dumper_writes_whole_files_or_none(tmp_path: Path) -> None:
    dumper = RequestDumper(tmp_path)
    dumper.dump(0, [{"role": "user", "content": "hi"}])
    assert json.loads((tmp_path / "0000.json").read_bytes()) == [{"role": "user", "content": "hi"}]
    assert [p.name for p in tmp_path.iterdir()] == ["0000.json"]


# ---------------------------------------------------------------------------------------------
# Fuzz: random option values
# ---------------------------------------------------------------------------------------------

_GOOD_PATH = "new"
_BAD_PATHS = ("existing-dir", "file", "under-file", "fifo", "odd-name")
_GOOD_STAGES = (
    "microcompact=clear-oldest:keep=2",
    "microcompact=server-clear:trigger_tokens=1000",
    "microcompact=off",
    "history_snip=off",
    "context_collapse=off",
    "tool_result_budget=budget:limit=1000",
)
TINY_BLOCKING = (
    "autocompact=summarize:block=true:context_window=4000:max_output_tokens=0:buffer_tokens=3000"
)
"""Blocks at 1,000 tokens: the small session cannot be replayed under it."""
_BAD_STAGES = (
    TINY_BLOCKING,
    "microcompact=clear-oldest:keep=-1",
    "microcompact=clear-oldest:bogus=1",
    "autocompact=summarize:summarizer=x",
    "context_collapse=summarize-spans:summarizer=x",
    BLOCKING,
    "autocompact=summarize:context_window=1",
    "autocompact=summarize:context_window=nan",
    "tool_result_budget=budget:limit=inf",
    "nope=x",
    "microcompact",
    "microcompact=",
    "=x",
    ":::",
)
_GOOD_POINTS = ("none", "truncate", "clear-every-turn", "default", "microcompact=off")
_GOOD_NUMBERS = ("1", "50", "1000", "1_000", "200000")
_BAD_NUMBERS = ("0", "-1", "1e9", "x", "", "1.5", "9" * 40)
_GOOD_PRICES = ("3", "0", "0.25")
_BAD_PRICES = ("-1", "NaN", "Infinity", "1e308", '"3"', "null", "true")


def _fuzz_path(base: Path, kind: str, name: str) -> Path:
    if kind == "existing-dir":
        path = base / f"dir-{name}"
        path.mkdir(exist_ok=True)
        return path
    if kind == "file":
        path = base / f"file-{name}"
        path.write_text("x")
        return path
    if kind == "under-file":
        blocker = base / "blocker"
        blocker.write_text("x")
        return blocker / name
    if kind == "fifo":
        path = base / f"fifo-{name}"
        if not path.exists():
            os.mkfifo(path)
        return path
    if kind == "odd-name":
        return base / f"odd \x1b\u202e name-{name}"
    return base / f"new-{name}"


@st.composite
def cli_args(draw: st.DrawFn, base: Path, transcript: Path) -> list[str]:
    """A ``replay`` (``--compare``) or ``demo`` command line: each option present or not, its
    value a good one or, in two lines of three, now and then a hostile one (so that many runs
    get past the checks too); every path under ``base``."""

    # a third of the lines take only good values (and run to the end); the others a hostile
    # value for about one option in three
    hostile = draw(st.integers(0, 2)) > 0

    def bad_now() -> bool:
        return hostile and draw(st.integers(0, 2)) == 0

    def pick(good: Any, bad: Any) -> Any:
        """A good value, or now and then a hostile one (or random text)."""
        if not bad_now():
            return draw(st.sampled_from(good))
        return draw(st.sampled_from(bad) | st.text(max_size=12))

    def maybe(one_in: int) -> bool:
        return draw(st.integers(1, one_in)) == 1

    def path(name: str) -> str:
        kind = draw(st.sampled_from(_BAD_PATHS)) if bad_now() else _GOOD_PATH
        return str(_fuzz_path(base, kind, name))

    command = draw(st.sampled_from(["replay", "compare", "demo"]))
    if command == "demo":  # the live loop too: a scripted server on 127.0.0.1
        args = ["demo"] if maybe(3) else ["demo", "--replay"]
    else:
        args = ["replay", str(transcript)]
    if draw(st.booleans()):
        args.append("--json")
    args += ["--store", path("store")]
    if maybe(3):
        args += ["--dump-requests", path("dumps")]
        if maybe(2):
            args += ["--dump-calls", pick(("0", "1-2", "0,5"), ("2-1", "x", "", "-1"))]
        if maybe(2):
            args += ["--dump-format", pick(("full", "delta"), ("zip",))]
    for flag in ("--per-message-chars", "--per-tool-chars"):
        if maybe(3):
            args += [flag, pick(_GOOD_NUMBERS, _BAD_NUMBERS)]
    for _ in range(draw(st.integers(0, 2))):
        args += ["--stage", pick(_GOOD_STAGES, _BAD_STAGES)]
    # demo has no comparison flags, and replay without --compare refuses --plot and --prices:
    # such lines are usage errors, tried now and then
    odd = maybe(20)
    compare = command == "compare" or (odd and command != "replay")
    if compare:
        names = [
            pick(_GOOD_POINTS, ("", "fastest", TINY_BLOCKING, "autocompact=summarize:summarizer=x"))
            for _ in range(draw(st.integers(1, 3)))
        ]
        args += ["--compare", ",".join(names)]
    if (compare or odd) and maybe(3):
        args += ["--plot", path(pick(("p.png", "p.svg"), ("p.xyz", "p", ".png")))]
    if (compare or odd) and maybe(3):
        table = base / "prices.json"
        value = pick(_GOOD_PRICES, _BAD_PRICES)
        table.write_text(f'{{"sonnet": {{"input": {value}, "output": 15}}}}')
        args += ["--prices", str(table) if draw(st.booleans()) else path("prices.json")]
    if command == "demo":
        if maybe(2):
            args += ["--out", path("demo.jsonl")]
        if maybe(3):
            args += ["--seed", pick(("1", "-5", str(10**30)), ("x",))]
    if maybe(5):
        args.append("--lenient" if command != "demo" else "-v")
    return args


def _strict_json(line: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.slow
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzz_option_values(
    tmp_path_factory: pytest.TempPathFactory, session: Path, data: st.DataObject
) -> None:
    """Any option values: a documented exit code, never a traceback, valid JSON with --json."""
    base = tmp_path_factory.mktemp("fuzz")
    args = data.draw(cli_args(base, session))
    code, out, err = run_main(*args)
    if args[0] == "demo":
        kind = "demo --replay" if "--replay" in args else "demo (live)"
    else:
        kind = "compare" if "--compare" in args else "replay"
    event(f"{kind} exit {code}")
    if code == 1:
        event(f"exit 1: {err.strip()[:70]}")
    assert code in (0, 1, 2), (args, code, err)
    assert "Traceback" not in err, (args, err)
    if code == 0 and "--json" in args:
        lines = [line for line in out.splitlines() if line.strip()]
        assert lines, args
        for line in lines:
            _strict_json(line)
    if code != 0:
        assert "error" in err or "usage:" in err, (args, code, err)


def test_a_replay_store_that_cannot_be_written_is_refused_before_any_work(
    session: Path, tmp_path: Path
) -> None:
    """A ``--store`` under a file (a typo) or a link to nowhere is exit 2 before the replay,
    as the demo's is, not a replay whose every persist fails."""
    blocker = tmp_path / "f"
    blocker.write_text("")
    nowhere = tmp_path / "link"
    nowhere.symlink_to(tmp_path / "missing" / "deeper")
    for store in (blocker / "sub", nowhere):
        code, out, err = run_main("replay", session, "--store", store)
        assert_clean_error(code, err, 2, "--store")
        assert out == ""


def test_dump_options_are_refused_where_nothing_is_dumped(session: Path, tmp_path: Path) -> None:
    """``--dump-calls``/``--dump-format`` without ``--dump-requests``, and ``--dump-requests``
    with ``--compare`` (several pipelines): refused, not ignored."""
    cases = [
        (["--dump-calls", "0"], "--dump-calls requires --dump-requests"),
        (["--dump-format", "delta"], "--dump-format requires --dump-requests"),
        (["--compare", "none,default", "--dump-requests", tmp_path / "d"], "--dump-requests"),
    ]
    for extra, message in cases:
        code, out, err = run_main("replay", session, "--store", tmp_path / "s", *extra)
        assert_clean_error(code, err, 2, message)
        assert out == "" and not (tmp_path / "d").exists()


@pytest.mark.parametrize("content", [b"[" * 100_000, b'{"m": {"input": 1, "output": \xff}}'])
def test_a_price_table_too_deep_or_not_utf8_is_a_clean_error(
    session: Path, tmp_path: Path, content: bytes
) -> None:
    prices = tmp_path / "p.json"
    prices.write_bytes(content)
    code, _out, err = run_main(
        "replay", session, "--store", tmp_path / "s", "--compare", "none", "--prices", prices
    )
    assert_clean_error(code, err, 2, "--prices", str(prices))


def test_the_agent_takes_no_per_call_output_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent prints its answer: ``--json`` and the dumps are not its options (exit 2),
    rather than options it would ignore; an empty ``--session-id`` is refused."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")  # never reached
    monkeypatch.chdir(tmp_path)
    for extra in (["--json"], ["--dump-requests", str(tmp_path / "d")], ["--progress"]):
        code, _out, err = run_main("agent", "go", "--model", "m", *extra)
        assert code == 2 and "unrecognized arguments" in err
    code, _out, err = run_main("agent", "go", "--model", "m", "--session-id", "")
    assert code == 2 and "--session-id" in err


def test_an_answer_printed_on_a_terminal_cannot_act_on_it(tmp_path: Path) -> None:
    """The model's answer on a terminal: an escape sequence in it is shown, not obeyed (it
    could recolour, retitle or clear the terminal); its lines and tabs stay. Piped, the answer
    is printed as it came."""
    import pty

    from pipeline.testing import Reply, ScriptedMessagesServer

    answer = "done \x1b[31mred\x1b]0;title\x07\nline two\tend"
    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": answer}])) as server:
        env = clean_env(ANTHROPIC_API_KEY="k", ANTHROPIC_BASE_URL=server.base_url)
        command = [sys.executable, "-m", "pipeline", "agent", "go", "--model", "m"]
        pid, fd = pty.fork()
        if pid == 0:  # the child: the command on the pseudo-terminal
            os.chdir(tmp_path / ".")
            os.execve(sys.executable, command, env)
        shown = b""
        with contextlib.suppress(OSError):  # EIO once the child has closed the terminal
            while chunk := os.read(fd, 65536):
                shown += chunk
        os.close(fd)
        _, status = os.waitpid(pid, 0)
        piped = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)
    text = shown.decode()
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "\\x1b[31mred\\x1b]0;title\\x07" in text and "\x1b" not in text
    assert "line two\tend" in text
    assert piped.returncode == 0 and piped.stdout == answer + "\n"
