"""The read-back tool: pages a persisted output by path, refuses anything else."""

from __future__ import annotations

import math
import os
import re
import tracemalloc
from pathlib import Path

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import Pipeline, SessionContext, ToolPolicies
from pipeline.store import readback
from pipeline.store.files import FileToolResultStore
from pipeline.store.readback import LineReader, PersistedOutputReader, ReadbackError
from stages import ToolResultBudget
from tests.builders import assistant, results, tool_result, tool_use


@pytest.fixture
def stored(tmp_path: Path) -> tuple[FileToolResultStore, str, str]:
    store = FileToolResultStore(tmp_path / "root", "sess")
    text = "".join(f"line {i}\n" for i in range(1, 101))
    return store, text, ""


async def _persist(store: FileToolResultStore, text: str) -> str:
    return await store.persist("toolu_1", text, "txt")


@pytest.mark.asyncio
async def test_reads_whole_and_pages(stored: tuple[FileToolResultStore, str, str]) -> None:
    store, text, _ = stored
    path = await _persist(store, text)
    reader = PersistedOutputReader(store.directory)
    assert await reader({"path": path}) == text
    page = await reader({"path": path, "offset": 11, "limit": 5})
    assert (
        page
        == "line 11\nline 12\nline 13\nline 14\nline 15\n\n[lines 11-15 of 100; next: offset=16]"
    )
    # paging through reassembles the file byte for byte
    parts, offset = [], 1
    while True:
        chunk = await reader({"path": path, "offset": offset, "limit": 30})
        body, sep, _note = chunk.partition("\n[lines ")
        parts.append(body)
        if not sep:
            break
        offset += 30
    assert "".join(parts) == text


@pytest.mark.asyncio
async def test_relative_name_and_char_cap(stored: tuple[FileToolResultStore, str, str]) -> None:
    store, _, _ = stored
    await store.persist("big", "x" * 500 + "\n", "txt")
    reader = PersistedOutputReader(store.directory, max_chars=100)
    out = await reader({"path": "big.txt"})
    assert out.startswith("x" * 100 + "\n[output cut at 100 chars within line 1")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "bad",
    [
        {"path": "/etc/passwd"},
        {"path": "../../../../etc/passwd"},
        {"path": ""},
        {"path": 5},
        {"path": "a\x00b"},
        {"path": "toolu_1.txt", "offset": 0},
        {"path": "toolu_1.txt", "limit": -1},
        {"path": "toolu_1.txt", "offset": True},
        {"path": "toolu_1.txt", "offset": 1000},
        {"path": "missing.txt"},
    ],
)
async def test_refuses_bad_requests(
    stored: tuple[FileToolResultStore, str, str], bad: dict[str, object]
) -> None:
    store, text, _ = stored
    await _persist(store, text)
    with pytest.raises(ReadbackError):
        await PersistedOutputReader(store.directory)(bad)


@pytest.mark.asyncio
async def test_symlink_out_of_the_store_is_refused(
    stored: tuple[FileToolResultStore, str, str], tmp_path: Path
) -> None:
    store, text, _ = stored
    await _persist(store, text)
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    os.symlink(secret, store.directory / "link.txt")
    with pytest.raises(ReadbackError):
        await PersistedOutputReader(store.directory)({"path": str(store.directory / "link.txt")})


@pytest.mark.asyncio
async def test_reads_what_the_budget_persisted_and_is_never_persisted(tmp_path: Path) -> None:
    reader_name = PersistedOutputReader.name
    policies = ToolPolicies(declared={reader_name: PersistedOutputReader.max_result_size_chars})
    assert math.isinf(policies.threshold(reader_name))
    ctx = SessionContext("sess", tmp_path, tool_policies=policies)
    assert isinstance(ctx.store, FileToolResultStore)
    original = "".join(f"{i:05d} some output\n" for i in range(5000))
    msgs = [assistant("r1", tool_use("big", "Other")), results(tool_result("big", original))]
    out = await Pipeline([ToolResultBudget()]).run(msgs, ctx)
    replacement = out[1].content[0]["content"]  # type: ignore[index]
    path = replacement.split("Full output saved to: ")[1].split("\n")[0]
    reader = PersistedOutputReader(ctx.store.directory, max_chars=1_000_000)
    assert await reader({"path": path, "limit": 10_000}) == original
    # the reader's own large output stays whole: its tool opted out with math.inf
    msgs2 = [
        *msgs,
        assistant("r2", tool_use("rb", reader_name, path=path)),
        results(tool_result("rb", original)),
    ]
    out2 = await Pipeline([ToolResultBudget()]).run(msgs2, ctx)
    assert out2[3].content[0]["content"] == original  # type: ignore[index]
    assert reader.definition["name"] == reader_name
    assert reader.definition["input_schema"]["required"] == ["path"]  # type: ignore[index]


# --------------------------------------------------------------------------------------------
# Hostile paths and values: ReadbackError only, with a bounded message
# --------------------------------------------------------------------------------------------


@pytest.fixture
def hostile_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    (root / "ok.txt").write_text("fine\n")
    os.symlink("self", root / "self")
    os.symlink("loop_b", root / "loop_a")
    os.symlink("loop_a", root / "loop_b")
    return root


def _reader(root: Path, **kwargs: int) -> LineReader:
    return LineReader([root], name="read_file", description="Read a file.", **kwargs)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "path",
    [
        pytest.param("\ud83d", id="lone-surrogate"),
        pytest.param("ok.txt\ud800", id="surrogate-suffix"),
        pytest.param("x" * 100_000, id="100k-name"),
        pytest.param("/".join(["d"] * 50_000), id="100k-path"),
        pytest.param("self", id="symlink-to-itself"),
        pytest.param("loop_a", id="two-link-loop"),
        pytest.param("self/ok.txt", id="loop-in-the-middle"),
        pytest.param("ok.txt\x00/etc/passwd", id="nul"),
    ],
)
async def test_hostile_paths_raise_only_a_bounded_readback_error(
    hostile_root: Path, path: str
) -> None:
    for form in (path, f"{hostile_root}/{path}"):
        with pytest.raises(ReadbackError) as info:
            await _reader(hostile_root)({"path": form})
        message = str(info.value)
        assert len(message) < 400, message[:500]
        message.encode("utf-8")  # safe to send: no lone surrogate in the message itself
        if len(form) > 1_000:
            assert f"({len(form):,} chars)" in message


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "request_",
    [
        pytest.param({"offset": -(10**6000)}, id="offset-beyond-int-str-limit"),
        pytest.param({"offset": "x" * 100_000}, id="offset-100k-string"),
        pytest.param({"limit": ["\ud83d"] * 10_000}, id="limit-long-list"),
        pytest.param({"offset": 10**6000}, id="offset-past-end-huge"),
        pytest.param({"path": "p" * 100_000 + "\x00"}, id="long-path-with-nul"),
        pytest.param({"path": {"a": 1}}, id="path-object"),
    ],
)
async def test_hostile_values_raise_a_bounded_readback_error(
    hostile_root: Path, request_: dict[str, object]
) -> None:
    with pytest.raises(ReadbackError) as info:
        await _reader(hostile_root)({"path": "ok.txt", **request_})
    assert len(str(info.value)) < 400


@pytest.mark.asyncio
@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux /proc")
async def test_a_read_error_is_a_readback_error(tmp_path: Path) -> None:
    # /proc/<pid>/mem is a regular file whose first page is unmapped: reading it fails with EIO
    reader = _reader(Path("/proc/self").resolve())
    with pytest.raises(ReadbackError, match="cannot read 'mem'"):
        await reader({"path": "mem"})


# --------------------------------------------------------------------------------------------
# Memory stays bounded whatever the file
# --------------------------------------------------------------------------------------------

GIB = 1 << 30
MEMORY_BOUND = 16 << 20


async def _peak(reader: LineReader, request: dict[str, object]) -> tuple[str | Exception, int]:
    """The reader's answer (or error) and the peak of Python allocations while serving it."""
    tracemalloc.start()
    try:
        try:
            answer: str | Exception = await reader(request)
        except ReadbackError as exc:
            answer = exc
        return answer, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def gigabyte_line(tmp_path: Path) -> Path:
    """A 1 GB first line of NULs with no line end, then two short lines (sparse: no disk)."""
    path = tmp_path / "root" / "big.txt"
    path.parent.mkdir()
    with path.open("wb") as fh:
        fh.truncate(GIB)
        fh.seek(GIB)
        fh.write(b"\nsecond line\nthird\n")
    return path


@pytest.mark.asyncio
async def test_a_gigabyte_line_is_cut_in_bounded_memory(gigabyte_line: Path) -> None:
    reader = PersistedOutputReader(gigabyte_line.parent)
    page, peak = await _peak(reader, {"path": "big.txt", "limit": 1})
    assert peak < MEMORY_BOUND, f"peak {peak:,} bytes"
    assert isinstance(page, str)
    body, _, notice = page.partition("\n[")
    assert body == "\x00" * readback.DEFAULT_MAX_CHARS
    assert notice.startswith(f"output cut at {readback.DEFAULT_MAX_CHARS} chars within line 1")
    assert notice.endswith("next: offset=2]")


@pytest.mark.asyncio
async def test_paging_past_a_gigabyte_line_is_bounded_in_memory(gigabyte_line: Path) -> None:
    reader = PersistedOutputReader(gigabyte_line.parent)
    page, peak = await _peak(reader, {"path": "big.txt", "offset": 2, "limit": 1})
    assert peak < MEMORY_BOUND, f"peak {peak:,} bytes"
    assert page == "second line\n\n[lines 2-2 of 3; next: offset=3]"
    error, peak = await _peak(reader, {"path": "big.txt", "offset": 5})
    assert peak < MEMORY_BOUND, f"peak {peak:,} bytes"
    assert isinstance(error, ReadbackError)
    assert str(error) == "offset 5 is past the end (3 lines)"


_LINE_END = re.compile(r"\r\n|\r|\n")


def _reference_lines(text: str) -> list[str]:
    """``text`` split after each line end as the reader counts them (``\\r\\n``, ``\\r``,
    ``\\n``)."""
    ends = [m.end() for m in _LINE_END.finditer(text)]
    starts = [0, *ends]
    lines = [text[a:b] for a, b in zip(starts, [*ends, len(text)], strict=True)]
    return [line for line in lines if line]


def _reference_page(lines: list[str], offset: int, limit: int, max_chars: int) -> str:
    """The page the reader should give, computed from the whole file in memory."""
    out: list[str] = []
    used = 0
    for line in lines[offset - 1 : offset - 1 + limit]:
        room = max_chars - used
        if room == 0:
            break
        if len(line) > room:
            out.append(line[:room])
            last = offset + len(out) - 1
            return "".join(out) + (
                f"\n[output cut at {max_chars} chars within line {last}; "
                f"the rest of that line is not shown; next: offset={last + 1}]"
            )
        out.append(line)
        used += len(line)
    last = offset + len(out) - 1
    if last < len(lines):
        return "".join(out) + f"\n[lines {offset}-{last} of {len(lines)}; next: offset={last + 1}]"
    return "".join(out)


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(st.sampled_from([b"a", b"\xc3\xa9", b"\r", b"\n", b"\r\n", b"\xff", b"\x00"])),
    chunk=st.integers(1, 9),
    limit=st.integers(1, 5),
    max_chars=st.integers(1, 12),
)
def test_every_page_matches_a_whole_file_reference_at_any_chunk_size(
    tmp_path_factory: pytest.TempPathFactory,
    data: list[bytes],
    chunk: int,
    limit: int,
    max_chars: int,
) -> None:
    """Tiny read chunks split line ends (``\\r|\\n``) between reads: the pages stay exact."""
    root = tmp_path_factory.mktemp("pages")
    raw = b"".join(data)
    (root / "f.txt").write_bytes(raw)
    lines = _reference_lines(raw.decode("utf-8", errors="replace"))
    reader = _reader(root, max_chars=max_chars, default_limit=limit)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(readback, "_CHUNK", chunk)
        for offset in range(1, len(lines) + 1):
            page = anyio.run(reader, {"path": "f.txt", "offset": offset})
            assert page == _reference_page(lines, offset, limit, max_chars)
        if lines:
            with pytest.raises(ReadbackError, match=f"past the end \\({len(lines)} lines\\)"):
                anyio.run(reader, {"path": "f.txt", "offset": len(lines) + 1})
        else:
            assert anyio.run(reader, {"path": "f.txt"}) == ""
