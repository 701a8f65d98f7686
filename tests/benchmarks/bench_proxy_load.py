"""The proxy under load, run as users run it (``python -m pipeline proxy``, a process): many
conversations and requests, its memory before and after; then idle connections at its
descriptor limit.

    python tests/benchmarks/bench_proxy_load.py [--conversations 1000] [--calls 5]
        [--concurrency 16] [--held 1000,256,100]

Not a test: it prints figures. Loopback only, against a scripted upstream in this process.

1. **Conversations.** For each ``--held`` bound (``--max-conversations``), a fresh proxy and
   store: ``--conversations`` conversations of ``--calls`` calls each, ``--concurrency`` at once;
   each call adds a tool call and its output (every third one 60K chars, persisted). Printed:
   requests a second, latency mean, p50, p99, the proxy's RSS at start and at the end, and how
   many conversations it held at most.
2. **Idle connections at the descriptor limit.** A proxy limited to 256 descriptors, 400
   connections that send half a request head and stay; printed: how long until a normal
   request is answered again, and how many lines the proxy logged meanwhile.
"""

from __future__ import annotations

import argparse
import resource
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx2  # noqa: E402

from pipeline.testing import Reply, ScriptedMessagesServer  # noqa: E402
from tests.wire_support import proxy_process  # noqa: E402


def reply(_body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "ok"}])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def proxy_pid(url: str) -> int:
    """The pid of the process listening on ``url``'s port (the proxy)."""
    port = int(url.rsplit(":", 1)[1])
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
            inodes.add(fields[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if fd.readlink().name.removeprefix("socket:[").rstrip("]") in inodes:
                    return int(proc.name)
        except OSError:
            continue
    raise RuntimeError(f"no process listens on {url}")


def conversation(url: str, number: int, calls: int) -> list[float]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {number}"}]
    times = []
    with httpx2.Client(timeout=60) as client:
        for k in range(calls):
            tid = f"toolu_{number:05d}_{k}"
            size = 60_000 if k % 3 == 2 else 2_000
            messages += [
                {"role": "assistant", "content": [{"type": "tool_use", "id": tid, "name": "Bash",
                                                   "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid,
                                              "content": f"{number}/{k} " + "y" * size}]},
            ]  # fmt: skip
            body = {"model": "m", "max_tokens": 5, "messages": messages}
            started = time.perf_counter()
            answer = client.post(f"{url}/v1/messages", json=body)
            times.append(time.perf_counter() - started)
            answer.raise_for_status()
            messages.append({"role": "assistant", "content": "ok"})
            messages.append({"role": "user", "content": "go on"})
    return times


def load(conversations: int, calls: int, concurrency: int, held: int) -> None:
    with (
        tempfile.TemporaryDirectory() as tmp,
        ScriptedMessagesServer(reply) as upstream,
        proxy_process(upstream.base_url, Path(tmp), "--max-conversations", str(held)) as (
            url,
            lines,
            _,
        ),
    ):
        pid = proxy_pid(url)
        before = rss_mib(pid)
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            runs = list(pool.map(lambda n: conversation(url, n, calls), range(conversations)))
        wall = time.perf_counter() - started
        after = rss_mib(pid)
    times = sorted(t * 1000 for run in runs for t in run)
    p99 = times[int(len(times) * 0.99) - 1]
    print(
        f"held <= {held:>5}: {len(times):,} requests in {wall:.1f} s ({len(times) / wall:.0f}/s); "
        f"ms mean {statistics.mean(times):.1f}, p50 {statistics.median(times):.1f}, "
        f"p99 {p99:.1f}; RSS {before:.0f} -> {after:.0f} MiB"
    )
    errors = [line for line in lines if '"status": 5' in line or "Traceback" in line]
    if errors:
        print(f"  {len(errors)} failed or traceback lines, e.g. {errors[0][:200]}")


def few_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


def idle_connections(count: int = 400) -> None:
    with (
        tempfile.TemporaryDirectory() as tmp,
        ScriptedMessagesServer(reply) as upstream,
        proxy_process(upstream.base_url, Path(tmp), preexec_fn=few_files) as (url, lines, _),
    ):
        host, port = url.removeprefix("http://").split(":")
        held = []
        for _ in range(count):
            try:
                conn = socket.create_connection((host, int(port)), timeout=5)
                conn.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\n")
                held.append(conn)
            except OSError:
                break
        logged_before = len(lines)
        started = time.perf_counter()
        body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        status, refused = None, 0
        while status != 200 and time.perf_counter() - started < 120:
            try:
                status = httpx2.post(f"{url}/v1/messages", json=body, timeout=5).status_code
            except httpx2.TransportError:
                status = None
            if status != 200:
                refused += 1
                time.sleep(0.2)
        waited = time.perf_counter() - started
        for conn in held:
            conn.close()
        logged = len(lines) - logged_before
    print(
        f"{len(held)} half-open connections against 256 descriptors: a request answered "
        f"{status} after {waited:.1f} s ({refused} tries refused or unanswered before, one "
        f"each 0.2 s); {logged} log lines meanwhile"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=1_000)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--held", default="1000,256,100")
    args = parser.parse_args()
    for held in (int(h) for h in args.held.split(",")):
        load(args.conversations, args.calls, args.concurrency, held)
    idle_connections()


if __name__ == "__main__":
    main()
