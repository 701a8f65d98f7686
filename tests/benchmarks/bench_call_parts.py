"""Where a proxy call's time goes, part by part: a conversation's first call and a call that
adds a round, at 100 messages (``--messages``), through the proxy's ASGI app in-process (no
sockets: an in-memory client and upstream, whose own time is in the total only).

Each part is one of the proxy's own functions, timed around each call with ``perf_counter``
(its callees included; nested parts overlap). For finding where to look, not a target:
``bench_peers.py`` measures what a user pays.

    python tests/benchmarks/bench_call_parts.py [--conversations 100] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import itertools
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers as peers  # noqa: E402
import httpx2  # noqa: E402

from pipeline.core import Pipeline  # noqa: E402
from pipeline.dropin import adapter, conversations, observing  # noqa: E402
from pipeline.dropin.family_placement import FamilyPlacement  # noqa: E402
from pipeline.dropin.proxy import build_app  # noqa: E402
from pipeline.dropin.session_writes import SessionWrites  # noqa: E402
from pipeline.wire import body_reader, body_writer, cache  # noqa: E402
from stages import (  # noqa: E402
    Autocompact,
    ContextCollapse,
    HistorySnip,
    Microcompact,
    ToolResultBudget,
    default_stages,
)

SPENT: dict[str, float] = {}

PARTS: list[tuple[Any, str, str]] = [
    (body_reader.BodyReader, "read_source_async", "read the body"),
    (conversations.Conversations, "route", "place it in its conversation"),
    (adapter.WireSession, "prepare_call", "prepare the call"),
    (adapter.WireSession, "_sync", "  its records"),
    (FamilyPlacement, "_place_answered", "  results answered before (recorded)"),
    (Pipeline, "run", "  the stages"),
    *((s, "__call__", f"    {s.__name__}") for s in (ToolResultBudget, HistorySnip)),
    *((s, "__call__", f"    {s.__name__}") for s in (Microcompact, ContextCollapse)),
    (Autocompact, "__call__", "    Autocompact"),
    (cache.WireCache, "to_api", "  the wire form"),
    (body_writer.BodyWriter, "write", "write the body"),
    (observing.ResponseObserving, "catch_up", "read the answer (record, learn)"),
    (SessionWrites, "appended", "append records"),
]


def _timed(owner: Any, name: str, label: str) -> None:
    inner: Callable[..., Any] = getattr(owner, name)
    if asyncio.iscoroutinefunction(inner):

        @functools.wraps(inner)
        async def waited(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await inner(*args, **kwargs)
            finally:
                SPENT[label] = SPENT.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, waited)
        return

    @functools.wraps(inner)
    def called(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[label] = SPENT.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, name, called)


def _report(title: str, calls: int, total: float) -> None:
    print(f"\n{title}: {total / calls * 1000:.3f} ms a call in all ({calls} calls)")
    for _owner, _name, label in PARTS:
        spent = SPENT.get(label)
        if spent is not None:
            print(f"  {label:<40} {spent / calls * 1000:8.3f} ms")
    SPENT.clear()


Call = Callable[[peers.Conversation], Awaitable[None]]
"""Send a conversation's next body and take its answer into it."""


@contextlib.asynccontextmanager
async def in_process(app: Any = None, **build: Any) -> AsyncIterator[Call]:
    """The proxy's app (``build_app`` with the default stages and an in-memory upstream, with
    ``build``'s arguments besides) or ``app``, served in-process to an in-memory client."""
    ids = itertools.count()

    def upstream(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, json=peers.reply_to(next(ids), len(request.content)))

    headers = {"content-type": "application/json", "x-api-key": "k", "anthropic-version": "1"}
    with tempfile.TemporaryDirectory() as root:
        if app is None:
            app = build_app(
                pipeline=lambda: Pipeline(default_stages()),
                root=Path(root),
                upstream="http://upstream",
                transport=httpx2.MockTransport(upstream),
                **build,
            )
        transport = httpx2.ASGITransport(app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://proxy") as client:

            async def call(conv: peers.Conversation) -> None:
                response = await client.post(
                    "/v1/messages", content=conv.next_body(), headers=headers
                )
                if response.status_code != 200:
                    raise RuntimeError(response.text[:200])
                conv.answered(response.json())

            yield call


async def _run(conversations_: int, messages: int, rounds: int) -> None:
    async with in_process() as call:
        for k in range(10):  # warm: imports, the first conversation's files
            await call(peers.Conversation(messages, f"warm{k}"))
        SPENT.clear()
        convs = [peers.Conversation(messages, f"c{k}") for k in range(conversations_)]
        gc.collect()
        start = time.perf_counter()
        for conv in convs:
            await call(conv)
        _report(f"A first call ({messages} messages)", len(convs), time.perf_counter() - start)
        gc.collect()
        start = time.perf_counter()
        for _ in range(rounds):
            for conv in convs:
                await call(conv)
        calls = rounds * len(convs)
        _report("A call that adds a round", calls, time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=50)
    parser.add_argument("--messages", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    for owner, name, label in PARTS:
        _timed(owner, name, label)
    asyncio.run(_run(args.conversations, args.messages, args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
