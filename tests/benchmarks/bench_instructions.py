"""What a proxy call costs in machine instructions: a conversation's first call and a call
that adds a round, counted by valgrind (``callgrind``), whose count moves by ~0.01 % between
runs where a timer moves with the machine's load (±25 % between runs on a shared 2-CPU
machine). A count is this machine's: the C library and OpenSSL pick their copy and hash code
by the CPU's features, and a server's periodic ticks add a little with the wall time.

    python tests/benchmarks/bench_instructions.py [--sizes 100,1000] [--rounds 10]
        [--processes 168] [--skip app,processes]

Not a test: it prints figures, and nothing where valgrind is not installed.

1. The proxy's app served in-process (an in-memory client and upstream, as
   ``bench_call_parts.py`` does): each figure is the difference of two runs that differ only
   in the calls made, so start-up cancels out, and the same runs against an app that only
   reads the body and answers give what the in-memory client and upstream cost, which is
   taken off.
2. The whole process, as users run it: ``python -m pipeline proxy`` and the bare forwarder of
   ``bench_peers.py`` (each under callgrind, its client and upstream not), sent the calls of
   ``bench_peers.py`` part 2's load one after another (four conversations growing from 100
   messages a round a call, each replaced by a new one past 140: one call in 21 a first
   call): the instructions a request of each, HTTP serving, the upstream client and the log
   line included, and their ratio -- what part 2's "CPU a request" ratio measures in time,
   without the noise of the machine's load.

A count says nothing of what waits on memory (a copy of a long body costs few instructions
and much time) or on the kernel (a count is of the process's own instructions):
``bench_peers.py`` measures what a user pays.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

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


_VALGRIND = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]


def _env() -> dict[str, str]:
    """The environment of a counted process: string hashing seeded alike in every run."""
    return {**os.environ, "PYTHONHASHSEED": "0"}


def _collected(log: str) -> int:
    """The instructions callgrind says (in ``log``, its stderr) the process ran."""
    found = re.search(r"Collected\s*:\s*([\d,]+)", log)
    if found is None:
        raise RuntimeError(log[-2000:])
    return int(found.group(1).replace(",", ""))


def instructions(kind: str, n: int, calls: int, trivial: bool) -> int:
    """Instructions of one run of :func:`serve` under callgrind."""
    command = [*_VALGRIND, sys.executable, __file__, "--serve", kind, str(n), str(calls)]
    command.append(str(int(trivial)))
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), check=True)
    return _collected(done.stderr)


def per_call(kind: str, n: int, calls: int) -> tuple[float, float]:
    """Millions of instructions a call: the proxy's own, and the in-memory client's and
    upstream's (taken off the first)."""
    made = calls * (4 if kind == "round" else 1)
    both = [
        (instructions(kind, n, calls, trivial) - instructions(kind, n, 0, trivial)) / made / 1e6
        for trivial in (False, True)
    ]
    return both[0] - both[1], both[1]


def _serving(proc: subprocess.Popen[str], err: IO[str], target: str) -> str:
    """The URL ``target`` serves on once it answers (start-up under callgrind takes a while);
    ``RuntimeError`` with its last lines if it ends, or has not answered within ten minutes."""
    import httpx2

    url = None
    if target == "forwarder":  # it prints the URL of the socket it has bound
        assert proc.stdout is not None
        found = re.search(r"(http://127\.0\.0\.1:\d+)", proc.stdout.readline())
        url = found.group(1) if found else None
    deadline = time.monotonic() + 600
    with httpx2.Client(timeout=5) as client:
        while time.monotonic() < deadline and proc.poll() is None:
            if url is None:  # the proxy chose its port: its start-up line names it
                err.seek(0)
                found = re.search(r"proxy on (http://127\.0\.0\.1:\d+)", err.read())
                url = found.group(1) if found else None
            if url is not None:
                try:
                    client.get(url + "/")
                    return url
                except httpx2.TransportError:
                    pass
            time.sleep(0.5)
    err.seek(0)
    raise RuntimeError(f"the {target} did not start: {err.read()[-2000:]}")


def process_instructions(target: str, upstream: str, calls: int) -> tuple[int, int]:
    """Instructions of one ``target`` process ("proxy" or "forwarder") over ``calls`` calls of
    part 2's load sent one after another, start-up and shut-down included; and how many of the
    calls were first calls."""
    import bench_peers as peers
    import httpx2

    with tempfile.TemporaryDirectory() as root, open(Path(root) / "stderr", "w+") as err:
        if target == "proxy":
            command = [sys.executable, "-m", "pipeline", "proxy", "--port", "0"]
            command += ["--store", str(Path(root) / "store"), "--upstream", upstream]
        else:
            command = [sys.executable, str(Path(__file__).parent / "bench_peers.py")]
            command += ["--serve-forwarder", upstream]
        # stderr to a file: a pipe nobody reads fills at ~160 log lines and stops the server
        out = subprocess.PIPE if target == "forwarder" else subprocess.DEVNULL
        with subprocess.Popen(
            [*_VALGRIND, *command], cwd=REPO, env=_env(), stdout=out, stderr=err, text=True
        ) as proc:
            try:
                url = _serving(proc, err, target)
                convs = [peers.Conversation(100, f"i{k}") for k in range(4)]
                firsts = min(4, calls)
                with httpx2.Client(timeout=300) as client:
                    for i in range(calls):
                        conv = convs[i % 4]
                        if len(conv.messages) > 140:  # as part 2 does: a new conversation
                            conv = convs[i % 4] = peers.Conversation(100, f"i{i}")
                            firsts += 1
                        peers.call(client, url, conv, conv.next_body())
            finally:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(300)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        err.seek(0)
        return _collected(err.read()), firsts


_CYCLE = 84
"""Calls of part 2's schedule in which each of the four conversations is replaced once (each
makes 21 calls, from 99 messages to 139): a window of a multiple of it holds one first call
in 21, as part 2's load does. The first replacement is the 85th call."""


def processes(calls: int) -> None:
    """Part 2: instructions a request of the proxy command and of the bare forwarder, over the
    calls after the first eight (a conversation's first and second); and of the proxy's calls
    that add a round (the 9th to the 84th) and, what is left, its first calls."""
    import bench_peers as peers

    print(
        f"\n2. The whole process, {calls} calls of bench_peers.py part 2's load one after"
        " another (millions of instructions a request)"
    )
    per: dict[str, float] = {}
    with peers.process("--serve-upstream") as upstream:
        for target in ("forwarder", "proxy"):
            (few, f0), (many, f1) = (
                process_instructions(target, upstream, n) for n in (8, 8 + calls)
            )
            per[target] = (many - few) / calls / 1e6
            print(f"  {target:>9}: {per[target]:8.2f}  ({f1 - f0} of the calls first calls)")
        rounds, f2 = process_instructions("proxy", upstream, _CYCLE)
    assert f2 == f0, "a first call among the rounds"
    round_ = (rounds - few) / (_CYCLE - 8) / 1e6  # few: the proxy's (the loop's last target)
    firsts = f1 - f0
    first = (per["proxy"] * calls - round_ * (calls - firsts)) / firsts
    print(f"  the proxy: a call that adds a round {round_:.2f}, a first call {first:.1f}")
    print(f"  the forwarder's over the proxy's: {per['forwarder'] / per['proxy']:.2f}x")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        kind, n, calls, trivial = sys.argv[2:6]
        serve(kind, int(n), int(calls), trivial == "1")
        return 0
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="100,1000")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--processes",
        type=int,
        default=2 * _CYCLE,
        help=f"calls of part 2 (a multiple of {_CYCLE})",
    )
    parser.add_argument("--skip", default="", help="parts to leave out: app,processes")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if args.processes < _CYCLE or args.processes % _CYCLE:
        parser.error(f"--processes must be a positive multiple of {_CYCLE}: one call in 21 a first")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: nothing to count (Debian: apt install valgrind)")
        return 0
    print(f"Python {sys.version.split()[0]}; millions of instructions a call (callgrind)")
    if "app" not in skip:
        print("\n1. The proxy's app in-process, its client and upstream taken off")
        for n in (int(x) for x in args.sizes.split(",")):
            own, harness = per_call("first", n, 3)
            shown = f"{own:8.2f}  (client and upstream {harness:.2f})"
            print(f"  a first call of {n:>5} messages: {shown}")
        own, harness = per_call("round", 100, args.rounds)
        shown = f"{own:8.2f}  (client and upstream {harness:.2f})"
        print(f"  a call that adds a round at 100:  {shown}")
    if "processes" not in skip:
        processes(args.processes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
