"""What a conversation held by the proxy costs in memory: ``sluicegate proxy`` run as users run
it (a process), fed conversations that grow as an agent's loop grows them, its resident size
read from ``/proc`` (Linux).

    python tests/benchmarks/bench_proxy_memory.py [--conversations 16] [--messages 1000]
        [--calls 10] [--claude-code-text] [--spaced-json] [--max-held-size SIZE] [--traced]
        [--corpus DIR [--copies K]]

Each conversation opens with ``--messages`` messages (~2K-character tool results) and then makes
``--calls`` calls, each sending the answer back with a new result. Printed: the proxy's resident
size before and after (right after the last answer, and at rest: a second of quiet later, once
it has given the C heap's free pages back), what it grew by, and that against the size of the
last request of every conversation (the conversation's wire text: what a client re-sends each
call). The growth holds
the conversations (their records, the stages' state, the wire form) and what the proxy keeps to
read and write the next requests in the size of what is new in them (the last bodies as parsed,
one a conversation held; the bytes written of its own, at most 32 MiB). ``--claude-code-text``:
bodies as Claude Code sends them (raw UTF-8, a system prompt with a character past U+FFFF).
Bodies are compact JSON, as the anthropic SDKs and Claude Code write them; ``--spaced-json``:
spaced, as Python's ``json.dumps`` writes by default (the proxy then keeps the bytes it sent on:
see ``pipeline.wire.body_writer``). ``--max-held-size SIZE``: the proxy's option (what the
conversations it holds last sent may come to; past it it lets the least recently used go), to
see its resident size stay bounded when the conversations' requests come to more.
``--traced``: the proxy served in this process instead (the same app, on a thread), its
allocations traced while the conversations grow, and what they left charged to the module that
made each one: where a conversation's memory goes (charged where it was made, not to what holds
it: the request bodies the body reader keeps are joined in ``pipeline/dropin/proxy.py``).
``--corpus DIR``: the conversations are the Claude Code sessions of a corpus of transcripts
instead (``claude-code_*/**/*.jsonl``, the ``--conversations`` largest), each sent in
``--calls`` growing requests cut after a user message, as Claude Code writes JSON: what a held
conversation costs with real outputs; ``--copies K``: each session sent as ``K`` conversations
(each copy's first message opens with a line of its own), a load large enough that what a
process pays once does not weigh on it. Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers  # noqa: E402
import httpx2 as httpx  # noqa: E402

from pipeline._cli.allocator import IDLE_TRIM  # noqa: E402
from pipeline.dropin.held_families import held_size  # noqa: E402
from tests.wire_support import proxy, proxy_process  # noqa: E402

_REST = IDLE_TRIM + 1.0
"""Seconds waited before a resident size is read at rest: the proxy gives the C heap's free
pages back once it has been idle for a second (``pipeline._cli.allocator``)."""
_TOP = 14
"""Modules printed by ``--traced`` (the rest are summed)."""


def resident(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in bytes."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--messages", type=int, default=1_000)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--claude-code-text", action="store_true")
    parser.add_argument("--traced", action="store_true")
    parser.add_argument("--spaced-json", action="store_true")
    parser.add_argument("--max-held-size", metavar="SIZE", help="the proxy's own option")
    parser.add_argument("--corpus", type=Path, help="real sessions' transcripts instead")
    parser.add_argument(
        "--copies", type=int, default=1, help="with --corpus: each session as this many"
    )
    args = parser.parse_args()
    bench_peers.SPACED_JSON = args.spaced_json
    if args.traced:
        return traced(args)
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(bench_peers.process("--serve-upstream"))
        store = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        bound = ["--max-held-size", args.max_held_size] if args.max_held_size else []
        url, _lines, _code = stack.enter_context(proxy_process(upstream, store / "p", *bound))
        pid = int(
            subprocess.check_output(["pgrep", "-n", "-f", "--", f"--store {store}/p"], text=True)
        )
        with httpx.Client(timeout=300) as client:
            warm_up(client, url, args)
            time.sleep(_REST)
            before, _ = resident(pid)
            sizes = list(conversations(client, url, args))
            last = sum(size for size, _ in sizes)
            held = sum(held_size(size, n) for size, n in sizes)
            busy, _ = resident(pid)
            time.sleep(_REST)
            after, peak = resident(pid)
    grown = after - before
    print(heading(args))
    print(
        f"the proxy's resident size: {before / 2**20:.1f} MiB before, {busy / 2**20:.1f} MiB "
        f"right after the last answer, {after / 2**20:.1f} MiB at rest (peak "
        f"{max(peak, busy) / 2**20:.1f} MiB)"
    )
    print(f"right after the last answer: {(busy - before) / last:.2f}x a conversation's wire text")
    print(
        f"grown by {grown / 2**20:.1f} MiB for {last / 2**20:.1f} MiB of last requests: "
        f"{grown / last:.2f}x a conversation's wire text at rest"
        + (f" (the proxy held at most {args.max_held_size} of them)" if args.max_held_size else "")
    )
    print(
        f"their held size (--max-held-size counts each body's bytes and 2 KiB a message): "
        f"{held / 2**20:.1f} MiB, {grown / held:.2f}x"
    )
    return 0


def heading(args: argparse.Namespace) -> str:
    if args.corpus is not None:
        return (
            f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}; the {args.conversations} "
            f"largest Claude Code sessions of {args.corpus}, {args.calls} calls each"
            + (f", each sent as {args.copies} conversations" if args.copies > 1 else "")
        )
    return (
        f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}; {args.conversations} "
        f"conversations of {args.messages:,} messages and {args.calls} calls each"
        + (", bodies as Claude Code sends them" if args.claude_code_text else "")
        + (", JSON spaced (not as the SDKs write it)" if args.spaced_json else "")
    )


def warm_up(client: httpx.Client, url: str, args: argparse.Namespace) -> None:
    """What a first request costs once in a process (its imports, its caches: the token
    estimator's masks grow once for a long text of wide characters), paid before measuring:
    with ``--corpus``, a session of it not measured (the one after the largest
    ``--conversations``), sent whole."""
    wide = "\u4e2d\u6587 \u00e9t\u00e9 " * 8_000  # the token estimator's masks grow once for it
    _send(
        client, url, Path("warm"), [{"role": "user", "content": [{"type": "text", "text": wide}]}]
    )
    if args.corpus is None:
        warm = bench_peers.Conversation(10, "warm")
        bench_peers.call(client, url, warm, warm.next_body())
        return
    files = _corpus_files(args.corpus)[args.conversations :]
    for path in files[:1]:
        _send(client, url, path, _messages_of(path))


def _corpus_files(corpus: Path) -> list[Path]:
    return sorted(corpus.glob("claude-code_*/**/*.jsonl"), key=lambda f: -f.stat().st_size)


def _messages_of(path: Path) -> list[Any]:
    from pipeline.transcript.read import load_transcript
    from pipeline.wire.form import to_api

    return list(to_api(load_transcript(path, strict=False).messages))


def _send(client: httpx.Client, url: str, path: Path, messages: list[Any]) -> int:
    """One request of ``messages`` as Claude Code writes it; its size."""
    body = {"model": "m", "max_tokens": 10, "messages": messages}
    raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    answer = client.post(
        url + "/v1/messages",
        content=raw,
        headers={"content-type": "application/json", "x-api-key": "k"},
    )
    if answer.status_code != 200:
        raise RuntimeError(f"{path.name}: {answer.status_code} {answer.text[:200]}")
    return len(raw)


def corpus_conversations(
    client: httpx.Client, url: str, args: argparse.Namespace
) -> Iterator[tuple[int, int]]:
    """``--corpus``: each of the largest Claude Code sessions sent in ``args.calls`` growing
    requests; yields its last request's size and messages."""
    for path in _corpus_files(args.corpus)[: args.conversations]:
        for copy in range(args.copies):
            messages = _messages_of(path)
            if copy:
                messages[0] = _marked(messages[0], copy)
            cuts = [i + 1 for i, m in enumerate(messages) if m["role"] == "user" and i > 0]
            if not cuts:
                continue
            step = max(1, len(cuts) // args.calls)
            for end in [*cuts[step - 1 :: step][: args.calls - 1], cuts[-1]]:
                size = _send(client, url, path, messages[:end])
            yield size, end


def _marked(first: dict[str, Any], copy: int) -> dict[str, Any]:
    """``first`` (a session's first message) opening with a line of its own: the copy is a
    conversation of its own."""
    content = first["content"]
    mark = f"copy {copy}\n"
    if isinstance(content, str):
        return {**first, "content": mark + content}
    return {**first, "content": [{"type": "text", "text": mark}, *content]}


def conversations(
    client: httpx.Client, url: str, args: argparse.Namespace
) -> Iterator[tuple[int, int]]:
    """Each conversation grown through the proxy at ``url``; yields its last request's size
    and messages."""
    if args.corpus is not None:
        yield from corpus_conversations(client, url, args)
        return
    for k in range(args.conversations):
        conversation = bench_peers.Conversation(
            args.messages, f"c{k}", claude_code_text=args.claude_code_text
        )
        for _ in range(args.calls + 1):
            raw = conversation.next_body()
            bench_peers.call(client, url, conversation, raw)
        yield len(raw), len(json.loads(raw)["messages"])


def traced(args: argparse.Namespace) -> int:
    """``--traced``: the growth by the module that allocated it (the proxy on a thread here)."""
    from pipeline import Pipeline
    from stages import default_stages

    def stages() -> Pipeline:
        return Pipeline(default_stages())

    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(bench_peers.process("--serve-upstream"))
        store = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        url = stack.enter_context(proxy(upstream, store / "p", stages))
        with httpx.Client(timeout=300) as client:
            warm_up(client, url, args)
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.take_snapshot()
            last = 0
            for size, _messages in conversations(client, url, args):
                last += size
            gc.collect()
            after = tracemalloc.take_snapshot()
            tracemalloc.stop()
    grown = Counter[str]()
    for stat in after.compare_to(before, "filename"):
        grown[_module(stat.traceback[0].filename)] += stat.size_diff
    client_side = grown.pop("(this benchmark: its client)", 0)
    total = sum(grown.values())
    print(heading(args) + ", the proxy in this process, its allocations traced")
    print(
        f"left allocated by the proxy: {total / 2**20:.1f} MiB for {last / 2**20:.1f} MiB of "
        f"last requests: {total / last:.2f}x (the benchmark's own client: "
        f"{client_side / 2**20:.1f} MiB, not counted)"
    )
    ranked = grown.most_common()
    for name, size in ranked[:_TOP]:
        print(f"  {size / last:6.3f}x  {size / 2**20:7.2f} MiB  {name}")
    rest = sum(size for _name, size in ranked[_TOP:])
    print(f"  {rest / last:6.3f}x  {rest / 2**20:7.2f} MiB  ({len(ranked) - _TOP} more)")
    return 0


def _module(filename: str) -> str:
    """The project's module a file is (``pipeline/wire/body_split.py``), the benchmark's own
    client, or another package's file name."""
    path = Path(filename)
    if path.is_relative_to(REPO / "tests"):
        return "(this benchmark: its client)"
    if path.is_relative_to(REPO):
        return path.relative_to(REPO).as_posix()
    return path.name


if __name__ == "__main__":
    sys.exit(main())
