"""No litter: ``replay`` and ``demo`` remove the temporary store they make (and the demo's
transcript in it) however they end, unless ``--keep-store``; an explicit ``--store`` is never
removed; what the output says of persisted files matches what is left on disk.

The commands run as subprocesses with ``TMPDIR`` set to a directory of the test, so whatever a
run leaves behind is there to see."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from pipeline._cli import common
from pipeline._cli.cleanup import interrupts_deferred, remove_made_dir
from pipeline._cli.common import ReplayOptions, StoreDir
from pipeline._cli.demo_session import write_session
from pipeline._cli.report import REMOVED_WITH_TEMPORARY_STORE
from pipeline.transcript.read import TranscriptWriter
from tests.builders import assistant, results, tool_result, tool_use, user_text
from tests.cli_support import clean_env, parse_json_lines, run_cli

REMOVED_LINE = f"persisted results: {REMOVED_WITH_TEMPORARY_STORE}"


@pytest.fixture
def tmpdir_env(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """An empty directory and an environment whose ``TMPDIR`` is it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp, clean_env(TMPDIR=str(tmp))


@pytest.fixture(scope="module")
def transcript(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo session as a Claude Code transcript: its replay persists results."""
    path = tmp_path_factory.mktemp("transcript") / "session.jsonl"
    write_session(path)
    return path


def _persisted_paths(calls: list[dict[str, Any]]) -> list[Path]:
    return [Path(p["path"]) for c in calls for p in c["persisted"]]


# ---------------------------------------------------------------------------------------------
# by default nothing is left
# ---------------------------------------------------------------------------------------------


def test_a_replay_leaves_nothing_and_says_so(
    tmpdir_env: tuple[Path, dict[str, str]], transcript: Path
) -> None:
    tmp, env = tmpdir_env
    proc = run_cli("replay", transcript, env=env)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp.iterdir()) == []
    assert proc.stdout.splitlines()[-1] == REMOVED_LINE
    assert str(tmp) not in proc.stdout  # no line points at the removed directory


def test_a_json_replay_names_the_removed_store_and_says_it_is_gone(
    tmpdir_env: tuple[Path, dict[str, str]], transcript: Path
) -> None:
    tmp, env = tmpdir_env
    proc = run_cli("replay", transcript, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    calls, summary = parse_json_lines(proc.stdout)
    store = Path(summary["store"])
    assert store.parent == tmp and store.name.startswith("sluicegate-")
    assert summary["store_kept"] is False
    persisted = _persisted_paths(calls)
    assert persisted and all(p.is_relative_to(store) for p in persisted)  # it did persist
    assert not store.exists()
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("mode", [["--replay"], []], ids=["replay", "live"])
def test_the_demo_leaves_nothing_and_says_its_transcript_goes(
    tmpdir_env: tuple[Path, dict[str, str]], mode: list[str]
) -> None:
    tmp, env = tmpdir_env
    proc = run_cli("demo", *mode, env=env)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp.iterdir()) == []
    first, last = proc.stdout.splitlines()[0], proc.stdout.splitlines()[-1]
    assert "demo-session.jsonl; temporary: removed at the end" in first
    assert "--keep-store" in first
    assert last == REMOVED_LINE


def test_compare_leaves_nothing(tmpdir_env: tuple[Path, dict[str, str]], transcript: Path) -> None:
    tmp, env = tmpdir_env
    proc = run_cli("replay", transcript, "--compare", "none,default", env=env)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# kept when asked, never removed when given
# ---------------------------------------------------------------------------------------------


def test_compare_with_keep_store_says_where_it_kept_the_results(
    tmpdir_env: tuple[Path, dict[str, str]], transcript: Path
) -> None:
    tmp, env = tmpdir_env
    proc = run_cli("replay", transcript, "--compare", "default", "--keep-store", env=env)
    assert proc.returncode == 0, proc.stderr
    (store,) = tmp.iterdir()
    assert f"sluicegate: persisted results kept in {store}" in proc.stderr
    assert any(store.rglob("tool-results/*.txt"))


def test_keep_store_keeps_the_replay_store_and_the_printed_path_exists(
    tmpdir_env: tuple[Path, dict[str, str]], transcript: Path
) -> None:
    tmp, env = tmpdir_env
    proc = run_cli("replay", transcript, "--keep-store", env=env)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.splitlines()[-1]
    assert last.startswith("persisted results: ")
    results_dir = Path(last.removeprefix("persisted results: "))
    assert results_dir.is_dir() and results_dir.is_relative_to(tmp)
    assert any(results_dir.iterdir())

    proc = run_cli("replay", transcript, "--keep-store", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    calls, summary = parse_json_lines(proc.stdout)
    assert summary["store_kept"] is True and Path(summary["store"]).is_dir()
    persisted = _persisted_paths(calls)
    assert persisted and all(p.is_file() for p in persisted)
    assert len(list(tmp.iterdir())) == 2  # one store per run, both kept


def test_keep_store_keeps_the_demo_store_and_its_transcript(
    tmpdir_env: tuple[Path, dict[str, str]],
) -> None:
    tmp, env = tmpdir_env
    proc = run_cli("demo", "--replay", "--keep-store", env=env)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert "temporary" not in first
    shown = Path(first.rpartition(": ")[2])
    assert shown.is_file() and shown.name == "demo-session.jsonl"
    (store,) = tmp.iterdir()
    assert shown.parent == store
    results_dir = Path(proc.stdout.splitlines()[-1].removeprefix("persisted results: "))
    assert results_dir.is_dir() and results_dir.is_relative_to(store)


@pytest.mark.parametrize("keep", [[], ["--keep-store"]], ids=["plain", "keep-store"])
def test_an_explicit_store_is_never_removed(
    tmpdir_env: tuple[Path, dict[str, str]], tmp_path: Path, transcript: Path, keep: list[str]
) -> None:
    tmp, env = tmpdir_env
    store = tmp_path / "mine"
    store.mkdir()
    (store / "unrelated.txt").write_text("the user's")
    proc = run_cli("replay", transcript, "--store", store, "--json", *keep, env=env)
    assert proc.returncode == 0, proc.stderr
    calls, summary = parse_json_lines(proc.stdout)
    assert summary["store_kept"] is True and Path(summary["store"]) == store
    assert all(p.is_file() for p in _persisted_paths(calls))
    assert (store / "unrelated.txt").read_text() == "the user's"

    proc = run_cli("demo", "--store", store, *keep, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (store / "demo-session.jsonl").is_file()
    assert proc.stdout.splitlines()[-1].startswith(f"persisted results: {store}")
    assert list(tmp.iterdir()) == []  # and no temporary store was made


def test_the_demo_out_file_outlives_the_temporary_store(
    tmpdir_env: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    tmp, env = tmpdir_env
    out = tmp_path / "session.jsonl"
    proc = run_cli("demo", "--replay", "--out", out, env=env)
    assert proc.returncode == 0, proc.stderr
    assert out.is_file()
    assert "temporary" not in proc.stdout.splitlines()[0]
    assert list(tmp.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# failures and interrupts leave nothing either
# ---------------------------------------------------------------------------------------------


def test_a_replay_that_fails_after_the_store_was_made_leaves_nothing(
    tmpdir_env: tuple[Path, dict[str, str]], transcript: Path
) -> None:
    tmp, env = tmpdir_env
    # autocompact with a tiny window and blocking on: the session is stopped at call 1, after
    # call 0 went through the store
    halt = "autocompact=summarize:context_window=30000:max_output_tokens=1000:block=true"
    proc = run_cli("replay", transcript, "--stage", halt, "--json", env=env)
    assert proc.returncode == 1
    assert "autocompact stopped the session" in proc.stderr
    assert len(proc.stdout.splitlines()) == 1  # call 0 was replayed
    assert list(tmp.iterdir()) == []


def test_the_demo_leaves_nothing_when_stdout_fails(
    tmpdir_env: tuple[Path, dict[str, str]],
) -> None:
    tmp, env = tmpdir_env
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline", "demo", "--replay", "--json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
    assert proc.returncode == 1
    assert "cannot write to standard output" in proc.stderr
    assert list(tmp.iterdir()) == []


def test_the_demo_leaves_nothing_when_an_option_is_refused(
    tmpdir_env: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    tmp, env = tmpdir_env
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (dumps / "0001.json").write_text("[]")  # an earlier run's: refused after the store is made
    proc = run_cli("demo", "--dump-requests", dumps, env=env)
    assert proc.returncode == 2
    assert "already holds 1 request dump" in proc.stderr
    assert list(tmp.iterdir()) == []


def _long_transcript(path: Path, calls: int) -> None:
    messages = [user_text("go")]
    for n in range(calls):
        messages.append(assistant(f"msg_{n:05d}", tool_use(f"toolu_{n:05d}", command="ls")))
        messages.append(results(tool_result(f"toolu_{n:05d}", "x" * 100)))
    TranscriptWriter(path, "long-session").append_messages(messages)


@pytest.mark.parametrize(
    ("sig", "code", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
)
def test_a_signal_mid_replay_leaves_nothing(
    tmpdir_env: tuple[Path, dict[str, str]], tmp_path: Path, sig: int, code: int, said: str
) -> None:
    """Ctrl-C and SIGTERM (what a service manager or ``timeout`` sends) both end the replay
    with its temporary store removed; the exit code names the signal."""
    tmp, env = tmpdir_env
    transcript = tmp_path / "long.jsonl"
    _long_transcript(transcript, 150)
    read_end, write_end = os.pipe()
    # a one-page pipe nobody reads: after its first line the replay blocks on stdout (150
    # calls write ~20K), so the interrupt lands mid-replay, whatever the machine's speed
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "replay", str(transcript), "--json"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(write_end)
    with os.fdopen(read_end, "rb") as out:
        first = json.loads(out.readline())
        assert first["call"] == 0  # the store is made and in use
        assert len(list(tmp.iterdir())) == 1
        proc.send_signal(sig)
        rest = out.read()
    assert proc.stderr is not None
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == code, stderr
    assert said in stderr
    assert b'"summary"' not in rest  # it stopped before the end
    assert list(tmp.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# removing only what the command made
# ---------------------------------------------------------------------------------------------


def _made(tmp: Path) -> tuple[Path, tuple[int, int]]:
    path = Path(tempfile.mkdtemp(prefix="sluicegate-", dir=tmp))
    st = os.lstat(path)
    return path, (st.st_dev, st.st_ino)


def test_removal_never_follows_a_symlink_inside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    path, identity = _made(tmp_path)
    (path / "s" / "tool-results").mkdir(parents=True)
    (path / "s" / "tool-results" / "a.txt").write_text("x")
    (path / "s" / "link").symlink_to(outside, target_is_directory=True)
    assert remove_made_dir(path, identity) is True
    assert not path.exists()
    assert (outside / "precious.txt").read_text() == "keep"


def test_a_store_replaced_by_a_symlink_is_not_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    path, identity = _made(tmp_path)
    path.rmdir()
    path.symlink_to(outside, target_is_directory=True)
    assert remove_made_dir(path, identity) is False
    assert path.is_symlink() and (outside / "precious.txt").read_text() == "keep"
    assert "temporary store not removed" in capsys.readouterr().err


def test_a_store_replaced_by_another_directory_is_not_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, identity = _made(tmp_path)
    other = tmp_path / "other"  # made while the first exists: another inode for sure
    other.mkdir()
    (other / "theirs.txt").write_text("someone else's")
    path.rmdir()
    other.rename(path)
    assert remove_made_dir(path, identity) is False
    assert (path / "theirs.txt").is_file()
    assert "no longer the directory this command made" in capsys.readouterr().err


def test_a_store_already_gone_is_fine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, identity = _made(tmp_path)
    path.rmdir()
    assert remove_made_dir(path, identity) is True
    assert capsys.readouterr().err == ""


def test_store_root_removes_its_directory_when_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made: list[StoreDir] = []
    with pytest.raises(KeyboardInterrupt), common.store_root(ReplayOptions()) as store:
        made.append(store)
        (store.path / "s").mkdir()
        raise KeyboardInterrupt
    assert made[0].temporary and not made[0].kept
    assert not made[0].path.exists()
    with common.store_root(ReplayOptions(keep_store=True)) as kept:
        pass
    assert kept.kept and kept.path.is_dir()
    given = tmp_path / "given"
    with common.store_root(ReplayOptions(store=given, keep_store=True)) as store:
        assert store == StoreDir(given, temporary=False, kept=True)


def test_interrupts_are_held_back_while_the_store_is_removed() -> None:
    """A second Ctrl-C or a SIGTERM during the removal waits for it, then arrives as it
    would have (here: Python's own SIGINT handler, a KeyboardInterrupt after the block)."""
    steps: list[str] = []
    before = signal.getsignal(signal.SIGINT)
    if before is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's own handler in this process")
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            steps.append("the block went on")
        steps.append("never reached")
    assert steps == ["the block went on"]
    assert signal.getsignal(signal.SIGINT) is before  # put back
