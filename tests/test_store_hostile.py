"""The file store against what it finds already on disk, on the real file system.

docs/behaviour.md §3 and invariant 7, for a store directory that is not fresh:

- a file under the result's name with other content (a stale run, a second session sharing the
  root, a planted file, a case-insensitive file system folding two ids onto one name) is never
  served: the content goes to ``<stem>.<12 hex of its sha256>.<ext>``, the same name every time;
- an equal file is reused as it is (resume and replay depend on the same path);
- store directories with group/other bits are tightened to 0700, another user's are refused;
- a hard link or another user's file under the name is never served;
- Windows device names (``CON``, ``nul``, ``COM1``, ...) never become file names;
- temp files of crashed writers are removed, those of live writers (other processes) kept;
- a bounded fuzz over hostile ids and planted states (marked ``slow``).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import Message, Pipeline, SessionContext, ToolPolicies
from pipeline.store.files import (
    STALE_TEMP_SECONDS,
    FileToolResultStore,
    OsFileOps,
    StoreError,
    safe_file_stem,
)
from pipeline.store.readback import PersistedOutputReader
from pipeline.testing import QuietLogger
from stages import ToolResultBudget
from tests.builders import assistant, results, tool_result, tool_use, user_text

SESSION = "sess-hostile"
FOREIGN_UID = 65534  # "nobody": a user other than the one running the tests
TEMP_NAME = re.compile(r"\.tmp-([0-9a-f]{8})([0-9a-f]{4})([0-9a-f]{4})-(.+)")

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="making a file another user's needs root (chown)",
)


def _store(root: Path, session: str = SESSION, **kw: Any) -> FileToolResultStore:
    return FileToolResultStore(root, session, **kw)


def _distinct_name(stem: str, text: str, ext: str = "txt") -> str:
    digest = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()[:12]
    return f"{stem}.{digest}.{ext}"


def _plant(path: Path, content: str | bytes, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = content.encode("utf-8") if isinstance(content, str) else content
    path.write_bytes(data)
    path.chmod(mode)
    return path


def _temps(directory: Path) -> list[str]:
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".tmp-"))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# --------------------------------------------------------------------------------------------
# A file already under the name: content checked, mismatch to a distinct name
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_stale_file_with_other_content_is_not_served(tmp_path: Path) -> None:
    store = _store(tmp_path)
    stale = _plant(store.path_for("toolu_x", "txt"), "AAAAAAAAAAAA from an older run")
    path = Path(await store.persist("toolu_x", "ZZZZZZZZZZZZ the new output", "txt"))
    assert path == (store.directory / _distinct_name("toolu_x", "ZZZZZZZZZZZZ the new output"))
    assert path.is_absolute()
    assert path.read_text(encoding="utf-8") == "ZZZZZZZZZZZZ the new output"
    assert _mode(path) == 0o600
    assert stale.read_text(encoding="utf-8") == "AAAAAAAAAAAA from an older run"
    assert _temps(store.directory) == []


@pytest.mark.anyio
@pytest.mark.parametrize("ext", ["txt", "json"])
async def test_equal_existing_file_is_reused_in_place(tmp_path: Path, ext: str) -> None:
    store = _store(tmp_path)
    text = '["same bytes — ü 字"]'
    planted = _plant(store.path_for("toolu_eq", ext), text)
    os.utime(planted, (1_000_000_000, 1_000_000_000))
    before = os.lstat(planted)
    path = await store.persist("toolu_eq", text, ext)
    assert Path(path) == planted.absolute()
    after = os.lstat(planted)
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert planted.read_text(encoding="utf-8") == text
    # its age restarts: retention counts from the last use
    assert after.st_mtime_ns > before.st_mtime_ns
    assert sorted(p.name for p in store.directory.iterdir()) == [planted.name]


@pytest.mark.anyio
async def test_the_distinct_name_is_the_same_on_every_persist(tmp_path: Path) -> None:
    _plant(_store(tmp_path).path_for("toolu_d", "json"), "[1]")
    paths = {await _store(tmp_path).persist("toolu_d", "[2]", "json") for _ in range(3)}
    assert len(paths) == 1
    (path,) = paths
    assert Path(path).name == _distinct_name("toolu_d", "[2]", "json")
    assert Path(path).read_text(encoding="utf-8") == "[2]"
    assert len(list(Path(path).parent.iterdir())) == 2


@pytest.mark.anyio
async def test_other_content_at_the_distinct_name_too_fails_cleanly(tmp_path: Path) -> None:
    store = _store(tmp_path)
    primary = _plant(store.path_for("toolu_b", "txt"), "first")
    distinct = _plant(store.directory / _distinct_name("toolu_b", "second"), "planted")
    with pytest.raises(StoreError) as info:
        await store.persist("toolu_b", "second", "txt")
    assert info.value.errno == errno.EEXIST
    assert primary.read_text(encoding="utf-8") == "first"
    assert distinct.read_text(encoding="utf-8") == "planted"
    assert sorted(p.name for p in store.directory.iterdir()) == sorted(
        [primary.name, distinct.name]
    )


class _RecordingOps(OsFileOps):
    """The real file operations, recording the size of every read."""

    def __init__(self) -> None:
        self.reads: list[int] = []

    def read(self, fd: int, size: int) -> bytes:
        chunk = super().read(fd, size)
        self.reads.append(len(chunk))
        return chunk


@pytest.mark.anyio
async def test_the_comparison_streams_a_large_file_in_chunks(tmp_path: Path) -> None:
    big = "0123456789abcdef\n" * 200_000  # 3.4 MB
    ops = _RecordingOps()
    store = _store(tmp_path, file_ops=lambda _t: ops)
    planted = _plant(store.path_for("toolu_big", "txt"), big)
    assert await store.persist("toolu_big", big, "txt") == str(planted.absolute())
    assert len(ops.reads) >= 4 and max(ops.reads) <= 1 << 20
    assert sum(ops.reads) == len(big)

    # the same size, one byte different at the very end: a distinct file
    ops.reads.clear()
    last = big[:-1] + "!"
    path = await store.persist("toolu_big", last, "txt")
    assert Path(path).name == _distinct_name("toolu_big", last)
    assert Path(path).read_text(encoding="utf-8") == last
    assert max(ops.reads) <= 1 << 20

    # different from the first byte on: one chunk read is enough to know
    ops.reads.clear()
    first = "!" + big[1:]
    await store.persist("toolu_big", first, "txt")
    assert len(ops.reads) == 1


@pytest.mark.anyio
async def test_two_sessions_sharing_a_root_each_read_back_their_own_output(
    tmp_path: Path,
) -> None:
    texts = {"alice": "ALICE\n" * 500, "bob": "BOB\n" * 500}
    paths: dict[str, str] = {}

    async def one(who: str) -> None:
        paths[who] = await _store(tmp_path, "shared").persist("toolu_01", texts[who], "txt")

    async with anyio.create_task_group() as tg:
        for who in texts:
            tg.start_soon(one, who)
    assert paths["alice"] != paths["bob"]
    reader = PersistedOutputReader(_store(tmp_path, "shared").directory)
    for who, text in texts.items():
        assert Path(paths[who]).read_text(encoding="utf-8") == text
        page = await reader({"path": paths[who], "limit": 1})
        assert page.startswith(text.splitlines()[0] + "\n")


def _ctx(root: Path) -> SessionContext:
    return SessionContext(
        SESSION, root, tool_policies=ToolPolicies(cap=1_000), logger=QuietLogger(keep=False)
    )


def _turn(tid: str, content: str) -> list[Message]:
    return [
        user_text("go"),
        assistant("msg_1", tool_use(tid, "Glob")),
        results(tool_result(tid, content)),
    ]


def _sent(messages: list[Message], tid: str) -> Any:
    for m in messages:
        if m.type == "user" and isinstance(m.content, list):
            for b in m.content:
                if b.get("type") == "tool_result" and b["tool_use_id"] == tid:
                    return b.get("content")
    raise AssertionError(f"no result for {tid}")


def _saved_path(replacement: str) -> Path:
    match = re.search(r"Full output saved to: (.+)\n", replacement)
    assert match, replacement
    return Path(match[1])


@pytest.mark.anyio
async def test_a_replay_over_a_stale_store_points_the_preview_at_its_own_file(
    tmp_path: Path,
) -> None:
    pipe = Pipeline([ToolResultBudget(3_000)])
    first = await pipe.run(_turn("t0", "A" * 5_000), _ctx(tmp_path))
    first_path = _saved_path(_sent(first, "t0"))
    # the same transcript, edited, replayed into the same store
    second = await pipe.run(_turn("t0", "Z" * 5_000), _ctx(tmp_path))
    replacement = _sent(second, "t0")
    assert "ZZZZZZZZZZ" in replacement and "AAAA" not in replacement
    second_path = _saved_path(replacement)
    assert second_path != first_path
    assert second_path.read_text(encoding="utf-8") == "Z" * 5_000
    assert first_path.read_text(encoding="utf-8") == "A" * 5_000
    # and the unedited one again: its original path, byte for byte the same replacement
    third = await pipe.run(_turn("t0", "A" * 5_000), _ctx(tmp_path))
    assert _sent(third, "t0") == _sent(first, "t0")


# --------------------------------------------------------------------------------------------
# Directory modes and ownership, hard links and foreign files
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_open_store_directories_are_tightened_to_0700(tmp_path: Path) -> None:
    root = tmp_path / "root"
    session = root / SESSION
    tool_results = session / "tool-results"
    tool_results.mkdir(parents=True)
    root.chmod(0o755)
    session.chmod(0o777)
    tool_results.chmod(0o2777)  # setgid too: new files would take the directory's group
    path = await _store(root).persist("toolu_m", "x", "txt")
    assert _mode(session) == 0o700
    assert _mode(tool_results) == 0o700
    assert _mode(Path(path)) == 0o600
    assert _mode(root) == 0o755  # the root is the caller's choice (it may be a project dir)


@pytest.mark.anyio
async def test_a_symlinked_open_directory_is_refused_and_its_target_keeps_its_mode(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o777)
    (tmp_path / SESSION).mkdir()
    os.symlink(outside, tmp_path / SESSION / "tool-results")
    with pytest.raises(StoreError):
        await _store(tmp_path).persist("toolu_s", "x", "txt")
    assert _mode(outside) == 0o777
    assert list(outside.iterdir()) == []


@needs_root
@pytest.mark.anyio
@pytest.mark.parametrize("which", ["session", "tool-results"])
async def test_store_directories_of_another_user_are_refused(tmp_path: Path, which: str) -> None:
    store = _store(tmp_path)
    store.directory.mkdir(parents=True, mode=0o700)
    foreign = store.directory if which == "tool-results" else store.directory.parent
    os.chown(foreign, FOREIGN_UID, -1)
    with pytest.raises(StoreError) as info:
        await store.persist("toolu_f", "x", "txt")
    assert info.value.errno == errno.EPERM
    assert list(store.directory.iterdir()) == []
    assert os.lstat(foreign).st_uid == FOREIGN_UID

    # through the budget stage: the original is sent, the failure reported
    ctx = _ctx(tmp_path)
    out = await Pipeline([ToolResultBudget(3_000)]).run(_turn("t1", "q" * 5_000), ctx)
    assert _sent(out, "t1") == "q" * 5_000
    assert ctx.report.persist_failed == ["t1"]


@needs_root
@pytest.mark.anyio
async def test_a_file_of_another_user_at_the_name_is_not_served(tmp_path: Path) -> None:
    store = _store(tmp_path)
    planted = _plant(store.path_for("toolu_o", "txt"), "same text", mode=0o666)
    os.chown(planted, FOREIGN_UID, -1)
    path = Path(await store.persist("toolu_o", "same text", "txt"))
    assert path.name == _distinct_name("toolu_o", "same text")
    assert os.lstat(path).st_uid == os.geteuid()
    assert path.read_text(encoding="utf-8") == "same text"
    # its owner can change the planted file at will; ours is unaffected
    planted.write_text("changed by its owner", encoding="utf-8")
    assert path.read_text(encoding="utf-8") == "same text"


@pytest.mark.anyio
@pytest.mark.parametrize("outside_text", ["SECRET CONTENT", "the same output"])
async def test_a_hard_link_at_the_name_is_not_served(tmp_path: Path, outside_text: str) -> None:
    outside = _plant(tmp_path / "outside" / "secret.txt", outside_text)
    store = _store(tmp_path / "root")
    store.directory.mkdir(parents=True, mode=0o700)
    os.link(outside, store.path_for("toolu_h", "txt"))
    path = Path(await store.persist("toolu_h", "the same output", "txt"))
    assert path.name == _distinct_name("toolu_h", "the same output")
    assert os.lstat(path).st_nlink == 1
    assert path.read_text(encoding="utf-8") == "the same output"
    outside.write_text("rewritten through the outside name", encoding="utf-8")
    assert path.read_text(encoding="utf-8") == "the same output"
    assert _temps(store.directory) == []


@pytest.mark.anyio
async def test_a_writers_temp_name_is_not_a_foreign_link(tmp_path: Path) -> None:
    # a writer between its link and its unlink (or whose unlink failed): the final file has
    # a second name, the writer's temp name, and is still the result
    store = _store(tmp_path)
    path = Path(await store.persist("toolu_t", "output", "txt"))
    os.link(path, store.directory / ".tmp-00000000ffffffff-toolu_t.txt")
    assert await store.persist("toolu_t", "output", "txt") == str(path)
    # a temp name of another file's does not count
    os.link(path, store.directory / ".tmp-00000000fffffffe-toolu_other.txt")
    assert Path(await store.persist("toolu_t", "output", "txt")).name == _distinct_name(
        "toolu_t", "output"
    )


# --------------------------------------------------------------------------------------------
# Case-insensitive file systems and Windows device names
# --------------------------------------------------------------------------------------------


class _CaseFoldingOps(OsFileOps):
    """A case-insensitive file system over the real one: every file name is folded to lower
    case on the way in (what APFS or NTFS do to ``ABC.txt`` and ``abc.txt``)."""

    @staticmethod
    def fold(path: Path) -> Path:
        return path.with_name(path.name.lower())

    def mkdir(self, path: Path, mode: int) -> None:
        super().mkdir(self.fold(path), mode)

    def lstat(self, path: Path) -> os.stat_result:
        return super().lstat(self.fold(path))

    def open(self, path: Path, flags: int, mode: int) -> int:
        return super().open(self.fold(path), flags, mode)

    def link(self, src: Path, dst: Path) -> None:
        super().link(self.fold(src), self.fold(dst))

    def unlink(self, path: Path) -> None:
        super().unlink(self.fold(path))


@pytest.mark.anyio
async def test_ids_differing_in_case_get_their_own_content_on_a_case_insensitive_fs(
    tmp_path: Path,
) -> None:
    ops = _CaseFoldingOps()
    store = _store(tmp_path, file_ops=lambda _t: ops)
    texts = {"ABC": "upper-case id's output", "abc": "lower-case id's output", "aBc": "mixed"}
    paths = {tid: await store.persist(tid, text, "txt") for tid, text in texts.items()}
    for tid, text in texts.items():
        # read as that file system would: through the folded name
        assert ops.fold(Path(paths[tid])).read_text(encoding="utf-8") == text, tid
    assert Path(paths["ABC"]).name == "ABC.txt"  # the first keeps its plain name
    assert len({ops.fold(Path(p)) for p in paths.values()}) == 3
    # a resumed session finds the same paths
    for tid, text in texts.items():
        assert (
            await _store(tmp_path, file_ops=lambda _t: ops).persist(tid, text, "txt")
            == (paths[tid])
        )


@pytest.mark.anyio
async def test_a_file_left_by_the_other_case_is_not_served(tmp_path: Path) -> None:
    # on Linux: the file a case-insensitive system would show for "ABC", planted by hand
    store = _store(tmp_path)
    _plant(store.path_for("ABC", "txt"), "what id 'abc' stored")
    path = Path(await store.persist("ABC", "what id 'ABC' produced", "txt"))
    assert path.name == _distinct_name("ABC", "what id 'ABC' produced")
    assert path.read_text(encoding="utf-8") == "what id 'ABC' produced"


WINDOWS_DEVICE_IDS = [
    "CON",
    "con",
    "Con",
    "PRN",
    "aux",
    "NUL",
    "nul",
    "COM0",
    "COM1",
    "com9",
    "LPT0",
    "LPT1",
    "lPt9",
    "CON.txt",
    "nul.json",
    "aux.tar.gz",
]


@pytest.mark.anyio
@pytest.mark.parametrize("tid", WINDOWS_DEVICE_IDS)
async def test_windows_device_names_are_hashed(tmp_path: Path, tid: str) -> None:
    expected = "unsafe." + hashlib.sha256(tid.encode()).hexdigest()
    assert safe_file_stem(tid) == expected
    path = Path(await _store(tmp_path).persist(tid, "output", "txt"))
    assert path.name == expected + ".txt"
    assert path.read_text(encoding="utf-8") == "output"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "tid",
    [
        "toolu_01XCkReV4rCWtDVEP82QJgZH",
        "CONSOLE",
        "COM10",
        "LPT",
        "NULL",
        "AUX_1",
        "con_1",
        "COMX",
        "nul-",
        "call_abc123",
    ],
)
async def test_ordinary_ids_keep_their_file_names(tmp_path: Path, tid: str) -> None:
    assert safe_file_stem(tid) == tid
    path = Path(await _store(tmp_path).persist(tid, "output", "txt"))
    assert path == (tmp_path / SESSION / "tool-results" / f"{tid}.txt").absolute()


# --------------------------------------------------------------------------------------------
# Temp files left by crashed writers
# --------------------------------------------------------------------------------------------

# A writer in another process: persists one id and, at ``fsync`` (the temp file complete,
# not yet linked), either kills itself with SIGKILL or signals the parent and waits forever.
WRITER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    import anyio
    from pipeline.store.files import FileToolResultStore, OsFileOps

    root, session, tid, how, marker = sys.argv[1:6]

    class Ops(OsFileOps):
        def fsync(self, fd):
            super().fsync(fd)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            Path(marker).touch()
            time.sleep(120)

    store = FileToolResultStore(root, session, file_ops=lambda _t: Ops())
    anyio.run(store.persist, tid, "partial output of " + tid, "txt")
    """
)


def _writer(tmp_path: Path, root: Path, tid: str, how: str) -> subprocess.Popen[bytes]:
    script = tmp_path / "writer.py"
    script.write_text(WRITER, encoding="utf-8")
    marker = tmp_path / f"{tid}.marker"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root), SESSION, tid, how, str(marker)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    if how == "wait":
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
            assert time.monotonic() < deadline, "the writer never reached fsync"
            time.sleep(0.02)
    else:
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else b""
    return proc


@pytest.fixture
def live_writer(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A writer process stopped with its complete temp file not yet linked."""
    proc = _writer(tmp_path, tmp_path / "root", "toolu_live", "wait")
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if proc.stderr:
            proc.stderr.close()


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
@pytest.mark.anyio
async def test_temp_files_of_a_killed_writer_are_removed_on_first_use(tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = _writer(tmp_path, root, "toolu_dead", "kill")
    if proc.stderr:
        proc.stderr.close()
    store = _store(root)
    (leftover,) = _temps(store.directory)
    assert leftover.endswith("-toolu_dead.txt")
    assert not store.path_for("toolu_dead", "txt").exists()

    path = await store.persist("toolu_next", "next", "txt")
    assert _temps(store.directory) == []
    assert Path(path).read_text(encoding="utf-8") == "next"
    path = await store.persist("toolu_dead", "complete output", "txt")
    assert Path(path).name == "toolu_dead.txt"
    assert Path(path).read_text(encoding="utf-8") == "complete output"


@pytest.mark.skipif(sys.platform == "win32", reason="signals")
@pytest.mark.anyio
async def test_temp_files_of_a_live_writer_in_another_process_are_kept(
    tmp_path: Path, live_writer: subprocess.Popen[bytes]
) -> None:
    root = tmp_path / "root"
    store = _store(root)
    (live,) = _temps(store.directory)
    await store.persist("toolu_mine", "mine", "txt")
    assert _temps(store.directory) == [live]
    assert _store(root).remove_stale_temps() == []

    live_writer.kill()
    live_writer.wait(timeout=30)
    assert _store(root).remove_stale_temps() == [store.directory / live]
    assert _temps(store.directory) == []


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_only_temp_files_of_dead_writers_here_or_old_ones_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = _writer(tmp_path, root, "toolu_dead", "kill")
    if proc.stderr:
        proc.stderr.close()
    store = _store(root)
    (dead,) = _temps(store.directory)
    match = TEMP_NAME.fullmatch(dead)
    assert match is not None
    pid, tag, rand = match[1], int(match[2], 16), match[3]
    assert int(pid, 16) == proc.pid
    # the same dead pid, written on another host (or pid namespace): kept while fresh
    elsewhere = _plant(store.directory / f".tmp-{pid}{tag ^ 0xFFFF:04x}{rand}-x.txt", "p")
    old_elsewhere = _plant(store.directory / f".tmp-{pid}{tag ^ 0xFFFF:04x}{rand}-y.txt", "p")
    # a live writer (this process) whose file is a day old: removed by age
    mine = f"{os.getpid():08x}{tag:04x}{rand}"
    old_mine = _plant(store.directory / f".tmp-{mine}-z.txt", "p")
    fresh_mine = _plant(store.directory / f".tmp-{mine}-w.txt", "p")
    day_ago = time.time() - STALE_TEMP_SECONDS - 60
    for p in (old_elsewhere, old_mine):
        os.utime(p, (day_ago, day_ago))
    # not temp files of the store: never touched
    unrelated = [
        _plant(store.directory / ".tmp-notours.txt", "p"),
        _plant(store.directory / f".tmp-{pid}{tag:04x}{rand}", "p"),
        _plant(store.directory / "toolu_kept.txt", "p"),
    ]
    a_dir = store.directory / f".tmp-{pid}{tag:04x}{rand}-d.txt"
    a_dir.mkdir()

    removed = store.remove_stale_temps()
    assert sorted(removed) == sorted([store.directory / dead, old_elsewhere, old_mine])
    left = {p.name for p in store.directory.iterdir()}
    assert left == {elsewhere.name, fresh_mine.name, a_dir.name, *(p.name for p in unrelated)}


# Many writers in other processes persist while the parent sweeps the same directory over and
# over: no writer may lose its temp file to a sweep.
CONCURRENT_WRITER = textwrap.dedent(
    """
    import sys
    import anyio
    from pipeline.store.files import FileToolResultStore

    root, session, who, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    async def main():
        for i in range(n):
            # a new store object each time: each one sweeps on its first persist
            store = FileToolResultStore(root, session)
            text = f"{who}:{i}:" + "x" * 20_000
            path = await store.persist(f"toolu_{who}_{i}", text, "txt")
            assert open(path, encoding="utf-8").read() == text, path

    anyio.run(main)
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="pids")
def test_sweeping_never_breaks_concurrent_writers_in_other_processes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    script = tmp_path / "concurrent_writer.py"
    script.write_text(CONCURRENT_WRITER, encoding="utf-8")
    n = 60
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(root), SESSION, f"w{k}", str(n)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for k in range(4)
    ]
    sweeps = 0
    try:
        while any(p.poll() is None for p in procs):
            removed = _store(root).remove_stale_temps()
            assert removed == [], removed
            sweeps += 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=60)
    for p in procs:
        assert p.returncode == 0, p.stderr.read() if p.stderr else b""
        if p.stderr:
            p.stderr.close()
    assert sweeps > 0
    directory = _store(root).directory
    assert _temps(directory) == []
    assert len(list(directory.iterdir())) == 4 * n


# --------------------------------------------------------------------------------------------
# Fuzz: hostile ids against planted states
# --------------------------------------------------------------------------------------------

PLANTS = [
    "none",
    "same",
    "other",
    "hardlink_same",
    "hardlink_other",
    "symlink",
    "dangling_symlink",
    "directory",
    "fifo",
    "foreign_same",
]
ACCEPTED = {"none", "same"}  # what a name may hold for the store to use it
MISMATCH = {"other", "hardlink_same", "hardlink_other", "foreign_same"}  # regular, not ours

HOSTILE_IDS = [
    "../../etc/passwd",
    "a/b",
    "..",
    ".",
    "",
    "x" * 129,
    "nul\x00byte",
    "lone\ud800surrogate",
    "CON",
    "nul",
    "Com1",
    "ABC",
    "abc",
    "toolu_01XCkReV4rCWtDVEP82QJgZH",
    "unsafe",
    ".tmp-0000000100000000-x",
]
ids = st.one_of(
    st.sampled_from(HOSTILE_IDS),
    st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True),
    st.text(st.characters(exclude_categories=()), max_size=40),
)
texts = st.text(st.characters(exclude_categories=()), max_size=300)


def _plant_state(path: Path, state: str, data: bytes, outside: Path) -> None:
    """Put ``state`` at ``path`` (the directory exists); returns nothing."""
    if state == "none":
        return
    if state in ("same", "other"):
        path.write_bytes(data if state == "same" else data + b"#other")
    elif state in ("hardlink_same", "hardlink_other"):
        src = outside / f"linked-{path.name}"
        src.write_bytes(data if state == "hardlink_same" else b"outside " + data)
        os.link(src, path)
    elif state == "symlink":
        src = outside / f"target-{path.name}"
        src.write_bytes(data)
        os.symlink(src, path)
    elif state == "dangling_symlink":
        os.symlink(outside / f"missing-{path.name}", path)
    elif state == "directory":
        path.mkdir()
    elif state == "fifo":
        os.mkfifo(path)
    elif state == "foreign_same":
        path.write_bytes(data)
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            os.chown(path, FOREIGN_UID, -1)
        else:  # cannot give a file away without root: plant other content instead
            path.write_bytes(data + b"#other")
    else:  # pragma: no cover
        raise AssertionError(state)


def _snapshot(top: Path) -> dict[str, tuple[str, bytes | str | None]]:
    """Every entry under ``top``: its kind and content (symlinks not followed)."""
    out: dict[str, tuple[str, bytes | str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st_ = os.lstat(p)
            if stat.S_ISLNK(st_.st_mode):
                out[str(p)] = ("link", os.readlink(p))
            elif stat.S_ISREG(st_.st_mode):
                out[str(p)] = ("file", p.read_bytes())
            elif stat.S_ISDIR(st_.st_mode):
                out[str(p)] = ("dir", None)
            else:
                out[str(p)] = ("other", None)
    return out


@pytest.mark.slow
@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(
    tid=ids,
    text=texts,
    ext=st.sampled_from(["txt", "json"]),
    at_name=st.sampled_from(PLANTS),
    at_distinct=st.sampled_from(PLANTS),
    open_dirs=st.booleans(),
)
def test_fuzz_hostile_ids_and_planted_files(
    tid: str, text: str, ext: str, at_name: str, at_distinct: str, open_dirs: bool
) -> None:
    with tempfile.TemporaryDirectory(prefix="sluicegate-hostile-") as tmp:
        sandbox = Path(tmp)
        outside = sandbox / "outside"
        outside.mkdir()
        store = _store(sandbox / "root")
        directory = store.directory
        directory.mkdir(parents=True)
        if open_dirs:
            directory.chmod(0o777)
            directory.parent.chmod(0o777)
        data = text.encode("utf-8", errors="surrogatepass")
        name = store.path_for(tid, ext)
        distinct = directory / _distinct_name(name.name.rsplit(".", 1)[0], text, ext)
        _plant_state(name, at_name, data, outside)
        _plant_state(distinct, at_distinct, data, outside)
        before = _snapshot(sandbox)

        try:
            path: Path | None = Path(anyio.run(store.persist, tid, text, ext))
        except OSError:  # StoreError included: the caller sends the original
            path = None

        # which outcome: the name when it holds nothing or the same bytes, else the distinct
        # name on the same terms, else a clean failure
        if at_name in ACCEPTED:
            assert path == name.absolute()
        elif at_name in MISMATCH and at_distinct in ACCEPTED:
            assert path == distinct.absolute()
        else:
            assert path is None
        if path is not None:
            st_ = os.lstat(path)
            assert stat.S_ISREG(st_.st_mode) and st_.st_nlink == 1
            assert st_.st_uid == os.lstat(directory).st_uid
            assert path.read_bytes() == data
        # nothing changed but the one new file inside tool-results; no temp file left
        after = _snapshot(sandbox)
        added = set(after) - set(before)
        assert added <= ({str(path)} if path is not None else set()), added
        assert set(before) <= set(after)
        assert {k: after[k] for k in before} == before
        assert _temps(directory) == []
        assert _mode(directory) == _mode(directory.parent) == 0o700
