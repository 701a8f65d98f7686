"""The proxy command's C allocator: bodies that grow a little every call come from the heap,
not as fresh pages each time (glibc only), unless the operator chose otherwise."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

import pipeline._cli.allocator as allocator
from pipeline._cli.allocator import _on_glibc, tune_allocator
from tests.wire_support import proxy_process

glibc = pytest.mark.skipif(not _on_glibc(), reason="the thresholds are glibc's")

# Forty bodies of 4 MiB and more, each 64 KiB larger than the last (a growing conversation),
# each written in full and freed: the page faults they took.
_GROWING_BODIES = textwrap.dedent(
    """
    import resource, sys
    from pipeline._cli.allocator import tune_allocator
    if sys.argv[1] == "tuned":
        assert tune_allocator() is None
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for k in range(40):
        body = b"x" * (4 * 2**20 + k * 2**16)
        joined = b"".join((body, b"]"))
        del body, joined
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _glibc_settings_removed() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
    }


def _faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _GROWING_BODIES, mode],
        capture_output=True,
        text=True,
        check=True,
        env=_glibc_settings_removed(),
    )
    return int(done.stdout)


@glibc
def test_growing_bodies_reuse_the_heap_once_tuned() -> None:
    untuned, tuned = _faults("system"), _faults("tuned")
    # untuned: two fresh 4 MiB mappings a body (~2,600 faults; fewer with huge pages); tuned:
    # the heap grows by what is new, 64 KiB twice
    assert tuned * 5 < untuned


@pytest.mark.parametrize(
    "environ",
    [
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
        {"GLIBC_TUNABLES": "glibc.rtld.nns=2:glibc.malloc.mmap_threshold=1048576"},
        {"MALLOC_ARENA_MAX": "4"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
    ],
)
@glibc
def test_the_operators_own_settings_are_left_alone(environ: dict[str, str]) -> None:
    assert tune_allocator(environ) is not None


@pytest.mark.parametrize("failure", [AttributeError, ValueError, OSError, None, ""])
def test_a_library_that_is_not_glibc_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, failure: Any
) -> None:
    def confstr(name: str) -> str | None:
        if isinstance(failure, type):
            raise failure(name)
        return failure  # type: ignore[no-any-return]

    monkeypatch.setattr(allocator.os, "confstr", confstr)
    assert tune_allocator({}) == "the C library is not glibc"


def _refused(param: int, value: int) -> int:
    return 0  # as glibc answers a value past its limit


class _Refusing:
    """A C library whose ``mallopt`` refuses every value."""

    mallopt = staticmethod(_refused)


@glibc
def test_a_refused_threshold_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: _Refusing())
    assert tune_allocator({}) == "glibc refuses a 32 MiB mmap threshold"


def _allocator_events(tmp_path: Path, *extra: str, **env: str) -> list[dict[str, Any]]:
    with proxy_process("http://127.0.0.1:9", tmp_path / "s", "-v", "--log-json", *extra, **env) as (
        _url,
        lines,
        _code,
    ):
        pass
    events = [json.loads(line) for line in lines if line.startswith("{")]
    return [e for e in events if e.get("event") == "proxy.allocator"]


@glibc
def test_the_proxy_command_tunes_it_unless_told(tmp_path: Path) -> None:
    (tuned,) = _allocator_events(tmp_path)
    assert (tuned["heap_blocks"], tuned["keep_freed"]) == (32 * 2**20, 32 * 2**20)
    (told,) = _allocator_events(tmp_path, "--system-allocator")
    assert told["left_alone"] == "--system-allocator"
    (chosen,) = _allocator_events(tmp_path, GLIBC_TUNABLES="glibc.malloc.arena_max=1")
    assert "GLIBC_TUNABLES" in chosen["left_alone"]


@glibc
def test_the_proxy_command_trims_the_heap_when_idle(tmp_path: Path) -> None:
    (tuned,) = _allocator_events(tmp_path)
    assert tuned["idle_trim"] == allocator.IDLE_TRIM
    (told,) = _allocator_events(tmp_path, "--system-allocator")
    assert "idle_trim" not in told


def _resident(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@glibc
def test_a_quiet_proxy_gives_freed_bodies_back(tmp_path: Path) -> None:
    """Large bodies read, parsed and freed leave their pages in the heap (kept for the next
    body); a second of quiet gives them back. Their size is read while a request is still in
    flight (its body not all sent), so that nothing is given back before it is read, however
    slowly this test runs."""
    release = threading.Event()

    def held_open() -> Iterator[bytes]:
        yield b'{"model": "m", "max_tokens": 1, "messages": ['
        release.wait(60)
        yield b"]}"

    with proxy_process("http://127.0.0.1:9", tmp_path / "s") as (url, _lines, _code):
        pid = int(
            subprocess.check_output(["pgrep", "-n", "-f", "--", f"--store {tmp_path}/s"], text=True)
        )
        headers = {"x-api-key": "k", "content-type": "application/json"}
        with httpx.Client(timeout=60) as client, ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                client.post, url + "/v1/messages", content=held_open(), headers=headers
            )
            for k in range(3):
                body = {
                    "model": "m",
                    "max_tokens": 1,
                    "messages": [{"role": "user", "content": "x" * (8 * 2**20 + k)}],
                }
                client.post(url + "/v1/messages", json=body, headers={"x-api-key": "k"})
            busy = _resident(pid)
            release.set()
            pending.result()
        time.sleep(allocator.IDLE_TRIM + 1.5)
        rested = _resident(pid)
    # each body held ~3x its size at once (bytes, text, parsed): ~24 MiB kept, then given back
    assert busy - rested > 8 * 2**20, (busy, rested)


@pytest.mark.asyncio
async def test_idle_trim_waits_for_quiet_and_trims_once() -> None:
    trims: list[float] = []
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope.get("path") == "/slow":
            await release.wait()

    idle = allocator.IdleTrim(app, lambda: trims.append(time.monotonic()), idle=0.05)
    slow = asyncio.create_task(idle({"type": "http", "path": "/slow"}, None, None))
    await idle({"type": "http", "path": "/"}, None, None)
    await asyncio.sleep(0.2)
    assert trims == []  # a request still in flight
    release.set()
    await slow
    await asyncio.sleep(0.2)
    assert len(trims) == 1 and idle.trims == 1
    await asyncio.sleep(0.2)
    assert len(trims) == 1  # once a quiet spell
    await idle({"type": "lifespan"}, None, None)
    await asyncio.sleep(0.2)
    assert len(trims) == 1  # not a request
    await idle({"type": "http", "path": "/"}, None, None)
    await asyncio.sleep(0.2)
    assert len(trims) == 2
