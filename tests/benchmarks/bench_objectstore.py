"""What the object-store backend costs per call against local files: a proxy's work on one call
(a listing of what other workers recorded, the pipeline pass with its persist and record
appends, the response's record) in sessions holding 10, 100 and 1,000 persisted results, on
local files and on S3 (moto's server on 127.0.0.1), side by side with ratios.

    python tests/benchmarks/bench_objectstore.py [--sizes 10,100,1000] [--calls 30]
        [--delay-ms 20]

Not a test: it prints figures. Each measured call adds one round whose ~6,000-char result is
persisted (as every call of the session so far did); wall and CPU time per call (CPU of the
whole process: the store's worker threads included), mean and median, garbage collection left
on. "Takeover" is the first call of a worker that never served the session (it loads the
records, then passes over the whole history). moto runs in a process of its own on localhost
and answers in about a millisecond with no network between: these ratios are what the
backend's code and requests cost, not S3's latency (a few milliseconds per request within a
region, tens from another). ``--delay-ms D`` puts a relay between the process and moto that
holds each request D ms before passing it on (S3's latency, as from another region at 20): the
figures then show what a call pays the store on its path, and the store requests a call makes
(counted at the relay; median and p99; the settle after the response included: the spool
check and the records' snapshot) -- for a call that persists a result, one that persists none
("kept"), and a new worker's first call.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import anyio  # noqa: E402
import anyio.to_thread  # noqa: E402

from pipeline import Pipeline, ToolPolicies  # noqa: E402
from pipeline.dropin.adapter import WireSession  # noqa: E402
from pipeline.store.sessions import SessionStates  # noqa: E402
from pipeline.testing import QuietLogger  # noqa: E402
from stages import ToolResultBudget  # noqa: E402

SESSION = "bench-session"
RESULT_CHARS = 6_000
CAP = 5_000
"""Every result is over the per-tool cap: each round persists one."""


class Client:
    """A client's history: one tool call and its persisted-size result per round (``chars``:
    another size; under the cap, nothing is persisted)."""

    def __init__(self) -> None:
        self.params: list[dict[str, Any]] = [{"role": "user", "content": "benchmark"}]
        self.rounds = 0
        self.chars = RESULT_CHARS

    def grow(self) -> None:
        tid = f"toolu_{self.rounds:05d}"
        line = f"{tid} build log line\n"
        self.params.append(
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": tid, "name": "get_log", "input": {}}],
            }
        )
        self.params.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": tid,
                        "content": (line * (self.chars // len(line) + 1))[: self.chars],
                    }
                ],
            }
        )
        self.rounds += 1


async def open_session(states: SessionStates, root: Path) -> WireSession:
    return await WireSession.open(
        SESSION,
        root,
        Pipeline([ToolResultBudget()]),
        storage=states.open(SESSION),
        tool_policies=ToolPolicies(cap=CAP),
        logger=QuietLogger(keep=False),
    )


async def one_call(session: WireSession, client: Client) -> None:
    """A proxy's work on one call, the HTTP hops left out (the settle after the response,
    which the proxy runs after the response has gone, is the caller's)."""
    if session.storage is not None:
        await anyio.to_thread.run_sync(session.storage.changed_elsewhere)
    await session.prepare(client.params)
    usage = {"input_tokens": 100 + client.rounds, "output_tokens": 5}
    await session.observe_async(f"msg_{client.rounds:05d}", usage, "claude-bench")
    client.grow()


async def call_and_settle(session: WireSession, client: Client) -> None:
    await one_call(session, client)
    await session.settle()


async def timed(work: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """(wall ms, CPU ms) of one awaited piece of work."""
    wall, cpu = time.perf_counter(), time.process_time()
    await work()
    return (time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000


async def measure(
    states: Callable[[], SessionStates],
    root: Path,
    size: int,
    calls: int,
    takeovers: int,
    requests: Callable[[], int] = lambda: 0,
) -> dict[str, list[float]]:
    """Grow a session to ``size`` persisted results, then time ``calls`` calls that persist,
    ``calls`` that persist nothing and ``takeovers`` first calls of new workers; ``requests``:
    the store requests made so far."""
    client = Client()
    session = await open_session(states(), root / "host-a")
    for _ in range(size):
        await call_and_settle(session, client)
    out: dict[str, list[float]] = {}

    async def sample(
        kind: str, work: Callable[[], Awaitable[object]], after: WireSession | None = None
    ) -> None:
        """Time ``work``; count the store requests it and ``after``'s settle make."""
        before = requests()
        wall, cpu = await timed(work)
        if after is not None:
            await after.settle()
        for key, value in (("wall", wall), ("cpu", cpu), ("requests", requests() - before)):
            out.setdefault(f"{kind}{key}", []).append(value)

    for _ in range(calls):
        await sample("", lambda: one_call(session, client), session)
    client.chars = CAP // 2
    for _ in range(calls):
        await sample("kept_", lambda: one_call(session, client), session)
    client.chars = RESULT_CHARS
    for k in range(takeovers):
        host = root / f"host-new-{size}-{k}"

        async def takeover(host: Path = host) -> None:
            fresh = await open_session(states(), host)  # a new worker: nothing cached
            await fresh.prepare(client.params)

        await sample("take_", takeover)
    return out


class DelayRelay:
    """A TCP relay on 127.0.0.1 in front of ``target`` (host, port) that holds each request
    ``delay`` seconds before passing it on, and counts requests (a chunk from a client that
    starts with an HTTP method after the last response began)."""

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        import asyncio
        import threading

        self.target, self.delay, self.requests = target, delay, 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.port = 0

        async def serve() -> None:
            server = await asyncio.start_server(self._client, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            async with server:
                await server.serve_forever()

        threading.Thread(target=self._loop.run_until_complete, args=(serve(),), daemon=True).start()
        ready.wait(10)

    async def _client(self, reader: Any, writer: Any) -> None:
        import asyncio

        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def upward() -> None:
            while data := await reader.read(65536):
                if data[:8].split(b" ", 1)[0] in (b"GET", b"PUT", b"HEAD", b"POST", b"DELETE"):
                    self.requests += 1
                    await asyncio.sleep(self.delay)
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()

        async def downward() -> None:
            while data := await up_reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        await asyncio.gather(upward(), downward(), return_exceptions=True)


def start_moto_process() -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server in a process of its own (its CPU is not this process's), on a free
    port of 127.0.0.1; (the process, its endpoint) once it answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=2)
            return server, endpoint
        except urllib.error.HTTPError:
            return server, endpoint  # it answers (an error for "/" is an answer)
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("moto's server did not start (moto[server]?)") from None
            time.sleep(0.1)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def cell(values: list[float]) -> str:
    return f"{statistics.mean(values):8.2f} / {statistics.median(values):7.2f}"


def ratio(s3: list[float], local: list[float]) -> str:
    return f"{statistics.median(s3) / statistics.median(local):6.1f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--takeovers", type=int, default=5)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    try:
        server, endpoint = start_moto_process()
    except (OSError, RuntimeError) as exc:
        print(f"cannot start moto's S3 server: {exc}", file=sys.stderr)
        return 1
    host, port = endpoint.removeprefix("http://").split(":")
    relay = DelayRelay((host, int(port)), args.delay_ms / 1000)
    moto_endpoint, endpoint = endpoint, f"http://127.0.0.1:{relay.port}"
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "AKIDBENCH",
            "AWS_SECRET_ACCESS_KEY": "bench-secret",
            "AWS_REGION": "us-east-1",
        }
    )
    bucket = "sluicegate-bench"
    urllib.request.urlopen(urllib.request.Request(f"{moto_endpoint}/{bucket}", method="PUT"))
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    rows = []
    try:
        for size in (int(x) for x in args.sizes.split(",")):
            with tempfile.TemporaryDirectory() as tmp:
                root = Path(tmp)
                local = anyio.run(
                    measure,
                    lambda root=root: SessionStates(root / "store"),
                    root / "local",
                    size,
                    args.calls,
                    args.takeovers,
                )
                prefix = f"s3://{bucket}/size-{size}"
                s3 = anyio.run(
                    measure,
                    lambda prefix=prefix: SessionStates(prefix),
                    root / "s3",
                    size,
                    args.calls,
                    args.takeovers,
                    lambda: relay.requests,
                )
            rows.append((size, local, s3))
            print(f"  {size:,} persisted results measured", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=30)

    heads = ("persisted", "local wall", "s3 wall", "wall", "local CPU", "s3 CPU", "CPU")
    widths = (9, 18, 18, 7, 18, 18, 7)
    print(f"store requests held {args.delay_ms:g} ms each at a relay in front of moto")
    for title, prefix in (
        ("per call that persists (a worker that served the previous call)", ""),
        ("per call that persists nothing", "kept_"),
        ("takeover (the first call of a worker new to the session)", "take_"),
    ):
        print(f"\n{title}, ms: mean / median")
        print(" ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)))
        for size, local, s3 in rows:
            wall, cpu = f"{prefix}wall", f"{prefix}cpu"
            cells = (
                f"{size:,}",
                cell(local[wall]),
                cell(s3[wall]),
                ratio(s3[wall], local[wall]),
                cell(local[cpu]),
                cell(s3[cpu]),
                ratio(s3[cpu], local[cpu]),
            )
            print(" ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)), end="")
            asked = s3[f"{prefix}requests"]
            print(f"   store requests median {statistics.median(asked):g}, p99 {p99(asked):g}")
    print(
        "(ratios of medians, S3 over local; S3 is moto on 127.0.0.1, not S3's latency; CPU is "
        "the process's, worker threads included)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
