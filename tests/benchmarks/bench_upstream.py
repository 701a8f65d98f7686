"""What the proxy's upstream calls cost it: :class:`~pipeline.dropin.upstream.Upstream` on
``httpx2``, on aiohttp and on httptools (asyncio's connections, answers read by llhttp), the
CPU this process spends a call (sending a body of ``--size`` bytes, reading the answer
through), ``--concurrency`` calls at once.

    python tests/benchmarks/bench_upstream.py [--calls 3200] [--concurrency 16]
        [--size 200000] [--rounds 3]

Not a test: it prints figures. The upstream is ``bench_peers.py``'s, in its own process (its
CPU is not counted); the clients take turns, round after round, and each ratio is the median
of the rounds' own.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

import bench_peers  # noqa: E402

from pipeline.dropin.upstream import Upstream  # noqa: E402

HEADERS = {
    "content-type": "application/json",
    "x-api-key": "sk-ant-bench",
    "anthropic-version": "2023-06-01",
    "user-agent": "bench",
}


def _cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


async def _run(url: str, client: str, body: bytes, calls: int, at_once: int) -> tuple[float, float]:
    """CPU ms and wall ms a call, after a warm-up."""
    upstream = Upstream(
        url, timeout=60, connect=10, max_connections=64, kept_alive=64, client=client
    )

    async def one() -> None:
        answer = await upstream.send(upstream.request("POST", "/v1/messages", b"", HEADERS, body))
        async for _chunk in answer.aiter_bytes():
            pass
        await answer.aclose()

    loop = asyncio.get_running_loop()
    try:
        await asyncio.gather(*[one() for _ in range(at_once)])
        cpu, wall = _cpu(), loop.time()
        for _ in range(calls // at_once):
            await asyncio.gather(*[one() for _ in range(at_once)])
        done = calls // at_once * at_once
        return (_cpu() - cpu) / done * 1000, (loop.time() - wall) / done * 1000
    finally:
        await upstream.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=3200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--size", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    body = b'{"model": "m", "max_tokens": 10, "messages": [' + b"0," * (args.size // 2) + b"0]}"
    clients = ("httpx2", "aiohttp", "httptools")
    print(
        f"Upstream calls, {args.concurrency} at once, bodies of {len(body):,} bytes: CPU and "
        f"wall time a call (ms) of this process, {args.rounds} rounds taking turns"
    )
    cpu: dict[str, list[float]] = {c: [] for c in clients}
    with bench_peers.process("--serve-upstream") as url:
        for _ in range(args.rounds):
            for client in clients:
                used, took = asyncio.run(_run(url, client, body, args.calls, args.concurrency))
                cpu[client].append(used)
                print(f"  {client:>8}: CPU {used:.3f}, wall {took:.3f}")
    medians = ", ".join(f"{c} {statistics.median(cpu[c]):.3f}" for c in clients)
    print(f"CPU a call (ms), median: {medians}")
    for client, against in (
        ("aiohttp", "httpx2"),
        ("httptools", "httpx2"),
        ("httptools", "aiohttp"),
    ):
        ratios = [a / h for a, h in zip(cpu[client], cpu[against], strict=True)]
        print(
            f"  {client} over {against}: {statistics.median(ratios):.2f}x"
            f" (rounds {min(ratios):.2f}-{max(ratios):.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
