"""What ``sluicegate proxy`` costs as a process (run as users run it), where its conversations come
and go or grow: its CPU, page faults and resident size read from ``/proc`` (Linux).

    python tests/benchmarks/bench_proxy_churn.py [--one-shot 1500] [--one-shot-messages 100]
        [--growing 1000,10000] [--calls N]

1. One-shot conversations: ``--one-shot`` new conversations of ``--one-shot-messages`` messages,
   one call each, past ``--max-conversations`` (256): each call's latency (median, p99, the
   slowest), the proxy's CPU a call, and its resident size after. A conversation let go must be
   freed at once; one left for the garbage collector grows the resident size past what the
   conversations held account for, and its collection pauses the calls.
2. The C allocator: one conversation growing a round a call from each of ``--growing``, sent in
   turn to the proxy as it starts (glibc's thresholds fixed) and to one with
   ``--system-allocator``: page faults, CPU and the median call. Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers  # noqa: E402
import httpx2 as httpx  # noqa: E402
from bench_proxy_memory import resident  # noqa: E402

from tests.wire_support import proxy_process  # noqa: E402


def usage(pid: int) -> tuple[float, int]:
    """CPU seconds (user and system) and minor page faults of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


@contextlib.contextmanager
def proxies(*variants: tuple[str, ...]) -> Iterator[list[tuple[str, int]]]:
    """One upstream and a proxy process per variant (its extra arguments); yields (URL, pid)
    per variant."""
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(bench_peers.process("--serve-upstream"))
        store = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        targets = []
        for k, extra in enumerate(variants):
            url, _lines, _code = stack.enter_context(
                proxy_process(upstream, store / str(k), *extra)
            )
            found = subprocess.check_output(
                ["pgrep", "-n", "-f", "--", f"--store {store}/{k}"], text=True
            )
            targets.append((url, int(found)))
        yield targets


def one_shot(count: int, messages: int) -> None:
    print(f"== 1. {count:,} one-shot conversations of {messages} messages, one call each ==")
    with proxies(()) as started, httpx.Client(timeout=120) as client:
        ((url, pid),) = started
        before_rss, _ = resident(pid)
        cpu, _ = usage(pid)
        took = []
        for k in range(count):
            conversation = bench_peers.Conversation(messages, f"once{k}")
            took.append(bench_peers.call(client, url, conversation, conversation.next_body()))
        spent = usage(pid)[0] - cpu
        after_rss, peak = resident(pid)
    took.sort()
    print(
        f"call: median {statistics.median(took):.2f} ms, p99 {bench_peers.p99(took):.2f}, "
        f"slowest {took[-1]:.1f}; the proxy's CPU {spent / count * 1000:.2f} ms a call"
    )
    print(
        f"resident: {before_rss / 2**20:.0f} MiB before, {after_rss / 2**20:.0f} MiB after "
        f"(peak {peak / 2**20:.0f} MiB)"
    )


def growing(sizes: list[int], calls: int) -> None:
    print("\n== 2. one conversation growing a round a call: the proxy as it starts against")
    print("   --system-allocator (calls in turn; page faults, CPU a call, median call) ==")
    with proxies((), ("--system-allocator",)) as started:
        targets = dict(zip(("tuned", "system"), started, strict=True))
        with httpx.Client(timeout=120) as client:
            for n in sizes:
                per = calls or max(30, 300_000 // n)
                conversations = {
                    name: bench_peers.Conversation(n, f"{name}{n}") for name in targets
                }
                for name, (url, _pid) in targets.items():  # their first calls, untimed
                    c = conversations[name]
                    bench_peers.call(client, url, c, c.next_body())
                took: dict[str, list[float]] = {name: [] for name in targets}
                start = {name: usage(pid) for name, (_url, pid) in targets.items()}
                for _ in range(per):
                    for name, (url, _pid) in targets.items():
                        c = conversations[name]
                        took[name].append(bench_peers.call(client, url, c, c.next_body()))
                cells = []
                for name, (_url, pid) in targets.items():
                    cpu, faults = usage(pid)
                    cells.append(
                        f"{name} {(faults - start[name][1]) / per:7.1f} faults "
                        f"{(cpu - start[name][0]) / per * 1000:6.2f} ms CPU "
                        f"{statistics.median(took[name]):6.2f} ms"
                    )
                print(f"{n:>8} messages, {per} calls: " + " | ".join(cells))
                sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--one-shot", type=int, default=1_500)
    parser.add_argument("--one-shot-messages", type=int, default=100)
    parser.add_argument("--growing", default="1000,3000,10000")
    parser.add_argument("--calls", type=int, default=0, help="calls a size (default: by size)")
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    if args.one_shot:
        one_shot(args.one_shot, args.one_shot_messages)
    if args.growing:
        growing([int(n) for n in args.growing.split(",")], args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
