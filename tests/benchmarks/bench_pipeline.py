"""Benchmark the pipeline's per-turn cost, corpus replay, replay memory and concurrent sessions.

    python tests/benchmarks/bench_pipeline.py [--sizes 100,1000,5000,20000] [--runs 7]
        [--only turn,replay,memory,sessions] [--sessions 1000] [--corpus DIR]

Not a test (pytest collects ``test_*.py`` only) and nothing here asserts a timing: it prints
figures -- medians of several runs, and ratios against a baseline measured in the same run.

1. ``turn``: per-turn overhead at N messages of a synthetic coding session (parallel tool
   calls, large results, progress records) grown turn by turn through the default pipeline,
   each response's usage being the size of the request the pipeline sent -- as live, so the
   stages act as they would (the budget persists, history snip removes rounds near the window).
   At each size the next turns are timed: the default pipeline (incremental, with a per-stage
   breakdown) against the same five stages with ``incremental=False`` (every pass re-derives
   everything from the whole history: the straightforward full rescan), resumed from the same
   decisions and fed the same inputs. Also the budget stage alone against ``FullRescanBudget``
   below (the budget done the straightforward way), and ``to_api`` (what an agent does next).
   Stores are in memory (disk I/O is not pipeline overhead) and logs are dropped.
2. ``replay``: every corpus session (``claude-code_*/**/*.jsonl``) loaded and replayed through
   the default pipeline with ``replay_messages`` (as the CLI does, minus printing), against just
   loading it.
3. ``memory``: peak traced memory (tracemalloc) of loading + replaying the largest sessions
   against the transcript's size, and of the replay alone; plus the max RSS of a subprocess
   that replays them, against one that only loads them.
4. ``sessions``: N sessions in one process (anyio task group), each its own ``SessionContext``
   over a real file store in a temp dir, several interleaved turns with tool results (some
   persisted); turns per second.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # this checkout's package, even when run from elsewhere

import anyio  # noqa: E402

from pipeline import (  # noqa: E402
    Message,
    Pipeline,
    ReplacementState,
    SessionContext,
    ToolPolicies,
    Usage,
    load_transcript,
    to_api,
)
from pipeline.gate import empty_result_text, is_persistable, persist_content  # noqa: E402
from pipeline.results.keys import result_key  # noqa: E402
from pipeline.results.reading import (  # noqa: E402
    candidate_size,
    content_is_empty,
    is_candidate_content,
)
from pipeline.testing import MemoryStore, QuietLogger  # noqa: E402
from pipeline.transcript.replay import replay_messages  # noqa: E402
from pipeline.wire.harness import last_result_index, split_tail, with_tail  # noqa: E402
from stages import ToolResultBudget, default_stages  # noqa: E402

DEFAULT_CORPUS = Path(os.environ.get("SLUICEGATE_CORPUS", REPO.parent / "shared" / "corpus"))
LIMIT = 200_000


# --------------------------------------------------------------------------------------------
# The baseline: the reference algorithm, rescanning everything every turn
# --------------------------------------------------------------------------------------------


class FullRescanBudget:
    """docs/behaviour.md §2 done the straightforward way: the whole history, every turn.

    Group (§2.1), classify against the ledger (§2.3: a result known by its ledger key, its id
    and the digest of its output, the harness tail of a record's last result split off),
    decide groups with fresh results (§2.4: never-persist tools, the per-tool gate, the
    largest-first walk), persist, then rebuild the message list with every replacement mapped
    in (the tail put back). No spans, no logs: the bare algorithm.
    """

    def __init__(self, limit: float, policies: ToolPolicies, store: Any) -> None:
        self.limit = limit
        self.policies = policies
        self.store = store

    async def __call__(self, messages: list[Message], state: ReplacementState) -> list[Message]:
        # a candidate: (tool_use_id, tool name, output, size, persistable, ledger key)
        groups: list[list[tuple[str, str | None, Any, int, bool, str]]] = []
        current: list[tuple[str, str | None, Any, int, bool, str]] = []
        names: dict[str, str] = {}
        response_ids: set[str] = set()
        apply: dict[str, str] = {}  # ledger key -> replacement
        empty: dict[str, str] = {}  # tool_use_id -> placeholder of its last blank result
        # (message index, block index) -> (key or None for a blank result, id, tail, is last)
        slots: dict[tuple[int, int], tuple[str | None, str, Any, bool]] = {}
        for i, m in enumerate(messages):
            if m.type == "assistant":
                if m.message_id is None or m.message_id not in response_ids:
                    if current:
                        groups.append(current)
                        current = []
                    if m.message_id is not None:
                        response_ids.add(m.message_id)
                if isinstance(m.content, list):
                    for b in m.content:
                        if b.get("type") == "tool_use":
                            names[b["id"]] = b.get("name") or ""
            elif m.type == "user" and isinstance(m.content, list):
                last = last_result_index(m.content)
                for j, b in enumerate(m.content):
                    if b.get("type") != "tool_result":
                        continue
                    tid, content = b["tool_use_id"], b.get("content")
                    core, tail = split_tail(content) if j == last else (content, None)
                    if content_is_empty(core):
                        empty[tid] = empty_result_text(names.get(tid))
                        slots[i, j] = (None, tid, tail, j == last)
                    elif is_candidate_content(core):
                        key = result_key(tid, core)
                        size = candidate_size(core)
                        current.append((tid, names.get(tid), core, size, is_persistable(core), key))
                        slots[i, j] = (key, tid, tail, j == last)
        if current:
            groups.append(current)

        for group in groups:
            frozen = 0
            fresh = []
            fresh_keys: set[str] = set()
            for c in group:
                key = c[5]
                if key in state.replacements:
                    apply[key] = state.replacements[key]
                elif key in state.seen_ids:
                    frozen += c[3]
                elif key not in fresh_keys:  # the same result twice: decided once
                    fresh.append(c)
                    fresh_keys.add(key)
            if not fresh:
                continue
            eligible = []
            for c in fresh:
                threshold = self.policies.threshold(c[1])
                if math.isinf(threshold):
                    state.seen_ids.add(c[5])
                elif c[4] and c[3] > threshold:
                    await self._persist(c, state, apply)
                else:
                    eligible.append(c)
            remaining = frozen + sum(c[3] for c in eligible)
            for c in sorted(eligible, key=lambda c: c[3], reverse=True):
                if remaining <= self.limit:
                    break
                if c[4]:
                    await self._persist(c, state, apply)
                    remaining -= c[3]
            for c in eligible:
                state.seen_ids.add(c[5])

        out = []
        for i, m in enumerate(messages):
            if m.type == "user" and isinstance(m.content, list):
                blocks = list(m.content)
                changed = False
                for j, b in enumerate(m.content):
                    slot = slots.get((i, j))
                    if slot is None:
                        continue
                    slot_key, tid, tail, last = slot
                    text = empty.get(tid) if slot_key is None else apply.get(slot_key)
                    if text is None:
                        continue
                    new = with_tail(text, tail) if last else text
                    if b.get("content") != new:
                        blocks[j] = {**b, "content": new}
                        changed = True
                if changed:
                    m = m.with_content(blocks)
            out.append(m)
        return out

    async def _persist(self, c: Any, state: ReplacementState, apply: dict[str, str]) -> None:
        persisted = await persist_content(self.store, c[0], c[2])
        state.record_replacement(c[5], persisted.replacement)
        apply[c[5]] = persisted.replacement


# --------------------------------------------------------------------------------------------
# A synthetic agent history
# --------------------------------------------------------------------------------------------

TOOLS = ("Bash", "Read", "Grep", "Glob", "Edit", "WebFetch", "Task")


class HistoryGen:
    """Turns of a coding agent: a response with 1-4 parallel tool calls (one record per block,
    as Claude Code streams), progress records, results of realistic sizes (mostly a few KB, some
    tens of KB, a few over the per-tool limit, and now and then a parallel batch over the
    per-message budget), and now and then a user prompt."""

    def __init__(self, seed: int = 7) -> None:
        self.rnd = random.Random(seed)
        self.turns = 0
        self.tokens = 20_000
        # shared text objects: the pipeline never copies tool output, neither should the fixture
        self.pool = {
            n: "".join(f"line {i:05d} " + "x" * 60 + "\n" for i in range(n // 72 + 1))[:n]
            for n in (300, 1_200, 4_000, 9_000, 24_000, 45_000, 60_000, 120_000)
        }

    def size(self) -> int:
        r = self.rnd.random()
        if r < 0.55:
            return self.rnd.choice((300, 1_200, 4_000))
        if r < 0.85:
            return 9_000
        if r < 0.97:
            return self.rnd.choice((24_000, 45_000))
        return self.rnd.choice((60_000, 120_000))

    def turn(self, sent_tokens: int | None = None) -> list[Message]:
        """One turn. ``sent_tokens``: the size of the request that produced this response, as a
        live session's usage reports it (else the context grows unmanaged)."""
        t = self.turns
        self.turns += 1
        rid = f"msg_{t:06d}"
        out: list[Message] = []
        if self.rnd.random() < 0.1:
            out.append(Message.user(f"next step {t}"))
        n = self.rnd.choice((1, 1, 2, 3, 4))
        big_batch = self.rnd.random() < 0.05  # parallel results that exceed 200K together
        ids = [f"toolu_{t:06d}_{k}" for k in range(n)]
        self.tokens += 800
        read = self.tokens if sent_tokens is None else max(0, sent_tokens - 3)
        usage = Usage(input_tokens=3, cache_read_input_tokens=read, output_tokens=200)
        model = "claude-sonnet-4-5"
        out.append(
            Message.assistant(
                [{"type": "text", "text": f"step {t}"}], message_id=rid, usage=usage, model=model
            )
        )
        for tid in ids:
            tool = self.rnd.choice(TOOLS)
            block = {"type": "tool_use", "id": tid, "name": tool, "input": {"arg": t}}
            out.append(Message.assistant([block], message_id=rid, usage=usage, model=model))
        for tid in ids:
            for _ in range(self.rnd.choice((0, 1, 1, 2))):
                out.append(Message(type="progress"))
            size = 45_000 if big_batch else self.size()
            self.tokens += size // 3
            text = self.pool[size]
            out.append(Message.user([{"type": "tool_result", "tool_use_id": tid, "content": text}]))
        return out


def history_with_turns(n_messages: int, extra_turns: int) -> tuple[list[Message], list[int]]:
    """Messages for ``n_messages`` and then ``extra_turns`` turns; the cut points of each
    (recorded usage, unmanaged: for the budget stage, which does not read it)."""
    gen = HistoryGen()
    messages: list[Message] = []
    while len(messages) < n_messages:
        messages += gen.turn()
    cuts = [len(messages)]
    for _ in range(extra_turns):
        messages += gen.turn()
        cuts.append(len(messages))
    return messages, cuts


# --------------------------------------------------------------------------------------------
# 1. Per-turn overhead
# --------------------------------------------------------------------------------------------


class Timed:
    """Wraps a stage to time it, keeping its name (stage state is keyed by it)."""

    def __init__(self, inner: Any, times: dict[str, list[float]]) -> None:
        self.inner = inner
        self.name = inner.name
        self.may_break_cache = getattr(inner, "may_break_cache", False)
        self.readonly_input = getattr(inner, "readonly_input", False)  # a copy costs O(n)
        self.times = times

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        start = time.perf_counter()
        try:
            return await self.inner(messages, ctx)
        finally:
            self.times.setdefault(self.name, []).append(time.perf_counter() - start)


def _ctx(name: str, root: str, store: Any = None) -> SessionContext:
    return SessionContext(
        name,
        root,
        store=store or MemoryStore(),
        tool_policies=ToolPolicies.claude_code(),
        logger=QuietLogger(keep=False),
    )


async def steady_state(
    step: Callable[[list[Message]], Awaitable[Any]], messages: list[Message], cuts: list[int]
) -> list[float]:
    """Warm up on the first cut, then time one pass per appended turn."""
    await step(messages[: cuts[0]])
    times = []
    for cut in cuts[1:]:
        view = messages[:cut]  # the agent's list, one turn longer (same message objects)
        start = time.perf_counter()
        await step(view)
        times.append(time.perf_counter() - start)
    return times


async def live_session(
    sizes: list[int], runs: int, tmp: str
) -> tuple[list[Message], dict[int, Checkpoint]]:
    """A session grown turn by turn through the default pipeline, each response's usage the
    size of the request the pipeline sent (as a live API reports it), so the stages act as they
    would live: the budget persists, history snip removes rounds whenever the context nears the
    window, microcompact clears. At each size, the decision state is kept and the next
    ``runs`` passes are timed (by stage) -- the incremental pipeline in steady state."""
    gen = HistoryGen()
    messages: list[Message] = []
    stage_times: dict[str, list[float]] = {}
    ctx = _ctx("live", tmp)
    pipe = Pipeline([Timed(s, stage_times) for s in default_stages()])
    sent: int | None = None
    checkpoints: dict[int, Checkpoint] = {}
    for n in sorted(sizes):
        while len(messages) < n:
            messages += gen.turn(sent)
            await pipe.run(messages, ctx)
            sent = ctx.report.estimated_tokens
        cp = Checkpoint(len(messages), list(ctx.stage_records), ctx.replacement_state.copy())
        stage_times.clear()
        for _ in range(runs):
            messages += gen.turn(sent)
            start = time.perf_counter()
            await pipe.run(messages, ctx)
            cp.times.append(time.perf_counter() - start)
            sent = ctx.report.estimated_tokens
            cp.cuts.append(len(messages))
        cp.by_stage = {k: list(v) for k, v in stage_times.items()}
        checkpoints[n] = cp
    return messages, checkpoints


@dataclass
class Checkpoint:
    """The live session at one size: its decisions so far, and the timed passes after it."""

    length: int
    records: list[Any]
    ledger: ReplacementState
    cuts: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    by_stage: dict[str, list[float]] = field(default_factory=dict)


async def bench_turn(sizes: list[int], runs: int) -> None:
    print(f"\n== 1. per-turn cost in steady state (median of {runs} turns, ms) ==")
    with tempfile.TemporaryDirectory(prefix="bench-turn-") as tmp:
        messages, checkpoints = await live_session(sizes, runs, tmp)
        print(
            f"{'messages':>9} {'rescan':>8} {'default':>8} {'ratio':>6}   "
            f"{'budget:':<7}{'rescan':>8} {'stage':>7} {'ratio':>6} {'to_api':>7}   "
            "default pipeline by stage"
        )
        for n in sorted(sizes):
            await _bench_turn_size(n, checkpoints[n], messages, tmp)
    print(
        "rescan: the same five stages with incremental=False (every pass re-derives everything"
        " from the whole history), resumed from the live session's decisions at that size;"
        "\ndefault: Pipeline(default_stages()) in the live session (its usage = what it sent)."
        "\nbudget: FullRescanBudget (this file, docs/behaviour.md §2 the straightforward way) vs"
        " ToolResultBudget, bare stage calls. to_api: what an agent does next."
        "\nby stage: the default pipeline's stages; run = the rest of Pipeline.run (spans,"
        " token estimates)."
    )


async def _bench_turn_size(n: int, cp: Checkpoint, messages: list[Message], tmp: str) -> None:
    cuts = [cp.length, *cp.cuts]

    # the full-rescan pipeline, from the same decisions, on the same inputs
    ctx_r = _ctx(f"rescan-{n}", tmp)
    ctx_r.stage_records = list(cp.records)
    ctx_r.replacement_state = cp.ledger.copy()
    pipe_r = Pipeline(default_stages(incremental=False))
    t_rescan = await steady_state(lambda v: pipe_r.run(v, ctx_r), messages, cuts)

    # the budget stage alone, bare, against the straightforward implementation
    policies = ToolPolicies.claude_code()
    ref_state = cp.ledger.copy()
    reference = FullRescanBudget(LIMIT, policies, MemoryStore())
    t_ref = await steady_state(lambda v: reference(v, ref_state), messages, cuts)
    ctx_b = _ctx(f"budget-{n}", tmp)
    ctx_b.replacement_state = cp.ledger.copy()
    budget = ToolResultBudget(LIMIT)

    async def budget_call(v: list[Message]) -> list[Message]:
        ctx_b.begin_pass()
        return await budget(v, ctx_b)

    t_budget = await steady_state(budget_call, messages, cuts)
    t_api = [_time(lambda v=messages[:c]: to_api(v)) for c in cuts[1:]]

    def ms(x: list[float]) -> float:
        return statistics.median(x) * 1e3

    by = {k: ms(v) for k, v in cp.by_stage.items()}
    rest = [t - sum(v[k] for v in cp.by_stage.values()) for k, t in enumerate(cp.times)]
    by_stage = " ".join(f"{k.split('_')[0][:7]}={v:.2f}" for k, v in by.items())
    by_stage += f" run={ms(rest):.2f}"
    r, d, fr, b = ms(t_rescan), ms(cp.times), ms(t_ref), ms(t_budget)
    print(
        f"{n:>9,} {r:>8.2f} {d:>8.2f} {r / d:>5.1f}x   {'':<7}{fr:>8.2f} {b:>7.3f} "
        f"{fr / b:>5.0f}x {ms(t_api):>7.2f}   {by_stage}"
    )


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --------------------------------------------------------------------------------------------
# 2. Corpus replay vs parsing
# --------------------------------------------------------------------------------------------


def corpus_files(corpus: Path) -> list[Path]:
    return sorted(corpus.glob("claude-code_*/**/*.jsonl")) if corpus.is_dir() else []


async def replay_file(
    path: Path,
    root: str,
    transcript: Any = None,
    stage_times: dict[str, list[float]] | None = None,
    copies: list[int] | None = None,
) -> int:
    """Load (unless given) and replay one session as the CLI does, minus the printing.

    ``stage_times``: time each stage into it. ``copies``: append, per call, how many tool_result
    texts the request holds as equal copies rather than the loaded objects themselves.
    """
    t = transcript if transcript is not None else load_transcript(path, strict=False)
    ctx = SessionContext(
        t.session_id or "replay",
        root,
        tool_policies=ToolPolicies.claude_code(),
        logger=QuietLogger(keep=False),
    )
    stages_ = default_stages()
    if stage_times is not None:
        stages_ = [Timed(s, stage_times) for s in stages_]
    originals = _tool_results(t.messages) if copies is not None else {}
    calls = 0
    # as the CLI replays: each request read before the next
    async for result in replay_messages(t.messages, Pipeline(stages_), ctx, shared=True):
        calls += 1
        result.request_chars  # noqa: B018 - the CLI computes it for every call
        if copies is not None:
            sent = _tool_results(result.request)
            copies.append(
                sum(
                    1
                    for tid, c in sent.items()
                    if tid in originals and c is not originals[tid] and c == originals[tid]
                )
            )
    return calls


def _tool_results(messages: Sequence[Any]) -> dict[str, Any]:
    """tool_use_id -> content object, from messages or request params."""
    out: dict[str, Any] = {}
    for m in messages:
        content = m.content if isinstance(m, Message) else m["content"]
        if isinstance(content, list):
            for b in content:
                if isinstance(b, dict) and b.get("type") == "tool_result":
                    out[b["tool_use_id"]] = b.get("content")
    return out


def bench_replay(corpus: Path, runs: int) -> None:
    files = corpus_files(corpus)
    print(f"\n== 2. corpus replay vs parsing (median of {runs}; s) ==")
    if not files:
        print(f"skipped: no corpus at {corpus}")
        return
    size = sum(p.stat().st_size for p in files)
    t_load, t_replay = [], []
    calls = 0
    for _ in range(runs):
        start = time.perf_counter()
        for p in files:
            load_transcript(p, strict=False)
        t_load.append(time.perf_counter() - start)
        with tempfile.TemporaryDirectory(prefix="bench-replay-") as root:
            start = time.perf_counter()
            calls = sum(anyio.run(replay_file, p, root) for p in files)
            t_replay.append(time.perf_counter() - start)
    lo, re_ = statistics.median(t_load), statistics.median(t_replay)
    # each run's parse and replay are timed back to back: their ratio cancels the machine's
    # drift between runs, which the two medians alone do not
    ratios = sorted(r / p for p, r in zip(t_load, t_replay, strict=True))
    print(f"{len(files)} sessions, {size / 1e6:.1f} MB, {calls:,} calls")
    print(f"parse only      {lo:8.2f} s   ({size / 1e6 / lo:.1f} MB/s)")
    print(
        f"parse + replay  {re_:8.2f} s   = {statistics.median(ratios):.2f}x parsing "
        f"(median of the runs' ratios; {ratios[0]:.2f}-{ratios[-1]:.2f})   "
        f"({calls / (re_ - lo):,.0f} calls/s of replay)"
    )
    # where the replay's time goes (one more run, instrumented)
    from pipeline.wire.cache import WireCache

    stage_times: dict[str, list[float]] = {}
    wire_times: list[float] = []
    real_to_api = WireCache.to_api

    def timed_to_api(self: WireCache, messages: Sequence[Message], **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real_to_api(self, messages, **kwargs)
        finally:
            wire_times.append(time.perf_counter() - start)

    WireCache.to_api = timed_to_api  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory(prefix="bench-replay-") as root:
            start = time.perf_counter()
            for p in files:
                anyio.run(replay_file, p, root, None, stage_times)
            total = time.perf_counter() - start
    finally:
        WireCache.to_api = real_to_api  # type: ignore[method-assign]
    parts = {k: sum(v) for k, v in stage_times.items()}
    parts["to_api"] = sum(wire_times)
    parts["load+rest"] = total - sum(parts.values())
    print(
        "   where it goes: "
        + ", ".join(f"{k} {v:.2f} s ({v / total:.0%})" for k, v in parts.items())
    )
    print("   (to_api: the request, built incrementally with its request_chars; rest: loading,")
    print("   the replay loop, token estimates and observations)")


# --------------------------------------------------------------------------------------------
# 3. Memory
# --------------------------------------------------------------------------------------------

_RSS_SCRIPT = """
import sys, resource, anyio
sys.path.insert(0, {repo!r}); sys.path.insert(0, {here!r})
import bench_pipeline as b
from pipeline import load_transcript
for p in {paths!r}:
    if {mode!r} != "imports":
        t = load_transcript(p, strict=False)
        if {mode!r} == "replay":
            anyio.run(b.replay_file, p, {root!r}, t)
        del t
try:  # this process's peak RSS in KiB (ru_maxrss would include the parent's: Linux keeps it
    # across exec)
    print(next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM")))
except (OSError, StopIteration):
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def bench_memory(corpus: Path, top: int) -> None:
    files = sorted(corpus_files(corpus), key=lambda p: -p.stat().st_size)[:top]
    print(f"\n== 3. replay memory, the {top} largest sessions ==")
    if not files:
        print(f"skipped: no corpus at {corpus}")
        return
    print(
        f"{'session':<26} {'file MB':>8} {'load+replay peak':>17} {'x file':>7} "
        f"{'replay alone':>13} {'x file':>7} {'text copies':>12}"
    )
    for p in files:
        size = p.stat().st_size
        with tempfile.TemporaryDirectory(prefix="bench-mem-") as root:
            tracemalloc.start()
            t = load_transcript(p, strict=False)
            loaded, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            anyio.run(replay_file, p, root, t)
            _, replay_peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            copies: list[int] = []  # not traced: the check itself holds every request
            anyio.run(replay_file, p, root, t, None, copies)
        print(
            f"{p.name[:26]:<26} {size / 1e6:8.2f} {replay_peak / 1e6:14.1f} MB "
            f"{replay_peak / size:6.2f}x {(replay_peak - loaded) / 1e6:10.1f} MB "
            f"{(replay_peak - loaded) / size:6.2f}x {sum(copies):>12}"
        )
    # as the OS sees it: max RSS of a process that only imports, loads, or loads and replays
    here = str(Path(__file__).resolve().parent)
    rss = {}
    with tempfile.TemporaryDirectory(prefix="bench-rss-") as root:
        for mode in ("imports", "load", "replay"):
            code = _RSS_SCRIPT.format(
                repo=str(REPO), here=here, paths=[str(p) for p in files], mode=mode, root=root
            )
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            )
            rss[mode] = int(out.stdout.strip().splitlines()[-1]) * 1024  # Linux: KiB
    largest = files[0].stat().st_size
    print(
        f"max RSS: imports {rss['imports'] / 1e6:.1f} MB, + loading {rss['load'] / 1e6:.1f} MB,"
        f" + replaying {rss['replay'] / 1e6:.1f} MB -> replay above loading "
        f"{(rss['replay'] - rss['load']) / 1e6:.1f} MB, above the imports "
        f"{(rss['replay'] - rss['imports']) / largest:.2f}x the largest file "
        f"({largest / 1e6:.1f} MB; sessions one after another)"
    )
    print(
        "x file = traced Python memory / transcript bytes; 'replay alone' = peak during the "
        "replay minus what the loaded transcript holds;\ntext copies = tool_result texts sent "
        "as equal copies instead of the loaded string objects (summed over every call)."
    )


# --------------------------------------------------------------------------------------------
# 4. Concurrent sessions
# --------------------------------------------------------------------------------------------


async def bench_sessions(n_sessions: int, turns: int) -> None:
    print(f"\n== 4. {n_sessions:,} concurrent sessions in one process, {turns} turns each ==")
    small = "ok\n" * 100
    big = "z" * 60_000  # over the 50,000 cap: persisted to the session's store
    pipe = Pipeline(default_stages())
    with tempfile.TemporaryDirectory(prefix="bench-sessions-") as root:
        done = 0
        persisted = 0

        async def session(i: int) -> None:
            nonlocal done, persisted
            ctx = SessionContext(f"s{i:05d}", root, logger=QuietLogger(keep=False))
            history: list[Message] = [Message.user(f"task {i}")]
            for t in range(turns):
                rid = f"r{i}_{t}"
                ids = [f"toolu_{i}_{t}_{k}" for k in range(2)]
                usage = Usage(input_tokens=100 + 50 * t, output_tokens=20)
                history.append(
                    Message.assistant(
                        [{"type": "tool_use", "id": x, "name": "Bash", "input": {}} for x in ids],
                        message_id=rid,
                        usage=usage,
                        model="claude-sonnet-4-5",
                    )
                )
                for k, x in enumerate(ids):
                    text = big if (i % 5 == 0 and t == 1 and k == 0) else small
                    history.append(
                        Message.user([{"type": "tool_result", "tool_use_id": x, "content": text}])
                    )
                projected = await pipe.run(history, ctx)
                to_api(projected)
                persisted += len(ctx.report.persisted)
                done += 1
                await anyio.sleep(0)  # let the other sessions interleave

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(n_sessions):
                tg.start_soon(session, i)
        elapsed = time.perf_counter() - start
    print(
        f"{done:,} turns in {elapsed:.2f} s = {done / elapsed:,.0f} turns/s "
        f"({persisted} results persisted to real files, fsync'd)"
    )


# --------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,5000,20000")
    parser.add_argument("--runs", type=int, default=7, help="turns timed per size in (1)")
    parser.add_argument("--replay-runs", type=int, default=5)
    parser.add_argument("--only", default="turn,replay,memory,sessions")
    parser.add_argument("--sessions", type=int, default=1_000)
    parser.add_argument("--session-turns", type=int, default=4)
    parser.add_argument("--memory-top", type=int, default=3)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    args = parser.parse_args()
    only = set(args.only.split(","))
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    if "turn" in only:
        anyio.run(bench_turn, [int(s) for s in args.sizes.split(",")], args.runs)
    if "replay" in only:
        bench_replay(args.corpus, args.replay_runs)
    if "memory" in only:
        bench_memory(args.corpus, args.memory_top)
    if "sessions" in only:
        anyio.run(bench_sessions, args.sessions, args.session_turns)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
