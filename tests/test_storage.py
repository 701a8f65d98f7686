"""The tool-result store on a real file system, and what the budget stage does when it fails.

docs/behaviour.md §3 and invariant 7: an existing file reused only when it holds the same bytes,
0600 files / 0700 directories, ``.txt`` vs ``.json``, hostile tool_use_ids that never escape
``<root>/<session>/tool-results/``, symlinks planted in the store's way, a store that cannot write
(the turn completes with the original content, the id is frozen), and a crash between the temp
write and the link. Planted files, foreign directories and leftover temp files: test_store_hostile.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import (
    FileToolResultStore,
    Message,
    Pipeline,
    SessionContext,
    ToolPolicies,
    ToolResultStore,
    TranscriptWriter,
    load_transcript,
    to_api,
)
from pipeline.gate import persist_content
from pipeline.store.files import OsFileOps, StoreError, safe_file_stem
from stages import ToolResultBudget
from tests.builders import assistant, key, results, tool_result, tool_use, user_text

SESSION = "sess-1"
PERSISTED = "<persisted-output>"


class _QuietLogger:
    """A structlog-shaped logger that drops everything (keeps test output readable)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def bind(self, **_kw: Any) -> _QuietLogger:
        return self

    def _log(self, level: str, event: str, **kw: Any) -> None:
        self.events.append((level, event, kw))

    def debug(self, event: str, **kw: Any) -> None:
        self._log("debug", event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._log("info", event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._log("warning", event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._log("error", event, **kw)


def _all_files(root: Path) -> list[Path]:
    """Every non-directory entry under ``root`` (symlinks included, not followed)."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if Path(dirpath, d).is_symlink()]:
            out.append(Path(dirpath, name))
    return sorted(out)


def _tmp_leftovers(directory: Path) -> list[str]:
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".tmp-"))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _store(root: Path, session: str = SESSION) -> FileToolResultStore:
    return FileToolResultStore(root, session)


# --------------------------------------------------------------------------------------------
# The file store itself
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_persist_writes_exact_utf8_bytes_under_the_session_dir(tmp_path: Path) -> None:
    store = _store(tmp_path / "store")
    text = "line one\r\nzwei — ü 字 😀\n\x00tail\n"
    path = await store.persist("toolu_01", text, "txt")
    expected = tmp_path / "store" / SESSION / "tool-results" / "toolu_01.txt"
    assert path == str(expected.absolute())
    assert Path(path).is_absolute()
    assert expected.read_bytes() == text.encode("utf-8")
    assert _tmp_leftovers(expected.parent) == []


@pytest.mark.anyio
async def test_relative_root_still_returns_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = FileToolResultStore(".sluicegate", SESSION)
    path = await store.persist("toolu_rel", "x", "txt")
    assert Path(path).is_absolute()
    assert Path(path) == tmp_path / ".sluicegate" / SESSION / "tool-results" / "toolu_rel.txt"
    assert Path(path).read_text(encoding="utf-8") == "x"


@pytest.mark.anyio
async def test_same_id_same_content_reuses_the_file_other_content_gets_its_own(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    first = await store.persist("toolu_same", "first content", "txt")
    inode = os.lstat(first).st_ino
    # the same content again (a resumed session, a replay): the same file, untouched
    assert await store.persist("toolu_same", "first content", "txt") == first
    assert await _store(tmp_path).persist("toolu_same", "first content", "txt") == first
    assert os.lstat(first).st_ino == inode
    # other content under the same id: never served the first file's bytes
    second = await store.persist("toolu_same", "SECOND, different", "txt")
    digest = hashlib.sha256(b"SECOND, different").hexdigest()[:12]
    assert Path(second).name == f"toolu_same.{digest}.txt"
    assert Path(second).read_text(encoding="utf-8") == "SECOND, different"
    assert Path(first).read_text(encoding="utf-8") == "first content"
    # a second store object on the same directory (a resumed session) finds the same paths
    assert await _store(tmp_path).persist("toolu_same", "SECOND, different", "txt") == second
    assert await _store(tmp_path).persist("toolu_same", "first content", "txt") == first
    assert sorted(p.name for p in Path(first).parent.iterdir()) == sorted(
        [Path(first).name, Path(second).name]
    )


@pytest.mark.anyio
async def test_files_are_0600_and_directories_0700_even_with_a_permissive_umask(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    old = os.umask(0)
    try:
        path = Path(await _store(root).persist("toolu_perm", "secret", "txt"))
    finally:
        os.umask(old)
    assert _mode(path) == 0o600
    assert stat.S_ISREG(os.lstat(path).st_mode)
    assert _mode(root / SESSION / "tool-results") == 0o700
    assert _mode(root / SESSION) == 0o700
    assert _mode(root) == 0o700
    json_path = Path(await _store(root).persist("toolu_perm2", "[]", "json"))
    assert _mode(json_path) == 0o600


@pytest.mark.anyio
async def test_txt_and_json_of_one_id_are_distinct_files(tmp_path: Path) -> None:
    store = _store(tmp_path)
    p_txt = await store.persist("toolu_x", "plain", "txt")
    p_json = await store.persist("toolu_x", '["j"]', "json")
    assert p_txt.endswith("toolu_x.txt")
    assert p_json.endswith("toolu_x.json")
    assert Path(p_txt).read_text(encoding="utf-8") == "plain"
    assert Path(p_json).read_text(encoding="utf-8") == '["j"]'


@pytest.mark.anyio
@pytest.mark.parametrize("ext", ["md", "", "txt/../x", "../txt", "TXT", "json "])
async def test_unknown_extension_is_rejected_before_touching_the_disk(
    tmp_path: Path, ext: str
) -> None:
    with pytest.raises(ValueError, match="extension"):
        await _store(tmp_path / "store").persist("toolu_e", "x", ext)
    assert not (tmp_path / "store").exists()


@pytest.mark.anyio
async def test_persist_content_str_goes_to_txt_and_block_list_to_pretty_json(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    text = "abc\n" * 10
    p1 = await persist_content(store, "toolu_s", text)
    assert p1.path.endswith("/toolu_s.txt")
    assert Path(p1.path).read_bytes() == text.encode("utf-8")
    assert p1.chars == len(text)

    blocks = [{"type": "text", "text": 'héllo\n"quoted"\t字'}, {"type": "text", "text": "two"}]
    p2 = await persist_content(store, "toolu_b", blocks)
    assert p2.path.endswith("/toolu_b.json")
    on_disk = Path(p2.path).read_text(encoding="utf-8")
    assert on_disk == json.dumps(blocks, indent=2, ensure_ascii=False)
    assert json.loads(on_disk) == blocks
    assert p2.chars == len(on_disk)

    with pytest.raises(ValueError):
        await persist_content(store, "toolu_img", [{"type": "image", "source": {}}])
    assert not list((tmp_path / SESSION / "tool-results").glob("toolu_img*"))


HOSTILE_IDS = [
    "../../etc/passwd",
    "../escape",
    "a/b",
    "/abs/path",
    "..",
    ".",
    "...",
    "",
    " ",
    "\t",
    "\n",
    "x" * 200,
    "x" * 129,
    "nul\x00byte",
    "\x00",
    "ツール_結果",
    "emoji😀",
    "back\\slash",
    "C:\\Windows",
    ".hidden",
    "~",
    "$HOME",
    "a b",
    "toolu_01.txt",
    "lone\ud800surrogate",
]


@pytest.mark.anyio
async def test_hostile_ids_never_escape_and_never_share_a_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = _store(root)
    directory = (root / SESSION / "tool-results").resolve()
    paths: dict[str, str] = {}
    for i, tid in enumerate(HOSTILE_IDS):
        text = f"content #{i} for {tid!r}"
        path = await store.persist(tid, text, "txt")
        resolved = Path(path).resolve()
        assert resolved.parent == directory, (tid, path)
        assert Path(path).parent == root.absolute() / SESSION / "tool-results", (tid, path)
        name = Path(path).name
        assert name.startswith("unsafe.") and name.endswith(".txt"), (tid, name)
        assert "\x00" not in path
        assert resolved.read_text(encoding="utf-8", errors="surrogatepass") == text
        paths[tid] = path
    # injective: every hostile id got its own file
    assert len(set(paths.values())) == len(HOSTILE_IDS)
    # nothing anywhere but the expected files
    assert _all_files(tmp_path) == sorted(Path(p) for p in paths.values())
    assert _tmp_leftovers(directory) == []


@pytest.mark.anyio
async def test_id_that_looks_like_a_mapped_name_does_not_collide(tmp_path: Path) -> None:
    store = _store(tmp_path)
    hostile = "../../etc/passwd"
    mapped_stem = "unsafe." + hashlib.sha256(hostile.encode()).hexdigest()
    assert safe_file_stem(hostile) == mapped_stem
    p_hostile = await store.persist(hostile, "the hostile one", "txt")
    p_lookalike = await store.persist(mapped_stem, "the look-alike", "txt")
    assert p_hostile != p_lookalike
    assert Path(p_hostile).read_text(encoding="utf-8") == "the hostile one"
    assert Path(p_lookalike).read_text(encoding="utf-8") == "the look-alike"
    # the look-alike in the other order, on a fresh store
    store2 = _store(tmp_path / "other")
    q_lookalike = await store2.persist(mapped_stem, "look-alike first", "txt")
    q_hostile = await store2.persist(hostile, "hostile second", "txt")
    assert Path(q_lookalike).read_text(encoding="utf-8") == "look-alike first"
    assert Path(q_hostile).read_text(encoding="utf-8") == "hostile second"


def test_safe_ids_are_used_as_is_up_to_128_chars() -> None:
    assert safe_file_stem("toolu_01ABC-xyz_9") == "toolu_01ABC-xyz_9"
    assert safe_file_stem("a" * 128) == "a" * 128
    assert safe_file_stem("a" * 129).startswith("unsafe.")
    assert safe_file_stem("unsafe_abc") == "unsafe_abc"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300), st.text(max_size=300))
def test_file_stem_is_always_a_single_safe_component_and_injective(a: str, b: str) -> None:
    for tid in (a, b):
        stem = safe_file_stem(tid)
        assert stem not in ("", ".", "..")
        assert "/" not in stem and "\x00" not in stem and "\\" not in stem
        assert len(stem) <= 128 + len("unsafe.")
        assert all(c.isascii() and (c.isalnum() or c in "_-.") for c in stem)
        if stem != tid:
            assert stem.startswith("unsafe.") and len(stem) == len("unsafe.") + 64
    if a != b:
        assert safe_file_stem(a) != safe_file_stem(b)


BAD_SESSION_IDS = [
    "",
    ".",
    "..",
    "../x",
    "a/b",
    "/abs",
    "a\x00b",
    "x" * 129,
    "ü",
    "a b",
    "a\\b",
    "s\n",
]


@pytest.mark.parametrize("session_id", BAD_SESSION_IDS)
def test_invalid_session_ids_are_rejected(tmp_path: Path, session_id: str) -> None:
    with pytest.raises(ValueError, match="session_id"):
        SessionContext(session_id, tmp_path)
    with pytest.raises(ValueError, match="session_id"):
        FileToolResultStore(tmp_path, session_id)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("session_id", [None, 7, b"abc"])
def test_non_string_session_ids_are_rejected(tmp_path: Path, session_id: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        SessionContext(session_id, tmp_path)


@pytest.mark.parametrize("session_id", ["s1", "a.b", "x" * 128, "UUID-1234_abcd", "..."])
def test_valid_session_ids_are_accepted(tmp_path: Path, session_id: str) -> None:
    ctx = SessionContext(session_id, tmp_path)
    assert ctx.session_id == session_id


# -- symlinks and non-files in the store's way ------------------------------------------------


@pytest.mark.anyio
async def test_symlinked_tool_results_dir_is_refused_and_nothing_is_written_outside(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / SESSION).mkdir(parents=True)
    os.symlink(outside, root / SESSION / "tool-results")
    with pytest.raises(OSError) as info:
        await _store(root).persist("toolu_sym", "must not land outside", "txt")
    assert isinstance(info.value, StoreError)
    assert list(outside.iterdir()) == []


@pytest.mark.anyio
async def test_symlinked_session_dir_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    root.mkdir()
    os.symlink(outside, root / SESSION)
    with pytest.raises(StoreError):
        await _store(root).persist("toolu_sym", "must not land outside", "txt")
    assert list(outside.iterdir()) == []


@pytest.mark.anyio
@pytest.mark.parametrize("dangling", [False, True])
async def test_symlink_at_the_final_name_is_refused_and_its_target_untouched(
    tmp_path: Path, dangling: bool
) -> None:
    root = tmp_path / "root"
    directory = root / SESSION / "tool-results"
    directory.mkdir(parents=True)
    target = tmp_path / "victim.txt"
    if not dangling:
        target.write_text("precious", encoding="utf-8")
    os.symlink(target, directory / "toolu_v.txt")
    with pytest.raises(StoreError):
        await _store(root).persist("toolu_v", "attacker-controlled", "txt")
    if dangling:
        assert not target.exists()
    else:
        assert target.read_text(encoding="utf-8") == "precious"
    assert _tmp_leftovers(directory) == []


@pytest.mark.anyio
async def test_a_directory_at_the_final_name_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / SESSION / "tool-results"
    (directory / "toolu_d.txt").mkdir(parents=True)
    with pytest.raises(StoreError):
        await _store(tmp_path).persist("toolu_d", "x", "txt")
    assert _tmp_leftovers(directory) == []


@pytest.mark.anyio
async def test_a_regular_file_where_tool_results_should_be_is_refused(tmp_path: Path) -> None:
    (tmp_path / SESSION).mkdir()
    (tmp_path / SESSION / "tool-results").write_text("not a dir", encoding="utf-8")
    with pytest.raises(OSError):
        await _store(tmp_path).persist("toolu_f", "x", "txt")
    assert (tmp_path / SESSION / "tool-results").read_text(encoding="utf-8") == "not a dir"


# -- concurrency and crashes ------------------------------------------------------------------


@pytest.mark.anyio
async def test_concurrent_persists_of_one_id_all_succeed_with_one_file(tmp_path: Path) -> None:
    store = _store(tmp_path)
    paths: list[str] = []

    async def one() -> None:
        paths.append(await store.persist("toolu_race", "same content", "txt"))

    async with anyio.create_task_group() as tg:
        for _ in range(24):
            tg.start_soon(one)
    assert len(paths) == 24 and len(set(paths)) == 1
    directory = tmp_path / SESSION / "tool-results"
    assert [p.name for p in directory.iterdir()] == ["toolu_race.txt"]
    assert Path(paths[0]).read_text(encoding="utf-8") == "same content"


@pytest.mark.anyio
async def test_concurrent_persists_of_many_ids(tmp_path: Path) -> None:
    store = _store(tmp_path)
    out: dict[str, str] = {}

    async def one(i: int) -> None:
        out[f"toolu_{i}"] = await store.persist(f"toolu_{i}", f"content {i}" * 100, "txt")

    async with anyio.create_task_group() as tg:
        for i in range(30):
            tg.start_soon(one, i)
    for i in range(30):
        assert Path(out[f"toolu_{i}"]).read_text(encoding="utf-8") == f"content {i}" * 100
    assert _tmp_leftovers(tmp_path / SESSION / "tool-results") == []


class _Ops(OsFileOps):
    """The real file operations, with the ones a test names replaced."""

    def __init__(self, **replaced: Any) -> None:
        for name, fn in replaced.items():
            setattr(self, name, fn)


@pytest.mark.anyio
async def test_crash_between_temp_write_and_link_leaves_no_final_file(tmp_path: Path) -> None:
    directory = tmp_path / SESSION / "tool-results"
    calls: list[tuple[str, str]] = []

    def failing_link(src: Path, dst: Path) -> None:
        calls.append((str(src), str(dst)))
        # the temp file is complete at this point: prove it, then "crash"
        assert Path(src).read_text(encoding="utf-8") == "full content"
        raise OSError(errno.EIO, "simulated crash before link")

    crashing = FileToolResultStore(tmp_path, SESSION, file_ops=lambda _t: _Ops(link=failing_link))
    with pytest.raises(OSError):
        await crashing.persist("toolu_crash", "full content", "txt")
    assert calls and Path(calls[0][0]).name.startswith(".tmp-")
    assert not (directory / "toolu_crash.txt").exists()
    assert _tmp_leftovers(directory) == []

    path = await _store(tmp_path).persist("toolu_crash", "full content", "txt")
    assert Path(path).read_text(encoding="utf-8") == "full content"
    assert _tmp_leftovers(directory) == []


@pytest.mark.anyio
async def test_disk_full_mid_write_leaves_no_final_file_and_no_temp(tmp_path: Path) -> None:
    directory = tmp_path / SESSION / "tool-results"

    def half_then_enospc(fd: int, data: memoryview) -> int:
        if len(data) > 1:
            return os.write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    full = FileToolResultStore(tmp_path, SESSION, file_ops=lambda _t: _Ops(write=half_then_enospc))
    with pytest.raises(OSError) as info:
        await full.persist("toolu_full", "0123456789" * 50, "txt")
    assert info.value.errno == errno.ENOSPC
    assert not (directory / "toolu_full.txt").exists()
    assert _tmp_leftovers(directory) == []
    path = await _store(tmp_path).persist("toolu_full", "0123456789" * 50, "txt")
    assert Path(path).read_text(encoding="utf-8") == "0123456789" * 50


@pytest.mark.anyio
async def test_fsync_failure_leaves_no_final_file(tmp_path: Path) -> None:
    directory = tmp_path / SESSION / "tool-results"

    def bad_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    store = FileToolResultStore(tmp_path, SESSION, file_ops=lambda _t: _Ops(fsync=bad_fsync))
    with pytest.raises(OSError):
        await store.persist("toolu_fs", "data", "txt")
    assert not (directory / "toolu_fs.txt").exists()
    assert _tmp_leftovers(directory) == []


@pytest.mark.anyio
async def test_stale_temp_file_from_an_earlier_crash_is_not_taken_for_the_result(
    tmp_path: Path,
) -> None:
    directory = tmp_path / SESSION / "tool-results"
    directory.mkdir(parents=True, mode=0o700)
    # a temp file as a live writer (this process, pid in the name) has it mid-write
    mine = await _temp_name_of_this_process(tmp_path / "probe")
    live = directory / (mine[: -len("toolu_probe.txt")] + "toolu_st.txt")
    live.write_text("partial", encoding="utf-8")
    path = await _store(tmp_path).persist("toolu_st", "the complete output", "txt")
    assert Path(path).name == "toolu_st.txt"
    assert Path(path).read_text(encoding="utf-8") == "the complete output"
    # the store's own temp file is gone; a live writer's one is left alone
    assert _tmp_leftovers(directory) == [live.name]


async def _temp_name_of_this_process(root: Path) -> str:
    """The name of the temp file this process uses for ``toolu_probe.txt`` (kept by a failing
    unlink), which carries this process's pid and host."""
    directory = root / SESSION / "tool-results"

    def keep(path: Path) -> None:
        raise OSError(errno.EIO, "kept")

    store = FileToolResultStore(root, SESSION, file_ops=lambda _t: _Ops(unlink=keep))
    with pytest.raises(OSError):
        await store.persist("toolu_probe", "x", "txt")
    (name,) = _tmp_leftovers(directory)
    return name


# --------------------------------------------------------------------------------------------
# Through the budget stage: a store that cannot write never fails the turn
# --------------------------------------------------------------------------------------------


class FlakyStore:
    """A ``ToolResultStore`` that raises for the ids in ``failing`` (or for every id)."""

    def __init__(
        self, inner: ToolResultStore, failing: set[str] | None, exc: BaseException
    ) -> None:
        self.inner = inner
        self.failing = failing
        self.exc = exc
        self.calls: list[str] = []

    async def persist(self, tool_use_id: str, text: str, ext: str) -> str:
        self.calls.append(tool_use_id)
        if self.failing is None or tool_use_id in self.failing:
            raise self.exc
        return await self.inner.persist(tool_use_id, text, ext)


def _ctx(
    root: Path,
    store: ToolResultStore | None = None,
    transcript: TranscriptWriter | None = None,
    policies: ToolPolicies | None = None,
) -> SessionContext:
    return SessionContext(
        SESSION,
        root,
        store=store,
        transcript=transcript,
        tool_policies=policies or ToolPolicies(declared={"Read": float("inf")}, cap=10_000),
        logger=_QuietLogger(),
    )


def _result_contents(messages: list[Message]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in messages:
        if m.type == "user" and isinstance(m.content, list):
            for b in m.content:
                if b.get("type") == "tool_result":
                    out[b["tool_use_id"]] = b.get("content")
    return out


def _turn(turn: int, sizes: dict[str, int]) -> list[Message]:
    ids = list(sizes)
    return [
        assistant(f"msg_{turn}", *(tool_use(i, "Glob") for i in ids)),
        *(results(tool_result(i, chr(ord("a") + k % 26) * sizes[i])) for k, i in enumerate(ids)),
    ]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        StoreError(errno.EROFS, "read-only"),
        RuntimeError("object store exploded"),
    ],
    ids=["ENOSPC", "StoreError", "RuntimeError"],
)
async def test_failing_store_per_message_turn_completes_and_id_is_frozen(
    tmp_path: Path, exc: BaseException
) -> None:
    store = FlakyStore(FileToolResultStore(tmp_path, SESSION), {"t_big"}, exc)
    transcript = TranscriptWriter(tmp_path / "t.jsonl", SESSION)
    ctx = _ctx(tmp_path, store, transcript)
    pipe = Pipeline([ToolResultBudget(3_000)])
    history = [user_text("go"), *_turn(1, {"t_big": 2_000, "t_mid": 1_500, "t_small": 100})]
    history_before = list(history)

    out = await pipe.run(history, ctx)
    assert history == history_before
    # the largest was selected and failed: it is sent whole, seen, not replaced
    assert store.calls == ["t_big"]
    assert ctx.report.persist_failed == ["t_big"]
    assert ctx.report.persisted == []
    sent = _result_contents(out)
    assert sent == _result_contents(history)  # everything original
    assert ctx.replacement_state.classify(key("t_big", sent["t_big"])) == "frozen"
    assert ctx.replacement_state.classify(key("t_mid", sent["t_mid"])) == "frozen"
    assert not (tmp_path / SESSION / "tool-results").exists() or not any(
        (tmp_path / SESSION / "tool-results").iterdir()
    )
    request = to_api(out)
    assert json.dumps(request)  # the turn completed with a sendable request

    # later turns: the store works again; the failed id is never retried, never replaced
    store.failing = set()
    history += [*_turn(2, {"t_next": 5_000})]
    out2 = await pipe.run(history, ctx)
    assert "t_big" not in store.calls[1:]
    assert ctx.report.persist_failed == []
    sent2 = _result_contents(out2)
    assert sent2["t_big"] == sent["t_big"]
    assert sent2["t_mid"] == sent["t_mid"]
    assert sent2["t_next"].startswith(PERSISTED)
    assert [r.tool_use_id for r in ctx.report.persisted] == ["t_next"]
    # a third pass with nothing new: still untouched, no store call
    n_calls = len(store.calls)
    out3 = await pipe.run(history, ctx)
    assert len(store.calls) == n_calls
    assert to_api(out3) == to_api(out2)
    # the transcript never recorded a replacement for the failed id
    loaded = load_transcript(tmp_path / "t.jsonl")
    assert [r.tool_use_id for r in loaded.replacement_records] == ["t_next"]


@pytest.mark.anyio
async def test_failing_store_per_tool_gate_keeps_original_and_frees_the_rest(
    tmp_path: Path,
) -> None:
    # per-tool threshold 1_000: t_huge is over it, its write fails -> frozen whole; being
    # frozen it counts toward the message sum, so the next largest goes instead.
    store = FlakyStore(
        FileToolResultStore(tmp_path, SESSION), {"t_huge"}, OSError(errno.ENOSPC, "full")
    )
    ctx = _ctx(tmp_path, store, policies=ToolPolicies(cap=1_000))
    pipe = Pipeline([ToolResultBudget(3_000)])
    history = [user_text("go"), *_turn(1, {"t_huge": 2_500, "t_a": 900, "t_b": 800})]
    out = await pipe.run(history, ctx)
    sent = _result_contents(out)
    assert ctx.report.persist_failed == ["t_huge"]
    assert sent["t_huge"] == "a" * 2_500
    assert ctx.replacement_state.classify(key("t_huge", "a" * 2_500)) == "frozen"
    # frozen 2_500 + 900 + 800 > 3_000 -> t_a (largest fresh) goes, 2_500 + 800 still > 3_000
    # -> t_b goes too
    assert sent["t_a"].startswith(PERSISTED)
    assert sent["t_b"].startswith(PERSISTED)
    assert sorted(store.calls) == ["t_a", "t_b", "t_huge"]


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _mount(*args: str) -> bool:
    try:
        done = subprocess.run(["mount", *args], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


@pytest.fixture
def readonly_root(tmp_path: Path) -> Iterator[Path]:
    """A store root where nothing can be created: chmod 0500, or as root a read-only tmpfs."""
    root = tmp_path / "ro"
    root.mkdir()
    if not _is_root():
        root.chmod(0o500)
        try:
            yield root
        finally:
            root.chmod(0o700)
        return
    # root ignores directory permissions: use a read-only mount instead
    if not shutil.which("mount") or not _mount(
        "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(root)
    ):
        pytest.skip("running as root and cannot mount a read-only tmpfs; chmod would not stop root")
    try:
        yield root
    finally:
        subprocess.run(["umount", str(root)], capture_output=True, check=False)


@pytest.mark.anyio
async def test_readonly_store_directory_sends_originals_and_reports(readonly_root: Path) -> None:
    store = FileToolResultStore(readonly_root, SESSION)
    with pytest.raises(OSError):
        await store.persist("toolu_ro", "x", "txt")
    ctx = _ctx(readonly_root, store, policies=ToolPolicies(cap=1_000))
    history = [user_text("go"), *_turn(1, {"t1": 5_000, "t2": 4_000, "t3": 10})]
    out = await Pipeline([ToolResultBudget(3_000)]).run(history, ctx)
    assert _result_contents(out) == _result_contents(history)
    # t1, t2 fail the per-tool gate and are frozen whole; frozen alone exceed the limit, so
    # the greedy walk selects every fresh result, t3 too -- and that write fails as well
    assert sorted(ctx.report.persist_failed) == ["t1", "t2", "t3"]
    assert ctx.replacement_state.replacements == {}
    keys = {key(t, c) for t, c in _result_contents(history).items()}
    assert len(keys) == 3 and keys <= ctx.replacement_state.seen_ids


@pytest.mark.anyio
async def test_store_path_blocked_by_a_file_sends_originals(tmp_path: Path) -> None:
    # works as root too: no permission bit involved
    (tmp_path / SESSION).mkdir()
    (tmp_path / SESSION / "tool-results").write_text("", encoding="utf-8")
    ctx = _ctx(tmp_path, policies=ToolPolicies(cap=1_000))
    history = [user_text("go"), *_turn(1, {"t1": 5_000, "t2": 2_000})]
    out = await Pipeline([ToolResultBudget(3_000)]).run(history, ctx)
    assert _result_contents(out) == _result_contents(history)
    assert sorted(ctx.report.persist_failed) == ["t1", "t2"]
    assert ctx.replacement_state.classify(key("t1", _result_contents(history)["t1"])) == "frozen"


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs, filled up (root only; skipped where mounting is not allowed)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if not _is_root() or not shutil.which("mount"):
        pytest.skip("a real full disk needs root to mount a tiny tmpfs")
    if not _mount("-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)):
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        # create the store directories first, then fill every remaining byte
        store_dir = mnt / SESSION / "tool-results"
        store_dir.mkdir(parents=True, mode=0o700)
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, check=False)


@pytest.mark.anyio
async def test_real_full_disk_turn_completes_without_partial_files(tiny_disk: Path) -> None:
    store_dir = tiny_disk / SESSION / "tool-results"
    ctx = _ctx(tiny_disk, policies=ToolPolicies(cap=1_000))
    history = [user_text("go"), *_turn(1, {"t1": 50_000, "t2": 20_000})]
    out = await Pipeline([ToolResultBudget(3_000)]).run(history, ctx)
    assert _result_contents(out) == _result_contents(history)
    assert sorted(ctx.report.persist_failed) == ["t1", "t2"]
    assert list(store_dir.iterdir()) == []  # no final file, no temp file


@pytest.mark.anyio
async def test_hostile_id_through_the_stage_lands_inside_the_store(tmp_path: Path) -> None:
    hostile = "../../../etc/cron.d/pwn"
    ctx = _ctx(tmp_path / "root", policies=ToolPolicies(cap=1_000))
    content = "payload\n" * 500
    history = [
        user_text("go"),
        assistant("msg_1", tool_use(hostile, "Glob")),
        results(tool_result(hostile, content)),
    ]
    out = await Pipeline([ToolResultBudget(3_000)]).run(history, ctx)
    replaced = _result_contents(out)[hostile]
    assert replaced.startswith(PERSISTED)
    directory = (tmp_path / "root" / SESSION / "tool-results").absolute()
    expected = directory / f"unsafe.{hashlib.sha256(hostile.encode()).hexdigest()}.txt"
    assert f"Full output saved to: {expected}\n" in replaced
    assert expected.read_text(encoding="utf-8") == content
    assert _all_files(tmp_path) == [expected]


@pytest.mark.anyio
async def test_unwritable_transcript_does_not_fail_the_turn(tmp_path: Path) -> None:
    logger = _QuietLogger()
    ctx = SessionContext(
        SESSION,
        tmp_path,
        transcript=TranscriptWriter(tmp_path / "t.jsonl", SESSION),
        tool_policies=ToolPolicies(cap=10_000),
        logger=logger,
    )
    # then a directory appears where the transcript file should be: appends raise
    (tmp_path / "t.jsonl").mkdir()
    history = [user_text("go"), *_turn(1, {"t1": 5_000})]
    out = await Pipeline([ToolResultBudget(3_000)]).run(history, ctx)
    sent = _result_contents(out)["t1"]
    # the decision stands (it is in the state): the replacement is sent and reported ...
    assert sent.startswith(PERSISTED)
    assert ctx.replacement_state.replacements == {key("t1", _result_contents(history)["t1"]): sent}
    # ... and the lost record is logged, since a resume could not restore it
    assert any(
        level == "error"
        and event == "stage_record.write_failed"
        and kw["stage"] == "tool_result_budget"
        for level, event, kw in logger.events
    )


class _FullDisk(TranscriptWriter):
    """A transcript on a full disk: every append fails as the OS reports it."""

    def append_replacements(self, *_args: Any, **_kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.anyio
async def test_a_failed_record_write_says_which_failure(tmp_path: Path) -> None:
    logger = _QuietLogger()
    ctx = SessionContext(
        SESSION,
        tmp_path,
        transcript=_FullDisk(tmp_path / "t.jsonl", SESSION),
        tool_policies=ToolPolicies(cap=10_000),
        logger=logger,
    )
    await Pipeline([ToolResultBudget(3_000)]).run([user_text("go"), *_turn(1, {"t1": 5_000})], ctx)
    (failed,) = [kw for _, event, kw in logger.events if event == "stage_record.write_failed"]
    assert failed["error"] == "OSError"
    assert failed["detail"] == "OSError: ENOSPC (No space left on device)"  # not read-only
