"""A transcript writer that keeps its descriptor between appends (``hold_open=True``): the same
lines as one that opens the file every time; a file removed or replaced is opened again as
safely as the first time (a planted link: ``test_transcript_hostile.py``); the descriptors
held in a process are bounded; a forked child and the garbage collector close theirs."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipeline import Message, TranscriptWriter, load_transcript
from pipeline.transcript.open_files import OpenFiles

SESSION = "held"


def _held_descriptors(*paths: Path) -> int:
    """How many of this process's descriptors are open on one of ``paths``."""
    wanted = {os.path.realpath(p) for p in paths}
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own descriptor, closed meanwhile
        count += target in wanted
    return count


def _texts(path: Path) -> list[str]:
    return [str(m.content) for m in load_transcript(path).messages]


def _writer(path: Path, files: OpenFiles | None = None) -> TranscriptWriter:
    return TranscriptWriter(
        path,
        SESSION,
        fsync_each=False,
        hold_open=True,
        open_files=files if files is not None else OpenFiles(),
    )


pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


def test_held_appends_write_the_same_lines_and_keep_one_descriptor(tmp_path: Path) -> None:
    held, opened = tmp_path / "held" / "t.jsonl", tmp_path / "opened" / "t.jsonl"
    a = _writer(held)
    b = TranscriptWriter(opened, SESSION, fsync_each=False)
    for k in range(5):
        for w in (a, b):
            w.append_messages([Message.user(f"m{k}", uuid=f"u{k}", timestamp="t")])
            w.append_stage_record("s", {"k": k})
        assert _held_descriptors(held) == 1 and _held_descriptors(opened) == 0
    assert held.read_bytes() == opened.read_bytes()
    a.close()
    assert _held_descriptors(held) == 0
    a.append_messages([Message.user("after close")])  # opens it again
    assert _texts(held)[-1] == "after close"


def test_a_sync_fsyncs_the_file_held_without_opening_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync of a held file opens nothing (opening the directory and the file again was a
    third of a sync's CPU, once a call), and leaves the held descriptor as it was."""
    path = tmp_path / "c" / "t.jsonl"
    writer = _writer(path)
    writer.append_messages([Message.user("one", uuid="u1", timestamp="t")])
    opened: list[object] = []
    real_open = os.open

    def counted(*args: object, **kwargs: object) -> int:
        opened.append(args[0])
        return real_open(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", counted)
    writer.sync()
    assert opened == []
    monkeypatch.undo()
    assert _held_descriptors(path) == 1
    writer.append_messages([Message.user("two", uuid="u2", timestamp="t")])
    writer.sync()
    assert _texts(path) == ["one", "two"]
    writer.close()
    writer.append_stage_record("s", {"k": 1})  # nothing held now: the sync opens the path
    writer.sync()
    assert _texts(path) == ["one", "two"]


def test_a_sync_after_the_file_moved_away_syncs_the_file_the_lines_went_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c" / "t.jsonl"
    writer = _writer(path)
    writer.append_messages([Message.user("one", uuid="u1", timestamp="t")])
    moved = tmp_path / "moved.jsonl"
    path.rename(moved)
    synced: list[int] = []
    real_fsync = os.fsync

    def recorded(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    writer.sync()  # the held file, now at its new name (opening the old one finds nothing)
    assert synced == [moved.stat().st_ino]
    assert not path.exists()
    assert _texts(moved) == ["one"]
    writer.close()


def test_a_removed_file_is_made_again_and_its_directory_too(tmp_path: Path) -> None:
    path = tmp_path / "s" / "t.jsonl"
    writer = _writer(path)
    writer.append_messages([Message.user("gone with it")])
    path.unlink()
    path.parent.rmdir()
    writer.append_messages([Message.user("new")])
    assert _texts(path) == ["new"]
    assert stat_mode(path) == 0o600 and stat_mode(path.parent) == 0o700
    assert _held_descriptors(path) == 1


def stat_mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o777


def test_a_file_replaced_by_another_is_appended_to_at_its_path(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = _writer(path)
    writer.append_messages([Message.user("old")])
    other = tmp_path / "other.jsonl"
    TranscriptWriter(other, SESSION).append_messages([Message.user("theirs", uuid="x")])
    os.replace(other, path)
    writer.append_messages([Message.user("mine")])
    assert _texts(path) == ["theirs", "mine"]


def test_a_file_moved_away_is_opened_again_at_its_path(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = _writer(path)
    writer.append_messages([Message.user("one")])
    moved = tmp_path / "moved.jsonl"
    os.rename(path, moved)
    writer.append_messages([Message.user("two")])
    assert _texts(moved) == ["one"] and _texts(path) == ["two"]


def test_a_line_torn_by_another_writer_is_not_glued_to(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = _writer(path)
    writer.append_messages([Message.user("one", uuid="u1")])
    with open(path, "ab") as f:
        f.write(b'{"type": "user", "uuid": "torn", "mess')  # a writer that crashed midway
    writer.append_messages([Message.user("two", uuid="u2")])
    lenient = load_transcript(path, strict=False)
    assert [m.uuid for m in lenient.messages] == ["u1", "u2"] and len(lenient.problems) == 1


def test_the_descriptors_held_are_bounded_least_recently_used_first(tmp_path: Path) -> None:
    files = OpenFiles(limit=2)
    paths = [tmp_path / f"t{k}.jsonl" for k in range(5)]
    writers = [_writer(p, files) for p in paths]
    for round_ in range(3):
        for k, w in enumerate(writers):
            w.append_stage_record("s", {"round": round_, "k": k})
            assert _held_descriptors(*paths) <= 2 and len(files) <= 2
    assert _held_descriptors(paths[-1], paths[-2]) == 2  # the two used last
    for k, p in enumerate(paths):
        lines = [json.loads(line)["data"] for line in p.read_text().splitlines()]
        assert lines == [{"round": r, "k": k} for r in range(3)]


def test_a_writer_in_the_middle_of_an_append_is_passed_over(tmp_path: Path) -> None:
    files = OpenFiles(limit=1)
    busy, other = _writer(tmp_path / "busy.jsonl", files), _writer(tmp_path / "o.jsonl", files)
    busy.append_stage_record("s", {})
    with busy._lock:  # as an append in another thread holds it
        other.append_stage_record("s", {})  # over the limit: busy cannot be closed now
        assert _held_descriptors(tmp_path / "busy.jsonl") == 1
    other.append_stage_record("s", {})
    busy.append_stage_record("s", {})  # now the other one goes
    assert _held_descriptors(tmp_path / "o.jsonl") == 0
    assert _held_descriptors(tmp_path / "busy.jsonl") == 1


def test_a_collected_writer_closes_its_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = _writer(path)
    writer.append_stage_record("s", {})
    assert _held_descriptors(path) == 1
    del writer
    gc.collect()
    assert _held_descriptors(path) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_opens_the_file_again_and_both_append_whole_lines(tmp_path: Path) -> None:
    files = OpenFiles()
    path = tmp_path / "t.jsonl"
    writer = _writer(path, files)
    writer.append_messages([Message.user("parent 1", uuid="p1")])
    pid = os.fork()
    if pid == 0:  # the child: its copy of the descriptor is closed, the file opened again
        code = 1
        try:
            assert writer._file is not None
            held_before = writer._file.fd
            writer.append_stage_record("child", {"ok": True})
            code = 0 if held_before is None and writer._file.fd is not None else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    writer.append_messages([Message.user("parent 2", uuid="p2")])
    kinds = [json.loads(line).get("stage", "msg") for line in path.read_text().splitlines()]
    assert kinds == ["msg", "child", "msg"]


_AT_EXIT = """
import sys
from pathlib import Path
from pipeline.dropin.thread_sync import ThreadSync
from pipeline.transcript.writer import TranscriptWriter

syncs = ThreadSync(window=60)  # registered for the exit before any writer holds a descriptor
root = Path(sys.argv[1])
a, b, c = (
    TranscriptWriter(root / n / "d.jsonl", n, fsync_each=False, hold_open=True) for n in "abc"
)
a.append_stage_record("first", {})
b.append_stage_record("first", {})
for w in (c, b, a):
    w.append_stage_record_later("later", {})
    syncs.add(w.sync)  # left for the exit
"""


def test_what_runs_at_the_exit_still_writes_through_the_held_descriptors(tmp_path: Path) -> None:
    """A sync left for the interpreter's exit (``wrap``'s sync thread flushes then) writes each
    writer's held-back record into its own file: the descriptors are not closed before it."""
    script = tmp_path / "at_exit.py"
    script.write_text(_AT_EXIT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    for name in "abc":
        lines = [
            json.loads(line) for line in (tmp_path / name / "d.jsonl").read_text().splitlines()
        ]
        assert {line["sessionId"] for line in lines} == {name}, lines
        assert [line["stage"] for line in lines] == (
            ["later"] if name == "c" else ["first", "later"]
        )
    assert "failed" not in done.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("hold_open", [False, True])
def test_a_fork_while_another_thread_appends_leaves_the_child_free_to_append(
    tmp_path: Path, hold_open: bool
) -> None:
    """The writer's lock is copied into a forked child as the fork found it: held by a thread
    the child does not have. The child's writers start with locks of their own (and without
    the parent's held-back records, which the parent writes)."""
    writer = TranscriptWriter(tmp_path / "d.jsonl", "s", fsync_each=False, hold_open=hold_open)
    writer.append_stage_record_later("parents", {})
    with writer._lock:  # as another thread in the middle of an append holds it
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                done = threading.Event()

                def append() -> None:
                    writer.append_stage_record("child", {})
                    done.set()

                threading.Thread(target=append, daemon=True).start()
                code = 0 if done.wait(10) else 3
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # 3: the child's append hung
    writer.append_stage_record("parent", {})
    kinds = [json.loads(line)["stage"] for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert kinds == ["child", "parents", "parent"]
