"""The proxy command's C allocator: bodies that grow a little every call come from the heap,
not as fresh pages each time (glibc only)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
        assert tune_allocator()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for k in range(40):
        body = b"x" * (4 * 2**20 + k * 2**16)
        joined = b"".join((body, b"]"))
        del body, joined
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _GROWING_BODIES, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


@glibc
def test_growing_bodies_reuse_the_heap_once_tuned() -> None:
    untuned, tuned = _faults("system"), _faults("tuned")
    # untuned: two fresh 4 MiB mappings a body, ~2,000 faults; tuned: the heap grows by what
    # is new, 64 KiB twice
    assert untuned > 40 * 1_000
    assert tuned * 10 < untuned


def test_tuning_is_refused_quietly_where_the_library_is_not_glibc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pipeline._cli.allocator as allocator

    monkeypatch.setattr(allocator, "_on_glibc", lambda: False)
    assert tune_allocator() is False


@glibc
def test_the_proxy_command_tunes_it(tmp_path: Path) -> None:
    with proxy_process("http://127.0.0.1:9", tmp_path / "s", "-v", "--log-json") as (
        _url,
        lines,
        _code,
    ):
        pass
    events = [json.loads(line) for line in lines if line.startswith("{")]
    (tuned,) = [e for e in events if e.get("event") == "proxy.allocator"]
    assert tuned["heap_blocks"] == 32 * 2**20
    assert tuned["keep_freed"] == 64 * 2**20
