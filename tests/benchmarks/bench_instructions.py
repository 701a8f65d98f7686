"""What a proxy call costs in machine instructions: a conversation's first call and a call
that adds a round, counted by valgrind (``callgrind``), which gives the same count on every
run where a timer moves with the machine (±25 % between runs on a shared 2-CPU machine).

    python tests/benchmarks/bench_instructions.py [--sizes 100,1000] [--rounds 10]

Not a test: it prints figures, and nothing where valgrind is not installed. The proxy's app
is served in-process (an in-memory client and upstream, as ``bench_call_parts.py`` does); each
figure is the difference of two runs that differ only in the calls made, so start-up cancels
out, and the same runs against an app that only reads the body and answers give what the
in-memory client and upstream cost, which is taken off. A count says nothing of what waits on
memory (a copy of a long body costs few instructions and much time): ``bench_peers.py``
measures what a user pays.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def serve(kind: str, n: int, calls: int, trivial: bool) -> None:
    """``calls`` first calls of ``n`` messages (``kind`` "first"), or four conversations of
    ``n`` messages each making ``calls`` rounds after three (``kind`` "round")."""
    import gc

    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_call_parts as parts
    import bench_peers as peers

    ids = itertools.count()

    async def answer(scope: Any, receive: Any, send: Any) -> None:
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        body = json.dumps(peers.reply_to(next(ids), 10)).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    async def run() -> None:
        served = parts.in_process(answer) if trivial else parts.in_process(long_pass=None)
        async with served as call:
            if kind == "first":
                for k in range(2 + calls):
                    await call(peers.Conversation(n, f"f{k}"))
            else:
                convs = [peers.Conversation(n, f"c{k}") for k in range(4)]
                for _ in range(3 + calls):
                    for conv in convs:
                        await call(conv)

    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)  # as the proxy command runs
    asyncio.run(run())


def instructions(kind: str, n: int, calls: int, trivial: bool) -> int:
    """Instructions of one run of :func:`serve` under callgrind."""
    command = [
        "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
        sys.executable, __file__, "--serve", kind, str(n), str(calls), str(int(trivial)),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    found = re.search(r"Collected\s*:\s*([\d,]+)", done.stderr)
    if found is None:
        raise RuntimeError(done.stderr[-2000:])
    return int(found.group(1).replace(",", ""))


def per_call(kind: str, n: int, calls: int) -> tuple[float, float]:
    """Millions of instructions a call: the proxy's own, and the in-memory client's and
    upstream's (taken off the first)."""
    made = calls * (4 if kind == "round" else 1)
    both = [
        (instructions(kind, n, calls, trivial) - instructions(kind, n, 0, trivial)) / made / 1e6
        for trivial in (False, True)
    ]
    return both[0] - both[1], both[1]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        kind, n, calls, trivial = sys.argv[2:6]
        serve(kind, int(n), int(calls), trivial == "1")
        return 0
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="100,1000")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: nothing to count (Debian: apt install valgrind)")
        return 0
    print(f"Python {sys.version.split()[0]}; millions of instructions a call (callgrind)")
    for n in (int(x) for x in args.sizes.split(",")):
        own, harness = per_call("first", n, 3)
        print(f"  a first call of {n:>5} messages: {own:8.2f}  (client and upstream {harness:.2f})")
    own, harness = per_call("round", 100, args.rounds)
    print(f"  a call that adds a round at 100:  {own:8.2f}  (client and upstream {harness:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
