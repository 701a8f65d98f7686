"""The CLI agent's tools against hostile input: the bash tool's process handling, and the
read-back tools (``read_file`` and ``read_persisted_output``) under fuzzed paths and values."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline._cli.coding_tools import bash_tool, read_file_tool
from pipeline.store.readback import DEFAULT_MAX_CHARS, LineReader, ReadbackError
from pipeline.tools import Tool

needs_proc = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="checks processes through Linux /proc"
)

# --------------------------------------------------------------------------------------------
# bash: returns when the shell exits, kills what it leaves behind, keeps output on a timeout
# --------------------------------------------------------------------------------------------


def _running_sleep(pid: int) -> bool:
    """Whether ``pid`` is a live ``sleep`` (a zombie is dead; another name is a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    state = stat[stat.rindex(")") + 2]
    return name == "sleep" and state not in "ZX"


def _within(check: Callable[[], bool], seconds: float = 5.0) -> bool:
    """Whether ``check()`` comes true within ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _gone(pid: int) -> bool:
    """Whether ``pid`` stops running within 5 s (a kill is not instant)."""
    return _within(lambda: not _running_sleep(pid))


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """The bash tool's cwd. Commands write their background pids to ``*.pid`` files there;
    any that still run afterwards (when the tool failed to kill them) are killed by pid."""
    yield tmp_path
    for pid_file in tmp_path.glob("*.pid"):
        for word in pid_file.read_text().split():
            if _running_sleep(int(word)):
                os.kill(int(word), signal.SIGKILL)


def _pid(workdir: Path, name: str = "bg.pid") -> int:
    return int((workdir / name).read_text())


async def _run(bash: Tool, command: str) -> str:
    out = await bash.handler({"command": command})
    assert isinstance(out, str)
    return out


@needs_proc
@pytest.mark.asyncio
async def test_bash_returns_when_the_shell_exits_and_kills_its_background_child(
    workdir: Path,
) -> None:
    bash = bash_tool(workdir, timeout=5)
    out = await _run(bash, "sleep 1000 & echo $! > bg.pid; echo started")
    # the background sleep holds the output pipe open: the call must not wait for its EOF
    assert out == "started\n"
    assert _gone(_pid(workdir)), "the background child outlived the call"


@needs_proc
@pytest.mark.asyncio
async def test_bash_timeout_kills_the_group_and_keeps_the_output(workdir: Path) -> None:
    bash = bash_tool(workdir, timeout=2)
    out = await _run(bash, "echo before; sleep 1000 & echo $! > bg.pid; wait")
    assert out.startswith("before\n")
    assert out.endswith(
        "\n[timed out after 2 s: the command and every process it started were killed]"
    )
    assert _gone(_pid(workdir))


@needs_proc
@pytest.mark.asyncio
async def test_a_cancelled_bash_call_kills_the_group(workdir: Path) -> None:
    bash = bash_tool(workdir, timeout=60)
    pid_file = workdir / "bg.pid"
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def cancel_once_started() -> None:
                # once the child is known (not after a fixed time a loaded machine may need)
                while not pid_file.exists():  # written whole (moved into place)
                    await anyio.sleep(0.02)
                scope.cancel()

            tg.start_soon(cancel_once_started)
            await _run(bash, "sleep 1000 & echo $! > bg.pid.tmp; mv bg.pid.tmp bg.pid; wait")
    assert scope.cancelled_caught
    assert _gone(_pid(workdir))


@pytest.mark.asyncio
async def test_bash_output_exit_code_and_stdin(workdir: Path) -> None:
    bash = bash_tool(workdir, timeout=30)
    out = await _run(bash, "echo out; echo err >&2; printf 'a\\377b'; exit 3")
    assert out == "out\nerr\na\ufffdb\n[exit code 3]"
    assert await _run(bash, "cat; echo done") == "done\n"  # stdin: /dev/null
    many = await _run(bash, "seq 1 300000")
    assert many.endswith("\n299999\n300000\n")
    with pytest.raises(ValueError, match="non-empty string"):
        await bash.handler({"command": " "})


@needs_proc
@pytest.mark.asyncio
async def test_bash_does_not_wait_for_a_child_that_left_the_group(workdir: Path) -> None:
    """A child that called setsid is out of reach (a documented limit), but it cannot hold
    the call open: output is drained without waiting for EOF."""
    bash = bash_tool(workdir, timeout=30)
    out = await _run(bash, "setsid sleep 1000 & echo $! > escaped.pid; sleep 0.2; echo started")
    assert out == "started\n"
    # setsid execs sleep: on a loaded machine, maybe after the shell's own short wait
    pid = _pid(workdir, "escaped.pid")
    assert _within(lambda: _running_sleep(pid))  # the fixture kills it


# --------------------------------------------------------------------------------------------
# read_file: hostile paths give ReadbackError only
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "path",
    [
        pytest.param("\ud83d", id="lone-surrogate"),
        pytest.param("n" * 100_000, id="100k-name"),
        pytest.param("loop", id="symlink-loop"),
        pytest.param("loop/notes.txt", id="through-a-loop"),
        pytest.param("notes.txt\x00", id="nul"),
    ],
)
async def test_read_file_refuses_hostile_paths_with_readback_error_only(
    tmp_path: Path, path: str
) -> None:
    cwd, store = tmp_path / "cwd", tmp_path / "store"
    cwd.mkdir()
    store.mkdir()
    (cwd / "notes.txt").write_text("hello\n")
    os.symlink("loop", cwd / "loop")
    read_file = read_file_tool(cwd, store)
    assert await read_file.handler({"path": "notes.txt"}) == "hello\n"
    with pytest.raises(ReadbackError) as info:
        await read_file.handler({"path": path})
    assert len(str(info.value)) < 400


# --------------------------------------------------------------------------------------------
# Fuzz: hostile paths and values against the read-back tools
# --------------------------------------------------------------------------------------------

SECRET = "SLUICEGATE-OUTSIDE-SECRET-5c81"
"""Planted in every file outside the allowed roots: it must never come back."""
SMALL_MAX_CHARS = 300
NOTICE_CHARS = 200
"""Room for the page's trailing notice (``[lines …]`` or ``[output cut …]``)."""


@dataclass(frozen=True)
class Layout:
    """A working directory and a store (the allowed roots) among hostile neighbours."""

    base: Path
    cwd: Path
    store: Path


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Layout:
    base = tmp_path_factory.mktemp("hostile")
    cwd, store, outside, evil = (base / n for n in ("cwd", "store", "outside", "store-evil"))
    for d in (cwd, store, outside, evil, cwd / "sub"):
        d.mkdir()
    for secret_file in (base / "secret.txt", outside / "secret.txt", evil / "toolu_1.txt"):
        secret_file.write_text(f"{SECRET}\n" * 3)
    (cwd / "notes.txt").write_text("".join(f"note {i}\n" for i in range(60)))
    (cwd / "long.txt").write_text("y" * 100_000 + "\nshort\n")
    (cwd / "mixed.txt").write_bytes(b"a\r\nb\rc\n\xff\xfe\x00\r")
    (cwd / "sub" / "inner.txt").write_text("inner\n")
    (store / "toolu_1.txt").write_text("persisted\n" * 10)
    links = {
        cwd / "abs_out": base / "secret.txt",
        cwd / "rel_out": Path("../secret.txt"),
        cwd / "dir_out": Path("../outside"),
        cwd / "link_in": Path("notes.txt"),
        cwd / "self": Path("self"),
        cwd / "loop_a": Path("loop_b"),
        cwd / "loop_b": Path("loop_a"),
        store / "toolu_evil.txt": base / "secret.txt",
        store / "evil_dir": Path("../store-evil"),
    }
    for link, target in links.items():
        os.symlink(target, link)
    os.mkfifo(cwd / "fifo")  # opening it would block: it must be refused without a read
    return Layout(base, cwd, store)


_NAMES = [
    "notes.txt",
    "long.txt",
    "mixed.txt",
    "sub",
    "sub/inner.txt",
    "abs_out",
    "rel_out",
    "dir_out",
    "dir_out/secret.txt",
    "link_in",
    "self",
    "self/notes.txt",
    "loop_a",
    "loop_b/x",
    "fifo",
    "secret.txt",
    "../secret.txt",
    "../outside/secret.txt",
    "../store/toolu_1.txt",
    "../store/toolu_evil.txt",
    "../store/evil_dir/toolu_1.txt",
    "../store-evil/toolu_1.txt",
    "toolu_1.txt",
    "toolu_evil.txt",
    "evil_dir/toolu_1.txt",
    ".",
    "..",
    "~",
    "~/secret.txt",
    "file:///etc/passwd",
    "//etc/passwd",
    "/etc/passwd",
    "/proc/self/environ",
    "/proc/self/cwd/../secret.txt",
    "/dev/fd/0",
    "/dev/zero",
]
_COMPONENTS = st.one_of(
    st.sampled_from(
        [
            *("..", ".", "", "sub", "dir_out", "self", "loop_a", "link_in", "notes.txt"),
            *("outside", "secret.txt", "store", "store-evil", "cwd", "toolu_1.txt", "evil_dir"),
            *("fifo", "\x00", "\ud83d", "\udcff", "~", "\n", " "),
        ]
    ),
    st.text(st.characters(exclude_categories=()), max_size=6),  # includes lone surrogates
)


def _paths(layout: Layout) -> st.SearchStrategy[Any]:
    # relative, or absolute into a root (most often), or absolute elsewhere
    anchors = ["", "", f"{layout.cwd}/", f"{layout.store}/", f"{layout.store}/", "/"]
    anchors += [f"{layout.base}/"]
    readable = st.sampled_from(
        ["notes.txt", "long.txt", "mixed.txt", "sub/inner.txt", "link_in", "./sub/../notes.txt"]
        + [f"{layout.cwd}/{n}" for n in ("notes.txt", "long.txt", "mixed.txt", "link_in")]
        + [f"{layout.store}/toolu_1.txt", f"{layout.cwd}/../store/toolu_1.txt"]
    )
    named = st.builds(lambda a, n: a + n, st.sampled_from(anchors), st.sampled_from(_NAMES))
    joined = st.builds(
        lambda a, parts: a + "/".join(parts),
        st.sampled_from(anchors),
        st.lists(_COMPONENTS, max_size=8),
    )
    long = st.builds(
        lambda a, unit, n: a + unit * n,
        st.sampled_from(anchors),
        st.sampled_from(["n", "../", "sub/", "self/", "\ud83d", "./"]),
        st.integers(100, 40_000),
    )
    other: st.SearchStrategy[Any] = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(),
        st.lists(st.text(max_size=3), max_size=3),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )
    # weighted by hand (one_of weighs every leaf of nested one_ofs alike): mostly paths that
    # reach the file system
    kinds = {"readable": readable, "named": named, "joined": joined, "long": long, "other": other}
    weighted = ["readable"] * 3 + ["named"] * 3 + ["joined"] * 2 + ["long", "other"]
    return st.sampled_from(weighted).flatmap(kinds.__getitem__)


_HOSTILE_NUMBERS: st.SearchStrategy[Any] = st.one_of(
    st.integers(-3, 0),
    st.integers(2**31, 2**70),
    st.sampled_from([2**1000, -(10**5000), 10**5000]),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=300),
    st.lists(st.integers(), max_size=3),
)
_NUMBERS = st.sampled_from([True, True, False]).flatmap(
    lambda valid: st.integers(1, 70) if valid else _HOSTILE_NUMBERS
)


def _readers(layout: Layout) -> list[tuple[Tool, int]]:
    """The CLI's read_file, and a reader with a small character bound."""
    small = LineReader(
        [layout.cwd, layout.store],
        name="read_file",
        description="Read a file.",
        default_limit=7,
        max_chars=SMALL_MAX_CHARS,
    )
    return [
        (read_file_tool(layout.cwd, layout.store), DEFAULT_MAX_CHARS),
        (small.as_tool(), SMALL_MAX_CHARS),
    ]


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_read_back_requests_give_bounded_text_or_readback_error(
    layout: Layout, data: st.DataObject
) -> None:
    tool, max_chars = data.draw(st.sampled_from(_readers(layout)), label="reader")
    request: dict[str, Any] = data.draw(
        st.fixed_dictionaries(
            {"path": _paths(layout)}, optional={"offset": _NUMBERS, "limit": _NUMBERS}
        ),
        label="request",
    )
    try:
        out = anyio.run(tool.handler, request)
    except ReadbackError as exc:
        text = str(exc)
        assert len(text) < 400, text[:500]
    else:
        assert isinstance(out, str)
        assert len(out) <= max_chars + NOTICE_CHARS
        text = out
    assert SECRET not in text
    text.encode("utf-8")  # safe to send to the API: no lone surrogate of the request echoed
