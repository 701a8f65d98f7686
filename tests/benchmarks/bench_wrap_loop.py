"""What an async client's loop pays for a wrapped call that meets a long conversation first, with
``wrap(..., long_pass=200)`` against without.

    python tests/benchmarks/bench_wrap_loop.py [--sizes 1000,10000] [--calls 3]

Not a test: it prints figures. Each call is the first of a new conversation of ``--sizes``
messages (a session resumed after a restart) through ``stages.wrap`` to a local scripted
server, while a task of the same loop ticks every millisecond: the longest gap between its
ticks (how long the loop was held) and the call's own time, per call.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "benchmarks"))

from bench_peers import history  # noqa: E402

from pipeline.testing import Reply, ScriptedMessagesServer  # noqa: E402
from stages import wrap  # noqa: E402
from tests.sdk_support import sdk_client  # noqa: E402


def _ok(_body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "ok"}])


async def _tick(done: anyio.Event, worst: list[float]) -> None:
    """Every millisecond until ``done``: the longest gap between two ticks into ``worst[0]``
    (seconds)."""
    last = time.perf_counter()
    while not done.is_set():
        await anyio.sleep(0.001)
        now = time.perf_counter()
        worst[0], last = max(worst[0], now - last), now


def run(n: int, calls: int, long_pass: int | None) -> tuple[list[float], list[float]]:
    """The loop's longest stall and the call's time (ms) for each of ``calls`` first calls."""
    stalls: list[float] = []
    took: list[float] = []
    with ScriptedMessagesServer(_ok) as server, tempfile.TemporaryDirectory() as root:
        client = wrap(sdk_client(server.base_url), root=root, long_pass=long_pass)

        async def main() -> None:
            for k in range(calls):
                done = anyio.Event()
                worst = [0.0]
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(_tick, done, worst)
                    messages = history(n, f"loop{k}")
                    start = time.perf_counter()
                    await client.messages.create(model="m", max_tokens=5, messages=messages)
                    took.append((time.perf_counter() - start) * 1000)
                    done.set()
                stalls.append(worst[0] * 1000)

        anyio.run(main)
    return stalls, took


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}, Python {sys.version.split()[0]}")
    print(f"{'messages':>9} {'long_pass':>10} {'longest loop stall, ms':>28} {'call, ms':>22}")
    for n in (int(x) for x in args.sizes.split(",")):
        for long_pass in (None, 200):
            stalls, took = run(n, args.calls, long_pass)
            shown = " ".join(f"{s:.0f}" for s in stalls)
            calls = " ".join(f"{t:.0f}" for t in took)
            print(f"{n:>9} {long_pass!s:>10} {shown:>28} {calls:>22}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
