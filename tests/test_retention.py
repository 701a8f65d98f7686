"""Retention: ``prune_store`` by age and by size on a real store, what it must never touch,
``prune_periodically``, the ``store prune`` command and the proxy's ``--retain``."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
import uvicorn

import pipeline.store.retention as retention
from pipeline import Pipeline
from pipeline._cli.app import main
from pipeline._cli.store_cmd import format_bytes, parse_duration, parse_size
from pipeline.dropin.proxy import build_app
from pipeline.store.files import FileToolResultStore
from pipeline.store.retention import PruneReport, is_persisted_name, prune_periodically, prune_store
from tests.cli_support import clean_env, run_cli

DAY = 86_400.0
NOW = 1_750_000_000.0
"""The clock of the tests that pass ``now``: mtimes are set relative to it."""
WEEK = timedelta(days=7)


def _now() -> datetime:
    return datetime.fromtimestamp(NOW, tz=UTC)


def persist(root: Path, session: str, tool_use_id: str, text: str, ext: str = "txt") -> Path:
    """A result persisted by the real store: its own directory layout and file name."""
    store = FileToolResultStore(root, session)
    return Path(anyio.run(store.persist, tool_use_id, text, ext))


def age(path: Path, days: float, *, base: float = NOW) -> None:
    """Set ``path``'s mtime ``days`` before ``base`` (a symlink itself, not its target)."""
    when = base - days * DAY
    os.utime(path, (when, when), follow_symlinks=False)


def names(report: PruneReport) -> list[str]:
    return sorted(f.path.name for f in report.removed)


# ---------------------------------------------------------------------------------------------
# by age, by size
# ---------------------------------------------------------------------------------------------


def test_by_age_removes_what_is_older_and_reports_it(tmp_path: Path) -> None:
    old = persist(tmp_path, "s1", "toolu_old", "o" * 300)
    new = persist(tmp_path, "s1", "toolu_new", "n" * 200)
    other = persist(tmp_path, "s2", "toolu_other", "x" * 50, ext="json")
    age(old, 10)
    age(new, 1)
    age(other, 8)
    report = prune_store(tmp_path, max_age=WEEK, now=_now())
    assert names(report) == ["toolu_old.txt", "toolu_other.json"]
    assert {f.reason for f in report.removed} == {"age"}
    assert (report.removed_count, report.removed_bytes) == (2, 350)
    assert (report.kept_files, report.kept_bytes) == (1, 200)
    assert not old.exists() and not other.exists()
    assert new.read_text() == "n" * 200
    assert report.errors == [] and report.vanished == 0


def test_a_tenants_conversations_are_pruned_like_any_session(tmp_path: Path) -> None:
    """A drop-in keeps each tenant's conversations one level down (<root>/<tenant>/<name>);
    a session that merely has a tenant's name (it holds tool-results itself) stays a session."""
    tenant = tmp_path / "t-0123456789abcdef0123"
    old = persist(tenant, "fp-aaaa", "toolu_old", "o" * 100)
    new = persist(tenant, "fp-aaaa", "toolu_new", "n" * 100)
    named = persist(tmp_path, "shared", "toolu_named", "s" * 100)
    alone = persist(tmp_path, "plain", "toolu_plain", "p" * 100)
    for path in (old, named, alone):
        age(path, 10)
    age(new, 1)
    report = prune_store(tmp_path, max_age=WEEK, now=_now())
    assert names(report) == ["toolu_named.txt", "toolu_old.txt", "toolu_plain.txt"]
    assert new.exists() and not old.exists()
    assert (tenant / "fp-aaaa").is_dir()  # still holds a result
    assert not (tmp_path / "plain").exists() and tenant.is_dir()


def test_a_file_exactly_at_the_age_limit_stays(tmp_path: Path) -> None:
    edge = persist(tmp_path, "s", "toolu_edge", "e")
    age(edge, 7)
    assert prune_store(tmp_path, max_age=WEEK, now=_now()).removed == []
    assert edge.exists()


def test_by_size_removes_the_oldest_first_until_the_rest_fits(tmp_path: Path) -> None:
    paths = {}
    for n, days in enumerate([5, 1, 4, 2, 3]):
        session = f"s{n % 2}"  # across sessions: one order over the whole store
        paths[days] = persist(tmp_path, session, f"toolu_{days}d", "x" * 100)
        age(paths[days], days)
    report = prune_store(tmp_path, max_bytes=250, now=_now())
    assert names(report) == ["toolu_3d.txt", "toolu_4d.txt", "toolu_5d.txt"]
    assert [f.reason for f in report.removed] == ["size"] * 3
    assert report.kept_bytes == 200 <= 250
    assert sorted(p.name for p in paths.values() if p.exists()) == ["toolu_1d.txt", "toolu_2d.txt"]


def test_a_store_already_under_the_size_limit_is_left_alone(tmp_path: Path) -> None:
    kept = persist(tmp_path, "s", "toolu_a", "x" * 100)
    report = prune_store(tmp_path, max_bytes=100)
    assert report.removed == [] and report.kept_bytes == 100 and kept.exists()


def test_age_goes_first_then_size(tmp_path: Path) -> None:
    ancient = persist(tmp_path, "s", "toolu_ancient", "a" * 100)
    older = persist(tmp_path, "s", "toolu_older", "b" * 100)
    newer = persist(tmp_path, "s", "toolu_newer", "c" * 100)
    age(ancient, 30)
    age(older, 3)
    age(newer, 1)
    report = prune_store(tmp_path, max_age=WEEK, max_bytes=150, now=_now())
    assert [(f.path.name, f.reason) for f in report.removed] == [
        ("toolu_ancient.txt", "age"),
        ("toolu_older.txt", "size"),
    ]
    assert newer.exists() and report.kept_files == 1
    assert report.to_json()["removed_by_age"] == report.to_json()["removed_by_size"] == 1


def test_a_dry_run_removes_nothing_and_reports_what_the_real_run_removes(tmp_path: Path) -> None:
    for n, days in enumerate([9, 8, 2, 1]):
        age(persist(tmp_path, "s", f"toolu_{n}", "x" * 10), days)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    dry = prune_store(tmp_path, max_age=WEEK, max_bytes=10, now=_now(), dry_run=True)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    real = prune_store(tmp_path, max_age=WEEK, max_bytes=10, now=_now())
    assert dry.dry_run and not real.dry_run
    assert [(f.path, f.reason) for f in dry.removed] == [(f.path, f.reason) for f in real.removed]
    assert dry.removed_count == 3 and dry.kept_files == real.kept_files == 1


# ---------------------------------------------------------------------------------------------
# directories
# ---------------------------------------------------------------------------------------------


def test_emptied_session_directories_go_and_others_stay(tmp_path: Path) -> None:
    age(persist(tmp_path, "only-results", "toolu_a", "a"), 30)
    age(persist(tmp_path, "with-transcript", "toolu_b", "b"), 30)
    (tmp_path / "with-transcript" / "transcript.jsonl").write_text("{}\n")
    age(persist(tmp_path, "partly-old", "toolu_c", "c"), 30)
    persist(tmp_path, "partly-old", "toolu_d", "d")
    (tmp_path / "never-persisted").mkdir()  # not emptied by the prune: not its business

    report = prune_store(tmp_path, max_age=WEEK)
    assert not (tmp_path / "only-results").exists()
    assert (tmp_path / "with-transcript" / "transcript.jsonl").is_file()
    assert not (tmp_path / "with-transcript" / "tool-results").exists()
    assert (tmp_path / "partly-old" / "tool-results" / "toolu_d.txt").is_file()
    assert (tmp_path / "never-persisted").is_dir()
    assert sorted(d.relative_to(tmp_path).as_posix() for d in report.removed_dirs) == [
        "only-results",
        "only-results/tool-results",
        "with-transcript/tool-results",
    ]


def test_a_dry_run_reports_the_directories_it_would_empty(tmp_path: Path) -> None:
    age(persist(tmp_path, "s", "toolu_a", "a"), 30)
    report = prune_store(tmp_path, max_age=WEEK, dry_run=True)
    assert [d.name for d in report.removed_dirs] == ["tool-results", "s"]
    assert (tmp_path / "s" / "tool-results" / "toolu_a.txt").is_file()


# ---------------------------------------------------------------------------------------------
# what is never touched
# ---------------------------------------------------------------------------------------------


def test_temp_files_foreign_files_and_symlinks_are_never_touched(tmp_path: Path) -> None:
    root = tmp_path / "store"
    outside = tmp_path / "outside"
    (outside / "tool-results").mkdir(parents=True)
    target = outside / "target.txt"
    target.write_text("not the store's")
    (outside / "tool-results" / "toolu_x.txt").write_text("behind a symlinked directory")

    persisted = persist(root, "s", "toolu_real", "gone")
    results = persisted.parent
    untouched = [
        # a writer's temp file in flight, named as the store names them
        results / ".tmp-00001234abcd5678-toolu_real.txt",
        results / "notes.md",
        results / "CON.txt",  # the store maps device names to unsafe.<sha256>
        results / "a.b.txt",
        results / "toolu_real.txt.bak",
        results / "unsafe.123.txt",
    ]
    for path in untouched:
        path.write_text("keep")
    (results / "dir.txt").mkdir()
    os.mkfifo(results / "fifo.txt")
    (results / "link.txt").symlink_to(target)
    (root / "linked-session").symlink_to(outside, target_is_directory=True)
    (root / "s2").mkdir()
    (root / "s2" / "tool-results").symlink_to(outside / "tool-results", target_is_directory=True)
    (root / "bad name" / "tool-results").mkdir(parents=True)  # not a session id
    (root / "bad name" / "tool-results" / "toolu_y.txt").write_text("keep")
    (root / "stray.txt").write_text("keep")
    for path in [*untouched, results / "link.txt", target, outside / "tool-results/toolu_x.txt"]:
        age(path, 100)

    report = prune_store(root, max_age=timedelta(0), max_bytes=0)
    assert [f.path for f in report.removed] == [persisted]
    assert all(p.read_text() == "keep" for p in untouched)
    assert (results / "dir.txt").is_dir() and (results / "fifo.txt").exists()
    assert (results / "link.txt").is_symlink() and target.read_text() == "not the store's"
    assert (outside / "tool-results" / "toolu_x.txt").is_file()
    assert (root / "linked-session").is_symlink() and (root / "s2" / "tool-results").is_symlink()
    assert (root / "bad name" / "tool-results" / "toolu_y.txt").is_file()
    assert (root / "stray.txt").is_file()
    assert results.is_dir() and report.removed_dirs == []  # it still holds the others
    assert report.errors == []


def test_every_name_the_store_writes_is_prunable(tmp_path: Path) -> None:
    written = [
        persist(tmp_path, "s", "toolu_plain", "a"),
        persist(tmp_path, "s", "toolu_json", "[1]", ext="json"),
        persist(tmp_path, "s", "has/a slash", "b"),  # unsafe.<sha256>.txt
        persist(tmp_path, "s", "CON", "c"),  # a device name: unsafe.<sha256>.txt too
    ]
    # a different file already under the id's name: the store writes <id>.<12 hex>.txt
    store = FileToolResultStore(tmp_path, "s")
    store.path_for("toolu_dup", "txt").write_text("someone else's")
    written.append(persist(tmp_path, "s", "toolu_dup", "mine"))
    assert written[2].name.startswith("unsafe.") and written[3].name.startswith("unsafe.")
    assert written[4].name != "toolu_dup.txt"
    assert all(is_persisted_name(p.name) for p in written)

    report = prune_store(tmp_path, max_bytes=0)
    assert sorted(f.path for f in report.removed) == sorted(
        [*written, written[4].parent / "toolu_dup.txt"]
    )
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    "name",
    [
        ".tmp-00001234abcd5678-toolu_a.txt",
        "toolu_a.md",
        "toolu_a",
        "nul.json",
        "toolu_a.0123456789ab.0123456789ab.txt",
        "toolu_a.ABCDEF012345.txt",
        "unsafe." + "0" * 63 + ".txt",
        "a" * 129 + ".txt",
    ],
)
def test_names_the_store_never_writes_are_not_persisted_names(name: str) -> None:
    assert not is_persisted_name(name)


def test_a_file_that_vanishes_meanwhile_is_counted_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    goes = persist(tmp_path, "s1", "toolu_goes", "g")
    stays_gone = persist(tmp_path, "s2", "toolu_session_goes", "h")
    removed = persist(tmp_path, "s1", "toolu_removed", "r")
    for path in (goes, stays_gone, removed):
        age(path, 30)
    for session in ("s1", "s2"):  # conversations still going on
        (tmp_path / session / "decisions.jsonl").write_text("{}\n")
    scan = retention._scan

    def scan_then_lose_some(*args: object) -> object:
        found = scan(*args)  # type: ignore[arg-type]
        goes.unlink()  # another prune, a user: between the scan and the removal
        for path in sorted(stays_gone.parent.parent.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        stays_gone.parent.parent.rmdir()
        return found

    monkeypatch.setattr(retention, "_scan", scan_then_lose_some)
    report = prune_store(tmp_path, max_age=WEEK)
    assert [f.path for f in report.removed] == [removed]
    assert report.vanished == 2 and report.errors == []
    assert not (tmp_path / "s1" / "tool-results").exists()


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------


def test_a_missing_root_is_an_empty_store(tmp_path: Path) -> None:
    report = prune_store(tmp_path / "none", max_age=WEEK)
    assert report.removed == [] and report.kept_files == 0


def test_bad_roots_and_limits_are_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        prune_store(tmp_path / "file", max_age=WEEK)
    with pytest.raises(ValueError, match="nothing to prune by"):
        prune_store(tmp_path)
    with pytest.raises(ValueError, match="max_age"):
        prune_store(tmp_path, max_age=timedelta(seconds=-1))
    with pytest.raises(ValueError, match="max_bytes"):
        prune_store(tmp_path, max_bytes=-1)


# ---------------------------------------------------------------------------------------------
# periodically
# ---------------------------------------------------------------------------------------------


def test_prune_periodically_prunes_after_each_interval(tmp_path: Path) -> None:
    old = persist(tmp_path, "s", "toolu_old", "o")
    age(old, 30, base=datetime.now().timestamp())
    reports: list[PruneReport] = []

    async def run() -> None:
        pruned = anyio.Event()

        def on_report(report: PruneReport) -> None:
            reports.append(report)
            if report.removed:
                pruned.set()

        with anyio.fail_after(60):  # a hang guard, not a timing assertion
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(
                    functools.partial(
                        prune_periodically, tmp_path, interval=0.01, max_age=WEEK,
                        on_report=on_report,
                    )
                )  # fmt: skip
                await pruned.wait()
                tasks.cancel_scope.cancel()

    anyio.run(run)
    assert not old.exists()
    assert [f.path for f in reports[-1].removed] == [old]


def test_prune_periodically_reports_errors_and_goes_on(tmp_path: Path) -> None:
    root = tmp_path / "file"
    root.write_text("not a directory")
    errors: list[Exception] = []

    async def run() -> None:
        twice = anyio.Event()

        def on_error(exc: Exception) -> None:
            errors.append(exc)
            if len(errors) == 2:
                twice.set()

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(
                    functools.partial(
                        prune_periodically, root, interval=0.01, max_bytes=1, on_error=on_error
                    )
                )
                await twice.wait()
                tasks.cancel_scope.cancel()

    anyio.run(run)
    assert all(isinstance(e, NotADirectoryError) for e in errors)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"interval": 0.0, "max_age": WEEK},
        {"interval": float("nan"), "max_age": WEEK},
        {"interval": 1.0},
    ],
)
def test_prune_periodically_refuses_bad_arguments_at_once(
    tmp_path: Path, kwargs: dict[str, object]
) -> None:
    with pytest.raises(ValueError):
        anyio.run(functools.partial(prune_periodically, tmp_path, **kwargs))  # type: ignore[arg-type]


@contextmanager
def served(app: Any) -> Iterator[uvicorn.Server]:
    """``app`` served by uvicorn on a random port for the ``with`` block."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive(), "the server did not stop"


def test_the_proxy_app_prunes_in_the_background_and_stops_at_shutdown(tmp_path: Path) -> None:
    old = persist(tmp_path, "s", "toolu_old", "o")
    age(old, 30, base=datetime.now().timestamp())
    pruned = threading.Event()
    stopped = threading.Event()

    def on_report(report: PruneReport) -> None:
        if report.removed:
            pruned.set()

    async def prune_until_cancelled() -> None:
        try:
            await prune_periodically(tmp_path, interval=0.01, max_age=WEEK, on_report=on_report)
        finally:
            stopped.set()

    app = build_app(
        pipeline=lambda: Pipeline([]),
        root=tmp_path,
        upstream="http://127.0.0.1:9",
        background=[prune_until_cancelled],
    )
    with served(app):
        assert pruned.wait(timeout=60)  # a hang guard, not a timing assertion
        assert not stopped.is_set()
    assert stopped.is_set()  # cancelled when the app shut down
    assert not old.exists()


# ---------------------------------------------------------------------------------------------
# durations and sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30m", timedelta(minutes=30)),
        ("12h", timedelta(hours=12)),
        ("7d", timedelta(days=7)),
        ("2w", timedelta(weeks=2)),
        ("90s", timedelta(seconds=90)),
        ("1.5h", timedelta(minutes=90)),
        (" 7d ", timedelta(days=7)),
    ],
)
def test_durations(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    "text", ["7", "", "d", "7 d", "-7d", "0d", "7y", "7D", "1e3s", "inf", "7d7h", "9" * 30 + "w"]
)
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration|longer than 0|too long"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1000", 1000),
        ("200K", 200 * 1024),
        ("500M", 500 * 1024**2),
        ("2G", 2 * 1024**3),
        ("1T", 1024**4),
        ("1.5G", 1_610_612_736),
        ("10mb", 10 * 1024**2),
        ("10MiB", 10 * 1024**2),
        ("64B", 64),
    ],
)
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "M", "-5M", "0", "0.1", "5X", "5 M", "1e6", "5P", "5iB"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError, match=r"size|at least 1 byte"):
        parse_size(text)


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 bytes"
    assert format_bytes(1023) == "1,023 bytes"
    assert format_bytes(1536) == "1,536 bytes (1.5 KiB)"
    assert format_bytes(3 * 1024**3) == "3,221,225,472 bytes (3.0 GiB)"


# ---------------------------------------------------------------------------------------------
# the store prune command
# ---------------------------------------------------------------------------------------------


def run_main(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _old_and_new(root: Path) -> tuple[Path, Path]:
    old = persist(root, "s", "toolu_old", "o" * 100)
    new = persist(root, "s", "toolu_new", "n" * 100)
    age(old, 30, base=datetime.now().timestamp())
    return old, new


def test_store_prune_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new = _old_and_new(tmp_path)
    code, out, err = run_main(
        capsys, "store", "prune", "--store", tmp_path, "--older-than", "7d", "--json"
    )
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["removed_files"] == report["removed_by_age"] == 1
    assert report["removed_bytes"] == 100 and report["kept_files"] == 1
    assert report["dry_run"] is False and report["errors"] == []
    assert [f["path"] for f in report["files"]] == [str(old)]
    assert not old.exists() and new.exists()


def test_store_prune_dry_run_lists_and_keeps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old, new = _old_and_new(tmp_path)
    code, out, _ = run_main(
        capsys, "store", "prune", "--store", tmp_path, "--max-size", "100", "--dry-run"
    )
    assert code == 0
    first, *listed = out.splitlines()
    assert "would remove 1 persisted result(s), 100 bytes (0 by age, 1 by size)" in first
    assert len(listed) == 1 and str(old) in listed[0] and "by size" in listed[0]
    assert old.exists() and new.exists()


def test_store_prune_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _old_and_new(tmp_path)
    code, out, _ = run_main(
        capsys, "store", "prune", "--store", tmp_path, "--older-than", "12h", "--max-size", "1M"
    )
    assert code == 0
    assert out == (
        f"store {tmp_path}: removed 1 persisted result(s), 100 bytes (1 by age, 0 by size); "
        "kept 1, 100 bytes\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--older-than", "7"], "argument --older-than: expected a duration"),
        (["--older-than", "0d"], "argument --older-than: must be longer than 0"),
        (["--max-size", "5X"], "argument --max-size: expected a size"),
        (["--max-size", "-1"], "argument --max-size: expected a size"),
    ],
)
def test_store_prune_bad_values_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["store", "prune", "--store", str(tmp_path), *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_store_prune_usage_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(capsys, "store", "prune", "--store", tmp_path)
    assert code == 2 and "nothing to prune by" in err
    code, _, err = run_main(
        capsys, "store", "prune", "--store", tmp_path / "no", "--max-size", "1G"
    )
    assert code == 2 and "no such directory" in err
    (tmp_path / "file").write_text("x")
    code, _, err = run_main(
        capsys, "store", "prune", "--store", tmp_path / "file", "--max-size", "1G"
    )
    assert code == 2 and "not a directory" in err
    with pytest.raises(SystemExit) as info:
        main(["store", "prune", "--older-than", "7d"])
    assert info.value.code == 2 and "--store" in capsys.readouterr().err


def test_store_prune_as_a_subprocess(tmp_path: Path) -> None:
    old, new = _old_and_new(tmp_path)
    proc = run_cli("store", "prune", "--store", tmp_path, "--older-than", "1w", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["removed_files"] == 1
    assert not old.exists() and new.exists()
    proc = run_cli("store", "prune", "--store", tmp_path, "--older-than", "a week")
    assert proc.returncode == 2 and "expected a duration" in proc.stderr


# ---------------------------------------------------------------------------------------------
# the proxy
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_the_proxy_prunes_its_store_at_start_up(tmp_path: Path) -> None:
    store = tmp_path / "store"
    old, new = _old_and_new(store)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "pipeline", "proxy", "--store", str(store),
            "--retain", "7d", "--max-store-size", "1M", "--port", str(_free_port()),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )  # fmt: skip
    assert proc.stderr is not None
    lines = []
    try:
        for line in proc.stderr:  # the banner comes once the start-up prune is done
            lines.append(line)
            if line.startswith("sluicegate proxy on"):
                break
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert lines[-1].startswith("sluicegate proxy on"), lines
    assert lines[0] == (
        f"sluicegate proxy: store {store}: removed 1 persisted result(s), 100 bytes "
        "(1 by age, 0 by size); kept 1, 100 bytes\n"
    )
    assert not old.exists() and new.exists()


def test_the_proxy_refuses_bad_retention_values(tmp_path: Path) -> None:
    proc = run_cli("proxy", "--store", tmp_path, "--retain", "forever")
    assert proc.returncode == 2 and "argument --retain: expected a duration" in proc.stderr
    proc = run_cli("proxy", "--store", tmp_path, "--max-store-size", "lots")
    assert proc.returncode == 2 and "argument --max-store-size: expected a size" in proc.stderr
