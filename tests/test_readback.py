"""The read-back tool: pages a persisted output by path, refuses anything else."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from pipeline import Pipeline, SessionContext, ToolPolicies
from pipeline.readback import PersistedOutputReader, ReadbackError
from pipeline.storage import FileToolResultStore
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
