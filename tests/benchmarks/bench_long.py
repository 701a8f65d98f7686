"""Long sessions: is the cost per call flat with history? Replay, live loop, memory, dumps.

    python tests/benchmarks/bench_long.py [--calls 500,1000,2000,4000,8000] [--naive-max 4000]
        [--only replay,live,memory,dumps] [--live-messages 20000] [--reps 3]

Not a test: it prints figures, each side by side with a baseline measured in the same run.

1. ``replay``: generated sessions (``long_session.py``: 1-3 parallel calls, results of 100 to
   45,000 chars) of each size replayed in a fresh process, as the CLI does: the default
   pipeline, the budget stage alone, and the naive reference -- the budget done the
   straightforward way (``FullRescanBudget``: the whole history every call) plus a plain
   ``to_api`` per call, up to ``--naive-max`` calls. CPU time of the replay (load excluded; GC
   included), median of ``--reps`` (the naive one: one run); per call; the fitted growth
   exponent (time ~ calls^k) over the sizes.
2. ``live``: a session grown the way ``Agent.turn`` grows one -- every turn the default
   pipeline, the request built (``WireCache.to_api``) and its pairing checked, each response's
   usage what was sent -- to ``--live-messages``. CPU per turn (GC included), mean, median and
   p99 by range of history length, then the quiet turns and the turns in which a stage freed
   tokens (a clear, a snip) apart; against the same request built the plain way (``to_api`` +
   ``check_pairing`` over the whole request) at the end.
3. ``memory``: peak RSS of ``python -m pipeline replay FILE --json`` on the 4,000-call session
   above an idle CLI (a 1-call session), as a multiple of the transcript's size; what loading
   alone takes, every output kept and with the long ones left in the file until the replay
   reads them (as the command loads); whether any tool-result text was copied (equal strings
   that are not the loaded objects) in any request; and where the memory goes, traced
   (``traced_memory.py``, replayed as the command replays: loading, the request, rewritten
   records, the components' state, the outputs read back).
4. ``dumps``: ``--dump-requests`` on the 500-call session: the whole array re-serialised per
   call (as before) against fragments, against deltas; CPU and bytes written.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import anyio  # noqa: E402

from pipeline import (  # noqa: E402
    Message,
    Pipeline,
    ReplacementState,
    SessionContext,
    ToolPolicies,
    load_transcript,
    to_api,
)
from pipeline.kept_list import KeptList  # noqa: E402
from pipeline.testing import MemoryStore, QuietLogger  # noqa: E402
from pipeline.transcript.deferred import DEFER_AT  # noqa: E402
from pipeline.transcript.replay import find_calls, replay_messages  # noqa: E402
from pipeline.wire.cache import WireCache, request_chars  # noqa: E402
from pipeline.wire.caching import place_cache_breakpoint  # noqa: E402
from pipeline.wire.pairing import check_pairing  # noqa: E402
from stages import ToolResultBudget, default_stages  # noqa: E402
from tests.benchmarks.bench_pipeline import FullRescanBudget, HistoryGen  # noqa: E402
from tests.benchmarks.long_session import write as write_session  # noqa: E402

CACHE = Path(tempfile.gettempdir()) / "sluicegate-bench-long"


def session_file(calls: int) -> Path:
    """The generated session of ``calls`` calls (written once, kept between runs)."""
    CACHE.mkdir(exist_ok=True)
    path = CACHE / f"long-{calls}.jsonl"
    if not path.exists():
        write_session(path, calls)
    return path


def _ctx(name: str, root: str) -> SessionContext:
    return SessionContext(
        name,
        root,
        store=MemoryStore(),
        tool_policies=ToolPolicies.claude_code(),
        logger=QuietLogger(keep=False),
    )


# --------------------------------------------------------------------------------------------
# 1. Replay growth (each run in its own process)
# --------------------------------------------------------------------------------------------


async def _replay(messages: list[Message], config: str, root: str) -> int:
    ctx = _ctx("bench", root)
    if config == "naive":
        rescan = FullRescanBudget(200_000, ctx.tool_policies, ctx.store)
        state = ReplacementState()
        chars = 0
        for call in find_calls(messages):
            out = await rescan(messages[: call.index], state)
            chars += request_chars(to_api(out))
        return chars
    pipe = Pipeline(default_stages() if config == "default" else [ToolResultBudget()])
    chars = 0
    async for result in replay_messages(messages, pipe, ctx, shared=True):
        chars += result.request_chars
    return chars


def replay_child(path: Path, config: str) -> None:
    """In a child process: load, replay, print the CPU seconds of the replay as JSON."""
    messages = load_transcript(path).messages
    gc.collect()
    gc.freeze()  # as the CLI does after loading
    before = [s["collections"] for s in gc.get_stats()]
    cpu, wall = time.process_time(), time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        anyio.run(_replay, messages, config, root)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    after = [s["collections"] for s in gc.get_stats()]
    print(
        json.dumps(
            {"cpu": cpu, "wall": wall, "gc": [a - b for a, b in zip(after, before, strict=True)]}
        )
    )


def _run_child(*args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, check=True
    )
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of log(y) against log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum(
        (a - mx) ** 2 for a in lx
    )


def bench_replay(sizes: list[int], naive_max: int, reps: int) -> None:
    print(f"== 1. replay of generated sessions (CPU s, median of {reps}; load excluded) ==")
    head = (
        f"{'calls':>6} {'records':>8} {'MB':>6}  {'default':>9} {'ms/call':>8}  "
        f"{'budget':>8} {'ms/call':>8}  {'naive':>9}  {'naive/def':>9} {'naive/bud':>9}"
    )
    print(head)
    rows: dict[str, list[float]] = {"default": [], "budget": []}
    for n in sizes:
        path = session_file(n)
        records = sum(1 for _ in path.open("rb"))
        cpu: dict[str, float | None] = {}
        for config in ("default", "budget", "naive"):
            if config == "naive" and n > naive_max:
                cpu[config] = None
                continue
            times = 1 if config == "naive" else reps  # the baseline: one run is enough
            runs = [_run_child("_replay", str(path), config)["cpu"] for _ in range(times)]
            cpu[config] = statistics.median(runs)
        d, b, nv = cpu["default"], cpu["budget"], cpu["naive"]
        assert d is not None and b is not None
        rows["default"].append(d)
        rows["budget"].append(b)
        naive = f"{nv:9.2f}" if nv is not None else f"{'-':>9}"
        rd = f"{nv / d:8.1f}x" if nv is not None else f"{'-':>9}"
        rb = f"{nv / b:8.1f}x" if nv is not None else f"{'-':>9}"
        print(
            f"{n:>6,} {records:>8,} {path.stat().st_size / 1e6:6.1f}  {d:9.2f} {d / n * 1e3:8.2f}"
            f"  {b:8.2f} {b / n * 1e3:8.2f}  {naive}  {rd} {rb}",
            flush=True,
        )
    if len(sizes) > 1:
        for config, ys in rows.items():
            k = fit_exponent(sizes, ys)
            local = ", ".join(
                f"{sizes[i]}->{sizes[i + 1]}: {fit_exponent(sizes[i : i + 2], ys[i : i + 2]):.2f}"
                for i in range(len(sizes) - 1)
            )
            print(f"growth {config:>7}: time ~ calls^{k:.2f}   (local: {local})")
    print(
        "default: Pipeline(default_stages()) through replay_messages, as the CLI replays "
        "(trackers observing, the request built and counted);\nbudget: the budget stage alone, "
        "the same way; naive: FullRescanBudget on the whole history + to_api, every call."
    )


# --------------------------------------------------------------------------------------------
# 2. The live loop
# --------------------------------------------------------------------------------------------


RANGES = ((0, 2_000), (2_000, 5_000), (5_000, 10_000), (10_000, 15_000), (15_000, 10**9))


async def _live(target: int) -> None:
    gen = HistoryGen()
    history: list[Message] = KeptList()  # as the agent keeps its history
    ctx = _ctx("live", tempfile.mkdtemp(prefix="sluicegate-live-"))
    pipe = Pipeline(default_stages())
    wire = WireCache()
    sent: int | None = None
    per_turn: list[tuple[int, float]] = []
    acting: list[bool] = []  # a stage freed tokens (a clear or a snip) in that turn
    projected: list[Message] = []
    while len(history) < target:
        history += gen.turn(sent)
        start = time.process_time()
        # as Agent.turn: the stages' own list, held across the API call (copied only if
        # another pass overlaps it), the request cache's own list, the pairing check, the
        # prompt-cache breakpoint (the next request restores the message it replaced)
        projected = await pipe.run(history, ctx, shared=True)
        held = ctx.hold(projected)
        request = wire.to_api(projected, shared=True)
        wire.ensure_paired()
        marked = place_cache_breakpoint(request)
        if marked is not None:
            wire.replaced(marked)
        held.release()
        per_turn.append((len(history), time.process_time() - start))
        acting.append(ctx.report.tokens_freed > 0)
        sent = ctx.report.estimated_tokens
    print(f"{'messages':>16} {'turns':>6} {'mean ms':>8} {'median':>7} {'p99':>7} {'max':>7}")
    for lo, hi in RANGES:
        times = sorted(t * 1e3 for n, t in per_turn if lo <= n < hi)
        if not times:
            continue
        p99 = times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)]
        label = f"{lo:,}-{min(hi, len(history)):,}"
        print(
            f"{label:>16} {len(times):>6} {statistics.fmean(times):8.2f} "
            f"{statistics.median(times):7.2f} {p99:7.2f} {times[-1]:7.2f}"
        )
    every = sorted(t * 1e3 for _, t in per_turn)
    p99_all = every[min(len(every) - 1, math.ceil(0.99 * len(every)) - 1)]
    print(
        f"{'all':>16} {len(every):>6} {statistics.fmean(every):8.2f} "
        f"{statistics.median(every):7.2f} {p99_all:7.2f} {every[-1]:7.2f}"
    )
    print(f"{'':>16} {'quiet turns: mean':>18} {'median':>7} {'freeing turns':>14} {'mean':>6}")
    for lo, hi in RANGES:
        rows = [(t * 1e3, a) for (n, t), a in zip(per_turn, acting, strict=True) if lo <= n < hi]
        quiet = [t for t, a in rows if not a]
        acted = [t for t, a in rows if a]
        if not quiet:
            continue
        label = f"{lo:,}-{min(hi, len(history)):,}"
        acted_mean = f"{statistics.fmean(acted):6.2f}" if acted else "     -"
        print(
            f"{label:>16} {statistics.fmean(quiet):18.2f} {statistics.median(quiet):7.2f} "
            f"{len(acted):>14} {acted_mean}"
        )
    # flat with history: per-turn means over bins of 1,000 messages, fitted as c * messages^k
    # (k = 0 is flat; the replay's growth target, total ~ calls^1.15, is k <= 0.15 per call)
    bins: dict[int, list[float]] = {}
    for n, t in per_turn:
        if n >= 1_000:
            bins.setdefault(n // 1_000, []).append(t)
    mids = [k * 1_000 + 500 for k in sorted(bins)]
    means = [statistics.fmean(bins[k]) for k in sorted(bins)]
    if len(mids) > 1:
        print(
            f"per-turn mean ~ messages^k over {mids[0]:,}-{mids[-1]:,} messages: "
            f"k = {fit_exponent(mids, means):.3f}"
        )
    last = sorted(t * 1e3 for n, t in per_turn[-50:])
    plain = []
    for _ in range(10):
        start = time.process_time()
        check_pairing(to_api(projected))
        plain.append((time.process_time() - start) * 1e3)
    print(
        f"at {len(history):,} messages: a turn costs {statistics.fmean(last):.2f} ms (mean of the "
        f"last 50, GC included); building and checking the request the plain way alone "
        f"(to_api + check_pairing) costs {statistics.fmean(plain):.2f} ms "
        f"= {statistics.fmean(plain) / statistics.fmean(last):.0f}x a whole turn"
    )


def bench_live(target: int) -> None:
    print(
        f"== 2. the live loop to {target:,} messages: pipeline + request + pairing check per turn "
        "(CPU ms, GC included) =="
    )
    anyio.run(_live, target)


# --------------------------------------------------------------------------------------------
# 3. Memory
# --------------------------------------------------------------------------------------------


_PEAK_OF_CHILD = """
import json, os, resource, subprocess, sys
with open(os.devnull, "w") as sink:
    subprocess.run([sys.executable, "-m", "pipeline", *sys.argv[1:]], stdout=sink, check=True)
print(json.dumps({"rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def cli_peak_rss(*cli: str) -> int:
    """The peak RSS (KiB) of ``python -m pipeline *cli``, run under a bare interpreter
    (``-S``, a few MB): a process started by a larger one inherits that one's peak (Linux keeps
    the high-water mark across exec), which would raise a small command's figure."""
    proc = subprocess.run(
        [sys.executable, "-S", "-c", _PEAK_OF_CHILD, *cli],
        capture_output=True,
        text=True,
        check=True,
    )
    rss: int = json.loads(proc.stdout)["rss"]
    return rss


_LOAD = """
import json, os, resource, sys
import pipeline.transcript.replay, pipeline.transcript.read as t
page = os.sysconf("SC_PAGE_SIZE") // 1024
with open("/proc/self/statm") as f:
    before = int(f.read().split()[1]) * page
t.load_transcript(sys.argv[1], defer_texts=int(sys.argv[2]) or None)
print(json.dumps({"before": before, "after": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def load_rss_child(path: Path, defer: int) -> None:
    """Print what loading ``path`` adds to a fresh process (KiB): its resident size once the
    imports are done, and its peak after loading. A new interpreter for it: a process started
    by a large one inherits that one's peak (Linux keeps the high-water mark across exec), so
    only the resident size before loading is measured directly (Linux: ``/proc``)."""
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD, str(path), str(defer)],
        capture_output=True,
        text=True,
        check=True,
    )
    print(proc.stdout.strip())


async def _copied_texts(path: Path) -> tuple[int, int]:
    """(tool outputs sent as equal copies of the loaded strings, tool outputs sent) over a
    replay (replacements and placeholders the stages made are not the loaded output)."""
    messages = load_transcript(path).messages
    texts = [
        b["content"]
        for m in messages
        if m.type == "user" and isinstance(m.content, list)
        for b in m.content
        if isinstance(b, dict) and isinstance(b.get("content"), str)
    ]
    loaded, values = {id(t) for t in texts}, set(texts)
    copies = sent = 0
    with tempfile.TemporaryDirectory() as root:
        async for r in replay_messages(messages, Pipeline(default_stages()), _ctx("m", root)):
            for param in r.request:
                content = param["content"]
                for b in content if isinstance(content, list) else ():
                    text = b.get("content") if isinstance(b, dict) else None
                    if isinstance(text, str) and text in values:  # loaded output, not a stage's
                        sent += 1
                        copies += id(text) not in loaded
    return copies, sent


def bench_memory(calls: int) -> None:
    print(f"== 3. memory: CLI replay of the {calls:,}-call session ==")
    path = session_file(calls)
    idle = session_file(1)
    with tempfile.TemporaryDirectory() as root:
        base = cli_peak_rss("replay", str(idle), "--json", "--store", root)
        peak = cli_peak_rss("replay", str(path), "--json", "--store", root)
    size = path.stat().st_size
    grown = (peak - base) * 1024
    print(
        f"peak RSS {peak / 1024:.1f} MiB, idle CLI {base / 1024:.1f} MiB: the replay adds "
        f"{grown / 2**20:.1f} MiB = {grown / size:.2f}x the transcript ({size / 1e6:.1f} MB)"
    )
    load = _run_child("_load_rss", str(path), "0")
    whole = (load["after"] - load["before"]) * 1024
    load = _run_child("_load_rss", str(path), str(DEFER_AT))
    loaded = (load["after"] - load["before"]) * 1024
    print(
        f"loading the transcript alone, every output kept: {whole / 2**20:.1f} MiB = "
        f"{whole / size:.2f}x; as the command loads it (outputs of {DEFER_AT:,} characters "
        f"and more left in the file): {loaded / 2**20:.1f} MiB = {loaded / size:.2f}x; the "
        f"replay (stage caches, token estimates, the request cache, the outputs read back) "
        f"the rest: {(grown - loaded) / size:.2f}x"
    )
    copies, sent = anyio.run(_copied_texts, path)
    print(f"tool-result texts sent: {sent:,}; sent as copies of the loaded strings: {copies}")
    traced = json.loads(
        subprocess.run(
            [sys.executable, str(Path(__file__).with_name("traced_memory.py")), str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    labels = {
        "request": "the request (params, pairing index)",
        "rewritten": "records the stages rewrote",
        "state": "the components' state",
        "replay": "the replay's bookkeeping",
        "read back": "outputs read back",
        "other": "other",
    }
    print(
        f"traced at the replay's last calls: loading {traced['loading'] / 2**20:.1f} MiB "
        f"({traced['loading'] / size:.2f}x); the replay added "
        + ", ".join(
            f"{label} {traced.get(k, 0) / 2**20:.1f} MiB ({traced.get(k, 0) / size:.2f}x)"
            for k, label in labels.items()
        )
    )
    left = 1.5 * size - loaded - traced.get("request", 0) - traced.get("rewritten", 0)
    kept, records = traced.get("state", 0) + traced.get("replay", 0), traced["records"]
    print(
        f"1.5x the transcript, less loading (RSS) and what the calls send, leaves "
        f"{left / 2**20:.1f} MiB ({left / records:.0f} bytes a record) for the state and the "
        f"bookkeeping, which take {kept / 2**20:.1f} MiB ({kept / records:.0f} bytes a record)"
    )


# --------------------------------------------------------------------------------------------
# 4. Dumps
# --------------------------------------------------------------------------------------------


def bench_dumps(calls: int) -> None:
    from pipeline._cli.dumps import RequestDumper

    print(f"== 4. --dump-requests on the {calls:,}-call session (CPU s, bytes written) ==")
    messages = load_transcript(session_file(calls)).messages

    async def requests() -> list[list[Any]]:
        with tempfile.TemporaryDirectory() as root:
            pipe = Pipeline(default_stages())
            return [r.request async for r in replay_messages(messages, pipe, _ctx("d", root))]

    sent = anyio.run(requests)
    with tempfile.TemporaryDirectory() as out:
        rows = []
        start = time.process_time()
        total = 0
        for n, request in enumerate(sent):  # the whole array, every call (as before)
            data = json.dumps(request, ensure_ascii=False, indent=2).encode("utf-8")
            (Path(out) / f"w{n:04d}.json").write_bytes(data)
            total += len(data)
        rows.append(("whole array per call", time.process_time() - start, total))
        for fmt in ("full", "delta"):
            target = Path(out) / fmt
            target.mkdir()
            dumper = RequestDumper(target, format=fmt)  # type: ignore[arg-type]
            start = time.process_time()
            for n, request in enumerate(sent):
                dumper.dump(n, request)
            cpu = time.process_time() - start
            rows.append((f"fragments, {fmt}", cpu, sum(p.stat().st_size for p in target.iterdir())))
    base_cpu = rows[0][1]
    for label, cpu, size in rows:
        print(f"{label:>22}: {cpu:7.2f} s ({base_cpu / cpu:5.1f}x)   {size / 1e6:9.1f} MB")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_load_rss":
        load_rss_child(Path(sys.argv[2]), int(sys.argv[3]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_replay":
        replay_child(Path(sys.argv[2]), sys.argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", default="500,1000,2000,4000,8000")
    parser.add_argument("--naive-max", type=int, default=4_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", default="replay,live,memory,dumps")
    parser.add_argument("--live-messages", type=int, default=20_000)
    parser.add_argument("--memory-calls", type=int, default=4_000)
    parser.add_argument("--dump-calls", type=int, default=500)
    args = parser.parse_args()
    only = set(args.only.split(","))
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    if "replay" in only:
        bench_replay([int(x) for x in args.calls.split(",")], args.naive_max, args.reps)
    if "live" in only:
        bench_live(args.live_messages)
    if "memory" in only:
        bench_memory(args.memory_calls)
    if "dumps" in only:
        bench_dumps(args.dump_calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
