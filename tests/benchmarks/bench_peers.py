"""What a hop costs: the proxy (run as users run it, ``sluicegate proxy``) and ``wrap`` against a
direct call and against a bare Python forwarder (Starlette + httpx, the same stack the proxy
is built on), all in one run, interleaved call by call so the machine's noise falls on all.
The forwarder runs on uvicorn's h11 parser and asyncio's event loop (what ``pip install
uvicorn`` brings) and, where ``httptools`` is installed, on it and on uvloop where that is
installed (``forwarder-ht``, what ``uvicorn[standard]`` brings): the proxy serves on those when
it can, so each ratio is printed against both. The upstream runs on h11 and asyncio's loop.

    python tests/benchmarks/bench_peers.py [--sizes 10,100,1000,10000] [--calls 40]
        [--concurrency 16] [--prepare 1000,5000,10000,20000] [--neighbours 1000,10000]
        [--claude-code-text]

Not a test: it prints figures. ``--claude-code-text``: every conversation's bodies as Claude
Code sends them (raw UTF-8, its system prompt with a character past U+FFFF), not ASCII JSON.

1. **Added latency.** Each target serves one conversation that grows by a round (a tool call and
   its ~2K-char result) per call, as a client loop does; a plain HTTP client sends bodies encoded
   before the clock starts. Per size: median and p99 of each target's wall time per call, and what
   it adds over the direct call (median of the per-call differences, interleaved). ``wrap`` is
   the SDK wrapped against the SDK alone (the SDK's own cost cancels out).
   1b. **First calls.** A new conversation's first call (the proxy meets all its messages at
   once) against its second, at 100 and 1,000 messages.
   1c. **A busy neighbour.** A conversation of 10 messages calling back to back while new
   conversations of ``--neighbours`` messages (1,000; 10,000 too) arrive beside it: its
   latency (p50, p99, max) and how many calls it made.
2. **Throughput.** ``--concurrency`` conversations at 100 messages at once, each sending calls back
   to back for a few seconds: requests a second, p50/p99 latency and the CPU its process spent
   a request (Linux) per target; also the proxy with its store on tmpfs (``/dev/shm``, where an
   fsync costs nothing), when there is one, and the proxy with its upstream calls on aiohttp
   (``--upstream-client aiohttp``) where aiohttp is installed. 2b: the proxy's CPU a call under
   that load against the same load where every call opens a new conversation (a first call):
   what a call that adds a round costs, and the first calls' share of the load's CPU. On a
   machine the load keeps busy, the ratio of requests a second follows the ratio of all three
   processes' CPU a request (the load's client and the upstream share it); the ratio of the
   forwarder's own CPU a request to the proxy's, printed beside it, is what the proxy would
   serve against the forwarder where each alone was the bottleneck.
3. **Per-call work at the wire.** ``WireSession.prepare`` (the drop-in path, no HTTP) per call at
   1K-20K messages, and the exponent of its growth (log-log fit): 1.0 is linear in history.
   3b: the same once the history snip has acted, with a ``cache_control`` mark on the last
   message that moves each call (as Claude Code's does) against one that stays.
4. **Bodies.** The body reader's first read of a body and its read of the next one against
   parsing it whole, and the body writer's write of a body that adds a round against encoding
   it whole (``--sizes`` from 1,000); also with bodies as Claude Code sends them (raw UTF-8,
   one character past U+FFFF).

The upstream is a tiny server in its own process answering every request with the same reply,
so what is measured is the hop, not the upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx2 as httpx  # noqa: E402


def reply_to(n: int, body_bytes: int) -> dict[str, Any]:
    """The upstream's answer to its ``n``-th request: a tool call of its own (ids unique to
    it, as the API's are), usage about the size of the body, as an agent's loop gets."""
    return {
        "id": f"msg_bench{n:08d}",
        "type": "message",
        "role": "assistant",
        "model": "claude-bench",
        "content": [{"type": "tool_use", "id": f"toolu_bench{n:08d}", "name": "x", "input": {}}],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": body_bytes // 4, "output_tokens": 12},
    }


def serve_upstream() -> None:
    """The upstream: reads the body, answers a tool call (a process of its own)."""
    import itertools

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    counter = itertools.count()

    async def messages(request: Request) -> Response:
        body = await request.body()
        reply = json.dumps(reply_to(next(counter), len(body))).encode()
        return Response(reply, media_type="application/json")

    app = Starlette(routes=[Route("/v1/messages", messages, methods=["POST"])])
    _serve(app)


def serve_forwarder(upstream: str, http: str = "h11") -> None:
    """The bare forwarder: what anyone would write in twenty lines to relay the Messages API,
    served by uvicorn on ``http`` (its parser: ``h11``, what ``pip install uvicorn`` brings,
    or ``httptools``, what the proxy serves on when it is installed)."""
    import uvicorn  # noqa: F401
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=upstream, timeout=None)
    drop = {"host", "content-length", "connection"}

    async def messages(request: Request) -> StreamingResponse:
        headers = {k: v for k, v in request.headers.items() if k not in drop}
        sent = client.build_request(
            "POST", "/v1/messages", headers=headers, content=await request.body()
        )
        got = await client.send(sent, stream=True)
        keep = {
            k: v for k, v in got.headers.items() if k not in ("content-length", "transfer-encoding")
        }
        return StreamingResponse(
            got.aiter_raw(), got.status_code, keep, background=BackgroundTask(got.aclose)
        )

    app = Starlette(routes=[Route("/v1/messages", messages, methods=["POST"])])
    _serve(app, http)


def _serve(app: Any, http: str = "h11") -> None:
    """``app`` on ``http``; on h11 with asyncio's loop (what ``pip install uvicorn`` brings),
    on httptools with uvloop where it is installed (``uvicorn[standard]``)."""
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    # connections kept open as long as a run lasts: a target left idle meanwhile finds its
    # pooled connections open, not closed under it
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        http=http,
        loop="asyncio" if http == "h11" else "auto",
        timeout_keep_alive=600,
    )
    uvicorn.Server(config).run(sockets=[sock])


@contextlib.contextmanager
def process(*args: str) -> Iterator[str]:
    """This file run in a mode (``--serve-upstream``, ``--serve-forwarder URL``); yields its URL."""
    proc = subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    found = re.search(r"(http://127\.0\.0\.1:\d+)", line)
    try:
        if found is None:
            raise RuntimeError(f"{args[0]} did not start: {line!r}")
        PIDS[found.group(1)] = proc.pid
        yield found.group(1)
    finally:
        proc.terminate()
        proc.wait(10)


PIDS: dict[str, int] = {}
"""The process serving each target's URL, where known: part 2 prints its CPU a request."""


def cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user and system) of process ``pid`` so far; None where it cannot be read
    (no ``/proc``)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def proxy_command(upstream: str, store: Path, *extra: str) -> Iterator[str]:
    """``python -m pipeline proxy`` as users run it (``extra``: more of its options); yields
    its URL."""
    from tests.wire_support import process_running, proxy_process

    with proxy_process(upstream, store, "--max-connections", "1024", *extra) as (
        url,
        _lines,
        _code,
    ):
        pid = process_running("pipeline", "proxy", str(store))
        if pid is not None:
            PIDS[url] = pid
        yield url


def history(n: int, tag: str = "", size: int = 2_000) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "user", "content": f"start {tag}"}]
    k = 0
    while len(out) < n - 1:
        out += round_of(f"toolu_{tag}{k:05d}", "y", size)
        k += 1
    return out


def round_of(tid: str, fill: str, size: int = 2_000) -> list[dict[str, Any]]:
    return [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": tid, "name": "x", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tid, "content": fill * size}],
        },
    ]


try:
    import httptools  # noqa: F401

    HTTPTOOLS = True
except ImportError:  # the proxy serves on h11 too: only the h11 forwarder is run
    HTTPTOOLS = False
FAST = "forwarder-ht"
"""The forwarder served on httptools and uvloop (where installed), as the proxy is."""


CLAUDE_CODE_SYSTEM = "You are an agent. Sign commits: Generated with Claude Code \U0001f916"
BODIES_AS_CLAUDE_CODE = False
"""Every conversation's bodies as Claude Code sends them (``--claude-code-text``)."""
SPACED_JSON = False
"""Bodies written with a space after each ``,`` and ``:`` (Python's ``json.dumps`` by default)
instead of compactly, as the anthropic SDKs and Claude Code write them."""


def encoded(body: dict[str, Any], *, ascii_only: bool) -> bytes:
    """``body`` as a client sends it: compact JSON, as the anthropic SDKs write it (spaced
    with :data:`SPACED_JSON`)."""
    separators = (", ", ": ") if SPACED_JSON else (",", ":")
    return json.dumps(body, ensure_ascii=ascii_only, separators=separators).encode()


class Conversation:
    """One target's conversation, as an agent's loop holds it: each answer (a tool call) goes
    back in the next request with its result (~2K chars); bodies are encoded before timing."""

    def __init__(self, n: int, tag: str, *, claude_code_text: bool | None = None) -> None:
        self.messages = history(n, tag)
        self.k = 0
        self.claude_code_text = (
            BODIES_AS_CLAUDE_CODE if claude_code_text is None else claude_code_text
        )
        """Bodies as Claude Code sends them: raw UTF-8 (not ``\\u`` escapes) and a system
        prompt holding a character past U+FFFF (its "Generated with Claude Code" line)."""

    def next_body(self) -> bytes:
        body: dict[str, Any] = {"model": "m", "max_tokens": 10, "messages": self.messages}
        if self.claude_code_text:
            body["system"] = CLAUDE_CODE_SYSTEM
        return encoded(body, ascii_only=not self.claude_code_text)

    def answered(self, reply: dict[str, Any]) -> None:
        """The answer to the last body and its tool's result, for the next call."""
        (call,) = reply["content"]
        result = {"type": "tool_result", "tool_use_id": call["id"], "content": "z" * 2_000}
        self.messages = [
            *self.messages,
            {"role": "assistant", "content": reply["content"]},
            {"role": "user", "content": [result]},
        ]
        self.k += 1


def call(client: httpx.Client, url: str, conv: Conversation, raw: bytes) -> float:
    """One timed call of ``conv`` (its body ``raw``); its answer goes into ``conv``."""
    start = time.perf_counter()
    response = client.post(
        url + "/v1/messages",
        content=raw,
        headers={
            "content-type": "application/json",
            "x-api-key": "k",
            "anthropic-version": "2023-06-01",
        },
    )
    elapsed = (time.perf_counter() - start) * 1000
    if response.status_code != 200:
        raise RuntimeError(f"{url}: {response.status_code} {response.text[:200]}")
    conv.answered(response.json())
    return elapsed


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def latency(targets: dict[str, str], sizes: list[int], calls: int) -> None:
    print(
        "\n1. Added latency per call (ms; median / p99 of wall time; added = median of the"
        " per-call difference to direct)"
    )
    heads = (
        ["messages"]
        + [f"{name} med/p99" for name in targets]
        + [f"{n} added" for n in targets if n != "direct"]
        + [f"proxy/{n}" for n in targets if n.startswith("forwarder")]
    )
    print("  ".join(h.rjust(16) for h in heads))
    for n in sizes:
        per_call = min(calls, max(8, calls * 1000 // max(n, 1000)))
        convs = {name: Conversation(n, f"{name}{n}") for name in targets}
        times: dict[str, list[float]] = {name: [] for name in targets}
        with httpx.Client(timeout=120) as client:
            for name, url in targets.items():  # warm: connection, first call of each conversation
                call(client, url, convs[name], convs[name].next_body())
            for _ in range(per_call):
                bodies = {name: convs[name].next_body() for name in targets}
                for name, url in targets.items():
                    times[name].append(call(client, url, convs[name], bodies[name]))
        cells = [f"{statistics.median(times[t]):7.2f}/{p99(times[t]):7.2f}" for t in targets]
        added = [
            statistics.median(a - d for a, d in zip(times[t], times["direct"], strict=True))
            for t in targets
            if t != "direct"
        ]
        by = dict(zip([t for t in targets if t != "direct"], added, strict=True))
        ratios = [
            by["proxy"] / by[f] if by[f] > 0 else math.nan for f in by if f.startswith("forwarder")
        ]
        row = [str(n).rjust(16), *(c.rjust(16) for c in cells)]
        row += [*(f"{a:+16.2f}" for a in added), *(f"{r:15.2f}x" for r in ratios)]
        print("  ".join(row))
        sys.stdout.flush()


def first_calls(targets: dict[str, str], sizes: list[int], conversations: int) -> None:
    """A conversation's first call, where the proxy meets all of its messages at once (the
    later calls meet only what is new): median over ``conversations`` new ones per size."""
    print(
        "\n1b. A new conversation's first call against its second (ms, median over"
        f" {conversations} new conversations each; the proxy has never seen their messages)"
    )
    print(f"{'messages':>10} {'target':>10} {'first':>9} {'second':>9}")
    for n in sizes:
        for name in ("forwarder", "proxy"):
            firsts, seconds = [], []
            with httpx.Client(timeout=120) as client:
                for k in range(conversations):
                    conv = Conversation(n, f"first{name}{n}x{k}")
                    firsts.append(call(client, targets[name], conv, conv.next_body()))
                    seconds.append(call(client, targets[name], conv, conv.next_body()))
            print(
                f"{n:>10} {name:>10} {statistics.median(firsts):9.2f}"
                f" {statistics.median(seconds):9.2f}"
            )
            sys.stdout.flush()


def _long_ones(url: str, tag: str, n: int, stop: Any, firsts: list[float]) -> None:
    """New conversations of ``n`` messages, one after another, until ``stop`` is set: the
    time of each one's first call into ``firsts``."""
    with httpx.Client(timeout=300) as client:
        k = 0
        while not stop.is_set():
            conv = Conversation(n, f"{tag}long{n}x{k}")
            firsts.append(call(client, url, conv, conv.next_body()))
            k += 1


def busy_neighbour(targets: dict[str, str], seconds: float, long: int = 1_000) -> None:
    """A conversation of 10 messages calling back to back while, beside it, new conversations
    of ``long`` messages arrive one after another (each one's first call: every message new)."""
    import threading

    print(
        "\n1c. A small conversation beside new long ones (ms): 10 messages calling back to"
        f" back, while conversations of {long:,} messages new to the target arrive one after"
        " another"
    )
    header = ("target", "small p50", "p99", "max", "calls", "long first p50")
    print(f"{header[0]:>20} {header[1]:>10} {header[2]:>8} {header[3]:>8} {header[4]:>6}"
          f" {header[5]:>15}")  # fmt: skip
    for name, url in targets.items():
        if name == "direct":
            continue
        stop, firsts = threading.Event(), []
        beside = threading.Thread(target=_long_ones, args=(url, name, long, stop, firsts))
        beside.start()
        small, times = Conversation(10, f"{name}small"), []
        with httpx.Client(timeout=60) as client:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                times.append(call(client, url, small, small.next_body()))
                if len(small.messages) > 60:
                    small = Conversation(10, f"{name}small{len(times)}")
        stop.set()
        beside.join()
        times.sort()
        print(
            f"{name:>20} {statistics.median(times):10.1f} {times[int(len(times) * 0.99)]:8.1f}"
            f" {times[-1]:8.1f} {len(times):6d} {statistics.median(firsts):15.1f}"
        )
        sys.stdout.flush()


def wrap_latency(upstream: str, sizes: list[int], calls: int) -> None:
    import anthropic

    from stages import wrap

    print(
        "\n   wrap: the SDK wrapped (and with raw_bodies=True) against the SDK alone (ms per"
        " call, median / p99; added = median difference)"
    )
    for n in sizes:
        per_call = min(calls, max(8, calls * 1000 // max(n, 1000)))
        with tempfile.TemporaryDirectory() as root:
            plain = anthropic.Anthropic(base_url=upstream, api_key="k", max_retries=0)
            wrapped = wrap(
                anthropic.Anthropic(base_url=upstream, api_key="k", max_retries=0), root=Path(root)
            )
            raw = wrap(
                anthropic.Anthropic(base_url=upstream, api_key="k", max_retries=0),
                root=Path(root) / "raw",
                raw_bodies=True,
            )
            convs = {"sdk": history(n, "s"), "wrap": history(n, "w"), "raw": history(n, "r")}
            times: dict[str, list[float]] = {"sdk": [], "wrap": [], "raw": []}
            for k in range(per_call + 1):
                for name, client in (("sdk", plain), ("wrap", wrapped), ("raw", raw)):
                    start = time.perf_counter()
                    reply = client.messages.create(model="m", max_tokens=10, messages=convs[name])  # type: ignore[arg-type]
                    if k:
                        times[name].append((time.perf_counter() - start) * 1000)
                    (tool,) = reply.content
                    convs[name] = [
                        *convs[name],
                        {"role": "assistant", "content": [tool.model_dump()]},
                        {"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": tool.id, "content": "z" * 2_000}
                        ]},
                    ]  # fmt: skip
        added = [
            statistics.median(w - s for w, s in zip(times[name], times["sdk"], strict=True))
            for name in ("wrap", "raw")
        ]
        cells = " ".join(
            f"{name} {statistics.median(t):7.2f}/{p99(t):7.2f}" for name, t in times.items()
        )
        print(f"   {n:>8}  {cells}  added {added[0]:+.2f}, raw_bodies {added[1]:+.2f}")
        sys.stdout.flush()


def throughput(targets: dict[str, str], concurrency: int, seconds: float, rounds: int) -> None:
    """Requests a second at ``concurrency`` conversations of ~100 messages, each target for
    ``seconds`` in each of ``rounds`` rounds, the targets taking turns: one run of a few
    seconds each varies by a third on a small machine, and a ratio of runs made apart varies
    more. Each ratio is the median of the rounds' own ratios, its range beside it."""
    print(
        f"\n2. Throughput: {concurrency} conversations at 100 messages at once,"
        f" {seconds:.0f} s each, {rounds} rounds taking turns"
    )
    print(
        f"{'target':>20} {'req/s':>9} {'rounds':>23} {'p50 ms':>9} {'p99 ms':>9} {'CPU ms/req':>11}"
    )
    rates: dict[str, list[float]] = {name: [] for name in targets}
    times: dict[str, list[float]] = {name: [] for name in targets}
    cpu: dict[str, list[float]] = {name: [] for name in targets}
    for _ in range(rounds):
        for name, url in targets.items():
            pid = PIDS.get(url)
            before = cpu_seconds(pid)
            rate, took = _load(url, name, concurrency, seconds)
            after = cpu_seconds(pid)
            rates[name].append(rate)
            times[name] += took
            if before is not None and after is not None and took:
                cpu[name].append((after - before) / len(took) * 1000)
    for name in targets:
        shown = " ".join(f"{r:.0f}" for r in rates[name])
        used = f"{statistics.median(cpu[name]):11.2f}" if cpu[name] else f"{'-':>11}"
        print(
            f"{name:>20} {statistics.median(rates[name]):9.1f} {shown:>23}"
            f" {statistics.median(times[name]):9.2f} {p99(times[name]):9.2f} {used}"
        )
    for forwarder in (n for n in rates if n.startswith("forwarder")):
        for name in (n for n in rates if n.startswith("proxy")):
            each = [p / f for p, f in zip(rates[name], rates[forwarder], strict=True)]
            # the rates share the machine with the load and the upstream; the CPU a request
            # is what each would serve where it alone was the bottleneck
            used = ""
            if cpu[name] and cpu[forwarder]:
                share = statistics.median(cpu[forwarder]) / statistics.median(cpu[name])
                used = f"; CPU a request, the forwarder's over the proxy's: {share:.2f}x"
            print(
                f"{name}/{forwarder} {statistics.median(each):.2f}x"
                f" (rounds {min(each):.2f}-{max(each):.2f}){used}"
            )
    sys.stdout.flush()


def _load(url: str, name: str, concurrency: int, seconds: float) -> tuple[float, list[float]]:
    """One run against ``url``: requests a second, and each call's time (ms)."""
    stop = time.monotonic() + seconds

    def worker(i: int) -> list[float]:
        conv = Conversation(100, f"t{name}{i}{stop}")
        mine = []
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < stop:
                if len(conv.messages) > 140:  # stay near 100 messages: a new conversation
                    conv = Conversation(100, f"t{name}{i}{stop}r{conv.k}")
                mine.append(call(client, url, conv, conv.next_body()))
        return mine

    began = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        took = [t for mine in pool.map(worker, range(concurrency)) for t in mine]
    return len(took) / (time.monotonic() - began), took


def first_call_share(url: str, concurrency: int, seconds: float, rounds: int = 2) -> None:
    """Part 2b: the proxy's CPU a call under part 2's load (``concurrency`` clients, each
    conversation starting again once past 140 messages: one first call in 21) against the same
    load where every call opens a new conversation of 100 messages (all its messages new to the
    proxy), in turns; from both, a call that adds a round and the first calls' share."""
    pid = PIDS.get(url)
    if cpu_seconds(pid) is None:
        return
    per: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for first in (True, False):
            before = cpu_seconds(pid)
            calls = _calls_for(url, f"fc{r}{first}{time.monotonic()}", first, concurrency, seconds)
            after = cpu_seconds(pid)
            assert before is not None and after is not None
            per[first].append((after - before) / calls * 1000)
    f, mixed = statistics.median(per[True]), statistics.median(per[False])
    rest = (21 * mixed - f) / 20
    print(
        f"\n2b. The proxy's CPU a call (ms; median of {rounds} rounds of {seconds:.0f} s,"
        f" {concurrency} clients): part 2's load {mixed:.2f}; every call a new conversation"
        f" {f:.2f}; so a call that adds a round ~{rest:.2f} ({f / rest:.1f}x less), and first"
        f" calls ~{f / (21 * mixed):.0%} of part 2's CPU"
    )
    sys.stdout.flush()


def _calls_for(url: str, tag: str, first: bool, concurrency: int, seconds: float) -> int:
    """Calls made in ``seconds`` by ``concurrency`` clients: each a new conversation of 100
    messages (``first``), or as in part 2 (one conversation each, growing a round a call,
    starting again once past 140 messages)."""
    stop = time.monotonic() + seconds

    def worker(i: int) -> int:
        made, k = 0, 0
        conv = Conversation(100, f"{tag}-{i}-0")
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < stop:
                if (first and made) or len(conv.messages) > 140:
                    k += 1
                    conv = Conversation(100, f"{tag}-{i}-{k}")
                call(client, url, conv, conv.next_body())
                made += 1
        return made

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(worker, range(concurrency)))


def prepare_scaling(sizes: list[int], calls: int) -> None:
    from pipeline import Pipeline
    from pipeline.dropin.adapter import WireSession
    from stages import default_stages

    print(
        "\n3. WireSession.prepare and observe_async per call (ms, median over calls; the"
        " conversation grows a round a"
        " call; 100-char results and a 10M-token window, so no stage fires: the steady cost)"
    )

    async def run(n: int, root: Path) -> float:
        pipeline = Pipeline(default_stages(context_window=10_000_000))
        session = await WireSession.open(f"bench{n}", root, pipeline)
        messages: list[Any] = history(n, "p", 100)
        times = []
        for k in range(calls + 1):
            start = time.perf_counter()
            await session.prepare(messages)
            # the response, as the proxy observes it: its usage anchors the next estimate
            usage = {"input_tokens": 3 + len(messages) * 30, "output_tokens": 20}
            await session.observe_async(f"msg_p{k}", usage, "m")
            if k:
                times.append((time.perf_counter() - start) * 1000)
            messages = messages + round_of(f"toolu_pn{k}", "z", 100)
        return statistics.median(times)

    medians = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as root:
            medians.append(asyncio.run(run(n, Path(root))))
        print(f"{n:>8} messages {medians[-1]:9.3f} ms")
        sys.stdout.flush()
    if len(sizes) > 1:
        xs = [math.log(n) for n in sizes]
        ys = [math.log(m) for m in medians]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        print(
            f"exponent {slope:.2f}; {sizes[-1]:,} against {sizes[0]:,}:"
            f" {medians[-1] / medians[0]:.2f}x"
        )


def _moved_mark(messages: list[Any]) -> list[Any]:
    """``messages`` as Claude Code sends them: its last block marked with ``cache_control``
    (the message that held the mark the call before comes without it: another object)."""
    last = dict(messages[-1])
    content = last["content"]
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    last["content"] = [*content[:-1], {**content[-1], "cache_control": {"type": "ephemeral"}}]
    return [*messages[:-1], last]


def marked_prepare(sizes: list[int], calls: int) -> None:
    """``WireSession.prepare`` once the history snip has acted: without a cache mark, and
    with one moved each call as Claude Code moves it."""
    from pipeline import Pipeline
    from pipeline.dropin.adapter import WireSession
    from stages import default_stages

    print(
        "\n3b. WireSession.prepare and observe_async per call once the history snip has acted"
        " (ms, median / mean / max over the calls; the default 200K window, usage the size of"
        " the request): the messages as sent before, and with a cache_control mark on the last"
        " message, moved each call as Claude Code moves it. The snip acts again every few"
        " dozen calls, on the whole history (the max): the mean holds it"
    )

    async def run(n: int, root: Path, mark: bool) -> list[float]:
        session = await WireSession.open(f"mark{n}", root, Pipeline(default_stages()))
        conv = Conversation(n, "m")
        times = []
        for k in range(calls + 1):
            messages = _moved_mark(conv.messages) if mark else list(conv.messages)
            start = time.perf_counter()
            sent = await session.prepare(messages)
            prepared = time.perf_counter() - start
            # usage the size of what was sent: past the snip's trigger on the first call
            # (~2K-char results), then what the snip left, growing a round a call
            reply = reply_to(k, len(json.dumps(sent)))
            start = time.perf_counter()
            await session.observe_async(reply["id"], reply["usage"], "m")
            if k:
                times.append((prepared + time.perf_counter() - start) * 1000)
            conv.answered(reply)
        return times

    def shown(times: list[float]) -> str:
        return (
            f"{statistics.median(times):7.3f} / {statistics.mean(times):7.3f} / {max(times):7.1f}"
        )

    for n in sizes:
        got = []
        for mark in (False, True):
            with tempfile.TemporaryDirectory() as root:
                got.append(asyncio.run(run(n, Path(root), mark)))
        print(f"{n:>8} messages  no mark {shown(got[0])}  moved mark {shown(got[1])}")
        sys.stdout.flush()


def bodies(sizes: list[int]) -> None:
    """The body reader and writer against parsing and encoding whole, per body."""
    from pipeline.wire.body_reader import BodyReader
    from pipeline.wire.body_writer import BodyWriter
    from pipeline.wire.encoding import dumps_body, loads_body

    print(
        "\n4. Bodies (ms, best of 5): a first body read (shared strings included), the next"
        " body (a round more) read, and with the cache mark moved onto its last message (as"
        " Claude Code does; and the median of 16 conversations' next bodies read in turn by one"
        " reader, up to 1,000 messages), against a whole parse; a body that adds a round written"
        " against a whole encode. 'cc': bodies as Claude Code sends them (raw UTF-8, a"
        " character past U+FFFF in the system prompt)"
    )
    for n in sizes:
        for cc in (False, True):
            conv = Conversation(n, f"b{n}", claude_code_text=cc)
            raw = conv.next_body()
            read_first = min(_timed(lambda raw=raw: BodyReader().read(raw)) for _ in range(5))
            parse_whole = min(_timed(lambda raw=raw: loads_body(raw)) for _ in range(5))
            reader = BodyReader(max_bytes=2**31)
            reader.read(raw)
            marking = BodyReader(max_bytes=2**31)
            marking.read(_cache_marked(conv))
            writer, msgs = BodyWriter(max_bytes=2**31), list(conv.messages)
            writer.write("c", {"model": "m", "messages": msgs})
            read_next, marked, written, encoded = [], [], [], []
            for k in range(5):
                conv.messages = conv.messages + round_of(f"toolu_b{k}", "z")
                raw = conv.next_body()
                read_next.append(_timed(lambda raw=raw, r=reader: r.read(raw)))
                raw = _cache_marked(conv)
                marked.append(_timed(lambda raw=raw, r=marking: r.read(raw)))
                msgs = msgs + round_of(f"toolu_b{k}", "z")
                body = {"model": "m", "max_tokens": 10, "messages": msgs}
                written.append(_timed(lambda body=body, w=writer: w.write("c", body)))
                encoded.append(_timed(lambda body=body: dumps_body(body)))
            in_turn = _read_in_turn(n, cc) if n <= 1_000 else float("nan")
            print(
                f"{n:>8} messages{' cc' if cc else '   '}  read first {read_first:7.2f}"
                f"  read next {min(read_next):6.2f} (mark moved {min(marked):6.2f},"
                f" 16 in turn {in_turn:6.2f})"
                f"  parse whole {parse_whole:7.2f}"
                f"  write {min(written):7.2f}  encode whole {min(encoded):7.2f}"
            )
            sys.stdout.flush()


def _read_in_turn(n: int, cc: bool, conversations: int = 16, rounds: int = 8) -> float:
    """The median time (ms) of a next body's read when ``conversations`` take turns."""
    from pipeline.wire.body_reader import BodyReader

    reader = BodyReader(max_bytes=2**31)
    talks = [Conversation(n, f"t{n}.{c}", claude_code_text=cc) for c in range(conversations)]
    times = []
    for k in range(rounds):
        for talk in talks:
            talk.messages = talk.messages + round_of(f"toolu_t{k}", "z")
            raw = talk.next_body()
            spent = _timed(lambda raw=raw: reader.read(raw))
            if k:
                times.append(spent)
    return statistics.median(times)


def _cache_marked(conv: Conversation) -> bytes:
    """``conv``'s next body with a ``cache_control`` mark on its last message only."""
    *earlier, last = conv.messages
    marked = [{**block, "cache_control": {"type": "ephemeral"}} for block in last["content"]]
    body = json.loads(conv.next_body())
    body["messages"] = [*earlier, {**last, "content": marked}]
    return encoded(body, ascii_only=not conv.claude_code_text)


def _timed(work: Any) -> float:
    start = time.perf_counter()
    work()
    return (time.perf_counter() - start) * 1000


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-upstream":
        serve_upstream()
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-forwarder":
        serve_forwarder(*sys.argv[2:4])
        return 0
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000,10000")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds")
    parser.add_argument("--prepare", default="1000,5000,10000,20000")
    parser.add_argument("--neighbours", default="1000", help="sizes of 1c's long conversations")
    parser.add_argument(
        "--skip",
        default="",
        help="parts to leave out: latency,first,busy,wrap,throughput,firstcpu,prepare,marked,"
        "bodies",
    )
    parser.add_argument(
        "--claude-code-text",
        action="store_true",
        help="bodies as Claude Code sends them: raw UTF-8, a character past U+FFFF",
    )
    args = parser.parse_args()
    global BODIES_AS_CLAUDE_CODE
    BODIES_AS_CLAUDE_CODE = args.claude_code_text
    skip = set(filter(None, args.skip.split(",")))
    sizes = [int(x) for x in args.sizes.split(",")]
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(process("--serve-upstream"))
        forwarder = stack.enter_context(process("--serve-forwarder", upstream))
        store = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        proxy = stack.enter_context(proxy_command(upstream, store / "p"))
        targets = {"direct": upstream, "forwarder": forwarder, "proxy": proxy}
        if HTTPTOOLS:  # the forwarder on the parser the proxy serves on: the same hop for both
            fast = stack.enter_context(process("--serve-forwarder", upstream, "httptools"))
            targets = {"direct": upstream, "forwarder": forwarder, FAST: fast, "proxy": proxy}
        if "latency" not in skip:
            latency(targets, sizes, args.calls)
        if "first" not in skip:
            first_calls(targets, [n for n in (100, 1000) if n <= max(sizes)] or [10], 15)
        if "busy" not in skip:
            for long in (int(x) for x in args.neighbours.split(",")):
                busy_neighbour(targets, args.seconds, long)
        if "wrap" not in skip:
            wrap_latency(upstream, sizes, args.calls)
        if "throughput" not in skip:
            loads = dict(targets)
            memory = Path("/dev/shm")
            if memory.is_dir() and os.access(memory, os.W_OK):
                # the same proxy with its store where an fsync costs nothing: what the disk's
                # durability costs a request (records are made durable in groups, after the calls)
                shm = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=memory)))
                loads["proxy (tmpfs store)"] = stack.enter_context(
                    proxy_command(upstream, shm / "p")
                )
            if importlib.util.find_spec("aiohttp") is not None:
                # the upstream calls on aiohttp, as before httptools' client was the default
                loads["proxy (aiohttp)"] = stack.enter_context(
                    proxy_command(upstream, store / "a", "--upstream-client", "aiohttp")
                )
            throughput(loads, args.concurrency, args.seconds, args.rounds)
        if "firstcpu" not in skip:
            first_call_share(proxy, args.concurrency, args.seconds)
    if "prepare" not in skip:
        prepare_scaling([int(x) for x in args.prepare.split(",")], 12)
    if "marked" not in skip:
        marked_prepare([n for n in (1_000, 10_000) if n <= max(sizes)] or [max(sizes)], 150)
    if "bodies" not in skip:
        bodies([n for n in sizes if n >= 1000] or sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
